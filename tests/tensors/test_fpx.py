"""FPxTensor (sub-byte floats, torchao's FPx) against a scalar reference written here from the
definition in docs/format.md ("FPxTensor"), in Python floats and Fractions: every code of every
allowed format, ties, neighbours of ties, saturation, signed zeros, the row scale, the bit stream."""
from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

from hf_aoq import AOQError, FormatError
from hf_aoq.configs import FPXWeightOnlyConfig, config_for_scheme, recipe_from_dict, recipe_to_dict
from hf_aoq.tensors.fpx import FORMATS, FPxTensor, decode_fpx, encode_fpx

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# ---------------------------------------------------------------------- the reference, from the definition
def ref_value(code: int, e: int, m: int) -> float:
    """S E..E M..M, bias 2^(e-1) - 1; E = 0: zero and subnormals; no inf or NaN codes."""
    bias = 2 ** (e - 1) - 1
    s, big_e, big_m = code >> (e + m), (code >> m) % 2 ** e, code % 2 ** m
    if big_e == 0:
        mag = 2.0 ** (1 - bias) * big_m / 2 ** m
    else:
        mag = 2.0 ** (big_e - bias) * (1 + big_m / 2 ** m)
    return -mag if s else mag


def ref_max(e: int, m: int) -> float:
    bias = 2 ** (e - 1) - 1
    return 2.0 ** (2 ** e - 1 - bias) * (2 - 2.0 ** -m)


def ref_encode(x: float, e: int, m: int) -> int:
    """The code nearest to x by exhaustive search (exact distances), ties to the even code,
    beyond the largest value the largest (saturation), with x's sign (also for zeros)."""
    a = abs(Fraction(x))
    mag = min(range(2 ** (e + m)), key=lambda c: (abs(Fraction(ref_value(c, e, m)) - a), c % 2))
    return mag | (2 ** (e + m) if math.copysign(1.0, x) < 0 else 0)


def f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def to_dtype(v: float, dtype) -> float:
    return torch.tensor(v, dtype=torch.float64).to(dtype).item()


def ref_quantize_row(row: list[float], e: int, m: int, dtype) -> tuple[list[int], float]:
    amax = max(f32(max(abs(v) for v in row)), f32(1e-12))
    scale = to_dtype(f32(amax / ref_max(e, m)), dtype)
    info = torch.finfo(dtype)
    scale = max(scale, info.tiny * info.eps)
    return [ref_encode(f32(v / scale), e, m) for v in row], scale


