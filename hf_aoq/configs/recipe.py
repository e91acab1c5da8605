"""The config base class, FqnToConfig (per-layer recipes, precedence below), and the strict JSON
both are stored as.


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

from ..core.errors import AOQError, FormatError
from ..core.granularity import PerGroup, PerRow, PerTensor
from ..core.registry import CONFIG_TYPES, config_type, dtype_from_name, dtype_name


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
