"""The int4 kernels' integer path (csrc/int4_pairs.h, half-precision activations as int16 codes)
on every row step it has: the AVX-512 build's 64-row step (csrc/int4_pairs512.h, two full
32-row blocks per 512-bit register), the 32-row block code and the 16-row tail block's scalar
code. Int4Tensor (scale and zero in float32, bfloat16 or float16) and Int4DQTensor (the command
line's default `int4` scheme), 1-8 activation rows and a few more, odd numbers of groups.

Each output goes through the same operations whichever step computes it (exact int32 sums, then
the same float32 multiplies and adds), so moving a weight row to another step (permuting the
weight's rows) must move its output and change no bit. That holds in each build (AVX2 or
AVX-512), and tests/kernels/test_cpu_isa.py's slow test checks the builds against each other.
Every step is also checked against the definition (int16_activation_linear)."""
import pytest
import torch
import torch.nn.functional as F

from hf_aoq import Int4DQTensor, Int4Tensor
from hf_aoq.kernels import cpu, cpu_ext, cpu_gemm

from conftest import int16_activation_linear

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's CPU extension is not built here")

# Rows: a 64-row step and a 32-row block (96); a step, a block and a 16-row tail (112); a step
# and a tail (80); three steps and a tail (208).
N_ROWS = (64, 80, 96, 112, 208)
KG = ((96, 32), (160, 32), (320, 64))  # 3, 5 and 5 groups
M_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17)
FORMATS = ("int4 float32", "int4 bfloat16", "int4 float16", "int4dq")


def quantize(fmt: str, w: torch.Tensor, g: int):
    if fmt == "int4dq":
        return Int4DQTensor.from_float(w, g).place()
    return Int4Tensor.from_float(w.to(getattr(torch, fmt.split()[1])), g).place()


def int16_linear(q, x: torch.Tensor) -> torch.Tensor:
    """The kernel's int16-code path on float32 rows x (holding half-precision values)."""
    ext, g = cpu_ext.load(), q.block_size[-1]
    xp = F.pad(x, (0, q.qdata.shape[1] * 2 - x.shape[1]))
    if isinstance(q, Int4DQTensor):
        return ext.int4dq_linear(xp, q.qdata, q.gparams, q.rparams, q.tparams, g, cpu.INT4_GEMV_MAX_ROWS, True)
    return ext.int4pack_linear(xp, q.qdata, q.scale, g, cpu.INT4_GEMV_MAX_ROWS, True)


def rel_err(expected, got):
    return float((expected.float() - got.float()).norm() / expected.float().norm())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", N_ROWS)
@pytest.mark.parametrize("k,g", KG)
def test_every_row_step_computes_the_definition(fmt, n, k, g):
    torch.manual_seed(n + k)
    q = quantize(fmt, torch.randn(n, k) * 0.05, g)
    w = q.dequantize(torch.float32)
    for m in M_ROWS:
        x = torch.randn(m, k).bfloat16().float()
        x[0, :g] *= 50  # an outlier group keeps its own step
        got = int16_linear(q, x)
        assert got.shape == (m, n)
        expected, bound = int16_activation_linear(x, w, g)
        assert rel_err(expected, got) < 1e-6, m
        exact = x.double() @ w.double().t()
        assert ((got - exact).abs() <= bound + 1e-6 * exact.abs().max()).all(), m
        # A row's outputs do not depend on the rows computed with it (the tiles of rows).
        assert torch.equal(int16_linear(q, x[-1:]), got[-1:]), m


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_output_does_not_depend_on_which_step_computes_it(fmt, dtype):
    """112 rows: a 64-row step (rows 0-63), a 32-row block (64-95), a 16-row tail (96-111). The
    permutation puts each original row into another step (0-15 into the tail, 16-79 into the
    step and the block, 80-111 into the step): the outputs move with their rows, bit for bit."""
    n, k, g = 112, 160, 32
    torch.manual_seed(7)
    w = torch.randn(n, k) * 0.05
    perm = torch.cat([torch.arange(16, 112), torch.arange(0, 16)])
    q, qp = quantize(fmt, w, g), quantize(fmt, w[perm], g)
    assert torch.equal(qp.dequantize(torch.float32), q.dequantize(torch.float32)[perm])  # the same weight rows
    for m in M_ROWS:
        x = torch.randn(m, k, dtype=dtype)
        y = F.linear(x, q)
        assert torch.equal(F.linear(x, qp), y[:, perm]), m
        assert torch.equal(int16_linear(qp, x.float()), int16_linear(q, x.float())[:, perm]), m


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_f_linear_at_decode_rows_against_the_reference(fmt, dtype):
    """Through F.linear (the kernel table's choice below the bf16-GEMM rows), with a bias: close
    to the reference (dequantize, then F.linear in x's dtype), which rounds the weight and the
    products to x's dtype where the kernels do not."""
    n, k, g = 112, 320, 64
    torch.manual_seed(3)
    q = quantize(fmt, torch.randn(n, k) * 0.05, g)
    bias = torch.randn(n, dtype=dtype)
    w = q.dequantize(torch.float32)
    for m in (1, 4, 8, 16):
        assert m < cpu_gemm.min_rows("int4")
        x = torch.randn(2, m, k, dtype=dtype)
        y = F.linear(x, q, bias)
        assert y.dtype == dtype and y.shape == (2, m, n)
        exact = x.double() @ w.double().t() + bias.double()
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert rel_err(exact, y) < tol, m


# Row counts whose steps the two threads split unevenly (272 rows: four 64-row steps and a unit
# holding a 16-row tail, 3 + 2) or evenly with a tail (336: five steps and a tail, 3 + 3); a
# single group (K = 32: the parameter prefetch, kInt4ParamPrefetch groups ahead, wraps past the
# next steps and past the tensor's end) and a few groups of 128 (the code prefetch, 2 KB ahead,
# runs past each step's streams and the tensor's end).
SPLITS = ((272, 32, 32), (336, 96, 32), (80, 384, 128), (272, 256, 128))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,g", SPLITS)
def test_two_threads_and_the_prefetch_change_no_bit(fmt, n, k, g):
    """The row steps split between two threads give the one-thread outputs bit for bit (each
    output's sum is computed by one thread, in one order), at the decode rows and a batch, and
    both match the definition near the tensor's end, where the prefetches point past it."""
    if fmt == "int4dq":
        g = min(g, 64)  # its largest group
    torch.manual_seed(n + k + g)
    q = quantize(fmt, torch.randn(n, k) * 0.05, g)
    w = q.dequantize(torch.float32)
    threads = torch.get_num_threads()
    try:
        for m in (1, 3, 4, 16):
            x = torch.randn(m, k).bfloat16().float()
            torch.set_num_threads(1)
            one = int16_linear(q, x)
            torch.set_num_threads(2)
            two = int16_linear(q, x)
            assert torch.equal(one, two), m
            expected, _ = int16_activation_linear(x, w, g)
            assert rel_err(expected, two) < 1e-6, m
    finally:
        torch.set_num_threads(threads)
