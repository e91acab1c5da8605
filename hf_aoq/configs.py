"""Quantization configs: one dataclass per scheme, and FqnToConfig for per-layer recipes.

A config knows how to turn one float weight into a quantized tensor (`quantize_weight`); which
weights it applies to is decided by `quantize_` (a single config) or by `FqnToConfig`.

FqnToConfig precedence, for a parameter `P` (e.g. "model.layers.0.mlp.down_proj.weight") owned
by module `M` ("model.layers.0.mlp.down_proj"), first hit wins:
  1. an exact key equal to P                       (any parameter, biases included)
  2. an exact key equal to M                       (M's `weight` only)
  3. the first "re:<regex>" key, in mapping order, that fully matches P; then the first that
     fully matches M                               (weights of Linear and Embedding modules only)
  4. "_default"                                    (weights of Linear modules only)
A hit whose value is None means: leave this parameter as it is. No hit: left as it is too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .core.errors import AOQError
from .core.granularity import PerRow, PerTensor
from .core.primitives import FLOAT8_DTYPES
from .core.registry import register_config_type
from .tensors import Float8Tensor, Int4Tensor, Int8Tensor
from .tensors.int4 import GROUP_SIZES


class AOQBaseConfig:
    """A quantization scheme for a single weight."""

    def quantize_weight(self, weight: torch.Tensor, *, name: str = "weight"):
        raise NotImplementedError


@register_config_type
@dataclass(frozen=True)
class Int4WeightOnlyConfig(AOQBaseConfig):
    group_size: int = 128
    symmetric: bool = False

    def __post_init__(self):
        if self.group_size not in GROUP_SIZES:
            raise AOQError(f"Int4WeightOnlyConfig.group_size must be one of {GROUP_SIZES}, got {self.group_size!r}")

    def quantize_weight(self, weight, *, name="weight"):
        return Int4Tensor.from_float(weight, self.group_size, self.symmetric, name=name)


@register_config_type
@dataclass(frozen=True)
class Int8WeightOnlyConfig(AOQBaseConfig):
    group_size: int | None = None  # None: one scale per row

    def __post_init__(self):
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise AOQError(f"Int8WeightOnlyConfig.group_size must be None or a positive int, got {self.group_size!r}")

    def quantize_weight(self, weight, *, name="weight"):
        return Int8Tensor.from_float(weight, self.group_size, name=name)


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

    def resolve(self, param_fqn: str, module_fqn: str, module: nn.Module, param_name: str) -> tuple[bool, Any]:
        """(hit, config) for one parameter under the precedence in this module's docstring."""
        if param_fqn in self._exact:
            return True, self._exact[param_fqn]
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
