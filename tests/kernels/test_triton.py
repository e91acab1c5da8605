"""hf_aoq's Triton kernels on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), against
the reference kernel, and compiled for an H200 (sm90) without a GPU. Skipped where triton is not
installed. The interpreter is slow (1-2 M multiply-adds a second): shapes stay N <= 256, K <= 1024."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The interpreter must be on before triton is first imported: triton.language's own @jit
# functions (tl.sum, ...) are made interpreted or compiled at import.
_SETS_INTERPRET = "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ
if _SETS_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

sys.path.insert(0, os.path.dirname(__file__))
import triton_interpreter  # noqa: E402  (after the interpreter is set above: it sets nothing then)

from hf_aoq import Int4Tensor, Int4WeightOnlyConfig, kernels  # noqa: E402
from hf_aoq.kernels import registry  # noqa: E402

pytestmark = pytest.mark.triton
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _interpreter_only_here():
    """The variable set above is this module's: later tests see the environment they had."""
    yield
    if _SETS_INTERPRET:
        os.environ.pop("TRITON_INTERPRET", None)


@pytest.fixture(scope="module")
def interpreted():
    """triton_jit and its kernel as Triton's interpreter runs it (on CPU tensors)."""
    if not triton.knobs.runtime.interpret:
        pytest.skip("triton was imported without TRITON_INTERPRET=1 in this process")
    from hf_aoq.kernels import triton_jit

    return triton_jit, triton_jit.int4_gemv_kernel


