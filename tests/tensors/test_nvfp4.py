"""NVFP4Tensor (NVIDIA FP4: e2m1 elements, e4m3 block scales of 16, a float32 per-tensor scale)
against a slow scalar reference written from the definition in docs/format.md, bit by bit, and
through every path the other tensor types take."""
from __future__ import annotations

import math
import re
import struct

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_aoq
from hf_aoq import AOQError, FormatError, FqnToConfig, quantize_, serialization
from hf_aoq.configs import (NVFP4InferenceConfig, NVFP4WeightOnlyConfig, config_for_scheme, recipe_from_dict,
                            recipe_to_dict)
from hf_aoq.tensors import nvfp4
from hf_aoq.tensors.nvfp4 import NVFP4Tensor, nvfp4_dequantize, nvfp4_quantize, per_tensor_scale_of

E4M3, FP4 = torch.float8_e4m3fn, torch.float4_e2m1fn_x2


# ---------------------------------------------------------------------- the reference, from the spec
def f32(x: float) -> float:
    """x rounded to float32 (to nearest, ties to even). A float64 +, -, *, / of float32 operands
    rounded once more to float32 is the correctly rounded float32 result (53 >= 2 * 24 + 2)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def e4m3_value(code: int) -> float:
    """float8 e4m3fn from its bit fields: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = code >> 3 & 15, code & 7
    if e == 15 and m == 7:
        return math.nan
    if e == 0:
        return sign * math.ldexp(m / 8, -6)
    return sign * math.ldexp(1 + m / 8, e - 7)


def e2m1_value(code: int) -> float:
    """e2m1 from its bit fields: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 8 else 1.0
    e, m = code >> 1 & 3, code & 1
    return sign * (m / 2 if e == 0 else math.ldexp(1 + m / 2, e - 1))


def nearest_code(a: float, codes: range, value, ties) -> int:
    """The code among `codes` (non-negative, ascending values) nearest to a >= 0; `ties` picks
    among equally near ones (the spec: the even code); saturating at the largest."""
    table = [(c, value(c)) for c in codes]
    if a >= table[-1][1]:
        return table[-1][0]
    best = min(abs(v - a) for _, v in table)
    return ties([c for c, v in table if abs(v - a) == best])


def even(candidates: list[int]) -> int:
    return candidates[0] if len(candidates) == 1 else next(c for c in candidates if c % 2 == 0)


def ref_quantize(w: torch.Tensor, ties_e2m1=even, ties_e4m3=even):
    """Per row of a 2-D weight: (element codes, scale codes, per-tensor scale), one Python float at a time."""
    rows = w.float().tolist()
    amax = max(abs(v) for row in rows for v in row)
    pts = max(f32(amax / 2688.0), 2.0 ** -126)
    codes, scales = [], []
    for row in rows:
        rc, rs = [], []
        for i in range(0, len(row), 16):
            block = row[i : i + 16]
            s = f32(f32(max(abs(v) for v in block) / 6.0) / pts)
            s = min(max(s, 2.0 ** -6), 448.0)
            sc = nearest_code(s, range(0x7F), e4m3_value, ties_e4m3)  # 0..126: the finite non-negative codes
            total = f32(pts * e4m3_value(sc))
            for v in block:
                q = f32(v / total)
                rc.append(nearest_code(abs(q), range(8), e2m1_value, ties_e2m1) | (8 if math.copysign(1, v) < 0 else 0))
            rs.append(sc)
        codes.append(rc)
        scales.append(rs)
    return codes, scales, pts


def ref_values(codes, scales, pts) -> torch.Tensor:
    return torch.tensor([[f32(e2m1_value(c) * f32(pts * e4m3_value(scales[r][i // 16]))) for i, c in enumerate(row)]
                         for r, row in enumerate(codes)])


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor of any dtype and shape (0-d included)."""
    return t.reshape(-1).view(torch.uint8)


def element_codes(t) -> list[list[int]]:
    """The e2m1 codes stored, unpacked by hand (low nibble = even element)."""
    return [[n for byte in row for n in (byte & 15, byte >> 4)] for row in t.qdata.tolist()]


