"""Int4DQTensor: quantization, the format's decoding, slicing and gathers, placement, checks."""
import pytest
import torch
import torch.nn.functional as F

import hf_aoq
from hf_aoq import AOQError, Int4DQTensor, Int4DQWeightOnlyConfig, Int4Tensor, kernels
from hf_aoq.configs import recipe_from_dict, recipe_to_dict
from hf_aoq.kernels import cpu, cpu_ext
from hf_aoq.tensors import int4dq


def weight(n=64, k=576, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Rows and columns of different magnitudes, as in real weights.
    scale = torch.rand(n, 1, generator=g) * torch.rand(1, k, generator=g) + 0.05
    return (torch.randn(n, k, generator=g) * scale * 0.05).to(dtype)


def rel_mse(w, deq):
    return float((deq.float() - w.float()).pow(2).mean() / w.float().pow(2).mean())


def bits_per_weight(q):
    return 8 * sum(t.numel() * t.element_size() for t in q.to_canonical().tensor_fields().values()) / q.numel()


def test_more_accurate_than_int4_g128_at_about_its_size():
    w = weight()
    q = Int4DQTensor.from_float(w)
    g128 = Int4Tensor.from_float(w, 128, qparams="mse")
    g32 = Int4Tensor.from_float(w, 32, qparams="mse")
    assert bits_per_weight(q) == pytest.approx(4 + 8 / 32 + 32 / 576 + 64 / w.numel())
    assert bits_per_weight(q) < bits_per_weight(g128) + 0.04
    assert rel_mse(w, q.dequantize()) < 0.75 * rel_mse(w, g128.dequantize())
    assert rel_mse(w, q.dequantize()) < 1.1 * rel_mse(w, g32.dequantize())  # at 5 bits per weight


def test_a_q4_1_grid_of_32_is_nearly_kept():
    # Weights that are exactly q * d + m per group of 32 (as SmolLM2's, from a Q4_1 GGUF): the
    # 4-bit indices into each row's grid cannot hold every group's d and m, but come close
    # (measured: 0.17x Int4 g128's error, with d spread over a factor of 6 in each row).
    g = torch.Generator().manual_seed(1)
    n, k = 32, 256
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 0.002
    m = -8 * d + torch.randn(n, k // 32, 1, generator=g) * 0.001
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    w = (q * d + m).reshape(n, k)
    deq = Int4DQTensor.from_float(w).dequantize()
    assert rel_mse(w, deq) < 0.25 * rel_mse(w, Int4Tensor.from_float(w, 128).dequantize())


def test_decoding_follows_the_format():
    """decode_row_params against a scalar reading of docs/format.md, for every code."""
    tparams = torch.tensor([0.75, 0.3125])
    codes = torch.arange(256, dtype=torch.uint8)
    rparams = torch.stack([codes, codes.flip(0), codes, codes.flip(0)], dim=1)
    got = int4dq.decode_row_params(rparams, tparams)

    def dval(k):
        return 0.0 if k == 255 else float(torch.tensor(0.75) * int4dq.LUT[k % 32]) * 2.0 ** -(k // 32)

    def cval(k):
        m = k & 127
        if m == 127:
            return 0.0
        v = float(torch.tensor(0.3125) * int4dq.LUT[2 * (m % 16)]) * 2.0 ** -(m // 16)
        return -v if k >> 7 else v

    for row in range(256):
        dlo, dhi, clo, chi = (int(v) for v in rparams[row])
        d_lo, d_hi, c_lo, c_hi = (torch.tensor(v, dtype=torch.float32) for v in (dval(dlo), dval(dhi), cval(clo), cval(chi)))
        expected = torch.stack([d_lo, (d_hi - d_lo) / 15, c_lo, (c_hi - c_lo) / 15])
        assert torch.equal(got[row], expected), row
    assert int4dq.LUT[0] == 1 and int4dq.LUT.dtype == torch.float32


@pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's CPU extension is not built here")
def test_the_kernels_decode_rows_as_python_does():
    tparams = torch.tensor([0.0421, 1.7e-3])
    codes = torch.arange(256, dtype=torch.uint8)
    rparams = torch.stack([codes, codes.roll(7), codes.roll(100), codes.roll(3)], dim=1)
    assert torch.equal(cpu_ext.load().int4dq_row_params(rparams, tparams), int4dq.decode_row_params(rparams, tparams))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,g", [(48, 576, 32), (32, 80, 32), (16, 200, 64)])
def test_placed_linear_matches_the_reference(dtype, n, k, g):
    """The CPU packing's kernel (few rows and many) against dequantize + F.linear; K = 80 and 200
    end in partial groups, 48 rows end in a 16-row block."""
    w = weight(n, k, dtype)
    q = Int4DQTensor.from_float(w, g)
    placed = q.place()
    reference = kernels.kernels_for("linear", "Int4DQTensor")[-1]
    if cpu_ext.available():
        assert placed.packing == "cpu_int4dq"
    back = placed.to_canonical()
    for name, t in q.tensor_fields().items():
        assert torch.equal(back.tensor_fields()[name], t), name
    bias = torch.randn(n, dtype=dtype)
    for m in (1, 5, 70):
        x = torch.randn(2, m, k, dtype=dtype)
        y = F.linear(x, placed, bias)
        assert y.dtype == dtype and y.shape == (2, m, n)
        expected = reference.fn(x.float(), q, bias.float())
        assert float((y.float() - expected).norm() / expected.norm()) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_rows_slices_and_embedding_lookups():
    w = weight(64, 576)
    q = Int4DQTensor.from_float(w)
    full = q.dequantize()
    assert torch.equal(q[8:24].dequantize(), full[8:24])
    assert torch.equal(q[:, 64:160].dequantize(), full[:, 64:160])
    assert torch.equal(q[:, 544:].dequantize(), full[:, 544:])
    with pytest.raises(AOQError, match="align with its groups of 32"):
        q[:, 10:64]
    ids = torch.tensor([[3, 60], [0, 3]])
    assert torch.equal(F.embedding(ids, q), full[ids])
    assert torch.equal(F.embedding(ids, q.place()), full[ids])


def test_degenerate_weights():
    zero = Int4DQTensor.from_float(torch.zeros(16, 64))
    assert torch.equal(zero.dequantize(), torch.zeros(16, 64))
    const = torch.full((16, 64), 0.25)
    assert torch.allclose(Int4DQTensor.from_float(const).dequantize(), const, rtol=0.05)
    spiky = torch.zeros(16, 64)
    spiky[3, 5] = 100.0
    deq = Int4DQTensor.from_float(spiky).dequantize()
    assert torch.isfinite(deq).all() and abs(float(deq[3, 5]) - 100) < 5
    bad = torch.ones(16, 64)
    bad[1, 1] = float("nan")
    with pytest.raises(AOQError, match="inf or nan"):
        Int4DQTensor.from_float(bad, name="layers.0.w")
    with pytest.raises(AOQError, match="even, non-empty input dimension"):
        Int4DQTensor.from_float(torch.ones(16, 63))
    with pytest.raises(AOQError, match="group_size must be one of"):
        Int4DQTensor.from_float(torch.ones(16, 64), 128)


@pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's CPU extension is not built here")
@pytest.mark.parametrize(
    "shape, g, dtype",
    [((200, 2048), 32, torch.bfloat16), ((64, 1000), 64, torch.float32), ((48, 70), 32, torch.float16), ((16, 2), 32, torch.float32)],
)
def test_cpp_search_chooses_as_the_torch_search(shape, g, dtype, monkeypatch):
    """The quantizer's C++ search (int4dq_search) and its torch version pick the same scale and
    centre indices and codes: rows of very different ranges, zero rows, constant rows, a partial
    last group."""
    torch.manual_seed(0)
    w = torch.randn(*shape) * torch.logspace(-4, 1, shape[0])[:, None]
    w[1] = 0.0
    w[2] = 0.3
    w = w.to(dtype)
    fast = Int4DQTensor.from_float(w, g)
    monkeypatch.setattr(cpu_ext, "load", lambda: None)
    slow = Int4DQTensor.from_float(w, g)
    for name in ("qdata", "gparams", "rparams", "tparams"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name


def test_quantizes_a_strided_weight():
    """A column slice of a wider float32 matrix (not contiguous) quantizes as its copy does."""
    wide = torch.randn(32, 256)
    q = Int4DQTensor.from_float(wide[:, :128])
    assert torch.equal(q.dequantize(), Int4DQTensor.from_float(wide[:, :128].contiguous()).dequantize())


def _fields(q):
    return {**q.tensor_fields(), **q.attributes()}


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda f: f.update(gparams=f["gparams"][:, :-1]), "field 'gparams'"),
        (lambda f: f.update(rparams=f["rparams"].to(torch.int16)), "field 'rparams'"),
        (lambda f: f.update(tparams=torch.tensor([0.5, 0.0])), "two finite positive numbers"),
        (lambda f: f.update(tparams=torch.tensor([0.5, float("inf")])), "two finite positive numbers"),
        (lambda f: f.update(block_size=(1, 128)), "attribute 'block_size'"),
        (lambda f: f.update(qdata=f["qdata"][:, :-1]), "field 'qdata'"),
        (lambda f: f.update(packing="cpu_int4dq"), "canonical layout only"),
    ],
)
def test_check_fields_refuses_contradictions(change, match):
    fields = _fields(Int4DQTensor.from_float(weight(16, 96)))
    change(fields)
    with pytest.raises(AOQError, match=match):
        Int4DQTensor.check_fields(fields)


def test_config_round_trips_as_json():
    recipe = Int4DQWeightOnlyConfig(group_size=64)
    assert recipe_from_dict(recipe_to_dict(recipe)) == recipe
    with pytest.raises(AOQError, match="group_size must be one of"):
        Int4DQWeightOnlyConfig(group_size=128)
    assert isinstance(Int4DQWeightOnlyConfig().quantize_weight(weight(16, 64)), Int4DQTensor)


def test_a_weight_at_the_float32_limit_is_refused_when_quantized_not_when_loaded(tmp_path):
    # Before: T_d overflowed to inf, the rows dequantized to NaN, and save_file wrote what
    # load_file then refused ("field 'tparams': [inf, ...]").
    w = torch.randn(16, 64)
    w[0, 0], w[0, 1] = 3e38, -3e38
    with pytest.raises(AOQError, match=r"^layers.0.w: .*tparams"):
        Int4DQTensor.from_float(w, name="layers.0.w")
    # fp16's maximum is within reach: quantized, finite, and loads back.
    h = torch.randn(16, 64).half()
    h[0, 0], h[0, 1], h[1] = 65504, -65504, 65504
    q = Int4DQTensor.from_float(h)
    assert torch.isfinite(q.dequantize()).all()
    path = str(tmp_path / "w.safetensors")
    hf_aoq.serialization.save_file({"w": q}, path)
    assert torch.equal(hf_aoq.serialization.load_file(path)["w"].dequantize(), q.dequantize())
