"""The `hf-aoq` command line (also `python -m hf_aoq`). Thin: it calls the library.

    hf-aoq demo [--out DIR]    quantize SmolLM2-135M to int4 while loading, save, reload,
                               generate, and compare size and speed with bf16
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

class CLIError(Exception):
    """A failure to report as one line with what to do."""


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-aoq", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="quantize SmolLM2-135M to int4, save, reload, generate; compare with bf16")
    p.add_argument("--out", default="smollm2-135m-aoq-int4", help="where to save the quantized model")
    p.add_argument("--group-size", type=int, default=32, choices=(32, 64))
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--new-tokens", type=int, default=24)
    p.set_defaults(func=demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CLIError as e:
        print(f"hf-aoq: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - one readable line unless --debug
        if args.debug:
            raise
        print(f"hf-aoq {args.command}: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        return 1
