"""Many-row CPU linears for bf16 activations where aten's bf16 GEMM is native (AMX tiles, or
AVX512-BF16's dot products): hf_aoq's C++ code dequantizes the weight into bf16, then aten's GEMM
(oneDNN) multiplies.

The numbers are the reference kernel's, bit for bit: the reference dequantizes in float32, rounds
once to the activation dtype and calls F.linear; the C++ `*_dequantize` functions produce the same
weight bits (tests/kernels/test_cpu_isa.py checks equality), and the same F.linear call follows. The whole
weight is dequantized (not chunk by chunk into per-thread GEMMs): the same single GEMM call as the
reference is what makes the outputs equal.

Measured on a 2-vCPU Xeon with AMX (scripts/bench_kernels.py, 2048x5632, bf16, 256 rows, a quiet
moment): dense bf16 3.5 ms, hf_aoq's int16-code int4 kernel 27 ms, float32 dequantize + GEMM
17-19 ms for int8 and float8; with these rows 0.3-0.4x those times (README's CPU kernel section).
Below `min_rows(format)` rows the weight-streaming kernels of cpu.py win (decode is bandwidth:
writing and reading a whole bf16 copy of the weight costs more than the int kernels' one pass over
the codes)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import rows as _rows
from . import cpu_ext, cpu_isa
from .cpu import _FP8_SHIFT, CPU_EXT, _float8_cpu_applies, _in_features, _per_row
from .registry import capability, capable, opaque_op, register_kernel

# bfloat16 only: float16 GEMMs have no AMX here (AMX-FP16 is a later CPU), and measured slower than
# float32 ones (2048x5632, 256 rows: dense fp16 0.90x dense fp32 time, 4.0x dense bf16).
HALF = (torch.bfloat16,)

# Where aten's bf16 GEMM is native: AMX, or AVX512-BF16 (no AMX). On a 2-core AMD EPYC Zen 5 (AVX512-BF16,
# no AMX; scripts/bench_kernels.py, 5632x2048, 256 rows, 1 thread) dense bf16 takes 16.4 ms against
# dense float32's 83: dequantize into bf16 + that GEMM beats every float32 path there (int8 and
# float8 at 0.24-0.26x their time at 256 rows, int4 0.6-0.75x the int16-code kernel's). An earlier
# measurement on the Xeon with oneDNN held to AVX512_CORE_BF16 (ONEDNN_MAX_CPU_ISA) had it losing
# at 16-128 rows; the Zen 5 rows below are what a real AVX512-BF16 CPU without AMX gives.
BF16_GEMM = capability("cpu:bf16_gemm", "cpu", lambda device: cpu_isa.bf16_gemm_isa() is not None)
BF16_GEMM_AMX = capability("cpu:bf16_gemm_amx", "cpu", lambda device: cpu_isa.bf16_gemm_isa() == "amx")

# Fewest activation rows at which dequantize + GEMM beats the weight-streaming kernels, per GEMM
# instruction set and format.
# AMX: measured (ratios of medians within interleaved rounds, 2048x5632 and 5632x2048, bf16) on a busy
# 2-vCPU Xeon. int4 against the int16-code kernel (AVX-512 VNNI build): new/old 1.1-1.7
# at 32-48 rows, 0.8-1.1 at 64, 0.5 at 128, 0.4 at 256. int8 and float8 against their GEMVs (up to
# 8 and 16 rows) and float32 dequantize + GEMM above: 1.5-2.8 at 8 rows, 0.6-0.95 at 16, 0.3 at 256.
# Against the tiled int8/float8 GEMVs (4 x 6 register tiles, kernels/cpu.py): 2.9-3.7 at 8 rows,
# 2.5 at 16, 1.1-1.15 at 32, 0.88-0.9 at 48, so they start at 40 (the GEMVs' limit there). Intx
# (IntxDQ too) and FPx: kernels/cpu_intx.py and cpu_fpx.py.
# AVX512-BF16 (the Zen 5 above, both shapes, 1 thread, medians of 7 interleaved rounds, GEMM row /
# streaming kernel): int4 g128 1.59/1.40 at 64 rows, 1.00/1.05 at 128, 0.86/0.82 at 192, 0.72/0.75
# at 256; Int4DQ g32 1.29/1.30 at 64, 1.13/0.99 at 96, 0.85/1.00 at 128, 0.79/0.69 at 192; int8
# 0.83/1.18 at 32, 0.50/0.57 at 48; float8 0.89/1.18 at 32, 0.44/0.57 at 48; int3 g32 asym (Intx)
# 1.35/1.55 at 64, 0.63/0.65 at 96; fp6 e3m2 (FPx, against float32 dequantize + GEMM) 0.91/1.09 at
# 5 rows, 0.90/1.06 at 8, 0.72/0.82 at 12, 0.79/0.76 at 16.
MIN_ROWS = {
    "amx": {"int4": 96, "int4dq": 96, "int8": 40, "fp8": 40, "intx": 20, "fpx": 64},
    "avx512_bf16": {"int4": 160, "int4dq": 128, "int8": 40, "fp8": 40, "intx": 65, "fpx": 12},
}


def min_rows(fmt: str, device: torch.device = torch.device("cpu")) -> int:
    """Fewest bf16 activation rows at which `fmt`'s dequantize + bf16 GEMM row runs on `device`
    (only where it has a native bf16 GEMM: the BF16_GEMM capability)."""
    return MIN_ROWS["amx" if capable((BF16_GEMM_AMX,), device) else "avx512_bf16"][fmt]


def many_bf16_rows(fmt, fits=None):
    """`when` of fmt's bf16-GEMM row: bf16 activations, at least min_rows(fmt) of them, and (with
    `fits`) a weight whose fields the C++ reads."""
    def when(x, w) -> bool:
        return x.dtype in HALF and _rows(x) >= min_rows(fmt, x.device) and (fits is None or fits(w))
    return when


def _weight_fake(*args):
    # Every *_dequantize op's fake: [N, k] in the requested dtype (the last two arguments).
    packed, k, dtype = args[0], args[-2], args[-1]
    return packed.new_empty((packed.shape[0], k), dtype=dtype)


@opaque_op("int4_dequantize_cpu", _weight_fake)
def int4_dequantize(packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int, k: int,
                    dtype: torch.dtype) -> torch.Tensor:
    return cpu_ext.load().int4pack_dequantize(packed, scale_zero, group_size, k, dtype)


@opaque_op("int4dq_dequantize_cpu", _weight_fake)
def int4dq_dequantize(packed: torch.Tensor, gparams: torch.Tensor, rparams: torch.Tensor, tparams: torch.Tensor,
                      group_size: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return cpu_ext.load().int4dq_dequantize(packed, gparams, rparams, tparams, group_size, k, dtype)


@opaque_op("int8_dequantize_cpu", _weight_fake)
def int8_dequantize(q: torch.Tensor, scale: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    return cpu_ext.load().int8_dequantize(q, scale, dtype)


@opaque_op("fp8_dequantize_cpu", _weight_fake)
def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, shift: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return cpu_ext.load().fp8_dequantize(codes, scale, shift, dtype)


def _linear(x, weight, bias):
    # The reference's call: F.linear in x's dtype, the bias cast to it.
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def _int4(x, w, bias):
    x = w.simulate_input_quantization(x)
    return _linear(x, int4_dequantize(w.qdata, w.scale, w.block_size[-1], _in_features(w), x.dtype), bias)


def _int4dq(x, w, bias):
    weight = int4dq_dequantize(w.qdata, w.gparams, w.rparams, w.tparams, w.block_size[-1], _in_features(w), x.dtype)
    return _linear(x, weight, bias)


def _int8(x, w, bias):
    x = w.simulate_input_quantization(x)
    return _linear(x, int8_dequantize(w.qdata, w.scale, w.qdata.shape[1], x.dtype), bias)


def _fp8(x, w, bias):
    x = w.simulate_input_quantization(x)
    codes = w.qdata
    scale = w.scale.reshape(-1).float().expand(codes.shape[0]).contiguous()
    return _linear(x, fp8_dequantize(codes.view(torch.uint8), scale, _FP8_SHIFT[codes.dtype], codes.shape[1], x.dtype),
                   bias)


def _contiguous(*tensors) -> bool:
    return all(t.is_contiguous() for t in tensors)


_NEEDS = (CPU_EXT, BF16_GEMM)
_int4_rows, _int4dq_rows, _int8_rows, _fp8_rows = (many_bf16_rows(f) for f in ("int4", "int4dq", "int8", "fp8"))
register_kernel("linear", "Int4Tensor", "cpu_int4_bf16_gemm", backend="cpu", priority=30, reads=("cpu_int4_pairs",),
                device="cpu", needs=_NEEDS, when=lambda x, w: _int4_rows(x, w) and _contiguous(w.qdata, w.scale))(_int4)
register_kernel("linear", "Int4DQTensor", "cpu_int4dq_bf16_gemm", backend="cpu", priority=30, reads=("cpu_int4dq",),
                device="cpu", needs=_NEEDS, when=lambda x, w: _int4dq_rows(x, w) and _contiguous(w.qdata, w.gparams))(_int4dq)
register_kernel("linear", "Int8Tensor", "cpu_int8_bf16_gemm", backend="cpu", priority=30, device="cpu", needs=_NEEDS,
                when=lambda x, w: _int8_rows(x, w) and _per_row(w) and w.qdata.is_contiguous())(_int8)
register_kernel("linear", "Float8Tensor", "cpu_fp8_bf16_gemm", backend="cpu", priority=20, device="cpu", needs=_NEEDS,
                when=lambda x, w: _fp8_rows(x, w) and _float8_cpu_applies(x, w))(_fp8)
