"""Backward compatibility: the checked-in format-version-1 fixtures (every generation of them)
load forever and give the stored answers exactly; a type that gains optional fields still loads
them; a schema bump upgrades old files through its upgraders; newer files fail with both
versions named."""
import functools
import hashlib
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from hf_aoq import AOQTensor, Float8Tensor, FormatError, Int4Tensor, Int8Tensor, MXTensor, NVFP4Tensor
from hf_aoq import serialization as S
from hf_aoq.core import registry

FIXTURES = Path(__file__).parents[1] / "fixtures"
# One manifest per generation of fixtures (scripts/make_fixtures.py); the tests see their union.
MANIFESTS = {p.name: json.loads(p.read_text()) for p in sorted(FIXTURES.glob("manifest*.json"))}
MANIFEST = {"files": {f: info for m in MANIFESTS.values() for f, info in m["files"].items()}}
FILES = sorted(MANIFEST["files"])
CASES = [(f, name) for f in FILES for name in MANIFEST["files"][f]["quantized"]]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def reference_linear_f64(w, x):
    """As scripts/make_fixtures.py computed it: exact in float64 for the stored inputs (3-D
    experts: each expert's on the same x, stacked)."""
    if len(w.shape) == 3:
        return torch.stack([reference_linear_f64(w[e], x) for e in range(w.shape[0])])
    return w.simulate_input_quantization(x).double() @ w.dequantize().double().t()