def ref_pack(codes: list[int], bits: int) -> list[int]:
    out = [0] * (-(-len(codes) * bits // 8))
    for k, c in enumerate(codes):
        for j in range(bits):
            i = k * bits + j
            out[i // 8] |= ((c >> j) & 1) << (i % 8)
    return out


def ids(fmt):
    return f"e{fmt[0]}m{fmt[1]}"


# ---------------------------------------------------------------------- codes
def test_the_allowed_formats():
    assert FORMATS == ((3, 2), (2, 3), (2, 2), (3, 1), (3, 0), (2, 1))


@pytest.mark.parametrize("fmt", FORMATS, ids=ids)
def test_every_code_decodes_to_the_definition(fmt):
    e, m = fmt
    codes = torch.arange(2 ** (1 + e + m), dtype=torch.uint8)
    got = decode_fpx(codes, e, m).tolist()
    want = [ref_value(c, e, m) for c in range(2 ** (1 + e + m))]
    assert got == want
    assert all(math.isfinite(v) for v in got)  # no inf / NaN encodings
    assert [math.copysign(1, v) for v in got] == [1.0] * 2 ** (e + m) + [-1.0] * 2 ** (e + m)
    assert max(got) == ref_max(e, m) == -min(got)
    # The same through the tensor type, with a scale of one per row.
    t = FPxTensor(torch.tensor([ref_pack(codes.tolist(), 1 + e + m)], dtype=torch.uint8),
                  torch.ones(1, 1), e, m, (1, len(codes)), (1, len(codes)), torch.float32)
    FPxTensor.check_fields(t.fields())
    assert t.dequantize()[0].tolist() == want


@pytest.mark.parametrize("fmt", FORMATS, ids=ids)
def test_every_value_encodes_to_its_code(fmt):
    e, m = fmt
    values = [ref_value(c, e, m) for c in range(2 ** (1 + e + m))]
    got = encode_fpx(torch.tensor(values), e, m).tolist()
    assert got == list(range(2 ** (1 + e + m)))  # -0.0 keeps its sign bit


@pytest.mark.parametrize("fmt", FORMATS, ids=ids)
def test_ties_neighbours_of_ties_and_saturation(fmt):
    e, m = fmt
    mags = sorted({abs(ref_value(c, e, m)) for c in range(2 ** (e + m))})
    xs = []
    for lo, hi in zip(mags, mags[1:]):
        mid = (lo + hi) / 2
        xs += [mid, math.nextafter(mid, 0), math.nextafter(mid, math.inf)]  # exact in float32 here
    top = mags[-1]
    xs += [top * 1.0625, top * 2, 3.0e38, math.nextafter(top, math.inf), 1e-30, 1e-45, 0.0]
    xs = [f32(v) for v in xs]
    xs += [-v for v in xs]
    got = encode_fpx(torch.tensor(xs, dtype=torch.float32), e, m).tolist()
    want = [ref_encode(v, e, m) for v in xs]
    assert got == want
    # Spot checks that the reference says what the definition does: a tie goes to the even code.
    assert ref_encode((mags[1] + mags[2]) / 2, e, m) == 2 and ref_encode(mags[-1] * 4, e, m) == 2 ** (e + m) - 1
    assert ref_encode(-1e-30, e, m) == 2 ** (e + m)  # -0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=ids)
def test_from_float_is_the_reference_quantizer(fmt, dtype):
    e, m = fmt
    gen = torch.Generator().manual_seed(e * 10 + m)
    w = torch.randn(6, 67, generator=gen) * torch.logspace(-3, 1, 6)[:, None]
    w[0, :3] = torch.tensor([0.0, -0.0, 5.0])
    w[5] = 0.0  # an all-zero row: scale 1e-12 / max, codes 0
    w = w.to(dtype)
    t = FPxTensor.from_float(w, e, m)
    assert (t.ebits, t.mbits, t.block_size, t.shape, t.dtype) == (e, m, (1, 67), w.shape, dtype)
    assert t.scale.shape == (6, 1) and t.scale.dtype == dtype and t.qdata.shape == (6, -(-67 * (1 + e + m) // 8))
    deq = t.dequantize(torch.float32)
    for n, row in enumerate(w.tolist()):
        codes, scale = ref_quantize_row(row, e, m, dtype)
        assert t.scale[n, 0].item() == scale, n
        assert t.codes()[n].tolist() == codes, n
        assert t.qdata[n].tolist() == ref_pack(codes, 1 + e + m), n
        assert deq[n].tolist() == [f32(ref_value(c, e, m) * scale) for c in codes], n
    assert torch.equal(t.dequantize(), deq.to(dtype))
    assert math.copysign(1, t.dequantize()[0, 1].item()) == -1  # -0 stays -0


def test_fp16_scale_of_a_tiny_row_is_the_smallest_subnormal():
    w = torch.full((1, 8), 1e-7, dtype=torch.float16)
    t = FPxTensor.from_float(w)
    assert t.scale.item() == 2.0 ** -24
    assert ref_quantize_row(w[0].tolist(), 3, 2, torch.float16) == (t.codes()[0].tolist(), 2.0 ** -24)


def test_scale_is_row_max_over_the_largest_value():
    w = torch.tensor([[1.0, -56.0, 3.0], [0.5, 0.25, -0.75]])
    t = FPxTensor.from_float(w)  # e3m2: largest value 28
    assert t.scale.flatten().tolist() == [2.0, f32(0.75 / 28)]
    assert t.dequantize()[0].tolist() == [1.0, -56.0, 3.0]


def test_more_mantissa_or_bits_reconstruct_better():
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    err = {f: float((FPxTensor.from_float(w, *f).dequantize() - w).square().mean()) for f in FORMATS}
    assert err[(2, 3)] < err[(3, 2)] < err[(2, 2)] < err[(2, 1)]
    assert err[(3, 1)] < err[(3, 0)]


# ---------------------------------------------------------------------- bad input
def test_weights_with_inf_or_nan_are_refused_by_name():
    for bad in (float("inf"), float("nan"), -float("inf")):
        w = torch.randn(4, 16)
        w[2, 3] = bad
        with pytest.raises(AOQError, match=r"model\.layers\.3\.mlp\.up_proj\.weight: cannot quantize a tensor with inf or nan"):
            FPXWeightOnlyConfig().quantize_weight(w, name="model.layers.3.mlp.up_proj.weight")


@pytest.mark.parametrize("ebits, mbits", [(3, 3), (1, 2), (2, 0), (4, 3), (3.0, 2), (True, 2), (None, 2), (3, "2")])
def test_bad_formats_are_refused_with_the_allowed_ones(ebits, mbits):
    with pytest.raises(AOQError, match=r"FPXWeightOnlyConfig: \(ebits, mbits\) must be one of .*e3m2, e2m3"):
        FPXWeightOnlyConfig(ebits, mbits)
    with pytest.raises(AOQError, match=r"w: FPxTensor: \(ebits, mbits\) must be one of"):
        FPxTensor.from_float(torch.randn(2, 8), ebits, mbits, name="w")


def test_bad_weights_and_fields_are_refused():
    with pytest.raises(AOQError, match=r"w: expected a 2-D \[N, K\] or 3-D \[E, N, K\] \(fused experts\) weight"):
        FPxTensor.from_float(torch.randn(2, 3, 4, 8), name="w")
    with pytest.raises(AOQError, match="float32, bfloat16 or float16"):
        FPxTensor.from_float(torch.randint(0, 3, (2, 8)))
    t = FPxTensor.from_float(torch.randn(4, 20))
    for change, match in [
        (dict(ebits=4), "attributes 'ebits', 'mbits'"),
        (dict(ebits=2, mbits=1), "field 'qdata'"),  # 4-bit rows are 10 bytes, 6-bit ones 15
        (dict(qdata=torch.zeros(4, 15, dtype=torch.int8)), "field 'qdata'"),
        (dict(qdata=torch.zeros(4, 14, dtype=torch.uint8)), "field 'qdata'"),
        (dict(scale=torch.ones(4)), "field 'scale'"),
        (dict(scale=torch.ones(4, 2)), "field 'scale'"),
        (dict(scale=torch.ones(4, 1, dtype=torch.int32)), "field 'scale'"),
        (dict(block_size=(1, 10)), "attribute 'block_size'"),
        (dict(block_size=(4, 20)), "attribute 'block_size'"),
        (dict(shape=(2, 2, 20), block_size=(1, 1, 20)), "field 'qdata'"),  # 3-D experts need 3-D fields
        (dict(shape=(1, 2, 2, 20), block_size=(1, 1, 1, 20)), "attribute 'shape'"),
    ]:
        with pytest.raises(AOQError, match=match):
            FPxTensor.check_fields(dict(t.fields(), **change))


# ---------------------------------------------------------------------- configs
def test_config_defaults_json_and_scheme():
    assert FPXWeightOnlyConfig() == FPXWeightOnlyConfig(3, 2) == config_for_scheme("fp6")
    for e, m in FORMATS:
        cfg = FPXWeightOnlyConfig(ebits=e, mbits=m)
        assert recipe_to_dict(cfg) == {"type": "FPXWeightOnlyConfig", "ebits": e, "mbits": m}
        assert recipe_from_dict(recipe_to_dict(cfg)) == cfg
        t = cfg.quantize_weight(torch.randn(4, 32))
        assert isinstance(t, FPxTensor) and (t.ebits, t.mbits) == (e, m)
    for bad in ({"type": "FPXWeightOnlyConfig", "ebits": 3, "mbits": 3},
                {"type": "FPXWeightOnlyConfig", "ebits": "3"},
                {"type": "FPXWeightOnlyConfig", "ebits": 3.0},
                {"type": "FPXWeightOnlyConfig", "set_inductor_config": True}):
        with pytest.raises(FormatError, match="FPXWeightOnlyConfig|recipe.ebits"):
            recipe_from_dict(bad)
    with pytest.raises(AOQError, match="scheme fp6 has no group size"):
        config_for_scheme("fp6", 32)


# ---------------------------------------------------------------------- slices and rows
def test_embedding_rows_and_slices():
    torch.manual_seed(0)
    t = FPxTensor.from_float(torch.randn(10, 37), 2, 2)
    d = t.dequantize()
    idx = torch.tensor([[3, 0], [9, 3]])
    assert torch.equal(torch.nn.functional.embedding(idx, t), torch.nn.functional.embedding(idx, d))
    assert torch.equal(t[2:5].dequantize(), d[2:5])
    assert torch.equal(t[:, 3:30].dequantize(), d[:, 3:30])  # 3 * 5 bits: codes repacked


# ---------------------------------------------------------------------- everywhere the other types go
def tiny_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(80, 96), torch.nn.ReLU(), torch.nn.Linear(96, 35)).to(torch.bfloat16)


@pytest.mark.parametrize("config", [FPXWeightOnlyConfig(), FPXWeightOnlyConfig(2, 2), FPXWeightOnlyConfig(2, 1)],
                         ids=lambda c: f"e{c.ebits}m{c.mbits}")
def test_quantize_save_reload_and_compile(config, tmp_path):
    import torch.nn.functional as F

    from hf_aoq import quantize_, serialization

    m = tiny_mlp()
    x = torch.randn(5, 80, dtype=torch.bfloat16)
    quantize_(m, config)
    assert all(isinstance(m[i].weight, FPxTensor) for i in (0, 2))
    eager = m(x)
    w0 = m[0].weight
    # The C++ row where it runs (else the reference, exactly this) agrees within bf16 rounding.
    torch.testing.assert_close(m[0](x), F.linear(x, w0.dequantize(), m[0].bias), rtol=2e-2, atol=2e-2)
    path = tmp_path / "m.safetensors"
    serialization.save_file(m.state_dict(), str(path))
    sd = serialization.load_file(str(path))
    for name in ("0.weight", "2.weight"):
        a, b = m.state_dict()[name], sd[name]
        assert isinstance(b, FPxTensor) and a.attributes() == b.attributes()
        for f, t in a.tensor_fields().items():
            assert torch.equal(t, getattr(b, f)), f
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="inductor", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), eager)


def test_fqn_to_config_mixes_fpx_with_other_schemes():
    import hf_aoq

    m = tiny_mlp()
    hf_aoq.quantize_(m, hf_aoq.FqnToConfig({"0": config_for_scheme("fp6"), "_default": FPXWeightOnlyConfig(3, 1)}))
    assert isinstance(m[0].weight, FPxTensor) and (m[0].weight.ebits, m[0].weight.mbits) == (3, 2)
    assert isinstance(m[2].weight, FPxTensor) and (m[2].weight.ebits, m[2].weight.mbits) == (3, 1)


def test_from_pretrained_quantizes_on_load_and_reloads_bit_exact(tiny_llama_dir, tmp_path):
    import hf_aoq
    from transformers import AutoModelForCausalLM

    config = hf_aoq.AOQConfig(quant_type=FPXWeightOnlyConfig(2, 3))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config)
    w = model.model.layers[0].mlp.up_proj.weight
    assert isinstance(w, FPxTensor) and (w.ebits, w.mbits) == (2, 3)
    ids = torch.tensor([[3, 4, 5, 6]])
    logits = model(ids).logits
    model.save_pretrained(tmp_path / "fpx")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "fpx")
    w2 = again.model.layers[0].mlp.up_proj.weight
    assert isinstance(w2, FPxTensor) and torch.equal(w2.qdata, w.qdata) and torch.equal(w2.scale, w.scale)
    assert w2.attributes() == w.attributes()
    assert torch.equal(again(ids).logits, logits)


