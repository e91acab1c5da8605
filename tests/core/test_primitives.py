import pytest
import torch

import hf_aoq
from hf_aoq import AOQError, PerGroup, PerRow, PerTensor
from hf_aoq.core.primitives import (
    FLOAT8_DTYPES,
    choose_qparams_affine,
    choose_scale_float8,
    dequantize_affine,
    dequantize_float8,
    pack_int4,
    quantize_affine,
    quantize_float8,
    unpack_int4,
)

from conftest import sqnr


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("granularity", [PerTensor(), PerRow(), PerGroup(32)])
def test_int4_affine_roundtrip(symmetric, granularity):
    torch.manual_seed(0)
    x = torch.randn(16, 128)
    block = granularity.block_size(tuple(x.shape))
    scale, zero = choose_qparams_affine(x, block, 0, 15, symmetric=symmetric, param_dtype=torch.float32)
    assert (zero is None) == symmetric
    q = quantize_affine(x, block, scale, zero, 0, 15, torch.uint8)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    y = dequantize_affine(q, block, scale, zero, 0, 15, torch.float32)
    # Per-element error is at most half a step: nothing is clipped.
    step = dequantize_affine(torch.full_like(q, 9), block, scale, zero, 0, 15, torch.float32) - dequantize_affine(
        torch.full_like(q, 8), block, scale, zero, 0, 15, torch.float32
    )
    limit = step * 0.5 + 1e-6
    assert bool(((x - y).abs() <= limit).all())
    expected = {PerTensor: 10, PerRow: 12, PerGroup: 14}[type(granularity)]
    assert sqnr(x, y) > expected