@pytest.mark.parametrize("n,k,group,symmetric", [(256, 1024, 128, False), (64, 576, 128, False), (40, 256, 32, True),
                                                  (72, 320, 64, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int4_gemv_matches_the_reference(interpreted, n, k, group, symmetric, dtype):
    triton_jit, kernel = interpreted
    torch.manual_seed(0)
    q = Int4Tensor.from_float(torch.randn(n, k, dtype=dtype), group, symmetric=symmetric)
    x = torch.randn(3, k, dtype=dtype)
    bias = torch.randn(n, dtype=dtype)
    y = triton_jit.int4_gemv(x, q.qdata, q.scale, q.zero, bias, group, n, k, kernel=kernel)
    assert y.dtype == dtype and y.shape == (3, n)
    exact = x.double() @ q.dequantize(torch.float32).double().t() + bias.double()
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert (y.double() - exact).abs().max() <= tol * exact.abs().max()
    reference = kernels.kernels_for("linear", "Int4Tensor")[-1]
    assert reference.name == "reference"
    ref = reference.fn(x, q, bias).double()
    assert (y.double() - ref).abs().max() <= 2 * tol * exact.abs().max() + 1e-2 * (dtype == torch.bfloat16)


def test_int4_gemv_with_no_rows(interpreted):
    triton_jit, kernel = interpreted
    q = Int4Tensor.from_float(torch.randn(64, 256), 64)
    y = triton_jit.int4_gemv(torch.randn(0, 256), q.qdata, q.scale, q.zero, None, 64, 64, 256, kernel=kernel)
    assert y.shape == (0, 64)


def _int4dq(n, k, group, dtype=torch.bfloat16):
    from hf_aoq import Int4DQTensor

    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=dtype)
    w[0, :group] = 0  # a zero group, and (row 1) a row of one sign: centre and scale codes at their ends
    w[1] = w[1].abs() + 0.5
    return Int4DQTensor.from_float(w, group)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n,k,group", [(40, 64, 32), (72, 96, 64), (136, 576, 32), (64, 576, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int4dq_gemv_matches_the_reference(interpreted, rows, n, k, group, dtype):
    """The decoded weights are dequantize(x.dtype)'s bit for bit (the kernel writes them out);
    the product is the reference's to float32-accumulation rounding, with and without bias."""
    from hf_aoq.tensors.int4dq import LUT

    triton_jit, _ = interpreted
    q = _int4dq(n, k, group)
    torch.manual_seed(rows)
    x = torch.randn(rows, k, dtype=dtype)
    reference = kernels.kernels_for("linear", "Int4DQTensor")[-1]
    assert reference.name == "reference"
    for bias in (torch.randn(n, dtype=dtype), None):
        decoded = torch.full((n, k), float("nan"), dtype=dtype)
        y = triton_jit.int4dq_gemv(x, q.qdata, q.gparams, q.rparams, q.tparams, LUT, bias, group, n, k,
                                   decoded=decoded)
        assert y.dtype == dtype and y.shape == (rows, n)
        w = q.dequantize(dtype)
        assert torch.equal(decoded.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           w.view(torch.int16 if dtype != torch.float32 else torch.int32))
        # float64 product of the very weights the kernel used: only accumulation rounding differs.
        exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
        scale = (x.double().abs() @ w.double().abs().t()).max() + 1
        tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        assert (y.double() - exact).abs().max() <= tol * scale
        ref = reference.fn(x, q, bias).double()
        assert (y.double() - ref).abs().max() <= 2 * tol * scale
        plain = triton_jit.int4dq_gemv(x, q.qdata, q.gparams, q.rparams, q.tparams, LUT, bias, group, n, k)
        assert torch.equal(plain, y)  # writing the weights out changes nothing else


def test_int4dq_gemv_with_no_rows(interpreted):
    from hf_aoq.tensors.int4dq import LUT

    triton_jit, _ = interpreted
    q = _int4dq(64, 256, 64)
    y = triton_jit.int4dq_gemv(torch.randn(0, 256), q.qdata, q.gparams, q.rparams, q.tparams, LUT, None, 64, 64, 256)
    assert y.shape == (0, 64)


def _scaled_weights():
    from hf_aoq import Float8Tensor, Int8Tensor, PerTensor

    torch.manual_seed(0)
    w = torch.randn(72, 320)
    return {
        "int8-row": Int8Tensor.from_float(w),
        "int8-group": Int8Tensor.from_float(w, group_size=64),
        "fp8-e4m3-row": Float8Tensor.from_float(w),
        "fp8-e4m3-tensor": Float8Tensor.from_float(w, granularity=PerTensor()),
        "fp8-e5m2-row": Float8Tensor.from_float(w, torch.float8_e5m2),
    }


@pytest.mark.parametrize("name", list(_scaled_weights()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_and_float8_gemv_match_the_reference(interpreted, name, dtype):
    triton_jit, _ = interpreted
    q = _scaled_weights()[name]
    x = torch.randn(2, 320, dtype=dtype)
    bias = torch.randn(72, dtype=dtype)
    y = triton_jit.scaled_gemv(x, q.qdata, q.scale, q.block_size[-1], bias)
    assert y.dtype == dtype and y.shape == (2, 72)
    exact = x.double() @ q.dequantize(torch.float32).double().t() + bias.double()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert (y.double() - exact).abs().max() <= tol * exact.abs().max()
    ref = kernels.kernels_for("linear", type(q).__name__)[-1].fn(x, q, bias).double()
    assert (y.double() - ref).abs().max() <= 3e-2 * exact.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_fused_int8_activation_quantizer_matches_torch_bit_for_bit(interpreted, dtype):
    from hf_aoq.kernels.common import quantize_int8_per_token

    triton_jit, _ = interpreted
    torch.manual_seed(0)
    for k in (576, 1000, 2048):
        x = torch.randn(5, k, dtype=dtype) * 3
        x[2] = 0  # an all-zero row: the 1e-12 floor
        x[3, 7] = 1e4  # an outlier: every other code of its row rounds near 0, half to even
        codes, scale = triton_jit.quantize_rows_int8(x)
        expected_codes, expected_scale = quantize_int8_per_token(x)
        assert torch.equal(codes, expected_codes) and torch.equal(scale, expected_scale), (dtype, k)
    assert triton_jit.quantize_rows_int8(torch.randn(0, 64, dtype=dtype))[0].shape == (0, 64)


COMPILE_FOR_H200 = triton_interpreter.RESOURCE_USAGE + """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_aoq.kernels import triton_jit

for has_zero in (True, False):
    signature = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*bf16", "z_ptr": "*bf16", "b_ptr": "*bf16",
                 "y_ptr": "*bf16", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32",
                 "stride_qn": "i32", "stride_sn": "i32", "GROUP": "constexpr", "HAS_ZERO": "constexpr",
                 "HAS_BIAS": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    constexprs = {"GROUP": 128, "HAS_ZERO": has_zero, "HAS_BIAS": True, "BLOCK_N": triton_jit.BLOCK_N,
                  "BLOCK_K": triton_jit.BLOCK_K}
    compiled = triton.compile(ASTSource(triton_jit.int4_gemv_kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": triton_jit.NUM_WARPS})
    check_fits(compiled, ("int4 gemv", has_zero))
for codes, x in [(c, "*bf16") for c in ("*i8", "*fp8e4nv", "*fp8e5")] + [("*i8", "*fp32"), ("*fp8e4nv", "*fp16")]:
    signature = {"x_ptr": x, "q_ptr": codes, "s_ptr": "*fp32", "b_ptr": x, "y_ptr": x,
                 "N": "i32", "K": "i32", "GROUP": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_qn": "i32",
                 "stride_sn": "i32", "HAS_BIAS": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    constexprs = {"HAS_BIAS": True, "BLOCK_N": triton_jit.WIDE_BLOCK_N, "BLOCK_K": triton_jit.BLOCK_K}
    compiled = triton.compile(ASTSource(triton_jit.scaled_gemv_kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": triton_jit.WIDE_NUM_WARPS})
    check_fits(compiled, (codes, x))
for x in ("*bf16", "*fp16", "*fp32"):
    for group in (32, 64):
        signature = {"x_ptr": x, "q_ptr": "*u8", "g_ptr": "*u8", "r_ptr": "*u8", "t_ptr": "*fp32", "lut_ptr": "*fp32",
                     "b_ptr": x, "y_ptr": x, "w_ptr": x, "N": "i32", "K": "i32", "stride_xm": "i32",
                     "stride_ym": "i32", "stride_qn": "i32", "stride_gn": "i32", "stride_rn": "i32",
                     "GROUP": "constexpr", "HAS_BIAS": "constexpr", "WRITE_W": "constexpr", "ROUND": "constexpr",
                     "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
        constexprs = {"GROUP": group, "HAS_BIAS": True, "WRITE_W": False, "ROUND": {"*fp32": 0, "*fp16": 1, "*bf16": 2}[x],
                      "BLOCK_N": triton_jit.WIDE_BLOCK_N, "BLOCK_K": triton_jit.BLOCK_K}
        compiled = triton.compile(ASTSource(triton_jit.int4dq_gemv_kernel, signature, constexprs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": triton_jit.WIDE_NUM_WARPS, "enable_fp_fusion": False})
        check_fits(compiled, (x, group))
        # No multiply and add fused: the decoding rounds each operation as torch does.
        assert "fma.rn.f32" not in compiled.asm["ptx"], (x, group)
for x in ("*bf16", "*fp16", "*fp32"):
    signature = {"x_ptr": x, "q_ptr": "*i8", "s_ptr": "*fp32", "K": "i32", "stride_xm": "i32", "stride_qm": "i32",
                 "BLOCK_K": "constexpr"}
    compiled = triton.compile(ASTSource(triton_jit.quantize_rows_int8_kernel, signature,
                                        {"BLOCK_K": triton_jit.QUANT_BLOCK_K}), target=GPUTarget("cuda", 90, 32))
    check_fits(compiled, x)
print("ok")
"""


def test_the_kernels_compile_for_an_h200():
    """No register spill or shared-memory overflow on sm90: triton.compile runs ptxas without a
    GPU (at 64 x 128 and 4 warps the int8 / float8 and Int4DQ GEMVs spilled 816-1184 bytes a
    thread). In a process of its own, without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_H200], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_rows_are_chosen_on_cuda_at_few_rows(monkeypatch):
    """On a GPU with triton: the Triton GEMV for a canonical Int4Tensor (here N = 20, which
    tinygemm cannot take), for Int4DQ and for int8 / float8 weight-only weights at few rows; at
    many, the Triton GEMM or dequantization (int4, Int4DQ) or the reference (int8, float8)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from test_cuda_contracts import fake_gpu

    q = Int4WeightOnlyConfig(32).quantize_weight(torch.randn(20, 256, dtype=torch.bfloat16))
    weights = _scaled_weights()
    dq = _int4dq(20, 256, 32)
    # A slice along K (qdata strided along N): not the row's (the reference reads it).
    from hf_aoq.kernels.triton_kernels import _int4dq_gemv_applies

    assert _int4dq_gemv_applies(torch.empty(1, 256), dq) and not _int4dq_gemv_applies(torch.empty(1, 64), dq[:, :64])
    with fake_gpu(monkeypatch):
        registry._CAPABLE[("cuda:triton", "cuda", 0)] = True
        on_gpu = q.to("cuda").place()
        assert on_gpu.packing is None
        assert kernels.select_kernel("linear", torch.empty(1, 256, dtype=torch.bfloat16, device="cuda"),
                                     on_gpu).name == "triton_int4_gemv"
        # Past the GEMV: the GEMM (tests/kernels/test_triton_gemm.py has the rows by M).
        assert kernels.select_kernel("linear", torch.empty(64, 256, dtype=torch.bfloat16, device="cuda"),
                                     on_gpu).name == "triton_int4_gemm"
        dq = dq.to("cuda").place()
        assert dq.packing is None  # no CUDA packing: the canonical layout the kernel reads
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.empty(1, 256, dtype=dtype, device="cuda")
            assert kernels.select_kernel("linear", x, dq).name == "triton_int4dq_gemv", dtype
        assert kernels.select_kernel("linear", torch.empty(8, 256, device="cuda"), dq).name == "triton_int4dq_gemv"
        assert kernels.select_kernel("linear", torch.empty(9, 256, device="cuda"), dq).name == "triton_int4dq_dequantize_mm"
        assert kernels.select_kernel("linear", torch.empty(9, 256, dtype=torch.bfloat16, device="cuda"),
                                     dq).name == "triton_int4dq_gemm"
        one_row = torch.empty(1, 320, dtype=torch.bfloat16, device="cuda")
        for name, q in weights.items():
            on_gpu = q.to("cuda").place()
            expected = "triton_int8_gemv" if name.startswith("int8") else "triton_fp8_gemv"
            assert kernels.select_kernel("linear", one_row, on_gpu).name == expected, name
            assert kernels.select_kernel("linear", one_row.expand(64, 320), on_gpu).name == "reference", name
            # A transposed weight (x @ W) has codes strided along K: the reference reads it.
            assert kernels.select_kernel("linear", torch.empty(1, 72, device="cuda"), on_gpu.t()).name == "reference"


def test_the_interpreter_tests_run_somewhere():
    """In a full run something imports triton first (torch.compile does), without the
    interpreter: then the interpreter tests above are skipped here and run in a process of their own."""
    if triton.knobs.runtime.interpret:
        pytest.skip("the interpreter tests ran in this process")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                           "-k", "match_the_reference or matches_the_reference or no_rows or bit_for_bit"],
                          env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0 and " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-3000:]
