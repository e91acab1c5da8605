"""Int4Tensor, Int8Tensor, Float8Tensor: numerics, every kernel against the reference, ops."""
import pytest
import torch
import torch.nn.functional as F

from hf_aoq import (
    AOQError,
    Float8DynamicActivationFloat8WeightConfig,
    Float8Tensor,
    Float8WeightOnlyConfig,
    Int4Tensor,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8Tensor,
    Int8WeightOnlyConfig,
    PerRow,
    PerTensor,
    kernels,
)

from conftest import cpu_int4_packing, sqnr

# Weight SQNR floors on N(0, 1) weights (seeded), in dB: the measured values less about 1 dB,
# so a regression in parameter choice fails. Uniform quantization gains ~6 dB per bit.
CONFIGS = [
    (Int4WeightOnlyConfig(32), 21.0),
    (Int4WeightOnlyConfig(64), 20.0),
    (Int4WeightOnlyConfig(128), 19.0),
    (Int4WeightOnlyConfig(256), 18.2),
    (Int4WeightOnlyConfig(128, symmetric=True), 18.0),
    (Int8WeightOnlyConfig(), 41.3),
    (Int8WeightOnlyConfig(group_size=64), 43.3),
    (Int8DynamicActivationInt8WeightConfig(), 41.3),
    (Float8WeightOnlyConfig(), 30.5),
    (Float8WeightOnlyConfig(torch.float8_e5m2), 24.6),
    (Float8WeightOnlyConfig(granularity=PerTensor()), 30.5),
    (Float8DynamicActivationFloat8WeightConfig(), 30.5),
    (Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()), 30.5),
    (Float8DynamicActivationFloat8WeightConfig(torch.float8_e5m2, torch.float8_e5m2), 24.6),
]
IDS = [f"{type(c).__name__}-{i}" for i, (c, _) in enumerate(CONFIGS)]


