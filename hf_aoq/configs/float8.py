"""Configs of Float8Tensor (float8 weights, alone or with dynamic or static float8 activations) and of
Float8SemiSparseTensor (2:4 sparse float8 weights with dynamic float8 activations)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.errors import AOQError
from ..core.granularity import PerRow, PerTensor
from ..core.primitives import FLOAT8_DTYPES
from ..core.registry import register_config_type
from ..tensors import Float8SemiSparseTensor, Float8Tensor
from ..tensors.float8 import static_act_scale
from .recipe import AOQBaseConfig


def _check_float8(owner: str, name: str, dtype) -> None:
    if dtype not in FLOAT8_DTYPES:
        raise AOQError(f"{owner}.{name} must be one of {FLOAT8_DTYPES}, got {dtype!r}")


def _check_granularity(owner: str, granularity) -> None:
    if not isinstance(granularity, (PerRow, PerTensor)):
        raise AOQError(f"{owner}.granularity must be PerRow() or PerTensor(), got {granularity!r}")


@register_config_type
@dataclass(frozen=True)
class Float8WeightOnlyConfig(AOQBaseConfig):
    weight_dtype: torch.dtype = torch.float8_e4m3fn
    granularity: PerRow | PerTensor = PerRow()

    def __post_init__(self):
        _check_float8(type(self).__name__, "weight_dtype", self.weight_dtype)
        _check_granularity(type(self).__name__, self.granularity)

    def quantize_weight(self, weight, *, name="weight"):
        return Float8Tensor.from_float(weight, self.weight_dtype, self.granularity, name=name)


@register_config_type
@dataclass(frozen=True)
class Float8DynamicActivationFloat8WeightConfig(AOQBaseConfig):
    """float8 weights; activations quantized to float8 at run time with the same granularity."""

    activation_dtype: torch.dtype = torch.float8_e4m3fn
    weight_dtype: torch.dtype = torch.float8_e4m3fn
    granularity: PerRow | PerTensor = PerRow()

    def __post_init__(self):
        _check_float8(type(self).__name__, "activation_dtype", self.activation_dtype)
        _check_float8(type(self).__name__, "weight_dtype", self.weight_dtype)
        _check_granularity(type(self).__name__, self.granularity)

    def quantize_weight(self, weight, *, name="weight"):
        act = "per_row" if isinstance(self.granularity, PerRow) else "per_tensor"
        return Float8Tensor.from_float(
            weight, self.weight_dtype, self.granularity, act_quant=act, act_dtype=self.activation_dtype, name=name
        )


@register_config_type
@dataclass(frozen=True)
class Float8StaticActivationFloat8WeightConfig(AOQBaseConfig):
    """float8 weights; activations quantized to float8 per tensor with a fixed `scale` (x / scale),
    given here or chosen by calibration (hf_aoq.activation_scales; AOQConfig(calibration=...)).
    A torchao user's `scale` tensor (one element) is taken as its number. Float8Tensor with
    act_quant "static" and the scale as its act_scale."""

    scale: float | None = None
    activation_dtype: torch.dtype = torch.float8_e4m3fn
    weight_dtype: torch.dtype = torch.float8_e4m3fn
    granularity: PerRow | PerTensor = PerTensor()

    def __post_init__(self):
        owner = type(self).__name__
        if self.scale is not None:
            object.__setattr__(self, "scale", static_act_scale(self.scale, f"{owner}.scale"))
        _check_float8(owner, "activation_dtype", self.activation_dtype)
        _check_float8(owner, "weight_dtype", self.weight_dtype)
        _check_granularity(owner, self.granularity)

    def quantize_weight(self, weight, *, name="weight"):
        if self.scale is None:
            raise AOQError(f"{name}: {type(self).__name__}.scale is None; give scale=<a positive number> or calibrate "
                           "the activation scales (AOQConfig(calibration=<text file>), hf_aoq.calibrate_activation_scales)")
        return Float8Tensor.from_float(weight, self.weight_dtype, self.granularity, act_quant="static",
                                       act_dtype=self.activation_dtype, act_scale=self.scale, name=name)


# torchao's one layout for this config; its class name is accepted (and stored) as this string.
SEMI_SPARSE_LAYOUTS = ("CutlassSemiSparseLayout",)


@register_config_type
@dataclass(frozen=True)
class Float8DynamicActivationFloat8SemiSparseWeightConfig(AOQBaseConfig):
    """2:4 semi-structured sparse float8 weights (Float8SemiSparseTensor: in every group of four
    along the input, the two of largest magnitude kept as e4m3 with a per-row scale) and
    activations quantized to float8 per token at run time. torchao's fields and defaults:
    `layout` is its only layout, CutlassSemiSparseLayout (given as that string, or as an instance
    of a class so named, e.g. torchao's own); activations default to e5m2 as torchao's do
    (`--scheme fp8-sparse` takes e4m3, as fp8-dyn does); `weight_dtype` must be e4m3.
    The weight is pruned here, by magnitude, without retraining: expect a loss of accuracy."""

    layout: str = "CutlassSemiSparseLayout"
    activation_dtype: torch.dtype = torch.float8_e5m2
    weight_dtype: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self):
        owner = type(self).__name__
        layout = self.layout
        if not isinstance(layout, str) and type(layout).__name__ in SEMI_SPARSE_LAYOUTS:
            object.__setattr__(self, "layout", type(layout).__name__)  # torchao's layout object, by its name only
        elif layout not in SEMI_SPARSE_LAYOUTS:
            raise AOQError(f"{owner}.layout must be one of {SEMI_SPARSE_LAYOUTS} (torchao's only layout for it), "
                           f"got {layout!r}")
        _check_float8(owner, "activation_dtype", self.activation_dtype)
        if self.weight_dtype != torch.float8_e4m3fn:
            raise AOQError(f"{owner}.weight_dtype must be torch.float8_e4m3fn (2:4 sparse float8 stores e4m3 values "
                           f"only), got {self.weight_dtype!r}")

    def quantize_weight(self, weight, *, name="weight"):
        return Float8SemiSparseTensor.from_float(weight, act_quant="per_row", act_dtype=self.activation_dtype, name=name)
