"""State dicts with quantized tensors <-> safetensors files, in the format of docs/format.md.

Saving puts each `AOQTensor` in its canonical layout, stores every tensor field under the key
`name:field`, and describes the tensor (type, schema version, field keys, typed attributes) in
one JSON text in the safetensors metadata. Loading parses that text once, resolves every name
through the allow-lists in `hf_aoq.core.registry`, upgrades old schemas, checks the stored
tensors against the attributes, and builds the tensors. Anything malformed is a `FormatError`
that names the file, the tensor and the field.

    metadata.py    the metadata JSON: typed values, parse_metadata, TensorEntry.build
    state_dict.py  flatten_state_dict / unflatten_state_dict
    reader.py      a strict, zero-copy reader of one safetensors file (its header alone, or all of it)
    shards.py      the one checkpoint reader: a folder's files (index), save ids, the union of the shards
    files.py       atomic writes (save_file, save_shards, write_atomic, replace_folder); load_file / load_checkpoint
"""
from .files import load_checkpoint, load_file, replace_folder, save_file, save_shards, write_atomic
from .metadata import FORMAT_VERSION, METADATA_KEY, SEPARATOR, TensorEntry, is_aoq_metadata, parse_metadata
from .reader import read_header, read_safetensors
from .shards import (
    INDEX_NAME,
    SAVE_ID_KEY,
    WEIGHTS_NAME,
    Checkpoint,
    checkpoint_files,
    new_save_id,
    open_checkpoint,
    read_loader_files,
    read_shards,
)
from .state_dict import flatten_state_dict, unflatten_state_dict

__all__ = [
    "Checkpoint",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "SAVE_ID_KEY",
    "WEIGHTS_NAME",
    "checkpoint_files",
    "load_checkpoint",
    "new_save_id",
    "open_checkpoint",
    "read_header",
    "read_loader_files",
    "read_shards",
    "save_shards",
    "replace_folder",
    "write_atomic",
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
