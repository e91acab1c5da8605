"""Quantize a checkpoint while loading it and save it, with its tokenizer and model card (what
`hf-aoq quantize` and scripts/quantize_and_push.py run).

The new checkpoint is built in a hidden folder beside OUT and swapped in only once it is
complete and loads back: an overwrite replaces every file of the old checkpoint (none of its
shards can survive next to the new ones), and a failure leaves the old checkpoint as it was.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import AOQError, FormatError
from .common import UsageError, check_model_source, log, parse_size, progress
from .hub import PushTarget, check_push_target, push_failed, push_folder

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "auto": "auto"}


def load_recipe(path):
    """A recipe file: an FqnToConfig (or a single config) as JSON, in the form AOQConfig writes
    to config.json (hf_aoq.configs.recipe_to_dict)."""
    from ..configs import recipe_from_dict

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read the recipe file {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UsageError(f"{path} is not valid JSON ({e}); a recipe file holds hf_aoq.configs.recipe_to_dict output") from None
    try:
        return recipe_from_dict(data, where=str(path))
    except FormatError as e:
        raise UsageError(f"{e} (write the file with hf_aoq.configs.recipe_to_dict)") from None


def build_aoq_config(scheme=None, group_size=None, recipe=None, skip=None, calibration=None, calibration_tokens=2048,
                     calibration_method="gptq", *, bits=None, candidates=None, gptq_order=None, refine=0):
    """The AOQConfig for `hf-aoq quantize`: `scheme` (+ `group_size`, which changes only that
    scheme's group size, never its type) is the config of every linear layer the recipe does
    not name; a `recipe` (FqnToConfig, or a path to its JSON) comes first; `skip` names modules
    to leave in float; `calibration` is a text file for GPTQ (plain int4), for the static
    activation scales of fp8-static (which needs it), or for `calibration_method` "awq" (int4 and
    Int4DQ) or "smoothquant" (int8-dyn). `bits` asks for mixed precision at that average (among
    `candidates`, comma-separated scheme names), measured on `calibration`; it replaces `scheme`
    and `recipe`. `gptq_order` ("act", the default, or "sequential": left to right) is the column
    order of GPTQ on `calibration` (AOQConfig.gptq_order). `refine` (with `bits`): rounds of
    in-context refinement of the choice (AOQConfig.refine_rounds)."""
    if refine and bits is None:
        raise UsageError("--refine refines a mixed-precision choice: give --bits too")
    if gptq_order is not None:
        if calibration is None or calibration_method != "gptq":
            raise UsageError("--gptq-order is the column order of GPTQ: it needs --calibration FILE (and "
                             "--calibration-method gptq, the default)")
        if bits is not None or candidates is not None:
            raise UsageError("--gptq-order does not apply to --bits: each candidate names its own order "
                             "(+gptq: left to right, +gptq-act: act order)")
    if bits is not None or candidates is not None:
        return _mixed_precision_config(bits, candidates, scheme, recipe, skip, calibration, calibration_tokens, refine)
    from ..configs import FqnToConfig, config_for_scheme
    from ..integrations.transformers import AOQConfig

    if scheme == "int4" and group_size not in (None, 32, 64):
        raise UsageError(f"--scheme int4 (Int4DQ) takes --group-size 32 or 64; for plain int4 in groups of "
                         f"{group_size} use --scheme int4-plain --group-size {group_size}")
    try:
        default = None if scheme is None else config_for_scheme(scheme, group_size)
    except AOQError as e:
        raise UsageError(str(e)) from None
    if scheme == "fp8-static" and calibration is None:
        raise UsageError("--scheme fp8-static needs --calibration FILE (a text file): its activation scales are "
                         "chosen on that text")
    if scheme is None and group_size is not None:
        raise UsageError("--group-size needs --scheme int4, int4-plain or int8")
    if isinstance(recipe, (str, os.PathLike)):
        recipe = load_recipe(recipe)
    if recipe is None and default is None:
        raise UsageError("say what to do: --scheme int4|int4-plain|int8|int8-dyn|fp8|fp8-dyn, or --recipe FILE.json")
    if recipe is None:
        quant_type = default
    elif default is None:
        quant_type = recipe
    elif isinstance(recipe, FqnToConfig) and "_default" not in recipe.mapping:
        quant_type = FqnToConfig({**recipe.mapping, "_default": default})
    else:
        raise UsageError("the recipe already has a default (_default, or a single config) and --scheme gives another; drop one")
    if calibration is not None and not Path(calibration).is_file():
        raise UsageError(f"--calibration {calibration}: no such text file")
    try:
        return AOQConfig(quant_type, modules_to_not_convert=list(skip) if skip else None,
                         calibration=calibration, calibration_tokens=calibration_tokens,
                         calibration_method=calibration_method, gptq_order=gptq_order or "act")
    except AOQError as e:
        raise UsageError(str(e)) from None


def _mixed_precision_config(bits, candidates, scheme, recipe, skip, calibration, calibration_tokens, refine=0):
    from ..integrations.transformers import AOQConfig

    if bits is None:
        raise UsageError("--schemes lists the schemes --bits chooses among; give --bits too")
    if scheme is not None or recipe is not None:
        raise UsageError("--bits chooses the scheme of every layer (among --schemes); drop --scheme/--recipe")
    if calibration is None:
        raise UsageError("--bits needs --calibration FILE: a text to measure each layer's sensitivity on")
    if not Path(calibration).is_file():
        raise UsageError(f"--calibration {calibration}: no such text file")
    names = None if candidates is None else [c.strip() for c in candidates.split(",") if c.strip()]
    try:
        return AOQConfig(None, modules_to_not_convert=list(skip) if skip else None, calibration=calibration,
                         calibration_tokens=calibration_tokens, target_bits_per_weight=bits, candidates=names,
                         refine_rounds=refine or 0)
    except AOQError as e:
        raise UsageError(str(e)) from None


@dataclass
class LoadOptions:
    """How to load the float model: what from_pretrained takes besides the quantization config."""

    dtype: str = "bfloat16"
    device_map: Any = None  # "auto", "cpu", "cuda:0", ... (None: transformers' default, CPU)
    revision: str | None = None
    trust_remote_code: bool = False
    token: str | None = None

    def kwargs(self) -> dict[str, Any]:
        import torch

        dtype = DTYPES.get(self.dtype, self.dtype)
        if dtype != "auto":
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise UsageError(f"--dtype {self.dtype}: not a dtype; give one of {', '.join(DTYPES)}")
            dtype = getattr(torch, dtype)
        out = {"dtype": dtype, "revision": self.revision, "trust_remote_code": self.trust_remote_code,
               "token": self.token}
        if self.device_map is not None:
            out["device_map"] = self.device_map
        return out


@dataclass
class QuantizeResult:
    out: Path
    seconds: float  # quantize-while-loading time
    info: Any  # hf_aoq.checkpoint.CheckpointInfo of the saved checkpoint
    quality: dict[str, str] = field(default_factory=dict)
    url: str | None = None  # the push's commit (or pull request) URL


def _local_float_checkpoint(model: str, revision: str | None) -> Path | None:
    """Where the float weights of `model` are on this machine (its folder, or the Hub cache)."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not cached as a full snapshot: no quality figures, nothing else lost
        return None


def check_out_folder(out: Path, overwrite: bool, option: str = "--out") -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"{option} {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UsageError(f"{option} {out} already has files; pass --overwrite to replace the checkpoint in it, or "
                         f"pick another folder")


