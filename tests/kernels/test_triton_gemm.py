"""The Triton small-M GEMMs and one-pass dequantizations of int4 and Int4DQ weights (canonical
layouts) under Triton's interpreter against the reference kernel, their rows in the kernel
table, and every tile compiled for an H200 (sm90) without a GPU. The interpreter is slow (1-2 M
multiply-adds a second): shapes stay N <= 256, K <= 1024."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import triton_interpreter  # noqa: E402  (before triton)

triton = pytest.importorskip("triton")

from hf_aoq import Int4DQTensor, Int4Tensor, Int4WeightOnlyConfig, kernels  # noqa: E402
from hf_aoq.kernels import registry, triton_kernels  # noqa: E402
from hf_aoq.tensors.int4dq import LUT  # noqa: E402

pytestmark = pytest.mark.triton
# Of sum |x| |w|: float32 accumulation and the output's rounding.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
ROWS = (2, 5, 16)


@pytest.fixture(scope="module", autouse=True)
def _interpreter_only_here():
    yield from triton_interpreter.interpreter_for_the_module()


@pytest.fixture(scope="module")
def gemm():
    triton_interpreter.require_interpreted_kernels()
    from hf_aoq.kernels import triton_gemm

    return triton_gemm


def _check_product(y, x, w, bias, reference):
    """y is x @ w.T + bias (w: the weights as dequantize(x.dtype) gives them) to float32
    accumulation and output rounding, and the reference kernel's result to twice that."""
    dtype = x.dtype
    assert y.dtype == dtype and y.shape == (x.shape[0], w.shape[0])
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    scale = (x.double().abs() @ w.double().abs().t()).max() + 1
    assert (y.double() - exact).abs().max() <= TOL[dtype] * scale
    assert (y.double() - reference.double()).abs().max() <= 2 * TOL[dtype] * scale


def _reference(type_name):
    row = kernels.kernels_for("linear", type_name)[-1]
    assert row.name == "reference"
    return row.fn


# Groups 32 to 256; K 576 in groups of 128 and 320 in groups of 256 end in a partial group.
INT4_SHAPES = [(40, 256, 32, True), (72, 320, 64, False), (64, 576, 128, False), (48, 320, 256, True)]


