"""MXTensor (OCP MX v1.0: MXFP8, MXFP4) against a slow scalar reference written from the spec,
bit by bit, and through every path the other tensor types take."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_aoq
from hf_aoq import AOQError, FormatError, FqnToConfig, quantize_, serialization
from hf_aoq.configs import (
    MXDynamicActivationMXWeightConfig,
    MXFPInferenceConfig,
    config_for_scheme,
    recipe_from_dict,
    recipe_to_dict,
)
from hf_aoq.tensors.mx import MXTensor, e8m0_to_float, mx_dequantize, mx_quantize

REPO_ROOT = Path(__file__).resolve().parents[2]
E4M3, E5M2, FP4 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2
ELEMS = (E4M3, E5M2, FP4)


# ---------------------------------------------------------------------- the reference, from the spec
# Element formats (OCP MX v1.0, section 5.3): (exponent bits, mantissa bits, bias, emax, kind).
FORMATS = {E4M3: (4, 3, 7, 8, "e4m3"), E5M2: (5, 2, 15, 15, "e5m2"), FP4: (2, 1, 1, 2, "e2m1")}


def ref_element_value(code: int, fmt) -> float:
    """The value of one element code, straight from the bit fields."""
    ebits, mbits, bias, _, kind = FORMATS[fmt]
    sign = -1.0 if code >> (ebits + mbits) & 1 else 1.0
    e = code >> mbits & ((1 << ebits) - 1)
    m = code & ((1 << mbits) - 1)
    if kind == "e4m3" and e == 15 and m == 7:
        return math.nan
    if kind == "e5m2" and e == 31:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * math.ldexp(m / (1 << mbits), 1 - bias)
    return sign * math.ldexp(1 + m / (1 << mbits), e - bias)


def ref_magnitudes(fmt) -> list[tuple[int, Fraction]]:
    """(code, value) of every finite non-negative element value, ascending."""
    ebits, mbits, *_ = FORMATS[fmt]
    out = []
    for code in range(1 << (ebits + mbits)):
        v = ref_element_value(code, fmt)
        if math.isfinite(v):
            out.append((code, Fraction(v)))
    return out


def ref_encode_element(q: Fraction, negative: bool, fmt) -> int:
    """Round |q| to the nearest element value, ties to the even code, saturating at the largest."""
    ebits, mbits, *_ = FORMATS[fmt]
    table = ref_magnitudes(fmt)
    a = abs(q)
    if a >= table[-1][1]:
        code = table[-1][0]
    else:
        best = min(table, key=lambda cv: (abs(cv[1] - a), cv[0] % 2))
        code = best[0]
    return code | (int(negative) << (ebits + mbits))


def ref_quantize_block(values: list[float], fmt) -> tuple[int, list[int]]:
    """(e8m0 code, element codes) of one block, by the spec's rule."""
    emax = FORMATS[fmt][3]
    amax = max(abs(v) for v in values)
    if amax == 0:
        shared = -127
    else:
        _, e = math.frexp(amax)  # amax = m * 2^e, 0.5 <= m < 1
        shared = min(max(e - 1 - emax, -127), 127)
    x = Fraction(2) ** shared
    return shared + 127, [ref_encode_element(Fraction(v) / x, math.copysign(1, v) < 0, fmt) for v in values]


def ref_quantize(w: torch.Tensor, fmt) -> tuple[list[list[int]], list[list[int]]]:
    """Per row of a 2-D weight: element codes (one per element) and scale codes."""
    codes, scales = [], []
    for row in w.float().tolist():
        rc, rs = [], []
        for i in range(0, len(row), 32):
            s, c = ref_quantize_block(row[i : i + 32], fmt)
            rs.append(s)
            rc += c
        codes.append(rc)
        scales.append(rs)
    return codes, scales


def element_codes(t: MXTensor) -> list[list[int]]:
    """The element codes MXTensor stores, unpacked by hand (low nibble = even element)."""
    if t.elem_dtype == FP4:
        rows = []
        for row in t.qdata.tolist():
            rows.append([n for byte in row for n in (byte & 15, byte >> 4)])
        return rows
    return t.qdata.view(torch.uint8).tolist()