def test_cli_quantize_and_inspect(tiny_llama_dir, tmp_path, capsys):
    import re

    from hf_aoq import cli

    out = tmp_path / "fp6"
    assert cli.main(["quantize", str(tiny_llama_dir), "--scheme", "fp6", "--out", str(out)]) == 0
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^model.layers.0.mlp.up_proj.weight\s+fp6 e3m2 per-row\s+256x128\s", text, re.M), text
    assert text.rstrip().endswith("every tensor loads: yes")
    assert "fp6 e3m2 per-row" in (out / "README.md").read_text()


def check_rows_decode_by_the_reference(t, dequantized, name):
    """Each row's bit stream, read by hand, times its scale is the stored answer (2-D [N, K] or
    3-D [E, N, K]: every expert's rows)."""
    k = t.shape[-1]
    bits = 1 + t.ebits + t.mbits
    qdata, scale = t.qdata.reshape(-1, t.qdata.shape[-1]), t.scale.reshape(-1)
    for r, want_row in enumerate(dequantized.reshape(-1, k)):
        data = qdata[r].tolist()
        codes = [sum(((data[(c * bits + j) // 8] >> ((c * bits + j) % 8)) & 1) << j for j in range(bits))
                 for c in range(k)]
        s = scale[r].item()
        want = torch.tensor([f32(ref_value(c, t.ebits, t.mbits) * s) for c in codes]).to(t.dtype)
        assert torch.equal(want, want_row), (name, r)


def test_the_v1_fixture_loads_and_decodes_as_the_format_says():
    """tests/fixtures/v1_fpx.safetensors (scripts/make_fixtures.py, manifest.fpx.json): every
    format loads, and its bits decode, by the reference above, to the stored answers."""
    from pathlib import Path

    import safetensors.torch

    from hf_aoq import serialization

    fixtures = Path(__file__).parents[1] / "fixtures"
    loaded = serialization.load_file(str(fixtures / "v1_fpx.safetensors"))
    expected = safetensors.torch.load_file(fixtures / "v1_fpx.expected.safetensors")
    quantized = {n: t for n, t in loaded.items() if isinstance(t, FPxTensor)}
    assert sorted((t.ebits, t.mbits) for t in quantized.values()) == sorted(FORMATS + ((3, 2),))
    for name, t in quantized.items():
        check_rows_decode_by_the_reference(t, expected[f"{name}.dequantized"], name)
    special = quantized["e3m2_special_f16"]
    assert special.scale[1, 0].item() == 2.0 ** -24 and special.codes()[2, :2].tolist() == [32, 32]  # -0, -0


# ---------------------------------------------------------------------- fused experts [E, N, K]
# (tests/tensors/test_experts.py runs the MoE ops, save/load and placement on FPx experts too.)
@pytest.mark.parametrize("fmt", FORMATS, ids=ids)
def test_experts_are_each_quantized_as_a_2d_weight(fmt):
    e, m = fmt
    w = torch.randn(3, 5, 13, dtype=torch.bfloat16) * torch.tensor([0.1, 1.0, 30.0])[:, None, None].bfloat16()
    t = FPxTensor.from_float(w, e, m)
    b = 1 + e + m
    assert t.shape == (3, 5, 13) and t.block_size == (1, 1, 13)
    assert t.qdata.shape == (3, 5, -(-13 * b // 8)) and t.scale.shape == (3, 5, 1)  # K = 13: a partial last byte
    assert t.codes().shape == (3, 5, 13)
    for i in range(3):
        one = FPxTensor.from_float(w[i], e, m)
        assert torch.equal(t.qdata[i], one.qdata) and torch.equal(t.scale[i], one.scale)
        assert torch.equal(t[i].dequantize(), one.dequantize()) and t[i].shape == (5, 13)
    assert torch.equal(t.dequantize(), torch.stack([FPxTensor.from_float(w[i], e, m).dequantize() for i in range(3)]))
    FPxTensor.check_fields(t.fields())


def test_an_expert_runs_the_cpu_kernel():
    import torch.nn.functional as F

    from hf_aoq import kernels

    t = FPxTensor.from_float(torch.randn(4, 32, 64, dtype=torch.bfloat16))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    want = "cpu_fpx_ext" if kernels.cpu_ext.available() else "reference"
    assert kernels.select_kernel("linear", x, t[2]).name == want
    torch.testing.assert_close(F.linear(x, t[2]), F.linear(x, t.dequantize()[2]), rtol=2e-2, atol=2e-2)


def test_slices_and_cats_of_experts_keep_the_codes():
    w = torch.randn(4, 8, 20)
    t = FPxTensor.from_float(w)
    d = t.dequantize()
    for cut, want in [(t[1:3], d[1:3]), (t[:, 2:6], d[:, 2:6]), (t[:, :, 3:17], d[:, :, 3:17])]:
        FPxTensor.check_fields(cut.fields())
        assert torch.equal(cut.dequantize(), want)
    assert torch.equal(torch.cat([t[:, :, :8], t[:, :, 8:]], 2).dequantize(), d)  # 8 codes: 6 whole bytes
    assert torch.equal(torch.cat([t[:, :3], t[:, 3:]], 1).dequantize(), d)
    # A cut inside the bytes that codes share cannot be put back by joining bytes (it used to give
    # wrong codes, silently).
    with pytest.raises(AOQError, match="does not end on a group of 4"):
        torch.cat([t[:, :, :1], t[:, :, 1:]], 2)
    two_d = FPxTensor.from_float(w[0])
    with pytest.raises(AOQError, match="does not end on a group of 4"):
        torch.cat([two_d[:, :1], two_d[:, 1:4]], 1)  # 6 + 18 bits: 1 + 3 bytes, as many as 24 bits take


def test_bad_expert_weights_are_refused_by_name(tmp_path):
    from hf_aoq import serialization

    with pytest.raises(AOQError, match=r"w: cannot quantize an empty weight of shape \(0, 4, 8\)"):
        FPxTensor.from_float(torch.zeros(0, 4, 8), name="w")
    bad = torch.randn(3, 4, 8)
    bad[1, 2, 3] = float("inf")
    with pytest.raises(AOQError, match=r"w \(expert 1\)"):
        FPxTensor.from_float(bad, name="w")
    with pytest.raises(AOQError, match=r"w: FPxTensor: \(ebits, mbits\) must be one of"):
        FPxTensor.from_float(torch.randn(3, 4, 8), 4, 4, name="w")
    t = FPxTensor.from_float(torch.randn(3, 4, 8))
    for change, match in [
        (dict(scale=t.scale[..., 0]), r"field 'scale': shape \(3, 4\), expected \(3, 4, 1\)"),  # [E, N, 1]
        (dict(scale=t.scale[0]), "field 'scale'"),
        (dict(qdata=t.qdata[:, :, :5]), r"field 'qdata': shape \(3, 4, 5\), expected \(3, 4, 6\)"),
        (dict(block_size=(3, 1, 8)), r"attribute 'block_size': \(3, 1, 8\), expected \(1, K\).*after a leading 1"),
    ]:
        path = str(tmp_path / "bad.safetensors")
        with pytest.MonkeyPatch.context() as mp:  # write what the save-side check would refuse
            mp.setattr(FPxTensor, "check_fields", classmethod(lambda cls, fields: None))
            serialization.save_file({"experts.w": t.replace(**change)}, path)
        with pytest.raises(FormatError, match=rf"tensor 'experts.w', {match}"):
            serialization.load_file(path)


def test_the_v1_fpx3d_fixture_holds_experts_that_decode_as_the_format_says():
    """tests/fixtures/v1_fpx3d.safetensors (manifest.fpx3d.json): fused experts [E, N, K], their
    fields [E, N, bytes] and [E, N, 1], decoded by the reference; one expert runs as a linear."""
    from pathlib import Path

    import safetensors.torch
    import torch.nn.functional as F

    from hf_aoq import serialization

    fixtures = Path(__file__).parents[1] / "fixtures"
    loaded = serialization.load_file(str(fixtures / "v1_fpx3d.safetensors"))
    expected = safetensors.torch.load_file(fixtures / "v1_fpx3d.expected.safetensors")
    quantized = {n: t for n, t in loaded.items() if isinstance(t, FPxTensor)}
    assert sorted((t.ebits, t.mbits) for t in quantized.values()) == [(2, 1), (2, 2), (3, 2)]
    for name, t in quantized.items():
        e, n, k = t.shape
        assert t.qdata.shape == (e, n, -(-k * (1 + t.ebits + t.mbits) // 8)) and t.scale.shape == (e, n, 1), name
        check_rows_decode_by_the_reference(t, expected[f"{name}.dequantized"], name)
        x = expected[f"{name}.input"]
        torch.testing.assert_close(F.linear(x, t[e - 1]).double(), expected[f"{name}.linear"][e - 1],
                                   rtol=2 ** -6, atol=2 ** -6 * float(expected[f"{name}.linear"].abs().max()))


def test_cli_quantizes_a_tiny_mixtral_with_scheme_fp6_and_inspect_names_its_experts(tmp_path, capsys):
    import re

    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

    from hf_aoq import cli

    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, num_local_experts=4,
                                     num_experts_per_tok=2)).save_pretrained(tmp_path / "float")
    out = tmp_path / "fp6"
    assert cli.main(["quantize", str(tmp_path / "float"), "--scheme", "fp6", "--out", str(out)]) == 0
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    # Fused experts stay one 3-D tensor on disk (Mixtral saves mlp. as block_sparse_moe.).
    assert re.search(r"^model.layers.0.block_sparse_moe.experts.gate_up_proj\s+fp6 e3m2 per-row\s+4x192x64\s", text,
                     re.M), text
    assert re.search(r"^model.layers.0.block_sparse_moe.experts.down_proj\s+fp6 e3m2 per-row\s+4x64x96\s", text, re.M)
    assert text.rstrip().endswith("every tensor loads: yes")
    model = AutoModelForCausalLM.from_pretrained(str(out))
    t = model.get_parameter("model.layers.0.mlp.experts.down_proj")
    assert isinstance(t, FPxTensor) and t.shape == (4, 64, 96) and t.scale.shape == (4, 64, 1)
