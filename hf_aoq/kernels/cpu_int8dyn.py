"""Int8 weights with dynamic per-token int8 activations (Int8Tensor act_quant="per_token") in exact
integer sums on CPU (csrc/int8dyn.cpp): the activations' codes and scales are the reference's
(common.quantize_int8_per_token, computed in C++), the codes multiply the weight's in exact int32
sums, and each output is float32 sum x row scale x weight row scale (+ bias), rounded once to x's
dtype. Two rows of the kernel table, the same bits from both:

- `cpu_int8dyn_amx`: AMX's int8 tiles, from INT8DYN_MIN_ROWS rows, where AMX-INT8 is granted;
- `cpu_int8dyn_vnni`: AVX-512 VNNI's VPDPBUSD, at any rows (a GEMV that streams the weight up to
  INT8DYN_VNNI_GEMV_MAX_ROWS rows, amx_gemm.h's dot-product panel loop above), wherever the
  extension's avx512 build runs (its CPUs all have VNNI): below the tiles' rows on an AMX machine,
  all rows on AMD EPYC Zen 4 / Zen 5.

The reference rounds the dequantized activations and weight to x's dtype before its float32 sums,
so these outputs differ from it by that rounding, not by the integer products. Elsewhere (AVX2)
int8dyn runs on cpu.py's cpu_int8_ext, which computes the reference's numbers in float32.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import cpu_ext
from .common import FLOATS
from .common import rows as _rows
from .cpu import CPU_EXT, _per_row
from .cpu_amx import AMX_INT8, _apply, _out
from .registry import capability, opaque_op, register_kernel

# The avx512 build of the extension, whose CPUs all have AVX-512 VNNI (cpu_ext.ISAS).
AVX512_VNNI = capability("cpu:avx512_vnni_kernels", "cpu",
                         lambda device: cpu_ext.available() and cpu_ext.chosen_isa() == "avx512")

# The int8 tiles (cpu_int8dyn_amx) against cpu.py's GEMV on the activations fake-quantized in the
# same C++ call (cpu_int8_ext; 2-vCPU Xeon, weights from DRAM, 64 copies cycled, 2048x5632 /
# 5632x2048, tiles / GEMV): 1.39 / 1.06 at 1 row, 1.04 / 1.03 at 2, 0.97 / 0.85 at 4, 0.46 / 0.42
# at 8, 0.29 / 0.29 at 16. (At one row the GEMV reads the weight at 21 GB/s, the tiles' panel
# writer at 13-15.) Below these rows the VNNI row runs there.
INT8DYN_MIN_ROWS = 4
# Input features whose sums of code products surely fit in int32 (127 x 127 x K < 2^31;
# csrc/int8dyn.cpp kInt8DynMaxK): wider weights run cpu.py's float32 path.
INT8DYN_MAX_K = 131072
# The VNNI GEMV against the dot-product loop (2-core AMD EPYC Zen 4, 2 threads, bf16 activations,
# 12 weights cycled from DRAM, medians of 5 alternated rounds, ms, 5632x2048 / 2048x5632): 16 rows
# 0.90 / 0.65 against 0.82 / 1.06, 20 rows 1.07 / 0.78 against 1.24 / 1.37, 24 rows 1.13 / 0.88
# against 1.27 / 1.27, 28 rows 1.41 / 1.21 against 1.25 / 1.16, 32 rows 1.42 / 1.40 against 1.25 /
# 1.18. Against the int8dyn path before it (cpu_int8_ext: the activations fake-quantized, float32
# GEMV) the GEMV took 1.0x its time at 1 row, 0.57 / 0.67 at 4, 0.28 / 0.21 at 16; the loop at 256
# rows took 0.51 / 0.55 of dense bf16 F.linear's time (the bf16 panel loop for weight-only int8
# 1.00 / 1.03): ~820 GOP/s of int8 products where AVX512-BF16 gives ~420 GFLOP/s.
INT8DYN_VNNI_GEMV_MAX_ROWS = 24


@opaque_op("int8dyn_amx_linear_cpu", _out)
def int8dyn_amx_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> torch.Tensor:
    return cpu_ext.load().int8dyn_amx_linear(x, qdata, scale, bias)


@opaque_op("int8dyn_vnni_linear_cpu", _out)
def int8dyn_vnni_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                        bias: Optional[torch.Tensor], gemv_max_rows: int) -> torch.Tensor:
    return cpu_ext.load().int8dyn_vnni_linear(x, qdata, scale, bias, gemv_max_rows)


def _int8dyn_fits(x, w) -> bool:
    # Dynamic per-token int8 activations, a scale per weight row, N a multiple of 32 and K of 64
    # (a 64-byte step, 32 output columns a block) up to INT8DYN_MAX_K; any float activations
    # (quantized inside, from their own dtype), rows contiguous.
    if w.act_quant != "per_token" or x.dtype not in FLOATS or not (_per_row(w) and w.qdata.is_contiguous()):
        return False
    n, k = w.qdata.shape
    return n % 32 == 0 and k % 64 == 0 and k <= INT8DYN_MAX_K and x.stride(-1) == 1


def _int8dyn_tile_rows(x, w) -> bool:
    return _int8dyn_fits(x, w) and _rows(x) >= INT8DYN_MIN_ROWS


def _int8dyn_any_rows(x, w) -> bool:
    return _int8dyn_fits(x, w)


@register_kernel("linear", "Int8Tensor", "cpu_int8dyn_amx", backend="cpu", priority=40, device="cpu",
                 needs=(CPU_EXT, AMX_INT8), when=_int8dyn_tile_rows)
def int8dyn_amx(x, w, bias):
    """Int8 weights with dynamic int8 activations on AMX's int8 tiles (TDPBSSD), exact int32 sums."""
    return _apply(x, w.qdata.shape[1], int8dyn_amx_linear, w.qdata, w.scale, bias)


@register_kernel("linear", "Int8Tensor", "cpu_int8dyn_vnni", backend="cpu", priority=38, device="cpu",
                 needs=(CPU_EXT, AVX512_VNNI), when=_int8dyn_any_rows)
def int8dyn_vnni(x, w, bias):
    """Int8 weights with dynamic int8 activations on AVX-512 VNNI (VPDPBUSD), exact int32 sums:
    the same bits as cpu_int8dyn_amx."""
    return _apply(x, w.qdata.shape[1], int8dyn_vnni_linear, w.qdata, w.scale, bias, INT8DYN_VNNI_GEMV_MAX_ROWS)
