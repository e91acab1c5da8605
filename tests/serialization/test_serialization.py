"""hf_aoq.serialization: round trips, the key and metadata layout, atomic saves, and a clear
FormatError for every malformed input (docs/format.md is the spec these tests hold it to)."""
import json
import os
import stat
import struct

import pytest
import safetensors.torch
import torch

from hf_aoq import (AOQTensor, Float8Tensor, FormatError, Int4DQTensor, Int4Tensor, Int8Tensor, IntxTensor, PerRow,
                    PerTensor)
from hf_aoq import serialization as S
from hf_aoq.core import registry


def weight(n=16, k=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.1).to(dtype)


CONFIGS = {
    "int4_asym_g32": lambda: Int4Tensor.from_float(weight(), group_size=32),
    "int4_sym_g128_f16": lambda: Int4Tensor.from_float(weight(dtype=torch.float16), group_size=128, symmetric=True),
    "int4dq_g32": lambda: Int4DQTensor.from_float(weight(), 32),
    "int4dq_g64_partial_f32": lambda: Int4DQTensor.from_float(weight(k=96, dtype=torch.float32), 64),
    "int8_per_row": lambda: Int8Tensor.from_float(weight()),
    "int8_per_group_f32": lambda: Int8Tensor.from_float(weight(dtype=torch.float32), group_size=32),
    "int8_dynamic": lambda: Int8Tensor.from_float(weight(), act_quant="per_token"),
    "intx3_sym_g32": lambda: IntxTensor.from_float(weight(), 3, 32),
    "intx5_asym_row_partial_f32": lambda: IntxTensor.from_float(weight(k=100, dtype=torch.float32), 5, None, False),
    "intx2_dynamic_g64": lambda: IntxTensor.from_float(weight(), 2, 64, act_quant="per_token"),
    "float8_e4m3_per_tensor": lambda: Float8Tensor.from_float(weight(), torch.float8_e4m3fn, PerTensor()),
    "float8_e5m2_per_row": lambda: Float8Tensor.from_float(weight(), torch.float8_e5m2, PerRow()),
    "float8_dynamic": lambda: Float8Tensor.from_float(
        weight(), granularity=PerRow(), act_quant="per_tensor", act_dtype=torch.float8_e5m2
    ),
}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch.equal has no float8 kernel on CPU; comparing bytes is stricter anyway.
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def assert_same_tensor(a: AOQTensor, b: AOQTensor):
    assert type(a) is type(b)
    assert a.attributes() == b.attributes()
    fa, fb = a.tensor_fields(), b.tensor_fields()
    assert fa.keys() == fb.keys()
    for n in fa:
        assert same_bits(fa[n], fb[n]), n


def model_state_dict():
    return {
        "layers.0.proj.weight": CONFIGS["int4_asym_g32"](),
        "layers.0.proj.weight_scale": torch.ones(16),  # a plain name that extends a quantized one
        "layers.0.proj.bias": torch.arange(16, dtype=torch.int16),
        "layers.1.proj.weight": CONFIGS["int8_dynamic"](),
        "layers.2.proj.weight": CONFIGS["float8_dynamic"](),
        "flags": torch.tensor([True, False]),
    }


def header(metadata):
    return json.loads(metadata[S.METADATA_KEY])


def with_header(metadata, doc):
    return {**metadata, S.METADATA_KEY: json.dumps(doc)}


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_round_trip_in_memory(config):
    t = CONFIGS[config]()
    tensors, metadata = S.flatten_state_dict({"w": t})
    back = S.unflatten_state_dict(tensors, metadata)
    assert list(back) == ["w"]
    assert_same_tensor(back["w"], t)
    assert torch.equal(back["w"].dequantize(), t.dequantize())


def test_round_trip_through_a_file(tmp_path):
    sd = model_state_dict()
    path = tmp_path / "model.safetensors"
    S.save_file(sd, path)
    back = S.load_file(path)
    assert back.keys() == sd.keys()
    for name, t in sd.items():
        if isinstance(t, AOQTensor):
            assert type(back[name]) is type(t)
            assert torch.equal(back[name].dequantize(), t.dequantize()), name
        else:
            assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_a_loaded_checkpoint_saves_again(tmp_path):
    sd = model_state_dict()
    S.save_file(sd, tmp_path / "a.safetensors")
    S.save_file(S.load_file(tmp_path / "a.safetensors"), tmp_path / "b.safetensors")
    back = S.load_file(tmp_path / "b.safetensors")
    for name, t in sd.items():
        got = back[name]
        assert torch.equal(got.dequantize(), t.dequantize()) if isinstance(t, AOQTensor) else torch.equal(got, t)


