"""The `hf-aoq` command line (also `python -m hf_aoq`). Thin: it calls the library.

    hf-aoq demo [--out DIR]    quantize SmolLM2-135M to int4 while loading, save, reload,
                               generate, and compare size and speed with bf16
    hf-aoq quantize MODEL --scheme int4|int8|int8-dyn|fp8|fp8-dyn [--group-size N]
                          [--recipe FILE.json] [--skip NAME ...] --out DIR [--max-shard-size SIZE]
                          [--push-to-hub REPO]
                               quantize a local folder or Hub model while loading it, save it
                               with its model card, and optionally push it to the Hub
    hf-aoq inspect DIR [--error FLOAT_DIR]
                               every tensor: scheme, shape, bytes before/after, whether it
                               loads; with --error, its SQNR against the float weights
    hf-aoq generate DIR "prompt" [--max-new-tokens N]
                               load, generate greedily, print the text and tokens/s
    hf-aoq convert-torchao SRC DST [--overwrite] [--max-shard-size SIZE]
                               convert a checkpoint saved by torchao's safetensors support
                               to an hf_aoq checkpoint, without torchao (docs/torchao.md)

SIZE is what save_pretrained's max_shard_size takes: bytes, or a number with KB, MB, GB or TB
(powers of 1000), like 500MB or 5GB; a larger checkpoint is split into shards with an index.

Errors are one line saying what to do; `--debug` shows the traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

class CLIError(Exception):
    """A failure to report as one line with what to do."""


_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
SIZE_FORM = "an integer number of bytes, or a number with KB, MB, GB or TB like 500MB or 5GB"


def parse_size(value, option: str = "--max-shard-size") -> int:
    """`value` (an int, or a string as save_pretrained's `max_shard_size` takes it: "5GB",
    "500MB", "1.5GB", "100KB", or digits for bytes) as a positive number of bytes. transformers
    5.x hands a string size to huggingface_hub's shard splitter; this reads it the same way (a
    number, then KB, MB, GB or TB in any case, powers of 1000), which a test checks."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        text = str(value).strip()
        try:
            if text.isdigit():
                size = int(text)
            else:
                number, unit = text[:-2].strip(), text[-2:].upper()
                size = int(float(number) * _SIZE_UNITS[unit]) if unit in _SIZE_UNITS and number else None
        except (ValueError, OverflowError):
            size = None
    if size is None or size <= 0:
        raise CLIError(f"{option} {value}: not a size; give {SIZE_FORM}")
    return size


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _generate(model, tokenizer, prompt: str, new_tokens: int) -> tuple[str, float]:
    import torch

    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        seconds = time.perf_counter() - start
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return text, new_tokens / seconds


def demo(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    import hf_aoq
    from hf_aoq import smollm2

    out = Path(args.out)
    torch.manual_seed(0)
    try:
        gguf = smollm2.gguf_path()
    except FileNotFoundError as e:
        raise CLIError(str(e)) from None
    print(f"SmolLM2-135M from {gguf.name} (transformers unpacks the GGUF to bf16)")
    base, tokenizer = smollm2.load(torch.bfloat16)
    with tempfile.TemporaryDirectory(prefix="hf_aoq_demo_") as tmp:
        base_dir = Path(tmp) / "bf16"
        base.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)

        config = hf_aoq.AOQConfig(hf_aoq.Int4WeightOnlyConfig(group_size=args.group_size))
        start = time.perf_counter()
        quantized = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16, quantization_config=config)
        quantize_seconds = time.perf_counter() - start
        quantized.save_pretrained(out)
        tokenizer.save_pretrained(out)
        bf16_bytes = _dir_bytes(base_dir)
    int4_bytes = _dir_bytes(out)

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = args.prompt
    bf16_text, bf16_tps = _generate(base, tokenizer, prompt, args.new_tokens)
    int4_text, int4_tps = _generate(reloaded, tokenizer, prompt, args.new_tokens)
    print(f"quantized while loading in {quantize_seconds:.1f} s; saved to {out}")
    print(f"prompt: {prompt!r}")
    print(f"  bf16: {bf16_text!r}")
    print(f"  int4: {int4_text!r}")
    print(f"{'':6}{'size (MB)':>12}{'tokens/s':>12}")
    print(f"{'bf16':6}{bf16_bytes / 1e6:>12.1f}{bf16_tps:>12.1f}")
    print(f"{'int4':6}{int4_bytes / 1e6:>12.1f}{int4_tps:>12.1f}")
    print(f"int4/bf16: size {int4_bytes / bf16_bytes:.2f}x, speed {int4_tps / bf16_tps:.2f}x "
          f"(group size {args.group_size}; SmolLM2's GGUF is Q4_1 with groups of 32, which g32 reproduces)")
    return 0


