"""A plain bf16 weight at few rows on CPU: hf_aoq's GEMV (csrc/dense.cpp), for the linears a quantized
model keeps in bf16 (the lm_head, layers a recipe skips). dense_linear.DenseLinear calls it.

aten's bf16 GEMV (oneDNN) is compute-bound on some CPUs: on a 2-core AMD EPYC Zen 4 it read a
[32000, 2048] lm_head at 15-18 GB/s against 26-28 GB/s for this loop, which widens each bf16 to
float32 in registers (2 threads, weights from DRAM). The sums are float32, in simd.h's lane order
(the same bits in the AVX2 and AVX-512 builds); against aten's only their order differs.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import cpu_ext
from .common import rows as _rows
from .registry import capability, capable, opaque_op

# Most activation rows given to the GEMV; above, aten's GEMM. Zen 4, [32000, 2048], 2 threads, 3
# weights cycled, hf_aoq's time over aten's in two runs: 0.59 / 0.63 at 1 row, 0.83 / 0.94 at 2,
# 0.84 / 0.96 at 4; in an earlier run 0.96 at 6 and 1.59 at 8, where the rows no longer fit one
# register tile (simd.h kTileRows).
MAX_ROWS = 4

# The extension built with vector kernels (AVX2 or AVX-512): its generic build's GEMV is a scalar
# loop, slower than aten's.
SIMD_EXT = capability("cpu:hf_aoq_ext_simd", "cpu",
                      lambda device: cpu_ext.available() and cpu_ext.chosen_isa() in ("avx2", "avx512"))


def _out(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@opaque_op("dense_linear_io_cpu", _out)
def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return cpu_ext.load().dense_linear_io(x, weight, bias)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether F.linear(x, weight) runs here: a plain (not a subclass), contiguous bf16 weight and bf16
    x on CPU, at most MAX_ROWS rows, no gradient wanted, and hf_aoq's C++ extension built with its
    vector kernels."""
    return (type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.dtype == torch.bfloat16
            and x.dtype == torch.bfloat16 and weight.device.type == "cpu" and x.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous() and _rows(x) <= MAX_ROWS
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            and capable((SIMD_EXT,), weight.device))