@pytest.fixture(scope="module")
def weight():
    torch.manual_seed(0)
    return torch.randn(256, 512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config,floor", CONFIGS, ids=IDS)
def test_weight_sqnr(config, floor, weight, dtype):
    w = weight.to(dtype)
    q = config.quantize_weight(w)
    assert q.shape == w.shape and q.dtype == dtype
    dq = q.dequantize()
    assert dq.dtype == dtype and type(dq) is torch.Tensor
    assert sqnr(w, dq) > floor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config,floor", CONFIGS, ids=IDS)
def test_linear_against_float_and_every_kernel_against_reference(config, floor, weight, dtype):
    torch.manual_seed(1)
    w = weight.to(dtype)
    bias = torch.randn(256, dtype=dtype)
    q = config.quantize_weight(w).place()
    for shape in [(1, 512), (3, 7, 512)]:
        x = torch.randn(*shape, dtype=dtype)
        y = F.linear(x, q, bias)
        assert y.shape == (*shape[:-1], 256) and y.dtype == dtype
        # Against the float layer: dynamic activation quantization costs a few dB more.
        assert sqnr(F.linear(x, w, bias), y) > floor - 4
        ran = 0
        reference = kernels.kernels_for("linear", type(q).__name__)[-1]
        assert reference.name == "reference"
        expected = reference.fn(x, q, bias)
        for kernel in kernels.kernels_for("linear", type(q).__name__):
            if kernel.applies(x, q):
                # Fast kernels accumulate differently; 40 dB is 1% RMS error relative to the output.
                assert sqnr(expected, kernel.fn(x, q, bias)) > (40 if dtype == torch.bfloat16 else 60), kernel.name
                ran += 1
        assert ran >= 1


@pytest.mark.parametrize("k,g", [(576, 128), (96, 64), (48, 128), (320, 256)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_partial_last_group(k, g, symmetric):
    """K not a multiple of the group size: the last group is partial, the packings pad it and
    every kernel agrees with the reference; packing, slicing and lookup stay exact."""
    torch.manual_seed(0)
    w = torch.randn(32, k, dtype=torch.bfloat16)
    q = Int4Tensor.from_float(w, g, symmetric)
    groups = -(-k // g)
    assert q.scale.shape == (32, groups) and q.qdata.shape == (32, k // 2)
    full = q.dequantize()
    assert sqnr(w, full) > 18
    # The last group is quantized on its own, exactly as a tensor of just those columns.
    tail = (groups - 1) * g
    alone = Int4Tensor.from_float(w[:, tail:], g, symmetric)
    assert torch.equal(full[:, tail:], alone.dequantize())
    assert torch.equal(q[:, tail:].dequantize(), full[:, tail:])
    placed = q.place()
    assert placed.packing == cpu_int4_packing()
    # aten's packing and kernel too: the fallback where hf_aoq's extension does not build.
    aten_packed = kernels.get_packing("cpu_int4pack").pack(q)
    for p in (placed, aten_packed):
        back = p.to_canonical()
        for name, t in q.tensor_fields().items():
            assert torch.equal(t, getattr(back, name)), (p.packing, name)
    for shape in [(1, k), (3, 5, k)]:
        x = torch.randn(*shape, dtype=torch.bfloat16)
        expected = kernels.kernels_for("linear", "Int4Tensor")[-1].fn(x, q, None)
        for p in (placed, aten_packed):
            # Every CPU kernel for the packing (hf_aoq's own for its pairs layout, aten's for its own).
            fast = [kn for kn in kernels.kernels_for("linear", "Int4Tensor") if kn.backend == "cpu" and kn.applies(x, p)]
            assert [kn.name for kn in fast] == [{"cpu_int4_pairs": "cpu_int4_ext", "cpu_int4pack": "cpu_int4pack_mm"}[p.packing]]
            assert kernels.select_kernel("linear", x, p) is fast[0]
            assert sqnr(expected, fast[0].fn(x, p, None)) > 40, p.packing
            assert sqnr(expected, F.linear(x, p)) > 40
    idx = torch.tensor([0, 31, 7])
    assert torch.equal(F.embedding(idx, q), full[idx])
    with pytest.raises(AOQError, match="align with its block size"):
        q[:, : tail + 2]


@pytest.mark.parametrize("config", [Int4WeightOnlyConfig(32), Int8WeightOnlyConfig(), Float8WeightOnlyConfig()])
def test_embedding_lookup(config):
    torch.manual_seed(0)
    table = torch.randn(100, 64, dtype=torch.bfloat16)
    q = config.quantize_weight(table)
    idx = torch.tensor([[0, 5, 99], [5, 5, 1]])
    out = F.embedding(idx, q)
    assert out.shape == (2, 3, 64) and out.dtype == torch.bfloat16
    assert torch.equal(out, F.embedding(idx, q.dequantize()))
    assert kernels.select_kernel("embedding", idx, q).name == "rowgather"
    # A packed int4 table still looks up correctly, through the reference kernel.
    if isinstance(q, Int4Tensor):
        assert torch.equal(F.embedding(idx, q.place()), out)


@pytest.mark.parametrize("config", [Int4WeightOnlyConfig(32), Int8WeightOnlyConfig(), Int8WeightOnlyConfig(32),
                                    Float8WeightOnlyConfig(), Float8WeightOnlyConfig(granularity=PerTensor())])
def test_slice_and_narrow_both_dims(config):
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    q = config.quantize_weight(w).place()
    full = q.dequantize()
    for sl in [(slice(16, 48), slice(None)), (slice(None), slice(32, 96)), (slice(8, 24), slice(64, 128))]:
        part = q[sl]
        assert type(part) is type(q) and part.shape == full[sl].shape
        assert torch.equal(part.dequantize(), full[sl])
    assert torch.equal(q.narrow(1, 0, 64).dequantize(), full[:, :64])
    assert torch.equal(q.narrow(0, 32, 32).dequantize(), full[32:])


def test_slice_that_splits_a_group_is_an_error():
    q = Int4Tensor.from_float(torch.randn(8, 128), 64)
    with pytest.raises(AOQError, match="align with its block size 64"):
        q[:, 10:70]
    with pytest.raises(AOQError, match="step 1"):
        q[::2]


@pytest.mark.parametrize("config", [Int4WeightOnlyConfig(32), Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig(),
                                    Float8WeightOnlyConfig(), Float8DynamicActivationFloat8WeightConfig()])
def test_mm_addmm_matmul_with_quantized_weight(config):
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    b = torch.randn(32)
    q = config.quantize_weight(w).place()
    x = torch.randn(4, 64)
    expected = F.linear(x, q, b)
    expected_nobias = F.linear(x, q)
    if isinstance(q, Int4Tensor):
        with pytest.raises(NotImplementedError, match="Int4Tensor does not support the op aten.t"):
            q.t()
        # As the right operand, an int4 weight is used as the matrix it stands for.
        assert torch.allclose(torch.matmul(x[:, :32], q), x[:, :32] @ q.dequantize(), atol=1e-5)
        return
    qt = q.t()
    assert qt.shape == (64, 32) and type(qt) is type(q)
    assert torch.allclose(torch.mm(x, qt), expected_nobias, atol=1e-5)
    assert torch.allclose(x @ qt, expected_nobias, atol=1e-5)
    assert torch.allclose(torch.matmul(x.unsqueeze(0), qt), expected_nobias.unsqueeze(0), atol=1e-5)
    assert torch.allclose(torch.addmm(b, x, qt), expected, atol=1e-5)
    assert torch.equal(qt.t().dequantize(), q.dequantize())


def test_from_float_bad_input_errors():
    w = torch.randn(16, 96)
    with pytest.raises(AOQError, match="layer.weight: int4 needs an even input dimension"):
        Int4Tensor.from_float(torch.randn(16, 95), 64, name="layer.weight")
    with pytest.raises(AOQError, match="must be one of"):
        Int4Tensor.from_float(w, 48)
    with pytest.raises(AOQError, match="must be one of"):
        Int4WeightOnlyConfig(group_size=100)
    w_nan = w.clone()
    w_nan[0, 0] = float("nan")
    for cfg in (Int4WeightOnlyConfig(32), Int8WeightOnlyConfig(), Float8WeightOnlyConfig()):
        with pytest.raises(AOQError, match="layer.weight: cannot quantize a tensor with inf or nan"):
            cfg.quantize_weight(w_nan, name="layer.weight")
    with pytest.raises(AOQError, match="expected a float32, bfloat16 or float16 weight, got torch.int32"):
        Int8Tensor.from_float(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(AOQError, match="2-D"):
        Float8Tensor.from_float(torch.randn(4))
    with pytest.raises(AOQError, match=r"weight_dtype must be one of .*got torch.float16"):
        Float8WeightOnlyConfig(weight_dtype=torch.float16)
    with pytest.raises(AOQError, match="unsupported float8 dtype"):
        Float8Tensor.from_float(w, torch.float16)
    with pytest.raises(AOQError, match="already quantized"):
        Int8Tensor.from_float(Int8Tensor.from_float(w))
    with pytest.raises(AOQError, match="per-row weight scale"):
        Int8Tensor.from_float(w, 32, act_quant="per_token")


def test_dtype_change_is_honoured():
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    for q in (Int4Tensor.from_float(w, 32).place(), Int8Tensor.from_float(w), Float8Tensor.from_float(w)):
        f32 = q.to(torch.float32)
        assert f32.dtype == torch.float32 and type(f32) is type(q)
        assert torch.equal(f32.dequantize(), q.dequantize(torch.float32))
        x = torch.randn(2, 64)
        assert F.linear(x, f32).dtype == torch.float32
        with pytest.raises(AOQError, match="floating dtype"):
            q.to(torch.int32)


def test_int8_per_token_activation_quantization_is_what_the_kernel_sees():
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    q = Int8Tensor.from_float(w, act_quant="per_token")
    x = torch.randn(3, 64)
    x[1] *= 100  # per-token scales: one loud row does not flatten the others
    xs = q.simulate_input_quantization(x)
    assert sqnr(x[0], xs[0]) > 38 and sqnr(x[2], xs[2]) > 38
