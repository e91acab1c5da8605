"""hf_aoq's CPU kernels for NVFP4Tensor (csrc/nvfp4.cpp, csrc/nvfp4_quant.cpp), weight-only or with
NVFP4 activations (the `nvfp4` scheme: activations quantized at run time in the same blocks of 16,
with a per-tensor scale from their own amax).

- Few rows (up to NVFP4_GEMV_MAX_ROWS): a GEMV that decodes the packed e2m1 weight and its e4m3
  block scales exactly in registers and computes in float32. Dynamic activations are quantized
  first in C++ exactly as the reference's simulate_input_quantization (the same values, bit for
  bit), in the same call.
- More rows: the activations quantized the same way and the weight dequantized in C++ into x's
  dtype, both bit for bit the reference's, then the reference's own F.linear call (aten's GEMM:
  oneDNN, on AMX where the CPU has it): the reference's outputs, with its slow torch
  dequantization (many small ops over the whole weight) replaced. Nothing is cached: the weight is
  dequantized per call (bfloat16 / float16 through float32 chunks of about 1 MB).
3-D experts run expert by expert (tensors/experts.py): each expert's 2-D weight takes these rows.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import cpu_ext
from .common import FLOATS, rows as _rows
from .cpu import CPU_EXT, _in_features, _linear_out
from .registry import opaque_op, register_kernel

# GEMV against dequantize + aten's AMX GEMM (2048x5632, bf16, 1 thread, interleaved rounds,
# scripts/bench_kernels.py on the shared 2-vCPU AVX-512/AMX Xeon at load 9-13, medians): 2.7 / 20 /
# 38 / 48 ms at 8 / 16 / 32 / 64 rows against 12 / 40 / 40 / 27 (dense bf16 5 / 18 / 10 / 12 in the
# same rounds; noisy, but the order is clear at 16 and 64). The GEMV decodes each weight row once
# per two activation rows, so it grows with the rows; the dequantization's cost does not.
NVFP4_GEMV_MAX_ROWS = 32
# Batch 1 against int4 g32 (Int4WeightOnlyConfig(32), hf_aoq's int4 kernel) and MXFP4's GEMV,
# 2048x5632 bf16, 1 thread, 100 interleaved rounds (scripts/bench_kernels.py) on the shared
# AVX-512 machine (load about 5 on 2 vCPUs): NVFP4 GEMV best 0.69 ms, median 0.97; int4 g32 best
# 0.93, median 1.27; MXFP4 GEMV best 0.62, median 0.91 (dense bf16 1.45 / 1.71). After the int4
# kernels' 512-bit step and this GEMV's row prefetch (mx_common.h), two later runs (medians as
# fractions of dense bf16's time): NVFP4 0.42-0.43, int4 g32 0.435-0.437, MXFP4 0.37-0.38. (The previous NVFP4 loop, one weight row at
# a time with the e4m3 scales decoded in registers per chunk: 1.46 ms against int4 g32's 1.13.)
ACT_QUANT = ("nvfp4",)  # NVFP4Tensor's act_quant values these kernels take (None: weight-only)


@opaque_op("nvfp4_linear_io_cpu", _linear_out)
def nvfp4_linear_io(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, per_tensor_scale: torch.Tensor, k: int,
    bias: Optional[torch.Tensor], act_quant: bool = False,
) -> torch.Tensor:
    return cpu_ext.load().nvfp4_linear_io(x, qdata, scale, per_tensor_scale, k, bias, act_quant)


@opaque_op("nvfp4_fake_quantize_cpu", lambda x: torch.empty_like(x))
def nvfp4_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """x quantized to NVFP4 with its own per-tensor scale and decoded in x's dtype: the reference's
    simulate_input_quantization, bit for bit."""
    return cpu_ext.load().nvfp4_fake_quantize(x)


def _dequantize_fake(qdata, scale, per_tensor_scale, k, dtype):
    return qdata.new_empty((*qdata.shape[:-1], k), dtype=dtype)


@opaque_op("nvfp4_dequantize_cpu", _dequantize_fake)
def nvfp4_dequantize(qdata: torch.Tensor, scale: torch.Tensor, per_tensor_scale: torch.Tensor, k: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """The weight ([N, k], or experts [E, N, k]) in dtype, bit for bit the reference's dequantize(dtype)."""
    return cpu_ext.load().nvfp4_dequantize(qdata, scale, per_tensor_scale, k, dtype)


def nvfp4_quantize(x: torch.Tensor, per_tensor_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdata, scale) of x in NVFP4 blocks of 16 along the last dim with the given per-tensor scale,
    computed in C++: tensors/nvfp4.py's nvfp4_quantize, bit for bit."""
    qdata, scale = cpu_ext.load().nvfp4_quantize_rows(x, per_tensor_scale)
    return qdata, scale


def _nvfp4_applies(x, w) -> bool:
    return x.dtype in FLOATS and w.qdata.ndim == 2 and (w.act_quant is None or w.act_quant in ACT_QUANT)


def _nvfp4_gemv_applies(x, w) -> bool:
    return _nvfp4_applies(x, w) and _rows(x) <= NVFP4_GEMV_MAX_ROWS


@register_kernel("linear", "NVFP4Tensor", "cpu_nvfp4_gemv", backend="cpu", priority=20, device="cpu",
                 needs=(CPU_EXT,), when=_nvfp4_gemv_applies)
def nvfp4_cpu_linear(x, w, bias):
    """Up to NVFP4_GEMV_MAX_ROWS rows, in float32 on the exact weight (activations quantized first
    for the dynamic variant)."""
    return nvfp4_linear_io(x, w.qdata, w.scale, w.per_tensor_scale, _in_features(w), bias, w.act_quant is not None)


@register_kernel("linear", "NVFP4Tensor", "cpu_nvfp4_dequant_gemm", backend="cpu", priority=10, device="cpu",
                 needs=(CPU_EXT,), when=_nvfp4_applies)
def nvfp4_cpu_dequant_linear(x, w, bias):
    """Many rows: the reference's computation (activations quantized, weight dequantized into x's
    dtype, F.linear), with both done in C++: the same bits, faster."""
    if w.act_quant is not None and x.numel():
        x = nvfp4_fake_quantize(x)
    weight = nvfp4_dequantize(w.qdata, w.scale, w.per_tensor_scale, _in_features(w), x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
