"""State dicts with quantized tensors <-> the plain tensors and metadata a safetensors file holds."""
from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

import torch

from ..core import registry
from ..core.errors import AOQError, FormatError
from ..core.tensor import AOQTensor
from .common import NAME_LIMIT, error, gc_paused, reader_version, short
from .metadata import FORMAT_VERSION, METADATA_KEY, SEPARATOR, TensorEntry, encode_value, parse_metadata


def flatten_state_dict(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Plain tensors for safetensors and the metadata that describes exactly them.

    A quantized tensor `name` is put in its canonical layout and each present tensor field is
    stored, contiguous and on CPU, under `name:field`; plain tensors keep their name. Call it per
    shard: the metadata covers only the tensors given. Refuses (FormatError) names containing
    ':', key collisions, unregistered types, attributes the format cannot hold and layouts the
    type's `check_fields` (the loader's check) refuses."""
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
                f"got {short(name, NAME_LIMIT)}",
            )
        if isinstance(value, AOQTensor):
            entries[name] = _flatten_one(name, value, registered, tensors, seen_storage, source)
        elif _is_transposed_view(value):
            raise error(source, "is a TransposedExperts view (fused experts stored as the transpose of the "
                        "module's parameter), which a state dict file cannot record; save the quantized tensor "
                        "under it (`.experts`) and wrap it again after loading, or save the model with "
                        "save_pretrained (quantization_config.stored_transposed records it)", name)
        elif isinstance(value, torch.Tensor):
            _put(tensors, name, value.detach().to("cpu").contiguous(), source)
        else:
            raise error(source, f"expected a tensor, got {type(value).__name__}", name)
    header = {"format_version": FORMAT_VERSION, "hf_aoq_version": reader_version(), "tensors": entries}
    return tensors, {"format": "pt", METADATA_KEY: json.dumps(header, separators=(",", ":"))}


def _is_transposed_view(value) -> bool:
    from ..tensors.experts import TransposedExperts  # tensors import serialization's users: import late

    return isinstance(value, TransposedExperts)


def _flatten_one(name, value, registered, tensors, seen_storage, source) -> dict[str, Any]:
    canonical = value.to_canonical()
    cls = type(canonical)
    type_name = registered.get(cls)
    if type_name is None:
        raise error(source, f"{cls.__name__} is not a registered tensor type, so no reader could load it", name)
    try:
        cls.check_fields(canonical.fields())  # what the loader checks: never save what it refuses
    except AOQError as e:  # its message starts "field 'f': ..." or "attribute 'a': ..."
        raise FormatError(f"{source}: tensor {short(name, NAME_LIMIT)}, {e}; a loader refuses this layout, "
                          f"so it is not saved") from None
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
    tensors: Mapping[str, torch.Tensor],
    entries: dict[str, TensorEntry],
    source: str,
    where: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Build every entry from its stored tensors; pass the other tensors through. Every key
    that holds a field must belong to an entry, and every entry's keys must be there.

    `where` (storage key -> file) is given when `tensors` is the union of a checkpoint's shards
    (`source` then names the checkpoint); errors name the file that holds a tensor."""
    with gc_paused():
        out: dict[str, torch.Tensor] = {}
        claimed = 0
        for name, entry in entries.items():
            fields = {}
            for f, key in entry.keys.items():
                t = tensors.get(key)
                if t is None:
                    raise key_problems(tensors, entries, source, where)[0][1]
                fields[f] = t
            claimed += len(fields)
            out[name] = entry.build(fields, source=source if where is None else where[entry.keys[f]])
        field_keys = 0
        for key, t in tensors.items():
            if SEPARATOR in key:
                field_keys += 1
            elif key in entries:
                raise key_problems(tensors, entries, source, where)[0][1]
            else:
                out[key] = t
        # Claimed keys are distinct (name:field) and all present, so equal counts mean that no
        # field key is left without an entry.
        if field_keys != claimed:
            raise key_problems(tensors, entries, source, where)[0][1]
        return out


def key_problems(
    keys: Iterable[str], entries: dict[str, TensorEntry], source: str, where: Mapping[str, str] | None = None
) -> list[tuple[str, FormatError]]:
    """(tensor name, error) for every way the stored `keys` and the metadata's `entries`
    disagree (docs/format.md, Reading, rule 5): a listed key that is not stored, a plain tensor
    with a quantized tensor's name, a field key no entry lists. `where` (key -> file) is given
    for the union of a checkpoint's shards; errors then name the file of a key."""
    keys = keys if isinstance(keys, Mapping) else dict.fromkeys(keys)
    sharded = where is not None
    out = []
    for name, entry in entries.items():
        for f, key in entry.keys.items():
            if key not in keys:
                problem = f"the metadata lists key {short(key, NAME_LIMIT)}, which is " + (
                    "in no shard" if sharded else "not in the file")
                out.append((name, error(source, problem, name, f"field {f!r}")))
        if name in keys:
            problem = "stored both as a plain tensor and as quantized fields" if sharded else \
                f"the file has both a plain tensor and a quantized tensor named {short(name, NAME_LIMIT)}"
            out.append((name, error(where[name] if sharded else source, problem, name)))
    for key in keys:
        if SEPARATOR not in key:
            continue
        name, _, f = key.partition(SEPARATOR)
        entry = entries.get(name)
        if entry is not None and entry.keys.get(f) == key:
            continue
        if sharded:
            problem = f"field key {short(key, NAME_LIMIT)} is in a shard but no hf_aoq metadata lists it"
            out.append((name, error(where[key], problem)))
        else:
            hint = "" if entries else f" (it has no {METADATA_KEY} metadata at all)"
            problem = f"the file has the field key {short(key, NAME_LIMIT)} but no metadata for it{hint}"
            out.append((name, error(source, problem, name, f"field {short(f, NAME_LIMIT)}")))
    return out
