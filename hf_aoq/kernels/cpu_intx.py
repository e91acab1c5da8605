"""hf_aoq's CPU kernels for IntxTensor (1-8 bit codes in the canonical bit streams, csrc/intx.cpp).

Few rows (up to INTX_GEMV_MAX_ROWS): an integer GEMV that decodes the packed codes in registers,
so that it reads b/8 bytes per weight, with int16 activation codes per group (weight-only) or
Int8Tensor's per-token int8 codes (act_quant "per_token"), exact int32 sums and float32 scaling.
Groups of 32, 64, 128 or 256, a multiple of 256, or one per row; other groups (16) and more rows:
the weight dequantized exactly in float32 chunks and a float32 GEMM, in the same C++ call. With
bf16 activations at many rows on CPUs where aten's bf16 GEMM is native (AMX or AVX512-BF16), the
weight dequantized to bf16 (bit for bit the reference's) and aten's GEMM.

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

# Measured with bf16 activations, 2048x5632, groups of 32, 2 threads on a busy 2-vCPU Xeon
# (AVX-512 build; best of interleaved rounds, GEMV / dequantize + float32 GEMM): int2 0.03, 0.11,
# 0.34, 0.53 at 4, 8, 16, 32 rows; int4 0.05, 0.15, 0.33, 0.6 there and 0.45, 0.73 at 48, 64. The
# GEMV decodes the weight once per tile of 4 activation rows (2 on AVX2), so its time grows with
# the rows; the dequantization (scalar code, about 30 ms for this weight) bounds the other path.
# AVX2 not measured.
INTX_GEMV_MAX_ROWS = 64
# bf16 activations where aten's bf16 GEMM is native (AMX, AVX512-BF16): above the GEMV's rows
# (cpu_gemm.MIN_ROWS "intx", INTX_GEMV_MAX_ROWS + 1 on both), dequantize to bf16 + aten's GEMM (the
# same dequantization, a faster GEMM than float32's).
# Batch 1 against int4 g32 (Int4Tensor's int16-code kernel through F.linear), 2048x5632, bf16,
# asymmetric groups of 32, scripts/bench_kernels.py --rows 1 --only intx,"int4 g32" --rounds 60,
# best of interleaved rounds as ratios (AVX-512 VNNI build, load average ~18 on 2 vCPUs): 1 thread
# int2 0.48, int3 0.64, int4 0.72, int8 1.16; 2 threads 0.56, 0.71, 0.78, 1.21; an earlier quieter
# run 0.62, 0.75, 0.73, 1.06. (The int4 row includes F.linear's dispatch, a few microseconds.)
BITS = tuple(range(1, 9))
# Not "per_token_asymmetric" (IntxTensor's torchao-style activations with zero points): the C++
# reads symmetric int8 codes only, so those weights run on the reference kernel.
ACT_QUANTS = (None, "per_token")


@opaque_op("intx_linear_io_cpu", _linear_out)
def intx_linear_io(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], bits: int,
    group_size: int, k: int, bias: Optional[torch.Tensor], int8_activations: bool,
) -> torch.Tensor:
    # Inference kernels, as every C++ row: no autograd graph (the float GEMM above the GEMV rows
    # writes into an output tensor, which autograd refuses when the bias requires grad).
    with torch.no_grad():
        return cpu_ext.load().intx_linear_io(x, qdata, scale, zero, bits, group_size, k, bias, INTX_GEMV_MAX_ROWS,
                                             int8_activations)


def intx_linear(x, qdata, scale, zero, bits, group_size, in_features, bias=None):
    """F.linear(x, IntxTensor weight, bias) from the weight's canonical fields, weight-only."""
    return intx_linear_io(x, qdata, scale, zero, bits, group_size, in_features, bias, False)


def intx_int8_linear(x, qdata, scale, zero, bits, group_size, in_features, bias=None):
    """As `intx_linear`, with the activations quantized to int8 per token (Int8Tensor's codes)."""
    return intx_linear_io(x, qdata, scale, zero, bits, group_size, in_features, bias, True)


def _dequantize_fake(qdata, scale, zero, bits, group_size, k, dtype):
    return qdata.new_empty((qdata.shape[0], k), dtype=dtype)


@opaque_op("intx_dequantize_cpu", _dequantize_fake)
def intx_dequantize(qdata: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], bits: int,
                    group_size: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, k] in dtype, bit for bit the reference's dequantize(dtype)."""
    return cpu_ext.load().intx_dequantize(qdata, scale, zero, bits, group_size, k, dtype)


def _fields_fit(w) -> bool:
    """The canonical 2-D layout the C++ reads: contiguous fields, one scale dtype."""
    zero = w.zero
    return (
        getattr(w, "packing", None) is None
        and w.bits in BITS
        and getattr(w, "act_quant", None) in ACT_QUANTS
        and w.qdata.ndim == 2
        and w.qdata.dtype == torch.uint8
        and w.qdata.is_contiguous()
        and w.scale.is_contiguous()
        and w.scale.dtype in FLOATS
        and (zero is None or (zero.is_contiguous() and zero.dtype == w.scale.dtype))
    )


def _intx_applies(x, w) -> bool:
    return x.dtype in FLOATS and _fields_fit(w)


@register_kernel("linear", "IntxTensor", "cpu_intx_ext", backend="cpu", priority=20, device="cpu", needs=(CPU_EXT,),
                 when=_intx_applies)
def intx_cpu_linear(x, w, bias):
    """Weight-only and int8-per-token alike: the integer GEMV at few rows, float32 dequantize +
    GEMM above (csrc/intx.cpp)."""
    return intx_linear_io(x, w.qdata, w.scale, w.zero, w.bits, w.block_size[-1], _in_features(w), bias,
                          w.act_quant == "per_token")


@register_kernel("linear", "IntxTensor", "cpu_intx_bf16_gemm", backend="cpu", priority=30, device="cpu",
                 needs=(CPU_EXT, BF16_GEMM), when=many_bf16_rows("intx", _fields_fit))
def intx_bf16_gemm_linear(x, w, bias):
    """The reference's numbers bit for bit: the same dequantized weight and the same F.linear."""
    x = w.simulate_input_quantization(x)
    weight = intx_dequantize(w.qdata, w.scale, w.zero, w.bits, w.block_size[-1], _in_features(w), x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
