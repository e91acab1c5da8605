"""hf_aoq's CPU kernels for Float8SemiSparseTensor (2:4 sparse e4m3 weights, csrc/fp8_sparse.cpp).

Few rows: a GEMV that reads only the kept values and their 2-bit positions, gathers the
activation element each value meets and multiplies in float32 on the exact weight: K/2
multiply-adds per output instead of K, and about 5 bits read per weight instead of 8. Above
FP8_SPARSE_GEMV_MAX_ROWS rows the weight is dequantized in C++ (bit for bit the reference's
dequantize(x.dtype)) and aten's GEMM in x's dtype runs: the reference's numbers, faster. Both
take the activation fake-quantized first, exactly as the reference (Float8Tensor's dynamic path).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import cpu_ext
from .common import FLOATS, rows as _rows
from .cpu import CPU_EXT, _in_features, _linear_out
from .registry import opaque_op, register_kernel

# Measured on the 2-vCPU AVX-512/AMX Xeon, busy (load 14-20 from other processes), 2048x5632, bf16
# activations, 1 thread, best of 30 (10 at 16+ rows) calls; milliseconds, e4m3 per-token activations:
#   rows                      1     4     8    16    32    64
#   sparse GEMV             0.61  1.55  2.98  40.6  89.6   301
#   dense fp8 (cpu_fp8_*)   0.75  1.30  3.06  37.0  58.1   127
#   bf16 F.linear (AMX)     1.31  1.21  1.49  1.59  2.01  3.31
#   dequantize + GEMM       101    66    81    86   112   100   (an earlier run: 91 / 77 / 95 at 16 / 32 / 64)
# Weight-only batch 1: sparse 0.52, dense fp8 0.65 (0.80x its time; 5 bits read per weight
# against 8). Each weight row is decoded once per four activation rows and every activation row
# costs its K/2 multiply-adds, so the GEMV grows with the rows; the dequantization writes a whole
# bf16 weight (most of its time here is first touching fresh memory, on a machine whose memory
# bandwidth the other processes took: a plain 23 MB copy took 15 ms), so it wins from about 32-64
# rows. The many-row rows (16+) are noise-dominated on this machine; re-measure on a quiet one.
FP8_SPARSE_GEMV_MAX_ROWS = 32


@opaque_op("fp8_sparse_linear_io_cpu", _linear_out)
def fp8_sparse_linear_io(
    x: torch.Tensor, qdata: torch.Tensor, positions: torch.Tensor, scale: torch.Tensor, k: int,
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    return cpu_ext.load().fp8_sparse_linear_io(x, qdata, positions, scale, k, bias)


def _dequantize_fake(qdata, positions, scale, k, dtype):
    return qdata.new_empty((qdata.shape[0], k), dtype=dtype)


@opaque_op("fp8_sparse_dequantize_cpu", _dequantize_fake)
def fp8_sparse_dequantize(
    qdata: torch.Tensor, positions: torch.Tensor, scale: torch.Tensor, k: int, dtype: torch.dtype
) -> torch.Tensor:
    return cpu_ext.load().fp8_sparse_dequantize(qdata, positions, scale, k, dtype)


def _plain_2d(x, w) -> bool:
    return (x.dtype in FLOATS and w.qdata.ndim == 2 and w.qdata.is_contiguous() and w.positions.is_contiguous()
            and w.scale.is_contiguous())


@register_kernel("linear", "Float8SemiSparseTensor", "cpu_fp8_sparse_gemv", backend="cpu", priority=20,
                 device="cpu", needs=(CPU_EXT,), when=lambda x, w: _plain_2d(x, w) and _rows(x) <= FP8_SPARSE_GEMV_MAX_ROWS)
def fp8_sparse_cpu_linear(x, w, bias):
    """Few rows: float32 on the kept values only."""
    x = w.simulate_input_quantization(x)
    return fp8_sparse_linear_io(x, w.qdata.view(torch.uint8), w.positions, w.scale.reshape(-1), _in_features(w), bias)


@register_kernel("linear", "Float8SemiSparseTensor", "cpu_fp8_sparse_dequant_gemm", backend="cpu", priority=10,
                 device="cpu", needs=(CPU_EXT,), when=_plain_2d)
def fp8_sparse_cpu_dequant_linear(x, w, bias):
    """Many rows: the reference's dequantize(x.dtype) in C++, then the reference's F.linear."""
    x = w.simulate_input_quantization(x)
    weight = fp8_sparse_dequantize(w.qdata.view(torch.uint8), w.positions, w.scale.reshape(-1), _in_features(w), x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
