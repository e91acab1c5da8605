"""hf_aoq's CPU kernels for MXTensor (csrc/mx.cpp, csrc/mx_quant.cpp): every element format (e2m1,
e4m3, e5m2), weight-only or with MX activations (the `mxfp4` / `mxfp8` schemes: e4m3 activations
in the same blocks of 32).

- Few rows (up to MX_GEMV_MAX_ROWS): a GEMV that decodes the MX bytes in registers (a 16-entry
  e2m1 table times the block's scale; float8 by a bit trick) into the reference's float32 weight
  and computes in float32. Dynamic activations are quantized first in C++ exactly as the
  reference's simulate_input_quantization (the same codes and values, bit for bit).
- More rows: the activations quantized the same way and the weight dequantized in C++ into x's
  dtype, both bit for bit the reference's, then the reference's own F.linear call: the reference's
  outputs, with its slow torch dequantization (many small ops over the whole weight) replaced.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import cpu_ext
from .common import FLOATS, rows as _rows
from .cpu import CPU_EXT, _in_features, _linear_out
from .registry import opaque_op, register_kernel

FP4 = torch.float4_e2m1fn_x2  # MXTensor's elem_dtype for e2m1 (kernels import no tensor type)
KIND = {FP4: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # csrc/mx_common.h's element kinds

# Measured on the 2-vCPU AVX-512/AMX Xeon (2048x5632, bf16 activations, best of 15 interleaved rounds,
# load average 9, 1 thread): MXFP4 GEMV 0.59 / 1.35 / 4.0 / 19.1 ms at 1 / 4 / 16 / 64 rows against
# 4.8 / 5.7 / 7.2 / 9.2 for C++ dequantize + aten's AMX GEMM (the reference: about 200 ms at any
# rows); the same run's int4 g32 1.16 / 1.89 / 4.3 / 13.5, dense bf16 2.0 / 2.1 / 2.3 / 3.6.
MX_GEMV_MAX_ROWS = 16


@opaque_op("mx_linear_io_cpu", _linear_out)
def mx_linear_io(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, kind: int, k: int, bias: Optional[torch.Tensor],
    act_kind: int,
) -> torch.Tensor:
    return cpu_ext.load().mx_linear_io(x, qdata, scale, kind, k, bias, act_kind)


@opaque_op("mx_fake_quantize_cpu", lambda x, kind: torch.empty_like(x))
def mx_fake_quantize(x: torch.Tensor, kind: int) -> torch.Tensor:
    return cpu_ext.load().mx_fake_quantize(x, kind)


@opaque_op("mx_dequantize_cpu", lambda qdata, scale, kind, k, dtype: qdata.new_empty((qdata.shape[0], k), dtype=dtype))
def mx_dequantize(qdata: torch.Tensor, scale: torch.Tensor, kind: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return cpu_ext.load().mx_dequantize(qdata, scale, kind, k, dtype)


def mx_quantize(x: torch.Tensor, elem_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdata, scale) of x in MX blocks of 32 along the last dim, computed in C++: tensors/mx.py's
    mx_quantize, bit for bit (what the fast paths quantize activations with)."""
    qdata, scale = cpu_ext.load().mx_quantize_rows(x, KIND[elem_dtype])
    return qdata, scale


def _mx_applies(x, w) -> bool:
    # The C++ kernels have no backward: with grad mode on, the reference (differentiable) runs.
    return (not torch.is_grad_enabled() and x.dtype in FLOATS and w.qdata.ndim == 2 and w.elem_dtype in KIND
            and (w.act_dtype is None or w.act_dtype in KIND))


def _act_kind(w) -> int:
    return -1 if w.act_dtype is None else KIND[w.act_dtype]


def _gemv_applies(x, w) -> bool:
    return _mx_applies(x, w) and _rows(x) <= MX_GEMV_MAX_ROWS


@register_kernel("linear", "MXTensor", "cpu_mx_gemv", backend="cpu", priority=20, device="cpu", needs=(CPU_EXT,),
                 when=_gemv_applies)
def mx_cpu_linear(x, w, bias):
    """Up to MX_GEMV_MAX_ROWS rows, in float32 on the exact weight (activations quantized first
    for the dynamic variants)."""
    return mx_linear_io(x, w.qdata, w.scale, KIND[w.elem_dtype], _in_features(w), bias, _act_kind(w))


@register_kernel("linear", "MXTensor", "cpu_mx_dequant_gemm", backend="cpu", priority=10, device="cpu",
                 needs=(CPU_EXT,), when=_mx_applies)
def mx_cpu_dequant_linear(x, w, bias):
    """Many rows: the reference's computation (activations quantized, weight dequantized into x's
    dtype, F.linear), with both done in C++: the same bits, faster."""
    if w.act_dtype is not None:
        x = mx_fake_quantize(x, KIND[w.act_dtype])
    weight = mx_dequantize(w.qdata, w.scale, KIND[w.elem_dtype], _in_features(w), x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
