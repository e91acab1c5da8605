"""Fuzzing the loader: whatever is done to a checkpoint's header, its hf_aoq metadata, its
tensors, its index or the save ids of its shards, loading either raises FormatError (whose
message stays short, however long the untrusted text it quotes) or returns tensors that work.
Never another exception, never a hang (every parse here is linear in the input)."""
import atexit
import copy
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest

import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_aoq import AOQTensor, FormatError
from hf_aoq import serialization as S

FIXTURE = Path(__file__).parents[1] / "fixtures" / "v1_model.safetensors"
DATA = FIXTURE.read_bytes()
(HEADER_LEN,) = struct.unpack("<Q", DATA[:8])
with safetensors.safe_open(str(FIXTURE), "pt") as _f:
    METADATA = _f.metadata()
    TENSORS = _f.get_tensors()
DOC = json.loads(METADATA[S.METADATA_KEY])

# Deterministic, so CI sees the same examples every run; raise HF_AOQ_FUZZ_EXAMPLES to dig deeper.
FUZZ = settings(
    max_examples=int(os.environ.get("HF_AOQ_FUZZ_EXAMPLES", 150)),
    derandomize=not os.environ.get("HF_AOQ_FUZZ_EXAMPLES"),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


LONG = "L" * 100_000  # untrusted text that no error message may quote whole
MAX_MESSAGE = 3000


def assert_loads_or_refuses(load) -> None:
    try:
        state_dict = load()
    except FormatError as e:
        assert len(str(e)) < MAX_MESSAGE, str(e)[:500]
        return
    for name, t in state_dict.items():  # what loads must work
        if isinstance(t, AOQTensor):
            out = t.dequantize()
            assert out.shape == t.shape and out.dtype == t.dtype, name


# ---------------------------------------------------------------------- raw bytes
byte_edits = st.lists(st.tuples(st.integers(0, 8 + HEADER_LEN - 1), st.integers(0, 255)), min_size=1, max_size=6)


def load_bytes(data: bytes):
    fd, path = tempfile.mkstemp(suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return S.load_file(path)
    finally:
        os.unlink(path)


@FUZZ
@given(edits=byte_edits, cut=st.none() | st.integers(0, len(DATA)))
def test_mutated_file_bytes(edits, cut):
    data = bytearray(DATA)
    for pos, value in edits:
        data[pos] = value
    data = bytes(data if cut is None else data[:cut])
    assert_loads_or_refuses(lambda: load_bytes(data))


@FUZZ
@given(st.data())
def test_mutated_header_length_and_padding(data):
    header = DATA[8 : 8 + HEADER_LEN]
    length = data.draw(st.integers(0, 2**64 - 1) | st.integers(max(0, HEADER_LEN - 16), HEADER_LEN + 16))
    pad = data.draw(st.binary(max_size=16))
    mutated = struct.pack("<Q", length) + header + pad + DATA[8 + HEADER_LEN :]
    assert_loads_or_refuses(lambda: load_bytes(mutated))


# ---------------------------------------------------------------------- hf_aoq metadata
NAMES = sorted(DOC["tensors"])
WORDS = st.sampled_from(
    ["Int4Tensor", "Int4DQTensor", "Int8Tensor", "Float8Tensor", "bfloat16", "float8_e5m2", "int32", "uint8", "ints",
     "int", "gparams", "rparams", "tparams", "cpu_int4dq",
     "F32", "BF16", "U8", "I8", "F8_E4M3", "F4", "data_offsets", "__metadata__",
     "bool", "dtype", "enum", "per_token", "per_row", "per_tensor", "cpu_int4pack", "qdata", "scale", "zero",
     "shape", "dtype", "block_size", "act_quant", "act_dtype", "packing", "fields", "attributes", "type",
     "schema_version", "format_version", "tensors", "__class__", "os.system", "", LONG,
     "weight_map", "metadata", "hf_aoq_save_id", "0123456789abcdef" * 2, "model.safetensors",
     "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "../x.safetensors",
     "/etc/passwd.safetensors", "sub/x.safetensors"]
    + NAMES
    + [f"{n}:{f}" for n in NAMES for f in ("qdata", "scale", "zero", "gparams", "rparams", "tparams")]
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**65), 2**65)
    | st.sampled_from([0, 1, 2, -1, 16, 32, 64, 128, 2**63 - 1])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | WORDS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | WORDS, inner, max_size=4),
    max_leaves=10,
)


