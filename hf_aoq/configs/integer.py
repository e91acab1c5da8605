"""Configs of the integer tensor types with their own formats: Int4, Int4DQ, IntxDQ (2- and 3-bit
codes on Int4DQ's group grid) and Int8 weights, with or without activations quantized at run time."""
from __future__ import annotations

import typing
from dataclasses import dataclass, field

import torch

from ..core.errors import AOQError
from ..core.primitives import QPARAM_METHODS
from ..core.registry import register_config_type
from ..tensors import Int4DQTensor, Int4Tensor, Int8Tensor, IntxDQTensor
from ..tensors import int4dq, intxdq
from ..tensors.int4 import DEFAULT_QPARAMS, GROUP_SIZES
from .recipe import OPTIONAL, AOQBaseConfig
from .float8 import _check_float8


@register_config_type
@dataclass(frozen=True)
class Int4WeightOnlyConfig(AOQBaseConfig):
    """4-bit weights in groups of `group_size` along the input dimension (the last group may be
    partial). `qparams` chooses each group's scale and zero: "mse" (default) minimises the
    group's squared reconstruction error, "minmax" maps its range onto the codes. Both give the
    same Int4Tensor format; a recipe saved without `qparams` reads as the default."""

    group_size: int = 128
    symmetric: bool = False
    qparams: str = DEFAULT_QPARAMS  # "mse"; Int4Tensor.from_float has the same default

    def __post_init__(self):
        if self.group_size not in GROUP_SIZES:
            raise AOQError(f"Int4WeightOnlyConfig.group_size must be one of {GROUP_SIZES}, got {self.group_size!r}")
        if self.qparams not in QPARAM_METHODS:
            raise AOQError(f"Int4WeightOnlyConfig.qparams must be one of {QPARAM_METHODS}, got {self.qparams!r}")

    def quantize_weight(self, weight, *, name="weight"):
        return Int4Tensor.from_float(weight, self.group_size, self.symmetric, qparams=self.qparams, name=name)


@register_config_type
@dataclass(frozen=True)
class Int4DQWeightOnlyConfig(AOQBaseConfig):
    """4-bit weights in groups of `group_size` (32 or 64) whose scale and centre are 4-bit
    indices into a per-row grid (Int4DQTensor): about the size of Int4WeightOnlyConfig at
    groups of 128 (4.25 + 32/K bits per weight at groups of 32) with the accuracy of small groups."""

    group_size: int = 32

    def __post_init__(self):
        if self.group_size not in int4dq.GROUP_SIZES:
            raise AOQError(
                f"Int4DQWeightOnlyConfig.group_size must be one of {int4dq.GROUP_SIZES}, got {self.group_size!r}"
            )

    def quantize_weight(self, weight, *, name="weight"):
        return Int4DQTensor.from_float(weight, self.group_size, name=name)


@register_config_type
@dataclass(frozen=True)
class IntxDQWeightOnlyConfig(AOQBaseConfig):
    """`bits`-bit weights (2 or 3) in groups of `group_size` (32 or 64) whose scale and centre are
    Int4DQ's 4-bit indices into a per-row grid (IntxDQTensor): bits + 8/g + 32/K bits per weight,
    3.25 + 32/K at 3 bits in groups of 32. hf_aoq's own format (torchao has no such config); the
    sub-4-bit candidate for mixed precision."""

    bits: int = 3
    group_size: int = 32

    def __post_init__(self):
        if type(self.bits) is not int or self.bits not in intxdq.BITS:
            raise AOQError(f"IntxDQWeightOnlyConfig.bits must be one of {intxdq.BITS}, got {self.bits!r}")
        if self.group_size not in int4dq.GROUP_SIZES:
            raise AOQError(
                f"IntxDQWeightOnlyConfig.group_size must be one of {int4dq.GROUP_SIZES}, got {self.group_size!r}"
            )

    def quantize_weight(self, weight, *, name="weight"):
        return IntxDQTensor.from_float(weight, self.bits, self.group_size, name=name)


