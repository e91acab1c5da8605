#!/usr/bin/env python
"""Microbenchmark of the CPU linear kernels against dense bf16 and float32, in one process.

The machines this runs on are small and shared, so absolute times drift by 2-10x from minute to
minute. Every candidate is therefore timed round-robin (one call of each per round), and the
table reports the median and best over the rounds and the ratio of medians to dense bf16 and
float32 measured in the same rounds: compare ratios, not milliseconds, across runs.

    .venv/bin/python scripts/bench_kernels.py                       # 2048x5632, rows 1 and 256
    .venv/bin/python scripts/bench_kernels.py --shape 5632x2048 --rows 1,4,16,64 --rounds 20
    .venv/bin/python scripts/bench_kernels.py --threads 1
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/bench_kernels.py
    .venv/bin/python scripts/bench_kernels.py --rows 1 --copies 32   # weights read from DRAM

One weight of a few MB stays in the last-level cache between calls (the AVX-512 VM's L3 is
480 MiB), so by default this measures the kernels on cached weights. A model's decode step reads
each weight once per token, from DRAM. `--copies N` builds N copies of every weight and each
timing is the mean over one call on each copy, with every other candidate's copies read in
between: choose N so that N times a bf16 weight is well above the L3.

On a machine shared with other busy processes, OpenMP's default spin-waiting makes every
parallel region wait on descheduled threads: with two threads, a decode step measured 5x
slower than with OMP_WAIT_POLICY=PASSIVE or --threads 1. Use one of those there.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def candidates(n: int, k: int, m: int, dtype: torch.dtype):
    """(name, zero-argument callable) pairs for an [m, k] activation and an [n, k] weight."""
    from hf_aoq import Float8Tensor, Int4Tensor, Int8Tensor, kernels
    from hf_aoq.kernels import cpu, cpu_ext, cpu_gemm, cpu_isa

    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    x = torch.randn(m, k, dtype=dtype)
    w_bf16, w_fp32 = w.to(torch.bfloat16), w.float()
    x_bf16, x_fp32 = x.to(torch.bfloat16), x.float()
    out = [("dense bf16", lambda: F.linear(x_bf16, w_bf16)), ("dense fp32", lambda: F.linear(x_fp32, w_fp32))]

    canonical4 = Int4Tensor.from_float(w.to(dtype), 128)
    if cpu.HAS_INT4_CPU:  # aten's kernel on aten's packing (the fallback without hf_aoq's extension)
        a4 = kernels.get_packing("cpu_int4pack").pack(canonical4)
        out.append(("aten int4pack " + str(dtype)[6:],
                    lambda: aten._weight_int4pack_mm_for_cpu(x, a4.qdata, 128, a4.scale)))
    q4 = canonical4.place()
    ext = cpu_ext.load()
    if q4.packing == "cpu_int4_pairs":
        half = dtype != torch.float32  # half-precision activations: int16 activation codes, at any row count
        out.append((f"hf_aoq ext int4 ({'int16 codes' if half else 'gemv'})",
                    lambda: ext.int4pack_linear(x_fp32, q4.qdata, q4.scale, 128, 1 << 30, half).to(dtype)))
        out.append(("hf_aoq ext int4 (dequant+gemm)",
                    lambda: ext.int4pack_linear(x_fp32, q4.qdata, q4.scale, 128, 0, False).to(dtype)))
    out.append(("hf_aoq int4 F.linear", lambda: F.linear(x, q4)))
    gemm = dtype in cpu_gemm.HALF and ext is not None
    if gemm and q4.packing == "cpu_int4_pairs":  # dequantize into x's dtype + aten's GEMM, at any row count
        out.append((f"hf_aoq int4 dequant {str(dtype)[6:]} + aten GEMM", lambda: cpu_gemm._int4(x, q4, None)))

    q8 = Int8Tensor.from_float(w.to(dtype))
    s8 = q8.scale.reshape(-1).to(dtype)
    if cpu.HAS_INT8_WEIGHT_MM:
        out.append(("aten int8pack " + str(dtype)[6:], lambda: aten._weight_int8pack_mm(x, q8.qdata, s8)))
    if ext is not None and hasattr(ext, "int8_linear"):
        s8f = q8.scale.reshape(-1).float().contiguous()
        out.append(("hf_aoq ext int8 (gemv)", lambda: ext.int8_linear(x_fp32, q8.qdata, s8f, 1 << 30, False).to(dtype)))
        out.append(("hf_aoq ext int8 (dequant+gemm)", lambda: ext.int8_linear(x_fp32, q8.qdata, s8f, 0, False).to(dtype)))
    out.append(("hf_aoq int8 F.linear", lambda: F.linear(x, q8)))
    if gemm:
        out.append((f"hf_aoq int8 dequant {str(dtype)[6:]} + aten GEMM", lambda: cpu_gemm._int8(x, q8, None)))
    q8d = Int8Tensor.from_float(w.to(dtype), act_quant="per_token")
    out.append(("hf_aoq int8dyn F.linear", lambda: F.linear(x, q8d)))

    if hasattr(torch.ops, "quantized") and hasattr(torch.ops.quantized, "linear_dynamic"):
        try:
            qw = torch.quantize_per_channel(w_fp32, (w_fp32.abs().amax(1) / 127).clamp(min=1e-12),
                                            torch.zeros(n, dtype=torch.long), 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(qw, None)
            torch.ops.quantized.linear_dynamic(x_fp32, packed)
            out.append(("fbgemm linear_dynamic fp32 (per-tensor act)",
                        lambda: torch.ops.quantized.linear_dynamic(x_fp32, packed)))
        except Exception:  # noqa: BLE001 - not built with fbgemm
            pass

    q8f = Float8Tensor.from_float(w.to(dtype))
    out.append(("hf_aoq fp8 F.linear", lambda: F.linear(x, q8f)))
    if gemm:
        out.append((f"hf_aoq fp8 dequant {str(dtype)[6:]} + aten GEMM", lambda: cpu_gemm._fp8(x, q8f, None)))
    from hf_aoq.kernels import cpu_mx, reference
    from hf_aoq.tensors.mx import FP4, MXTensor

    mx4 = MXTensor.from_float(w.to(dtype), FP4)
    mx8 = MXTensor.from_float(w.to(dtype), torch.float8_e4m3fn)
    mx4d = MXTensor.from_float(w.to(dtype), FP4, act_dtype=torch.float8_e4m3fn)
    if ext is not None:
        for name, q in (("mxfp4", mx4), ("mxfp8", mx8), ("mxfp4 e4m3-act", mx4d)):
            act = -1 if q.act_dtype is None else cpu_mx.KIND[q.act_dtype]
            out.append((f"hf_aoq {name} gemv", lambda q=q, act=act: cpu_mx.mx_linear_io(
                x, q.qdata, q.scale, cpu_mx.KIND[q.elem_dtype], k, None, act)))
            out.append((f"hf_aoq {name} dequant + aten GEMM", lambda q=q: cpu_mx.mx_cpu_dequant_linear(x, q, None)))
    out.append(("hf_aoq mxfp4 reference", lambda: reference.reference_linear(x, mx4, None)))
    from hf_aoq.kernels import cpu_nvfp4
    from hf_aoq.tensors.nvfp4 import NVFP4Tensor

    nv4 = NVFP4Tensor.from_float(w.to(dtype))
    nv4d = NVFP4Tensor.from_float(w.to(dtype), "nvfp4")
    if ext is not None:
        out.append(("hf_aoq nvfp4 gemv", lambda: cpu_nvfp4.nvfp4_linear_io(x, nv4.qdata, nv4.scale, nv4.per_tensor_scale,
                                                                          k, None)))
        out.append(("hf_aoq nvfp4 dyn-act gemv", lambda: cpu_nvfp4.nvfp4_linear_io(
            x, nv4d.qdata, nv4d.scale, nv4d.per_tensor_scale, k, None, True)))
        out.append(("hf_aoq nvfp4 dequant + GEMM", lambda: cpu_nvfp4.nvfp4_cpu_dequant_linear(x, nv4, None)))
        out.append(("hf_aoq nvfp4 dyn-act dequant + GEMM", lambda: cpu_nvfp4.nvfp4_cpu_dequant_linear(x, nv4d, None)))
    out.append(("hf_aoq nvfp4 reference", lambda: reference.reference_linear(x, nv4, None)))
    out.append(("hf_aoq nvfp4 dyn-act reference", lambda: reference.reference_linear(x, nv4d, None)))
    q4g32 = Int4Tensor.from_float(w.to(dtype), 32).place()
    out.append(("hf_aoq int4 g32 F.linear", lambda: F.linear(x, q4g32)))
    from hf_aoq import Int4DQTensor

    dq32 = Int4DQTensor.from_float(w.to(dtype), 32).place()  # the command line's default `int4` scheme
    out.append(("hf_aoq int4dq g32 F.linear", lambda: F.linear(x, dq32)))
    if gemm and dq32.packing == "cpu_int4dq":
        out.append((f"hf_aoq int4dq g32 dequant {str(dtype)[6:]} + aten GEMM", lambda: cpu_gemm._int4dq(x, dq32, None)))
    if ext is not None and hasattr(ext, "intx_linear_io"):  # IntxTensor's fields: any bytes are valid codes
        from hf_aoq.kernels import cpu_intx

        gen = torch.Generator().manual_seed(0)
        for bits in (2, 3, 4, 8):
            qb = torch.randint(0, 256, (n, -(-k * bits // 8)), generator=gen, dtype=torch.uint8)
            sb, zb = ((torch.rand(n, -(-k // 32), generator=gen) * 0.01).to(dtype) for _ in range(2))
            out.append((f"hf_aoq intx{bits} g32 asym kernel",
                        lambda qb=qb, sb=sb, zb=zb, bits=bits: cpu_intx.intx_linear(x, qb, sb, zb, bits, 32, k)))
    from hf_aoq.tensors.fpx import FPxTensor

    for ebits, mbits in ((3, 2), (2, 2), (2, 1)):  # fp6, fp5, fp4 through F.linear (the table's row)
        qf = FPxTensor.from_float(w.to(dtype), ebits, mbits)
        out.append((f"hf_aoq fpx e{ebits}m{mbits} F.linear", lambda qf=qf: F.linear(x, qf)))
    if dtype == torch.float16:
        w_fp16 = w.half()
        out.insert(2, ("dense fp16", lambda: F.linear(x, w_fp16)))
    if not cpu_ext.available():
        print("note: hf_aoq's CPU extension is unavailable; its kernels fall back")
    return out


def run(n, k, m, dtype, rounds, only=(), copies=1):
    sets = [[(name, f) for name, f in candidates(n, k, m, dtype)
             if not only or name.startswith("dense") or any(o in name for o in only)] for _ in range(copies)]
    names = [name for name, _ in sets[0]]
    times = {name: [] for name in names}
    with torch.inference_mode():
        for cands in sets:  # warm-up (and any one-time build)
            for _, f in cands:
                f()
        for _ in range(rounds):
            for i, name in enumerate(names):
                start = time.perf_counter()
                for cands in sets:
                    cands[i][1]()
                times[name].append((time.perf_counter() - start) / copies)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    where = f", {copies} copies of each weight (from DRAM)" if copies > 1 else ""
    print(f"\n### weight {n}x{k}, {m} rows, {str(dtype)[6:]} activations, {rounds} rounds, "
          f"{torch.get_num_threads()} threads{where}")
    print("| kernel | median ms | best ms | ×dense bf16 | ×dense fp32 |")
    print("| --- | --- | --- | --- | --- |")
    for name, t in times.items():
        print(f"| {name} | {med[name]:.3f} | {min(t) * 1e3:.3f} | {med[name] / med['dense bf16']:.3f} | "
              f"{med[name] / med['dense fp32']:.3f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="2048x5632", help="NxK of the weight (out x in); comma-separated for several")
    p.add_argument("--rows", default="1,256", help="comma-separated activation row counts")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--copies", type=int, default=1,
                   help="copies of every weight, read in turn, so that they come from DRAM rather than the cache")
    p.add_argument("--only", default="", help="comma-separated substrings: time only the kernels named so (and dense)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from hf_aoq.kernels import cpu_isa

    print(f"machine: {cpu_isa.describe()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for shape in a.shape.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for m in (int(r) for r in a.rows.split(",")):
            for dt in a.dtypes.split(","):
                run(n, k, m, getattr(torch, dt), max(3, a.rounds if m <= 16 else a.rounds // 3),
                    tuple(o for o in a.only.split(",") if o), max(1, a.copies))


if __name__ == "__main__":
    main()
