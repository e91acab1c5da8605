"""Float8 weights x bf16 activations on AVX512-BF16's dot products (kernels/cpu_fp8_dot.py,
csrc/fp8.cpp fp8_dpbf16_linear): every code becomes its exact bf16 value, the sums are float32 and
each output is (sum x row scale + bias) rounded once; a row's outputs do not depend on the rows
beside it; the outputs agree with the reference kernel within its rounding of the weight to bf16;
the kernel table takes the row only where it applies. Skipped, saying why, where the avx512 build
or AVX512-VBMI is missing."""
from __future__ import annotations

import pytest
import torch

from hf_aoq import Float8Tensor
from hf_aoq.kernels import cpu_ext, cpu_fp8_dot, cpu_isa, registry, select_kernel
from hf_aoq.kernels.build_cache import cpu_features
from hf_aoq.kernels.reference import reference_linear
from hf_aoq.tensors.float8 import PerTensor

_HERE = f"({cpu_isa.describe()['flags']}, extension {cpu_ext.chosen_isa()})"
RUNS = (cpu_isa.avx512_allowed() and cpu_ext.available() and cpu_ext.chosen_isa() == "avx512"
        and "avx512vbmi" in cpu_features())
needs_kernel = pytest.mark.skipif(not RUNS, reason=f"no avx512 build with AVX512-VBMI here {_HERE}: skipped")
# Where the table takes it: AVX512-BF16 without AMX (AMX machines keep their tiles and GEMV).
TABLE = RUNS and cpu_isa.bf16_gemm_isa() == "avx512_bf16"
MIN_ROWS, MAX_ROWS = cpu_fp8_dot.FP8_DPBF16_MIN_ROWS, cpu_fp8_dot.FP8_DPBF16_MAX_ROWS
SHIFT = {torch.float8_e4m3fn: 20, torch.float8_e5m2: 21}


def _call(x, w, bias=None):
    return cpu_fp8_dot.fp8_dpbf16(x, w, bias)


