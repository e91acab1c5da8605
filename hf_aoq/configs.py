"""Quantization configs: one dataclass per scheme, and FqnToConfig for per-layer recipes.

A config knows how to turn one float weight into a quantized tensor (`quantize_weight`); which
weights it applies to is decided by `quantize_` (a single config) or by `FqnToConfig`.

FqnToConfig precedence, for a parameter `P` (e.g. "model.layers.0.mlp.down_proj.weight") owned
by module `M` ("model.layers.0.mlp.down_proj"), first hit wins:
  1. an exact key equal to P                       (any parameter, biases included)
  2. an exact key equal to M                       (M's `weight` only)
  3. the first "re:<regex>" key, in mapping order, that fully matches P; then the first that
     fully matches M                               (weights of Linear and Embedding modules, and
                                                    fused MoE experts, only)
  4. "_default"                                    (weights of Linear modules, and fused experts)
Fused experts are the 3-D float parameters of a module that is not a convolution (e.g.
transformers' `mlp.experts.gate_up_proj` [E, 2I, H]); hf_aoq.quantize decides which those are.
A hit whose value is None means: leave this parameter as it is. No hit: left as it is too.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .core.errors import AOQError, FormatError
from .core.granularity import PerGroup, PerRow, PerTensor
from .core.primitives import FLOAT8_DTYPES, QPARAM_METHODS
from .core.registry import CONFIG_TYPES, config_type, dtype_from_name, dtype_name, register_config_type
from .tensors import Float8Tensor, Int4DQTensor, Int4Tensor, Int8Tensor, IntxTensor, MXTensor
from .tensors import int4dq, intx, mx
from .tensors.float8 import static_act_scale
from .tensors.int4 import DEFAULT_QPARAMS, GROUP_SIZES


# Field metadata for a config field added after its config was first released: the JSON holds it
# only when it differs from its default, so a recipe that does not use it still reads in the
# releases before it (which refuse keys they do not know), as optional tensor fields do.
OPTIONAL = {"optional": True}


class AOQBaseConfig:
    """A quantization scheme for a single weight."""

    def quantize_weight(self, weight: torch.Tensor, *, name: str = "weight"):
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """This config as strict JSON-ready data: {"type": <class name>, <field>: <value>, ...}."""
        return _config_to_dict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "AOQBaseConfig":
        """Build a config from `to_dict` output; FormatError for unknown types, keys or values."""
        config = _config_from_dict(data, "config" if cls is AOQBaseConfig else cls.__name__)
        if not isinstance(config, cls):
            raise FormatError(f"expected a {cls.__name__}, the JSON names a {type(config).__name__}")
        return config


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


@dataclass
class FqnToConfig:
    """Per-layer recipe: {exact name | "re:<regex>" | "_default": config or None}."""

    mapping: dict[str, AOQBaseConfig | None] = field(default_factory=dict)

    def __post_init__(self):
        self._exact: dict[str, AOQBaseConfig | None] = {}
        self._regexes: list[tuple[re.Pattern, AOQBaseConfig | None]] = []
        for key, cfg in self.mapping.items():
            if not isinstance(key, str) or not key:
                raise AOQError(f"FqnToConfig keys must be non-empty strings, got {key!r}")
            if cfg is not None and not isinstance(cfg, AOQBaseConfig):
                raise AOQError(f"FqnToConfig[{key!r}] must be a quantization config or None, got {cfg!r}")
            if key.startswith("re:"):
                try:
                    self._regexes.append((re.compile(key[3:]), cfg))
                except re.error as e:
                    raise AOQError(f"FqnToConfig key {key!r} is not a valid regex: {e}") from None
            elif key != "_default":
                self._exact[key] = cfg

    def resolve(
        self, param_fqn: str, module_fqn: str, module: nn.Module, param_name: str, *, experts: bool = False
    ) -> tuple[bool, Any]:
        """(hit, config) for one parameter under the precedence in this module's docstring;
        `experts`: the parameter is a fused MoE experts tensor."""
        if param_fqn in self._exact:
            return True, self._exact[param_fqn]
        if experts:
            for name in (param_fqn, module_fqn):
                for pattern, cfg in self._regexes:
                    if pattern.fullmatch(name):
                        return True, cfg
            return ("_default" in self.mapping), self.mapping.get("_default")
        if param_name != "weight":
            return False, None
        if module_fqn in self._exact:
            return True, self._exact[module_fqn]
        if isinstance(module, (nn.Linear, nn.Embedding)):
            for name in (param_fqn, module_fqn):
                for pattern, cfg in self._regexes:
                    if pattern.fullmatch(name):
                        return True, cfg
        if isinstance(module, nn.Linear) and "_default" in self.mapping:
            return True, self.mapping["_default"]
        return False, None

    def exact_keys(self) -> set[str]:
        return set(self._exact)

    def to_dict(self) -> dict[str, Any]:
        """This recipe as strict JSON-ready data; the mapping's order is kept."""
        return _fqn_to_config_to_dict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "FqnToConfig":
        """Build an FqnToConfig from `to_dict` output; FormatError for anything not allowed."""
        if not isinstance(data, dict) or data.get("type") != _FQN_TO_CONFIG_TAG:
            raise FormatError(f'FqnToConfig JSON must be an object with "type": "FqnToConfig", got {data!r}')
        return _fqn_to_config_from_dict(data, "FqnToConfig")


