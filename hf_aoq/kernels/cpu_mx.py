"""hf_aoq's CPU kernel for MXTensor with e2m1 elements (MXFP4), weight-only, at few rows:
csrc/mx.cpp decodes the packed weight exactly in registers and computes in float32 (the
reference dequantizes to the activation dtype and calls aten's GEMM). Above MXFP4_GEMV_MAX_ROWS
rows, and for the dynamic-activation variant and MXFP8, the reference kernel runs."""
from __future__ import annotations

from typing import Optional

import torch

from . import cpu_ext
from .common import FLOATS
from .cpu import CPU_EXT, _in_features, _linear_out
from .registry import opaque_op, register_kernel

# Measured crossover with the reference (dequantize in torch + aten GEMM), 2048x5632 weight, bf16
# activations, 2 threads (scripts/bench_kernels.py, best of interleaved rounds): the GEMV 1.37 /
# 1.04 / 3.35 / 48 ms at 1 / 4 / 16 / 64 rows against the reference's 195-235 ms; 208 against 210
# at 128 rows (a tie), 499 against 219 at 256. Each weight row is decoded once per four activation
# rows and meets every activation row, so the GEMV's time grows with the rows.
MXFP4_GEMV_MAX_ROWS = 64
# Batch 1 against int4 g32 (Int4WeightOnlyConfig(32), hf_aoq's int4 kernel), same run: 1.13 ms
# against 0.82 (best of 60 interleaved rounds; the medians, 12.5 and 19.7 ms, measured the other
# processes on a shared 2-core machine). Issue 17's target (MXFP4 at least as fast) is not met yet:
# the decode costs about five vector instructions per eight elements, where int4 uses VNNI.
FP4 = torch.float4_e2m1fn_x2  # MXTensor's elem_dtype for e2m1 (kernels import no tensor type)


@opaque_op("mxfp4_linear_io_cpu", _linear_out)
def mxfp4_linear_io(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, k: int, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    return cpu_ext.load().mxfp4_linear_io(x, qdata, scale, k, bias)


def _mxfp4_gemv_applies(x, w) -> bool:
    if w.elem_dtype != FP4 or w.act_dtype is not None or x.dtype not in FLOATS or w.qdata.ndim != 2:
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return rows <= MXFP4_GEMV_MAX_ROWS


@register_kernel("linear", "MXTensor", "cpu_mxfp4_gemv", backend="cpu", priority=10, device="cpu",
                 needs=(CPU_EXT,), when=_mxfp4_gemv_applies)
def mxfp4_cpu_linear(x, w, bias):
    """Weight-only MXFP4 at up to MXFP4_GEMV_MAX_ROWS rows, in float32 on the exact weight."""
    return mxfp4_linear_io(x, w.qdata, w.scale, _in_features(w), bias)
