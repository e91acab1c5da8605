"""The Triton MX (MXFP4, MXFP8) and NVFP4 kernels (hf_aoq/kernels/triton_mx.py) under Triton's
interpreter: every element code at edge scales decoded as the types' dequantize gives it, bit for
bit; the GEMV and dequantize + matmul rows against the reference kernel; the rows the table picks
on a (fake) GPU; and the kernels compiled for an H200 (sm90) without a GPU. Shapes stay tiny
(N <= 64, K <= 256): the interpreter is slow."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import triton_interpreter  # noqa: E402  (before triton)

triton = pytest.importorskip("triton")

from hf_aoq import MXTensor, NVFP4Tensor, kernels  # noqa: E402
from hf_aoq.kernels import registry, triton_kernels  # noqa: E402
from hf_aoq.tensors.mx import FP4, mx_dequantize  # noqa: E402
from hf_aoq.tensors.nvfp4 import nvfp4_dequantize  # noqa: E402

pytestmark = pytest.mark.triton
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
E8M0_EDGES = (0, 1, 2, 100, 126, 127, 128, 140, 200, 253, 254, 255)  # 0: 2^-127 (subnormal), 255: NaN
MX_FORMATS = ((FP4, 0), (torch.float8_e4m3fn, 1), (torch.float8_e5m2, 2))


@pytest.fixture(scope="module", autouse=True)
def _interpreter_only_here():
    yield from triton_interpreter.interpreter_for_the_module()


@pytest.fixture(scope="module")
def mx():
    triton_interpreter.require_interpreted_kernels()
    from hf_aoq.kernels import triton_mx

    return triton_mx


def _same_bits(got, want):
    """Equal bit for bit, NaN where and only where the other is NaN (a NaN's payload aside)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    ints = torch.int32 if want.dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(ints)[~nan], want.view(ints)[~nan])


def _mx_every_code(elem_dtype):
    """Codes and scales: every element code (FP4: every byte, so every nibble pair) in every row,
    each row's blocks at edge e8m0 scales, rotated from row to row."""
    rows = len(E8M0_EDGES)
    if elem_dtype == FP4:
        qdata = (torch.arange(128, dtype=torch.int32) + 128 * (torch.arange(rows)[:, None] % 2)).to(torch.uint8)
        k = 256
    else:
        qdata = torch.arange(256, dtype=torch.int32).repeat(rows, 1).to(torch.uint8).view(elem_dtype)
        k = 256
    edges = torch.tensor(E8M0_EDGES, dtype=torch.int32)
    scale = torch.stack([edges.roll(r)[: k // 32] for r in range(rows)]).to(torch.uint8)
    return qdata.contiguous(), scale.contiguous(), rows, k


@pytest.mark.parametrize("elem_dtype,fmt", MX_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mx_every_code_is_decoded_bit_for_bit(mx, elem_dtype, fmt, dtype):
    qdata, scale, n, k = _mx_every_code(elem_dtype)
    got = mx.mx_dequantize(qdata, scale, None, fmt, n, k, dtype)
    _same_bits(got, mx_dequantize(qdata, scale, elem_dtype, dtype))


@pytest.mark.parametrize("p", [2.0 ** -126, 1.0, 0.3, 2.0 ** 100])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_every_code_is_decoded_bit_for_bit(mx, p, dtype):
    """Every e2m1 byte against every e4m3 block scale (NaN included), at edge per-tensor scales."""
    n, k = 16, 256
    qdata = (torch.arange(128, dtype=torch.int32) + 128 * (torch.arange(n)[:, None] % 2)).to(torch.uint8)
    scale = torch.arange(256, dtype=torch.int32).reshape(n, k // 16).to(torch.uint8).view(torch.float8_e4m3fn)
    per_tensor = torch.tensor(p, dtype=torch.float32)
    got = mx.mx_dequantize(qdata.contiguous(), scale.contiguous(), per_tensor, 3, n, k, dtype)
    _same_bits(got, nvfp4_dequantize(qdata, scale, per_tensor, dtype))


def _weights():
    """Weight-only MX (K = 100 for float8: a partial last block; MXFP4 K even, 80) and NVFP4
    weights, N = 40: a partial tile along N."""
    torch.manual_seed(0)
    out = []
    for elem_dtype, _ in MX_FORMATS:
        k = 80 if elem_dtype == FP4 else 100
        out.append(MXTensor.from_float(torch.randn(40, k) * 3, elem_dtype))
    out.append(NVFP4Tensor.from_float(torch.randn(40, 88)))
    return out


def _act_weights():
    """Activation-quantized MX (MXFP4 x MXFP4, MXFP8 weights with e2m1 activations) and NVFP4."""
    torch.manual_seed(1)
    return [MXTensor.from_float(torch.randn(40, 64), FP4, act_dtype=FP4),
            MXTensor.from_float(torch.randn(40, 96), torch.float8_e4m3fn, act_dtype=torch.float8_e4m3fn),
            NVFP4Tensor.from_float(torch.randn(40, 80), act_quant="nvfp4")]


def _reference(w):
    row = kernels.kernels_for("linear", type(w).__name__)[-1]
    assert row.name == "reference"
    return row.fn


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_mx_and_nvfp4_gemv_matches_the_reference(mx, rows, dtype):
    for w in _weights() + _act_weights():
        n, k = w.shape
        torch.manual_seed(rows)
        x = torch.randn(rows, k, dtype=dtype)
        deq = w.dequantize(dtype)
        xs = w.simulate_input_quantization(x)  # x itself for weight-only
        for bias in (torch.randn(n, dtype=dtype), None):
            y = triton_kernels.mx_triton_linear(x, w, bias)
            assert y.dtype == dtype and y.shape == (rows, n)
            exact = xs.double() @ deq.double().t() + (0 if bias is None else bias.double())
            scale = (xs.double().abs() @ deq.double().abs().t()).max() + 1
            assert (y.double() - exact).abs().max() <= TOL[dtype] * scale, (type(w).__name__, bias is None)
            ref = _reference(w)(x, w, bias).double()
            assert (y.double() - ref).abs().max() <= 2 * TOL[dtype] * scale
        # Leading dimensions are kept.
        assert triton_kernels.mx_triton_linear(x.reshape(1, rows, k), w, None).shape == (1, rows, n)


def test_the_mx_and_nvfp4_dequantize_mm_matches_the_reference(mx):
    for w in _weights() + _act_weights():
        n, k = w.shape
        x = torch.randn(12, k, dtype=torch.bfloat16)
        bias = torch.randn(n, dtype=torch.bfloat16)
        y = triton_kernels.mx_triton_dequantize_linear(x, w, bias)
        assert torch.equal(y, _reference(w)(x, w, bias))  # the same weight, then the same F.linear


def test_the_mx_gemv_with_no_rows(mx):
    w = _weights()[0]
    y = mx.mx_gemv(torch.randn(0, 80), w.qdata, w.scale, None, None, 0, 40, 80)
    assert y.shape == (0, 40)


@pytest.mark.parametrize("rows,dtype,expected", [
    (1, torch.bfloat16, "gemv"), (8, torch.float16, "gemv"), (4, torch.float32, "gemv"),
    (9, torch.bfloat16, "dequantize_mm"), (512, torch.float16, "dequantize_mm"), (16, torch.float32, "dequantize_mm"),
])
def test_the_mx_and_nvfp4_rows_by_m(monkeypatch, rows, dtype, expected):
    """On a GPU with triton: the GEMV up to TRITON_GEMV_MAX_ROWS, one dequantization and cuBLAS
    above, activation-quantized weights too; slices along K are no Triton row's."""
    from test_cuda_contracts import fake_gpu

    torch.manual_seed(0)
    weights = [(MXTensor.from_float(torch.randn(20, 256), e), "mx") for e, _ in MX_FORMATS]
    weights.append((NVFP4Tensor.from_float(torch.randn(20, 256)), "nvfp4"))
    act = [MXTensor.from_float(torch.randn(20, 256), FP4, act_dtype=FP4),
           NVFP4Tensor.from_float(torch.randn(20, 256), act_quant="nvfp4")]
    for w, _ in weights:
        for row in kernels.kernels_for("linear", type(w).__name__):
            if row.backend == "triton":
                assert not row.when(torch.empty(rows, 64, dtype=dtype), w[:, :64]), row.name
    with fake_gpu(monkeypatch):
        registry._CAPABLE[("cuda:triton", "cuda", 0)] = True
        x = torch.empty(rows, 256, dtype=dtype, device="cuda")
        for w, name in weights:
            on_gpu = w.to("cuda")
            assert kernels.select_kernel("linear", x, on_gpu).name == f"triton_{name}_{expected}"
            assert kernels.select_kernel("linear", x.reshape(1, rows, 256), on_gpu).name == f"triton_{name}_{expected}"
        for w, name in zip(act, ("mx", "nvfp4")):
            assert kernels.select_kernel("linear", x, w.to("cuda")).name == f"triton_{name}_{expected}"
        # Under torch.compile the rows are custom ops whose fakes give the output's shape and dtype.
        w = weights[-1][0].to("cuda")
        if expected == "gemv":
            y = triton_kernels.mx_gemv_op.op(x, w.qdata, w.scale, w.per_tensor_scale, None, 3, 20, 256)
            assert y.dtype == dtype and tuple(y.shape) == (rows, 20)
        else:
            d = triton_kernels.mx_dequantize_op.op(w.qdata, w.scale, w.per_tensor_scale, 3, 20, 256, x)
            assert d.dtype == dtype and tuple(d.shape) == (20, 256)


COMPILE_FOR_H200 = triton_interpreter.RESOURCE_USAGE + """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_aoq.kernels import triton_jit, triton_mx

ROUND = {"*fp32": 0, "*fp16": 1, "*bf16": 2}
GEMV = {"x_ptr": None, "q_ptr": "*u8", "s_ptr": "*u8", "p_ptr": "*fp32", "b_ptr": None, "y_ptr": None, "N": "i32",
        "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_qn": "i32", "stride_sn": "i32",
        "FORMAT": "constexpr", "BLOCK": "constexpr", "HAS_BIAS": "constexpr", "ROUND": "constexpr",
        "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
DEQUANT = {"q_ptr": "*u8", "s_ptr": "*u8", "p_ptr": "*fp32", "w_ptr": None, "N": "i32", "K": "i32",
           "stride_qn": "i32", "stride_sn": "i32", "FORMAT": "constexpr", "BLOCK": "constexpr", "ROUND": "constexpr",
           "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
builds = [(fmt, "*bf16") for fmt in range(4)] + [(0, "*fp32"), (3, "*fp16")]
for fmt, x in builds:
    block = triton_mx.block_of(fmt)
    signature = {k: (x if v is None else v) for k, v in GEMV.items()}
    constexprs = {"FORMAT": fmt, "BLOCK": block, "HAS_BIAS": True, "ROUND": ROUND[x],
                  "BLOCK_N": triton_jit.WIDE_BLOCK_N, "BLOCK_K": triton_jit.BLOCK_K}
    compiled = triton.compile(ASTSource(triton_mx.mx_gemv_kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": triton_jit.WIDE_NUM_WARPS, "enable_fp_fusion": False})
    check_fits(compiled, ("mx gemv", fmt, x))
    assert ".ftz" not in compiled.asm["ptx"], (fmt, x)  # float32 subnormals kept (e8m0 code 0 is one)
    signature = {k: (x if v is None else v) for k, v in DEQUANT.items()}
    constexprs = {"FORMAT": fmt, "BLOCK": block, "ROUND": ROUND[x], "BLOCK_N": triton_mx.DEQUANT_BLOCK_N,
                  "BLOCK_K": triton_mx.DEQUANT_BLOCK_K}
    compiled = triton.compile(ASTSource(triton_mx.mx_dequantize_kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    check_fits(compiled, ("mx dequantize", fmt, x))
    assert "fma.rn.f32" not in compiled.asm["ptx"], (fmt, x)  # decoded as torch computes them
    assert ".ftz" not in compiled.asm["ptx"], (fmt, x)
print("ok")
"""


def test_the_mx_kernels_compile_for_an_h200():
    """The GEMV and the dequantization for every format: no register spill or shared-memory
    overflow on sm90 (triton.compile runs ptxas without a GPU), no fused multiply-add, no
    flushing of float32 subnormals."""
    triton_interpreter.compile_in_a_process(COMPILE_FOR_H200)


def test_the_interpreter_tests_run_somewhere():
    if triton_interpreter.is_interpreted():
        pytest.skip("the interpreter tests ran in this process")
    triton_interpreter.run_interpreted(__file__, "bit_for_bit or matches_the_reference or no_rows")
