"""Float8SemiSparseTensor's CPU kernels (csrc/fp8_sparse.cpp, kernels/cpu_sparse.py) against the
reference kernel (dequantize, F.linear, the activation fake-quantized as Float8Tensor's dynamic
path does), at 1..64 rows, eager and compiled. tests/kernels/test_no_cpu_ext.py runs this module
again without the extension, where the reference runs and the extension-only tests skip.

The GEMV computes in float32 on the exact weight, the reference in the activation dtype on the
weight rounded to it: outputs agree within TOL[dtype] of sum(|x| |w|) per output. The many-row
kernel dequantizes bit for bit as the reference does and calls the same F.linear: equal outputs."""
import os

import pytest
import torch
import torch.nn.functional as F

from hf_aoq import kernels
from hf_aoq.kernels import cpu_ext, cpu_sparse
from hf_aoq.kernels.reference import reference_linear
from hf_aoq.tensors.float8_sparse import Float8SemiSparseTensor

needs_ext = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's C++ extension is not built here")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}
ROWS = list(range(1, 65))


def sparse_weight(n, k, seed=0, dtype=torch.float32, act_quant="per_row"):
    g = torch.Generator().manual_seed(seed)
    return Float8SemiSparseTensor.from_float(torch.randn(n, k, generator=g).to(dtype), act_quant=act_quant)


def assert_close_to_reference(y, x, w, bias=None):
    ref = reference_linear(x, w, bias)
    assert y.dtype == x.dtype and y.shape == ref.shape
    xq = w.simulate_input_quantization(x).float().reshape(-1, x.shape[-1])
    bound = (xq.abs() @ w.dequantize(torch.float32).abs().t()).reshape(ref.shape)
    if bias is not None:
        bound = bound + bias.float().abs()
    err = (y.float() - ref.float()).abs()
    assert (err <= TOL[x.dtype] * bound + 1e-30).all(), err.max()


def expected_kernel(rows: int) -> str:
    if not cpu_ext.available():
        return "reference"
    return "cpu_fp8_sparse_gemv" if rows <= cpu_sparse.FP8_SPARSE_GEMV_MAX_ROWS else "cpu_fp8_sparse_dequant_gemm"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [136, 100])  # 68 values: 4 steps of 16 and a tail; 25 groups: a pad nibble
def test_linear_agrees_with_the_reference_at_1_to_64_rows(dtype, k):
    n = 37  # not a multiple of 4, 8 or 16
    w = sparse_weight(n, k, seed=k, dtype=dtype)
    bias = torch.randn(n).to(dtype)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        assert kernels.select_kernel("linear", x, w).name == expected_kernel(rows)
        assert_close_to_reference(F.linear(x, w), x, w)
        assert_close_to_reference(F.linear(x, w, bias), x, w, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act_quant", [None, "per_row"])
def test_weight_only_and_every_dtype(dtype, act_quant):
    w = sparse_weight(20, 576, seed=3, dtype=dtype, act_quant=act_quant)
    for rows in (1, 5, 40):
        x = torch.randn(2, rows, 576).to(dtype)  # leading dimensions
        y = F.linear(x, w)
        assert y.shape == (2, rows, 20)
        assert_close_to_reference(y, x, w)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [576, 100, 4])
def test_cpp_dequantize_is_the_references_bit_for_bit(dtype, k):
    w = sparse_weight(33, k, seed=k)
    got = cpu_sparse.fp8_sparse_dequantize(w.qdata.view(torch.uint8), w.positions, w.scale.reshape(-1), k, dtype)
    assert torch.equal(got.view(torch.uint8) if dtype != torch.float32 else got.view(torch.int32),
                       w.dequantize(dtype).view(torch.uint8) if dtype != torch.float32 else w.dequantize(dtype).view(torch.int32))


@needs_ext
def test_many_rows_are_the_reference_exactly():
    w = sparse_weight(48, 256, seed=5, dtype=torch.bfloat16)
    x = torch.randn(cpu_sparse.FP8_SPARSE_GEMV_MAX_ROWS + 7, 256).to(torch.bfloat16)
    assert kernels.select_kernel("linear", x, w).name == "cpu_fp8_sparse_dequant_gemm"
    assert torch.equal(F.linear(x, w), reference_linear(x, w, None))


@needs_ext
def test_gemv_reads_each_kept_value_exactly():
    """One-hot activations pick single weights: the GEMV's decoded values are exact (float32)."""
    w = sparse_weight(9, 64, seed=7, act_quant=None)
    x = torch.eye(64)[:16]
    y = cpu_sparse.fp8_sparse_linear_io(x, w.qdata.view(torch.uint8), w.positions, w.scale.reshape(-1), 64, None)
    assert torch.equal(y, w.dequantize(torch.float32)[:, :16].t())


@pytest.mark.parametrize("rows", [1, 7, 16, 40])
def test_compiled_agrees_with_eager(rows):
    torch._dynamo.reset()
    lin = torch.nn.Linear(96, 24, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight = torch.nn.Parameter(sparse_weight(24, 96, seed=rows, dtype=torch.bfloat16), requires_grad=False)
        x = torch.randn(rows, 96).to(torch.bfloat16)
        eager = lin(x)
        compiled = torch.compile(lin, backend="inductor", fullgraph=True)(x)
    assert_close_to_reference(compiled, x, lin.weight, lin.bias.detach())
    assert_close_to_reference(eager, x, lin.weight, lin.bias.detach())


def test_the_extension_switch_is_honoured():
    if not os.environ.get("HF_AOQ_NO_CPU_EXT"):
        pytest.skip("the extension is not switched off in this run")
    w = sparse_weight(8, 32)
    assert kernels.select_kernel("linear", torch.randn(1, 32), w).name == "reference"
