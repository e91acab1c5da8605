"""Unquantized bf16 linears of a quantized model on hf_aoq's CPU GEMV: `DenseLinear`, an nn.Linear
whose forward at few rows on CPU runs kernels/cpu_dense.py's GEMV and otherwise F.linear, and
`route_dense_linears`, which gives that forward to a model's plain nn.Linear modules with bf16
weights (the lm_head a quantized model keeps, layers a recipe skips).

Only the module's class changes (`module.__class__`), never its parameters: the state dict, the
saved files, tied weights and `isinstance(m, nn.Linear)` stay as they were. Where the GEMV does not
apply (GPU, float32 or fp16, many rows, a gradient wanted, a tensor subclass such as a DTensor),
the forward is nn.Linear's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import cpu_dense


class DenseLinear(nn.Linear):
    """nn.Linear with hf_aoq's bf16 GEMV at few rows on CPU (kernels/cpu_dense.py); same state."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_dense.applies(x, self.weight):
            return cpu_dense.dense_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def route_dense_linears(model: nn.Module) -> list[str]:
    """Give DenseLinear's forward to every module of `model` that is exactly an nn.Linear (not a
    subclass) with a plain bf16 weight; returns the names of those it changed (none the second time)."""
    routed = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and type(module.weight) in (torch.Tensor, nn.Parameter) \
                and module.weight.dtype == torch.bfloat16:
            module.__class__ = DenseLinear
            routed.append(name)
    return routed
