#!/usr/bin/env python
"""The Python cost of F.linear on a quantized weight at batch 1: what it adds to the C++ call.

For each type (a --n x --k weight, placed for this CPU, bf16 activations, one row) it times, call
by call and interleaved, the extension's own `*_linear_io` function with the arguments the kernel
table's row passes, `F.linear(x, w)` and an `nn.Linear` holding w, and reports medians of the
paired differences (a busy machine's preemptions land in the tails, not in the medians).
With --stub the extension's functions are replaced by ones that return a preallocated output at
once: what is left is the Python alone (dispatch, the table lookup, the row), steadier still.

    .venv/bin/python scripts/bench_dispatch.py --threads 1 [--stub] [--grad-mode no_grad]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

TYPES = ("int4", "int4dq", "int8", "fp8")


def build(name: str, w: torch.Tensor):
    from hf_aoq.tensors.float8 import Float8Tensor
    from hf_aoq.tensors.int4 import Int4Tensor
    from hf_aoq.tensors.int4dq import Int4DQTensor
    from hf_aoq.tensors.int8 import Int8Tensor

    cls = {"int4": Int4Tensor, "int4dq": Int4DQTensor, "int8": Int8Tensor, "fp8": Float8Tensor}[name]
    return cls.from_float(w).place()


def direct_call(name: str, ext, x, q):
    """The extension call the kernel table's row makes for `q`, with its arguments bound."""
    from hf_aoq.kernels import cpu

    k = x.shape[-1]
    if name == "int4":
        return lambda: ext.int4pack_linear_io(x, q.qdata, q.scale, q.block_size[-1], k, None, cpu.INT4_GEMV_MAX_ROWS)
    if name == "int4dq":
        return lambda: ext.int4dq_linear_io(x, q.qdata, q.gparams, q.rparams, q.tparams, q.block_size[-1], k, None,
                                            cpu.INT4_GEMV_MAX_ROWS)
    if name == "int8":
        return lambda: ext.int8_linear_io(x, q.qdata, q.scale, None, cpu.INT8_GEMV_MAX_ROWS)
    shift = cpu._FP8_SHIFT[q.qdata.dtype]
    return lambda: ext.fp8_linear_io(x, q.qdata, q.scale, shift, None, cpu.FP8_GEMV_MAX_ROWS)


def paired(fns, calls: int) -> list[list[float]]:
    """Per call, each fn once, in turn: their times in microseconds."""
    clock = time.perf_counter
    times = [[] for _ in fns]
    for _ in range(calls):
        for t, fn in zip(times, fns):
            start = clock()
            fn()
            t.append(1e6 * (clock() - start))
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--stub", action="store_true", help="replace the extension's functions by an instant stub")
    p.add_argument("--grad-mode", choices=("inference_mode", "no_grad"), default="inference_mode",
                   help="what the decode loop runs under (hf-aoq generate: inference_mode; transformers' generate: no_grad)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from hf_aoq.kernels import cpu_ext, select_kernel

    ext = cpu_ext.load()
    if ext is None:
        raise SystemExit("hf_aoq's C++ extension is not available here")
    x = torch.randn(1, 1, a.k, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    if a.stub:
        out = torch.empty(1, 1, a.n, dtype=torch.bfloat16)

        class Stub:
            def __getattr__(self, name):
                fn = lambda *args: out  # noqa: E731
                setattr(self, name, fn)
                return fn

        ext = Stub()
    real_load = cpu_ext.load
    w = torch.randn(a.n, a.k, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    mode = torch.inference_mode if a.grad_mode == "inference_mode" else torch.no_grad
    print(f"{a.n}x{a.k}, 1 bf16 row, {a.threads} thread(s), {a.grad_mode}, {'stubbed' if a.stub else 'real'} "
          f"extension; medians of {a.calls} interleaved calls, microseconds\n")
    print("| type | row | direct | F.linear | +Python | nn.Linear | +Python |\n|---|---|---|---|---|---|---|")
    for name in a.types.split(","):
        q = build(name, w)
        lin = torch.nn.Linear(a.k, a.n, bias=False)
        lin.weight = torch.nn.Parameter(q, requires_grad=False)
        if a.stub:
            cpu_ext.load = lambda: ext  # what the rows call
        try:
            with mode():
                direct = direct_call(name, ext, x, q)
                row = select_kernel("linear", x, q).name
                fns = (direct, lambda: F.linear(x, q), lambda: lin(x))
                paired(fns, max(a.calls // 10, 10))  # warm-up
                t_direct, t_f, t_mod = paired(fns, a.calls)
        finally:
            if a.stub:
                cpu_ext.load = real_load
        med = statistics.median
        extra_f = med([f - d for f, d in zip(t_f, t_direct)])
        extra_m = med([m - d for m, d in zip(t_mod, t_direct)])
        print(f"| {name} | {row} | {med(t_direct):.1f} | {med(t_f):.1f} | {extra_f:.1f} | {med(t_mod):.1f} | {extra_m:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