def test_layout_of_keys_and_metadata():
    tensors, metadata = S.flatten_state_dict(model_state_dict())
    assert sorted(tensors) == sorted([
        "layers.0.proj.weight:qdata", "layers.0.proj.weight:scale", "layers.0.proj.weight:zero",
        "layers.0.proj.weight_scale", "layers.0.proj.bias",
        "layers.1.proj.weight:qdata", "layers.1.proj.weight:scale",
        "layers.2.proj.weight:qdata", "layers.2.proj.weight:scale",
        "flags",
    ])
    assert all(t.is_contiguous() and t.device.type == "cpu" and type(t) is torch.Tensor for t in tensors.values())
    assert metadata["format"] == "pt"
    doc = header(metadata)
    assert doc["format_version"] == S.FORMAT_VERSION == 1
    assert list(doc["tensors"]) == ["layers.0.proj.weight", "layers.1.proj.weight", "layers.2.proj.weight"]
    assert doc["tensors"]["layers.0.proj.weight"] == {
        "type": "Int4Tensor",
        "schema_version": 1,
        "fields": {f: f"layers.0.proj.weight:{f}" for f in ("qdata", "scale", "zero")},
        "attributes": {
            "block_size": ["ints", [1, 32]],
            "shape": ["ints", [16, 128]],
            "dtype": ["dtype", "bfloat16"],
        },  # packing is None, so it is left out
    }
    assert doc["tensors"]["layers.1.proj.weight"]["attributes"]["act_quant"] == ["enum", "per_token"]
    assert doc["tensors"]["layers.2.proj.weight"]["attributes"]["act_dtype"] == ["dtype", "float8_e5m2"]
    assert S.is_aoq_metadata(metadata)
    assert not S.is_aoq_metadata({"format": "pt"}) and not S.is_aoq_metadata(None)


def test_unset_optional_fields_are_left_out():
    tensors, metadata = S.flatten_state_dict({"w": CONFIGS["int4_sym_g128_f16"](), "v": CONFIGS["int8_per_row"]()})
    assert "w:zero" not in tensors
    entries = header(metadata)["tensors"]
    assert set(entries["w"]["fields"]) == {"qdata", "scale"}
    assert "act_quant" not in entries["v"]["attributes"]


def test_each_shard_describes_only_its_own_tensors():
    sd = model_state_dict()
    names = list(sd)
    shards = [dict((n, sd[n]) for n in names[:3]), dict((n, sd[n]) for n in names[3:])]
    merged = {}
    for shard in shards:
        tensors, metadata = S.flatten_state_dict(shard)
        described = set(header(metadata)["tensors"])
        assert described == {n for n, t in shard.items() if isinstance(t, AOQTensor)}
        merged.update(S.unflatten_state_dict(tensors, metadata))
    assert merged.keys() == sd.keys()
    for n, t in sd.items():
        got = merged[n]
        assert torch.equal(got.dequantize(), t.dequantize()) if isinstance(t, AOQTensor) else torch.equal(got, t)


def test_a_packed_tensor_is_saved_in_its_canonical_layout(tmp_path):
    t = CONFIGS["int4_asym_g32"]()
    packed = t.place()
    if packed.packing is None:
        pytest.skip("this torch build has no CPU int4 packing")
    tensors, metadata = S.flatten_state_dict({"w": packed})
    assert tensors["w:qdata"].shape == t.qdata.shape and "packing" not in header(metadata)["tensors"]["w"]["attributes"]
    canonical = S.unflatten_state_dict(tensors, metadata)["w"]
    assert canonical.packing is None
    assert_same_tensor(canonical, t)
    S.save_file({"w": packed}, tmp_path / "w.safetensors")
    placed = S.load_file(tmp_path / "w.safetensors", device="cpu")["w"]
    assert placed.packing == packed.packing  # load_file places for the device
    assert torch.equal(placed.dequantize(), t.dequantize())