def tricky_weight(dtype: torch.dtype, k: int = 80) -> torch.Tensor:
    """Rows hitting the definition's corners, every value exact in `dtype`: the tensor's amax is
    2688, so the per-tensor scale is exactly 1; blocks whose scale is a power of two, holding
    every e2m1 midpoint (ties); a block scale that is an e4m3 tie (6.375 / 6 = 1.0625); a block
    at the top (scale 448, saturated elements); tiny blocks (scale clamped to 2^-6); zeros of
    both signs; random blocks of several magnitudes."""
    g = torch.Generator().manual_seed(0)
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    tie = torch.tensor((mids * 12)[:k])
    tie[0::16] = 6.0  # each block's max: scale 1, total scale 1
    tie[1::2] *= -1
    top = torch.linspace(-2688, 2688, k)
    top[0] = 2688.0
    e4m3_tie = tie.clone()
    e4m3_tie[0::16] = 6.375  # 6.375 / 6 = 1.0625, between e4m3's 1.0 and 1.125: the even 1.0
    z = torch.zeros(k)
    z[1] = -0.0
    z[16:32] = torch.randn(16, generator=g) * 1e-4  # below 2^-6 * 6 * 2^-2: clamped scale
    z[48:] = -0.0
    rows = [top, tie, tie * 0.5, tie * 2.0 ** -4, e4m3_tie, z]
    rows += [torch.randn(k, generator=g) * 10.0 ** p for p in (-3, -1, 0, 2)]
    return torch.stack(rows).to(dtype)


# ---------------------------------------------------------------------- decode and encode, bit by bit
def test_every_e4m3_and_e2m1_code_decodes_as_the_spec_and_torch_say():
    codes = torch.arange(256, dtype=torch.uint8)
    want = torch.tensor([e4m3_value(c) for c in range(256)])
    assert torch.allclose(codes.view(E4M3).float(), want, rtol=0, atol=0, equal_nan=True)
    # The element table: one block, scale 1 (code 0x38), per-tensor scale 1.
    qdata = (torch.arange(16)[0::2] | (torch.arange(16)[1::2] << 4)).to(torch.uint8)
    got = nvfp4_dequantize(qdata[None], torch.tensor([[0x38]], dtype=torch.uint8).view(E4M3), torch.tensor(1.0),
                           torch.float32)[0]
    want = torch.tensor([e2m1_value(c) for c in range(16)])
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_quantize_matches_the_scalar_reference_bit_by_bit(dtype):
    w = tricky_weight(dtype)
    t = NVFP4Tensor.from_float(w)
    codes, scales, pts = ref_quantize(w)
    assert t.per_tensor_scale.dtype == torch.float32 and t.per_tensor_scale.item() == pts == 1.0
    assert t.scale.dtype == E4M3 and t.scale.view(torch.uint8).tolist() == scales
    assert element_codes(t) == codes
    assert torch.equal(t.dequantize(torch.float32), ref_values(codes, scales, pts))
    assert torch.equal(t.dequantize(), ref_values(codes, scales, pts).to(dtype))


@pytest.mark.parametrize("seed, scale", [(1, 1.0), (2, 1e-3), (3, 37.0)])
def test_random_weights_with_a_partial_last_block_match_the_reference(seed, scale):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(6, 72, generator=g) * scale).to(torch.bfloat16)  # 72 = 4 x 16 + 8
    t = NVFP4Tensor.from_float(w)
    codes, scales, pts = ref_quantize(w)
    assert t.scale.shape == (6, 5) and t.per_tensor_scale.item() == pts
    assert t.scale.view(torch.uint8).tolist() == scales and element_codes(t) == codes
    assert torch.equal(t.dequantize(torch.float32), ref_values(codes, scales, pts))
    assert t.dequantize().is_contiguous()


