"""hf_aoq's NVFP4 CPU kernels (csrc/nvfp4.cpp, csrc/nvfp4_quant.cpp, kernels/cpu_nvfp4.py) against
the reference kernel.

The GEMV computes in float32 on the exactly decoded weight, the reference dequantizes to the
activation dtype and calls aten's GEMM, so the sums differ in order and in rounding: outputs are
compared within TOL[dtype] of sum(|x| |w|) per output (a few roundings of the result's dtype).
The decoded weights themselves are compared exactly, through one-hot activations, for every
e2m1 code and every e4m3 scale byte. The C++ dequantization and activation quantization are
compared bit for bit with tensors/nvfp4.py's, and the many-rows path (the reference's own
F.linear on them) gives the reference's outputs bit for bit."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_aoq.kernels import cpu_ext, cpu_nvfp4, select_kernel
from hf_aoq.kernels.reference import reference_linear
from hf_aoq.tensors import nvfp4
from hf_aoq.tensors.mx import _E2M1_MIDPOINTS
from hf_aoq.tensors.nvfp4 import NVFP4Tensor, nvfp4_dequantize

REPO_ROOT = Path(__file__).resolve().parents[2]
needs_ext = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's C++ extension is not built here")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}
E4M3 = torch.float8_e4m3fn


def gemv(x, w, bias=None):
    return cpu_nvfp4.nvfp4_linear_io(x, w.qdata, w.scale, w.per_tensor_scale, w.shape[-1], bias)


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


def nv_weight(n, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return NVFP4Tensor.from_float((torch.randn(n, k, generator=g) * torch.rand(n, k, generator=g) ** 3).to(dtype))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [64, 16, 2, 40, 96, 576, 2050])  # tails: partial chunks and a partial block
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 33, cpu_nvfp4.NVFP4_GEMV_MAX_ROWS])
def test_gemv_agrees_with_the_reference(dtype, k, rows):
    n = 37  # not a multiple of 4 or 16: row tails
    w = nv_weight(n, k, seed=k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    assert_close_to_reference(gemv(x, w), x, w)
    bias = torch.randn(n).to(dtype)
    assert_close_to_reference(gemv(x, w, bias), x, w, bias)


def weight_from(codes: torch.Tensor, scale_bytes: torch.Tensor, pts: float) -> NVFP4Tensor:
    n, k = codes.shape
    qdata = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return NVFP4Tensor(qdata, scale_bytes.to(torch.uint8).view(E4M3), torch.tensor(pts), (1, 16),
                       torch.Size((n, k)), torch.float32)


@needs_ext
@pytest.mark.parametrize("k, pts", [(96, 1.0), (72, 0.37), (48, 2.0 ** -100)])
def test_decoded_weights_are_exact_for_every_code_and_scale_byte(k, pts):
    # 256 scale bytes (subnormal e4m3, negative, the NaNs 0x7F / 0xFF included) over 256 // b rows
    # of b blocks; every row holds every e2m1 code in every block.
    b = -(-k // 16)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F])
    n = -(-len(finite) // b)
    scale = torch.cat([finite[torch.arange(n * b) % len(finite)].reshape(n, b),  # every finite byte
                       torch.tensor([[0x7F, 0xFF] * b])[:, :b]])  # and a row holding the NaNs
    n += 1
    codes = (torch.arange(k)[None, :] + torch.arange(n)[:, None]) % 16
    w = weight_from(codes, scale, pts)
    exact = nvfp4_dequantize(w.qdata, w.scale, w.per_tensor_scale, torch.float32)
    nan_rows = ((scale & 0x7F) == 0x7F).any(1)  # 0 times a NaN weight is NaN: the whole row's output
    for j in range(k):  # one-hot activations: y[:, n] is w[n, j], one product, no sum
        x = torch.zeros(1, k)
        x[0, j] = 1.0
        got = gemv(x, w)[0]
        assert torch.isnan(got[nan_rows]).all(), j
        assert torch.equal(got[~nan_rows], exact[~nan_rows, j]), j  # signed zeros aside (0 * -0 sums to +0)
    assert set(scale[~nan_rows].unique().tolist()) == set(range(256)) - {0x7F, 0xFF}


@needs_ext
def test_leading_dims_and_float32_bias_with_half_input():
    w = nv_weight(20, 96)
    x = torch.randn(2, 3, 96).to(torch.bfloat16)
    bias = torch.randn(20)
    y = gemv(x, w, bias)
    assert y.shape == (2, 3, 20)
    assert_close_to_reference(y.reshape(6, 20), x.reshape(6, 96), w, bias.to(torch.bfloat16))


@needs_ext
def test_the_table_picks_the_gemv_for_few_rows_and_dequantize_gemm_above():
    w = nv_weight(32, 64)
    small = torch.randn(cpu_nvfp4.NVFP4_GEMV_MAX_ROWS, 64)
    large = torch.randn(cpu_nvfp4.NVFP4_GEMV_MAX_ROWS + 1, 64)
    dyn = NVFP4Tensor.from_float(torch.randn(32, 64), "nvfp4")
    experts = NVFP4Tensor.from_float(torch.randn(2, 32, 64))
    for weight in (w, dyn, experts[1]):  # weight-only, dynamic activations, one expert of a 3-D weight
        assert select_kernel("linear", small, weight).name == "cpu_nvfp4_gemv"
        assert select_kernel("linear", large, weight).name == "cpu_nvfp4_dequant_gemm"
    y = F.linear(small.to(torch.bfloat16), w)  # through the tensor type's dispatch
    assert_close_to_reference(y, small.to(torch.bfloat16), w)


@needs_ext
@pytest.mark.parametrize("rows", [1, 7])
def test_torch_compile_agrees_with_eager_and_sees_one_custom_op(rows):
    w = nv_weight(40, 96)
    lin = torch.nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    lin.weight = torch.nn.Parameter(w.replace(dtype=torch.bfloat16), requires_grad=False)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = lin(x)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(lin, backend="inductor", fullgraph=True)(x), eager)
    assert compiled_hf_aoq_ops(lin, x, eager) == ["hf_aoq.nvfp4_linear_io_cpu.default"]


def compiled_hf_aoq_ops(lin, x, eager):
    """The hf_aoq custom ops in the graph of `lin` compiled with fullgraph=True, once its output on
    x is checked to equal `eager`."""
    from torch._dynamo.backends.common import aot_autograd

    ops = []

    def record(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    with torch.no_grad():
        torch._dynamo.reset()
        assert torch.equal(torch.compile(lin, backend=aot_autograd(fw_compiler=record), fullgraph=True)(x), eager)
    return [op for op in ops if op.startswith("hf_aoq.")]


@needs_ext
@pytest.mark.parametrize("rows, want", [(3, ["hf_aoq.nvfp4_linear_io_cpu.default"]),
                                        (80, ["hf_aoq.nvfp4_fake_quantize_cpu.default",
                                              "hf_aoq.nvfp4_dequantize_cpu.default"])])
def test_torch_compile_runs_the_dynamic_activation_kernels_as_opaque_ops(rows, want):
    lin = torch.nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    lin.weight = torch.nn.Parameter(NVFP4Tensor.from_float(torch.randn(40, 96, dtype=torch.bfloat16), "nvfp4"),
                                    requires_grad=False)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = lin(x)
    assert compiled_hf_aoq_ops(lin, x, eager) == want


def test_without_the_extension_the_reference_runs_eager_and_compiled():
    # A process of its own: HF_AOQ_NO_CPU_EXT is read once, when the extension would load.
    code = """
