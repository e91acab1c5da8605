"""Float8 weights x bf16 activations at a few rows on AVX512-BF16's dot products (csrc/fp8.cpp
fp8_dpbf16_linear): every float8 value is a bf16 value, so the codes become their exact bf16 bits by
byte-table lookups in registers (AVX512-VBMI) and VDPBF16PS multiplies them with x in place, 32
products an instruction where the float32 GEMV (cpu.py's cpu_fp8_gemv) does 16; the row's scale
multiplies each float32 sum, which is rounded once to bf16. The reference rounds code x scale to
bf16 first (as the panel rows of cpu_amx.py do), so the outputs agree with it within that rounding
of the weight, as the float32 GEMV's do.

One row of the kernel table, `cpu_fp8_dpbf16`, from FP8_DPBF16_MIN_ROWS to FP8_DPBF16_MAX_ROWS rows,
where AVX512-BF16 runs without AMX (cpu_amx.AVX512_BF16: AMD EPYC Zen 4 and Zen 5) and the CPU has
AVX512-VBMI. At one row the float32 GEMV stays (as fast: both read the weight at the memory's
rate); above the rows the panel GEMM (cpu_fp8_avx512bf16) takes over. Where AMX is, its tiles and
the GEMV keep these rows (not measured there).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import cpu_ext
from .build_cache import cpu_features
from .common import rows as _rows
from .cpu import _FP8_SHIFT, CPU_EXT, _float8_cpu_applies, _in_features
from .cpu_amx import AVX512_BF16, _apply, _out, fp8_operands
from .registry import capability, opaque_op, register_kernel

# The byte permutes of the code-to-bf16 lookup (VPERMI2B); the avx512 build itself does not need it.
AVX512_VBMI = capability("cpu:avx512_vbmi", "cpu", lambda device: "avx512vbmi" in cpu_features())

# Against the rows it replaces (2-core AMD EPYC Zen 4, 2 threads, bf16 activations, 12 weights
# cycled from DRAM, medians of 7 alternated rounds, this row's time over the other's, [5632, 2048] /
# [2048, 5632]): the float32 GEMV 0.94 / 1.09 at 1 row, 0.79 / 0.90 at 2, 0.67 / 0.70 at 4; the
# panel GEMM 0.75 / 0.52 at 8, 0.90 / 0.72 at 16, 0.85 / 0.57 at 24, 0.91 / 0.88 at 28, 1.04 / 0.94
# at 32 (docs/performance.md, "Float8 x bf16 on AVX512-BF16's dot products").
FP8_DPBF16_MIN_ROWS = 2
FP8_DPBF16_MAX_ROWS = 28


@opaque_op("fp8_dpbf16_linear_cpu", _out)
def fp8_dpbf16_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, shift: int,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    return cpu_ext.load().fp8_dpbf16_linear(x, codes, scale, shift, bias)


def _applies(x, w) -> bool:
    return (x.dtype == torch.bfloat16 and FP8_DPBF16_MIN_ROWS <= _rows(x) <= FP8_DPBF16_MAX_ROWS
            and w.qdata.dtype in _FP8_SHIFT and _float8_cpu_applies(x, w))


@register_kernel("linear", "Float8Tensor", "cpu_fp8_dpbf16", backend="cpu", priority=26, device="cpu",
                 needs=(CPU_EXT, AVX512_BF16, AVX512_VBMI), when=_applies)
def fp8_dpbf16(x, w, bias):
    """Float8 weight-only (or dynamic, the input fake-quantized first) at few bf16 rows: the codes
    exact in bf16, VDPBF16PS sums, the row's scale on each sum."""
    x = w.simulate_input_quantization(x).contiguous()  # the kernel reads x's rows in place
    return _apply(x, _in_features(w), fp8_dpbf16_linear, *fp8_operands(w), bias)
