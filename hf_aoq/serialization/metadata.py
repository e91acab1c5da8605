"""The `hf_aoq` metadata JSON of docs/format.md: typed attribute values, and the parser that
turns it into one validated `TensorEntry` per quantized tensor (which builds the tensor)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import torch

from ..core import registry
from ..core.errors import AOQError, FormatError
from ..core.tensor import AOQTensor
from .common import NAME_LIMIT, error, gc_paused, load_json_object, reader_version, short

FORMAT_VERSION = 1
METADATA_KEY = "hf_aoq"  # the safetensors metadata key holding the JSON text
SEPARATOR = ":"  # field keys are f"{name}:{field}"; no state-dict name may contain it

_TOP_KEYS = frozenset({"format_version", "hf_aoq_version", "tensors"})
_ENTRY_KEYS = frozenset({"type", "schema_version", "fields", "attributes"})
TAGS = ("int", "ints", "bool", "dtype", "enum")
_INT_MIN, _INT_MAX = -9223372036854775808, 9223372036854775807  # int64


# ---------------------------------------------------------------------- attribute values
def encode_value(value: Any, enum: str) -> list:
    """The tagged JSON form `[tag, value]` of an attribute value; `enum` names its allow-list
    ("TypeName.attribute"), used if the value is a string. Raises AOQError for a value that no
    reader could decode."""
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise AOQError(f"int {value} is outside the int64 range")
        return ["int", int(value)]
    if isinstance(value, torch.dtype):
        try:
            return ["dtype", registry.dtype_name(value)]
        except FormatError as e:
            raise AOQError(str(e)) from None
    if isinstance(value, str):
        try:
            return ["enum", registry.enum_value(enum, value)]
        except FormatError as e:
            raise AOQError(str(e)) from None
    if isinstance(value, (tuple, list)) and _is_int64_list(value):
        return ["ints", list(value)]
    raise AOQError(f"cannot store a {type(value).__name__} attribute ({short(value)}); tags are {TAGS}")


def _is_int64_list(values) -> bool:
    # `type(x) is int`: bool is a subclass of int but is not a size.
    return all(type(x) is int and _INT_MIN <= x <= _INT_MAX for x in values)


def decode_value(value: Any) -> Any:
    """The Python value of a tagged JSON attribute `[tag, value]`. Raises AOQError if malformed."""
    if type(value) is not list or len(value) != 2:
        raise AOQError(f"expected [tag, value] with a tag out of {TAGS}, got {short(value)}")
    tag, v = value
    if tag == "ints":
        if type(v) is list and _is_int64_list(v):
            return tuple(v)
    elif tag == "dtype":
        dtype = registry.DTYPES.get(v) if type(v) is str else None
        if dtype is not None:
            return dtype
        if type(v) is str:
            raise AOQError(f"unknown dtype {short(v)}; known: {sorted(registry.DTYPES)}")
    elif tag == "enum":
        if type(v) is str:
            return v  # checked against its attribute's allow-list by _check_names
    elif tag == "int":
        if type(v) is int and _INT_MIN <= v <= _INT_MAX:
            return v
    elif tag == "bool":
        if type(v) is bool:
            return v
    else:
        raise AOQError(f"unknown value tag {short(tag)}; this hf_aoq knows {TAGS}")
    raise AOQError(f"malformed {tag!r} value {short(v)}")


# ---------------------------------------------------------------------- checking records
class _Schema(NamedTuple):
    """A tensor type's declared field names, as sets, for checking records."""

    names: tuple[str, ...]
    tensors: frozenset[str]
    required_tensors: frozenset[str]
    attributes: frozenset[str]
    required_attributes: frozenset[str]


_SCHEMAS: dict[type, _Schema] = {}


def _schema(cls: type[AOQTensor]) -> _Schema:
    s = _SCHEMAS.get(cls)
    if s is None:
        s = _SCHEMAS[cls] = _Schema(
            cls.field_names(),
            frozenset(cls.tensor_data_names) | frozenset(cls.optional_tensor_data_names),
            frozenset(cls.tensor_data_names),
            frozenset(cls.tensor_attribute_names) | frozenset(cls.optional_tensor_attribute_names),
            frozenset(cls.tensor_attribute_names),
        )
    return s