# ---------------------------------------------------------------------- JSON round-trip
# A recipe is stored as plain JSON (in config.json under "quantization_config"):
#   a config:     {"type": "<name in CONFIG_TYPES>", "<field>": <value>, ...}
#   FqnToConfig:  {"type": "FqnToConfig", "mapping": [["<key>", <config or null>], ...]}
# Field values are JSON scalars (finite numbers) or one of two tagged values:
#   {"dtype": "<name in the dtype allow-list>"}      a torch.dtype
#   {"granularity": "PerRow" | "PerTensor"}           a granularity
#   {"granularity": "PerGroup", "group_size": <int>}  a granularity with a group size
# The mapping is a list of pairs, not an object, because regex keys are tried in order and JSON
# writers (transformers' among them) sort object keys. Decoding is strict: a type, dtype or
# granularity not on the allow-lists, an unknown key, or a value of the wrong type is a
# FormatError before any config is built. A field missing from the JSON takes its default, so
# a config may gain a field with a default without breaking older files.

_GRANULARITIES: dict[str, type] = {"PerRow": PerRow, "PerTensor": PerTensor}
_FQN_TO_CONFIG_TAG = "FqnToConfig"


def _encode_value(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        return value
    if isinstance(value, torch.dtype):
        try:
            return {"dtype": dtype_name(value)}
        except FormatError as e:
            raise AOQError(f"{where}: {e}") from None
    if type(value) in _GRANULARITIES.values():
        return {"granularity": type(value).__name__}
    if type(value) is PerGroup:
        return {"granularity": "PerGroup", "group_size": value.group_size}
    raise AOQError(f"{where}: cannot write {value!r} ({type(value).__name__}) to config JSON")


def _decode_value(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict) and set(value) == {"granularity", "group_size"} and value["granularity"] == "PerGroup":
        size = value["group_size"]
        if type(size) is not int:
            raise FormatError(f"{where}: PerGroup group_size must be an int, got {size!r}")
        try:
            return PerGroup(size)
        except AOQError as e:
            raise FormatError(f"{where}: {e}") from None
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        return value
    if isinstance(value, dict) and len(value) == 1:
        (tag, name), = value.items()
        if tag == "dtype":
            try:
                return dtype_from_name(name)
            except FormatError as e:
                raise FormatError(f"{where}: {e}") from None
        if tag == "granularity":
            if not isinstance(name, str) or name not in _GRANULARITIES:
                raise FormatError(f"{where}: unknown granularity {name!r}; known: {sorted(_GRANULARITIES)}")
            return _GRANULARITIES[name]()
    raise FormatError(
        f"{where}: {value!r} is not a bool, int, string, null, {{'dtype': ...}}, {{'granularity': ...}} "
        f"or {{'granularity': 'PerGroup', 'group_size': ...}}"
    )


def _allowed_types(cls: type, name: str) -> tuple[type, ...]:
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else ()
    return tuple(type(None) if a is None else a for a in (args or (hint,)))


def _check_type(value: Any, allowed: tuple[type, ...], where: str) -> None:
    # bool is an int subclass; a boolean is accepted only where bool is declared.
    # A JSON integer is a number too where a float is declared.
    ok = (any(isinstance(value, t) for t in allowed) or (float in allowed and isinstance(value, int))) and not (
        isinstance(value, bool) and bool not in allowed
    )
    if not ok:
        names = " | ".join("None" if t is type(None) else getattr(t, "__name__", str(t)) for t in allowed)
        raise FormatError(f"{where}: expected {names}, got {value!r}")


def _config_to_dict(config: AOQBaseConfig) -> dict[str, Any]:
    cls = type(config)
    name = cls.__name__
    if CONFIG_TYPES.get(name) is not cls or not dataclasses.is_dataclass(config):
        raise AOQError(f"{name} is not a registered config dataclass; it cannot be written to config JSON")
    out: dict[str, Any] = {"type": name}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.metadata.get("optional") and value == f.default:
            continue
        out[f.name] = _encode_value(value, f"{name}.{f.name}")
    return out


def _config_from_dict(data: Any, where: str) -> AOQBaseConfig:
    if not isinstance(data, dict):
        raise FormatError(f"{where}: a config must be a JSON object, got {data!r}")
    name = data.get("type")
    if name == _FQN_TO_CONFIG_TAG:
        raise FormatError(f"{where}: an FqnToConfig cannot be nested inside another recipe")
    try:
        cls = config_type(name)  # only registered names resolve
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, AOQBaseConfig) and dataclasses.is_dataclass(cls)):
        raise FormatError(f"{where}: {name!r} is not a quantization config dataclass")
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - fields - {"type"})
    if unknown:
        raise FormatError(f"{where}: {name} has no field(s) {unknown}; fields are {sorted(fields)}")
    kwargs = {}
    for key in sorted(set(data) - {"type"}):
        value = _decode_value(data[key], f"{where}.{key}")
        _check_type(value, _allowed_types(cls, key), f"{where}.{key}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except AOQError as e:
        raise FormatError(f"{where}: {e}") from None


def _fqn_to_config_to_dict(recipe: "FqnToConfig") -> dict[str, Any]:
    pairs = []
    for key, cfg in recipe.mapping.items():
        pairs.append([key, None if cfg is None else cfg.to_dict()])
    return {"type": _FQN_TO_CONFIG_TAG, "mapping": pairs}


def _fqn_to_config_from_dict(data: dict, where: str) -> "FqnToConfig":
    unknown = sorted(set(data) - {"type", "mapping"})
    if unknown:
        raise FormatError(f"{where}: FqnToConfig has no field(s) {unknown}; fields are ['mapping']")
    pairs = data.get("mapping")
    if not isinstance(pairs, list):
        raise FormatError(f"{where}.mapping: expected a list of [key, config or null] pairs, got {pairs!r}")
    mapping: dict[str, AOQBaseConfig | None] = {}
    for i, pair in enumerate(pairs):
        at = f"{where}.mapping[{i}]"
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
            raise FormatError(f"{at}: expected a [key, config or null] pair, got {pair!r}")
        key, cfg = pair
        if key in mapping:
            raise FormatError(f"{at}: key {key!r} appears twice")
        mapping[key] = None if cfg is None else _config_from_dict(cfg, f"{at}[{key!r}]")
    try:
        return FqnToConfig(mapping)
    except AOQError as e:
        raise FormatError(f"{where}: {e}") from None


def recipe_to_dict(recipe: "AOQBaseConfig | FqnToConfig") -> dict[str, Any]:
    """A config or FqnToConfig as strict JSON-ready data (see the comment above)."""
    if isinstance(recipe, FqnToConfig):
        return _fqn_to_config_to_dict(recipe)
    if isinstance(recipe, AOQBaseConfig):
        return recipe.to_dict()
    raise AOQError(f"expected a quantization config or FqnToConfig, got {type(recipe).__name__}")


def recipe_from_dict(data: Any, *, where: str = "recipe") -> "AOQBaseConfig | FqnToConfig":
    """Inverse of `recipe_to_dict`; FormatError for anything not allowed."""
    if isinstance(data, dict) and data.get("type") == _FQN_TO_CONFIG_TAG:
        return _fqn_to_config_from_dict(data, where)
    return _config_from_dict(data, where)


# ---------------------------------------------------------------------- schemes by name
# The names `hf-aoq quantize --scheme` and the scripts take; one function builds their configs.
SCHEMES = ("int4", "int4-plain", "int8", "int8-dyn", "fp8", "fp8-dyn", "mxfp8", "mxfp4",
           "int2", "int3", "int5", "int6", "int8-int2", "int8-int3", "int8-int5", "int8-int6",
           "int8-int4", "fp8-int4", "int4-int4", "fp8-static")
INTX_SCHEME_BITS = {"int2": 2, "int3": 3, "int5": 5, "int6": 6}
INTX_DEFAULT_GROUP = 32
# The activation-quantized int4 schemes: their configs take `group_size` as Int4WeightOnlyConfig does.
_INT4_ACT_SCHEMES = {
    "int8-int4": Int8DynamicActivationInt4WeightConfig,
    "fp8-int4": Float8DynamicActivationInt4WeightConfig,
    "int4-int4": Int4DynamicActivationInt4WeightConfig,
}


def config_for_scheme(scheme: str, group_size: int | None = None) -> AOQBaseConfig:
    """The config a scheme name stands for. One rule: a scheme names one tensor type, and
    `group_size` only changes that type's group size. int4 is Int4DQWeightOnlyConfig (groups of
    32, or 64, with 4-bit group parameters: about the size of plain int4 in groups of 128 and far
    more accurate); int4-plain is Int4WeightOnlyConfig (a float scale and zero per group of 128,
    or 32, 64, 256; what GPTQ calibration chooses); int8 (per row, or groups of `group_size`),
    int8-dyn, fp8 and fp8-dyn (per row, e4m3; no groups); mxfp8 and mxfp4 are MXFPInferenceConfig
    with e4m3 or e2m1 weights and e4m3 activations, both in MX blocks of 32 (their only size);
    int2, int3, int5 and int6 are IntxWeightOnlyConfig, symmetric, in groups of 32 (or 16, 64,
    128, 256); int8-int2 .. int8-int6 are Int8DynamicActivationIntxWeightConfig with the same
    weights and int8 per-token activations.
    int8-int4, fp8-int4 and int4-int4 are int4 weights (groups of 32, 128 and 128 by default) with
    int8, float8 (e4m3) or int4 activations quantized per token at run time; fp8-static is
    Float8StaticActivationFloat8WeightConfig, whose activation scales calibration chooses."""
    intx_bits = INTX_SCHEME_BITS.get(scheme.removeprefix("int8-") if scheme.startswith("int8-int") else scheme)
    if intx_bits is not None and scheme in SCHEMES:
        g = INTX_DEFAULT_GROUP if group_size is None else group_size
        if g not in intx.GROUP_SIZES:
            raise AOQError(f"scheme {scheme}: group size must be one of {intx.GROUP_SIZES}, got {g}")
        dtype = INT_DTYPES_BY_BITS[intx_bits]
        if scheme.startswith("int8-"):
            return Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=PerGroup(g))
        return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=PerGroup(g))
    if scheme == "int4":
        return Int4DQWeightOnlyConfig() if group_size is None else Int4DQWeightOnlyConfig(group_size=group_size)
    if scheme == "int4-plain":
        return Int4WeightOnlyConfig() if group_size is None else Int4WeightOnlyConfig(group_size=group_size)
    if scheme == "int8":
        return Int8WeightOnlyConfig(group_size=group_size)
    if scheme in _INT4_ACT_SCHEMES:
        cls = _INT4_ACT_SCHEMES[scheme]
        return cls() if group_size is None else cls(group_size=group_size)
    if scheme not in SCHEMES:
        raise AOQError(f"unknown scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    if scheme in ("mxfp8", "mxfp4"):
        if group_size not in (None, mx.BLOCK_SIZE):
            raise AOQError(f"scheme {scheme} has MX blocks of {mx.BLOCK_SIZE} only, got group size {group_size}")
        weight = torch.float8_e4m3fn if scheme == "mxfp8" else mx.FP4
        return MXFPInferenceConfig(activation_dtype=torch.float8_e4m3fn, weight_dtype=weight)
    if group_size is not None:
        raise AOQError(f"scheme {scheme} has no group size (it is per row); drop the group size or use int4/int8")
    return {
        "int8-dyn": Int8DynamicActivationInt8WeightConfig,
        "fp8": Float8WeightOnlyConfig,
        "fp8-dyn": Float8DynamicActivationFloat8WeightConfig,
        "fp8-static": Float8StaticActivationFloat8WeightConfig,
    }[scheme]()
