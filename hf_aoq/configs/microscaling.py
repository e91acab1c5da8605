"""Configs of the microscaling formats (MXTensor: OCP MX v1.0; NVFP4Tensor: NVIDIA's FP4)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.errors import AOQError
from ..core.registry import register_config_type
from ..tensors import MXTensor, NVFP4Tensor
from ..tensors import mx, nvfp4
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


# ---------------------------------------------------------------------- NVFP4
NVFP4_MM_CONFIGS = ("dynamic", "weight_only")  # the values of torchao's NVFP4MMConfig


def _check_nvfp4_common(config) -> None:
    owner = type(config).__name__
    if config.block_size != nvfp4.BLOCK_SIZE or type(config.block_size) is not int:
        raise AOQError(f"{owner}.block_size must be {nvfp4.BLOCK_SIZE} (NVFP4's only block size), got {config.block_size!r}")
    if config.use_dynamic_per_tensor_scale is not True:
        raise AOQError(f"{owner}.use_dynamic_per_tensor_scale must be True: hf_aoq's NVFP4 always uses the two-level "
                       f"scheme (a float32 scale per tensor from its amax, then e4m3 block scales); single-level and "
                       f"calibrated activation scales are not supported, got {config.use_dynamic_per_tensor_scale!r}")


@register_config_type
@dataclass(frozen=True)
class NVFP4InferenceConfig(AOQBaseConfig):
    """NVIDIA FP4 weights (NVFP4Tensor): e2m1 elements, an e4m3 scale per 16 along K and a float32
    scale per tensor, with activations quantized at run time to NVFP4 in the same blocks (a
    per-tensor scale from each activation's amax). torchao's fields: `mm_config` "dynamic" or
    "weight_only" (torchao's NVFP4MMConfig values; weight-only keeps activations as they are);
    `use_triton_kernel` is accepted and changes nothing (hf_aoq's kernel table chooses the
    kernels, all of which give the reference's values); `use_dynamic_per_tensor_scale` must be
    True. `block_size` must be 16."""

    mm_config: str = "dynamic"
    use_triton_kernel: bool = True
    use_dynamic_per_tensor_scale: bool = True
    block_size: int = nvfp4.BLOCK_SIZE

    def __post_init__(self):
        owner = type(self).__name__
        mm = getattr(self.mm_config, "value", self.mm_config)  # torchao's enum, or its value
        if mm not in NVFP4_MM_CONFIGS:
            raise AOQError(f"{owner}.mm_config must be one of {list(NVFP4_MM_CONFIGS)}, got {self.mm_config!r}")
        object.__setattr__(self, "mm_config", mm)
        if type(self.use_triton_kernel) is not bool:
            raise AOQError(f"{owner}.use_triton_kernel must be a bool, got {self.use_triton_kernel!r}")
        _check_nvfp4_common(self)

    def quantize_weight(self, weight, *, name="weight"):
        act = "nvfp4" if self.mm_config == "dynamic" else None
        return NVFP4Tensor.from_float(weight, act, self.block_size, name=name)


@register_config_type
@dataclass(frozen=True)
class NVFP4WeightOnlyConfig(AOQBaseConfig):
    """NVFP4 weights (NVFP4Tensor), activations kept as they are. `use_dynamic_per_tensor_scale`
    (torchao's field) must be True; `block_size` must be 16."""

    use_dynamic_per_tensor_scale: bool = True
    block_size: int = nvfp4.BLOCK_SIZE

    def __post_init__(self):
        _check_nvfp4_common(self)

    def quantize_weight(self, weight, *, name="weight"):
        return NVFP4Tensor.from_float(weight, None, self.block_size, name=name)
