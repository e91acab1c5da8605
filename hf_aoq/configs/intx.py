"""Configs of IntxTensor: 1- to 8-bit integer weights, with or without int8 activations."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.errors import AOQError
from ..core.granularity import PerGroup, PerRow
from ..core.registry import register_config_type
from ..tensors import IntxTensor
from ..tensors import intx
from .recipe import OPTIONAL, AOQBaseConfig


# ---------------------------------------------------------------------- 1- to 8-bit integers
INT_DTYPES = {getattr(torch, f"int{b}"): b for b in intx.BITS}  # torch.int1 .. torch.int8
INT_DTYPES_BY_BITS = {b: d for d, b in INT_DTYPES.items()}
UINT_DTYPES = {getattr(torch, f"uint{b}"): b for b in intx.BITS[:-1]}  # torch.uint1 .. torch.uint7
MAPPING_TYPES = ("symmetric", "asymmetric")
_INTX_GRANULARITIES = "PerRow() or PerGroup(g) with g in " + str(intx.GROUP_SIZES)


def _intx_bits(owner: str, name: str, dtype, allowed: dict) -> int:
    if not isinstance(dtype, torch.dtype) or dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise AOQError(f"{owner}.{name} must be one of {names}; got {dtype!r}")
    return allowed[dtype]


def _intx_group(owner: str, name: str, granularity) -> int | None:
    """The group size of an Intx granularity (None: per row)."""
    if isinstance(granularity, PerRow):
        return None
    if isinstance(granularity, PerGroup) and granularity.group_size in intx.GROUP_SIZES:
        return granularity.group_size
    raise AOQError(f"{owner}.{name} must be {_INTX_GRANULARITIES}; got {granularity!r}")


def _intx_symmetric(owner: str, name: str, mapping_type, bits: int) -> bool:
    if mapping_type not in MAPPING_TYPES:
        raise AOQError(f"{owner}.{name} must be one of {MAPPING_TYPES}; got {mapping_type!r}")
    if mapping_type == "symmetric" and bits == 1:
        raise AOQError(f"{owner}.{name} must be 'asymmetric' for 1-bit weights (symmetric int1 has only the "
                       f"codes -1 and 0)")
    return mapping_type == "symmetric"


def _intx_group_size(owner: str, group_size, allowed_none: bool) -> None:
    if group_size is None and allowed_none:
        return
    if type(group_size) is not int or group_size not in intx.GROUP_SIZES:
        extra = " or None (per row)" if allowed_none else ""
        raise AOQError(f"{owner}.group_size must be one of {intx.GROUP_SIZES}{extra}; got {group_size!r}")


@register_config_type
@dataclass(frozen=True)
class IntxWeightOnlyConfig(AOQBaseConfig):
    """1- to 8-bit integer weights (IntxTensor, codes bit-packed): `weight_dtype` torch.int1 ..
    torch.int8 gives the bit width, `granularity` PerRow() (torchao's PerAxis(0), its default)
    or PerGroup(g) along the input dimension (g in 16, 32, 64, 128, 256; the last group may be
    partial), `mapping_type` "symmetric" (no zero; int1 must be asymmetric) or "asymmetric".
    Scales and zeros are chosen by the "mse" search (tensors/intx.py)."""

    weight_dtype: torch.dtype = torch.int8
    granularity: PerGroup | PerRow = PerRow()
    mapping_type: str = "symmetric"

    def __post_init__(self):
        owner = type(self).__name__
        bits = _intx_bits(owner, "weight_dtype", self.weight_dtype, INT_DTYPES)
        _intx_group(owner, "granularity", self.granularity)
        _intx_symmetric(owner, "mapping_type", self.mapping_type, bits)

    def quantize_weight(self, weight, *, name="weight"):
        bits = INT_DTYPES[self.weight_dtype]
        return IntxTensor.from_float(weight, bits, _intx_group(type(self).__name__, "granularity", self.granularity),
                                     self.mapping_type == "symmetric", name=name)


@register_config_type
@dataclass(frozen=True)
class Int8DynamicActivationIntxWeightConfig(AOQBaseConfig):
    """IntxWeightOnlyConfig's weights, and activations quantized to int8 per token at run time.
    `act_mapping_type` "symmetric" (default; IntxTensor act_quant "per_token", as
    Int8DynamicActivationInt8WeightConfig's, with C++ kernels) or "asymmetric" (act_quant
    "per_token_asymmetric": a zero point per token, computed as torchao's
    IntxUnpackedToInt8Tensor computes it, on the reference kernel only). torchao's default is
    asymmetric; hf_aoq's stays symmetric. `act_mapping_type` came after the config and is written
    to the JSON only when set (OPTIONAL)."""

    weight_dtype: torch.dtype = torch.int8
    weight_granularity: PerGroup | PerRow = PerGroup(32)
    weight_mapping_type: str = "symmetric"
    act_mapping_type: str = field(default="symmetric", metadata=OPTIONAL)

    def __post_init__(self):
        owner = type(self).__name__
        bits = _intx_bits(owner, "weight_dtype", self.weight_dtype, INT_DTYPES)
        _intx_group(owner, "weight_granularity", self.weight_granularity)
        _intx_symmetric(owner, "weight_mapping_type", self.weight_mapping_type, bits)
        if self.act_mapping_type not in MAPPING_TYPES:
            raise AOQError(f"{owner}.act_mapping_type must be one of {MAPPING_TYPES}; got {self.act_mapping_type!r}")

    def quantize_weight(self, weight, *, name="weight"):
        group = _intx_group(type(self).__name__, "weight_granularity", self.weight_granularity)
        act = "per_token" if self.act_mapping_type == "symmetric" else "per_token_asymmetric"
        return IntxTensor.from_float(weight, INT_DTYPES[self.weight_dtype], group,
                                     self.weight_mapping_type == "symmetric", act_quant=act, name=name)


@register_config_type
@dataclass(frozen=True)
class UIntXWeightOnlyConfig(AOQBaseConfig):
    """Unsigned asymmetric X-bit weights, torch.uint1 .. torch.uint7 (default uint4), in groups
    of `group_size` (16, 32, 64, 128, 256): an asymmetric IntxTensor (a scale and a zero per
    group)."""

    dtype: torch.dtype = torch.uint4
    group_size: int = 64

    def __post_init__(self):
        owner = type(self).__name__
        _intx_bits(owner, "dtype", self.dtype, UINT_DTYPES)
        _intx_group_size(owner, self.group_size, allowed_none=False)

    def quantize_weight(self, weight, *, name="weight"):
        return IntxTensor.from_float(weight, UINT_DTYPES[self.dtype], self.group_size, False, name=name)


@register_config_type
@dataclass(frozen=True)
class GemliteUIntXWeightOnlyConfig(AOQBaseConfig):
    """torchao's gemlite front end for UIntX: `bit_width` 4 or 8, `group_size` 16 .. 256 or None
    (per row). hf_aoq has no gemlite kernels: this makes the same asymmetric IntxTensor as
    UIntXWeightOnlyConfig, which runs on hf_aoq's own kernels."""

    bit_width: int = 4
    group_size: int | None = 64

    def __post_init__(self):
        owner = type(self).__name__
        if type(self.bit_width) is not int or self.bit_width not in (4, 8):
            raise AOQError(f"{owner}.bit_width must be one of (4, 8); got {self.bit_width!r}")
        _intx_group_size(owner, self.group_size, allowed_none=True)

    def quantize_weight(self, weight, *, name="weight"):
        return IntxTensor.from_float(weight, self.bit_width, self.group_size, False, name=name)
