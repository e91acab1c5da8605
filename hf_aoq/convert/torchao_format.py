"""Reading a checkpoint written by torchao's safetensors support, strictly, without torchao.

transformers' `save_pretrained` for a `TorchAoConfig` model stores a quantized tensor `M.w` as
plain tensors `M._w_<field>`; the safetensors metadata lists every state-dict name under
`tensor_names` and holds, under each name, JSON `{"_type": <class>, "_data": {<attribute>: <value>},
"_tensor_data_names": [<field>, ...]}` (`{"_type": "Tensor"}` for a plain tensor). This module
turns that into `Record`s (fields + decoded attributes) and refuses anything it does not
understand, naming the file and the tensor: every JSON text is parsed strictly, every `_type`
is looked up in the allow-lists below, and nothing is unpickled or evaluated. docs/torchao.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ..core.errors import FormatError
from ..serialization import INDEX_NAME, WEIGHTS_NAME, open_checkpoint
from ..serialization.common import loads_strict, short

# Pickle-based weights: never read, and not copied next to the converted weights.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


class TorchaoConversionError(FormatError):
    """A torchao checkpoint that cannot be converted: malformed, or using something hf_aoq lacks."""


# ---------------------------------------------------------------------- strict metadata values
# Value types torchao's JSON may name, and how they decode. A name outside these is an error.
FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FLOAT8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
INT_DTYPES = {f"int{b}": b for b in range(1, 9)}  # torch.int1 .. torch.int8 -> bit width
MX_ELEMENT_DTYPES = {"float4_e2m1fn_x2": torch.float4_e2m1fn_x2}  # MXTensor's elem_dtype, besides float8
_OBJECT_TYPES = frozenset(
    {"PerRow", "PerTensor", "PerGroup", "PerAxis", "Float8MMConfig", "QuantizeTensorToFloat8Kwargs",
     "QuantizeTensorToInt8Kwargs", "QuantizeTensorToMXKwargs", "NoSwizzle", "Swizzle_32_4_4",
     "QuantizeTensorToNVFP4Kwargs"}
)
_ENUM_TYPES = {
    "MappingType": frozenset({"SYMMETRIC", "ASYMMETRIC", "SYMMETRIC_NO_CLIPPING_ERR"}),
    "KernelPreference": frozenset({"AUTO", "TORCH", "MSLK", "FBGEMM", "EMULATED"}),
    # IntxUnpackedToInt8Tensor.activation_quantization (a str enum: usually written as its plain
    # value "int8_asym_per_token"; this is the object form, should a writer use it).
    "IntxUnpackedToInt8TensorActivationQuantization": frozenset({"INT8_ASYM_PER_TOKEN"}),
    # MXTensor (mx_formats): how activation scales are chosen, and the older name of KernelPreference.
    "ScaleCalculationMode": frozenset({"FLOOR", "RCEIL", "CEIL", "EVEN"}),
    "MXGemmKernelChoice": frozenset({"EMULATED", "CUTLASS", "CUBLAS"}),
    # NVFP4Tensor's quantization kernel (torchao's NVFP4QuantizeKernelChoice): no effect on the values.
    "NVFP4QuantizeKernelChoice": frozenset({"TORCH", "TRITON", "FLASHINFER", "MSLK"}),
}


@dataclass(frozen=True)
class Obj:
    """A decoded torchao object value: its class name and decoded fields."""

    type: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Enum:
    type: str
    name: str


@dataclass(frozen=True)
class Dtype:
    name: str  # a key of FLOAT_DTYPES, FLOAT8_DTYPES or INT_DTYPES


class _ValueError(Exception):
    """A metadata value this converter does not understand (turned into a TorchaoConversionError)."""


def _decode(value: Any) -> Any:
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [_decode(v) for v in value]
    if type(value) is not dict:
        raise _ValueError(f"unexpected JSON value {short(value)}")
    if set(value) != {"_type", "_data"}:
        raise _ValueError(f"expected an object with exactly '_type' and '_data', got keys {sorted(value)}")
    kind, data = value["_type"], value["_data"]
    if kind == "torch.dtype":
        if type(data) is str and (data in FLOAT_DTYPES or data in FLOAT8_DTYPES or data in INT_DTYPES
                                  or data in MX_ELEMENT_DTYPES):
            return Dtype(data)
        raise _ValueError(f"dtype {short(data)} is not one this converter knows")
    if kind in _ENUM_TYPES:
        if type(data) is str and data in _ENUM_TYPES[kind]:
            return Enum(kind, data)
        raise _ValueError(f"{kind} value {short(data)} is not one this converter knows")
    if kind in _OBJECT_TYPES:
        if type(data) is not dict:
            raise _ValueError(f"{kind} must hold an object, got {short(data)}")
        return Obj(kind, {k: _decode(v) for k, v in data.items()})
    raise _ValueError(f"value type {short(kind)} is not one this converter knows")


# ---------------------------------------------------------------------- one torchao tensor
@dataclass(frozen=True)
class Spec:
    """The fields and attributes a torchao tensor type may have."""

    required_fields: frozenset[str]
    optional_fields: frozenset[str]
    required_attributes: frozenset[str]
    optional_attributes: frozenset[str]


class Record:
    """One torchao tensor as stored: its fields (tensors) and decoded attributes."""

    def __init__(self, source: str, name: str, type_name: str, fields: dict[str, torch.Tensor],
                 attributes: dict[str, Any]):
        self.source, self.name, self.type_name = source, name, type_name
        self.fields, self.attributes = fields, attributes

    def fail(self, problem: str) -> TorchaoConversionError:
        return TorchaoConversionError(f"{self.source}: tensor {self.name!r} ({self.type_name}): {problem}")

    def tensor(self, f: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None = None) -> torch.Tensor:
        t = self.fields[f]
        if t.dtype not in dtypes:
            raise self.fail(f"field {f!r} has dtype {t.dtype}, expected one of {dtypes}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise self.fail(f"field {f!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t

    def ints(self, a: str, length: int | None = None) -> tuple[int, ...]:
        v = self.attributes.get(a)
        if type(v) is not list or not all(type(x) is int and x > 0 for x in v) or (length and len(v) != length):
            what = f"a list of {length} positive ints" if length else "a list of positive ints"
            raise self.fail(f"attribute {a!r} must be {what}, got {short(v)}")
        return tuple(v)

    def float_dtype(self, a: str) -> torch.dtype:
        v = self.attributes.get(a)
        if not isinstance(v, Dtype) or v.name not in FLOAT_DTYPES:
            raise self.fail(f"attribute {a!r} must be one of {sorted(FLOAT_DTYPES)}, got {show(v)}")
        return FLOAT_DTYPES[v.name]

    def unset(self, a: str, why: str) -> None:
        """Refuse an optional attribute or field that is set: hf_aoq has no equivalent."""
        v = self.fields.get(a, self.attributes.get(a))
        if v is not None:
            raise self.fail(f"{a!r} is set ({show(v)}): {why}; hf_aoq has no equivalent, so it is not converted")


def show(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    if isinstance(v, Dtype):
        return v.name
    if isinstance(v, Enum):
        return f"{v.type}.{v.name}"
    if isinstance(v, Obj):
        return f"{v.type}({', '.join(f'{k}={show(x)}' for k, x in v.data.items())})"
    return short(v)


# ---------------------------------------------------------------------- the checkpoint
def read_checkpoint(src: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], list[Path]]:
    """All stored tensors and the union of the shards' metadata (a key in several shards must
    hold the same text in each: transformers writes the whole metadata into every shard). The
    files are found and checked as a set by hf_aoq's checkpoint reader (`open_checkpoint`)."""
    if not (src / WEIGHTS_NAME).is_file() and not (src / INDEX_NAME).is_file():
        pickles = sorted(p.name for p in src.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise TorchaoConversionError(
                f"{src}: has {pickles} but no {WEIGHTS_NAME}: torchao checkpoints saved with pickle are never "
                f"read; re-save the model with safetensors (save_pretrained(..., safe_serialization=True))"
            )
        raise TorchaoConversionError(f"{src}: no {WEIGHTS_NAME} or {INDEX_NAME}")
    try:
        ckpt = open_checkpoint(src)
    except FormatError as e:
        raise TorchaoConversionError(str(e)) from None
    metadata: dict[str, str] = {}
    for path in ckpt.files:
        for key, text in (ckpt.headers[path].metadata or {}).items():
            if metadata.setdefault(key, text) != text:
                raise TorchaoConversionError(f"{path}: metadata key {short(key)} differs from another shard's")
    return ckpt.tensors(), metadata, [Path(f) for f in ckpt.files]


def parse_records(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    source: str,
    specs: Mapping[str, Spec],
    unsupported: Mapping[str, str],
):
    """Yield ("plain", name, tensor) and ("quantized", name, Record) for every name torchao lists;
    refuse anything not understood, and any stored key that no listed name claims."""
    if "tensor_names" not in metadata:
        raise TorchaoConversionError(
            f"{source}: no torchao metadata ('tensor_names' is not in the safetensors metadata); "
            f"this is not a checkpoint written by torchao's safetensors support"
        )
    try:
        names = loads_strict(metadata["tensor_names"])
    except ValueError as e:
        raise TorchaoConversionError(f"{source}: metadata 'tensor_names': {e}") from None
    if type(names) is not list or not all(type(n) is str and n for n in names) or len(set(names)) != len(names):
        raise TorchaoConversionError(f"{source}: metadata 'tensor_names' must be a list of distinct names")
    listed = set(names)
    for key in metadata:
        if key not in listed and key not in ("tensor_names", "format"):
            raise TorchaoConversionError(f"{source}: metadata key {key!r} is not a listed tensor (unknown metadata)")
    claimed: set[str] = set()
    out = []
    for name in names:
        text = metadata.get(name)
        if text is None:
            raise TorchaoConversionError(f"{source}: tensor {name!r} is listed in 'tensor_names' but has no metadata")
        try:
            entry = loads_strict(text)
        except ValueError as e:
            raise TorchaoConversionError(f"{source}: tensor {name!r}: metadata: {e}") from None
        if type(entry) is not dict or type(entry.get("_type")) is not str:
            raise TorchaoConversionError(f"{source}: tensor {name!r}: metadata must be an object with a '_type' string")
        type_name = entry["_type"]
        if type_name == "Tensor":
            if set(entry) != {"_type"}:
                extra = sorted(set(entry) - {"_type"})
                raise TorchaoConversionError(f"{source}: tensor {name!r}: unexpected keys {extra}")
            if name in tensors:
                claimed.add(name)
                out.append(("plain", name, tensors[name]))
            else:
                out.append(("missing", name, None))
            continue
        if type_name in unsupported:
            raise TorchaoConversionError(
                f"{source}: tensor {name!r}: torchao type {type_name} ({unsupported[type_name]}) is not supported; "
                f"hf_aoq converts {sorted(specs)}"
            )
        if type_name not in specs:
            raise TorchaoConversionError(
                f"{source}: tensor {name!r}: unknown torchao tensor type {short(type_name)}; "
                f"hf_aoq converts {sorted(specs)}"
            )
        spec = specs[type_name]
        if set(entry) != {"_type", "_data", "_tensor_data_names"}:
            raise TorchaoConversionError(
                f"{source}: tensor {name!r}: metadata must have exactly '_type', '_data' and '_tensor_data_names', "
                f"got {sorted(entry)}"
            )
        data, field_names = entry["_data"], entry["_tensor_data_names"]
        if type(field_names) is not list or not all(type(f) is str for f in field_names) \
                or len(set(field_names)) != len(field_names):
            raise TorchaoConversionError(
                f"{source}: tensor {name!r}: '_tensor_data_names' must be a list of distinct names"
            )
        unknown = sorted(set(field_names) - spec.required_fields - spec.optional_fields)
        if unknown:
            raise TorchaoConversionError(
                f"{source}: tensor {name!r} ({type_name}): unknown tensor field {unknown[0]!r} (a newer torchao?); "
                f"known: {sorted(spec.required_fields | spec.optional_fields)}"
            )
        missing = sorted(spec.required_fields - set(field_names))
        if missing:
            raise TorchaoConversionError(f"{source}: tensor {name!r} ({type_name}): required field {missing[0]!r} is "
                                         f"not in '_tensor_data_names'")
        if "." not in name:
            raise TorchaoConversionError(f"{source}: tensor {name!r}: a quantized tensor name needs a module part")
        module, leaf = name.rsplit(".", 1)
        fields = {}
        for f in field_names:
            key = f"{module}._{leaf}_{f}"
            if key not in tensors:
                raise TorchaoConversionError(
                    f"{source}: tensor {name!r} ({type_name}): field {f!r} (stored as {key!r}) is not in the checkpoint"
                )
            fields[f] = tensors[key]
            claimed.add(key)
        if type(data) is not dict:
            raise TorchaoConversionError(f"{source}: tensor {name!r}: '_data' must be an object")
        unknown = sorted(set(data) - spec.required_attributes - spec.optional_attributes)
        if unknown:
            raise TorchaoConversionError(
                f"{source}: tensor {name!r} ({type_name}): unknown attribute {unknown[0]!r} (a newer torchao?)"
            )
        missing = sorted(a for a in spec.required_attributes if data.get(a) is None)
        if missing:
            raise TorchaoConversionError(f"{source}: tensor {name!r} ({type_name}): required attribute {missing[0]!r} "
                                         f"is missing")
        attributes = {}
        for a, v in data.items():
            try:
                attributes[a] = _decode(v)
            except _ValueError as e:
                raise TorchaoConversionError(f"{source}: tensor {name!r} ({type_name}), attribute {a!r}: {e}") from None
        out.append(("quantized", name, Record(source, name, type_name, fields, attributes)))
    unclaimed = sorted(set(tensors) - claimed)
    if unclaimed:
        raise TorchaoConversionError(
            f"{source}: stored tensor {unclaimed[0]!r} belongs to no tensor the torchao metadata lists"
        )
    return out