def locations(node, out):
    """Every (container, key) in a JSON tree, where container[key] can be replaced or removed."""
    if isinstance(node, dict):
        for k, v in node.items():
            out.append((node, k))
            locations(v, out)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append((node, i))
            locations(v, out)
    return out


def mutate_json(data, doc):
    """Replace, delete, add or swap one to three nodes of a JSON tree, in place."""
    for _ in range(data.draw(st.integers(1, 3))):
        places = locations(doc, [])
        if not places:
            return  # every node deleted: nothing left to mutate
        container, key = data.draw(st.sampled_from(places))
        op = data.draw(st.sampled_from(["replace", "delete", "add", "swap"]))
        if op == "replace":
            container[key] = data.draw(json_values)
        elif op == "delete":
            del container[key]
        elif op == "add" and isinstance(container, dict):
            container[data.draw(WORDS | st.text(max_size=6))] = data.draw(json_values)
        elif op == "swap":
            other, other_key = data.draw(st.sampled_from(locations(doc, [])))
            container[key], other[other_key] = other[other_key], container[key]


@FUZZ
@given(st.data())
def test_mutated_metadata_structure(data):
    doc = copy.deepcopy(DOC)
    mutate_json(data, doc)
    metadata = {**METADATA, S.METADATA_KEY: json.dumps(doc)}
    assert_loads_or_refuses(lambda: S.unflatten_state_dict(TENSORS, metadata, source="fuzz"))


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, len(METADATA[S.METADATA_KEY])), st.text(max_size=3), st.integers(0, 3)),
                      min_size=1, max_size=5))
def test_mutated_metadata_text(edits):
    text = METADATA[S.METADATA_KEY]
    for pos, insert, delete in edits:
        text = text[:pos] + insert + text[pos + delete :]
    metadata = {**METADATA, S.METADATA_KEY: text}
    assert_loads_or_refuses(lambda: S.unflatten_state_dict(TENSORS, metadata, source="fuzz"))


@FUZZ
@given(st.data())
def test_mutated_safetensors_header_structure(data):
    header = json.loads(DATA[8 : 8 + HEADER_LEN])
    mutate_json(data, header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    mutated = struct.pack("<Q", len(text)) + text + DATA[8 + HEADER_LEN :]
    assert_loads_or_refuses(lambda: load_bytes(mutated))


# ---------------------------------------------------------------------- stored tensors
DTYPES = [torch.uint8, torch.int8, torch.int32, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]
shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3)


@FUZZ
@given(st.data())
def test_mutated_tensors(data):
    tensors = dict(TENSORS)
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(tensors)) | WORDS)
        op = data.draw(st.sampled_from(["replace", "delete", "reshape"]))
        if op == "delete":
            tensors.pop(key, None)
        elif op == "reshape" and key in tensors and tensors[key].dim() == 2:
            t = tensors[key]
            tensors[key] = t.reshape(t.shape[1], t.shape[0]) if t.shape[0] != t.shape[1] else t.reshape(-1)
        else:
            shape, dtype = data.draw(shapes), data.draw(st.sampled_from(DTYPES))
            tensors[key] = torch.zeros(shape, dtype=dtype)
    assert_loads_or_refuses(lambda: S.unflatten_state_dict(tensors, METADATA, source="fuzz"))


