"""State dicts with quantized tensors <-> safetensors files, in the format of docs/format.md.

Saving puts each `AOQTensor` in its canonical layout, stores every tensor field under the key
`name:field`, and describes the tensor (type, schema version, field keys, typed attributes) in
one JSON text in the safetensors metadata. Loading parses that text once, resolves every name
through the allow-lists in `hf_aoq.core.registry`, upgrades old schemas, checks the stored
tensors against the attributes, and builds the tensors. Anything malformed is a `FormatError`
that names the file, the tensor and the field.

    metadata.py    the metadata JSON: typed values, parse_metadata, TensorEntry.build
    state_dict.py  flatten_state_dict / unflatten_state_dict
    files.py       save_file (atomic) / load_file (placed on a device)
    reader.py      a strict, zero-copy safetensors reader for load_file
"""
from .files import load_file, save_file
from .metadata import FORMAT_VERSION, METADATA_KEY, SEPARATOR, TensorEntry, is_aoq_metadata, parse_metadata
from .reader import read_safetensors
from .state_dict import flatten_state_dict, unflatten_state_dict

__all__ = [
    "FORMAT_VERSION",
    "METADATA_KEY",
    "SEPARATOR",
    "TensorEntry",
    "flatten_state_dict",
    "is_aoq_metadata",
    "load_file",
    "parse_metadata",
    "read_safetensors",
    "save_file",
    "unflatten_state_dict",
]
