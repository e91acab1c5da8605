"""hf_aoq's NVFP4 CPU GEMV (csrc/nvfp4.cpp, kernels/cpu_nvfp4.py) against the reference kernel.

The GEMV computes in float32 on the exactly decoded weight, the reference dequantizes to the
activation dtype and calls aten's GEMM, so the sums differ in order and in rounding: outputs are
compared within TOL[dtype] of sum(|x| |w|) per output (a few roundings of the result's dtype).
The decoded weights themselves are compared exactly, through one-hot activations, for every
e2m1 code and every e4m3 scale byte."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_aoq.kernels import cpu_ext, cpu_nvfp4, select_kernel
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
def test_the_table_picks_the_gemv_only_where_it_applies():
    w = nv_weight(32, 64)
    small = torch.randn(cpu_nvfp4.NVFP4_GEMV_MAX_ROWS, 64)
    assert select_kernel("linear", small, w).name == "cpu_nvfp4_gemv"
    assert select_kernel("linear", torch.randn(cpu_nvfp4.NVFP4_GEMV_MAX_ROWS + 1, 64), w).name == "reference"
    dyn = NVFP4Tensor.from_float(torch.randn(32, 64), "nvfp4")
    assert select_kernel("linear", small, dyn).name == "reference"
    y = F.linear(small.to(torch.bfloat16), w)  # through the tensor type's dispatch
    assert_close_to_reference(y, small.to(torch.bfloat16), w)
    experts = NVFP4Tensor.from_float(torch.randn(2, 32, 64))
    assert select_kernel("linear", small, experts[1]).name == "cpu_nvfp4_gemv"


@needs_ext
@pytest.mark.parametrize("rows", [1, 7])
def test_torch_compile_agrees_with_eager_and_sees_one_custom_op(rows):
    from torch._dynamo.backends.common import aot_autograd

    w = nv_weight(40, 96)
    lin = torch.nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    lin.weight = torch.nn.Parameter(w.replace(dtype=torch.bfloat16), requires_grad=False)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    ops = []

    def record(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    with torch.no_grad():
        eager = lin(x)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(lin, backend="inductor", fullgraph=True)(x), eager)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(lin, backend=aot_autograd(fw_compiler=record), fullgraph=True)(x), eager)
    assert [op for op in ops if op.startswith("hf_aoq.")] == ["hf_aoq.nvfp4_linear_io_cpu.default"], ops


def test_without_the_extension_the_reference_runs_eager_and_compiled():
    # A process of its own: HF_AOQ_NO_CPU_EXT is read once, when the extension would load.
    code = """
import torch, torch.nn.functional as F
from hf_aoq.kernels import cpu_ext, select_kernel
from hf_aoq.tensors.nvfp4 import NVFP4Tensor
assert not cpu_ext.available()
w = NVFP4Tensor.from_float(torch.randn(24, 80))
for rows in (1, 5):
    x = torch.randn(rows, 80, dtype=torch.bfloat16)
    assert select_kernel("linear", x, w).name == "reference"
    want = F.linear(x, w.dequantize(torch.bfloat16))
    assert torch.equal(F.linear(x, w), want)
    lin = torch.nn.Linear(80, 24, bias=False)
    lin.weight = torch.nn.Parameter(w, requires_grad=False)
    assert torch.equal(torch.compile(lin, fullgraph=True)(x), want)
print("ok")
"""
    env = dict(os.environ, HF_AOQ_NO_CPU_EXT="1", PYTHONPATH=str(REPO_ROOT))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