def test_the_corner_cases_are_really_exercised():
    # A reference that rounds ties away from zero (e2m1) or up (e4m3) disagrees on the tricky
    # weight, so the bit-by-bit test above tells the right rounding from a wrong one.
    w = tricky_weight(torch.float32)
    codes, scales, _ = ref_quantize(w)
    away, _, _ = ref_quantize(w, ties_e2m1=max)
    assert away != codes
    _, up, _ = ref_quantize(w, ties_e4m3=max)
    assert up != scales
    assert scales[4][0] == 0x38  # 1.0625 -> 1.0 (even), not 1.125
    assert 0x7E in scales[0] and 7 in codes[0]  # 448 and saturated elements
    assert 0x08 in scales[5] and codes[5][1] == 8  # the clamped 2^-6, and -0 keeps its sign


@pytest.mark.parametrize("mutant", ["ties_away", "truncate"])
def test_a_wrong_rounding_in_the_implementation_fails_the_comparison(mutant, monkeypatch):
    def ties_away(q):
        a = q.abs().clamp(max=6.0)
        mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        mids = (mags[1:] + mags[:-1]) / 2
        idx = torch.bucketize(a, mids, right=True)
        return (idx | (torch.signbit(q).to(idx.dtype) << 3)).to(torch.uint8)

    def truncate(q):
        a = q.abs().clamp(max=6.0)
        idx = torch.bucketize(a, torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]), right=True)
        return (idx | (torch.signbit(q).to(idx.dtype) << 3)).to(torch.uint8)

    w = tricky_weight(torch.float32)
    codes, _, _ = ref_quantize(w)
    assert element_codes(NVFP4Tensor.from_float(w)) == codes
    monkeypatch.setattr(nvfp4, "encode_e2m1", {"ties_away": ties_away, "truncate": truncate}[mutant])
    assert element_codes(NVFP4Tensor.from_float(w)) != codes


def test_bytes_are_torch_float4_e2m1fn_x2_and_float8_e4m3fn():
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1] = 1.0 * 2688 / 6, -6.0 * 2688 / 6  # amax 2688: p = 1, block scale 448
    t = NVFP4Tensor.from_float(w)
    assert t.qdata[0, 0].item() == (15 << 4) | 2  # 448 -> code 2 (1.0) low, -2688 -> 15 (-6) high
    assert t.qdata.view(FP4).dtype == FP4 and t.qdata.view(FP4).shape == (1, 8)
    assert t.scale.float().item() == 448.0 and t.scale.view(torch.uint8).item() == 0x7E


def test_all_zero_and_tiny_weights():
    z = torch.zeros(2, 32)
    z[1] = -0.0
    t = NVFP4Tensor.from_float(z)
    assert t.per_tensor_scale.item() == 2.0 ** -126
    assert t.scale.view(torch.uint8).unique().tolist() == [0x08]  # 2^-6
    assert element_codes(t) == [[0] * 32, [8] * 32]
    assert torch.equal(torch.signbit(t.dequantize()), torch.signbit(z))
    tiny = torch.randn(3, 32) * 1e-38
    codes, scales, pts = ref_quantize(tiny)
    t = NVFP4Tensor.from_float(tiny)
    assert pts == 2.0 ** -126 and t.per_tensor_scale.item() == pts
    assert t.scale.view(torch.uint8).tolist() == scales and element_codes(t) == codes


def test_quantize_in_row_chunks_gives_the_same_bits(monkeypatch):
    from hf_aoq.core import primitives

    w = torch.randn(64, 128, dtype=torch.bfloat16)
    whole = NVFP4Tensor.from_float(w)
    monkeypatch.setattr(primitives, "ROW_CHUNK_ELEMENTS", 128 * 5)
    chunked = NVFP4Tensor.from_float(w)
    assert torch.equal(whole.qdata, chunked.qdata) and torch.equal(whole.scale.view(torch.uint8), chunked.scale.view(torch.uint8))


# ---------------------------------------------------------------------- dynamic activations
def test_activations_are_quantized_in_the_same_blocks_with_their_own_per_tensor_scale():
    t = NVFP4Tensor.from_float(torch.randn(8, 80), "nvfp4")
    x = tricky_weight(torch.float32) * 0.01
    codes, scales, pts = ref_quantize(x)
    want = ref_values(codes, scales, pts)
    assert torch.equal(t.simulate_input_quantization(x), want)
    # The CPU GEMV (C++ activation quantization, the same values bit for bit) sums in its own
    # order: equal to the float product within float32 summation order.
    torch.testing.assert_close(F.linear(x, t), F.linear(want, t.dequantize()), rtol=1e-5, atol=1e-5)


