"""Export an hf_aoq checkpoint folder to compressed-tensors (what vLLM, SGLang and transformers'
compressed-tensors integration load) or GGUF (llama.cpp; hf_aoq.convert.gguf_checkpoint), and
`convert` another library's checkpoint to hf_aoq, detecting its kind (torchao, compressed-tensors
from config.json; a .gguf file). What `hf-aoq export` and `hf-aoq convert` run.

Both build the whole result in memory (tensors view the mapped source files) before writing
anything: a weight that cannot go exactly is an ExportError naming it, and OUT is untouched. The
folder is written under a hidden name beside OUT and swapped in whole (`replace_folder`).
"""
from __future__ import annotations

import json
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..convert import compressed_tensors as ct
from ..core.errors import AOQError, FormatError
from ..core.tensor import AOQTensor
from .common import UsageError, progress

CONFIG_NAME = "config.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3
FORMATS = ("compressed-tensors", "gguf")
# Never copied from SRC: the weights and config are written anew, the card is made for OUT,
# and pickled files are not carried along.
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".pkl", ".ckpt")
_SKIP_NAMES = {CONFIG_NAME, "model.safetensors.index.json", "README.md"}


class ExportError(UsageError):
    """A checkpoint that cannot be exported or converted as asked (nothing was written)."""