def _tensor_type(type_name: Any, source: str, tensor: str) -> type[AOQTensor]:
    if type(type_name) is not str:
        raise error(source, f"'type' must be a string, got {short(type_name)}", tensor)
    try:
        return registry.tensor_type(type_name)
    except FormatError as e:
        raise error(source, str(e), tensor) from None


def _check_names(cls, type_name: str, tensor_names, attributes: Mapping[str, Any], source, tensor, writer) -> None:
    """Every field of a current-schema record is declared by `cls` in its role, every required
    one is there, and every enum attribute holds an allowed value."""
    s = _schema(cls)
    if not tensor_names <= s.tensors:
        name = sorted(set(tensor_names) - s.tensors)[0]
        raise _unknown_field(cls, type_name, name, s, "field", source, tensor, writer)
    if not attributes.keys() <= s.attributes:
        name = sorted(attributes.keys() - s.attributes)[0]
        raise _unknown_field(cls, type_name, name, s, "attribute", source, tensor, writer)
    if not s.required_tensors <= tensor_names:
        missing = sorted(s.required_tensors - set(tensor_names))[0]
        raise error(source, "required tensor field missing from the metadata", tensor, f"field {missing!r}")
    if not s.required_attributes <= attributes.keys():
        missing = sorted(s.required_attributes - attributes.keys())[0]
        raise error(source, "required attribute missing from the metadata", tensor, f"attribute {missing!r}")
    enums = registry.ENUMS
    for name, value in attributes.items():
        if type(value) is str or f"{type_name}.{name}" in enums:
            try:
                registry.enum_value(f"{type_name}.{name}", value)
            except FormatError as e:
                raise error(source, str(e), tensor, f"attribute {name!r}") from None


def _unknown_field(cls, type_name, name, s: _Schema, role, source, tensor, writer) -> FormatError:
    if name in s.attributes and role == "field":
        return error(source, f"is an attribute of {type_name}, not a tensor field", tensor, f"field {name!r}")
    if name in s.tensors and role == "attribute":
        return error(source, f"is a tensor field of {type_name}, not an attribute", tensor, f"attribute {name!r}")
    return error(
        source,
        f"{type_name} schema {cls.schema_version} in this hf_aoq {reader_version()} has no such {role}; "
        f"the file was written by hf_aoq {writer}, which may have added it: upgrade hf_aoq to load it",
        tensor,
        f"{role} {name!r}",
    )


def _newer_schema(type_name: str, version: int, cls, writer: str, source: str, tensor: str) -> FormatError:
    return error(
        source,
        f"{type_name} schema version {short(version)}, written by hf_aoq {writer}, is newer than this hf_aoq "
        f"{reader_version()} can read ({type_name} schema versions 1 to {cls.schema_version}): upgrade hf_aoq",
        tensor,
    )