def test_activation_blocks_with_inf_or_nan_decode_to_nan_and_leave_the_scale_alone():
    t = NVFP4Tensor.from_float(torch.randn(4, 32), "nvfp4")
    x = torch.randn(2, 32)
    x[0, 3], x[1, 20] = math.inf, math.nan
    assert per_tensor_scale_of(x).item() == per_tensor_scale_of(torch.where(x.isfinite(), x, 0)).item()
    q, s = nvfp4_quantize(x, per_tensor_scale_of(x))
    assert s.view(torch.uint8)[0, 0].item() == 0x7F and s.view(torch.uint8)[1, 1].item() == 0x7F
    sim = t.simulate_input_quantization(x)
    assert sim[0, :16].isnan().all() and sim[1, 16:].isnan().all()
    assert sim[0, 16:].isfinite().all() and sim[1, :16].isfinite().all()


def test_weight_only_leaves_activations_alone():
    t = NVFP4Tensor.from_float(torch.randn(8, 64))
    x = torch.randn(3, 64)
    assert t.simulate_input_quantization(x) is x
    # Equal to the float product on the decoded weight up to float32 summation order (the CPU GEMV
    # sums in its own order); NVFP4 activations would be off by ~10%.
    torch.testing.assert_close(F.linear(x, t), F.linear(x, t.dequantize()), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- 3-D weights
def test_expert_weights_quantize_per_expert_and_round_trip(tmp_path):
    w = torch.randn(3, 8, 64, dtype=torch.bfloat16) * torch.tensor([1.0, 10.0, 0.01])[:, None, None].to(torch.bfloat16)
    t = NVFP4Tensor.from_float(w, "nvfp4")
    assert t.shape == (3, 8, 64) and t.block_size == (1, 1, 16) and t.scale.shape == (3, 8, 4)
    assert t.per_tensor_scale.shape == (3,) and t.act_quant == "nvfp4"
    for e in range(3):
        codes, scales, pts = ref_quantize(w[e])
        assert t.per_tensor_scale[e].item() == pts and element_codes(t[e]) == codes
        assert t.scale[e].view(torch.uint8).tolist() == scales
        assert torch.equal(t.dequantize()[e], NVFP4Tensor.from_float(w[e]).dequantize())
    path = tmp_path / "experts.safetensors"
    serialization.save_file({"experts.gate_up_proj": t}, str(path))
    back = serialization.load_file(str(path))["experts.gate_up_proj"]
    assert isinstance(back, NVFP4Tensor) and back.act_quant == "nvfp4"
    for f in ("qdata", "scale", "per_tensor_scale"):
        assert torch.equal(bits(getattr(back, f)), bits(getattr(t, f))), f


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 16, 64))
        self.proj = nn.Linear(64, 16)

    def forward(self, x):  # x [2, T, 64]
        return torch.matmul(self.weight, x.transpose(1, 2)).transpose(1, 2) + self.proj(x)


def test_fqn_to_config_reaches_a_3d_parameter():
    m = Experts()
    quantize_(m, FqnToConfig({"weight": NVFP4WeightOnlyConfig()}))
    assert isinstance(m.weight, NVFP4Tensor) and m.weight.shape == (2, 16, 64)
    assert not isinstance(m.proj.weight, NVFP4Tensor)
    x = torch.randn(2, 3, 64)
    want = torch.matmul(m.weight.dequantize(), x.transpose(1, 2)).transpose(1, 2) + m.proj(x)
    assert torch.equal(m(x), want)


