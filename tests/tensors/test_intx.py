"""IntxTensor (1- to 8-bit weights, bit-packed) against an independent bit-by-bit packer, and
through every path the other tensor types take."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_aoq
from hf_aoq import AOQError, FqnToConfig, PerGroup, PerRow, quantize_, serialization
from hf_aoq.configs import (
    GemliteUIntXWeightOnlyConfig,
    Int8DynamicActivationIntxWeightConfig,
    IntxWeightOnlyConfig,
    UIntXWeightOnlyConfig,
    config_for_scheme,
    recipe_from_dict,
    recipe_to_dict,
)
from hf_aoq.tensors.intx import IntxTensor, pack_intx, unpack_intx

INT = {b: getattr(torch, f"int{b}") for b in range(1, 9)}


# ---------------------------------------------------------------------- the reference packer
def ref_pack_row(codes: list[int], bits: int) -> list[int]:
    """docs/format.md's bit stream, one bit at a time: code k's bit j is stream bit k*bits + j,
    and stream bit i is bit i % 8 of byte i // 8."""
    out = [0] * (-(-len(codes) * bits // 8))
    for k, code in enumerate(codes):
        assert 0 <= code < 1 << bits
        for j in range(bits):
            i = k * bits + j
            out[i // 8] |= ((code >> j) & 1) << (i % 8)
    return out


def ref_unpack_row(data: list[int], bits: int, k: int) -> list[int]:
    return [sum(((data[(c * bits + j) // 8] >> ((c * bits + j) % 8)) & 1) << j for j in range(bits)) for c in range(k)]


def ref_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.tensor([ref_pack_row(r, bits) for r in codes.tolist()], dtype=torch.uint8)


def ref_dequantize(t: IntxTensor) -> torch.Tensor:
    """w = (q - 2^(bits-1)) * scale + zero, from the reference unpacker, in float32."""
    n, k = t.shape
    g = t.block_size[1]
    q = torch.tensor([ref_unpack_row(r, t.bits, k) for r in t.qdata.tolist()], dtype=torch.float32)
    col_group = torch.arange(k) // g
    w = (q - (1 << (t.bits - 1))) * t.scale.float()[:, col_group]
    if t.zero is not None:
        w = w + t.zero.float()[:, col_group]
    return w.to(t.dtype)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("k", [1, 5, 8, 13, 64, 80])
def test_pack_matches_the_bit_by_bit_reference(bits, k):
    torch.manual_seed(bits * 100 + k)
    codes = torch.randint(0, 1 << bits, (3, k), dtype=torch.uint8)
    packed = pack_intx(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, -(-k * bits // 8))
    assert torch.equal(packed, ref_pack(codes, bits))
    assert torch.equal(unpack_intx(packed, bits, k), codes)


def test_four_bits_are_int4_nibble_order_and_eight_codes_are_bits_bytes():
    from hf_aoq.core.primitives import pack_int4

    codes = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    assert torch.equal(pack_intx(codes, 4), pack_int4(codes))
    # Code 0 of a 3-bit stream is the low 3 bits of byte 0; code 2 straddles bytes 0 and 1.
    assert pack_intx(torch.tensor([[5, 0, 0b111]], dtype=torch.uint8), 3).tolist() == [[0b11000101, 0b1]]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size, k", [(32, 64), (32, 80), (None, 40), (16, 24)])
def test_quantize_round_trips_through_the_reference(bits, symmetric, group_size, k):
    if symmetric and bits == 1:
        pytest.skip("int1 is asymmetric only (test_bad_input)")
    torch.manual_seed(bits)
    w = torch.randn(6, k, dtype=torch.bfloat16)
    t = IntxTensor.from_float(w, bits, group_size, symmetric)
    g = k if group_size is None else group_size
    assert t.bits == bits and t.block_size == (1, g) and t.shape == w.shape and t.dtype == w.dtype
    assert t.scale.shape == (6, -(-k // g)) and t.scale.dtype == torch.bfloat16
    assert (t.zero is None) == symmetric
    assert torch.equal(t.dequantize(), ref_dequantize(t))
    # The codes are the nearest to each weight under the stored scale and zero.
    mid = 1 << (bits - 1)
    cols = torch.arange(k) // g
    zero = 0 if t.zero is None else t.zero.float()[:, cols]
    want = (torch.round((w.float() - zero) / t.scale.float()[:, cols]) + mid).clamp(0, (1 << bits) - 1)
    assert torch.equal(t.codes().float(), want)


def test_more_bits_reconstruct_better_and_mse_beats_minmax():
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    errors = [float((IntxTensor.from_float(w, b, 32).dequantize() - w).square().mean()) for b in range(2, 9)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-4
    for b in (2, 3, 5):
        mse = IntxTensor.from_float(w, b, 32).dequantize()
        minmax = IntxTensor.from_float(w, b, 32, qparams="minmax").dequantize()
        assert (mse - w).square().sum() <= (minmax - w).square().sum()


def test_act_quant_fake_quantizes_inputs_as_int8_does():
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    t = IntxTensor.from_float(w, 4, 32, act_quant="per_token")
    x = torch.randn(3, 64)
    codes, scale = hf_aoq.Int8Tensor.from_float(w, act_quant="per_token").quantize_input(x)
    xq = codes.float() * scale
    assert torch.equal(t.simulate_input_quantization(x), xq)
    # The reference kernel is exactly the fake-quantized matmul; the table's fast row (the C++
    # GEMV where the extension is built, tests/kernels/test_intx_kernels.py) agrees closely.
    from hf_aoq.kernels import registry

    reference = next(k for k in registry.kernels_for("linear", "IntxTensor") if k.name == "reference")
    assert torch.equal(reference.fn(x, t, None), F.linear(xq, t.dequantize()))
    torch.testing.assert_close(F.linear(x, t), F.linear(xq, t.dequantize()), rtol=0, atol=1e-4)
    weight_only = IntxTensor.from_float(w, 4, 32)
    assert torch.equal(reference.fn(x, weight_only, None), F.linear(x, weight_only.dequantize()))
    torch.testing.assert_close(F.linear(x, weight_only), F.linear(x, weight_only.dequantize()), rtol=0, atol=0.05)


# ---------------------------------------------------------------------- configs
def test_configs_build_the_tensor_and_round_trip_through_json():
    w = torch.randn(8, 64)
    cases = [
        (IntxWeightOnlyConfig(), 8, 64, True, None),  # torchao's defaults: int8, per row, symmetric
        (IntxWeightOnlyConfig(torch.int3, PerGroup(32), "asymmetric"), 3, 32, False, None),
        (IntxWeightOnlyConfig(torch.int1, PerRow(), "asymmetric"), 1, 64, False, None),
        (UIntXWeightOnlyConfig(), 4, 64, False, None),
        (UIntXWeightOnlyConfig(torch.uint2, 16), 2, 16, False, None),
        (GemliteUIntXWeightOnlyConfig(), 4, 64, False, None),
        (GemliteUIntXWeightOnlyConfig(8, None), 8, 64, False, None),
        (Int8DynamicActivationIntxWeightConfig(), 8, 32, True, "per_token"),
        (Int8DynamicActivationIntxWeightConfig(torch.int2, PerRow(), "asymmetric"), 2, 64, False, "per_token"),
    ]
    for cfg, bits, g, sym, act in cases:
        t = cfg.quantize_weight(w)
        assert isinstance(t, IntxTensor)
        assert (t.bits, t.block_size, t.zero is None, t.act_quant) == (bits, (1, g), sym, act), cfg
        assert recipe_from_dict(recipe_to_dict(cfg)) == cfg


@pytest.mark.parametrize("make, match", [
    (lambda: IntxWeightOnlyConfig(torch.uint4), r"IntxWeightOnlyConfig.weight_dtype must be one of torch.int1.*torch.int8"),
    (lambda: IntxWeightOnlyConfig(torch.int4, PerGroup(48)), r"IntxWeightOnlyConfig.granularity must be PerRow\(\) or PerGroup"),
    (lambda: IntxWeightOnlyConfig(torch.int4, hf_aoq.PerTensor()), "granularity must be"),
    (lambda: IntxWeightOnlyConfig(torch.int4, mapping_type="weird"), r"mapping_type must be one of \('symmetric', 'asymmetric'\)"),
    (lambda: IntxWeightOnlyConfig(torch.int1), "mapping_type must be 'asymmetric' for 1-bit"),
    (lambda: UIntXWeightOnlyConfig(torch.uint8), r"UIntXWeightOnlyConfig.dtype must be one of torch.uint1.*torch.uint7"),
    (lambda: UIntXWeightOnlyConfig(torch.uint4, 100), r"UIntXWeightOnlyConfig.group_size must be one of \(16, 32"),
    (lambda: GemliteUIntXWeightOnlyConfig(3), r"bit_width must be one of \(4, 8\)"),
    (lambda: Int8DynamicActivationIntxWeightConfig(torch.int4, PerGroup(7)), "weight_granularity must be"),
    (lambda: config_for_scheme("int3", 48), r"group size must be one of \(16, 32, 64, 128, 256\)"),
])
def test_bad_configs_name_the_field_and_the_allowed_values(make, match):
    with pytest.raises(AOQError, match=match):
        make()


def test_bad_json_granularity_is_refused():
    data = recipe_to_dict(IntxWeightOnlyConfig(torch.int3, PerGroup(32)))
    assert data["granularity"] == {"granularity": "PerGroup", "group_size": 32}
    for bad in ({"granularity": "PerGroup", "group_size": "32"}, {"granularity": "PerGroup", "group_size": -1},
                {"granularity": "PerGroup"}):
        with pytest.raises(hf_aoq.FormatError):
            recipe_from_dict(dict(data, granularity=bad))


def test_scheme_names():
    assert config_for_scheme("int2") == IntxWeightOnlyConfig(torch.int2, PerGroup(32))
    assert config_for_scheme("int6", 128) == IntxWeightOnlyConfig(torch.int6, PerGroup(128))
    assert config_for_scheme("int8-int3") == Int8DynamicActivationIntxWeightConfig(torch.int3, PerGroup(32))
    assert config_for_scheme("int8-int5", 64) == Int8DynamicActivationIntxWeightConfig(torch.int5, PerGroup(64))


def test_bad_weights_and_fields_are_refused():
    w = torch.randn(4, 64)
    for kwargs, match in [
        (dict(bits=0), "bits must be one of"), (dict(bits=9), "bits must be one of"),
        (dict(bits=4, group_size=48), "group_size must be one of"),
        (dict(bits=1, symmetric=True), "1-bit weights must be asymmetric"),
        (dict(bits=4, act_quant="per_tensor"), "act_quant must be one of"),
    ]:
        with pytest.raises(AOQError, match=match):
            IntxTensor.from_float(w, **kwargs)
    with pytest.raises(AOQError, match="inf or nan"):
        IntxTensor.from_float(torch.full((4, 64), float("nan")), 3)
    with pytest.raises(AOQError, match="2-D"):
        IntxTensor.from_float(torch.randn(64), 3)
    t = IntxTensor.from_float(w, 3, 32)
    for change, match in [
        (dict(bits=9), "attribute 'bits'"),
        (dict(bits=4), "field 'qdata'"),  # 3-bit rows are 24 bytes, 4-bit ones 32
        (dict(qdata=torch.zeros(4, 24, dtype=torch.int8)), "field 'qdata'"),
        (dict(scale=torch.zeros(4, 3)), "field 'scale'"),
        (dict(block_size=(1, 48)), "attribute 'block_size'"),
        (dict(block_size=(2, 32)), "field 'scale'"),  # 2 rows a block: the grid has 2 rows, not 4
        (dict(act_quant="per_tensor"), "attribute 'act_quant'"),
        (dict(packing="cpu_whatever"), "attribute 'packing'"),
    ]:
        with pytest.raises(AOQError, match=match):
            IntxTensor.check_fields(dict(t.fields(), **change))


# ---------------------------------------------------------------------- everywhere the other types go
def tiny_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(80, 96), nn.ReLU(), nn.Linear(96, 32)).to(torch.bfloat16)


@pytest.mark.parametrize("config", [
    IntxWeightOnlyConfig(torch.int2, PerGroup(32)),  # 80 = two groups of 32 and one of 16
    IntxWeightOnlyConfig(torch.int7, PerRow(), "asymmetric"),
    UIntXWeightOnlyConfig(torch.uint3, 16),
    Int8DynamicActivationIntxWeightConfig(torch.int5, PerGroup(32)),
], ids=lambda c: type(c).__name__)
def test_quantize_save_reload_and_compile(config, tmp_path):
    m = tiny_mlp()
    x = torch.randn(5, 80, dtype=torch.bfloat16)
    quantize_(m, config)
    assert all(isinstance(m[i].weight, IntxTensor) for i in (0, 2))
    eager = m(x)
    w0 = m[0].weight
    # The C++ row where it runs (else the reference, exactly this) agrees within bf16 rounding.
    torch.testing.assert_close(m[0](x), F.linear(w0.simulate_input_quantization(x), w0.dequantize(), m[0].bias),
                               rtol=2e-2, atol=2e-2)
    path = tmp_path / "m.safetensors"
    serialization.save_file(m.state_dict(), str(path))
    sd = serialization.load_file(str(path))
    for name in ("0.weight", "2.weight"):
        a, b = m.state_dict()[name], sd[name]
        assert isinstance(b, IntxTensor) and a.attributes() == b.attributes()
        for f, t in a.tensor_fields().items():
            assert torch.equal(t, getattr(b, f)), f
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="inductor", fullgraph=True)
    with torch.no_grad():  # inference, as the other compile tests: the C++ rows have no autograd formula
        assert torch.equal(compiled(x), eager)


def test_fqn_to_config_mixes_intx_with_other_schemes():
    m = tiny_mlp()
    quantize_(m, FqnToConfig({"0": config_for_scheme("int3"), "_default": hf_aoq.Int8WeightOnlyConfig()}))
    assert isinstance(m[0].weight, IntxTensor) and m[0].weight.bits == 3
    assert isinstance(m[2].weight, hf_aoq.Int8Tensor)


def test_embedding_rows_and_slices():
    torch.manual_seed(0)
    t = IntxTensor.from_float(torch.randn(10, 80), 3, 16, False)
    d = t.dequantize()
    idx = torch.tensor([[3, 0], [9, 3]])
    assert torch.equal(F.embedding(idx, t), F.embedding(idx, d))
    assert torch.equal(t[2:5].dequantize(), d[2:5])
    assert torch.equal(t[:, 16:].dequantize(), d[:, 16:])  # 16 * 3 bits: not byte-aligned codes, repacked
    assert torch.equal(t[:, 32:48].dequantize(), d[:, 32:48])
    with pytest.raises(AOQError, match="align"):
        t[:, 8:]


def test_from_pretrained_quantizes_on_load_and_reloads_bit_exact(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    config = hf_aoq.AOQConfig(quant_type=Int8DynamicActivationIntxWeightConfig(torch.int3, PerGroup(32)))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config)
    w = model.model.layers[0].mlp.up_proj.weight
    assert isinstance(w, IntxTensor) and w.bits == 3 and w.act_quant == "per_token"
    ids = torch.tensor([[3, 4, 5, 6]])
    logits = model(ids).logits
    model.save_pretrained(tmp_path / "intx")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "intx")
    w2 = again.model.layers[0].mlp.up_proj.weight
    assert isinstance(w2, IntxTensor) and torch.equal(w2.qdata, w.qdata) and torch.equal(w2.scale, w.scale)
    assert w2.attributes() == w.attributes()
    assert torch.equal(again(ids).logits, logits)


def test_cli_quantize_and_inspect(tiny_llama_dir, tmp_path, capsys):
    from hf_aoq import cli

    out = tmp_path / "int3"
    assert cli.main(["quantize", str(tiny_llama_dir), "--scheme", "int3", "--group-size", "64", "--out", str(out)]) == 0
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^model.layers.0.mlp.up_proj.weight\s+intx3 g64 sym\s+256x128\s", text, re.M), text
    assert text.rstrip().endswith("every tensor loads: yes")
    card = (out / "README.md").read_text()
    assert "intx3 g64 sym" in card


def test_the_v1_fixture_loads_and_decodes_as_the_format_says():
    """tests/fixtures/v1_intx.safetensors (scripts/make_fixtures.py, manifest.intx.json): every
    bit width loads and its bits decode, by the reference unpacker, to the stored answers."""
    import safetensors.torch
    from pathlib import Path

    fixtures = Path(__file__).parents[1] / "fixtures"
    loaded = serialization.load_file(str(fixtures / "v1_intx.safetensors"))
    expected = safetensors.torch.load_file(fixtures / "v1_intx.expected.safetensors")
    quantized = {n: t for n, t in loaded.items() if isinstance(t, IntxTensor)}
    assert sorted(t.bits for t in quantized.values()) == [1, 2, 2, 3, 3, 3, 4, 5, 6, 7, 8]
    assert {t.act_quant for t in quantized.values()} == {None, "per_token"}
    for name, t in quantized.items():
        assert torch.equal(ref_dequantize(t), expected[f"{name}.dequantized"]), name


def test_quantize_for_compressed_tensors_refuses_intx_schemes():
    """compressed-tensors has no form for IntxTensor: `--target compressed-tensors --scheme int3`
    is refused up front (it used to quantize to Intx, which `export` then refused)."""
    from hf_aoq.workflows.common import UsageError
    from hf_aoq.workflows.target import build_target_config

    for scheme in ("int3", "int8-int2"):
        with pytest.raises(UsageError, match=f"{scheme} has no compressed-tensors form"):
            build_target_config("compressed-tensors", "unused", scheme, None)