# ---------------------------------------------------------------------- quantize
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "auto": "auto"}


def _log(message: str) -> None:
    print(f"[hf-aoq] {message}", flush=True)


def load_recipe(path) -> "object":
    """A recipe file: an FqnToConfig (or a single config) as JSON, in the form AOQConfig writes
    to config.json (hf_aoq.configs.recipe_to_dict)."""
    from .configs import recipe_from_dict
    from .core.errors import FormatError

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CLIError(f"cannot read the recipe file {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise CLIError(f"{path} is not valid JSON ({e}); a recipe file holds hf_aoq.configs.recipe_to_dict output") from None
    try:
        return recipe_from_dict(data, where=str(path))
    except FormatError as e:
        raise CLIError(f"{e} (write the file with hf_aoq.configs.recipe_to_dict)") from None


def build_aoq_config(scheme=None, group_size=None, recipe=None, skip=None, calibration=None, calibration_tokens=2048):
    """The AOQConfig for `hf-aoq quantize`: `scheme` (+ `group_size`) is the config of every
    linear layer the recipe does not name; a `recipe` (FqnToConfig, or a path to its JSON) comes
    first; `skip` names modules to leave in float; `calibration` is a text file for GPTQ."""
    from .configs import FqnToConfig, config_for_scheme
    from .core.errors import AOQError
    from .integrations.transformers import AOQConfig

    try:
        default = None if scheme is None else config_for_scheme(scheme, group_size)
    except AOQError as e:
        raise CLIError(str(e)) from None
    if calibration is not None and scheme == "int4" and group_size is None:
        raise CLIError(
            "--calibration (GPTQ) chooses plain int4 groups: add --group-size 128 (or 32, 64, 256). The default "
            "int4 (Int4DQ) needs no data and is more accurate (SmolLM2: 31.6 against GPTQ's 38.9 at g128)"
        )
    if scheme is None and group_size is not None:
        raise CLIError("--group-size needs --scheme int4 or int8")
    if isinstance(recipe, (str, os.PathLike)):
        recipe = load_recipe(recipe)
    if recipe is None and default is None:
        raise CLIError("say what to do: --scheme int4|int8|int8-dyn|fp8|fp8-dyn, or --recipe FILE.json")
    if recipe is None:
        quant_type = default
    elif default is None:
        quant_type = recipe
    elif isinstance(recipe, FqnToConfig) and "_default" not in recipe.mapping:
        quant_type = FqnToConfig({**recipe.mapping, "_default": default})
    else:
        raise CLIError("the recipe already has a default (_default, or a single config) and --scheme gives another; drop one")
    try:
        if calibration is not None and not Path(calibration).is_file():
            raise CLIError(f"--calibration {calibration}: no such text file")
        return AOQConfig(quant_type, modules_to_not_convert=list(skip) if skip else None,
                         calibration=calibration, calibration_tokens=calibration_tokens)
    except AOQError as e:
        raise CLIError(str(e)) from None


def _local_float_checkpoint(model: str) -> Path | None:
    """Where the float weights of `model` are on this machine (its folder, or the Hub cache)."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # not cached as a full snapshot: no quality figures, nothing else lost
        return None


def quantize_checkpoint(model: str, config, out, *, dtype: str = "bfloat16", overwrite: bool = False,
                        push_to_hub: str | None = None, measure: bool = True,
                        max_shard_size: int | str | None = None) -> Path:
    """Quantize `model` (a folder or Hub id) while loading it, save it to `out` with its
    tokenizer and model card, measure the weight error when the float weights are local, and
    push the folder to the Hub repo `push_to_hub` if given. What `hf-aoq quantize` runs.
    `max_shard_size` (bytes, or "500MB"...; save_pretrained's default if None) splits the weights
    into shards of at most that size, with model.safetensors.index.json."""
    import torch
    from transformers import AutoModelForCausalLM

    from . import model_card
    from .checkpoint import format_bytes, quality_summary, read_checkpoint, weight_errors

    out = Path(out)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": parse_size(max_shard_size)}
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CLIError(f"--out {out} already has files; pass --overwrite to replace the checkpoint in it, or pick another folder")
    if not Path(model).is_dir() and (os.sep in model.strip("/") and not _HUB_ID.fullmatch(model) or Path(model).is_file()):
        raise CLIError(f"{model}: no such folder, and not a Hub id (owner/name)")
    if Path(model).is_dir() and not (Path(model) / "config.json").is_file():
        raise CLIError(f"{model} has no config.json; give a checkpoint folder written by save_pretrained, or a Hub id")
    torch_dtype = _DTYPES.get(dtype, dtype)
    if torch_dtype != "auto":
        torch_dtype = getattr(torch, torch_dtype)
    _log(f"loading {model} and quantizing while loading ({config.quant_type})")
    start = time.perf_counter()
    try:
        quantized = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype, quantization_config=config)
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CLIError(f"cannot load {model}: {first} (give a folder with config.json and weights, or a Hub id; "
                       f"set HF_TOKEN for a private repo)") from e
    _log(f"quantized in {time.perf_counter() - start:.1f} s; saving to {out}")
    quantized.save_pretrained(out, **save_kwargs)  # writes the model card too (hf_aoq.model_card)
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(model).save_pretrained(out)
    except Exception as e:  # a model without a tokenizer still quantizes; generate will say what is missing
        _log(f"no tokenizer saved ({type(e).__name__}); `hf-aoq generate` needs one in {out}")
    info = read_checkpoint(out)
    quality = None
    source = _local_float_checkpoint(model) if measure else None
    if source is not None:
        try:
            quality = quality_summary(weight_errors(info, source))
        except Exception as e:  # e.g. float weights stored as .bin only
            _log(f"quality not measured ({type(e).__name__}: {e})")
    if quality:
        model_card.set_quality(quantized, quality)
        model_card.write_model_card(out, info=info, base_model=model, load_name=str(out), quality=quality)
        for k, v in quality.items():
            _log(f"{k}: {v}")
    if not info.loads:
        raise CLIError(f"{out}: the saved checkpoint does not load back; run `hf-aoq inspect {out}` to see which tensor fails")
    before, after = info.bytes_before, info.bytes_after
    _log(f"saved {len(info.quantized)} quantized tensors of {len(info.tensors)}: {format_bytes(before)} -> "
         f"{format_bytes(after)} ({after / max(before, 1):.2f}x); card in {out / model_card.CARD_NAME}")
    if push_to_hub:
        url = push_folder(out, push_to_hub, base_model=model, quality=quality)
        _log(f"pushed to {url}")
    return out


def push_folder(folder, repo_id: str, *, base_model: str | None = None, quality=None,
                private: bool | None = None, commit_message: str = "Upload hf_aoq quantized model") -> str:
    """Upload a saved checkpoint folder to the Hub repo `repo_id` (created if needed) in one
    commit through huggingface_hub. A card already on the Hub is kept and gets the quantization
    section. Returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    from . import model_card
    from .checkpoint import read_checkpoint

    folder = Path(folder)
    api = HfApi()
    repo_id = api.create_repo(repo_id, exist_ok=True, private=private).repo_id
    card = model_card.render_card(read_checkpoint(folder, build=False), base_model=base_model,
                                  load_name=repo_id, quality=quality)
    local = folder / model_card.CARD_NAME
    existing = local.read_text(encoding="utf-8") if local.is_file() else ""
    with tempfile.TemporaryDirectory(prefix="hf_aoq_card_") as tmp:
        try:
            existing = Path(hf_hub_download(repo_id, model_card.CARD_NAME, cache_dir=tmp)).read_text(encoding="utf-8")
        except EntryNotFoundError:
            pass
    card = model_card.merge(existing, card)
    operations = [CommitOperationAdd(path_in_repo=model_card.CARD_NAME, path_or_fileobj=card.encode("utf-8"))]
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel != model_card.CARD_NAME and not any(p.startswith(".") for p in rel.split("/")):
            operations.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path)))
    _log(f"uploading {len(operations)} files to {repo_id}")
    info = api.create_commit(repo_id, operations, commit_message=commit_message)
    return info.commit_url