# ---------------------------------------------------------------------- configs and schemes
def test_configs_round_trip_through_strict_json():
    for cfg in (NVFP4InferenceConfig(), NVFP4InferenceConfig(mm_config="weight_only", use_triton_kernel=False),
                NVFP4WeightOnlyConfig()):
        d = recipe_to_dict(cfg)
        assert recipe_from_dict(d) == cfg and type(recipe_from_dict(d)) is type(cfg)
    recipe = FqnToConfig({"re:.*up_proj": NVFP4InferenceConfig(), "_default": NVFP4WeightOnlyConfig()})
    assert recipe_from_dict(recipe_to_dict(recipe)).mapping == recipe.mapping


def test_torchao_field_values_and_what_they_mean():
    assert NVFP4InferenceConfig().quantize_weight(torch.randn(4, 32)).act_quant == "nvfp4"
    assert NVFP4InferenceConfig(mm_config="weight_only").quantize_weight(torch.randn(4, 32)).act_quant is None
    assert NVFP4WeightOnlyConfig().quantize_weight(torch.randn(4, 32)).act_quant is None

    class NVFP4MMConfig:  # torchao's enum member, as an object with a .value
        value = "weight_only"

    assert NVFP4InferenceConfig(mm_config=NVFP4MMConfig()).mm_config == "weight_only"


def test_bad_configs_name_the_field_and_the_allowed_values():
    with pytest.raises(AOQError, match=r"NVFP4InferenceConfig.block_size must be 16.*32"):
        NVFP4InferenceConfig(block_size=32)
    with pytest.raises(AOQError, match=r"NVFP4WeightOnlyConfig.use_dynamic_per_tensor_scale must be True"):
        NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=False)
    with pytest.raises(AOQError, match=r"NVFP4InferenceConfig.mm_config must be one of \['dynamic', 'weight_only'\]"):
        NVFP4InferenceConfig(mm_config="static")
    with pytest.raises(AOQError, match=r"use_triton_kernel must be a bool"):
        NVFP4InferenceConfig(use_triton_kernel="yes")
    with pytest.raises(FormatError, match="block_size"):
        recipe_from_dict({"type": "NVFP4InferenceConfig", "block_size": 32})


def test_scheme_names():
    assert config_for_scheme("nvfp4") == NVFP4InferenceConfig()
    assert config_for_scheme("nvfp4-wo") == NVFP4WeightOnlyConfig()
    assert config_for_scheme("nvfp4-wo", 16) == NVFP4WeightOnlyConfig()
    with pytest.raises(AOQError, match="scheme nvfp4 has NVFP4 blocks of 16 only, got group size 32"):
        config_for_scheme("nvfp4", 32)


# ---------------------------------------------------------------------- bad input
def test_bad_weights_are_refused_with_clear_errors():
    with pytest.raises(AOQError, match="w: NVFP4 block_size must be 16"):
        NVFP4Tensor.from_float(torch.randn(4, 64), block_size=32, name="w")
    with pytest.raises(AOQError, match="w: NVFP4 .* needs an even input dimension"):
        NVFP4Tensor.from_float(torch.randn(4, 33), name="w")
    with pytest.raises(AOQError, match=r"w: cannot quantize a tensor with inf or nan \(1 such"):
        NVFP4Tensor.from_float(torch.tensor([[1.0, math.inf] + [0.0] * 14]), name="w")
    with pytest.raises(AOQError, match=r"w \(expert 1\): cannot quantize a tensor with inf or nan"):
        NVFP4Tensor.from_float(torch.stack([torch.ones(2, 16), torch.full((2, 16), math.nan)]), name="w")
    with pytest.raises(AOQError, match="2-D .* or 3-D"):
        NVFP4Tensor.from_float(torch.randn(64), name="w")
    with pytest.raises(AOQError, match="act_quant must be None or one of"):
        NVFP4Tensor.from_float(torch.randn(4, 64), "per_token", name="w")


