"""`hf-aoq export SRC OUT --format gguf` and `hf-aoq convert FILE.gguf OUT`: an hf_aoq checkpoint
folder <-> one GGUF file (llama.cpp, transformers' gguf_file=...), tensor by tensor through
hf_aoq.convert.gguf, names and metadata through gguf_meta. docs/gguf.md has the mapping.

Both build everything in memory first: a tensor that cannot go exactly is an error naming it, and
OUT is untouched. The file is written under a hidden name and renamed; a folder OUT (model.gguf
and its card) is staged beside OUT and swapped in whole.
"""
from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path

import torch

from ..core.errors import AOQError
from ..core.tensor import AOQTensor
from . import gguf as codec
from .gguf_file import KV, STRING, UINT32, read_gguf, type_name, write_gguf
from .gguf_meta import (HF_CONFIG_KEY, MetadataError, architecture_metadata, config_from_metadata, gguf_name,
                        hf_name, permuted_heads, tokenizer_metadata)

GGUF_NAME = "model.gguf"
# general.file_type: the "mostly" type llama.cpp names a file by.
_FILE_TYPES = {0: 0, 1: 1, 2: 2, 3: 3, 8: 7, 30: 32}
_DESCRIBE = {2: "Q4_0 (int4 symmetric, groups of 32)", 3: "Q4_1 (int4 asymmetric, groups of 32)",
             8: "Q8_0 (int8, groups of 32, fp16 scales)"}


def _workflow():
    from ..workflows import export as wf  # the folder plumbing (_check_out, Summary, ExportError) lives there

    return wf


def gguf_target(out: Path) -> tuple[Path, Path | None]:
    """(the .gguf file to write, the folder around it or None when OUT names the file itself)."""
    return (out, None) if out.suffix == ".gguf" else (out / GGUF_NAME, out)