def measure_quality(info, source: Path) -> dict[str, str]:
    """Weight SQNR of every quantized tensor against the float weights in `source`, one
    progress step per tensor."""
    import dataclasses

    from ..checkpoint import quality_summary, weight_errors

    class _Stepping(dict):  # weight_errors walks info.built.items(); each step moves the bar
        def items(self):
            return progress(super().items(), total=len(self), desc="Measuring weight error", unit="tensor")

    return quality_summary(weight_errors(dataclasses.replace(info, built=_Stepping(info.built)), source))


def quantize_checkpoint(model: str, config, out, *, load: LoadOptions | None = None, overwrite: bool = False,
                        push: PushTarget | str | None = None, measure: bool = True,
                        max_shard_size: int | str | None = None, card_base_model: str | None = None,
                        dtype: str | None = None, push_to_hub: str | None = None) -> QuantizeResult:
    """Quantize `model` (a folder or Hub id) while loading it, save it to `out` with its
    tokenizer and model card, measure the weight error when the float weights are local, and
    push the folder to the Hub when `push` (a checked PushTarget, or a repo id) is given. The
    source, OUT and the push target are all checked before anything is loaded.
    `max_shard_size` (bytes, or "500MB"...; save_pretrained's default if None) splits the
    weights into shards of at most that size, with model.safetensors.index.json."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .. import model_card
    from ..serialization import replace_folder
    from ..checkpoint import read_checkpoint

    load = load or LoadOptions(**({"dtype": dtype} if dtype else {}))
    push = push if push is not None else push_to_hub
    out = Path(out)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": parse_size(max_shard_size)}
    check_out_folder(out, overwrite)
    load_kwargs = load.kwargs()
    if check_model_source(model, revision=load.revision, token=load.token) == "hub":
        _fetch_card(model, load)
    if isinstance(push, str):
        push = check_push_target(push, token=load.token)
    if push is not None:
        log(f"will push to {push.repo_id} (token and repo checked)")

    log(f"loading {model} and quantizing while loading ({config.quant_type})")
    start = time.perf_counter()
    try:
        quantized = AutoModelForCausalLM.from_pretrained(model, quantization_config=config, **load_kwargs)
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"cannot load {model}: {first}") from e
    seconds = time.perf_counter() - start
    mixed = getattr(getattr(quantized, "hf_quantizer", None), "mixed_precision", None)
    if mixed is not None:
        chosen, measured = mixed
        log(f"{chosen.summary()}; calibration-text perplexity predicted {chosen.predicted_perplexity():.3f}, "
            f"measured {measured:.3f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.hf_aoq-{secrets.token_hex(4)}.tmp"
    staging.mkdir()
    try:
        users_card = (out / model_card.CARD_NAME).is_file()
        if users_card:  # the user's card text survives an overwrite
            shutil.copy2(out / model_card.CARD_NAME, staging / model_card.CARD_NAME)
        log(f"quantized in {seconds:.1f} s; saving to {out}")
        quantized.save_pretrained(staging, **save_kwargs)  # writes the model card too (hf_aoq.model_card)
        try:
            AutoTokenizer.from_pretrained(model, revision=load.revision, trust_remote_code=load.trust_remote_code,
                                          token=load.token).save_pretrained(staging)
        except Exception as e:  # a model without a tokenizer still quantizes; generate will say what is missing
            log(f"no tokenizer saved ({type(e).__name__}); `hf-aoq generate` needs one in {out}")
        info = read_checkpoint(staging)
        if not info.loads:
            raise UsageError(f"the new checkpoint does not load back ({sum(t.error is not None for t in info.tensors)} "
                             f"tensors fail); nothing in {out} was changed. Run with --debug and report it")
        quality = {}
        source = _local_float_checkpoint(model, load.revision) if measure else None
        if source is not None:
            try:
                quality = measure_quality(info, source)
            except Exception as e:  # e.g. float weights stored as .bin only
                log(f"quality not measured ({type(e).__name__}: {e})")
        model_card.set_quality(quantized, quality)
        if not users_card:  # the card save_pretrained wrote is made again whole, with what is known now
            (staging / model_card.CARD_NAME).unlink(missing_ok=True)
        model_card.write_model_card(staging, info=info, base_model=card_base_model or model, load_name=str(out),
                                    quality=quality, revision=load.revision)
        replace_folder(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    info.path, info.files = out, [out / f.name for f in info.files]
    for k, v in quality.items():
        log(f"{k}: {v}")
    result = QuantizeResult(out, seconds, info, quality)
    if push is not None:
        try:
            result.url = push_folder(out, push)
        except UsageError:
            raise
        except Exception as e:
            raise push_failed(out, push, e) from e
    return result


def _fetch_card(repo_id: str, load: LoadOptions) -> None:
    """Put the base model's card into the Hub cache, where the model card reads its license."""
    from huggingface_hub import hf_hub_download

    from ..model_card import CARD_NAME

    try:
        hf_hub_download(repo_id, CARD_NAME, revision=load.revision, token=load.token)
    except Exception as e:  # no card, or no network: the card then has no license, nothing else lost
        log(f"{repo_id} has no model card to take the license from ({type(e).__name__})")


