"""hf_aoq.serialization.read_safetensors: the same tensors as safetensors, without copies, and a
FormatError for every header the safetensors format does not allow."""
import json
import struct
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from hf_aoq import FormatError
from hf_aoq.serialization import read_safetensors, reader

FIXTURES = Path(__file__).parents[1] / "fixtures"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def assert_same_as_safetensors(path):
    tensors, metadata = read_safetensors(path)
    with safetensors.safe_open(str(path), "pt") as f:
        expected, expected_metadata = f.get_tensors(), f.metadata()
    assert metadata == expected_metadata
    assert tensors.keys() == expected.keys()
    for k, t in tensors.items():
        e = expected[k]
        assert t.dtype == e.dtype and t.shape == e.shape and t.is_contiguous(), k
        assert torch.equal(as_bytes(t), as_bytes(e)), k


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.safetensors")))
def test_fixtures_read_like_safetensors_reads_them(name):
    assert_same_as_safetensors(FIXTURES / name)


def test_every_dtype_and_odd_shapes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "bool": torch.tensor([True, False, True]),
        "u8": torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),
        "i8": torch.randint(-128, 127, (2, 3), generator=g, dtype=torch.int8),
        "i16": torch.randint(-1000, 1000, (3,), generator=g, dtype=torch.int16),
        "i32": torch.randint(-1000, 1000, (3,), generator=g, dtype=torch.int32),
        "i64": torch.arange(7),
        "f16": torch.randn(3, 1, generator=g).half(),
        "bf16": torch.randn(1, 5, generator=g).bfloat16(),
        "f32": torch.randn(2, 2, 2, generator=g),
        "f64": torch.randn(3, generator=g).double(),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "e4m3": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(4, generator=g).to(torch.float8_e5m2),
        "u16": torch.arange(5, dtype=torch.int32).to(torch.uint16),
    }
    path = tmp_path / "all.safetensors"
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt", "x": ""})
    assert_same_as_safetensors(path)
    empty = tmp_path / "empty.safetensors"
    safetensors.torch.save_file({}, empty)
    assert read_safetensors(empty) == ({}, None)


def test_tensors_are_private_maps_of_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(1000), "b": torch.ones(3, dtype=torch.bfloat16)}, path)
    before = path.read_bytes()
    tensors, _ = read_safetensors(path)
    tensors["w"] += 1  # copy-on-write: the file is not touched
    assert path.read_bytes() == before
    assert torch.equal(read_safetensors(path)[0]["w"], torch.zeros(1000))
    # Each tensor owns its bytes, aligned, as if read alone: re-saving them is plain sailing.
    for t in tensors.values():
        assert t.untyped_storage().nbytes() == t.nbytes and t.data_ptr() % t.element_size() == 0
    safetensors.torch.save_file(tensors, tmp_path / "again.safetensors")


def craft(path, header, data=b"", *, raw_header: str | None = None):
    text = (raw_header if raw_header is not None else json.dumps(header)).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_unaligned_data_is_copied(tmp_path):
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float32)
    header = {
        "odd": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "f": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]},
    }
    path = craft(tmp_path / "odd.safetensors", header, b"\x07" + values.numpy().tobytes())
    tensors, _ = read_safetensors(path)
    assert tensors["odd"].tolist() == [7] and torch.equal(tensors["f"], values)
    assert tensors["f"].data_ptr() % 4 == 0


def test_dtypes_it_does_not_map_are_read_by_safetensors(tmp_path, monkeypatch):
    path = tmp_path / "x.safetensors"
    craft(path, {"x": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [0, 2]}}, b"\x7f\x80")
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("this torch has no float8_e8m0fnu")
    tensors, _ = read_safetensors(path)
    assert tensors["x"].dtype == torch.float8_e8m0fnu
    # A big-endian host would take the same path for every file.
    monkeypatch.setattr(reader.sys, "byteorder", "big")
    assert_same_as_safetensors(FIXTURES / "v1_model.safetensors")


