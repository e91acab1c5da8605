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
from .common import FLOATS
from .cpu import CPU_EXT, _in_features, _linear_out
from .registry import opaque_op, register_kernel

# Crossover with dequantize + GEMM, measured (scripts/bench_kernels.py style, see the commit
# introducing it): each weight row is decoded once per four activation rows and gathers once per
# activation row, so the GEMV's time grows with the rows faster than a GEMM's.
FP8_SPARSE_GEMV_MAX_ROWS = 16


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


def _rows(x) -> int:
    k = x.shape[-1]
    return x.numel() // k if k else 0


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