import torch, torch.nn.functional as F
from hf_aoq.kernels import cpu_ext, select_kernel
from hf_aoq.tensors.nvfp4 import NVFP4Tensor
assert not cpu_ext.available()
for w in (NVFP4Tensor.from_float(torch.randn(24, 80)), NVFP4Tensor.from_float(torch.randn(24, 80), "nvfp4")):
    for rows in (1, 5, 100):
        x = torch.randn(rows, 80, dtype=torch.bfloat16)
        assert select_kernel("linear", x, w).name == "reference"
        want = F.linear(w.simulate_input_quantization(x), w.dequantize(torch.bfloat16))
        assert torch.equal(F.linear(x, w), want)
        if rows == 5:
            lin = torch.nn.Linear(80, 24, bias=False)
            lin.weight = torch.nn.Parameter(w, requires_grad=False)
            torch._dynamo.reset()
            assert torch.equal(torch.compile(lin, fullgraph=True)(x), want)
experts = NVFP4Tensor.from_float(torch.randn(3, 24, 80))
x = torch.randn(70, 80)
for e in range(3):
    assert select_kernel("linear", x, experts[e]).name == "reference"
    assert torch.equal(F.linear(x, experts[e]), F.linear(x, experts.dequantize()[e]))
print("ok")
"""
    env = dict(os.environ, HF_AOQ_NO_CPU_EXT="1", PYTHONPATH=str(REPO_ROOT))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


# ---------------------------------------------------------------------- dequantize (many rows)
def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns (signed zeros differ), NaNs replaced by one pattern."""
    t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def assert_bits_equal(got, want, what=""):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(torch.isnan(got), torch.isnan(want)), what
    assert torch.equal(bits(got), bits(want)), (what, (got.float() - want.float()).abs().nan_to_num().max())


