"""Allow-lists: the only tensor types, config types and dtypes that metadata or config JSON may
name. Resolving a name goes through these dicts and nothing else (no getattr on modules, no
import by name), so a checkpoint cannot make hf_aoq build an object it did not register.
"""
from __future__ import annotations

from typing import TypeVar

import torch

from .errors import FormatError, short

T = TypeVar("T", bound=type)

TENSOR_TYPES: dict[str, type] = {}
CONFIG_TYPES: dict[str, type] = {}

# The one table of dtype names: each torch dtype hf_aoq stores, its name in hf_aoq metadata (None:
# metadata may not name it), its name in safetensors headers (None: no tensor is stored in it), and
# the short name reports print.
_DTYPE_TABLE: tuple[tuple[torch.dtype, str | None, str | None, str], ...] = (
    (torch.float32, "float32", "F32", "fp32"),
    (torch.float16, "float16", "F16", "fp16"),
    (torch.bfloat16, "bfloat16", "BF16", "bf16"),
    (torch.float64, "float64", "F64", "fp64"),
    (torch.float8_e4m3fn, "float8_e4m3fn", "F8_E4M3", "e4m3"),
    (torch.float8_e5m2, "float8_e5m2", "F8_E5M2", "e5m2"),
    (torch.int8, "int8", "I8", "int8"),
    (torch.uint8, "uint8", "U8", "uint8"),
    (torch.int16, "int16", "I16", "int16"),
    (torch.int32, "int32", "I32", "int32"),
    (torch.int64, "int64", "I64", "int64"),
    (torch.bool, "bool", "BOOL", "bool"),
    # Int4Tensor's act_dtype names it (int4 activation codes); no tensor is stored in it.
    (torch.int4, "int4", None, "int4"),
    (torch.complex64, None, "C64", "complex64"),
    # MXTensor's element formats name it (attributes and config JSON); its bytes are stored as U8
    # (safetensors' F4 counts elements, not bytes, so it is not this dtype).
    (torch.float4_e2m1fn_x2, "float4_e2m1fn_x2", None, "e2m1"),
) + tuple(
    # The sub-byte integer dtypes name bit widths in config JSON (IntxWeightOnlyConfig's
    # weight_dtype, UIntXWeightOnlyConfig's dtype); no tensor is stored in them.
    (getattr(torch, name), name, None, name)
    for name in [f"int{b}" for b in range(1, 8)] + [f"uint{b}" for b in range(1, 8)]
) + tuple(
    (getattr(torch, name), None, st, name)
    for name, st in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"))
    if hasattr(torch, name)
)
DTYPES: dict[str, torch.dtype] = {name: d for d, name, _, _ in _DTYPE_TABLE if name is not None}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {st: d for d, _, st, _ in _DTYPE_TABLE if st is not None}
SHORT_DTYPE_NAMES: dict[torch.dtype, str] = {d: short for d, _, _, short in _DTYPE_TABLE}

# Enum-like string attributes of tensor types: "TypeName.attribute" -> the values metadata may
# give it. An attribute that is None is never written, so None is not listed.
ENUMS: dict[str, frozenset[str]] = {
    "Int4Tensor.packing": frozenset(),  # checkpoints hold the canonical layout only
    "Int4DQTensor.packing": frozenset(),
    "Int8Tensor.packing": frozenset(),
    "Int8Tensor.act_quant": frozenset({"per_token"}),
    "IntxTensor.packing": frozenset(),
    "IntxTensor.act_quant": frozenset({"per_token", "per_token_asymmetric"}),
    "Int4Tensor.act_quant": frozenset({"per_token"}),
    "Float8Tensor.act_quant": frozenset({"per_tensor", "per_row", "static"}),
    "NVFP4Tensor.act_quant": frozenset({"nvfp4"}),
    "Float8SemiSparseTensor.act_quant": frozenset({"per_row"}),
}


def _register(table: dict[str, type], kind: str, cls: T) -> T:
    name = cls.__name__
    if name in table and table[name] is not cls:
        raise TypeError(f"two {kind} types named {name!r}: {table[name]} and {cls}")
    table[name] = cls
    return cls


def register_tensor_type(cls: T) -> T:
    """Class decorator: allow `cls` to be named in checkpoint metadata."""
    return _register(TENSOR_TYPES, "tensor", cls)


def register_config_type(cls: T) -> T:
    """Class decorator: allow `cls` to be named in config JSON."""
    return _register(CONFIG_TYPES, "config", cls)


def tensor_type(name: str) -> type:
    try:
        return TENSOR_TYPES[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown tensor type {short(name)}; known: {sorted(TENSOR_TYPES)}") from None


def config_type(name: str) -> type:
    try:
        return CONFIG_TYPES[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown config type {short(name)}; known: {sorted(CONFIG_TYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown dtype {short(name)}; known: {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} cannot be named in hf_aoq metadata") from None


def enum_value(enum: str, value: str) -> str:
    """`value` if the allow-list `ENUMS[enum]` ("TypeName.attribute") holds it."""
    allowed = ENUMS.get(enum)
    if allowed is None:
        raise FormatError(f"{enum} is not an enum attribute; known: {sorted(ENUMS)}")
    if not isinstance(value, str) or value not in allowed:
        raise FormatError(f"unknown {enum} value {short(value)}; known: {sorted(allowed)}")
    return value