@functools.lru_cache(maxsize=None)
def expected_outputs(file: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(FIXTURES / MANIFEST["files"][file]["expected"])


def read_canonical(path) -> dict[str, torch.Tensor]:
    """Canonical tensors, read by safetensors itself (as a transformers loader does)."""
    with safetensors.safe_open(str(path), "pt") as f:
        return S.unflatten_state_dict(f.get_tensors(), f.metadata(), source=str(path))


def read_fixture(file: str) -> dict[str, torch.Tensor]:
    return read_canonical(FIXTURES / file)


def test_fixtures_are_never_regenerated():
    """If this fails, a fixture was rewritten: restore it from version control. New formats and
    schemas get new fixtures next to these; see docs/format.md."""
    assert sorted(MANIFESTS) == ["manifest.act_variants.json", "manifest.awq_input_scale.json", "manifest.fp8_sparse.json", "manifest.fpx.json", "manifest.fpx3d.json", "manifest.int4dq.json", "manifest.intx.json",
                                 "manifest.intx_asym_act.json", "manifest.intxdq.json", "manifest.json", "manifest.mx.json",
                                 "manifest.mx3d.json", "manifest.nvfp4.json", "manifest.partial_groups.json"]
    for file, info in MANIFEST["files"].items():
        for name, digest in ((file, info["sha256"]), (info["expected"], info["expected_sha256"])):
            assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == digest, name
    assert all(m["format_version"] == 1 for m in MANIFESTS.values())
    # The fixtures stay small (they are cloned with every checkout): 1 MB for every generation so far
    # (14 generations, ~700 kB after MX 3-D, NVFP4, FPx, 2:4 sparse float8 and IntxDQ came in).
    total = sum(p.stat().st_size for p in FIXTURES.iterdir())
    assert total < 1_000_000


@pytest.mark.parametrize("file", FILES)
def test_fixture_holds_exactly_the_listed_tensors(file):
    info = MANIFEST["files"][file]
    loaded = read_fixture(file)
    assert sorted(loaded) == sorted([*info["quantized"], *info["plain"]])
    for name in info["plain"]:
        assert same_bits(loaded[name], expected_outputs(file)[name]), name


def check_against_manifest(t: AOQTensor, description: dict) -> None:
    assert type(t).__name__ == description["type"]
    fields = {n: [registry.dtype_name(f.dtype), list(f.shape)] for n, f in t.tensor_fields().items()}
    assert fields == description["fields"]
    for name, value in t.attributes().items():
        # An attribute the type gained after the fixture was written must have its default.
        expected = description["attributes"].get(name)
        if isinstance(value, torch.dtype):
            value = registry.dtype_name(value)
        elif isinstance(value, tuple):
            value = list(value)
        assert value == expected, name


@pytest.mark.parametrize("file, name", CASES)
def test_fixture_gives_the_stored_answers(file, name):
    t = read_fixture(file)[name]
    check_against_manifest(t, MANIFEST["files"][file]["quantized"][name])
    expected = expected_outputs(file)
    assert same_bits(t.dequantize(), expected[f"{name}.dequantized"])
    assert same_bits(reference_linear_f64(t, expected[f"{name}.input"]), expected[f"{name}.linear"])


def assert_kernel_close(w, x, reference):
    """A placed weight's own kernel agrees with the exact reference within its precision."""
    # clone(): a tensor mapped from a file may start at any even address, and aten's int8 CPU
    # kernel (torch 2.13) crashes on an activation that is not 4-byte aligned.
    if len(w.shape) == 3:  # fused experts: each expert as a linear weight
        y = torch.stack([F.linear(x.clone(), w[e]) for e in range(w.shape[0])]).double().cpu()
    else:
        y = F.linear(x.clone(), w).double().cpu()
    scale = reference.abs().max().item()
    torch.testing.assert_close(y, reference, rtol=2**-6, atol=scale * 2**-6)


@pytest.mark.parametrize("file", FILES)
def test_load_file_places_fixtures_for_the_cpu(file):
    loaded = S.load_file(FIXTURES / file, device="cpu")
    expected = expected_outputs(file)
    for name in MANIFEST["files"][file]["quantized"]:
        w = loaded[name]
        assert same_bits(w.dequantize(), expected[f"{name}.dequantized"]), name
        assert_kernel_close(w, expected[f"{name}.input"], expected[f"{name}.linear"])


@pytest.mark.cuda
@pytest.mark.parametrize("file", FILES)
def test_fixtures_load_on_cuda(file, tmp_path):
    loaded = S.load_file(FIXTURES / file, device="cuda")
    expected = expected_outputs(file)
    for name in MANIFEST["files"][file]["quantized"]:
        w = loaded[name]
        assert w.device.type == "cuda"
        assert same_bits(w.dequantize().cpu(), expected[f"{name}.dequantized"]), name
        assert_kernel_close(w, expected[f"{name}.input"].cuda(), expected[f"{name}.linear"])
    # ... and what CUDA placed saves back to the same canonical bytes.
    S.save_file(loaded, tmp_path / "again.safetensors")
    again = read_canonical(tmp_path / "again.safetensors")
    for name in MANIFEST["files"][file]["quantized"]:
        assert same_bits(again[name].dequantize(), expected[f"{name}.dequantized"]), name


# ---------------------------------------------------------------------- optional fields added later
def later_release(base: type[AOQTensor]) -> type[AOQTensor]:
    """`base` as a later release declares it: one more optional tensor and one more optional
    attribute, same schema version (the seeds' scenario). Same class name, so kernels apply."""
    return type(
        base.__name__,
        (base,),
        {
            "optional_tensor_data_names": base.optional_tensor_data_names + ("correction",),
            "optional_tensor_attribute_names": base.optional_tensor_attribute_names + ("rounding",),
        },
    )


@pytest.fixture(params=[Int4Tensor, Int8Tensor, Float8Tensor, MXTensor, NVFP4Tensor], ids=lambda c: c.__name__)
def grown(request, monkeypatch):
    base = request.param
    cls = later_release(base)
    monkeypatch.setitem(registry.TENSOR_TYPES, base.__name__, cls)
    monkeypatch.setitem(registry.ENUMS, f"{base.__name__}.rounding", frozenset({"stochastic"}))
    return base, cls


def test_fixtures_load_after_a_type_gains_optional_fields(grown):
    base, cls = grown
    cases = [(f, n) for f, n in CASES if MANIFEST["files"][f]["quantized"][n]["type"] == base.__name__]
    assert cases
    for file, name in cases:
        t = read_fixture(file)[name]
        assert type(t) is cls and t.correction is None and t.rounding is None
        check_against_manifest(t, MANIFEST["files"][file]["quantized"][name])
        expected = expected_outputs(file)
        assert same_bits(t.dequantize(), expected[f"{name}.dequantized"])
        assert same_bits(reference_linear_f64(t, expected[f"{name}.input"]), expected[f"{name}.linear"])


def test_new_optional_fields_round_trip_and_old_readers_refuse_them(grown, monkeypatch):
    base, cls = grown
    file, name = next((f, n) for f, n in CASES if MANIFEST["files"][f]["quantized"][n]["type"] == base.__name__)
    t = read_fixture(file)[name]
    used = t.replace(correction=torch.full((t.shape[0],), 0.25), rounding="stochastic")
    tensors, metadata = S.flatten_state_dict({"w": used})
    back = S.unflatten_state_dict(tensors, metadata)["w"]
    assert back.rounding == "stochastic" and torch.equal(back.correction, used.correction)
    unused_tensors, unused_metadata = S.flatten_state_dict({"w": t})

    monkeypatch.setitem(registry.TENSOR_TYPES, base.__name__, base)  # a reader from before the change
    with pytest.raises(FormatError, match=r"tensor 'w', field 'correction': .* has no such field; the file was "
                                          r"written by hf_aoq 0\.1\.0, which may have added it: upgrade hf_aoq"):
        S.unflatten_state_dict(tensors, metadata)
    # It loads a file from the newer writer that does not use the new fields.
    old = S.unflatten_state_dict(unused_tensors, unused_metadata)["w"]
    assert type(old) is base and torch.equal(old.dequantize(), t.dequantize())


# ---------------------------------------------------------------------- schema bumps and upgraders
UPGRADES = []


class ToyV1(AOQTensor):
    """w = codes * scale[:, None], as a first release declares it (schema 1)."""

    tensor_data_names = ("codes", "scale")
    tensor_attribute_names = ("shape", "dtype")

    def dequantize(self, dtype=None):
        return (self.codes.float() * self.scale[:, None]).to(dtype or self.dtype)


def rename_codes(record):
    """Schema 1 -> 2: `codes` is renamed `qdata` and the bit width becomes a required attribute."""
    UPGRADES.append(1)
    record["qdata"] = record.pop("codes")
    record["bits"] = 8
    return record


def scale_as_column(record):
    """Schema 2 -> 3: scale is stored as a column, [N, 1]."""
    UPGRADES.append(2)
    record["scale"] = record["scale"].reshape(-1, 1)
    return record


class ToyV2(AOQTensor):
    tensor_data_names = ("qdata", "scale")
    tensor_attribute_names = ("bits", "shape", "dtype")
    schema_version = 2
    schema_upgraders = {1: rename_codes}

    def dequantize(self, dtype=None):
        return (self.qdata.float() * self.scale[:, None]).to(dtype or self.dtype)


class ToyV3(AOQTensor):
    tensor_data_names = ("qdata", "scale")
    tensor_attribute_names = ("bits", "shape", "dtype")
    schema_version = 3
    schema_upgraders = {1: rename_codes, 2: scale_as_column}

    def dequantize(self, dtype=None):
        return (self.qdata.float() * self.scale).to(dtype or self.dtype)


def toy_codes():
    return torch.arange(-6, 6, dtype=torch.int8).reshape(3, 4)


def toy_scale():
    return torch.tensor([0.5, 0.25, 2.0])


TOYS = {
    1: lambda: ToyV1(toy_codes(), toy_scale(), (3, 4), torch.bfloat16),
    2: lambda: ToyV2(toy_codes(), toy_scale(), 8, (3, 4), torch.bfloat16),
    3: lambda: ToyV3(toy_codes(), toy_scale()[:, None], 8, (3, 4), torch.bfloat16),
}
TOY_CLASSES = {1: ToyV1, 2: ToyV2, 3: ToyV3}


def write_toy(version, monkeypatch):
    monkeypatch.setitem(registry.TENSOR_TYPES, "ToyTensor", TOY_CLASSES[version])
    tensors, metadata = S.flatten_state_dict({"toy": TOYS[version]()})
    assert json.loads(metadata["hf_aoq"])["tensors"]["toy"]["schema_version"] == version
    return tensors, metadata


@pytest.mark.parametrize("written, upgrades", [(1, [1, 2]), (2, [2]), (3, [])])
def test_old_schemas_are_upgraded_in_order(written, upgrades, monkeypatch):
    tensors, metadata = write_toy(written, monkeypatch)
    monkeypatch.setitem(registry.TENSOR_TYPES, "ToyTensor", ToyV3)
    UPGRADES.clear()
    toy = S.unflatten_state_dict(tensors, metadata)["toy"]
    assert UPGRADES == upgrades
    assert type(toy) is ToyV3 and toy.bits == 8 and toy.scale.shape == (3, 1)
    assert torch.equal(toy.dequantize(), TOYS[1]().dequantize())


def test_a_newer_schema_is_refused_with_both_versions_named(monkeypatch):
    tensors, metadata = write_toy(3, monkeypatch)
    monkeypatch.setitem(registry.TENSOR_TYPES, "ToyTensor", ToyV1)
    with pytest.raises(
        FormatError,
        match=r"tensor 'toy': ToyTensor schema version 3, written by hf_aoq 0\.1\.0, is newer than this hf_aoq "
        r"0\.1\.0 can read \(ToyTensor schema versions 1 to 1\)",
    ):
        S.unflatten_state_dict(tensors, metadata, source="toy.safetensors")


def test_upgrader_failures_are_format_errors(monkeypatch):
    tensors, metadata = write_toy(1, monkeypatch)

    def broken(record):
        raise KeyError("codes")

    def wrong_field(record):
        return {**rename_codes(record), "extra": 1}

    for upgrader, match in [
        (broken, "tensor 'toy': upgrading ToyTensor schema 1 to 2 failed: 'codes'"),
        (wrong_field, "tensor 'toy', attribute 'extra': ToyTensor schema 2 .* has no such attribute"),
    ]:
        cls = type("ToyTensor", (ToyV2,), {"schema_upgraders": {1: upgrader}})
        monkeypatch.setitem(registry.TENSOR_TYPES, "ToyTensor", cls)
        with pytest.raises(FormatError, match=match):
            S.unflatten_state_dict(tensors, metadata)


def test_a_schema_bump_without_an_upgrader_is_refused_at_class_creation():
    with pytest.raises(TypeError, match=r"schema_version 3 needs schema_upgraders for \[2\]"):
        type("ToyTensor", (ToyV2,), {"schema_version": 3})
    with pytest.raises(TypeError, match="schema_version must be an int >= 1"):
        type("ToyTensor", (ToyV1,), {"schema_version": 0})
