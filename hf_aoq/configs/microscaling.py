"""Configs of the microscaling formats (MXTensor: OCP MX v1.0)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.errors import AOQError
from ..core.registry import register_config_type
from ..tensors import MXTensor
from ..tensors import mx
from .recipe import AOQBaseConfig


def _check_mx_dtype(owner: str, name: str, dtype, allowed: tuple) -> None:
    if dtype not in allowed:
        names = ", ".join("None" if d is None else str(d) for d in allowed)
        raise AOQError(f"{owner}.{name} must be one of {names}; got {dtype!r}")


@register_config_type
@dataclass(frozen=True)
class MXFPInferenceConfig(AOQBaseConfig):
    """OCP Microscaling (MX v1.0) weights (MXTensor): 32-element blocks along K sharing a
    power-of-two e8m0 scale; elements float8_e4m3fn or float8_e5m2 (MXFP8) or
    float4_e2m1fn_x2 (MXFP4). Activations are quantized at run time in the same blocks, to
    `activation_dtype`; None (an hf_aoq addition to torchao's config) keeps them as they are
    (weight-only, as transformers' Mxfp4 models run). `block_size` must be 32."""

    activation_dtype: torch.dtype | None = torch.float8_e4m3fn
    weight_dtype: torch.dtype = torch.float8_e4m3fn
    block_size: int = mx.BLOCK_SIZE

    def __post_init__(self):
        owner = type(self).__name__
        _check_mx_dtype(owner, "weight_dtype", self.weight_dtype, mx.ELEM_DTYPES)
        _check_mx_dtype(owner, "activation_dtype", self.activation_dtype, (None,) + mx.ELEM_DTYPES)
        if self.block_size != mx.BLOCK_SIZE or type(self.block_size) is not int:
            raise AOQError(f"{owner}.block_size must be {mx.BLOCK_SIZE} (the only MX block size), got {self.block_size!r}")

    def quantize_weight(self, weight, *, name="weight"):
        return MXTensor.from_float(weight, self.weight_dtype, self.activation_dtype, self.block_size, name=name)


@register_config_type
@dataclass(frozen=True)
class MXDynamicActivationMXWeightConfig(MXFPInferenceConfig):
    """torchao's newer name for MXFPInferenceConfig: the same fields and the same MXTensor."""