def test_asymmetric_reproduces_a_grid_exactly():
    # Values that already lie on a 16-level grid per group (like GGUF Q4_1) come back exactly.
    torch.manual_seed(0)
    d = torch.rand(8, 4, 1) + 0.1
    m = torch.randn(8, 4, 1)
    codes = torch.randint(0, 16, (8, 4, 32)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # every group spans the full grid
    x = (codes * d + m).reshape(8, 128)
    block = (1, 32)
    scale, zero = choose_qparams_affine(x, block, 0, 15, symmetric=False, param_dtype=torch.float32)
    q = quantize_affine(x, block, scale, zero, 0, 15, torch.uint8)
    assert torch.equal(q.reshape(8, 4, 32).float(), codes)
    assert torch.allclose(dequantize_affine(q, block, scale, zero, 0, 15, torch.float32), x, atol=1e-5)


def test_all_zero_and_constant_groups_are_finite():
    x = torch.zeros(4, 64)
    x[1] = 3.0
    x[2, :32] = -2.0
    for symmetric in (False, True):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            scale, zero = choose_qparams_affine(x, (1, 32), 0, 15, symmetric=symmetric, param_dtype=dtype)
            assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
            q = quantize_affine(x, (1, 32), scale, zero, 0, 15, torch.uint8)
            y = dequantize_affine(q, (1, 32), scale, zero, 0, 15, torch.float32)
            assert bool(torch.isfinite(y).all())
            # bf16/fp16 scales round, so allow one part in 2**7 of the largest value.
            assert torch.allclose(y, x, atol=3.0 / 128), (symmetric, dtype)
    s8 = choose_scale_float8(torch.zeros(4, 16), (1, 16), torch.float8_e4m3fn)
    assert bool(torch.isfinite(s8).all()) and bool((s8 > 0).all())
    q8 = quantize_float8(torch.zeros(4, 16), (1, 16), s8, torch.float8_e4m3fn)
    assert bool((dequantize_float8(q8, (1, 16), s8, torch.float32) == 0).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_a_clear_error(bad):
    x = torch.randn(4, 64)
    x[2, 5] = bad
    with pytest.raises(AOQError, match="my.weight.*inf or nan"):
        choose_qparams_affine(x, (1, 32), 0, 15, symmetric=False, param_dtype=torch.float32, name="my.weight")
    with pytest.raises(AOQError, match="inf or nan"):
        choose_scale_float8(x, (1, 64), torch.float8_e4m3fn)


def test_block_size_must_divide_all_but_the_last_dim():
    with pytest.raises(AOQError, match="does not divide dimension 0"):
        choose_qparams_affine(torch.randn(6, 64), (4, 32), 0, 15, symmetric=False, param_dtype=torch.float32)
    with pytest.raises(AOQError, match="does not divide"):
        PerGroup(32).block_size((4, 60))


@pytest.mark.parametrize("symmetric", [False, True])
def test_partial_last_block_is_a_block_of_its_own(symmetric):
    """K = 60 in groups of 32: one whole group and one of 28, each quantized on its own."""
    torch.manual_seed(0)
    x = torch.randn(4, 60)
    kw = dict(symmetric=symmetric, param_dtype=torch.float32)
    scale, zero = choose_qparams_affine(x, (1, 32), 0, 15, **kw)
    assert scale.shape == (4, 2)
    s0, z0 = choose_qparams_affine(x[:, :32], (1, 32), 0, 15, **kw)
    s1, z1 = choose_qparams_affine(x[:, 32:], (1, 28), 0, 15, **kw)
    assert torch.equal(scale, torch.cat([s0, s1], 1))
    if not symmetric:
        assert torch.equal(zero, torch.cat([z0, z1], 1))
    q = quantize_affine(x, (1, 32), scale, zero, 0, 15, torch.uint8)
    assert q.shape == x.shape
    assert torch.equal(q[:, 32:], quantize_affine(x[:, 32:], (1, 28), s1, z1, 0, 15, torch.uint8))
    y = dequantize_affine(q, (1, 32), scale, zero, 0, 15, torch.float32)
    assert torch.equal(y[:, 32:], dequantize_affine(q[:, 32:], (1, 28), s1, z1, 0, 15, torch.float32))
    assert sqnr(x, y) > 18
    # A group longer than the whole row is one partial group.
    scale, _ = choose_qparams_affine(x, (1, 128), 0, 15, **kw)
    assert scale.shape == (4, 1)


@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("granularity", [PerTensor(), PerRow()])
def test_float8_roundtrip(f8, granularity):
    torch.manual_seed(0)
    x = torch.randn(32, 64) * 5
    block = granularity.block_size(tuple(x.shape))
    scale = choose_scale_float8(x, block, f8)
    q = quantize_float8(x, block, scale, f8)
    assert q.dtype == f8
    y = dequantize_float8(q, block, scale, torch.float32)
    assert sqnr(x, y) > (28 if f8 == torch.float8_e4m3fn else 22)
    # The abs-max element maps to the top of the float8 range and back exactly.
    i = x.abs().argmax()
    assert torch.isclose(y.flatten()[i], x.flatten()[i], rtol=1e-6)


def test_float8_rejects_other_dtypes():
    with pytest.raises(AOQError, match="unsupported float8 dtype"):
        choose_scale_float8(torch.randn(2, 2), (1, 2), torch.float16)


def test_pack_int4_layout():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.tolist() == [[0x21, 0x0F]]  # low nibble = even column
    assert torch.equal(unpack_int4(packed), q)
    with pytest.raises(AOQError, match="odd"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


@pytest.mark.parametrize(
    "make",
    [
        lambda w: hf_aoq.Int4Tensor.from_float(w, 128, qparams="mse"),
        lambda w: hf_aoq.Int4Tensor.from_float(w, 64, symmetric=True),
        lambda w: hf_aoq.Int8Tensor.from_float(w),
        lambda w: hf_aoq.Int8Tensor.from_float(w, 64),
        lambda w: hf_aoq.Float8Tensor.from_float(w),
    ],
    ids=["int4-mse", "int4-sym", "int8-row", "int8-g64", "fp8-row"],
)
def test_quantizing_in_row_chunks_changes_nothing(make, monkeypatch):
    # from_float takes the rows in chunks to bound its temporaries; with 37 rows per chunk the
    # last chunk is short, and every field must equal the one-piece result bit for bit.
    from hf_aoq.core import primitives

    torch.manual_seed(0)
    w = torch.randn(300, 576, dtype=torch.bfloat16) * torch.linspace(0.1, 3, 300, dtype=torch.bfloat16)[:, None]
    whole = make(w)
    monkeypatch.setattr(primitives, "ROW_CHUNK_ELEMENTS", 37 * 576)
    chunked = make(w)
    a, b = whole.tensor_fields(), chunked.tensor_fields()
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if x.dtype in FLOAT8_DTYPES:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), k


# ---------------------------------------------------------------------- extreme finite weights
_EXTREME_MAKERS = {
    "int4 minmax": lambda w, name: hf_aoq.Int4Tensor.from_float(w, 32, qparams="minmax", name=name),
    "int4 minmax sym": lambda w, name: hf_aoq.Int4Tensor.from_float(w, 32, True, qparams="minmax", name=name),
    "int4 mse": lambda w, name: hf_aoq.Int4Tensor.from_float(w, 32, qparams="mse", name=name),
    "int4 mse sym": lambda w, name: hf_aoq.Int4Tensor.from_float(w, 32, True, qparams="mse", name=name),
    "int4dq": lambda w, name: hf_aoq.Int4DQTensor.from_float(w, 32, name=name),
    "int8": lambda w, name: hf_aoq.Int8Tensor.from_float(w, name=name),
    "intx3 mse": lambda w, name: hf_aoq.IntxTensor.from_float(w, 3, 32, name=name),
    "intx4 mse asym": lambda w, name: hf_aoq.IntxTensor.from_float(w, 4, 32, False, name=name),
    "intx6 minmax asym row": lambda w, name: hf_aoq.IntxTensor.from_float(w, 6, None, False, qparams="minmax", name=name),
    "int8 g32": lambda w, name: hf_aoq.Int8Tensor.from_float(w, 32, name=name),
    "fp8": lambda w, name: hf_aoq.Float8Tensor.from_float(w, name=name),
    "fp8 per tensor": lambda w, name: hf_aoq.Float8Tensor.from_float(w, granularity=PerTensor(), name=name),
}


def _extreme(dtype, case):
    top = torch.finfo(dtype).max
    w = torch.randn(16, 64).to(dtype)
    if case == "one group +-max":
        w[0, 0], w[0, 1] = top, -top
    elif case == "a row at max":
        w[1] = top
    elif case == "all +-max":
        w[:] = top
        w[:, ::2] = -top
    return w


@pytest.mark.parametrize("make", sorted(_EXTREME_MAKERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["one group +-max", "a row at max", "all +-max"])
def test_extreme_finite_weights_give_finite_tensors_or_a_clear_error(make, dtype, case, tmp_path):
    # Before: +-3e38 in one group made int4 (asymmetric) and int4dq scales inf and rows NaN,
    # fp16 +-65504 with int4 minmax dequantized to inf, and save_file wrote an int4dq tensor
    # that load_file refused.
    w = _extreme(dtype, case)
    try:
        q = _EXTREME_MAKERS[make](w, "layers.0.up.weight")
    except AOQError as e:
        assert str(e).startswith("layers.0.up.weight: ") and dtype != torch.float16, str(e)
        return
    for t in q.tensor_fields().values():
        assert t.element_size() == 1 or bool(torch.isfinite(t).all())
    assert bool(torch.isfinite(q.dequantize()).all())
    path = str(tmp_path / "w.safetensors")
    hf_aoq.serialization.save_file({"w": q}, path)
    assert torch.equal(hf_aoq.serialization.load_file(path)["w"].dequantize(), q.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_near_the_dtype_maximum_are_still_quantized(dtype):
    # Only weights within reach of the float32 limit itself may be refused: a weight at 1e37,
    # or at fp16's maximum, is quantized by every scheme, within its usual error.
    top = 65504.0 if dtype == torch.float16 else 1e37
    w = torch.randn(16, 64).to(dtype)
    w[0, :4] = torch.tensor([top, -top, top / 2, 0.0], dtype=dtype)
    w[1] = top
    for make in _EXTREME_MAKERS.values():
        deq = make(w, "w").dequantize().float()
        assert bool(torch.isfinite(deq).all())
        assert float((deq[:2] - w[:2].float()).abs().max()) < 0.2 * top