def tricky_weight(dtype: torch.dtype, fmt, k: int = 96, seed: int = 0) -> torch.Tensor:
    """Rows that hit the spec's corners: many magnitudes, exact ties, saturation, zeros of both
    signs, tiny values, all-zero blocks; every value exactly representable in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    emax = FORMATS[fmt][3]
    rows = [torch.randn(k, generator=g) * 10.0 ** float(p) for p in (-3, -1, 0, 2)]
    mags = [v for _, v in ref_magnitudes(fmt)]
    # Ties: midpoints between neighbouring element values, in a block whose max sets e = 0.
    mids = [float((a + b) / 2) for a, b in zip(mags, mags[1:])]
    tie = torch.tensor((mids * (k // len(mids) + 1))[:k])
    tie[0::32] = 2.0**emax * 1.5  # every block's max
    tie[1::2] *= -1
    rows += [tie, tie * 2.0**-5]
    # Saturation: the block max just below 2^(emax+1) is clamped to the largest normal.
    sat = torch.linspace(-1, 1, k) * (2.0 ** (emax + 1)) * 0.999
    rows.append(sat)
    z = torch.zeros(k)
    z[1] = -0.0
    z[40:] = torch.randn(k - 40, generator=g) * 1e-30  # tiny: the scale clamps at 2^-127 for some
    z[64:] = -0.0
    rows.append(z)
    w = torch.stack(rows)
    return w.to(dtype)


# ---------------------------------------------------------------------- decode, bit by bit
@pytest.mark.parametrize("fmt", ELEMS, ids=lambda d: FORMATS[d][4])
def test_every_element_code_decodes_as_the_spec_says(fmt):
    n = 16 if fmt == FP4 else 256
    codes = torch.arange(n, dtype=torch.uint8)
    if fmt == FP4:
        qdata = codes[0::2] | (codes[1::2] << 4)
    else:
        qdata = codes.view(fmt)
    got = mx_dequantize(qdata[None], torch.tensor([[127]], dtype=torch.uint8), fmt, torch.float32)[0]
    want = torch.tensor([ref_element_value(c, fmt) for c in range(n)], dtype=torch.float32)
    assert torch.equal(torch.signbit(got), torch.signbit(want)) or fmt != FP4
    assert torch.allclose(got, want, rtol=0, atol=0, equal_nan=True)
    if fmt != FP4:  # torch's own float8 casts agree with the bit fields too
        assert torch.allclose(codes.view(fmt).float(), want, rtol=0, atol=0, equal_nan=True)


def test_every_e8m0_code_decodes_as_the_spec_and_torch_say():
    codes = torch.arange(256, dtype=torch.uint8)
    got = e8m0_to_float(codes)
    want = torch.tensor([math.nan if c == 255 else math.ldexp(1.0, c - 127) for c in range(256)])
    assert torch.allclose(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(got, codes.view(torch.float8_e8m0fnu).float(), rtol=0, atol=0, equal_nan=True)


def test_fp4_bytes_are_torch_float4_e2m1fn_x2_with_the_even_element_low():
    # torch's Float4_e2m1fn_x2 puts val0 in bits 3..0 and val1 in bits 7..4.
    w = torch.tensor([[1.0, -6.0] + [0.0] * 30])  # block max 6: e = 0, codes 2 and 15
    t = MXTensor.from_float(w, FP4)
    assert t.qdata[0, 0].item() == (15 << 4) | 2
    assert t.qdata.view(FP4).dtype == FP4 and t.qdata.view(FP4).shape == (1, 16)
    assert t.scale.view(torch.float8_e8m0fnu).float().item() == 1.0


# ---------------------------------------------------------------------- encode, bit by bit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", ELEMS, ids=lambda d: FORMATS[d][4])
def test_quantize_matches_the_scalar_reference_bit_by_bit(fmt, dtype):
    w = tricky_weight(dtype, fmt)
    t = MXTensor.from_float(w, fmt)
    codes, scales = ref_quantize(w, fmt)
    assert t.scale.tolist() == scales
    assert element_codes(t) == codes
    # And the decoded values are the reference's: element * 2^(s - 127), rounded to the dtype.
    want = torch.tensor([
        [ref_element_value(c, fmt) * math.ldexp(1.0, scales[r][i // 32] - 127) for i, c in enumerate(row)]
        for r, row in enumerate(codes)
    ]).to(dtype)
    assert torch.equal(t.dequantize(), want)


def test_tie_and_saturation_cases_are_really_exercised():
    # The reference picks ties by code parity and clamps: make sure the rows above hit both.
    fmt = FP4
    w = tricky_weight(torch.float32, fmt)
    codes, _ = ref_quantize(w, fmt)
    assert 4 in codes[4] and 6 in codes[4]  # 2.5 -> 2 (code 4), 3.5 -> 4 (code 6)
    assert max(c & 7 for c in codes[6]) == 7  # saturated to 6
    assert codes[7][1] == 8  # -0 keeps its sign


def test_partial_last_block_is_its_own_block():
    w = torch.randn(4, 80)
    w[:, 64:] *= 1000  # the last block of 16 has its own, larger scale
    t = MXTensor.from_float(w, E4M3)
    codes, scales = ref_quantize(w, E4M3)
    assert t.scale.shape == (4, 3) and t.scale.tolist() == scales and element_codes(t) == codes
    assert t.dequantize().is_contiguous()  # safetensors saves only contiguous tensors


def test_quantize_in_row_chunks_gives_the_same_bits(monkeypatch):
    from hf_aoq.core import primitives

    w = torch.randn(64, 128, dtype=torch.bfloat16)
    whole = MXTensor.from_float(w, FP4)
    monkeypatch.setattr(primitives, "ROW_CHUNK_ELEMENTS", 128 * 5)
    chunked = MXTensor.from_float(w, FP4)
    assert torch.equal(whole.qdata, chunked.qdata) and torch.equal(whole.scale, chunked.scale)


# ---------------------------------------------------------------------- dynamic activations
@pytest.mark.parametrize("act", ELEMS, ids=lambda d: FORMATS[d][4])
def test_activations_are_quantized_in_the_same_blocks(act):
    w = torch.randn(8, 64)
    t = MXTensor.from_float(w, FP4, act_dtype=act)
    x = tricky_weight(torch.float32, act, k=64, seed=3)
    codes, scales = ref_quantize(x, act)
    want = torch.tensor([
        [ref_element_value(c, act) * math.ldexp(1.0, scales[r][i // 32] - 127) for i, c in enumerate(row)]
        for r, row in enumerate(codes)
    ])
    assert torch.equal(t.simulate_input_quantization(x), want)
    # F.linear sees those values: the kernel's answer is the float matmul of both decodings.
    y = F.linear(x, t)
    assert torch.equal(y, F.linear(want, t.dequantize()))


def test_activation_blocks_with_inf_or_nan_decode_to_nan():
    t = MXTensor.from_float(torch.randn(4, 64), E4M3, act_dtype=E4M3)
    x = torch.randn(2, 64)
    x[0, 3] = math.inf
    x[1, 40] = math.nan
    q, s = mx_quantize(x, E4M3)
    assert s.tolist() == [[255, s[0, 1].item()], [s[1, 0].item(), 255]]
    sim = t.simulate_input_quantization(x)
    assert sim[0, :32].isnan().all() and sim[1, 32:].isnan().all()
    assert sim[0, 32:].isfinite().all() and sim[1, :32].isfinite().all()


def test_weight_only_leaves_activations_alone():
    t = MXTensor.from_float(torch.randn(8, 64), E4M3)
    x = torch.randn(3, 64)
    assert t.simulate_input_quantization(x) is x
    assert torch.equal(F.linear(x, t), F.linear(x, t.dequantize()))


# ---------------------------------------------------------------------- 3-D weights
@pytest.mark.parametrize("fmt", ELEMS, ids=lambda d: FORMATS[d][4])
def test_expert_weights_quantize_per_expert_and_round_trip(fmt, tmp_path):
    w = torch.randn(3, 8, 64, dtype=torch.bfloat16)
    t = MXTensor.from_float(w, fmt)
    assert t.shape == (3, 8, 64) and t.block_size == (1, 1, 32) and t.scale.shape == (3, 8, 2)
    for e in range(3):
        one = MXTensor.from_float(w[e], fmt)
        assert torch.equal(t.qdata[e], one.qdata) and torch.equal(t.scale[e], one.scale)
        assert torch.equal(t.dequantize()[e], one.dequantize())
    path = tmp_path / "experts.safetensors"
    serialization.save_file({"experts.gate_up_proj": t}, str(path))
    back = serialization.load_file(str(path))["experts.gate_up_proj"]
    assert isinstance(back, MXTensor) and back.elem_dtype == fmt
    assert torch.equal(back.qdata.view(torch.uint8), t.qdata.view(torch.uint8)) and torch.equal(back.scale, t.scale)


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 16, 64))
        self.proj = nn.Linear(64, 16)

    def forward(self, x):  # x [2, T, 64]
        return torch.matmul(self.weight, x.transpose(1, 2)).transpose(1, 2) + self.proj(x)


def test_fqn_to_config_reaches_a_3d_parameter():
    m = Experts()
    quantize_(m, FqnToConfig({"weight": MXFPInferenceConfig(activation_dtype=None, weight_dtype=FP4)}))
    assert isinstance(m.weight, MXTensor) and m.weight.shape == (2, 16, 64)
    assert not isinstance(m.proj.weight, MXTensor)
    x = torch.randn(2, 3, 64)
    want = torch.matmul(m.weight.dequantize(), x.transpose(1, 2)).transpose(1, 2) + m.proj(x)
    assert torch.equal(m(x), want)


# ---------------------------------------------------------------------- configs and schemes
def test_configs_round_trip_through_strict_json_under_both_names():
    for cfg in (MXFPInferenceConfig(), MXFPInferenceConfig(activation_dtype=None, weight_dtype=FP4),
                MXDynamicActivationMXWeightConfig(weight_dtype=E5M2, activation_dtype=E5M2)):
        d = recipe_to_dict(cfg)
        assert recipe_from_dict(d) == cfg and type(recipe_from_dict(d)) is type(cfg)
    assert recipe_to_dict(MXFPInferenceConfig(weight_dtype=FP4))["weight_dtype"] == {"dtype": "float4_e2m1fn_x2"}
    recipe = FqnToConfig({"re:.*up_proj": MXFPInferenceConfig(weight_dtype=FP4), "_default": MXFPInferenceConfig()})
    assert recipe_from_dict(recipe_to_dict(recipe)).mapping == recipe.mapping


def test_bad_configs_name_the_field_and_the_allowed_values():
    with pytest.raises(AOQError, match=r"MXFPInferenceConfig.block_size must be 32.*16"):
        MXFPInferenceConfig(block_size=16)
    with pytest.raises(AOQError, match=r"MXFPInferenceConfig.weight_dtype must be one of .*float8_e4m3fn.*float4_e2m1fn_x2.*int8"):
        MXFPInferenceConfig(weight_dtype=torch.int8)
    with pytest.raises(AOQError, match=r"MXDynamicActivationMXWeightConfig.activation_dtype must be one of None"):
        MXDynamicActivationMXWeightConfig(activation_dtype=torch.bfloat16)
    with pytest.raises(FormatError, match="block_size"):
        recipe_from_dict({"type": "MXFPInferenceConfig", "block_size": 64})
    with pytest.raises(FormatError, match="unknown dtype"):
        recipe_from_dict({"type": "MXFPInferenceConfig", "weight_dtype": {"dtype": "float6_e3m2"}})


def test_scheme_names():
    assert config_for_scheme("mxfp8") == MXFPInferenceConfig()
    assert config_for_scheme("mxfp4") == MXFPInferenceConfig(activation_dtype=E4M3, weight_dtype=FP4)
    assert config_for_scheme("mxfp4", 32) == config_for_scheme("mxfp4")
    with pytest.raises(AOQError, match="blocks of 32 only"):
        config_for_scheme("mxfp8", 64)


# ---------------------------------------------------------------------- bad input
def test_bad_weights_are_refused_with_clear_errors():
    with pytest.raises(AOQError, match="w: MX block_size must be 32"):
        MXTensor.from_float(torch.randn(4, 64), E4M3, block_size=16, name="w")
    with pytest.raises(AOQError, match="w: MXFP4 .* needs an even input dimension"):
        MXTensor.from_float(torch.randn(4, 33), FP4, name="w")
    with pytest.raises(AOQError, match="w: MXFP4 .* needs an even input dimension"):
        MXTensor.from_float(torch.randn(4, 33), E4M3, act_dtype=FP4, name="w")
    with pytest.raises(AOQError, match="elem_dtype must be one of"):
        MXTensor.from_float(torch.randn(4, 64), torch.float8_e4m3fnuz, name="w")
    with pytest.raises(AOQError, match="inf or nan"):
        MXTensor.from_float(torch.tensor([[1.0, math.nan] * 16]), E4M3, name="w")
    with pytest.raises(AOQError, match="2-D .* or 3-D"):
        MXTensor.from_float(torch.randn(64), E4M3, name="w")
    # An odd K is fine for MXFP8: its last block is partial.
    assert MXTensor.from_float(torch.randn(4, 33), E4M3).scale.shape == (4, 2)


@pytest.mark.parametrize("change, match", [
    (dict(scale=torch.zeros(4, 3, dtype=torch.uint8)), "field 'scale'"),
    (dict(scale=torch.zeros(4, 2)), "field 'scale'"),
    (dict(qdata=torch.zeros(4, 64, dtype=torch.uint8)), "field 'qdata'"),
    (dict(block_size=(1, 16)), "attribute 'block_size'"),
    (dict(elem_dtype=torch.int8), "attribute 'elem_dtype'"),
    (dict(act_dtype=torch.bfloat16), "attribute 'act_dtype'"),
])
def test_loader_refuses_fields_that_contradict_the_attributes(change, match, tmp_path):
    t = MXTensor.from_float(torch.randn(4, 64), E4M3)
    fields = dict(t.fields(), **change)
    with pytest.raises(AOQError, match=match):
        MXTensor.check_fields(fields)


@pytest.mark.parametrize("fmt, special", [(E4M3, [0x7F, 0xFF]), (E5M2, [0x7C, 0x7D, 0x7E, 0x7F, 0xFC, 0xFD, 0xFE, 0xFF])])
def test_loader_refuses_inf_and_nan_element_codes(fmt, special, tmp_path):
    # The C++ kernels decode codes by a bit trick with no special values, so a weight holding
    # them would give finite outputs where the reference gives NaN/inf: files holding them are
    # refused. Every other code loads (so the check is not refusing too much).
    t = MXTensor.from_float(torch.randn(8, 256), fmt)
    ok = dict(t.fields(), qdata=torch.tensor([c for c in range(256) if c not in special] * 9,
                                             dtype=torch.uint8)[: 8 * 256].reshape(8, 256).view(fmt))
    MXTensor.check_fields(ok)
    for code in special:
        codes = t.qdata.view(torch.uint8).clone()
        codes[5, 37] = code
        with pytest.raises(AOQError, match=r"field 'qdata': 1 .* element codes are .*\(5, 37\)"):
            MXTensor.check_fields(dict(t.fields(), qdata=codes.view(fmt)))
    # Through the loader: a valid file whose stored qdata is changed to hold one NaN code.
    from safetensors import safe_open
    from safetensors.torch import save_file as raw_save

    path = tmp_path / "w.safetensors"
    serialization.save_file({"w": t}, path)
    with safe_open(str(path), "pt") as f:
        meta, raw = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = next(k for k, v in raw.items() if v.dtype == fmt)
    raw[key].view(torch.uint8)[5, 37] = special[0]
    raw_save(raw, str(path), metadata=meta)
    with pytest.raises(FormatError, match=r"w\.safetensors.*field 'qdata': 1 .* element codes are"):
        serialization.load_file(path)


# ---------------------------------------------------------------------- everywhere the other types go
def tiny_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32)).to(torch.bfloat16)


@pytest.mark.parametrize("scheme", ["mxfp8", "mxfp4"])
def test_quantize_save_reload_and_compile(scheme, tmp_path):
    m = tiny_mlp()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    quantize_(m, config_for_scheme(scheme))
    assert all(isinstance(m[i].weight, MXTensor) for i in (0, 2))
    eager = m(x)
    w0 = m[0].weight
    want0 = F.linear(w0.simulate_input_quantization(x), w0.dequantize(), m[0].bias)
    assert torch.equal(m[0](x), want0)
    path = tmp_path / "m.safetensors"
    serialization.save_file(m.state_dict(), str(path))
    sd = serialization.load_file(str(path))
    for name in ("0.weight", "2.weight"):
        a, b = m.state_dict()[name], sd[name]
        assert torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8)) and torch.equal(a.scale, b.scale)
        assert a.attributes() == b.attributes()
    compiled = torch.compile(m, backend="inductor", fullgraph=True)
    assert torch.equal(compiled(x), eager)  # the same reference kernel, traced


def test_fqn_to_config_mixes_mx_with_other_schemes():
    m = tiny_mlp()
    recipe = FqnToConfig({"0": MXDynamicActivationMXWeightConfig(weight_dtype=E5M2, activation_dtype=E5M2),
                          "_default": hf_aoq.Int8WeightOnlyConfig()})
    quantize_(m, recipe)
    assert isinstance(m[0].weight, MXTensor) and m[0].weight.elem_dtype == E5M2 and m[0].weight.act_dtype == E5M2
    assert isinstance(m[2].weight, hf_aoq.Int8Tensor)


def test_embedding_rows_and_slices():
    w = torch.randn(10, 64)
    t = MXTensor.from_float(w, FP4)
    idx = torch.tensor([[3, 0], [9, 3]])
    assert torch.equal(F.embedding(idx, t), F.embedding(idx, t.dequantize()))
    assert torch.equal(t[2:5].dequantize(), t.dequantize()[2:5])
    assert torch.equal(t[:, 32:].dequantize(), t.dequantize()[:, 32:])
    with pytest.raises(AOQError, match="align"):
        t[:, 8:]


def test_from_pretrained_quantizes_on_load_and_reloads_bit_exact(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    config = hf_aoq.AOQConfig(quant_type=MXFPInferenceConfig(weight_dtype=FP4))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config)
    w = model.model.layers[0].mlp.up_proj.weight
    assert isinstance(w, MXTensor) and w.elem_dtype == FP4 and w.act_dtype == E4M3
    ids = torch.tensor([[3, 4, 5, 6]])
    logits = model(ids).logits
    model.save_pretrained(tmp_path / "mx")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "mx")
    w2 = again.model.layers[0].mlp.up_proj.weight
    assert isinstance(w2, MXTensor) and torch.equal(w2.qdata, w.qdata) and torch.equal(w2.scale, w.scale)
    assert torch.equal(again(ids).logits, logits)


def test_cli_quantize_and_inspect(tiny_llama_dir, tmp_path, capsys):
    from hf_aoq import cli

    out = tmp_path / "mxfp4"
    assert cli.main(["quantize", str(tiny_llama_dir), "--scheme", "mxfp4", "--out", str(out)]) == 0
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^model.layers.0.mlp.up_proj.weight\s+mx e2m1 g32 dyn-act mx e4m3\s+256x128\s", text, re.M)
    assert text.rstrip().endswith("every tensor loads: yes")
    # As a command of its own (which imports only what the command needs), inspect still knows
    # every tensor type: it used to answer "unknown tensor type 'MXTensor'; known: []".
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    run = subprocess.run([sys.executable, "-m", "hf_aoq", "inspect", str(out)], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert "every tensor loads: yes" in run.stdout