def export_gguf(src: Path, out: Path, config: dict, state: dict, *, requantize: bool, overwrite: bool):
    """See `hf_aoq.workflows.export_checkpoint`; `state` is the checkpoint's state dict."""
    from .. import model_card

    wf = _workflow()
    file, folder = gguf_target(out)
    if out.exists() and not overwrite:
        raise wf.ExportError(f"{out} already exists; choose a new path or pass --overwrite")
    if folder is None and out.is_dir() or folder is not None and out.exists() and not out.is_dir():
        raise wf.ExportError(f"{out}: a {'folder' if out.is_dir() else 'file'} is there; give a .gguf path or a folder")
    plain_config = {k: v for k, v in config.items() if k != "quantization_config"}
    try:
        meta = architecture_metadata(plain_config, str(src / wf.CONFIG_NAME), wf._base_model(src) or src.name)
    except MetadataError as e:
        raise wf.ExportError(f"{e}; nothing was written at {out}") from None
    summary = wf.Summary(str(src), str(file), "gguf")
    tied = bool(plain_config.get("tie_word_embeddings"))
    tensors, kinds = [], {}
    for name, t in wf.progress(state.items(), total=len(state), desc="export", unit="tensor"):
        if tied and name == "lm_head.weight":
            continue  # llama.cpp (and transformers' GGUF loader) use token_embd when there is no output
        target = gguf_name(name)
        if target is None:
            raise wf.ExportError(f"{name}: llama.cpp's llama architecture has no tensor for it; nothing was written "
                                 f"at {out}")
        heads = permuted_heads(name, plain_config)
        if heads is not None:
            t = codec.permute_rows(t, codec.llama_rows(t.shape[0], heads, to_gguf=True))
        try:
            ggml_type, raw = codec.export_tensor(t)
        except codec.NotExact as e:
            if not requantize:
                raise wf.ExportError(f"{name} ({type(t).__name__}) cannot go to gguf exactly: {e}. Nothing was "
                                     f"written at {out}; --requantize re-quantizes such weights into the nearest "
                                     f"GGUF type (lossy)") from None
            new, what = codec.nearest_exportable(t, name)
            summary.requantized.append(f"{name}: {e}; {what}")
            t = new if new is not None else t.dequantize()
            ggml_type, raw = codec.export_tensor(t)
        tensors.append((target, ggml_type, tuple(t.shape), raw))
        kinds[ggml_type] = kinds.get(ggml_type, 0) + 1
        if ggml_type in _DESCRIBE:
            summary.groups[_DESCRIBE[ggml_type]] = summary.groups.get(_DESCRIBE[ggml_type], 0) + 1
        else:
            summary.plain += 1
    if not summary.groups:
        raise wf.ExportError(f"{src}: no quantized weight to export")
    quantized = {k: n for k, n in kinds.items() if k in _DESCRIBE}
    meta["general.file_type"] = KV(UINT32, _FILE_TYPES[max(quantized, key=quantized.get)])
    tok, why = tokenizer_metadata(src, plain_config, int(plain_config["vocab_size"]))
    meta.update(tok)
    if why:
        summary.notes.append(f"no tokenizer in the GGUF file ({why}); transformers loads the weights, llama.cpp "
                             f"needs a tokenizer")
    meta[HF_CONFIG_KEY] = KV(STRING, json.dumps(plain_config, sort_keys=True))
    if folder is None:
        file.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(file, meta, tensors)
        summary.notes.append("OUT is a file, so no model card was written (give a folder for model.gguf + README.md)")
        return summary
    from ..serialization import replace_folder

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.{secrets.token_hex(6)}.tmp"
    staging.mkdir()
    try:
        write_gguf(staging / GGUF_NAME, meta, tensors)
        model_card.write_export_card(staging, format="gguf", base_model=wf._base_model(src), groups=summary.groups,
                                     requantized=summary.requantized, load_name=str(out))
        replace_folder(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return summary


def _recipe_config(t: AOQTensor, ggml_type: int):
    from ..configs import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    if isinstance(t, codec.Int4Tensor):
        return Int4WeightOnlyConfig(group_size=t.group_size, symmetric=t.zero is None)
    return Int8WeightOnlyConfig(group_size=t.block_size[1], scale_dtype=torch.float16 if ggml_type == 8 else None)


def convert_gguf(src, out, *, overwrite: bool = False, max_shard_size: int):
    """Convert the GGUF file `src` into an hf_aoq checkpoint folder at `out` (docs/gguf.md):
    Q4_0, Q4_1, Q8_0 exactly, Q4_K and Q6_K into the nearest hf_aoq types (exact where the
    summary says so), float tensors as they are."""
    from .. import model_card
    from ..configs import FqnToConfig
    from ..integrations.transformers import AOQConfig
    from ..serialization import replace_folder, save_shards, write_atomic

    wf = _workflow()
    src, out = Path(src), Path(out)
    if out.exists() and not overwrite:
        raise wf.ExportError(f"{out} already exists; choose a new folder or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise wf.ExportError(f"{out} is a file; give a folder")
    try:
        g = read_gguf(src)
        config = config_from_metadata(g.metadata, "output.weight" in g.tensors, str(src))
    except AOQError as e:
        raise wf.ExportError(f"{e}; nothing was written at {out}") from None
    dtype = wf._DTYPES.get(config.get("dtype") or config.get("torch_dtype"), torch.bfloat16)
    summary = wf.Summary(str(src), str(out), "hf_aoq")
    state, recipe, inexact = {}, {}, []
    for gname, gt in wf.progress(g.tensors.items(), total=len(g.tensors), desc="convert", unit="tensor"):
        name = hf_name(gname)
        if name is None:
            raise wf.ExportError(f"{src}: tensor {gname!r} has no transformers name in the llama architecture; "
                                 f"nothing was written at {out}")
        try:
            t, exact = codec.import_tensor(gname, gt.ggml_type, gt.data, gt.shape, dtype, str(src))
        except AOQError as e:
            raise wf.ExportError(f"{e}; nothing was written at {out}") from None
        heads = permuted_heads(name, config)
        if heads is not None:
            t = codec.permute_rows(t, codec.llama_rows(t.shape[0], heads, to_gguf=False))
        if not isinstance(t, AOQTensor):
            if t.dtype != dtype and torch.equal(t.to(dtype).to(t.dtype), t):
                t = t.to(dtype)  # F32 norms of a bf16 model (what export writes) go back to bf16
            state[name] = t
            summary.plain += 1
            continue
        state[name] = t
        recipe[name] = _recipe_config(t, gt.ggml_type)
        what = f"{type_name(gt.ggml_type)} -> {type(t).__name__} {recipe[name].to_dict()['type']}" \
               f"(group {t.block_size[1]})"
        summary.groups[what] = summary.groups.get(what, 0) + 1
        if not exact:
            inexact.append(name)
    if not recipe:
        raise wf.ExportError(f"{src}: no quantized tensor (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) to convert")
    if inexact:
        summary.notes.append(f"{len(inexact)} tensors differ from GGUF's dequantization by float32 rounding (a "
                             f"Q4_1 / Q4_K block's zero, m + 8 d or 8 d sc - dmin mn, does not fit float32), "
                             f"first {inexact[0]}")
    embeddings = any(n.startswith(("model.embed_tokens.", "lm_head.")) for n in recipe)
    config = dict(config, quantization_config=AOQConfig(FqnToConfig(recipe),
                                                        include_input_output_embeddings=embeddings).to_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.{secrets.token_hex(6)}.tmp"
    staging.mkdir()
    try:
        save_shards(state, staging, max_shard_size)
        write_atomic(staging / wf.CONFIG_NAME, json.dumps(config, indent=2) + "\n")
        summary.copied = _tokenizer(src, staging, summary)
        model_card.write_model_card(staging, base_model=str(g.metadata.get("general.name") or src.name),
                                    load_name=str(out))
        replace_folder(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return summary


def _tokenizer(src: Path, staging: Path, summary) -> list[str]:
    """The tokenizer files transformers makes from the GGUF's tokenizer.ggml.* keys (its GGUF
    tokenizer conversion), or a note saying why there are none."""
    before = set(p.name for p in staging.iterdir())
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(staging)
    except Exception as e:  # noqa: BLE001 - the weights convert without a tokenizer
        summary.notes.append(f"no tokenizer written (transformers could not build one from the GGUF file: "
                             f"{type(e).__name__}: {str(e)[:120]})")
        return []
    return sorted(set(p.name for p in staging.iterdir()) - before)
