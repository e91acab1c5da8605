"""hf_aoq's CPU kernels for FPxTensor (sub-byte floats in the canonical bit streams, a scale per
row; csrc/fpx.cpp).

Few rows (up to FPX_GEMV_MAX_ROWS, one register tile): a float32 GEMV that decodes 16 codes at a time by a table
lookup in registers (the table holds the 2^(b-1) magnitudes; the sign is the code's top bit), so
it reads b/8 bytes per weight, and multiplies each row's sum by its scale. More rows: the weight
dequantized exactly in float32 chunks and a float32 GEMM, in the same C++ call; with bf16
activations on CPUs where aten's bf16 GEMM is native (AMX or AVX512-BF16), the weight dequantized
to bf16 (bit for bit the reference's) and aten's GEMM, as the int4/int8/Intx bf16-GEMM rows do.

Eager and compiled calls run the same C++ entry points, through `OpaqueOp`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import cpu_ext
from .common import FLOATS
from .cpu import CPU_EXT, _in_features, _linear_out
from .cpu_gemm import BF16_GEMM, many_bf16_rows
from .registry import opaque_op, register_kernel

# Measured on the AVX-512 Xeon VM (2048x5632, fp6 e3m2, bf16 activations, 1 thread, best of 15
# interleaved rounds, load ~15 from other jobs): the GEMV 1.11 / 1.24 / 1.47 / 1.61 ms at 1-4 rows
# (one register tile) against dequantize + float32 GEMM 2.39 / 2.16 / 2.31 / 2.54; at 5-8 rows an
# earlier GEMV that read a decoded row from a buffer lost (3.2-9.4 against 2.7-3.3 ms). Above one
# tile the row is decoded once per tile, so the GEMV stops at one AVX-512 tile. AVX2 not measured.
FPX_GEMV_MAX_ROWS = 4
# bf16 activations on AMX CPUs: dequantize to bf16 + aten's GEMM from 64 rows (cpu_gemm.MIN_ROWS
# "fpx"; same run: 24.8 / 26.8 / 27.1 ms at 64 / 96 / 128 rows against float32 dequantize + GEMM's
# 43.9 / 53.7 / 66.4; at 8-32 rows it lost, 20-24 against 3.3-20.9). AVX512-BF16 without AMX: from
# 12 rows (measured on a Zen 5, cpu_gemm.py).
# Batch 1 against int4 g32 (Int4Tensor, hf_aoq's int16-code kernel through F.linear) and dense bf16,
# same machine, scripts/bench_kernels.py --rows 1 --dtypes bfloat16 --threads 1 --rounds 80 (load
# ~20), best / median ms: dense bf16 2.01 / 5.45, int4 g32 1.07 / 1.53, fp6 e3m2 1.21 / 1.38, fp5
# e2m2 0.99 / 1.17, fp4 e2m1 0.87 / 0.95. The decode (about seven vector instructions per 16
# weights) bounds it more than the bytes read: fp6 reads 1.5x int4's bytes in 1.1x its time.


@opaque_op("fpx_linear_io_cpu", _linear_out)
def fpx_linear_io(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, ebits: int, mbits: int, k: int,
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    # Inference kernels, as every C++ row: no autograd graph.
    with torch.no_grad():
        return cpu_ext.load().fpx_linear_io(x, qdata, scale, ebits, mbits, k, bias, FPX_GEMV_MAX_ROWS)


def _dequantize_fake(qdata, scale, ebits, mbits, k, dtype):
    return qdata.new_empty((qdata.shape[0], k), dtype=dtype)


@opaque_op("fpx_dequantize_cpu", _dequantize_fake)
def fpx_dequantize(qdata: torch.Tensor, scale: torch.Tensor, ebits: int, mbits: int, k: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, k] in dtype, bit for bit the reference's dequantize(dtype)."""
    return cpu_ext.load().fpx_dequantize(qdata, scale, ebits, mbits, k, dtype)


def _fields_fit(w) -> bool:
    """The canonical 2-D layout the C++ reads: contiguous uint8 codes, a float scale per row."""
    return (
        w.qdata.ndim == 2
        and w.qdata.dtype == torch.uint8
        and w.qdata.is_contiguous()
        and w.scale.is_contiguous()
        and w.scale.dtype in FLOATS
    )


def _fpx_applies(x, w) -> bool:
    return x.dtype in FLOATS and _fields_fit(w)


@register_kernel("linear", "FPxTensor", "cpu_fpx_ext", backend="cpu", priority=20, device="cpu", needs=(CPU_EXT,),
                 when=_fpx_applies)
def fpx_cpu_linear(x, w, bias):
    """The table-lookup GEMV at few rows, float32 dequantize + GEMM above (csrc/fpx.cpp)."""
    return fpx_linear_io(x, w.qdata, w.scale, w.ebits, w.mbits, _in_features(w), bias)


@register_kernel("linear", "FPxTensor", "cpu_fpx_bf16_gemm", backend="cpu", priority=30, device="cpu",
                 needs=(CPU_EXT, BF16_GEMM), when=many_bf16_rows("fpx", _fields_fit))
def fpx_bf16_gemm_linear(x, w, bias):
    """The reference's numbers bit for bit: the same dequantized weight and the same F.linear."""
    weight = fpx_dequantize(w.qdata, w.scale, w.ebits, w.mbits, _in_features(w), x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
