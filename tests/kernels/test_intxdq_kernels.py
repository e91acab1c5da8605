"""hf_aoq's IntxDQTensor CPU kernels (csrc/intx.cpp's IntxTensor kernels with Int4DQ's group
grid, kernels/cpu_intx.py) against the tensor's own reference: its dequantize (bit for bit) and
a float64 product of that weight (within the kernels' tolerance). Both widths, both group sizes,
partial last groups, the three activation dtypes, row counts on both sides of the GEMV's
crossover, with the CPU packing's decoded row table and without (decoded per call), eager and
torch.compile, and the table's rows. The AVX2 and AVX-512 builds are compared in
test_intx_kernels.py's two-build test, whose outputs include IntxDQ weights.

Tolerances are relative to sum(|x| |w|) per output: weight-only activations become int16 codes per
group (each within 1/65534 of the group's largest |x|), then the output's rounding."""
import pytest
import torch

from hf_aoq import IntxDQTensor
from hf_aoq.kernels import cpu_amx, cpu_ext, cpu_gemm, cpu_intx, cpu_isa, registry

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's C++ extension is not built here")

OUT_TOL = {torch.float32: 0.0, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}
ACT_TOL = 5e-4


def make_weight(n, k, bits, g, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * (1 + torch.rand(n, 1, generator=gen) * 3)
    w[:, :7] *= 6  # loud columns: groups with very different ranges
    return IntxDQTensor.from_float(w.to(dtype), bits, g)


def run(x, w, bias=None):
    return cpu_intx.intxdq_linear_io(x, w.qdata, w.gparams, w.rparams, w.tparams, w.bits, w.group_size, w.shape[1],
                                     bias)


def assert_close(y, x, w, bias=None):
    x64 = x.reshape(-1, x.shape[-1]).double()
    w64 = w.dequantize(torch.float32).double()
    ref = x64 @ w64.t()
    bound = x64.abs() @ w64.abs().t()
    if bias is not None:
        ref = ref + bias.double()
        bound = bound + bias.double().abs()
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    err = (y.reshape(ref.shape).double() - ref).abs()
    tol = (ACT_TOL + OUT_TOL[x.dtype]) * bound + OUT_TOL[x.dtype] * ref.abs() + 1e-30
    assert (err <= tol).all(), f"max error {(err / (bound + 1e-30)).max():.3g} of sum |x||w|"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g", [32, 64])
@pytest.mark.parametrize("bits", [2, 3])
def test_dequantize_is_the_references_bit_for_bit(bits, g, dtype):
    w = make_weight(37, 200, bits, g, seed=bits + g)  # 200: a partial last group, a partial last byte at 3 bits
    got = cpu_intx.intxdq_dequantize(w.qdata, w.gparams, w.rparams, w.tparams, bits, g, 200, dtype)
    assert torch.equal(got, w.dequantize(dtype))


@pytest.mark.parametrize("g", [32, 64])
@pytest.mark.parametrize("bits", [2, 3])
def test_every_code_is_decoded_exactly(bits, g):
    # One-hot activations are exact int16 codes: row i of the output is column i of the weight to
    # within float32 rounding (far below one code's step), for every column, on the GEMV.
    k = 392
    w = make_weight(23, k, bits, g, seed=bits)
    dense = w.dequantize(torch.float32).double().t()
    step = float(w.group_grid()[0].abs().max())
    for k0 in range(0, k, cpu_intx.INTX_GEMV_MAX_ROWS):
        cols = torch.arange(k0, min(k, k0 + cpu_intx.INTX_GEMV_MAX_ROWS))
        x = torch.zeros(len(cols), k)
        x[torch.arange(len(cols)), cols] = 1.0
        y = run(x, w).double()
        assert torch.allclose(y, dense[cols], rtol=0, atol=1e-5 * step * 2 ** bits), k0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 3, 5, 17, cpu_intx.INTX_GEMV_MAX_ROWS, cpu_intx.INTX_GEMV_MAX_ROWS + 1])
def test_rows_dtypes_and_bias(rows, dtype):
    # Up to INTX_GEMV_MAX_ROWS the integer GEMV; above, the float32 dequantize + GEMM.
    for bits, g in ((2, 32), (3, 64), (3, 32)):
        w = make_weight(19, 330, bits, g, seed=rows + bits)
        x = torch.randn(1, rows, 330, generator=torch.Generator().manual_seed(bits)).to(dtype)
        bias = torch.randn(19).to(dtype)
        assert_close(run(x, w, bias), x, w, bias)
        assert_close(run(x, w), x, w)


def cpu_amx_engines() -> list[bool]:
    """The panel GEMM's engines this machine runs (tiles: AMX; else AVX512-BF16's dot products)."""
    engines = [True] if cpu_isa.amx_bf16_allowed() and cpu_ext.load().amx_available() else []
    return engines + ([False] if cpu_isa.avx512_allowed() and cpu_ext.chosen_isa() == "avx512" else [])


