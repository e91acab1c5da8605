"""The CPU kernel for Int4Tensor with integer activations (csrc/int8_int4.cpp, kernels/cpu.py's
cpu_int8_int4_ext): against the exact integer definition and the reference kernel, for int8 and
int4 activations, symmetric and asymmetric weights, every group size, partial last groups, a
16-row tail block (the scalar path), one and many rows, every float input dtype, eager and
torch.compile. The AVX2 and AVX-512 builds give the same outputs bit for bit
(test_cpu_isa.py's build comparison covers these weights); without the extension the same
weights fall back to fake-quantized activations on aten's int4 kernel (test_no_cpu_ext.py runs
this module again)."""
import pytest
import torch
import torch.nn.functional as F

from hf_aoq import Int4Tensor
from hf_aoq.kernels import cpu, cpu_ext, select_kernel
from hf_aoq.kernels.reference import reference_linear

needs_ext = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's CPU extension is not built here")


def act_weight(n, k, g, act_dtype, symmetric=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    w = (torch.randn(n, k) * 0.05).to(dtype)
    return Int4Tensor.from_float(w, g, symmetric, act_quant="per_token", act_dtype=act_dtype)


def exact(x, w, bias=None):
    """The definition in float64: the per-token codes and scales of quantize_input times the
    exactly dequantized weight (float32 values), plus the bias."""
    codes, scale = w.quantize_input(x.reshape(-1, x.shape[-1]))
    y = (codes.double() * scale.double()) @ w.dequantize(torch.float32).double().t()
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], w.shape[0])


CASES = [  # n, k, g, symmetric
    (64, 256, 32, True),
    (48, 200, 64, False),   # a tail block of 16 rows; K = 200: a partial last group of 8
    (96, 384, 128, True),
    (32, 512, 256, False),
    (16, 64, 32, True),     # one 16-row block only
]


@needs_ext
@pytest.mark.parametrize("act_dtype", [torch.int8, torch.int4], ids=["int8", "int4"])
@pytest.mark.parametrize("n, k, g, symmetric", CASES)
def test_kernel_matches_the_exact_definition(act_dtype, n, k, g, symmetric):
    w = act_weight(n, k, g, act_dtype, symmetric).place()
    assert w.packing == "cpu_int4_pairs"
    bias = torch.randn(n)
    for rows in (1, 2, 3, 17, 64):
        x = torch.randn(rows, k) * 3
        assert select_kernel("linear", x, w).name == "cpu_int8_int4_ext"
        for b in (None, bias):
            y = F.linear(x, w, b)
            ref = exact(x, w, b)
            # float32 epilogue per group: within a few float32 roundings of the sums' size.
            scale = (ref.abs().max() + 1).item()
            torch.testing.assert_close(y.double(), ref, rtol=0, atol=scale * 2**-18)
            # and the reference kernel (fake-quantized input, float32 matmul) agrees as closely.
            torch.testing.assert_close(y, reference_linear(x, w, b), rtol=1e-5, atol=scale * 2**-18)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_round_once(dtype):
    w = act_weight(64, 192, 64, torch.int8, dtype=dtype).place()
    bias = torch.randn(64, dtype=dtype)
    x = torch.randn(2, 5, 192, dtype=dtype)
    y = F.linear(x, w, bias)
    assert y.dtype == dtype and y.shape == (2, 5, 64)
    # The exact float result rounded once to dtype: at most one rounding away.
    ref = exact(x, w, bias)
    torch.testing.assert_close(y.double(), ref, rtol=2**-7 if dtype == torch.bfloat16 else 2**-10, atol=1e-3)
    # The reference kernel rounds the activations and the weight to dtype first: within its precision.
    r = reference_linear(x, w, bias)
    torch.testing.assert_close(y.float(), r.float(), rtol=0.02, atol=0.02 * r.float().abs().max().item())


@needs_ext
def test_rows_are_independent_and_empty_batches_work():
    w = act_weight(64, 128, 32, torch.int8).place()
    x = torch.randn(9, 128)
    many = F.linear(x, w)
    for i in range(9):  # exact integer sums: a row's result does not depend on the others
        assert torch.equal(F.linear(x[i:i + 1], w), many[i:i + 1])
    assert F.linear(torch.randn(0, 128), w).shape == (0, 64)


@needs_ext
def test_other_weights_do_not_take_the_integer_kernel():
    x = torch.randn(2, 128)
    plain = Int4Tensor.from_float(torch.randn(64, 128), 32).place()
    f8 = Int4Tensor.from_float(torch.randn(64, 128), 32, act_quant="per_token", act_dtype=torch.float8_e4m3fn).place()
    assert select_kernel("linear", x, plain).name == "cpu_int4_ext"
    assert select_kernel("linear", x, f8).name == "cpu_int4_ext"
    # Float8 activations: fake-quantized, then the int4 kernel, as the reference does.
    torch.testing.assert_close(F.linear(x, f8), reference_linear(x, f8, None), rtol=1e-5, atol=1e-4)


@needs_ext
@pytest.mark.parametrize("act_dtype", [torch.int8, torch.int4], ids=["int8", "int4"])
def test_torch_compile_agrees_with_eager_through_one_custom_op(act_dtype):
    from torch._dynamo.backends.common import aot_autograd

    w = act_weight(64, 256, 32, act_dtype).place()
    lin = torch.nn.Linear(256, 64)
    lin.weight = torch.nn.Parameter(w, requires_grad=False)
    x = torch.randn(3, 256)
    ops = []

    def record(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    with torch.no_grad():
        eager = lin(x)
        torch._dynamo.reset()
        compiled = torch.compile(lin, backend="inductor", fullgraph=True)(x)
        torch._dynamo.reset()
        traced = torch.compile(lin, backend=aot_autograd(fw_compiler=record), fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(traced, eager)
    assert [op for op in ops if op.startswith("hf_aoq.")] == ["hf_aoq.int8_int4_linear_io_cpu.default"], ops
    assert not any("mm" in op or "linear" in op for op in ops if not op.startswith("hf_aoq.")), ops


def test_without_the_integer_kernel_the_fallback_fake_quantizes(monkeypatch):
    """The int4 kernels that do not take integer codes (aten's, the float32/int16 ones) run on
    the fake-quantized input: the reference's numbers, not weight-only ones."""
    w = act_weight(64, 128, 32, torch.int4)
    x = torch.randn(2, 128)
    placed = w.place()
    kernel = select_kernel("linear", x, placed)
    expected = reference_linear(x, w, None)
    weight_only = F.linear(x, w.dequantize(torch.float32))
    if cpu_ext.available():
        y = cpu.int4_ext_linear(x, placed, None)  # the row below the integer kernel
    else:
        assert kernel.name == "cpu_int4pack_mm"
        y = F.linear(x, placed)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-3)
    assert (y - weight_only).abs().max() > 1e-2  # int4 activations change the answer