def test_transposed_and_sliced_tensors_round_trip():
    big = CONFIGS["int8_per_row"]()
    rows = big[0:8]  # fields are views into big's storage
    sd = {"big": big, "rows": rows, "t": big.t(), "tied": big}
    tensors, metadata = S.flatten_state_dict(sd)
    back = S.unflatten_state_dict(tensors, metadata)
    for n, t in sd.items():
        assert torch.equal(back[n].dequantize(), t.dequantize()), n
    # Every stored field owns its memory, so safetensors accepts the lot.
    safetensors.torch.save(tensors, metadata)


def test_plain_safetensors_files_load_unchanged(tmp_path):
    plain = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64), "c": torch.zeros(0, 2)}
    safetensors.torch.save_file(plain, tmp_path / "plain.safetensors")
    back = S.load_file(tmp_path / "plain.safetensors")
    assert back.keys() == plain.keys() and all(torch.equal(back[k], plain[k]) for k in plain)


def test_parse_metadata_and_build():
    t = CONFIGS["int8_dynamic"]()
    tensors, metadata = S.flatten_state_dict({"w": t})
    (entry,) = S.parse_metadata(metadata, source="f.safetensors").values()
    assert (entry.name, entry.type_name, entry.schema_version) == ("w", "Int8Tensor", 1)
    assert entry.keys == {"qdata": "w:qdata", "scale": "w:scale"}
    assert entry.attributes["act_quant"] == "per_token" and entry.attributes["dtype"] is torch.bfloat16
    built = entry.build({f: tensors[k] for f, k in entry.keys.items()})
    assert_same_tensor(built, t)
    with pytest.raises(FormatError, match="field names, not storage keys"):
        entry.build(dict(tensors))
    with pytest.raises(FormatError, match=r"tensor 'w', field 'scale'.*not in the file"):
        entry.build({"qdata": tensors["w:qdata"]})
    assert S.parse_metadata(None) == {} and S.parse_metadata({"format": "pt"}) == {}


def test_enum_allow_lists_match_the_tensor_types():
    from hf_aoq.tensors import float8, float8_sparse, int4, int8

    assert registry.ENUMS["Int8Tensor.act_quant"] == set(int8.ACT_QUANTS) - {None}
    assert registry.ENUMS["Int4Tensor.act_quant"] == set(int4.ACT_QUANTS) - {None}
    assert all(d in registry.DTYPE_NAMES for d in int4.ACT_DTYPES)  # every act_dtype can be written
    assert registry.ENUMS["Float8Tensor.act_quant"] == set(float8.ACT_QUANTS) - {None}
    assert registry.ENUMS["Float8SemiSparseTensor.act_quant"] == set(float8_sparse.ACT_QUANTS) - {None}
    assert registry.ENUMS["Int4Tensor.packing"] == frozenset()  # only canonical tensors are saved
    assert registry.ENUMS["Int4DQTensor.packing"] == frozenset()
    from hf_aoq.tensors import nvfp4

    assert registry.ENUMS["NVFP4Tensor.act_quant"] == set(nvfp4.ACT_QUANT)


# ---------------------------------------------------------------------- refusals when saving
class Unregistered(AOQTensor):
    tensor_data_names = ("qdata",)
    tensor_attribute_names = ("shape", "dtype")
    optional_tensor_attribute_names = ("ratio",)


def unregistered(**kw):
    return Unregistered(torch.zeros(2, 2), (2, 2), torch.float32, **kw)


@pytest.mark.parametrize(
    "sd, match",
    [
        ({"a:b": torch.zeros(1)}, "without ':'"),
        ({"w:qdata": CONFIGS["int8_per_row"]()}, "without ':'"),
        ({"": torch.zeros(1)}, "non-empty"),
        ({1: torch.zeros(1)}, "strings"),
        ({"w": [1, 2]}, "tensor 'w': expected a tensor, got list"),
        ({"w": unregistered()}, "tensor 'w': Unregistered is not a registered tensor type"),
    ],
)
def test_flatten_refuses(sd, match):
    with pytest.raises(FormatError, match=match):
        S.flatten_state_dict(sd)