def test_the_packings_row_table_gives_the_bits_of_the_decode_per_call():
    # The CPU packing appends the decoded row table to tparams ([2 + 4N]); a canonical weight's [2]
    # is decoded per call. Every path reads the same table: the GEMV (2 rows), the float32 chunks
    # (70 rows, above INTX_GEMV_MAX_ROWS), the dequantization and the panel rows (cpu_amx).
    w = make_weight(64, 256, 3, 32)
    packed = cpu_intx.pack_intxdq_for_cpu(w)
    table = cpu_ext.load().int4dq_row_params(w.rparams, w.tparams)
    assert packed.packing == "cpu_intxdq" and packed.tparams.shape == (2 + 4 * 64,)
    assert torch.equal(packed.tparams[:2], w.tparams) and torch.equal(packed.tparams[2:].view(64, 4), table)
    for rows in (2, 70):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        assert torch.equal(run(x, packed), run(x, w)), rows
    assert torch.equal(cpu_intx.intxdq_dequantize(packed.qdata, packed.gparams, packed.rparams, packed.tparams, 3, 32,
                                                  256, torch.bfloat16), w.dequantize(torch.bfloat16))
    x = torch.randn(40, 256, dtype=torch.bfloat16)
    for tiles in cpu_amx_engines():
        assert torch.equal(cpu_amx._intxdq(x, packed, None, tiles), cpu_amx._intxdq(x, w, None, tiles)), tiles
    assert torch.equal(cpu_intx.unpack_intxdq_from_cpu(packed).tparams, w.tparams)
    # A table of another length is no table: the [2] check refuses it.
    with pytest.raises(RuntimeError, match="tparams"):
        run(x, packed.replace(tparams=packed.tparams[:-1].clone()))


def test_bad_fields_are_refused():
    w = make_weight(8, 64, 3, 32)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="qdata"):
        cpu_intx.intxdq_linear_io(x, w.qdata[:, :-1].contiguous(), w.gparams, w.rparams, w.tparams, 3, 32, 64, None)
    with pytest.raises(RuntimeError, match="gparams"):
        cpu_intx.intxdq_linear_io(x, w.qdata, w.gparams[:, :1].contiguous(), w.rparams, w.tparams, 3, 32, 64, None)
    with pytest.raises(RuntimeError, match="rparams"):
        cpu_intx.intxdq_linear_io(x, w.qdata, w.gparams, w.rparams[:4], w.tparams, 3, 32, 64, None)
    with pytest.raises(RuntimeError, match="tparams"):
        cpu_intx.intxdq_linear_io(x, w.qdata, w.gparams, w.rparams, w.tparams.double(), 3, 32, 64, None)


# ---------------------------------------------------------------------- the table rows
@pytest.mark.parametrize("bits,g", [(2, 32), (3, 32), (3, 64)])
def test_f_linear_runs_the_kernel_and_agrees_with_the_reference_kernel(bits, g):
    w = make_weight(40, 320, bits, g, seed=bits)
    reference = next(k for k in registry.kernels_for("linear", "IntxDQTensor") if k.name == "reference")
    # Below the many-row rows' crossovers (the AMX tiles from 16 rows, tests/kernels/test_cpu_amx.py)
    for rows in (1, 5, 12):
        x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        assert registry.select_kernel("linear", x, w).name == "cpu_intxdq_ext"
        y, ref = torch.nn.functional.linear(x, w), reference.fn(x, w, None)
        assert y.dtype == ref.dtype == torch.bfloat16 and y.shape == ref.shape == (rows, 40)
        bound = x.double().abs() @ w.dequantize(torch.float64).abs().t()
        tol = (ACT_TOL + 2 * OUT_TOL[torch.bfloat16]) * bound + 1e-30
        assert ((y.double() - ref.double()).abs() <= tol).all()


def test_bf16_gemm_row_gives_the_references_bits():
    gemm = next(k for k in registry.kernels_for("linear", "IntxDQTensor") if k.name == "cpu_intxdq_bf16_gemm")
    if not registry.capable(gemm.needs, torch.device("cpu")):
        pytest.skip("no native bf16 GEMM on this CPU (AMX or AVX512-BF16): the row does not run here")
    w = make_weight(24, 256, 3, 32)
    x = torch.randn(cpu_gemm.min_rows("intx"), 256, dtype=torch.bfloat16)
    assert gemm.when(x, w) and not gemm.when(x[:-1], w)
    # where hf_aoq's panel rows run (AMX tiles, or AVX512-BF16's dot products), they come first
    # (priority 35 and 34 against 30)
    assert registry.select_kernel("linear", x, w).name in ("cpu_intxdq_bf16_gemm", "cpu_intxdq_amx",
                                                           "cpu_intxdq_avx512bf16")
    assert torch.equal(gemm.fn(x, w, None), torch.nn.functional.linear(x, w.dequantize(torch.bfloat16)))


def test_fused_experts_go_to_the_reference():
    experts = IntxDQTensor.from_float(torch.randn(2, 16, 64), 3, 32)
    ext = next(k for k in registry.kernels_for("linear", "IntxDQTensor") if k.name == "cpu_intxdq_ext")
    assert not ext.when(torch.randn(1, 64), experts)


# ---------------------------------------------------------------------- torch.compile
def test_compiled_calls_are_one_opaque_op_and_agree_with_eager():
    from torch._dynamo.backends.common import aot_autograd

    lin = torch.nn.Linear(384, 40, bias=False)
    lin.weight = torch.nn.Parameter(make_weight(40, 384, 3, 32), requires_grad=False)
    ops = []

    def record(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    with torch.no_grad():
        f = torch.compile(lambda x: lin(x) * 2, backend=aot_autograd(fw_compiler=record), fullgraph=True)
        assert torch.equal(f(x), lin(x) * 2)
    assert [op for op in ops if op.startswith("hf_aoq.")] == ["hf_aoq.intxdq_linear_io_cpu.default"], ops


def test_inductor_agrees_with_eager():
    w = make_weight(40, 384, 2, 64, dtype=torch.float32)
    f = torch.compile(lambda x: run(x, w) + 1, fullgraph=True)
    x = torch.randn(2, 384)
    assert torch.equal(f(x), run(x, w) + 1)
