"""State dicts with quantized tensors <-> the plain tensors and metadata a safetensors file holds."""
from __future__ import annotations

import json
from typing import Any, Mapping

import torch

from ..core import registry
from ..core.errors import AOQError, FormatError
from ..core.tensor import AOQTensor
from .common import error, gc_paused, reader_version
from .metadata import FORMAT_VERSION, METADATA_KEY, SEPARATOR, TensorEntry, encode_value, parse_metadata


def flatten_state_dict(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Plain tensors for safetensors and the metadata that describes exactly them.

    A quantized tensor `name` is put in its canonical layout and each present tensor field is
    stored, contiguous and on CPU, under `name:field`; plain tensors keep their name. Call it per
    shard: the metadata covers only the tensors given. Refuses (FormatError) names containing
    ':', key collisions, unregistered types and attributes the format cannot hold."""
    source = "<state dict>"
    registered = {cls: name for name, cls in registry.TENSOR_TYPES.items()}
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, Any] = {}
    seen_storage: set[int] = set()
    for name, value in state_dict.items():
        if type(name) is not str or not name or SEPARATOR in name:
            raise error(
                source,
                f"state-dict names must be non-empty strings without {SEPARATOR!r} (it separates field keys), "
                f"got {name!r}",
            )
        if isinstance(value, AOQTensor):
            entries[name] = _flatten_one(name, value, registered, tensors, seen_storage, source)
        elif isinstance(value, torch.Tensor):
            _put(tensors, name, value.detach().to("cpu").contiguous(), source)
        else:
            raise error(source, f"expected a tensor, got {type(value).__name__}", name)
    header = {"format_version": FORMAT_VERSION, "hf_aoq_version": reader_version(), "tensors": entries}
    return tensors, {"format": "pt", METADATA_KEY: json.dumps(header, separators=(",", ":"))}


def _flatten_one(name, value, registered, tensors, seen_storage, source) -> dict[str, Any]:
    canonical = value.to_canonical()
    cls = type(canonical)
    type_name = registered.get(cls)
    if type_name is None:
        raise error(source, f"{cls.__name__} is not a registered tensor type, so no reader could load it", name)
    keys = {}
    for f, t in canonical.tensor_fields().items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        # safetensors refuses tensors that share memory; a field that is a view of a larger
        # buffer, or the same buffer as another field (tied weights), gets its own copy.
        if storage.nbytes() != t.nbytes or storage.data_ptr() in seen_storage:
            t = t.clone()
            storage = t.untyped_storage()
        if t.nbytes:
            seen_storage.add(storage.data_ptr())
        key = name + SEPARATOR + f
        _put(tensors, key, t, source)
        keys[f] = key
    attributes = {}
    for a, v in canonical.attributes().items():
        if v is None:
            continue  # optional and unset: left out, so older readers can load the file
        try:
            attributes[a] = encode_value(v, f"{type_name}.{a}")
        except AOQError as e:
            raise error(source, str(e), name, f"attribute {a!r}") from None
    return {"type": type_name, "schema_version": cls.schema_version, "fields": keys, "attributes": attributes}


def _put(tensors: dict[str, torch.Tensor], key: str, t: torch.Tensor, source: str) -> None:
    if key in tensors:
        raise error(source, f"two tensors would be stored under the key {key!r}")
    tensors[key] = t


def unflatten_state_dict(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None, *, source: str = "<memory>"
) -> dict[str, torch.Tensor]:
    """The state dict that `flatten_state_dict` flattened: quantized tensors rebuilt (canonical
    layout, not placed), plain tensors passed through. `tensors` and `metadata` are one file's."""
    entries = parse_metadata(metadata, source=source)
    return assemble(tensors, entries, source)


def assemble(
    tensors: Mapping[str, torch.Tensor], entries: dict[str, TensorEntry], source: str
) -> dict[str, torch.Tensor]:
    """Build every entry from its stored tensors; pass the other tensors through. Every key
    that holds a field must belong to an entry, and every entry's keys must be there."""
    with gc_paused():
        out: dict[str, torch.Tensor] = {}
        claimed = 0
        for name, entry in entries.items():
            fields = {}
            for f, key in entry.keys.items():
                t = tensors.get(key)
                if t is None:
                    problem = f"the metadata lists key {key!r}, which is not in the file"
                    raise error(source, problem, name, f"field {f!r}")
                fields[f] = t
            claimed += len(fields)
            out[name] = entry.build(fields, source=source)
        field_keys = 0
        for key, t in tensors.items():
            if SEPARATOR in key:
                field_keys += 1
            elif key in entries:
                raise error(source, f"the file has both a plain tensor and a quantized tensor named {key!r}", key)
            else:
                out[key] = t
        # Claimed keys are distinct (name:field) and all present, so equal counts mean that no
        # field key is left without an entry.
        if field_keys != claimed:
            raise _unclaimed_key(tensors, entries, source)
        return out


def _unclaimed_key(tensors: Mapping[str, torch.Tensor], entries: dict[str, TensorEntry], source: str) -> FormatError:
    for key in tensors:
        if SEPARATOR in key:
            name, _, f = key.partition(SEPARATOR)
            entry = entries.get(name)
            if entry is None or entry.keys.get(f) != key:
                hint = "" if entries else f" (it has no {METADATA_KEY} metadata at all)"
                problem = f"the file has the field key {key!r} but no metadata for it{hint}"
                return error(source, problem, name, f"field {f!r}")
    raise AssertionError("unreachable: the counts differ but every field key has its entry")
