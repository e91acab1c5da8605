"""hf_aoq's CPU kernels for IntxTensor (1-8 bit codes in the canonical bit streams, csrc/intx.cpp),
and for IntxDQTensor, whose 2- and 3-bit codes are the same bit streams (the end of this file).

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
from .registry import CANONICAL, Packing, opaque_op, register_kernel, register_packing

# Measured with bf16 activations, 2048x5632, groups of 32, 2 threads on a busy 2-vCPU Xeon
# (AVX-512 build; best of interleaved rounds, GEMV / dequantize + float32 GEMM): int2 0.03, 0.11,
# 0.34, 0.53 at 4, 8, 16, 32 rows; int4 0.05, 0.15, 0.33, 0.6 there and 0.45, 0.73 at 48, 64. The
# GEMV decodes the weight once per tile of 4 activation rows (2 on AVX2), so its time grows with
# the rows; the dequantization bounds the other path (then scalar code, about 30 ms for this
# weight; eight codes per vector step since, 3 ms: below). AVX2 not measured.
INTX_GEMV_MAX_ROWS = 64
# bf16 activations where aten's bf16 GEMM is native (AMX, AVX512-BF16): from cpu_gemm.MIN_ROWS
# "intx" rows, dequantize to bf16 + aten's GEMM (the same dequantization, a faster GEMM than
# float32's). With the vector dequantization (5632x2048 weight, 3-bit codes in groups of 32, bf16,
# 2 threads on the 2-vCPU Xeon, AMX; best of 15): dequantize to bf16 14.5 -> 3.3 ms for IntxDQ
# (the scalar loop's byte-wise copy stalled on its reload), and GEMV / (dequantize + AMX GEMM) in
# ms, IntxDQ int3 then Intx int3-asym: 2.37 / 3.69 and 2.51 / 3.40 at 16 rows, 4.56 / 3.67 and
# 4.47 / 3.77 at 24, 5.93 / 3.99 at 32, 9.23 / 3.99 at 64: so from 20 rows on AMX (65, just above
# the GEMV, where AVX512-BF16 has no AMX: not re-measured there). Where hf_aoq's own AMX tiles run
# (cpu_amx.py), they come first: from 7 rows for both (cpu_amx.MIN_ROWS), faster than both.
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


# ---------------------------------------------------------------------- IntxDQTensor
# The same C++ kernels: IntxDQ's codes are IntxTensor's bit streams, and each group's scale d and
# centre c (w = (q - (2^b - 1) / 2) * d + c) are decoded per row from the 4-bit indices (gparams)
# on the row's grid (dlo, dstep, clo, cstep), which the CPU packing keeps decoded after T_d and T_c
# in tparams (float32 [2 + 4N], 16 bytes a row; a canonical weight's [2] is decoded per call).
# Weight-only; the GEMV at up to INTX_GEMV_MAX_ROWS rows, float32 dequantize + GEMM above, and
# with bf16 activations on a native bf16 GEMM the dequantized weight (the reference's bits) and
# aten's GEMM from the same crossover as IntxTensor's.
@opaque_op("intxdq_linear_io_cpu", _linear_out)
def intxdq_linear_io(
    x: torch.Tensor, qdata: torch.Tensor, gparams: torch.Tensor, rparams: torch.Tensor, tparams: torch.Tensor,
    bits: int, group_size: int, k: int, bias: Optional[torch.Tensor],
) -> torch.Tensor:
    with torch.no_grad():
        return cpu_ext.load().intxdq_linear_io(x, qdata, gparams, rparams, tparams, bits, group_size, k, bias,
                                               INTX_GEMV_MAX_ROWS)


def _dq_dequantize_fake(qdata, gparams, rparams, tparams, bits, group_size, k, dtype):
    return qdata.new_empty((qdata.shape[0], k), dtype=dtype)


@opaque_op("intxdq_dequantize_cpu", _dq_dequantize_fake)
def intxdq_dequantize(qdata: torch.Tensor, gparams: torch.Tensor, rparams: torch.Tensor, tparams: torch.Tensor,
                      bits: int, group_size: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The IntxDQ weight [N, k] in dtype, bit for bit the reference's dequantize(dtype)."""
    return cpu_ext.load().intxdq_dequantize(qdata, gparams, rparams, tparams, bits, group_size, k, dtype)


def _dq_fields_fit(w) -> bool:
    """The canonical 2-D layout the C++ reads (3-D fused experts go to the reference)."""
    return (
        w.bits in BITS
        and w.qdata.ndim == 2
        and w.qdata.is_contiguous()
        and w.gparams.is_contiguous()
        and w.tparams.dtype == torch.float32
    )


def pack_intxdq_for_cpu(w):
    """The canonical fields, tparams followed by the decoded row table the kernels read (float32
    [2 + 4N]: T_d, T_c, then dlo, dstep, clo, cstep per row): made once here, so that no call
    decodes it, eager or compiled (a compiled graph reads the weight's fields as they are; decoded
    per call, the table cost a Zen 4's compiled int3-dq decode step 1.4%, Int4DQ's 3-9%:
    docs/performance.md)."""
    tparams = w.tparams.contiguous()
    table = cpu_ext.load().int4dq_row_params(w.rparams.contiguous(), tparams)
    return w.replace(tparams=torch.cat([tparams, table.reshape(-1)]), packing="cpu_intxdq")


def unpack_intxdq_from_cpu(w):
    return w.replace(tparams=w.tparams[:2].clone(), packing=None)


# The kernels below read a canonical weight too (decoding its table per call): a tied weight that
# an embedding also reads stays canonical (placement is for weights linears alone read).
register_packing(
    Packing("cpu_intxdq", "IntxDQTensor", "cpu", 10, _dq_fields_fit, pack_intxdq_for_cpu, unpack_intxdq_from_cpu,
            needs=(CPU_EXT,), helps_canonical_readers=True)
)
DQ_READS = (CANONICAL, "cpu_intxdq")


@register_kernel("linear", "IntxDQTensor", "cpu_intxdq_ext", backend="cpu", priority=20, device="cpu", reads=DQ_READS,
                 needs=(CPU_EXT,), when=lambda x, w: x.dtype in FLOATS and _dq_fields_fit(w))
def intxdq_cpu_linear(x, w, bias):
    """The integer GEMV at few rows, float32 dequantize + GEMM above (csrc/intx.cpp)."""
    return intxdq_linear_io(x, w.qdata, w.gparams, w.rparams, w.tparams, w.bits, w.block_size[-1], _in_features(w),
                            bias)


@register_kernel("linear", "IntxDQTensor", "cpu_intxdq_bf16_gemm", backend="cpu", priority=30, device="cpu",
                 reads=DQ_READS, needs=(CPU_EXT, BF16_GEMM), when=many_bf16_rows("intx", _dq_fields_fit))
def intxdq_bf16_gemm_linear(x, w, bias):
    """The reference's numbers bit for bit: the same dequantized weight and the same F.linear."""
    weight = intxdq_dequantize(w.qdata, w.gparams, w.rparams, w.tparams, w.bits, w.block_size[-1], _in_features(w),
                               x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