# ---------------------------------------------------------------------- a sharded checkpoint
SHARDED = Path(tempfile.mkdtemp(prefix="hf_aoq_fuzz_"))
atexit.register(shutil.rmtree, SHARDED, True)
S.save_shards(S.unflatten_state_dict(TENSORS, METADATA), SHARDED, max_shard_size=DATA.__len__() // 2)
INDEX = json.loads((SHARDED / S.INDEX_NAME).read_text())
SHARDS = sorted(set(INDEX["weight_map"].values()))
assert len(SHARDS) >= 2


@FUZZ
@given(st.data())
def test_mutated_index(data):
    doc = copy.deepcopy(INDEX)
    mutate_json(data, doc)
    folder = Path(tempfile.mkdtemp(prefix="hf_aoq_fuzz_"))
    try:
        for name in SHARDS:
            os.symlink(SHARDED / name, folder / name)
        (folder / S.INDEX_NAME).write_text(json.dumps(doc))
        assert_loads_or_refuses(lambda: S.load_checkpoint(folder))
    finally:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()


save_ids = st.none() | st.sampled_from(["0123456789abcdef" * 2, INDEX["metadata"][S.SAVE_ID_KEY], "", LONG,
                                        "ABCDEF0123456789" * 2, "0" * 33])


@FUZZ
@given(ids=st.lists(save_ids, min_size=len(SHARDS), max_size=len(SHARDS)), index_id=save_ids)
def test_mutated_save_ids(ids, index_id):
    folder = Path(tempfile.mkdtemp(prefix="hf_aoq_fuzz_"))
    try:
        for name, save_id in zip(SHARDS, ids):
            with safetensors.safe_open(str(SHARDED / name), "pt") as f:
                tensors, metadata = f.get_tensors(), dict(f.metadata())
            metadata.pop(S.SAVE_ID_KEY)
            if save_id is not None:
                metadata[S.SAVE_ID_KEY] = save_id
            safetensors.torch.save_file(tensors, str(folder / name), metadata=metadata)
        index = copy.deepcopy(INDEX)
        index["metadata"].pop(S.SAVE_ID_KEY)
        if index_id is not None:
            index["metadata"][S.SAVE_ID_KEY] = index_id
        (folder / S.INDEX_NAME).write_text(json.dumps(index))
        found = {i for i in ids} | ({index_id} - {None})
        if len(found) > 1:  # files of different saves never load together
            with pytest.raises(FormatError):
                S.load_checkpoint(folder)
        assert_loads_or_refuses(lambda: S.load_checkpoint(folder))
    finally:
        shutil.rmtree(folder)


# ---------------------------------------------------------------------- layouts no kernel runs
def assert_loads_and_runs_or_refuses(load) -> None:
    """Stricter than assert_loads_or_refuses: what loads must also run F.linear once placed."""
    try:
        state_dict = load()
    except FormatError:
        return
    for name, t in state_dict.items():
        if isinstance(t, AOQTensor):
            x = torch.randn(2, t.shape[-1], dtype=t.dtype)
            assert torch.nn.functional.linear(x, t.place()).shape == (2, t.shape[0]), name


def _with_attributes(name, **attributes):
    doc = copy.deepcopy(DOC)
    doc["tensors"][name]["attributes"].update(attributes)
    return {**METADATA, S.METADATA_KEY: json.dumps(doc)}


# Metadata that describes the stored fields consistently, in a layout no kernel runs: before,
# loading accepted these (or raised a bare ValueError) and the first F.linear raised.
MALFORMED_LAYOUTS = [
    ("model.layers.0.proj.weight", {"block_size": ["ints", [2, 32]]}),  # scale [16, 2] read as 8 x 2 blocks
    ("model.layers.0.proj.weight", {"block_size": ["ints", [16, 64]]}),  # per tensor
    ("model.layers.0.proj.weight", {"block_size": ["ints", [1, 16]]}),  # a group size no kernel has
    # 3-D [E, N, K] is fused experts (tests/tensors/test_experts.py); 4-D is nothing.
    ("model.layers.0.proj.weight", {"shape": ["ints", [2, 1, 8, 64]], "block_size": ["ints", [1, 1, 1, 32]]}),
    ("model.layers.0.proj.weight", {"packing": ["enum", "cpu_int4_pairs"]}),
    ("model.layers.0.proj.weight_extra", {"block_size": ["ints", [2, 64]]}),
    ("model.layers.0.proj.weight_extra", {"shape": ["ints", [2, 1, 8, 64]], "block_size": ["ints", [1, 1, 1, 64]]}),
    ("model.embed.weight", {"block_size": ["ints", [2, 64]]}),
    ("model.embed.weight", {"block_size": ["ints", [1, 32]]}),
]


def test_malformed_layouts_are_refused_naming_the_tensor():
    for name, attributes in MALFORMED_LAYOUTS:
        tensors = dict(TENSORS)
        if "shape" in attributes:  # store the fields in the 4-D shape the metadata claims
            for key in [k for k in tensors if k.startswith(name + ":")]:
                t = tensors[key]
                tensors[key] = t.reshape(2, 1, t.shape[0] // 2, *t.shape[1:])
        metadata = _with_attributes(name, **attributes)
        try:
            S.unflatten_state_dict(tensors, metadata, source="fuzz")
        except FormatError as e:
            assert f"tensor {name!r}" in str(e), (attributes, str(e))
        else:
            raise AssertionError(f"{name} with {attributes} loaded")


block_sizes = st.lists(st.integers(0, 70), min_size=1, max_size=3)


@FUZZ
@given(name=st.sampled_from(sorted(DOC["tensors"])), block=block_sizes)
def test_mutated_block_size_loads_and_runs_or_is_refused(name, block):
    metadata = _with_attributes(name, block_size=["ints", block])
    assert_loads_and_runs_or_refuses(lambda: S.unflatten_state_dict(TENSORS, metadata, source="fuzz"))