def add_quantize_arguments(p: argparse.ArgumentParser, *, out_required: bool = True) -> None:
    """The arguments of `hf-aoq quantize` (scripts/quantize_and_push.py takes the same)."""
    from .configs import SCHEMES

    p.add_argument("model", help="a local checkpoint folder or a Hub model id")
    p.add_argument("--scheme", choices=SCHEMES, help="config of every linear layer the recipe does not name")
    p.add_argument("--group-size", type=int, metavar="N",
                   help="int4: plain groups of 32, 64, 128 or 256 (default: Int4DQ, groups of 32 with 4-bit group "
                        "parameters, the size of g128); int8: groups instead of rows")
    p.add_argument("--recipe", metavar="FILE.json", help="per-layer FqnToConfig as JSON (hf_aoq.configs.recipe_to_dict)")
    p.add_argument("--skip", nargs="+", action="extend", metavar="NAME", default=[],
                   help="modules to leave in float (names or regexes; put MODEL before this option)")
    p.add_argument("--calibration", metavar="FILE",
                   help="text file: choose int4 weights by GPTQ on it (slower; loads the float model first)")
    p.add_argument("--calibration-tokens", type=int, default=2048, metavar="N",
                   help="how many tokens of --calibration to use (default 2048)")
    p.add_argument("--out", required=out_required, metavar="DIR", help="folder to save the quantized checkpoint in")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="split the weights into files of at most SIZE (bytes, or e.g. 500MB, 5GB; "
                        "default: save_pretrained's)")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="dtype to load the float model in")
    p.add_argument("--push-to-hub", metavar="REPO", help="then upload the folder to this Hub repo")
    p.add_argument("--no-measure", dest="measure", action="store_false",
                   help="skip the weight-error figures for the model card")