@register_config_type
@dataclass(frozen=True)
class Int8WeightOnlyConfig(AOQBaseConfig):
    """int8 weights, a float32 scale per row (or per group of `group_size`). `qparams` "minmax"
    (default) maps each row's abs-max onto code 127; "mse" takes the scale with the least squared
    reconstruction error among a few slightly smaller ones, each refined by least squares
    (README's int8 quality notes have the measurements). `scale_dtype` torch.float16 picks scales
    that fp16 holds exactly (what GGUF's Q8_0 stores; `hf-aoq quantize --target gguf` sets it with
    group_size 32); None keeps the exact float32 scale. Both came after the config and are written
    to the JSON only when set (OPTIONAL)."""

    group_size: int | None = None  # None: one scale per row
    scale_dtype: torch.dtype | None = field(default=None, metadata=OPTIONAL)
    qparams: str = field(default="minmax", metadata=OPTIONAL)

    def __post_init__(self):
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise AOQError(f"Int8WeightOnlyConfig.group_size must be None or a positive int, got {self.group_size!r}")
        if self.scale_dtype not in (None, torch.float32, torch.float16):
            raise AOQError(f"Int8WeightOnlyConfig.scale_dtype must be None, torch.float32 or torch.float16, got "
                           f"{self.scale_dtype!r}")
        if self.qparams not in QPARAM_METHODS:
            raise AOQError(f"Int8WeightOnlyConfig.qparams must be one of {QPARAM_METHODS}, got {self.qparams!r}")

    def quantize_weight(self, weight, *, name="weight"):
        return Int8Tensor.from_float(weight, self.group_size, scale_dtype=self.scale_dtype, name=name,
                                     qparams=self.qparams)


@register_config_type
@dataclass(frozen=True)
class Int8DynamicActivationInt8WeightConfig(AOQBaseConfig):
    """int8 per-row weights; activations quantized per token at run time."""

    def quantize_weight(self, weight, *, name="weight"):
        return Int8Tensor.from_float(weight, None, act_quant="per_token", name=name)



# ---------------------------------------------------------------------- activation-quantized int4
_MAPPING_TYPES = ("symmetric", "asymmetric")


def _check_int4_weight(owner: str, group_size, mapping_type: str = "symmetric") -> None:
    if type(group_size) is not int or group_size not in GROUP_SIZES:
        raise AOQError(f"{owner}.group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if mapping_type not in _MAPPING_TYPES:
        raise AOQError(f"{owner}.mapping_type must be one of {_MAPPING_TYPES}, got {mapping_type!r}")


class _IntActivationInt4WeightConfig(AOQBaseConfig):
    """int4 weights in groups of `group_size` (symmetric, torchao's default, or "asymmetric": a
    zero per group) x integer activations quantized per token (symmetric) at run time to
    `_act_dtype`: an Int4Tensor run by integer dot products on CPU (kernels/cpu.py)."""

    _act_dtype: typing.ClassVar[torch.dtype]

    def __post_init__(self):
        _check_int4_weight(type(self).__name__, self.group_size, self.mapping_type)

    def quantize_weight(self, weight, *, name="weight"):
        return Int4Tensor.from_float(weight, self.group_size, self.mapping_type == "symmetric", act_quant="per_token",
                                     act_dtype=self._act_dtype, name=name)


@register_config_type
@dataclass(frozen=True)
class Int8DynamicActivationInt4WeightConfig(_IntActivationInt4WeightConfig):
    """int8 activations (per token, codes in [-127, 127]) x int4 weights in groups of 32."""

    group_size: int = 32
    mapping_type: str = "symmetric"
    _act_dtype = torch.int8


@register_config_type
@dataclass(frozen=True)
class Int4DynamicActivationInt4WeightConfig(_IntActivationInt4WeightConfig):
    """int4 activations (per token, codes in [-7, 7]) x int4 weights. torchao's weights are per
    row; hf_aoq's Int4Tensor takes groups, of `group_size` (128, an hf_aoq addition)."""

    group_size: int = 128
    mapping_type: str = "symmetric"
    _act_dtype = torch.int4


@register_config_type
@dataclass(frozen=True)
class Float8DynamicActivationInt4WeightConfig(AOQBaseConfig):
    """int4 weights in groups of `group_size` (symmetric, or "asymmetric" as torchao's plain int4
    may be) x float8 activations quantized per token at run time (fake-quantized, then the int4
    kernels run)."""

    group_size: int = 128
    activation_dtype: torch.dtype = torch.float8_e4m3fn
    mapping_type: str = "symmetric"

    def __post_init__(self):
        _check_int4_weight(type(self).__name__, self.group_size, self.mapping_type)
        _check_float8(type(self).__name__, "activation_dtype", self.activation_dtype)

    def quantize_weight(self, weight, *, name="weight"):
        return Int4Tensor.from_float(weight, self.group_size, self.mapping_type == "symmetric", act_quant="per_token",
                                     act_dtype=self.activation_dtype, name=name)