def test_flatten_refuses_attribute_values_no_reader_could_load(monkeypatch):
    monkeypatch.setitem(registry.TENSOR_TYPES, "Unregistered", Unregistered)
    with pytest.raises(FormatError, match="tensor 'w', attribute 'ratio': cannot store a float"):
        S.flatten_state_dict({"w": unregistered(ratio=0.5)})
    with pytest.raises(FormatError, match="attribute 'ratio': Unregistered.ratio is not an enum"):
        S.flatten_state_dict({"w": unregistered(ratio="half")})
    with pytest.raises(FormatError, match="attribute 'ratio': int .* outside the int64 range"):
        S.flatten_state_dict({"w": unregistered(ratio=2**70)})
    with pytest.raises(FormatError, match="attribute 'ratio': dtype torch.complex64 cannot be named"):
        S.flatten_state_dict({"w": unregistered(ratio=torch.complex64)})
    bad_enum = CONFIGS["int8_per_row"]().replace(act_quant="per_block")
    with pytest.raises(FormatError, match="attribute 'act_quant': unknown Int8Tensor.act_quant value 'per_block'"):
        S.flatten_state_dict({"w": bad_enum})


def test_extra_metadata(tmp_path):
    path = tmp_path / "m.safetensors"
    S.save_file({"w": CONFIGS["int8_per_row"]()}, path, extra_metadata={"format": "pt", "note": "hi"})
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata()["note"] == "hi"
    for bad, match in [({"hf_aoq": "{}"}, "reserved key 'hf_aoq'"), ({"format": "np"}, "reserved key 'format'"),
                       ({"n": 1}, "str to str")]:
        with pytest.raises(FormatError, match=match):
            S.save_file({"w": torch.zeros(1)}, tmp_path / "x.safetensors", extra_metadata=bad)
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