def quantize_command(args) -> int:
    config = build_aoq_config(args.scheme, args.group_size, args.recipe, args.skip, args.calibration,
                              args.calibration_tokens)
    quantize_checkpoint(args.model, config, args.out, dtype=args.dtype, overwrite=args.overwrite,
                        push_to_hub=args.push_to_hub, measure=args.measure,
                        max_shard_size=getattr(args, "max_shard_size", None))
    return 0


# ---------------------------------------------------------------------- inspect
def _table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def inspect_command(args) -> int:
    from .checkpoint import format_bytes, read_checkpoint, weight_errors
    from .core.errors import AOQError, FormatError

    try:
        info = read_checkpoint(args.dir)
    except AOQError as e:
        if isinstance(e, FormatError):
            raise CLIError(f"does not load: {e}") from None
        raise CLIError(str(e)) from None
    errors = {}
    if args.error:
        try:
            errors = weight_errors(info, args.error)
        except AOQError as e:
            raise CLIError(f"--error {args.error}: {e}") from None
    header = ["name", "scheme", "shape", "before", "after"] + (["SQNR dB"] if args.error else []) + ["loads"]
    rows = []
    for t in info.tensors:
        row = [t.name, t.scheme, "x".join(map(str, t.shape)) or "()", format_bytes(t.bytes_before),
               format_bytes(t.bytes_after)]
        if args.error:
            row.append(f"{errors[t.name]:.1f}" if t.name in errors else "")
        row.append("ok" if t.error is None else "FAILS")
        rows.append(row)
    print(f"checkpoint: {info.path} ({len(info.files)} file{'s' if len(info.files) != 1 else ''})")
    if info.format_versions:
        print(f"format: hf_aoq format version {', '.join(map(str, info.format_versions))}, "
              f"written by hf_aoq {', '.join(info.writers)}")
    else:
        print("format: no hf_aoq metadata (a plain float checkpoint)")
    print(_table(header, rows, right={3, 4, 5} if args.error else {3, 4}))
    before, after = info.bytes_before, info.bytes_after
    print(f"total: {len(info.tensors)} tensors, {len(info.quantized)} quantized; {format_bytes(before)} -> "
          f"{format_bytes(after)} ({after / max(before, 1):.2f}x)")
    if args.error:
        finite = [v for v in errors.values() if v != float("inf")]
        if finite:
            print(f"SQNR over {len(errors)} quantized tensors: mean {sum(finite) / len(finite):.1f} dB, "
                  f"worst {min(errors.values()):.1f} dB ({min(errors, key=errors.get)})")
        missing = len(info.built) - len(errors)
        if missing:
            print(f"{missing} quantized tensors have no float weight of the same name and shape in {args.error}")
    if info.loads:
        print("every tensor loads: yes")
        return 0
    print("every tensor loads: NO")
    for t in info.tensors:
        if t.error is not None:
            print(f"  {t.name}: {t.error}")
    for problem in info.problems:
        print(f"  {problem}")
    failing = sum(t.error is not None for t in info.tensors) + len(info.problems)
    raise CLIError(f"{args.dir}: {failing} tensor(s) or key(s) do not load (listed above)")