def cpu_dequantize(w, dtype):
    return cpu_nvfp4.nvfp4_dequantize(w.qdata, w.scale, w.per_tensor_scale, w.shape[-1], dtype)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k, pts", [(96, 1.0), (72, 0.37), (34, 2.0 ** -100), (30, 3.0e30), (2, 1.0), (2050, 0.011)])
def test_dequantize_is_the_references_bit_for_bit_for_every_code_and_scale_byte(dtype, k, pts):
    # Every scale byte (zero, e4m3 subnormals, the largest 0x7E = 448, negative ones, the NaNs),
    # every e2m1 code in every block; per-tensor scales that make subnormal products (2^-100),
    # products past float16's range (3e30) and odd widths (partial 32-element pairs and blocks).
    b = -(-k // 16)
    n = -(-256 // b)
    scale = (torch.arange(n * b) % 256).reshape(n, b)
    codes = (torch.arange(k)[None, :] + torch.arange(n)[:, None]) % 16
    w = weight_from(codes, scale, pts)
    assert_bits_equal(cpu_dequantize(w, dtype), w.dequantize(dtype), (k, pts))
    assert set(scale.unique().tolist()) == set(range(256))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_takes_3d_experts_each_with_its_per_tensor_scale(dtype):
    g = torch.Generator().manual_seed(3)
    w = NVFP4Tensor.from_float(torch.randn(3, 21, 80, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None])
    assert w.per_tensor_scale.unique().numel() == 3
    got = cpu_dequantize(w, dtype)
    assert_bits_equal(got, w.dequantize(dtype))
    for e in range(3):  # and each expert's 2-D view alone
        assert_bits_equal(cpu_dequantize(w[e], dtype), got[e])


@needs_ext
@pytest.mark.parametrize("act_quant", [None, "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_many_rows_equal_the_reference_exactly(act_quant, dtype):
    # Past the GEMV: the reference's own computation (the same activations, the same weight bits,
    # the same F.linear), so the same outputs bit for bit.
    w = NVFP4Tensor.from_float(torch.randn(40, 112), act_quant)
    for b in (None, torch.randn(40)):
        x = torch.randn(3, cpu_nvfp4.NVFP4_GEMV_MAX_ROWS, 112).to(dtype)
        assert select_kernel("linear", x, w).name == "cpu_nvfp4_dequant_gemm"
        assert_bits_equal(F.linear(x, w, b), reference_linear(x, w, b))


@needs_ext
def test_experts_take_the_fast_paths_expert_by_expert(monkeypatch):
    from hf_aoq import kernels

    t = NVFP4Tensor.from_float(torch.randn(3, 24, 64), "nvfp4")
    offs = torch.tensor([70, 72, 150], dtype=torch.int32)  # 70, 2 and 78 tokens
    x = torch.randn(150, 64, dtype=torch.bfloat16)
    picked = []
    select = kernels.select_kernel
    monkeypatch.setattr(kernels, "select_kernel", lambda op, x, w: picked.append(select(op, x, w).name) or select(op, x, w))
    out = F.grouped_mm(x, t.transpose(-2, -1), offs=offs)
    assert picked == ["cpu_nvfp4_dequant_gemm", "cpu_nvfp4_gemv", "cpu_nvfp4_dequant_gemm"]
    for e, (start, end) in enumerate([(0, 70), (70, 72), (72, 150)]):
        ref = reference_linear(x[start:end], t[e], None)
        if end - start > cpu_nvfp4.NVFP4_GEMV_MAX_ROWS:
            assert_bits_equal(out[start:end], ref)
        else:
            assert_close_to_reference(out[start:end], t[e].simulate_input_quantization(x[start:end]), t[e])


# ---------------------------------------------------------------------- dynamic activations
def tie_rows(dtype) -> torch.Tensor:
    """Rows whose quantization hits every corner: with 2688 in the tensor its per-tensor scale is 1,
    so a block of amax 6 * s has the e4m3 scale s and q = x / s exactly; the first rows put q on
    every e2m1 midpoint (ties) of either sign. Then zeros of both signs, an all-zero block, a
    block of tiny values, large values, a partial block (K = 40)."""
    k = 40
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    rows = []
    for s in (1.0, 0.5, 2.0 ** -6, 2.0 ** -9, 448.0, 3.3):  # the floor, below it (clamped), the max, not e4m3
        r = torch.cat([torch.tensor([6.0 * s]), mids * s, -mids * s, torch.tensor([-6.0 * s])])  # 16
        rows.append(torch.cat([r, -r.flip(0), r[:8]]))
    rows.append(torch.cat([torch.tensor([2688.0]), torch.zeros(15), -torch.zeros(16), torch.full((8,), 1e-30)]))
    g = torch.Generator().manual_seed(0)
    rows.append(torch.randn(k, generator=g) * 300)
    rows.append(torch.randint(-64, 64, (k,), generator=g).float() / 16)
    return torch.stack(rows).to(dtype)


def random_rows(dtype, k, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, k, generator=g) * torch.rand(6, k, generator=g) ** 4 * torch.logspace(-3, 3, 6)[:, None]
    x[1, :16] = 0.0
    return x.to(dtype)


def activation_mismatches(x) -> list[str]:
    """What the C++ activation quantization gets wrong against the reference (tensors/nvfp4.py),
    by name: the codes and scales of nvfp4_quantize, and simulate_input_quantization's values."""
    wrong = []
    p = nvfp4.per_tensor_scale_of(x)
    q, s = cpu_nvfp4.nvfp4_quantize(x, p)
    qr, sr = nvfp4.nvfp4_quantize(x, p)
    if not (q.shape == qr.shape and torch.equal(q, qr)):
        wrong.append("codes")
    if not (s.dtype == sr.dtype and torch.equal(s.view(torch.uint8), sr.view(torch.uint8))):
        wrong.append("scales")
    fake = cpu_nvfp4.nvfp4_fake_quantize(x)
    want = NVFP4Tensor.from_float(torch.ones(2, x.shape[-1]), "nvfp4").simulate_input_quantization(x)
    if not (fake.dtype == want.dtype and torch.equal(torch.isnan(fake), torch.isnan(want))
            and torch.equal(bits(fake), bits(want))):
        wrong.append("values")
    return wrong


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_activation_quantization_is_the_references_bit_for_bit(dtype):
    cases = [tie_rows(dtype), tie_rows(dtype)[:, :16] * 1e-3, torch.zeros(3, 32, dtype=dtype),
             -torch.zeros(2, 16, dtype=dtype)]
    cases += [random_rows(dtype, k, k) for k in (2, 16, 30, 96, 1000)]
    big = torch.randn(4, 64) * (3e38 if dtype == torch.float32 else 6e4)  # amax near the dtype's largest
    cases.append(big.to(dtype))
    cases.append(torch.full((2, 32), 2.0 ** -140 if dtype == torch.float32 else 2.0 ** -20).to(dtype))  # subnormal
    nonfinite = random_rows(dtype, 48, 1)
    nonfinite[0, 3], nonfinite[2, 20], nonfinite[4, 47] = math.inf, math.nan, -math.inf
    cases.append(nonfinite)
    cases.append(torch.randn(2, 3, 64).to(dtype))  # leading dimensions
    for i, x in enumerate(cases):
        assert activation_mismatches(x) == [], (i, dtype)
    assert cpu_nvfp4.nvfp4_fake_quantize(nonfinite)[0, :16].isnan().all()
    assert cpu_nvfp4.nvfp4_fake_quantize(x[:0]).shape == (0, 3, 64)


def test_the_ties_and_edges_are_really_there():
    x = tie_rows(torch.float32)
    p = nvfp4.per_tensor_scale_of(x)
    assert p.item() == 1.0
    _, s = nvfp4.nvfp4_quantize(x, p)
    q = (x[:6, :32].reshape(6, 2, 16) / s.float()[:6, :2, None]).abs()
    assert set(q.unique().tolist()) >= {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0}
    # The 2^-6 floor (the all-zero block; 2^-9 * 6 clamped up to it), the largest, 3.3 rounded (3.25).
    assert {0x08, 0x7E, 0x45} <= set(s.view(torch.uint8).unique().tolist())
    assert (x[6, 16:32] == 0).all() and torch.signbit(x[6, 16:32]).all()


@needs_ext
@pytest.mark.parametrize("mutant", ["ties_away", "per_tensor_scale_one_ulp_up", "inf_in_the_amax", "unclamped_scale"])
def test_a_wrong_reference_rule_fails_the_comparison(mutant, monkeypatch):
    # Each rule of the reference changed in turn: the same sweep must see the C++ differ, so the
    # sweep exercises that rule (and would catch the C++ getting it wrong).
    mids = torch.tensor(_E2M1_MIDPOINTS)
    real_encode, real_pts = nvfp4.encode_e2m1, nvfp4.per_tensor_scale_of
    if mutant == "ties_away":  # a tie takes the larger magnitude
        monkeypatch.setattr(nvfp4, "encode_e2m1", lambda q: torch.where(
            torch.isin(q.abs(), mids), real_encode(q * (1 + 2 ** -20)), real_encode(q)))
    elif mutant == "per_tensor_scale_one_ulp_up":  # amax / 2688 rounded differently
        monkeypatch.setattr(nvfp4, "per_tensor_scale_of", lambda x: torch.nextafter(real_pts(x), torch.tensor(1e30)))
    elif mutant == "inf_in_the_amax":
        monkeypatch.setattr(nvfp4, "per_tensor_scale_of", lambda x: real_pts(torch.nan_to_num(x.float(), posinf=1e6)))
    else:  # no floor at 2^-126: an all-zero activation gets p = 0
        monkeypatch.setattr(nvfp4, "per_tensor_scale_of",
                            lambda x: x.detach().abs().float().nan_to_num(posinf=0).amax() / 2688.0)
    cases = [tie_rows(torch.float32), torch.zeros(2, 32), random_rows(torch.float32, 96, 5)]
    nonfinite = random_rows(torch.float32, 48, 1)
    nonfinite[0, 3] = math.inf
    cases.append(nonfinite)
    assert any(activation_mismatches(x) for x in cases), mutant


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 16, cpu_nvfp4.NVFP4_GEMV_MAX_ROWS])
def test_dynamic_activation_gemv_agrees_with_the_reference(dtype, rows):
    for k in (96, 40, 2050):
        w = NVFP4Tensor.from_float(torch.randn(37, k), "nvfp4")
        x = random_rows(dtype, k, rows).repeat(-(-rows // 6), 1)[:rows]
        assert select_kernel("linear", x, w).name == "cpu_nvfp4_gemv"
        bias = torch.randn(37).to(dtype)
        xq = w.simulate_input_quantization(x)
        assert_close_to_reference(F.linear(x, w), xq, w)
        assert_close_to_reference(F.linear(x, w, bias), xq, w, bias)
        # The GEMV on the reference's quantized activations as a weight-only call: the same sums.
        assert torch.equal(F.linear(x, w), gemv(xq, w))