@pytest.mark.parametrize("n,k,group,symmetric", INT4_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_gemm_matches_the_reference(gemm, n, k, group, symmetric, dtype):
    torch.manual_seed(0)
    q = Int4Tensor.from_float(torch.randn(n, k, dtype=dtype), group, symmetric=symmetric)
    w = q.dequantize(dtype)
    for rows in ROWS:
        x = torch.randn(rows, k, dtype=dtype)
        bias = torch.randn(n, dtype=dtype) if rows == 5 else None
        y = gemm.int4_gemm(x, q.qdata, q.scale, q.zero, bias, group, n, k)
        _check_product(y, x, w, bias, _reference("Int4Tensor")(x, q, bias))
    # The table's row (eager: the kernel itself) on a 3-D input.
    x3 = torch.randn(2, 8, k, dtype=dtype)
    y3 = triton_kernels.int4_triton_gemm_linear(x3, q, None)
    y2 = gemm.int4_gemm(x3.reshape(16, k), q.qdata, q.scale, q.zero, None, group, n, k)
    assert y3.shape == (2, 8, n) and torch.equal(y3.reshape(16, n), y2)


@pytest.mark.parametrize("n,k,group,symmetric", INT4_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int4_dequantization_is_the_references_bit_for_bit(gemm, n, k, group, symmetric, dtype):
    """One pass of the weight to x's dtype, then cuBLAS (here: torch): the large-M row."""
    torch.manual_seed(1)
    q = Int4Tensor.from_float(torch.randn(n, k, dtype=torch.bfloat16), group, symmetric=symmetric)
    w = gemm.int4_dequantize(q.qdata, q.scale, q.zero, group, n, k, dtype)
    assert torch.equal(w, q.dequantize(dtype))
    x = torch.randn(3, 7, k, dtype=dtype)
    bias = torch.randn(n, dtype=torch.bfloat16)
    y = triton_kernels.int4_triton_dequantize_linear(x, q, bias)
    assert torch.equal(y, _reference("Int4Tensor")(x, q, bias))


def test_int4_gemm_in_float32_and_with_no_rows(gemm):
    torch.manual_seed(2)
    q = Int4Tensor.from_float(torch.randn(64, 576), 128)
    x = torch.randn(5, 576)
    y = gemm.int4_gemm(x, q.qdata, q.scale, q.zero, None, 128, 64, 576)
    _check_product(y, x, q.dequantize(torch.float32), None, _reference("Int4Tensor")(x, q, None))
    assert gemm.int4_gemm(x[:0], q.qdata, q.scale, q.zero, None, 128, 64, 576).shape == (0, 64)


def test_every_tile_gives_the_references_product(gemm):
    """Each GEMM_TILES entry (the table's choice at other M), at M = 20 and a partial N tile."""
    torch.manual_seed(3)
    q = Int4Tensor.from_float(torch.randn(72, 256, dtype=torch.bfloat16), 64)
    dq = _int4dq(40, 192, 64)
    x = torch.randn(20, 256, dtype=torch.bfloat16)
    for rows, tile in zip(gemm.GEMM_TILE_ROWS, gemm.GEMM_TILES):
        assert gemm.gemm_tile(rows or 10 ** 6, 64) == tile[:2] + (min(tile[2], 64),) + tile[3:]
        y = gemm.int4_gemm(x, q.qdata, q.scale, q.zero, None, 64, 72, 256, tile=tile)
        _check_product(y, x, q.dequantize(torch.bfloat16), None, _reference("Int4Tensor")(x, q, None))
        xk = x[:, :192]
        y = gemm.int4dq_gemm(xk, dq.qdata, dq.gparams, dq.rparams, dq.tparams, LUT, None, 64, 40, 192, tile=tile)
        _check_product(y, xk, dq.dequantize(torch.bfloat16), None, _reference("Int4DQTensor")(xk, dq, None))
    assert gemm.gemm_tile(16, 32)[2] == 32  # BLOCK_K divides the group


def _int4dq(n, k, group, dtype=torch.bfloat16):
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=dtype)
    w[0, :group] = 0  # a zero group, and (row 1) a row of one sign: centre and scale codes at their ends
    w[1] = w[1].abs() + 0.5
    return Int4DQTensor.from_float(w, group)


# K 288 in groups of 64 ends in a partial group.
INT4DQ_SHAPES = [(40, 64, 32), (72, 288, 64), (64, 576, 32)]


@pytest.mark.parametrize("n,k,group", INT4DQ_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4dq_gemm_matches_the_reference(gemm, n, k, group, dtype):
    q = _int4dq(n, k, group)
    w = q.dequantize(dtype)
    for rows in ROWS:
        torch.manual_seed(rows)
        x = torch.randn(rows, k, dtype=dtype)
        bias = torch.randn(n, dtype=dtype) if rows == 5 else None
        y = gemm.int4dq_gemm(x, q.qdata, q.gparams, q.rparams, q.tparams, LUT, bias, group, n, k)
        _check_product(y, x, w, bias, _reference("Int4DQTensor")(x, q, bias))
    x = torch.randn(16, k, dtype=dtype)
    assert torch.equal(triton_kernels.int4dq_triton_gemm_linear(x, q, None),
                       gemm.int4dq_gemm(x, q.qdata, q.gparams, q.rparams, q.tparams, LUT, None, group, n, k))


@pytest.mark.parametrize("n,k,group", INT4DQ_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int4dq_dequantization_is_the_references_bit_for_bit(gemm, n, k, group, dtype):
    q = _int4dq(n, k, group)
    w = gemm.int4dq_dequantize(q.qdata, q.gparams, q.rparams, q.tparams, LUT, group, n, k, dtype)
    assert torch.equal(w, q.dequantize(dtype))
    x = torch.randn(70, k, dtype=dtype)
    y = triton_kernels.int4dq_triton_dequantize_linear(x, q, None)
    assert torch.equal(y, _reference("Int4DQTensor")(x, q, None))


@pytest.mark.parametrize("rows,dtype,expected", [
    (1, torch.bfloat16, "gemv"), (8, torch.float16, "gemv"), (9, torch.bfloat16, "gemm"),
    (64, torch.float16, "gemm"), (65, torch.bfloat16, "dequantize_mm"), (512, torch.bfloat16, "dequantize_mm"),
    (16, torch.float32, "dequantize_mm"), (4, torch.float32, "gemv"),
])
def test_the_rows_by_m(monkeypatch, rows, dtype, expected):
    """On a GPU with triton, canonical int4 (N = 20: tinygemm cannot take it) and Int4DQ weights:
    the GEMV up to TRITON_GEMV_MAX_ROWS, the GEMM (bf16, fp16) up to TRITON_GEMM_MAX_ROWS, one
    dequantization and cuBLAS above (and for float32 past the GEMV)."""
    from test_cuda_contracts import fake_gpu

    assert (triton_kernels.TRITON_GEMV_MAX_ROWS, triton_kernels.TRITON_GEMM_MAX_ROWS) == (8, 64)
    q = Int4WeightOnlyConfig(32).quantize_weight(torch.randn(20, 256, dtype=torch.bfloat16))
    dq = _int4dq(20, 256, 32)
    # A slice along K (fields strided along N) is no row's: the reference reads it.
    for w in (q, dq):
        for row in kernels.kernels_for("linear", type(w).__name__):
            if row.backend == "triton":
                assert not row.when(torch.empty(rows, 64, dtype=dtype), w[:, :64]), row.name
    with fake_gpu(monkeypatch):
        registry._CAPABLE[("cuda:triton", "cuda", 0)] = True
        x = torch.empty(rows, 256, dtype=dtype, device="cuda")
        for name, w in (("int4", q), ("int4dq", dq)):
            on_gpu = w.to("cuda").place()
            assert on_gpu.packing is None
            assert kernels.select_kernel("linear", x, on_gpu).name == f"triton_{name}_{expected}"
            assert kernels.select_kernel("linear", x.reshape(1, rows, 256), on_gpu).name == f"triton_{name}_{expected}"
        # Under torch.compile the rows are custom ops whose fakes give the output's shape and dtype.
        on_gpu = q.to("cuda").place()
        if expected == "gemm":
            y = triton_kernels.int4_gemm_op.op(x, on_gpu.qdata, on_gpu.scale, on_gpu.zero, None, 32, 20, 256)
            assert y.dtype == dtype and tuple(y.shape) == (rows, 20)
        if expected == "dequantize_mm":
            w = triton_kernels.int4_dequantize_op.op(on_gpu.qdata, on_gpu.scale, on_gpu.zero, 32, 20, 256, x)
            assert w.dtype == dtype and tuple(w.shape) == (20, 256)


COMPILE_FOR_H200 = triton_interpreter.RESOURCE_USAGE + """
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_aoq.kernels import triton_gemm

ROUND = {"*fp32": 0, "*fp16": 1, "*bf16": 2}
COMMON = {"M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_qn": "i32",
          "GROUP": "constexpr", "HAS_BIAS": "constexpr", "ROUND": "constexpr", "DOT_F32": "constexpr",
          "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}


def int4(x, group, has_zero, tile):
    bm, bn, bk, warps, stages = tile
    signature = {"x_ptr": x, "q_ptr": "*u8", "s_ptr": x, "z_ptr": x, "b_ptr": x, "y_ptr": x, "stride_sn": "i32",
                 "HAS_ZERO": "constexpr", **COMMON}
    constexprs = {"GROUP": group, "HAS_ZERO": has_zero, "HAS_BIAS": True, "ROUND": ROUND[x], "DOT_F32": x == "*fp32",
                  "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    return triton_gemm.int4_gemm_kernel, signature, constexprs, warps, stages


def int4dq(x, group, tile):
    bm, bn, bk, warps, stages = tile
    signature = {"x_ptr": x, "q_ptr": "*u8", "g_ptr": "*u8", "r_ptr": "*u8", "t_ptr": "*fp32", "lut_ptr": "*fp32",
                 "b_ptr": x, "y_ptr": x, "stride_gn": "i32", "stride_rn": "i32", **COMMON}
    constexprs = {"GROUP": group, "HAS_BIAS": True, "ROUND": ROUND[x], "DOT_F32": x == "*fp32", "BLOCK_M": bm,
                  "BLOCK_N": bn, "BLOCK_K": bk}
    return triton_gemm.int4dq_gemm_kernel, signature, constexprs, warps, stages


builds = []
for rows in triton_gemm.GEMM_TILE_ROWS:  # every tile the table picks, at its largest group's BLOCK_K
    m = rows or 512
    builds.append(int4("*bf16", 128, True, triton_gemm.gemm_tile(m, 128)))
    builds.append(int4dq("*bf16", 64, triton_gemm.gemm_tile(m, 64)))
builds.append(int4("*fp16", 32, False, triton_gemm.gemm_tile(16, 32)))
builds.append(int4("*fp16", 256, True, triton_gemm.gemm_tile(64, 256)))
builds.append(int4dq("*fp16", 32, triton_gemm.gemm_tile(32, 32)))
assert len({triton_gemm.gemm_tile(m, 128, torch.float32) for m in (1, 16, 64, 512)}) == 1  # one float32 tile
builds.append(int4("*fp32", 128, True, triton_gemm.gemm_tile(64, 128, torch.float32)))
for kernel, signature, constexprs, warps, stages in builds:
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False})
    what = (kernel.__name__, signature["x_ptr"], constexprs)
    check_fits(compiled, what)
    ptx = compiled.asm["ptx"]
    if signature["x_ptr"] != "*fp32":  # (float32's dot is itself multiply-adds)
        assert "mma" in ptx, what  # tensor cores for bf16 and fp16
        assert "fma.rn.f32" not in ptx, what  # the weights decode as torch rounds them
for x in ("*bf16", "*fp16", "*fp32"):
    signature = {"q_ptr": "*u8", "s_ptr": "*bf16", "z_ptr": "*bf16", "w_ptr": x, "N": "i32", "K": "i32",
                 "stride_qn": "i32", "stride_sn": "i32", "GROUP": "constexpr", "HAS_ZERO": "constexpr",
                 "ROUND": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    constexprs = {"GROUP": 128, "HAS_ZERO": True, "ROUND": ROUND[x], "BLOCK_N": triton_gemm.DEQUANT_BLOCK_N,
                  "BLOCK_K": triton_gemm.DEQUANT_BLOCK_K}
    compiled = triton.compile(ASTSource(triton_gemm.int4_dequantize_kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    check_fits(compiled, ("int4 dequantize", x))
    signature = {"q_ptr": "*u8", "g_ptr": "*u8", "r_ptr": "*u8", "t_ptr": "*fp32", "lut_ptr": "*fp32", "w_ptr": x,
                 "N": "i32", "K": "i32", "stride_qn": "i32", "stride_gn": "i32", "stride_rn": "i32",
                 "GROUP": "constexpr", "ROUND": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    constexprs = {"GROUP": 32, "ROUND": ROUND[x], "BLOCK_N": triton_gemm.DEQUANT_BLOCK_N,
                  "BLOCK_K": triton_gemm.DEQUANT_BLOCK_K}
    compiled = triton.compile(ASTSource(triton_gemm.int4dq_dequantize_kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    check_fits(compiled, ("int4dq dequantize", x))
    assert "fma.rn.f32" not in compiled.asm["ptx"], x
print("ok")
"""


def test_the_gemms_compile_for_an_h200():
    """Every tile the table picks, for int4 and Int4DQ, bf16 and fp16 (and float32), and the
    dequantizations: no register spill or shared-memory overflow on sm90 (triton.compile runs
    ptxas without a GPU), tensor cores used, no fused multiply-add in the weight decoding."""
    triton_interpreter.compile_in_a_process(COMPILE_FOR_H200)


def test_the_interpreter_tests_run_somewhere():
    if triton_interpreter.is_interpreted():
        pytest.skip("the interpreter tests ran in this process")
    triton_interpreter.run_interpreted(__file__, "matches_the_reference or bit_for_bit or no_rows or every_tile")
