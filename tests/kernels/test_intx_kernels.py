"""hf_aoq's IntxTensor CPU kernels (csrc/intx.cpp, kernels/cpu_intx.py) against a float64
reference, on fields built here: codes packed bit by bit into the canonical stream (column k at
stream bits [k*b, (k+1)*b), stream bit i = bit i % 8 of byte i // 8), w = (q - 2^(b-1)) * scale
+ zero. Every bit width, the GEMV's groups (32..256, a multiple of 256, per row) and one it
refuses (16: dequantize + GEMM), symmetric and asymmetric, partial last groups, the three
activation dtypes, row counts on both sides of the crossover, odd N; weight-only and Int8's
per-token int8 activations; eager and torch.compile; the AVX2 and AVX-512 builds alike (these
builds' outputs include IntxDQTensor's, which runs the same kernels: test_intxdq_kernels.py).

Tolerances are relative to sum(|x| |w|) per output. Weight-only activations become int16 codes
per group (each within 1/65534 of the group's largest |x|); int8 activations are the reference's
codes exactly, so only float32 rounding remains and one code off by one would show."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from hf_aoq.kernels import cpu_ext, cpu_gemm, cpu_intx, registry
from hf_aoq.kernels.common import quantize_int8_per_token

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's C++ extension is not built here")

OUT_TOL = {torch.float32: 0.0, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}  # the output's rounding
ACT_TOL = {False: 5e-4, True: 2e-6}  # int16 codes per group / int8 codes exactly


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [N, ceil(K * bits / 8)]: bit i of column k's code is stream bit k * bits + i."""
    n, k = codes.shape
    stream = torch.zeros(n, -(-k * bits // 8) * 8, dtype=torch.uint8)
    for i in range(bits):
        stream[:, i: k * bits: bits] = ((codes >> i) & 1).to(torch.uint8)
    weights = (2 ** torch.arange(8)).to(torch.uint8)
    return (stream.view(n, -1, 8) * weights).sum(-1).to(torch.uint8)


def make_weight(n, k, bits, g, symmetric, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // g)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=gen)
    scale = (torch.rand(n, groups, generator=gen) * 0.1 + 0.01).to(dtype)
    zero = None if symmetric else (torch.randn(n, groups, generator=gen) * 0.05).to(dtype)
    return SimpleNamespace(codes=codes, qdata=pack_bits(codes, bits), scale=scale, zero=zero, bits=bits,
                           block_size=(1, g), shape=torch.Size((n, k)), act_quant=None, packing=None,
                           simulate_input_quantization=lambda x: x)  # weight-only: the activation as is


def dense64(w) -> torch.Tensor:
    k = w.shape[1]
    g = w.block_size[1]
    w64 = (w.codes.double() - 2 ** (w.bits - 1)) * w.scale.double().repeat_interleave(g, 1)[:, :k]
    if w.zero is not None:
        w64 = w64 + w.zero.double().repeat_interleave(g, 1)[:, :k]
    return w64


def activation64(x, int8):
    x2 = x.reshape(-1, x.shape[-1])
    if not int8:
        return x2.double()
    codes, scale = quantize_int8_per_token(x2)
    return codes.double() * scale.double()


def run(x, w, bias=None, int8=False):
    fn = cpu_intx.intx_int8_linear if int8 else cpu_intx.intx_linear
    return fn(x, w.qdata, w.scale, w.zero, w.bits, w.block_size[1], w.shape[1], bias)


def assert_close(y, x, w, bias=None, int8=False):
    x64, w64 = activation64(x, int8), dense64(w)
    ref = x64 @ w64.t()
    bound = x64.abs() @ w64.abs().t()
    if bias is not None:
        ref = ref + bias.double()
        bound = bound + bias.double().abs()
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    err = (y.reshape(ref.shape).double() - ref).abs()
    tol = (ACT_TOL[int8] + OUT_TOL[x.dtype]) * bound + OUT_TOL[x.dtype] * ref.abs() + 1e-30
    assert (err <= tol).all(), f"max error {(err / (bound + 1e-30)).max():.3g} of sum |x||w|"


GROUPS = [32, 64, 128, 256, 512, None, 16]  # None: one group per row; 512: a multiple of 256; 16: no GEMV


@pytest.mark.parametrize("int8", [False, True], ids=["weight-only", "int8-act"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("bits", range(1, 9))
def test_every_width_and_group_against_float64(bits, g, symmetric, int8):
    for k, rows in ((1024, 1), (1000, 3)):  # 1000: a partial last group, and odd bits leave a partial byte
        w = make_weight(37, k, bits, g or k, symmetric, torch.float32, seed=bits * 7 + k)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        assert_close(run(x, w, int8=int8), x, w, int8=int8)


@pytest.mark.parametrize("g", [32, 256, None])
@pytest.mark.parametrize("bits", range(1, 9))
def test_gemv_decodes_every_code_exactly(bits, g):
    # One-hot activations are exact as int16 (and int8) codes: row i of the output is column k of
    # the weight, to within float32 rounding, for every column (a code decoded wrongly would show).
    k = 392  # not a multiple of any block: a partial last block in every layout
    w = make_weight(23, k, bits, g or k, False, torch.float32, seed=bits)
    dense = dense64(w).t()
    # float32 rounding of the terms the kernel adds (s * sum q x and (z - o s) * sum x), far below
    # one code's step (a scale, >= 0.01)
    atol = 1e-6 * (2 ** (bits - 1) * float(w.scale.max()) + float(w.zero.abs().max()))
    for k0 in range(0, k, cpu_intx.INTX_GEMV_MAX_ROWS):
        cols = torch.arange(k0, min(k, k0 + cpu_intx.INTX_GEMV_MAX_ROWS))
        x = torch.zeros(len(cols), k)
        x[torch.arange(len(cols)), cols] = 1.0
        for int8 in (False, True):
            y = run(x, w, int8=int8).double()
            assert torch.allclose(y, dense[cols], rtol=0, atol=atol), (int8, k0)


@pytest.mark.parametrize("int8", [False, True], ids=["weight-only", "int8-act"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 3, 5, 17, cpu_intx.INTX_GEMV_MAX_ROWS, cpu_intx.INTX_GEMV_MAX_ROWS + 1])
def test_dtypes_rows_and_bias(dtype, rows, int8):
    for bits, g in ((2, 32), (3, 128), (5, 64), (8, 256)):
        w = make_weight(19, 320, bits, g, bits % 2 == 0, dtype, seed=rows + bits)
        x = torch.randn(1, rows, 320, generator=torch.Generator().manual_seed(bits)).to(dtype)
        bias = torch.randn(19).to(dtype)
        assert_close(run(x, w, bias, int8), x, w, bias, int8)
        assert_close(run(x, w, None, int8), x, w, None, int8)


@pytest.mark.parametrize("bits,g", [(1, 32), (2, 32), (3, 64), (3, 32), (4, 32), (8, 128)])
def test_gemv_and_gemm_paths_agree_and_rows_are_independent(bits, g):
    # The GEMV's result for a row does not depend on the rows computed with it (exact integer
    # sums, the same float operations per output), whatever the tile, and whether the tile's
    # block step is inlined (one row of 2-bit codes, every tile of 3- to 8-bit) or not.
    w = make_weight(45, 576, bits, g, False, torch.bfloat16, seed=bits)
    x = torch.randn(7, 576, dtype=torch.bfloat16)
    together = run(x, w)
    for i in range(7):
        assert torch.equal(run(x[i:i + 1], w)[0], together[i])


def test_nan_in_an_activation_row_stays_in_that_row():
    w = make_weight(16, 256, 4, 32, True, torch.float32)
    x = torch.randn(3, 256)
    x[1, 5] = float("nan")
    for int8 in (False, True):
        y = run(x, w, int8=int8)
        assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", range(1, 9))
def test_dequantize_is_the_references_bit_for_bit(bits, dtype):
    w = make_weight(21, 200, bits, 64, bits % 2 == 1, torch.bfloat16)
    expected = ((w.codes.float() - 2 ** (bits - 1)) * w.scale.float().repeat_interleave(64, 1)[:, :200])
    if w.zero is not None:
        expected = expected + w.zero.float().repeat_interleave(64, 1)[:, :200]
    got = cpu_intx.intx_dequantize(w.qdata, w.scale, w.zero, bits, 64, 200, dtype)
    assert torch.equal(got, expected.to(dtype))


def test_bad_fields_are_refused():
    w = make_weight(8, 64, 3, 32, True, torch.float32)
    with pytest.raises(RuntimeError, match="qdata"):
        cpu_intx.intx_linear(torch.randn(1, 64), w.qdata[:, :-1].contiguous(), w.scale, None, 3, 32, 64)
    with pytest.raises(RuntimeError, match="scale"):
        cpu_intx.intx_linear(torch.randn(1, 64), w.qdata, w.scale[:, :1].contiguous(), None, 3, 32, 64)
    with pytest.raises(RuntimeError, match="bits"):
        cpu_intx.intx_linear(torch.randn(1, 64), w.qdata, w.scale, None, 9, 32, 64)


# ---------------------------------------------------------------------- the table rows
def test_table_rows_run_the_kernel_for_intx_weights():
    rows = [k.name for k in registry.kernels_for("linear", "IntxTensor")]
    assert "cpu_intx_ext" in rows and "cpu_intx_bf16_gemm" in rows
    ext = next(k for k in registry.kernels_for("linear", "IntxTensor") if k.name == "cpu_intx_ext")
    w = make_weight(24, 256, 6, 128, False, torch.bfloat16)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    assert ext.when(x, w)
    assert_close(ext.fn(x, w, None), x, w)
    w.act_quant = "per_token"
    assert_close(ext.fn(x, w, None), x, w, int8=True)
    assert not ext.when(x, SimpleNamespace(**{**vars(w), "packing": "some_device_layout"}))
    assert not ext.when(x, SimpleNamespace(**{**vars(w), "scale": w.scale.t().contiguous().t()}))
    assert not ext.when(x.to(torch.int32), w)


def test_amx_row_gives_the_references_bits():
    amx = next(k for k in registry.kernels_for("linear", "IntxTensor") if k.name == "cpu_intx_bf16_gemm")
    w = make_weight(24, 256, 3, 32, True, torch.bfloat16)
    x = torch.randn(cpu_gemm.min_rows("intx"), 256, dtype=torch.bfloat16)
    assert amx.when(x, w) and not amx.when(x[:-1], w)
    weight = dense64(w).float().to(torch.bfloat16)
    assert torch.equal(amx.fn(x, w, None), torch.nn.functional.linear(x, weight))


# ---------------------------------------------------------------------- torch.compile
def test_compiled_calls_are_one_opaque_op_and_agree_with_eager():
    w = make_weight(40, 384, 2, 64, False, torch.bfloat16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for int8 in (False, True):
        fn = cpu_intx.intx_int8_linear if int8 else cpu_intx.intx_linear
        f = torch.compile(lambda x: fn(x, w.qdata, w.scale, w.zero, 2, 64, 384) * 2, backend=backend, fullgraph=True)
        x = torch.randn(3, 384, dtype=torch.bfloat16)
        assert torch.equal(f(x), fn(x, w.qdata, w.scale, w.zero, 2, 64, 384) * 2)
    ops = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("hf_aoq.intx_linear_io_cpu" in op for op in ops) == 2, ops


def test_inductor_agrees_with_eager():
    w = make_weight(40, 384, 5, 128, True, torch.float32)
    f = torch.compile(lambda x: cpu_intx.intx_linear(x, w.qdata, w.scale, None, 5, 128, 384) + 1, fullgraph=True)
    x = torch.randn(2, 384)
    assert torch.equal(f(x), cpu_intx.intx_linear(x, w.qdata, w.scale, None, 5, 128, 384) + 1)


# ---------------------------------------------------------------------- the two builds
OUTPUTS = """
import json, sys, torch
from safetensors.torch import save_file
sys.path.insert(0, sys.argv[2])
from test_intx_kernels import make_weight, run
from hf_aoq.kernels import cpu_ext
out = {}
for bits in range(1, 9):
    for g in (32, 128, 512):
        w = make_weight(37, 1000, bits, g, bits % 2 == 0, torch.bfloat16, seed=bits)
        for rows in (1, 2, 5):
            for int8 in (False, True):
                x = torch.randn(rows, 1000, generator=torch.Generator().manual_seed(rows)).bfloat16()
                out[f"{bits} {g} {rows} {int8}"] = run(x, w, int8=int8).contiguous()
from test_intxdq_kernels import make_weight as make_dq, run as run_dq
for bits in (2, 3):
    for g in (32, 64):
        for k in (1000, 330):  # 330: a row's last 16 groups partly past its end
            w = make_dq(37, k, bits, g, seed=bits)
            for rows in (1, 2, 5, 70):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
                out[f"dq {bits} {g} {k} {rows}"] = run_dq(x, w).contiguous()
save_file(out, sys.argv[1])
print("RESULT " + json.dumps({"isa": cpu_ext.chosen_isa(), "file": cpu_ext.load().__file__}))
"""


def _outputs(tmp, isa_env):
    from safetensors.torch import load_file

    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("HF_AOQ_CPU_ISA", None)
    if isa_env:
        env["HF_AOQ_CPU_ISA"] = isa_env
    path = tmp / f"{isa_env}.safetensors"
    proc = subprocess.run([sys.executable, "-c", OUTPUTS, str(path), os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("RESULT ")), load_file(path)


@pytest.mark.slow  # builds the AVX2 binary if this machine has not yet (minutes)
def test_avx512_build_gives_the_avx2_builds_outputs(tmp_path):
    if cpu_ext.chosen_isa() != "avx512":
        pytest.skip("this CPU does not allow the AVX-512 build; only AVX2 runs here")
    avx2, out2 = _outputs(tmp_path, "avx2")
    avx512, out512 = _outputs(tmp_path, "avx512")
    assert avx2["isa"] == "avx2" and avx512["isa"] == "avx512" and avx2["file"] != avx512["file"]
    for key in out2:
        assert torch.equal(out2[key], out512[key]), key


# ---------------------------------------------------------------------- the real tensor type
@pytest.mark.parametrize("act_quant", [None, "per_token"])
@pytest.mark.parametrize("bits,group_size,symmetric", [(1, 32, False), (2, 32, True), (3, 128, False), (4, 64, True),
                                                       (5, None, True), (6, 256, False), (8, 32, False)])
def test_intx_tensors_run_the_kernel_and_agree_with_the_reference_kernel(bits, group_size, symmetric, act_quant):
    # IntxTensor (hf_aoq/tensors/intx.py) through the table: F.linear picks the C++ row at few
    # rows, and its output is the reference kernel's (dequantize + matmul, the same activation
    # quantization) within the kernels' tolerance.
    from hf_aoq import IntxTensor

    gen = torch.Generator().manual_seed(bits)
    weight = torch.randn(40, 320, generator=gen).to(torch.bfloat16)
    w = IntxTensor.from_float(weight, bits, group_size, symmetric=symmetric, act_quant=act_quant)
    reference = next(k for k in registry.kernels_for("linear", "IntxTensor") if k.name == "reference")
    for rows in (1, 5):
        x = torch.randn(rows, 320, generator=gen).to(torch.bfloat16)
        assert registry.select_kernel("linear", x, w).name == "cpu_intx_ext"
        y, ref = torch.nn.functional.linear(x, w), reference.fn(x, w, None)
        assert y.dtype == ref.dtype == torch.bfloat16 and y.shape == ref.shape == (rows, 40)
        bound = x.double().abs() @ w.dequantize(torch.float64).abs().t()
        tol = (ACT_TOL[act_quant is not None] + 2 * OUT_TOL[torch.bfloat16]) * bound + 1e-30
        assert ((y.double() - ref.double()).abs() <= tol).all()
