"""hf_aoq's MXFP4 CPU GEMV (csrc/mx.cpp, kernels/cpu_mx.py) against the reference kernel.

The GEMV computes in float32 on the exactly decoded weight, the reference dequantizes to the
activation dtype and calls aten's GEMM, so the sums differ in order and in rounding: outputs are
compared within TOL[dtype] of sum(|x| |w|) per output (a few roundings of the result's dtype).
The decoded weights themselves are compared exactly, through one-hot activations."""
import pytest
import torch
import torch.nn.functional as F

from hf_aoq.kernels import cpu_ext, cpu_mx, select_kernel
from hf_aoq.tensors.mx import E2M1_VALUES, FP4, MXTensor, mx_dequantize

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's C++ extension is not built here")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}


def gemv(x, w, bias=None):
    return cpu_mx.mxfp4_linear_io(x, w.qdata, w.scale, w.shape[-1], bias)


def reference(x, w, bias=None):
    return F.linear(x, w.dequantize(x.dtype), bias)


def assert_close_to_reference(y, x, w, bias=None):
    ref = reference(x, w, bias)
    assert y.dtype == x.dtype and y.shape == ref.shape
    bound = x.float().abs() @ w.dequantize(torch.float32).abs().t()
    if bias is not None:
        bound = bound + bias.float().abs()
    err = (y.float() - ref.float()).abs()
    assert (err <= TOL[x.dtype] * bound + 1e-30).all(), err.max()


def mx_weight(n, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return MXTensor.from_float(torch.randn(n, k, generator=g).to(dtype), FP4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [64, 96, 576, 2048, 80, 2])
@pytest.mark.parametrize("rows", [1, 3, 12, cpu_mx.MXFP4_GEMV_MAX_ROWS])
def test_gemv_agrees_with_the_reference(dtype, k, rows):
    n = 37  # not a multiple of 4 or 16: row tails
    w = mx_weight(n, k, seed=k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    assert_close_to_reference(gemv(x, w), x, w)
    bias = torch.randn(n).to(dtype)
    assert_close_to_reference(gemv(x, w, bias), x, w, bias)


def test_leading_dims_and_float32_bias_with_half_input():
    w = mx_weight(20, 96)
    x = torch.randn(2, 3, 96).to(torch.bfloat16)
    bias = torch.randn(20)
    y = gemv(x, w, bias)
    assert y.shape == (2, 3, 20)
    assert_close_to_reference(y.reshape(6, 20), x.reshape(6, 96), w, bias.to(torch.bfloat16))


def weight_from(codes: torch.Tensor, scale: torch.Tensor) -> MXTensor:
    """An MXFP4 MXTensor with the given element codes [N, K] and scale codes [N, B]."""
    n, k = codes.shape
    qdata = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return MXTensor(qdata, scale.to(torch.uint8), FP4, (1, 32), torch.Size((n, k)), torch.float32)


@pytest.mark.parametrize("k", [96, 80])
def test_decoded_weights_are_exact_for_every_code_and_scale_edge(k):
    # Every row holds every code (cycled, shifted per row) in every block; the scales cycle through
    # the edges 0 (subnormal 2^-127), 1, 127, 254 and 255 (NaN) and a few ordinary ones.
    edges = torch.tensor([0, 1, 127, 254, 255, 120, 130])
    n, b = 14, -(-k // 32)
    codes = (torch.arange(k)[None, :] + torch.arange(n)[:, None]) % 16
    scale = edges[(torch.arange(n)[:, None] + torch.arange(b)[None, :] * 3) % len(edges)]
    w = weight_from(codes, scale)
    exact = mx_dequantize(w.qdata, w.scale, FP4, torch.float32)
    nan_rows = (scale == 255).any(1)  # x = 0 times a NaN weight is NaN: the whole row's output, as F.linear
    for j in range(k):  # one-hot activations: y[:, n] is w[n, j], one product, no sum
        x = torch.zeros(1, k)
        x[0, j] = 1.0
        got = gemv(x, w)[0]
        assert torch.isnan(got[nan_rows]).all() and torch.isnan(reference(x, w)[0, nan_rows]).all(), j
        # Signed zeros aside (0 * -0 sums to +0), bit for bit, infinities (6 * 2^127) included.
        assert torch.equal(got[~nan_rows], exact[~nan_rows, j]), j
    kept = scale[~nan_rows]
    assert {0, 1, 127, 254} <= set(kept.unique().tolist()) and set(codes[~nan_rows].unique().tolist()) == set(range(16))
    # The table really is the spec's e2m1 values, and the edges really are there.
    assert 255 in set(scale.unique().tolist())
    assert E2M1_VALUES[7] == 6.0 and E2M1_VALUES[15] == -6.0


def test_a_nan_scale_block_gives_nan_in_its_rows_columns_only():
    w = mx_weight(24, 96)
    scale = w.scale.clone()
    scale[5, 1] = 255
    scale[17, 2] = 255  # the last block
    w = w.replace(scale=scale)
    x = torch.randn(3, 96).to(torch.bfloat16)
    y, ref = gemv(x, w), reference(x, w)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.isnan(y[:, [5, 17]]).all() and not torch.isnan(y[:, [i for i in range(24) if i not in (5, 17)]]).any()


def test_the_table_picks_the_gemv_only_where_it_applies():
    w = mx_weight(32, 64)
    small = torch.randn(cpu_mx.MXFP4_GEMV_MAX_ROWS, 64)
    assert select_kernel("linear", small, w).name == "cpu_mxfp4_gemv"
    assert select_kernel("linear", torch.randn(cpu_mx.MXFP4_GEMV_MAX_ROWS + 1, 64), w).name == "reference"
    dyn = MXTensor.from_float(torch.randn(32, 64), FP4, act_dtype=FP4)
    assert select_kernel("linear", small, dyn).name == "reference"
    fp8 = MXTensor.from_float(torch.randn(32, 64), torch.float8_e4m3fn)
    assert select_kernel("linear", small, fp8).name == "reference"
    y = F.linear(small.to(torch.bfloat16), w)  # through the tensor type's dispatch
    assert_close_to_reference(y, small.to(torch.bfloat16), w)


def test_torch_compile_agrees_with_eager():
    w = mx_weight(40, 96)
    lin = torch.nn.Linear(96, 40, bias=True)
    lin.weight = torch.nn.Parameter(w, requires_grad=False)
    x = torch.randn(1, 96)
    with torch.no_grad():
        eager = lin(x)
        torch._dynamo.reset()
        compiled = torch.compile(lin, backend="inductor", fullgraph=True)(x)
    assert torch.equal(eager, compiled)


def test_torch_compile_sees_one_custom_op():
    from torch._dynamo.backends.common import aot_autograd

    w = mx_weight(40, 96)
    lin = torch.nn.Linear(96, 40, bias=True)
    lin.weight = torch.nn.Parameter(w, requires_grad=False)
    ops = []

    def record(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    x = torch.randn(2, 96, dtype=torch.bfloat16)
    lin = lin.to(torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(lin, backend=aot_autograd(fw_compiler=record), fullgraph=True)(x)
        assert torch.equal(got, lin(x))
    assert [op for op in ops if op.startswith("hf_aoq.")] == ["hf_aoq.mxfp4_linear_io_cpu.default"], ops
    assert not any("linear" in op or "mm" in op for op in ops if not op.startswith("hf_aoq.")), ops