# ---------------------------------------------------------------------- atomic saves
def test_save_leaves_nothing_behind_when_it_fails(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    S.save_file({"w": CONFIGS["int8_per_row"]()}, path)
    before = path.read_bytes()

    with pytest.raises(FormatError):  # refused before anything is written
        S.save_file({"a:b": torch.zeros(1)}, path)

    def write_half_then_fail(tensors, p, metadata):
        with open(p, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(S.files, "_write_safetensors", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        S.save_file({"w": torch.zeros(4)}, path)
    with pytest.raises(OSError, match="disk full"):
        S.save_file({"w": torch.zeros(4)}, tmp_path / "new.safetensors")
    monkeypatch.undo()

    def fail_replace(src, dst):
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", fail_replace)
    with pytest.raises(OSError, match="rename failed"):
        S.save_file({"w": torch.zeros(4)}, path)
    monkeypatch.undo()

    assert os.listdir(tmp_path) == ["ckpt.safetensors"]  # no temporary files, no new file
    assert path.read_bytes() == before  # the old checkpoint is untouched


def test_save_replaces_an_existing_file_and_respects_the_umask(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    S.save_file({"w": torch.zeros(1)}, path)
    S.save_file({"v": CONFIGS["int8_per_row"]()}, path)
    assert list(S.load_file(path)) == ["v"]
    reference = tmp_path / "reference"
    reference.write_bytes(b"")
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(reference.stat().st_mode)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.safetensors", "reference"]


# ---------------------------------------------------------------------- malformed files
@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "bad.safetensors"
    S.save_file(model_state_dict(), path)
    return path


def test_truncated_file(saved):
    data = saved.read_bytes()
    for cut, match in [
        (len(data) - 1, "it is truncated"),
        (len(data) // 2, "it is truncated"),
        (10, "header length \\d+ does not fit in a file of 10 bytes"),
        (4, "4 bytes is too short"),
        (0, "0 bytes is too short"),
    ]:
        saved.write_bytes(data[:cut])
        with pytest.raises(FormatError, match=f"^{saved}: not a (complete )?safetensors file: .*{match}"):
            S.load_file(saved)


def test_header_that_is_not_json(saved):
    data = bytearray(saved.read_bytes())
    data[8] = ord("#")
    saved.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=f"^{saved}: safetensors header: not valid JSON"):
        S.load_file(saved)
    data[8:10] = b"\xff\xfe"
    saved.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=f"^{saved}: safetensors header: not valid JSON: not UTF-8"):
        S.load_file(saved)


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        S.load_file(tmp_path / "nothing.safetensors")


def rewrite(path, mutate_doc=None, mutate_tensors=None):
    """Re-save `path` with its hf_aoq JSON and/or its tensors changed."""
    with safetensors.safe_open(str(path), "pt") as f:
        metadata, tensors = f.metadata(), f.get_tensors()
    if mutate_doc is not None:
        doc = header(metadata)
        mutate_doc(doc)
        metadata = with_header(metadata, doc)
    if mutate_tensors is not None:
        mutate_tensors(tensors)
    safetensors.torch.save_file(tensors, path, metadata=metadata)


W0 = "layers.0.proj.weight"
W1 = "layers.1.proj.weight"
W2 = "layers.2.proj.weight"


def entry(doc, name=W0):
    return doc["tensors"][name]


BAD_HEADERS = {
    "unknown type": (lambda d: entry(d).update(type="os.system"), f"tensor '{W0}': unknown tensor type 'os.system'"),
    "type not a string": (lambda d: entry(d).update(type=["Int4Tensor"]), f"tensor '{W0}': 'type' must be a string"),
    "unknown dtype": (
        lambda d: entry(d)["attributes"].update(dtype=["dtype", "torch.load"]),
        f"tensor '{W0}', attribute 'dtype': unknown dtype 'torch.load'",
    ),
    "unknown enum": (
        lambda d: entry(d, W1)["attributes"].update(act_quant=["enum", "per_block"]),
        f"tensor '{W1}', attribute 'act_quant': unknown Int8Tensor.act_quant value 'per_block'",
    ),
    "enum given another tag": (
        lambda d: entry(d, W1)["attributes"].update(act_quant=["bool", True]),
        f"tensor '{W1}', attribute 'act_quant': unknown Int8Tensor.act_quant value True",
    ),
    "string for a non-enum attribute": (
        lambda d: entry(d)["attributes"].update(block_size=["enum", "1,32"]),
        f"tensor '{W0}', attribute 'block_size': Int4Tensor.block_size is not an enum",
    ),
    "packing in a checkpoint": (
        lambda d: entry(d)["attributes"].update(packing=["enum", "cpu_int4pack"]),
        f"tensor '{W0}', attribute 'packing': unknown Int4Tensor.packing value 'cpu_int4pack'",
    ),
    "untagged attribute": (
        lambda d: entry(d)["attributes"].update(block_size=[1, 32]),
        f"tensor '{W0}', attribute 'block_size': unknown value tag 1",
    ),
    "unknown tag": (
        lambda d: entry(d)["attributes"].update(block_size=["tuple", [1, 32]]),
        f"tensor '{W0}', attribute 'block_size': unknown value tag 'tuple'.*written by hf_aoq",
    ),
    "bool as int": (
        lambda d: entry(d)["attributes"].update(shape=["ints", [True, 128]]),
        f"tensor '{W0}', attribute 'shape': malformed 'ints'",
    ),
    "int out of range": (
        lambda d: entry(d)["attributes"].update(shape=["ints", [2**64, 128]]),
        f"tensor '{W0}', attribute 'shape': malformed 'ints'",
    ),
    "missing required attribute": (
        lambda d: entry(d)["attributes"].pop("block_size"),
        f"tensor '{W0}', attribute 'block_size': required attribute missing",
    ),
    "shape contradicts the stored tensors": (
        lambda d: entry(d)["attributes"].update(shape=["ints", [16, 256]]),
        f"tensor '{W0}', field 'qdata': shape \\(16, 64\\), expected \\(16, 128\\)",
    ),
    "block size contradicts the stored tensors": (
        lambda d: entry(d)["attributes"].update(block_size=["ints", [1, 64]]),
        f"tensor '{W0}', field 'scale': shape \\(16, 4\\), expected \\(16, 2\\)",
    ),
    "block size does not tile the shape": (
        lambda d: entry(d)["attributes"].update(block_size=["ints", [3, 32]]),
        f"tensor '{W0}', attribute 'block_size'",
    ),
    "a partial last group does not match the scale": (
        lambda d: entry(d)["attributes"].update(block_size=["ints", [1, 48]]),
        f"tensor '{W0}', field 'scale': shape \\(16, 4\\), expected \\(16, 3\\)",
    ),
    "integer logical dtype": (
        lambda d: entry(d)["attributes"].update(dtype=["dtype", "int32"]),
        f"tensor '{W0}', attribute 'dtype': torch.int32 is not a float dtype",
    ),
    "act_dtype not float8": (
        lambda d: entry(d, W2)["attributes"].update(act_dtype=["dtype", "bfloat16"]),
        f"tensor '{W2}', attribute 'act_dtype'",
    ),
    "attribute given as a tensor field": (
        lambda d: entry(d)["fields"].update(block_size=f"{W0}:block_size"),
        f"tensor '{W0}', field 'block_size': is an attribute of Int4Tensor, not a tensor field",
    ),
    "field key that is not name:field": (
        lambda d: entry(d)["fields"].update(scale="layers.0.proj.weight_scale"),
        f"tensor '{W0}', field 'scale': key must be '{W0}:scale'",
    ),
    "metadata for a tensor not in the file": (
        lambda d: d["tensors"].update({"ghost": {**entry(d), "fields": {f: f"ghost:{f}" for f in ("qdata", "scale")}}}),
        "tensor 'ghost', field 'qdata': the metadata lists key 'ghost:qdata', which is not in the file",
    ),
    "quantized tensor with no metadata": (
        lambda d: d["tensors"].pop(W1),
        f"tensor '{W1}', field '(qdata|scale)': the file has the field key '{W1}:(qdata|scale)' but no metadata",
    ),
    "quantized name containing the separator": (
        lambda d: d["tensors"].update({"a:b": d["tensors"].pop(W0)}),
        "tensor 'a:b': a quantized tensor's name must be non-empty and contain no ':'",
    ),
    "tensor field given as an attribute": (
        lambda d: entry(d)["attributes"].update(scale=["int", 1]),
        f"tensor '{W0}', attribute 'scale': is a tensor field of Int4Tensor, not an attribute",
    ),
    "entry without fields": (
        lambda d: d["tensors"].update({"flags": {**entry(d), "fields": {}}}),
        "tensor 'flags': 'fields' must be a non-empty object",
    ),
    "unknown entry key": (lambda d: entry(d).update(checksum="0"), f"tensor '{W0}': unknown key 'checksum'"),
    "missing entry key": (lambda d: entry(d).pop("attributes"), f"tensor '{W0}': missing key 'attributes'"),
    "unknown top-level key": (lambda d: d.update(extra=1), "unknown key 'extra'"),
    "tensors not an object": (lambda d: d.update(tensors=[]), "'tensors' must be an object"),
    "schema version as bool": (
        lambda d: entry(d).update(schema_version=True),
        f"tensor '{W0}': 'schema_version' must be an int >= 1, got True",
    ),
    "schema version zero": (lambda d: entry(d).update(schema_version=0), "'schema_version' must be an int >= 1"),
    "format version as string": (lambda d: d.update(format_version="1"), "'format_version' must be an int >= 1"),
    "writer not a string": (lambda d: d.update(hf_aoq_version=1), "'hf_aoq_version' must be a string"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_malformed_metadata(saved, case):
    mutate, match = BAD_HEADERS[case]
    rewrite(saved, mutate_doc=mutate)
    with pytest.raises(FormatError, match=f"^{saved}: .*(?:{match})"):
        S.load_file(saved)


def test_required_tensor_field_missing(saved):
    def drop_scale(doc):
        del entry(doc)["fields"]["scale"]

    rewrite(saved, mutate_doc=drop_scale, mutate_tensors=lambda t: t.pop(f"{W0}:scale"))
    with pytest.raises(FormatError, match=f"{saved}: tensor '{W0}', field 'scale': required tensor field missing"):
        S.load_file(saved)


def test_stored_dtype_contradicts_the_metadata(saved):
    rewrite(saved, mutate_tensors=lambda t: t.update({f"{W0}:qdata": t[f"{W0}:qdata"].view(torch.int8)}))
    with pytest.raises(FormatError, match=f"{saved}: tensor '{W0}', field 'qdata': dtype torch.int8"):
        S.load_file(saved)
    S.save_file(model_state_dict(), saved)
    rewrite(saved, mutate_tensors=lambda t: t.update({f"{W1}:scale": t[f"{W1}:scale"].double()}))
    with pytest.raises(FormatError, match=f"tensor '{W1}', field 'scale': dtype torch.float64"):
        S.load_file(saved)


def test_stored_shape_contradicts_the_metadata(saved):
    rewrite(saved, mutate_tensors=lambda t: t.update({f"{W1}:qdata": t[f"{W1}:qdata"].reshape(32, 64)}))
    with pytest.raises(FormatError, match=f"{saved}: tensor '{W1}', field 'qdata': shape \\(32, 64\\)"):
        S.load_file(saved)


def test_plain_tensor_with_a_quantized_tensors_name(saved):
    rewrite(saved, mutate_tensors=lambda t: t.update({W0: torch.zeros(1)}))
    with pytest.raises(FormatError, match=f"both a plain tensor and a quantized tensor named '{W0}'"):
        S.load_file(saved)


def test_field_keys_without_any_hf_aoq_metadata(saved):
    with safetensors.safe_open(str(saved), "pt") as f:
        tensors = f.get_tensors()
    safetensors.torch.save_file(tensors, saved, metadata={"format": "pt"})
    with pytest.raises(FormatError, match="but no metadata for it \\(it has no hf_aoq metadata at all\\)"):
        S.load_file(saved)


def test_duplicate_keys_in_the_metadata(saved):
    with safetensors.safe_open(str(saved), "pt") as f:
        metadata, tensors = f.metadata(), f.get_tensors()
    text = metadata[S.METADATA_KEY]
    field_dup = text.replace('"fields":{"qdata":', '"fields":{"scale":"x","qdata":', 1)
    entry_dup = text.replace('"tensors":{', '"tensors":{"%s":{},' % W1, 1)
    for bad, match in [
        (field_dup, f"key 'scale' appears twice in one object \\(at 'tensors' / '{W0}' / 'fields'\\)"),
        (entry_dup, f"key '{W1}' appears twice in one object \\(at 'tensors'\\)"),
    ]:
        with pytest.raises(FormatError, match=f"{saved}: hf_aoq metadata: {match}"):
            S.unflatten_state_dict(tensors, {**metadata, S.METADATA_KEY: bad}, source=str(saved))


@pytest.mark.parametrize(
    "text, match",
    [
        ("{", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ('{"format_version": NaN}', "not valid JSON.*NaN is not allowed"),
        ("[" * 100000 + "]" * 100000, "not valid JSON"),
        ("[" * 900 + '{"a": 1, "a": 2}' + "]" * 900, "key 'a' appears twice|a key appears twice"),
        ('{"format_version": 1, "hf_aoq_version": "0", "tensors": {}, "x": 1e999999}', "not valid JSON|unknown key"),
    ],
)
def test_metadata_that_is_not_the_json_we_wrote(text, match):
    with pytest.raises(FormatError, match=f"^f.safetensors: hf_aoq metadata.*{match}"):
        S.unflatten_state_dict({}, {S.METADATA_KEY: text}, source="f.safetensors")


def test_metadata_that_is_not_a_mapping_of_strings():
    with pytest.raises(FormatError, match="must be a str -> str mapping"):
        S.parse_metadata([("hf_aoq", "{}")])
    with pytest.raises(FormatError, match="must hold JSON text"):
        S.parse_metadata({"hf_aoq": b"{}"})


LONG = "v" * 1_000_000
LONG_METADATA = {
    "version string": lambda d: d.update(format_version=2, hf_aoq_version=LONG),
    "version string, newer schema": lambda d: (d.update(hf_aoq_version=LONG), entry(d).update(schema_version=9)),
    "format version": lambda d: d.update(format_version=int("9" * 4000)),
    "type name": lambda d: entry(d).update(type=LONG),
    "tensor name": lambda d: d["tensors"].update({LONG: d["tensors"].pop(W0)}),
    "field name": lambda d: entry(d)["fields"].update({LONG: f"{W0}:{LONG}"}),
    "attribute name": lambda d: entry(d)["attributes"].update({LONG: ["int", 1]}),
    "enum value": lambda d: entry(d, W1)["attributes"].update(act_quant=["enum", LONG]),
    "dtype name": lambda d: entry(d)["attributes"].update(dtype=["dtype", LONG]),
}


@pytest.mark.parametrize("case", sorted(LONG_METADATA))
def test_untrusted_text_is_cut_in_errors(saved, case):
    """A 1 MB name or version in a file's metadata is not quoted whole."""
    rewrite(saved, mutate_doc=LONG_METADATA[case])
    with pytest.raises(FormatError) as e:
        S.load_file(saved)
    assert str(e.value).startswith(f"{saved}: ") and len(str(e.value)) < 1000, str(e.value)[:300]


def test_build_refuses_fields_that_are_not_plain_tensors():
    t = CONFIGS["int8_per_row"]()
    tensors, metadata = S.flatten_state_dict({"w": t})
    tensors["w:scale"] = t  # a quantized tensor where a plain one belongs
    with pytest.raises(FormatError, match="tensor 'w', field 'scale': expected a plain tensor, got Int8Tensor"):
        S.unflatten_state_dict(tensors, metadata)


def test_newer_format_version_names_both_versions(saved):
    def newer(doc):
        doc.update(format_version=7, hf_aoq_version="9.0.0", tensors="anything may change")

    rewrite(saved, mutate_doc=newer)
    with pytest.raises(
        FormatError,
        match=r"written in hf_aoq format version 7 by hf_aoq 9\.0\.0; "
        r"this hf_aoq 0\.1\.0 reads format versions up to 1",
    ):
        S.load_file(saved)


def test_newer_schema_version_names_both_versions(saved):
    def newer(doc):
        doc["hf_aoq_version"] = "2.0.0"
        entry(doc)["schema_version"] = 3

    rewrite(saved, mutate_doc=newer)
    with pytest.raises(
        FormatError,
        match=rf"tensor '{W0}': Int4Tensor schema version 3, written by hf_aoq 2\.0\.0, is newer than this hf_aoq "
        rf"0\.1\.0 can read \(Int4Tensor schema versions 1 to 1\): upgrade hf_aoq",
    ):
        S.load_file(saved)


def test_unknown_optional_field_from_a_newer_writer_is_refused(saved):
    def newer(doc):
        doc["hf_aoq_version"] = "0.2.0"
        entry(doc)["attributes"]["rounding"] = ["enum", "stochastic"]

    rewrite(saved, mutate_doc=newer)
    with pytest.raises(
        FormatError,
        match=rf"tensor '{W0}', attribute 'rounding': Int4Tensor schema 1 in this hf_aoq 0\.1\.0 has no such "
        rf"attribute; the file was written by hf_aoq 0\.2\.0",
    ):
        S.load_file(saved)

    def newer_tensor(doc):
        entry(doc)["fields"]["correction"] = f"{W0}:correction"

    rewrite(saved, mutate_doc=lambda d: (entry(d)["attributes"].pop("rounding"), newer_tensor(d)),
            mutate_tensors=lambda t: t.update({f"{W0}:correction": torch.zeros(16)}))
    with pytest.raises(FormatError, match=rf"tensor '{W0}', field 'correction': Int4Tensor schema 1 .* no such field"):
        S.load_file(saved)


def test_a_safetensors_header_with_a_duplicate_tensor_name(saved):
    data = saved.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    head = data[8 : 8 + n].decode()
    dup = head.replace('"flags"', f'"{W0}:qdata"', 1)
    saved.write_bytes(struct.pack("<Q", len(dup.encode())) + dup.encode() + data[8 + n :])
    with pytest.raises(FormatError, match=f"^{saved}: safetensors header: key '{W0}:qdata' appears twice"):
        S.load_file(saved)


def test_metadata_is_parsed_once_whatever_the_number_of_tensors(tmp_path, monkeypatch):
    calls = []
    loads = json.loads

    def counting_loads(*args, **kwargs):
        calls.append(1)
        return loads(*args, **kwargs)

    for n in (3, 60):
        sd = {f"layers.{i}.weight": CONFIGS["int8_per_row"]() for i in range(n)}
        S.save_file(sd, tmp_path / "m.safetensors")
        monkeypatch.setattr(json, "loads", counting_loads)
        calls.clear()
        assert len(S.load_file(tmp_path / "m.safetensors")) == n
        monkeypatch.undo()
        assert len(calls) == 2  # the safetensors header, then the hf_aoq metadata in it


class Normalizing(AOQTensor):
    """A type whose constructor does more than bind its fields."""

    tensor_data_names = ("qdata",)
    tensor_attribute_names = ("shape", "dtype")

    def __new__(cls, qdata, shape, dtype):
        return super().__new__(cls, qdata.contiguous(), tuple(shape), dtype)


def test_types_with_their_own_constructor_are_built_through_it(monkeypatch):
    monkeypatch.setitem(registry.TENSOR_TYPES, "Normalizing", Normalizing)
    built = []
    original = Normalizing.__new__

    def spy(cls, *args, **kwargs):
        built.append(cls)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(Normalizing, "__new__", spy)
    t = Normalizing(torch.ones(2, 3), (2, 3), torch.float32)
    tensors, metadata = S.flatten_state_dict({"n": t})
    built.clear()
    back = S.unflatten_state_dict(tensors, metadata)["n"]
    assert built == [Normalizing] and torch.equal(back.qdata, t.qdata)
    Plain = type("Plain", (Normalizing,), {"__new__": AOQTensor.__new__})
    assert Plain.from_checked_fields({"qdata": torch.ones(1), "shape": (1,), "dtype": torch.float32}).shape == (1,)