def _exact(x: torch.Tensor, w: Float8Tensor, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact outputs (float64: x . codes x row scale + bias) and a bound on each one's float32
    summation error (K x 2^-23 of the sum of |products|)."""
    codes = w.qdata.double()
    scale = w.scale.reshape(-1).double().expand(codes.shape[0])
    x2 = x.reshape(-1, x.shape[-1]).double()
    y = (x2 @ codes.t()) * scale
    if bias is not None:
        y = y + bias.double()
    mags = (x2.abs() @ codes.abs().t()) * scale
    return y, mags * codes.shape[1] * 2.0 ** -23


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("rows,n,k", [(1, 7, 45), (2, 64, 64), (4, 9, 600), (6, 33, 1030), (7, 64, 2048),
                                      (13, 12, 1100), (24, 40, 3000)])
def test_one_rounding_of_the_exact_sum(dtype, rows, n, k):
    # N not a multiple of 4 (the last block's rows repeat), K neither of 32 nor 64 and past a
    # chunk of 1024, rows across the 6-row tiles: each output within one bf16 rounding (half an
    # ulp, 2^-8 of the value at most) of the exact value, besides float32's few roundings and the
    # summation's bound.
    torch.manual_seed(rows * 1000 + k)
    w = Float8Tensor.from_float(torch.randn(n, k) * 0.05, dtype)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    bias = torch.randn(n)
    for b in (None, bias):
        y = _call(x, w, b)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        exact, slack = _exact(x, w, b)
        assert ((y.double() - exact).abs() <= exact.abs() * (2.0 ** -8 + 2.0 ** -21) + slack * 1.01).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_code_is_its_exact_value(dtype):
    # Weight row c holds code c at column 37 and zeros elsewhere; x picks column 37: each output is
    # the code's value exactly (subnormal codes, the largest, both zeros' sign aside, inf, NaN).
    k = 100
    codes = torch.zeros(256, k, dtype=torch.uint8)
    codes[:, 37] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    w = Float8Tensor(codes.view(dtype), torch.ones(256, 1), (1, k), (256, k), torch.float32)
    x = torch.zeros(3, k, dtype=torch.bfloat16)
    x[:, 37] = 1
    y = _call(x, w)
    want = codes[:, 37].view(dtype).float()
    for row in y.float():
        assert ((row == want) | (row.isnan() & want.isnan())).all()
    assert want.isnan().any() and (dtype == torch.float8_e4m3fn or want.isinf().any())


@needs_kernel
def test_rows_do_not_depend_on_the_rows_beside_them():
    torch.manual_seed(3)
    w = Float8Tensor.from_float(torch.randn(70, 1500) * 0.05)
    x = torch.randn(MAX_ROWS, 1500, dtype=torch.bfloat16)
    alone = torch.cat([_call(x[i:i + 1], w) for i in range(MAX_ROWS)])
    for m in range(2, MAX_ROWS + 1):
        assert torch.equal(_call(x[:m], w), alone[:m]), m


@needs_kernel
@pytest.mark.parametrize("rows", [1, 8, MAX_ROWS])
def test_outputs_agree_with_the_reference_kernel(rows):
    # The reference rounds code x scale to bf16 before its float32 sums: within a few bf16
    # roundings of the output. Per-row and per-tensor scales, a 3-D input, a bias.
    torch.manual_seed(rows)
    for w in (Float8Tensor.from_float(torch.randn(128, 512) * 0.05),
              Float8Tensor.from_float(torch.randn(128, 512) * 0.05, torch.float8_e5m2, PerTensor())):
        x = torch.randn(2, rows, 512, dtype=torch.bfloat16)
        bias = torch.randn(128, dtype=torch.bfloat16)
        y, ref = _call(x, w, bias), reference_linear(x, w, bias)
        assert y.shape == ref.shape == (2, rows, 128)
        scale = ref.float().abs().mean()
        assert ((y.float() - ref.float()).abs() <= 2 ** -6 * (ref.float().abs() + scale)).all()


@needs_kernel
def test_what_it_does_not_take_is_refused_by_name():
    w = Float8Tensor.from_float(torch.randn(64, 256))
    codes, scale = w.qdata.view(torch.uint8), w.scale.reshape(-1).float().contiguous()
    ext = cpu_ext.load()
    with pytest.raises(RuntimeError, match="x: contiguous bfloat16"):
        ext.fp8_dpbf16_linear(torch.randn(2, 256), codes, scale, 20, None)
    with pytest.raises(RuntimeError, match="disagree on K: 255 and 256"):
        ext.fp8_dpbf16_linear(torch.randn(2, 255, dtype=torch.bfloat16), codes, scale, 20, None)
    with pytest.raises(RuntimeError, match=r"scale: float32 \[64\]"):
        ext.fp8_dpbf16_linear(torch.randn(2, 256, dtype=torch.bfloat16), codes, scale[:3], 20, None)
    with pytest.raises(RuntimeError, match="shift: 20"):
        ext.fp8_dpbf16_linear(torch.randn(2, 256, dtype=torch.bfloat16), codes, scale, 7, None)
    y = ext.fp8_dpbf16_linear(torch.randn(0, 256, dtype=torch.bfloat16), codes, scale, 20, None)
    assert y.shape == (0, 64) and y.dtype == torch.bfloat16


def test_the_table_takes_it_for_few_bf16_rows():
    w = Float8Tensor.from_float(torch.randn(64, 256))
    names = {m: select_kernel("linear", torch.randn(1, m, 256, dtype=torch.bfloat16), w).name
             for m in (1, MIN_ROWS, 8, MAX_ROWS, MAX_ROWS + 1)}
    if not TABLE:
        assert "cpu_fp8_dpbf16" not in names.values()
        return
    assert all(names[m] == "cpu_fp8_dpbf16" for m in (MIN_ROWS, 8, MAX_ROWS)), names
    assert names[1] == "cpu_fp8_gemv" and names[MAX_ROWS + 1] == "cpu_fp8_avx512bf16", names
    # Other activation dtypes, and float8 formats it has no table for: other rows.
    for dtype in (torch.float32, torch.float16):
        assert select_kernel("linear", torch.randn(2, 256, dtype=dtype), w).name != "cpu_fp8_dpbf16"
    assert registry.capable(next(k for k in registry.kernels_for("linear", "Float8Tensor")
                                 if k.name == "cpu_fp8_dpbf16").needs, torch.device("cpu"))


@pytest.mark.skipif(not TABLE, reason=f"the table does not take the row here {_HERE}")
def test_f_linear_runs_it_eagerly_and_compiled():
    torch.manual_seed(5)
    w = Float8Tensor.from_float(torch.randn(96, 256) * 0.05)
    bias = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(2, 4, 256, dtype=torch.bfloat16)
    assert select_kernel("linear", x, w).name == "cpu_fp8_dpbf16"
    eager = torch.nn.functional.linear(x, w, bias)
    assert torch.equal(eager, _call(x, w, bias))
    compiled = torch.compile(lambda x: torch.nn.functional.linear(x, w, bias), fullgraph=True)(x)
    assert torch.equal(compiled, eager)
    # An input whose rows are not contiguous (a transposed view): the same bits as its copy.
    xt = torch.randn(256, 3, dtype=torch.bfloat16).t()
    assert torch.equal(torch.nn.functional.linear(xt, w, bias), _call(xt.contiguous(), w, bias))