# ---------------------------------------------------------------------- generate
def generate_command(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = args.dir
    if not Path(path).is_dir() and (Path(path).exists() or not _HUB_ID.fullmatch(path)):
        raise CLIError(f"{path}: no such checkpoint folder (nor a Hub id)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or path)
    except Exception as e:
        raise CLIError(f"no tokenizer in {args.tokenizer or path} ({type(e).__name__}); save one there with "
                       f"tokenizer.save_pretrained, or pass --tokenizer NAME") from e
    _log(f"loading {path}")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    inputs = tokenizer(args.prompt, return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=pad)  # warm-up
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
        seconds = time.perf_counter() - start
    new = out[0, prompt_len:]
    print(tokenizer.decode(new, skip_special_tokens=True))
    print(f"{new.numel()} new tokens in {seconds:.2f} s: {new.numel() / seconds:.1f} tokens/s")
    return 0


def convert_torchao_command(args) -> int:
    """`hf-aoq convert-torchao SRC DST`: hf_aoq.convert.convert_torchao_checkpoint, reported."""
    from .convert.torchao import TorchaoConversionError, convert_torchao_checkpoint

    kwargs = {} if args.max_shard_size is None else {"max_shard_size": parse_size(args.max_shard_size)}
    try:
        summary = convert_torchao_checkpoint(args.src, args.dst, overwrite=args.overwrite, **kwargs)
    except TorchaoConversionError as e:
        raise CLIError(f"{e} (nothing was written)") from e
    print(summary.format())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-aoq", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    # --debug is also accepted after the subcommand; SUPPRESS keeps it from resetting the above.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("quantize", parents=[common], help="quantize a model while loading it, save it, push it")
    add_quantize_arguments(p)
    p.set_defaults(func=quantize_command)

    p = sub.add_parser("inspect", parents=[common], help="per-tensor scheme, shape, sizes; check that it loads")
    p.add_argument("dir", help="a checkpoint folder (or one .safetensors file)")
    p.add_argument("--error", metavar="FLOAT_DIR", help="float checkpoint folder: per-tensor SQNR against its weights")
    p.set_defaults(func=inspect_command)

    p = sub.add_parser("generate", parents=[common], help="load a checkpoint, generate greedily, print tokens/s")
    p.add_argument("dir", help="a checkpoint folder or Hub id")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--tokenizer", help="tokenizer folder or Hub id, if DIR has none")
    p.set_defaults(func=generate_command)

    p = sub.add_parser("convert-torchao", parents=[common],
                       help="convert a checkpoint saved by torchao (safetensors) to hf_aoq, without torchao")
    p.add_argument("src", help="the torchao checkpoint folder")
    p.add_argument("dst", help="the hf_aoq checkpoint folder to write (must not exist)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="split the weights into files of at most SIZE (bytes, or e.g. 500MB, 5GB; default 5GiB)")
    p.set_defaults(func=convert_torchao_command)

    p = sub.add_parser("demo", parents=[common],
                       help="quantize SmolLM2-135M to int4, save, reload, generate; compare with bf16")
    p.add_argument("--out", default="smollm2-135m-aoq-int4", help="where to save the quantized model")
    p.add_argument("--group-size", type=int, default=32, choices=(32, 64))
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--new-tokens", type=int, default=24)
    p.set_defaults(func=demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args) -> int:
    """Run `args.func(args)`; a failure is one line on stderr (rc 2 for a CLIError, 1 otherwise),
    or the traceback with `args.debug`."""
    try:
        return args.func(args)
    except CLIError as e:
        if args.debug:
            raise
        print(f"hf-aoq {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - one readable line unless --debug
        if args.debug:
            raise
        text = " ".join(str(e).split())
        text = text if len(text) <= 600 else text[:597] + "..."
        print(f"hf-aoq {args.command}: {type(e).__name__}: {text} (run with --debug for the traceback)", file=sys.stderr)
        return 1