@pytest.mark.parametrize("change, match", [
    (dict(scale=torch.zeros(4, 3, dtype=torch.uint8)), "field 'scale'"),
    (dict(scale=torch.zeros(4, 4)), "field 'scale'"),
    (dict(qdata=torch.zeros(4, 64, dtype=torch.uint8)), "field 'qdata'"),
    (dict(per_tensor_scale=torch.ones(1)), "field 'per_tensor_scale'"),
    (dict(per_tensor_scale=torch.ones((), dtype=torch.bfloat16)), "field 'per_tensor_scale'"),
    (dict(block_size=(1, 32)), "attribute 'block_size'"),
    (dict(act_quant="per_token"), "attribute 'act_quant'"),
    (dict(shape=(4, 63)), "attribute 'shape'|field"),
])
def test_loader_refuses_fields_that_contradict_the_attributes(change, match):
    t = NVFP4Tensor.from_float(torch.randn(4, 64))
    with pytest.raises(AOQError, match=match):
        NVFP4Tensor.check_fields(dict(t.fields(), **change))


# ---------------------------------------------------------------------- everywhere the other types go
def tiny_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32)).to(torch.bfloat16)


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4-wo"])
def test_quantize_save_reload_and_compile(scheme, tmp_path):
    m = tiny_mlp()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    quantize_(m, config_for_scheme(scheme))
    assert all(isinstance(m[i].weight, NVFP4Tensor) for i in (0, 2))
    eager = m(x)
    w0 = m[0].weight
    want0 = F.linear(w0.simulate_input_quantization(x), w0.dequantize(), m[0].bias)
    torch.testing.assert_close(m[0](x), want0, rtol=2e-2, atol=2e-2)  # the GEMV sums in float32
    path = tmp_path / "m.safetensors"
    serialization.save_file(m.state_dict(), str(path))
    sd = serialization.load_file(str(path))
    for name in ("0.weight", "2.weight"):
        a, b = m.state_dict()[name], sd[name]
        for f in ("qdata", "scale", "per_tensor_scale"):
            assert torch.equal(bits(getattr(a, f)), bits(getattr(b, f))), f
        assert a.attributes() == b.attributes()
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(x), eager, rtol=2e-2, atol=2e-2)


def test_embedding_rows_and_slices():
    w = torch.randn(10, 64)
    t = NVFP4Tensor.from_float(w)
    idx = torch.tensor([[3, 0], [9, 3]])
    assert torch.equal(F.embedding(idx, t), F.embedding(idx, t.dequantize()))
    assert torch.equal(t[2:5].dequantize(), t.dequantize()[2:5])
    assert torch.equal(t[:, 16:].dequantize(), t.dequantize()[:, 16:])
    with pytest.raises(AOQError, match="align"):
        t[:, 8:]


def test_from_pretrained_quantizes_on_load_and_reloads_bit_exact(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    config = hf_aoq.AOQConfig(quant_type=NVFP4InferenceConfig())
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config)
    w = model.model.layers[0].mlp.up_proj.weight
    assert isinstance(w, NVFP4Tensor) and w.act_quant == "nvfp4"
    ids = torch.tensor([[3, 4, 5, 6]])
    logits = model(ids).logits
    model.save_pretrained(tmp_path / "nvfp4")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "nvfp4")
    w2 = again.model.layers[0].mlp.up_proj.weight
    assert isinstance(w2, NVFP4Tensor) and torch.equal(w2.qdata, w.qdata)
    assert torch.equal(w2.scale.view(torch.uint8), w.scale.view(torch.uint8))
    assert torch.equal(w2.per_tensor_scale, w.per_tensor_scale)
    assert torch.equal(again(ids).logits, logits)


def test_cli_quantize_and_inspect(tiny_llama_dir, tmp_path, capsys):
    from hf_aoq import cli

    out = tmp_path / "nvfp4"
    assert cli.main(["quantize", str(tiny_llama_dir), "--scheme", "nvfp4", "--out", str(out)]) == 0
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^model.layers.0.mlp.up_proj.weight\s+nvfp4 e2m1 g16 dyn-act nvfp4\s+256x128\s", text, re.M), text
    assert text.rstrip().endswith("every tensor loads: yes")
    card = (out / "README.md").read_text()  # the model card names how the layers are stored
    assert re.search(r"\| `model.layers.\*.mlp.up_proj` \| \d+ \| nvfp4 e2m1 g16 dyn-act nvfp4 \|", card), card