@dataclass
class Summary:
    src: str
    out: str
    format: str
    groups: dict[str, int] = field(default_factory=dict)  # what each weight became -> count
    plain: int = 0
    requantized: list[str] = field(default_factory=list)  # "name: what was done"
    copied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def format_text(self) -> str:
        lines = [f"{self.src} -> {self.out} ({self.format})"]
        lines += [f"  {n:5d} x {what}" for what, n in sorted(self.groups.items())]
        lines.append(f"  {self.plain:5d} plain tensors copied unchanged")
        if self.requantized:
            lines.append(f"  {len(self.requantized)} weights were NOT exact and were re-quantized (--requantize):")
            lines += [f"    {r}" for r in self.requantized]
        if self.copied:
            lines.append(f"  files copied: {', '.join(self.copied)}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# Layers vLLM fuses into one (q/k/v, gate/up): their shards must share one scheme there.
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _fused_mismatches(schemes: dict[str, object]) -> list[str]:
    out = []
    for parts in _FUSED:
        parents = {m.rpartition(".")[0] for m in schemes if m.rpartition(".")[2] in parts}
        for parent in sorted(parents):
            got = {p: schemes.get(f"{parent}.{p}") for p in parts if f"{parent}.{p}" in schemes}
            if len(set(map(id, got.values()))) > 1 or len(got) not in (0, len(parts)):
                out.append(f"{parent}: {', '.join(parts)} have different schemes (or some stay in float); vLLM "
                           f"fuses them into one layer and refuses that")
    return out


# ---------------------------------------------------------------------- shared folder plumbing
def _read_config(src: Path) -> dict:
    from ..serialization.common import read_json_file

    path = src / CONFIG_NAME
    if not src.is_dir():
        raise ExportError(f"{src}: not a folder")
    if not path.is_file():
        raise ExportError(f"{src}: no {CONFIG_NAME}; give a checkpoint folder")
    return read_json_file(path, ExportError)


def _quant_method(config: dict) -> str | None:
    qc = config.get("quantization_config")
    return qc.get("quant_method") if isinstance(qc, dict) else None


def _check_out(src: Path, out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise ExportError(f"{out} already exists; choose a new folder or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file; give a folder")
    if out.resolve() == src.resolve():
        raise ExportError(f"{out}: the output must differ from the source")


def _write_folder(src: Path, out: Path, state: dict, config: dict, max_shard_size: int, card) -> list[str]:
    """Write OUT whole: the weights (sharded above `max_shard_size`), config.json, the card
    (`card(staging)` writes it) and SRC's other files (tokenizer, generation config...)."""
    from ..serialization import replace_folder, save_shards, write_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.{secrets.token_hex(6)}.tmp"
    staging.mkdir()
    copied = []
    try:
        save_shards(state, staging, max_shard_size)
        write_atomic(staging / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
        for p in sorted(src.iterdir()):
            if p.is_file() and p.name not in _SKIP_NAMES and p.suffix not in _SKIP_SUFFIXES:
                shutil.copy2(p, staging / p.name)
                copied.append(p.name)
        card(staging)
        replace_folder(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return copied


def _linear_modules(config: dict) -> set[str] | None:
    """The names of the nn.Linear modules of the model config.json describes (built on the meta
    device, no weights), or None when transformers cannot build it."""
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    try:
        cfg = AutoConfig.for_model(**plain)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception:  # an architecture transformers does not ship: every 2-D weight is a linear one
        return None
    return {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _base_model(src: Path) -> str | None:
    card = src / "README.md"
    if not card.is_file():
        return None
    try:
        from huggingface_hub import ModelCard

        return ModelCard.load(card).data.get("base_model")
    except Exception:  # a card that does not parse names no base model
        return None


# ---------------------------------------------------------------------- export
def export_checkpoint(src, out, *, format: str = "compressed-tensors", requantize: bool = False,
                      overwrite: bool = False, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> Summary:
    """Export the hf_aoq checkpoint folder `src` to `out` in `format` (docs/compressed_tensors.md).
    Every weight goes bit-exactly or the export is refused (ExportError naming the first weight
    and why; nothing written), unless `requantize`, which re-quantizes such weights from their
    dequantized values into the nearest form that goes (or keeps them in float), lists them in
    the summary and records them in the model card."""
    from .. import model_card
    from ..serialization import open_checkpoint

    if format not in FORMATS:
        raise ExportError(f"--format {format}: not one of {', '.join(FORMATS)}")
    src, out = Path(src), Path(out)
    config = _read_config(src)
    if _quant_method(config) != "aoq":
        raise ExportError(f"{src}: quantization_config.quant_method is {_quant_method(config)!r}, not 'aoq'; "
                          f"export takes a checkpoint written by hf_aoq")
    if format != "gguf":
        _check_out(src, out, overwrite)
    elif out.resolve() == src.resolve():
        raise ExportError(f"{out}: the output must differ from the source")
    try:
        state = open_checkpoint(src).state_dict()
    except AOQError as e:
        raise ExportError(f"{src} does not load: {e}") from None
    if format == "gguf":
        from ..convert.gguf_checkpoint import export_gguf

        return export_gguf(src, out, config, state, requantize=requantize, overwrite=overwrite)
    linear = _linear_modules(config)
    summary = Summary(str(src), str(out), format)
    groups: dict[ct.Scheme, list[str]] = {}
    result: dict[str, torch.Tensor] = {}
    kept_float: list[str] = []
    for name, t in progress(state.items(), total=len(state), desc="export", unit="tensor"):
        if not isinstance(t, AOQTensor):
            result[name] = t
            summary.plain += 1
            continue
        module = name.removesuffix(".weight")
        is_linear = module != name and (linear is None or module in linear)
        try:
            if not is_linear:
                raise ct.NotExact("not the weight of a linear layer (compressed-tensors quantizes linear layers)")
            scheme, stored = ct.export_tensor(t)
        except ct.NotExact as e:
            if not requantize:
                raise ExportError(f"{name} ({type(t).__name__}) cannot go to {format} exactly: {e}. Nothing was "
                                  f"written at {out}; --requantize re-quantizes such weights into the nearest "
                                  f"form (lossy)") from None
            new, what = ct.nearest_exportable(t, name) if is_linear else (None, "kept in float (dequantized)")
            summary.requantized.append(f"{name}: {e}; {what}")
            if new is None:
                result[name] = t.dequantize()
                kept_float.append(module)
                summary.plain += 1
                continue
            scheme, stored = ct.export_tensor(new)
        groups.setdefault(scheme, []).append(module)
        result.update({f"{module}.{suffix}": v for suffix, v in stored.items()})
        summary.groups[scheme.describe()] = summary.groups.get(scheme.describe(), 0) + 1
    if not groups:
        raise ExportError(f"{src}: no quantized weight to export")
    quantized = {m for ms in groups.values() for m in ms}
    summary.notes += _fused_mismatches({m: scheme for scheme, ms in groups.items() for m in ms})
    if linear is None:  # every plain 2-D weight is taken for a linear layer's
        linear = quantized | {n.removesuffix(".weight") for n, t in result.items()
                              if n.endswith(".weight") and t.ndim == 2}
    ignore = sorted((linear - quantized) | set(kept_float))
    config = dict(config, quantization_config=ct.quantization_config(groups, ignore))
    base = _base_model(src)

    def card(folder: Path) -> None:
        model_card.write_export_card(folder, format=format, base_model=base, groups=summary.groups,
                                     requantized=summary.requantized, load_name=str(out))

    summary.copied = _write_folder(src, out, result, config, max_shard_size, card)
    return summary


# ---------------------------------------------------------------------- convert (to hf_aoq)
def convert_checkpoint(src, out, *, overwrite: bool = False, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE):
    """Convert the checkpoint folder `src` to hf_aoq at `out`, by the quant_method in its
    config.json: "torchao" (hf_aoq.convert.convert_torchao_checkpoint), "compressed-tensors" or
    "mxfp4" (transformers' Mxfp4, gpt-oss: hf_aoq.convert.mxfp4);
    or the GGUF file `src` (hf_aoq.convert.gguf_checkpoint, docs/gguf.md). Returns a summary
    with `format_text()` (or `format()` for torchao's)."""
    src = Path(src)
    if src.suffix == ".gguf" or src.is_file():
        from ..convert.gguf_checkpoint import convert_gguf

        return convert_gguf(src, out, overwrite=overwrite, max_shard_size=max_shard_size)
    method = _quant_method(_read_config(src))
    if method == "torchao":
        from ..convert.torchao import TorchaoConversionError, convert_torchao_checkpoint

        try:
            return convert_torchao_checkpoint(src, out, overwrite=overwrite, max_shard_size=max_shard_size)
        except TorchaoConversionError as e:
            raise ExportError(f"{e} (nothing was written)") from e
    if method == ct.QUANT_METHOD:
        return convert_compressed_tensors(src, out, overwrite=overwrite, max_shard_size=max_shard_size)
    if method == "mxfp4":  # transformers' Mxfp4 (gpt-oss): hf_aoq.convert.mxfp4
        from ..convert.mxfp4 import convert_mxfp4_checkpoint

        return convert_mxfp4_checkpoint(src, out, overwrite=overwrite, max_shard_size=max_shard_size)
    hint = "; it is already an hf_aoq checkpoint" if method == "aoq" else ""
    raise ExportError(f"{src}: quantization_config.quant_method is {method!r}; convert takes torchao, "
                      f"compressed-tensors or transformers' mxfp4 checkpoints, or a .gguf file{hint}")


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _groups_of(qc: dict, where: str) -> list[tuple[list[str], ct.Scheme | None, str]]:
    for key, why in (("kv_cache_scheme", "a quantized KV cache"), ("sparsity_config", "sparse weights"),
                     ("transform_config", "weight transforms (rotations)")):
        if qc.get(key):
            raise ExportError(f"{where}: {key} ({why}) has no hf_aoq equivalent")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise ExportError(f"{where}: quantization_status {qc.get('quantization_status')!r}: only compressed "
                          f"checkpoints hold quantized weights")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ExportError(f"{where}: no config_groups")
    out = []
    for gname, group in groups.items():
        targets = group.get("targets") if isinstance(group, dict) else None
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise ExportError(f"{where}.config_groups.{gname}.targets: expected a list of names")
        try:
            scheme, problem = ct.parse_scheme(group, qc.get("format"), f"{where}.config_groups.{gname}"), ""
        except FormatError as e:  # only an error if a stored weight uses it
            scheme, problem = None, str(e)
        out.append((targets, scheme, problem))
    return out


def _scheme_for(module: str, groups, ignore: list[str]):
    if any(ct.targets_match(module, i) and i != "Linear" for i in ignore):
        return None, "listed in ignore"
    for rank in (lambda t: t == module, lambda t: t.startswith("re:"), lambda t: t == "Linear"):
        for targets, scheme, problem in groups:
            if any(rank(t) and ct.targets_match(module, t) for t in targets):
                return scheme, problem
    return None, "matched by no config group"


def _recipe_config(t: AOQTensor):
    from ..configs import (Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig,
                           Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig)
    from ..core.granularity import PerRow, PerTensor
    from ..tensors import Float8Tensor, Int4Tensor

    if isinstance(t, Int4Tensor):
        return Int4WeightOnlyConfig(group_size=t.group_size, symmetric=t.zero is None)
    if isinstance(t, Float8Tensor):
        gran = PerTensor() if tuple(t.block_size) == tuple(t.shape) else PerRow()
        if t.act_quant:
            return Float8DynamicActivationFloat8WeightConfig(granularity=gran)
        return Float8WeightOnlyConfig(granularity=gran)
    if t.act_quant:
        return Int8DynamicActivationInt8WeightConfig()
    return Int8WeightOnlyConfig(group_size=None if t.block_size[1] == t.shape[1] else t.block_size[1])


def convert_compressed_tensors(src, out, *, overwrite: bool = False,
                               max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> Summary:
    """Convert the compressed-tensors checkpoint folder `src` into an hf_aoq checkpoint at
    `out`, exactly (docs/compressed_tensors.md); ExportError naming the first module whose
    scheme or tensors hf_aoq has no type for, with nothing written."""
    from .. import model_card
    from ..configs import FqnToConfig
    from ..integrations.transformers import AOQConfig
    from ..serialization import open_checkpoint

    src, out = Path(src), Path(out)
    config = _read_config(src)
    qc = config.get("quantization_config")
    where = f"{src / CONFIG_NAME}: quantization_config"
    if _quant_method(config) != ct.QUANT_METHOD:
        raise ExportError(f"{where}.quant_method is {_quant_method(config)!r}, not {ct.QUANT_METHOD!r}")
    groups = _groups_of(qc, where)
    ignore = [i for i in (qc.get("ignore") or []) if isinstance(i, str)]
    _check_out(src, out, overwrite)
    dtype = _DTYPES.get(config.get("dtype") or config.get("torch_dtype"), torch.bfloat16)
    try:
        stored = open_checkpoint(src).tensors()
    except AOQError as e:
        raise ExportError(f"{src} does not load: {e}") from None
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key in stored:
        module, _, suffix = key.rpartition(".")
        if suffix in ("weight_packed", "weight_scale"):
            by_module.setdefault(module, {})
    state, recipe = {}, {}
    summary = Summary(str(src), str(out), "hf_aoq")
    for key, t in stored.items():
        module, _, suffix = key.rpartition(".")
        if module in by_module and suffix.startswith(("weight", "input_", "output_")):
            by_module[module][suffix] = t
        else:
            state[key] = t
            summary.plain += 1
    for module, tensors in progress(by_module.items(), total=len(by_module), desc="convert", unit="layer"):
        scheme, problem = _scheme_for(module, groups, ignore)
        if scheme is None:
            raise ExportError(f"{module}: stores quantized tensors but {problem or 'its group is not supported'}; "
                              f"nothing was written at {out}")
        try:
            t = ct.import_tensor(module, scheme, tensors, dtype)
            type(t).check_fields(t.fields())
        except AOQError as e:
            raise ExportError(f"{e}; nothing was written at {out}") from None
        state[f"{module}.weight"] = t
        recipe[f"{module}.weight"] = _recipe_config(t)
        summary.groups[f"{scheme.describe()} -> {type(t).__name__}"] = \
            summary.groups.get(f"{scheme.describe()} -> {type(t).__name__}", 0) + 1
    if not recipe:
        raise ExportError(f"{src}: no quantized weight found (no *.weight_scale tensors)")
    config = dict(config, quantization_config=AOQConfig(FqnToConfig(recipe)).to_dict())

    def card(folder: Path) -> None:
        model_card.write_model_card(folder, base_model=_base_model(src) or str(src), load_name=str(out))

    summary.copied = _write_folder(src, out, state, config, max_shard_size, card)
    return summary
