"""The fused per-row float8 (e4m3) activation quantizer (fp8-dyn, fp8-int4): bit for bit
Float8Tensor's per-row path under Triton's interpreter, over every range an e4m3 code has
(subnormals, ties, saturation at 448, zeros and negative zero); its use by the CUDA rows; and
compiled for an H200 (sm90) without a GPU.

Why the code is computed from the bits: the interpreter's cast to float8e4nv (triton 3.9, with
or without fp_downcast_rounding="rtne") rounds ties away from zero, drops the carry into the
exponent when the exponent is odd (1.9375 -> 1.0 instead of 2.0), truncates subnormal results,
and misreads float32 subnormals; over the 34754 finite bfloat16 values in [-448, 448], 1030 codes
differ from torch's."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import triton_interpreter  # noqa: E402  (before triton)

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from hf_aoq import (  # noqa: E402
    Float8DynamicActivationFloat8WeightConfig,
    Float8DynamicActivationInt4WeightConfig,
    Float8Tensor,
)
from hf_aoq.kernels import registry  # noqa: E402
from hf_aoq.kernels import triton_jit as jit_functions  # noqa: E402
from hf_aoq.tensors.float8 import quantize_input_float8  # noqa: E402

pytestmark = pytest.mark.triton
E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module", autouse=True)
def _interpreter_only_here():
    yield from triton_interpreter.interpreter_for_the_module()


@pytest.fixture(scope="module")
def triton_jit():
    triton_interpreter.require_interpreted_kernels()
    from hf_aoq.kernels import triton_jit

    return triton_jit


@triton.jit
def code_kernel(x_ptr, c_ptr, v_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    code = jit_functions.e4m3_code(tl.load(x_ptr + offs, mask=mask, other=0.0))
    tl.store(c_ptr + offs, code.to(tl.uint8), mask=mask)
    tl.store(v_ptr + offs, jit_functions.e4m3_value(code), mask=mask)


def _every_e4m3_neighbourhood() -> torch.Tensor:
    """float32 values: every finite bfloat16 (all e4m3 ties among them), every e4m3 value, each
    midpoint between neighbours and one float32 ulp either side, float32 subnormals, values at
    and past 448 (inf too), +0 and -0."""
    bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    values = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    values = values[~values.isnan()].unique()
    mid = ((values[1:] + values[:-1]) / 2).contiguous()
    bits = mid.view(torch.int32)
    around = torch.cat([(bits - 1).view(torch.float32), mid, (bits + 1).view(torch.float32)])
    tiny = torch.tensor([1e-45, 1e-40, 5e-39, 1.1e-38, 2.0 ** -126, 2.0 ** -127, 2.0 ** -10, 2.0 ** -11])
    big = torch.tensor([447.99997, 448.0, 448.00003, 449.0, 464.0, 465.0, 479.0, 480.0, 1e6, 3e38, float("inf")])
    x = torch.cat([bf16, values, around, tiny, -tiny, big, -big, torch.tensor([0.0, -0.0])])
    return x[~x.isnan()].contiguous()


def test_the_e4m3_code_is_torchs_bit_for_bit(triton_jit):
    """e4m3_code(v) is torch's v.clamp(-448, 448).to(float8_e4m3fn) for every float32 that matters
    (round to nearest even, saturation, subnormals, signed zeros), e4m3_value its exact value."""
    x = _every_e4m3_neighbourhood()
    codes = torch.empty(x.shape, dtype=torch.uint8)
    values = torch.empty(x.shape)
    code_kernel[(triton.cdiv(x.numel(), 8192),)](x, codes, values, x.numel(), BLOCK=8192)
    expected = x.clamp(-448, 448).to(E4M3)
    wrong = codes != expected.view(torch.uint8)
    assert not wrong.any(), (x[wrong][:8], codes[wrong][:8], expected.view(torch.uint8)[wrong][:8])
    assert torch.equal(values.view(torch.int32), expected.float().view(torch.int32))  # -0.0 included
    assert (codes[x == 448.00003] == 0x7E).all() and (codes[x == -float("inf")] == 0xFE).all()
    nan = torch.full((4,), float("nan"))
    code_kernel[(1,)](nan, codes, values, 4, BLOCK=4)
    assert (codes[:4] & 0x7F).tolist() == [0x7F] * 4


def _activation_rows(k: int, dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(k)
    x = torch.randn(8, k, dtype=dtype) * 3
    x[1] = 0  # an all-zero row: the 1e-12 floor of the scale
    x[2, 7] = 6e4  # an outlier: every other code of its row is subnormal or zero
    x[3] = x[3] * 1e-12  # a row below the floor: scale 1e-12
    x[3, 0] = -0.0
    # A row with amax 448 (scale 1, exactly): x / scale is x, so the codes run over ties,
    # subnormals and negative zero as they are.
    grid = torch.arange(127, dtype=torch.uint8).view(E4M3).float()  # 0 .. 448
    ties = (grid[1:] + grid[:-1]) / 2
    row = torch.cat([grid, ties, -grid, -ties])[:k].to(dtype)
    x[4] = 0
    x[4, : row.numel()] = row
    x[4, -1] = 448
    x[5, 3] = -0.0
    # Amaxes where amax / (amax / 448) rounds above 448: the clamp (saturation) decides the code.
    amax = torch.linspace(1.0, 2.0, 4096).to(dtype).float().unique()
    over = amax[amax / (amax / 448) > 448]
    assert over.numel() > 0
    x[6] *= 0.01
    x[6, 0] = over[0].to(dtype)
    x[6, 1] = -over[0].to(dtype)
    x[7, 5] = -1e-3
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [576, 1000])
def test_the_fused_fp8_quantizer_is_float8_tensors_bit_for_bit(triton_jit, dtype, k):
    """Codes and scales as Float8Tensor's per-row dynamic path (fp8-dyn) gives them, and the
    fake-quantized activations as an fp8-int4 weight's simulate_input_quantization."""
    x = _activation_rows(k, dtype)
    codes, scale = triton_jit.quantize_rows_fp8(x)
    expected_codes, expected_scale = quantize_input_float8(x, "per_row", E4M3)
    assert codes.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (8, 1)
    wrong = codes.view(torch.uint8) != expected_codes.view(torch.uint8)
    assert not wrong.any(), (wrong.nonzero()[:5], x[wrong][:5])
    assert torch.equal(scale, expected_scale)
    w = Float8DynamicActivationFloat8WeightConfig().quantize_weight(torch.randn(16, k))
    assert torch.equal(w.quantize_input(x)[0].view(torch.uint8), codes.view(torch.uint8))
    fake = triton_jit.fake_quantize_rows_fp8(x)
    int4 = Float8DynamicActivationInt4WeightConfig().quantize_weight(torch.randn(16, k, dtype=dtype))
    expected = int4.simulate_input_quantization(x)
    assert fake.dtype == dtype and torch.equal(fake.view(torch.uint8), expected.view(torch.uint8))
    assert triton_jit.quantize_rows_fp8(x[:0])[0].shape == (0, k)
    assert triton_jit.fake_quantize_rows_fp8(x[:0]).shape == (0, k)