# ---------------------------------------------------------------------- entries
@dataclass(frozen=True)
class TensorEntry:
    """One quantized tensor as the metadata describes it, validated by `parse_metadata`."""

    name: str
    type_name: str
    schema_version: int
    keys: dict[str, str]  # tensor field name -> storage key in the file
    attributes: dict[str, Any] = field(default_factory=dict)  # decoded attribute values
    writer: str = "unknown"  # the hf_aoq release that wrote the file, for error messages
    _checked: bool = field(default=False, repr=False, compare=False)  # names and enums checked

    def build(self, fields: Mapping[str, torch.Tensor], *, source: str = "<memory>") -> AOQTensor:
        """The tensor in canonical layout from its stored tensors, by field name (`qdata`, not
        the storage key). Checks them against the metadata, upgrades an old schema and leaves
        missing optional fields at their default."""
        name = self.name
        cls = registry.TENSOR_TYPES.get(self.type_name) or _tensor_type(self.type_name, source, name)
        if fields.keys() != self.keys.keys():
            raise self._field_mismatch(fields, source)
        for f, t in fields.items():
            if type(t) is not torch.Tensor and (not isinstance(t, torch.Tensor) or isinstance(t, AOQTensor)):
                raise error(source, f"expected a plain tensor, got {type(t).__name__}", name, f"field {f!r}")
        values = dict.fromkeys(_schema(cls).names)  # optional fields default to None
        if self.schema_version != cls.schema_version:
            values.update(self._upgrade(cls, {**fields, **self.attributes}, source))
        else:
            if not self._checked:
                _check_names(cls, self.type_name, fields.keys(), self.attributes, source, name, self.writer)
            values.update(fields)
            values.update(self.attributes)
        try:
            cls.check_fields(values)
        except AOQError as e:  # its message starts "field 'f': ..." or "attribute 'a': ..."
            raise FormatError(f"{source}: tensor {short(name, NAME_LIMIT)}, {e}") from None
        try:
            # The constructor's own role, presence and type checks were all done above.
            return cls.from_checked_fields(values)
        except (TypeError, ValueError, RuntimeError) as e:
            raise error(source, f"cannot build a {self.type_name}: {e}", name) from e

    def _field_mismatch(self, fields: Mapping[str, Any], source: str) -> FormatError:
        extra = [f for f in fields if f not in self.keys]
        if any(SEPARATOR in str(f) for f in extra):
            return error(source, "build takes field names, not storage keys", self.name, f"field {extra[0]!r}")
        for f, key in self.keys.items():
            if f not in fields:
                problem = f"the metadata lists key {short(key, NAME_LIMIT)}, which is not in the file"
                return error(source, problem, self.name, f"field {f!r}")
        return error(source, "not listed in the metadata", self.name, f"field {extra[0]!r}")

    def _upgrade(self, cls: type[AOQTensor], record: dict[str, Any], source: str) -> dict[str, Any]:
        if self.schema_version > cls.schema_version:
            raise _newer_schema(self.type_name, self.schema_version, cls, self.writer, source, self.name)
        for v in range(self.schema_version, cls.schema_version):
            upgrade = cls.schema_upgraders.get(v)
            if upgrade is None:
                raise error(source, f"{self.type_name} has no upgrader from schema {v} to {v + 1}", self.name)
            try:
                record = upgrade(dict(record))
            except Exception as e:  # an upgrader meets data from an old file: any failure is a bad file
                raise error(source, f"upgrading {self.type_name} schema {v} to {v + 1} failed: {e}", self.name) from e
            if not isinstance(record, dict):
                raise error(source, f"{self.type_name} upgrader {v} returned a {type(record).__name__}", self.name)
        record = {k: v for k, v in record.items() if v is not None}
        tensors = {k for k, v in record.items() if isinstance(v, torch.Tensor)}
        attributes = {k: v for k, v in record.items() if k not in tensors}
        _check_names(cls, self.type_name, tensors, attributes, source, self.name, self.writer)
        return record


# ---------------------------------------------------------------------- parsing
def is_aoq_metadata(metadata: Mapping[str, str] | None) -> bool:
    """Whether safetensors metadata was written by hf_aoq (it may still be malformed)."""
    return isinstance(metadata, Mapping) and METADATA_KEY in metadata


def parse_metadata(metadata: Mapping[str, str] | None, *, source: str = "<memory>") -> dict[str, TensorEntry]:
    """One entry per quantized tensor described by safetensors `metadata`; {} if it has no
    hf_aoq metadata. Parses the JSON once and validates all of it (structure, versions, type,
    dtype and enum allow-lists, field keys) before any tensor is read."""
    return read_metadata(metadata, source=source)[2]


def read_metadata(
    metadata: Mapping[str, str] | None, *, source: str = "<memory>"
) -> tuple[int | None, str | None, dict[str, TensorEntry]]:
    """(format version, writer's release, entries) of safetensors `metadata`, as `parse_metadata`
    parses it; (None, None, {}) when it has no hf_aoq metadata."""
    if metadata is None:
        return None, None, {}
    if not isinstance(metadata, Mapping):
        raise error(source, f"metadata must be a str -> str mapping, got {type(metadata).__name__}")
    text = metadata.get(METADATA_KEY)
    if text is None:
        return None, None, {}
    if not isinstance(text, str):
        raise error(source, f"metadata key {METADATA_KEY!r} must hold JSON text, got {type(text).__name__}")
    with gc_paused():
        return _parse_text(text, source)