F32_3 = {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
BAD_FILES = {
    "hole": ({"a": F32_3, "b": {"dtype": "F32", "shape": [1], "data_offsets": [16, 20]}}, 20,
             "tensor 'b': data at bytes \\[16, 20\\) leaves a hole of 4 bytes"),
    "overlap": ({"a": F32_3, "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, 12,
                "tensor '[ab]': data at bytes \\[8, 12\\) overlaps the tensor before it"),
    "span does not match the shape": ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, 12,
                                      "tensor 'a': data_offsets \\[0, 12\\] span 12 bytes, but F32 \\[4\\] needs 16"),
    "unknown dtype": ({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, 16,
                      "tensor 'a': unknown safetensors dtype 'F128'"),
    "dtype not a string": ({"a": {**F32_3, "dtype": ["F32"]}}, 12, "tensor 'a': unknown safetensors dtype \\['F32'\\]"),
    "extra info key": ({"a": {**F32_3, "endian": "big"}}, 12, "tensor 'a': header entry must have exactly"),
    "negative dim": ({"a": {"dtype": "F32", "shape": [-3], "data_offsets": [0, 12]}}, 12,
                     "tensor 'a': shape must be a list of non-negative ints"),
    "bool dim": ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4,
                 "tensor 'a': shape must be a list of non-negative ints"),
    "reversed offsets": ({"a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}}, 4,
                         "tensor 'a': data_offsets must be \\[begin, end\\]"),
    "trailing bytes": ({"a": F32_3}, 16, "4 bytes longer than its tensors"),
    "truncated": ({"a": F32_3}, 8, "it is truncated"),
    "metadata values not strings": ({"__metadata__": {"n": 1}}, 0, "__metadata__ must map strings to strings"),
    "header not an object": ([1, 2], 0, "safetensors header must be a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_malformed_files(tmp_path, case):
    header, nbytes, match = BAD_FILES[case]
    path = craft(tmp_path / "bad.safetensors", header, bytes(nbytes))
    with pytest.raises(FormatError, match=f"^{path}: .*{match}"):
        read_safetensors(path)


def test_duplicate_metadata_keys_are_refused(tmp_path):
    # safetensors itself keeps the last of two keys; a second "hf_aoq" could hide the first.
    raw = '{"__metadata__": {"hf_aoq": "{}", "format": "pt", "hf_aoq": "[]"}}'
    path = craft(tmp_path / "dup.safetensors", None, raw_header=raw)
    with pytest.raises(FormatError, match="key 'hf_aoq' appears twice in one object \\(at '__metadata__'\\)"):
        read_safetensors(path)


def test_header_length_beyond_the_file(tmp_path):
    path = tmp_path / "long.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(FormatError, match="header length 9223372036854775808 does not fit in a file of 10 bytes"):
        read_safetensors(path)


def test_a_header_over_the_cap_says_so(tmp_path):
    """A 200 MB file (sparse: no disk used) whose header claims 150 MB: it fits, but exceeds the
    100 MB that safetensors allows a header."""
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 150_000_000))
        f.truncate(200_000_000)
    with pytest.raises(FormatError, match=f"^{path}: not a safetensors file: header length 150000000 exceeds the cap "
                                          f"of 100000000 bytes"):
        read_safetensors(path)


LONG = "n" * 1_000_000


@pytest.mark.parametrize("header", [
    {LONG: {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
    {LONG: {"dtype": "F32", "shape": [LONG], "data_offsets": [0, 4]}},
    {"a": {"dtype": LONG, "shape": [1], "data_offsets": [0, 4]}},
    {"__metadata__": {"x": [LONG]}},
])
def test_untrusted_names_are_cut_in_errors(tmp_path, header):
    path = craft(tmp_path / "long.safetensors", header, bytes(16))
    with pytest.raises(FormatError) as e:
        read_safetensors(path)
    assert str(e.value).startswith(f"{path}: ") and len(str(e.value)) < 1000
