#!/usr/bin/env python
"""The GPU benchmark of scripts/gpu_check.sh: hf_aoq's CUDA linears against bf16 and against the
aten kernels they call, and a tiny model's decode speed, written as JSON; with --crossover, the
Triton int4 / Int4DQ kernels at M = 1 .. 512 (GEMV, GEMM, dequantize + cuBLAS) and the fused fp8
activation quantizer, with the row counts where one overtakes the other: what
TRITON_GEMV_MAX_ROWS and TRITON_GEMM_MAX_ROWS (hf_aoq/kernels/triton_kernels.py) should be.

    python scripts/gpu_bench.py --out gpu_check_out/bench.json
    python scripts/gpu_bench.py --crossover --out gpu_check_out/crossover.json
    python scripts/gpu_bench.py --list        # the cases, without a GPU

Times are CUDA-event medians over `--iters` calls after warm-up, per (scheme, rows, shape).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SCHEMES = ["int4", "int4dq", "int8", "int8-dynamic", "fp8", "fp8-dynamic"]
ROWS = [1, 16, 512]
SHAPES = [(4096, 4096), (11008, 4096)]


# --crossover: one shape, bf16 activations; each Triton kernel over the rows where it may win.
CROSSOVER_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
CROSSOVER_SHAPE = (4096, 4096)
CROSSOVER_KERNELS = {"gemv": (1, 32), "gemm": (2, 512), "dequantize_mm": (8, 512)}  # rows from, to
QUANTIZER_ROWS = [1, 16, 512]


def cases() -> list[dict]:
    return [{"scheme": s, "rows": m, "n": n, "k": k} for s in SCHEMES for m in ROWS for n, k in SHAPES]


def crossover_cases() -> list[dict]:
    n, k = CROSSOVER_SHAPE
    out = [{"section": "crossover", "scheme": s, "kernel": name, "rows": m, "n": n, "k": k}
           for s in ("int4", "int4dq") for m in CROSSOVER_ROWS
           for name, (lo, hi) in CROSSOVER_KERNELS.items() if lo <= m <= hi]
    return out + [{"section": "crossover", "scheme": "fp8-quantize", "kernel": "triton", "rows": m, "n": 0, "k": k}
                  for m in QUANTIZER_ROWS]


def config_of(scheme: str):
    import hf_aoq as q

    return {
        "int4": q.Int4WeightOnlyConfig(128),
        "int4dq": q.Int4DQWeightOnlyConfig(),
        "int8": q.Int8WeightOnlyConfig(),
        "int8-dynamic": q.Int8DynamicActivationInt8WeightConfig(),
        "fp8": q.Float8WeightOnlyConfig(),
        "fp8-dynamic": q.Float8DynamicActivationFloat8WeightConfig(),
    }[scheme]


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def aten_baseline(scheme: str, q, x):
    """The aten kernel hf_aoq's row calls, on operands prepared beforehand (None: no such kernel)."""
    n, k = q.shape
    if scheme == "int4" and q.packing == "cuda_tinygemm":
        sz = q.scale.to(torch.bfloat16)
        return lambda: torch.ops.aten._weight_int4pack_mm(x, q.qdata, q.block_size[-1], sz)
    if scheme == "int8-dynamic":
        xq = torch.randint(-127, 127, (max(x.shape[0], 17), k), dtype=torch.int8, device=x.device)
        return lambda: torch._int_mm(xq, q.qdata.t())
    if scheme == "fp8-dynamic":
        xq = x.to(torch.float8_e4m3fn)
        sa = torch.ones(x.shape[0], 1, device=x.device)
        sb = torch.ones(1, n, device=x.device)
        return lambda: torch._scaled_mm(xq, q.qdata.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    return None


def time_triton(case, w, x, q, iters: int):
    """hf_aoq's Triton GEMV on the canonical layout: int4 (groups of 128) and Int4DQ (`q` itself,
    canonical on CUDA); None for other schemes, without triton or above its rows."""
    from hf_aoq import Int4Tensor
    from hf_aoq.kernels.triton_kernels import TRITON_GEMV_MAX_ROWS, _lut_on

    if case["scheme"] not in ("int4", "int4dq"):
        return None
    try:
        from hf_aoq.kernels import triton_jit
    except ImportError:
        return None
    if case["rows"] > TRITON_GEMV_MAX_ROWS * 2:
        return None
    n, k = case["n"], case["k"]
    if case["scheme"] == "int4dq":
        lut = _lut_on(x.device)
        return time_ms(lambda: triton_jit.int4dq_gemv(x, q.qdata, q.gparams, q.rparams, q.tparams, lut, None,
                                                      q.block_size[-1], n, k), iters)
    c = Int4Tensor.from_float(w, 128)
    return time_ms(lambda: triton_jit.int4_gemv(x, c.qdata, c.scale, c.zero, None, 128, n, k), iters)


def bench_linears(iters: int, results: list, save) -> list[dict]:
    from hf_aoq import kernels

    for case in cases():
        torch.manual_seed(0)
        w = torch.randn(case["n"], case["k"], dtype=torch.bfloat16, device="cuda") * 0.02
        x = torch.randn(case["rows"], case["k"], dtype=torch.bfloat16, device="cuda")
        q = config_of(case["scheme"]).quantize_weight(w).place()
        row = dict(case, kernel=kernels.select_kernel("linear", x, q).name)
        with torch.no_grad():
            row["bf16_ms"] = time_ms(lambda: F.linear(x, w), iters)
            row["hf_aoq_ms"] = time_ms(lambda: F.linear(x, q), iters)
            base = aten_baseline(case["scheme"], q, x)
            row["aten_ms"] = time_ms(base, iters) if base else None
            row["triton_ms"] = time_triton(case, w, x, q, iters)
        row["vs_bf16"] = row["hf_aoq_ms"] / row["bf16_ms"]
        results.append(row)
        save()
        print(json.dumps(row), flush=True)
    return results


def crossover_kernels(scheme: str, q, n: int, k: int):
    """name -> fn(x) for the Triton kernels of a canonical int4 (groups of 128) or Int4DQ weight."""
    from hf_aoq.kernels import triton_gemm, triton_jit
    from hf_aoq.kernels.triton_kernels import _lut_on

    g = q.block_size[-1]
    if scheme == "int4":
        return {
            "gemv": lambda x: triton_jit.int4_gemv(x, q.qdata, q.scale, q.zero, None, g, n, k),
            "gemm": lambda x: triton_gemm.int4_gemm(x, q.qdata, q.scale, q.zero, None, g, n, k),
            "dequantize_mm": lambda x: F.linear(x, triton_gemm.int4_dequantize(q.qdata, q.scale, q.zero, g, n, k,
                                                                               x.dtype)),
        }
    lut = _lut_on(q.qdata.device)
    fields = (q.qdata, q.gparams, q.rparams, q.tparams, lut)
    return {
        "gemv": lambda x: triton_jit.int4dq_gemv(x, *fields, None, g, n, k),
        "gemm": lambda x: triton_gemm.int4dq_gemm(x, *fields, None, g, n, k),
        "dequantize_mm": lambda x: F.linear(x, triton_gemm.int4dq_dequantize(*fields, g, n, k, x.dtype)),
    }


def crossovers(rows: list[dict]) -> dict:
    """Per scheme: the fewest rows at which the GEMM beats the GEMV and dequantize + cuBLAS beats
    the GEMM (None: not within the rows measured), and the limits the table uses now."""
    from hf_aoq.kernels.triton_kernels import TRITON_GEMM_MAX_ROWS, TRITON_GEMV_MAX_ROWS

    out = {"TRITON_GEMV_MAX_ROWS": TRITON_GEMV_MAX_ROWS, "TRITON_GEMM_MAX_ROWS": TRITON_GEMM_MAX_ROWS}
    for scheme in ("int4", "int4dq"):
        ms = {(r["kernel"], r["rows"]): r["ms"] for r in rows if r["scheme"] == scheme}

        def first(faster, slower):
            return next((m for m in CROSSOVER_ROWS if (faster, m) in ms and (slower, m) in ms
                         and ms[(faster, m)] < ms[(slower, m)]), None)

        out[scheme] = {"gemm_beats_gemv_from": first("gemm", "gemv"),
                       "dequantize_mm_beats_gemm_from": first("dequantize_mm", "gemm")}
    return out


def bench_crossover(iters: int, report: dict, save) -> None:
    """Each case of crossover_cases(), against bf16 F.linear and what the table picks."""
    from hf_aoq import Int4DQWeightOnlyConfig, Int4Tensor, kernels
    from hf_aoq.kernels import triton_jit
    from hf_aoq.tensors.float8 import quantize_input_float8

    rows, n, k = report["crossover"], *CROSSOVER_SHAPE
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    weights = {"int4": Int4Tensor.from_float(w, 128, qparams="minmax"),  # canonical, as the Triton rows read it
               "int4dq": Int4DQWeightOnlyConfig().quantize_weight(w).place()}
    fns = {s: crossover_kernels(s, q, n, k) for s, q in weights.items()}
    for case in crossover_cases():
        x = torch.randn(case["rows"], k, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            if case["scheme"] == "fp8-quantize":
                row = dict(case, ms=time_ms(lambda: triton_jit.quantize_rows_fp8(x), iters),
                           torch_ms=time_ms(lambda: quantize_input_float8(x, "per_row", torch.float8_e4m3fn), iters))
            else:
                q = weights[case["scheme"]]
                row = dict(case, ms=time_ms(lambda: fns[case["scheme"]][case["kernel"]](x), iters),
                           bf16_ms=time_ms(lambda: F.linear(x, w), iters),
                           table=kernels.select_kernel("linear", x, q).name)
        rows.append(row)
        report["crossovers"] = crossovers(rows)
        save()
        print(json.dumps(row), flush=True)


def bench_decode(tokens: int, out: list, save) -> list[dict]:
    """Greedy decode tok/s of a small random Llama (bf16 and each scheme), batch 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_aoq import quantize_

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=8192)
    for scheme in ["bf16"] + SCHEMES:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16).cuda().eval()
        if scheme != "bf16":
            quantize_(model, config_of(scheme))
        prompt = torch.randint(0, 8192, (1, 16), device="cuda")
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=4, do_sample=False)
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            torch.cuda.synchronize()
        row = {"scheme": scheme, "tokens": tokens, "tok_per_s": tokens / (time.perf_counter() - start)}
        out.append(row)
        save()
        print(json.dumps(row), flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    parser.add_argument("--crossover", action="store_true",
                        help="only the Triton crossover rows (int4 / Int4DQ GEMV, GEMM, dequantize + cuBLAS)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.list:
        print(json.dumps(cases() + crossover_cases()))
        return 0
    if not torch.cuda.is_available():
        print("gpu_bench.py: no CUDA device", file=sys.stderr)
        return 2
    report = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()), "linears": [], "decode": [],
    }

    def save():  # after every figure, atomically: a run cut short keeps what it measured
        if args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump(report, f, indent=1)
            os.replace(args.out + ".tmp", args.out)

    if args.crossover:
        report.update(crossover=[], crossovers={})
        del report["linears"], report["decode"]
        bench_crossover(args.iters, report, save)
    else:
        bench_linears(args.iters, report["linears"], save)
        bench_decode(args.tokens, report["decode"], save)
    if not args.out:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