def _parse_text(text: str, source: str) -> tuple[int, str, dict[str, TensorEntry]]:
    doc = load_json_object(text, source, f"{METADATA_KEY} metadata")
    version = doc.get("format_version")
    writer = doc.get("hf_aoq_version")
    if type(writer) is str and len(writer) > 40:  # it is quoted in error messages only
        writer = writer[:37] + "..."
    if type(version) is int and version > FORMAT_VERSION:  # anything else in a newer format may differ
        raise error(
            source,
            f"written in hf_aoq format version {short(version)} by hf_aoq "
            f"{writer if type(writer) is str else '(unknown)'}; "
            f"this hf_aoq {reader_version()} reads format versions up to {FORMAT_VERSION}: upgrade hf_aoq",
        )
    if type(version) is not int or version < 1:
        raise error(source, f"{METADATA_KEY} metadata: 'format_version' must be an int >= 1, got {short(version)}")
    if type(writer) is not str:
        raise error(source, f"{METADATA_KEY} metadata: 'hf_aoq_version' must be a string, got {short(writer)}")
    if doc.keys() != _TOP_KEYS:
        raise error(source, f"{METADATA_KEY} metadata: {_key_problem(doc, _TOP_KEYS)}")
    tensors = doc["tensors"]
    if type(tensors) is not dict:
        raise error(source, f"{METADATA_KEY} metadata: 'tensors' must be an object, got {short(tensors)}")
    return version, writer, {name: _parse_entry(name, raw, writer, source) for name, raw in tensors.items()}


def _key_problem(obj: dict, expected: frozenset[str]) -> str:
    missing = sorted(expected - obj.keys())
    if missing:
        return f"missing key {missing[0]!r}"
    return f"unknown key {short(sorted(obj.keys() - expected)[0])}; expected exactly {sorted(expected)}"


def _parse_entry(name: str, raw: Any, writer: str, source: str) -> TensorEntry:
    if not name or SEPARATOR in name:
        raise error(source, f"a quantized tensor's name must be non-empty and contain no {SEPARATOR!r}", name)
    if type(raw) is not dict:
        raise error(source, f"metadata entry must be an object, got {short(raw)}", name)
    if raw.keys() != _ENTRY_KEYS:
        raise error(source, _key_problem(raw, _ENTRY_KEYS), name)
    type_name = raw["type"]
    cls = (type(type_name) is str and registry.TENSOR_TYPES.get(type_name)) or _tensor_type(type_name, source, name)
    version = raw["schema_version"]
    if type(version) is not int or version < 1:
        raise error(source, f"'schema_version' must be an int >= 1, got {short(version)}", name)
    if version > cls.schema_version:
        raise _newer_schema(type_name, version, cls, writer, source, name)
    keys = raw["fields"]
    if type(keys) is not dict or not keys:
        raise error(source, f"'fields' must be a non-empty object, got {short(keys)}", name)
    prefix = name + SEPARATOR
    for f, key in keys.items():
        if type(key) is not str or key != prefix + f:
            raise error(source, f"key must be {short(prefix + f, NAME_LIMIT)}, got {short(key)}", name, f"field {f!r}")
    raw_attributes = raw["attributes"]
    if type(raw_attributes) is not dict:
        raise error(source, f"'attributes' must be an object, got {short(raw_attributes)}", name)
    attributes = {}
    for a, value in raw_attributes.items():
        try:
            attributes[a] = decode_value(value)
        except AOQError as e:
            raise error(source, f"{e} (the file was written by hf_aoq {writer})", name, f"attribute {a!r}") from None
    checked = version == cls.schema_version
    if checked:
        _check_names(cls, type_name, keys.keys(), attributes, source, name, writer)
    return TensorEntry(name, type_name, version, keys, attributes, writer, checked)