def test_the_cuda_rows_quantize_e4m3_rows_with_it(monkeypatch):
    """On a GPU with triton: fp8-dyn's _scaled_mm row and fp8-int4's tinygemm row take the fused
    quantizer (its custom op under torch.compile); e5m2, per-tensor and int8 activations do not."""
    from hf_aoq import Int8DynamicActivationInt4WeightConfig, PerTensor
    from hf_aoq.kernels import triton_kernels

    from test_cuda_contracts import fake_gpu

    launched = []

    def quantize(x2):
        launched.append("codes")
        return quantize_input_float8(x2, "per_row", E4M3)

    def fake_quantize(x2):
        launched.append("fake")
        codes, scale = quantize_input_float8(x2, "per_row", E4M3)
        return (codes.float() * scale).to(x2.dtype)

    w = torch.randn(64, 256, dtype=torch.bfloat16)
    weights = {
        "fp8-dyn": Float8DynamicActivationFloat8WeightConfig().quantize_weight(w),
        "fp8-int4": Float8DynamicActivationInt4WeightConfig().quantize_weight(w),
        "e5m2": Float8Tensor.from_float(w, torch.float8_e5m2, act_quant="per_row"),
        "per-tensor": Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()).quantize_weight(w),
        "int8-int4": Int8DynamicActivationInt4WeightConfig().quantize_weight(w),
    }
    with fake_gpu(monkeypatch):
        registry._CAPABLE[("cuda:triton", "cuda", 0)] = True
        monkeypatch.setattr(triton_kernels, "quantize_rows_fp8_op", quantize)
        monkeypatch.setattr(triton_kernels, "fake_quantize_rows_fp8_op", fake_quantize)
        for name, q in weights.items():
            on_gpu = q.to("cuda").place()
            for rows in (1, 17):
                x = torch.empty(rows, 256, dtype=torch.bfloat16, device="cuda")
                launched.clear()
                assert triton_kernels._e4m3_rows_fused(on_gpu, x) == (name in ("fp8-dyn", "fp8-int4")), name
                if name in ("fp8-dyn", "fp8-int4"):
                    kernel = registry.select_kernel("linear", x, on_gpu)
                    assert kernel.backend == "cuda", (name, kernel.name)
                    kernel.fn(x, on_gpu, None)
                    assert launched == ["codes" if name == "fp8-dyn" else "fake"], (name, rows, launched)
        on_cpu = weights["fp8-dyn"]
        assert not triton_kernels._e4m3_rows_fused(on_cpu, torch.empty(1, 256))  # CPU: torch's


COMPILE_FOR_H200 = triton_interpreter.RESOURCE_USAGE + """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_aoq.kernels import triton_jit

for x, rnd in (("*bf16", 2), ("*fp16", 1), ("*fp32", 0)):
    for codes, fake in ((True, False), (False, True)):
        signature = {"x_ptr": x, "q_ptr": "*u8", "s_ptr": "*fp32", "f_ptr": x, "K": "i32", "stride_xm": "i32",
                     "stride_qm": "i32", "stride_fm": "i32", "CODES": "constexpr", "FAKE": "constexpr",
                     "ROUND": "constexpr", "BLOCK_K": "constexpr"}
        constexprs = {"CODES": codes, "FAKE": fake, "ROUND": rnd, "BLOCK_K": triton_jit.QUANT_BLOCK_K}
        compiled = triton.compile(ASTSource(triton_jit.quantize_rows_fp8_kernel, signature, constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        check_fits(compiled, (x, codes, fake))
        # The code comes from the bits, not from a conversion instruction.
        assert "cvt.rn.satfinite.e4m3" not in compiled.asm["ptx"], (x, codes, fake)
print("ok")
"""


def test_the_quantizer_compiles_for_an_h200():
    """No register spill or shared-memory overflow on sm90 (triton.compile runs ptxas without a
    GPU), in a process of its own, without the interpreter."""
    triton_interpreter.compile_in_a_process(COMPILE_FOR_H200)


def test_the_interpreter_tests_run_somewhere():
    if triton_interpreter.is_interpreted():
        pytest.skip("the interpreter tests ran in this process")
    triton_interpreter.run_interpreted(__file__, "bit_for_bit or bit_for_bits")
