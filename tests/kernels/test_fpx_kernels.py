"""hf_aoq's FPxTensor CPU kernels (csrc/fpx.cpp, kernels/cpu_fpx.py) against a float64
reference, on fields built here: random codes of every format packed bit by bit into the
canonical stream (column k at stream bits [k*b, (k+1)*b), stream bit i = bit i % 8 of byte i // 8),
w = value(code) * scale with value from the definition (sign, ebits exponent bits with bias
2^(ebits-1) - 1 and subnormals, mbits mantissa bits). Rows 1..64 (the GEMV: in registers up to a
tile, several tiles above, called directly) and the table's call (the GEMV up to one tile, dequantize
+ GEMM above), K tails, the three activation dtypes,
bias; eager and torch.compile; with and without the extension (HF_AOQ_NO_CPU_EXT=1).

The GEMV decodes the weight exactly and sums in float32: tolerances are float32 accumulation
(relative to sum(|x| |w|) per output) plus the output dtype's rounding."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_aoq.kernels import cpu_ext, cpu_fpx, cpu_gemm, registry
from hf_aoq.tensors.fpx import FORMATS, FPxTensor

needs_ext = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's C++ extension is not built here")

OUT_TOL = {torch.float32: 0.0, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}
ACC_TOL = 1e-5  # float32 sums of a few thousand products


def value(code: int, e: int, m: int) -> float:
    bias = 2 ** (e - 1) - 1
    s, big_e, big_m = code >> (e + m), (code >> m) % 2 ** e, code % 2 ** m
    mag = 2.0 ** (1 - bias) * big_m / 2 ** m if big_e == 0 else 2.0 ** (big_e - bias) * (1 + big_m / 2 ** m)
    return -mag if s else mag


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    n, k = codes.shape
    stream = torch.zeros(n, -(-k * bits // 8) * 8, dtype=torch.uint8)
    for i in range(bits):
        stream[:, i: k * bits: bits] = ((codes >> i) & 1).to(torch.uint8)
    weights = (2 ** torch.arange(8)).to(torch.uint8)
    return (stream.view(n, -1, 8) * weights).sum(-1).to(torch.uint8)


def make_weight(n, k, fmt, scale_dtype=torch.float32, seed=0):
    e, m = fmt
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** (1 + e + m), (n, k), generator=gen)
    scale = (torch.rand(n, 1, generator=gen) * 0.1 + 0.01).to(scale_dtype)
    return SimpleNamespace(codes=codes, qdata=pack_bits(codes, 1 + e + m), scale=scale, ebits=e, mbits=m,
                           shape=torch.Size((n, k)))


def dense64(w) -> torch.Tensor:
    table = torch.tensor([value(c, w.ebits, w.mbits) for c in range(2 ** (1 + w.ebits + w.mbits))], dtype=torch.float64)
    return table[w.codes] * w.scale.double()


def run(x, w, bias=None):
    """The table row's call: the GEMV up to FPX_GEMV_MAX_ROWS rows, dequantize + GEMM above."""
    return cpu_fpx.fpx_linear_io(x, w.qdata, w.scale, w.ebits, w.mbits, w.shape[1], bias)


def run_gemv(x, w, bias=None):
    """The GEMV at any number of rows (tiles of activation rows, each decoding the weight again)."""
    return cpu_ext.load().fpx_linear_io(x, w.qdata, w.scale, w.ebits, w.mbits, w.shape[1], bias, 1 << 30)


def assert_close(y, x, w, bias=None):
    x64, w64 = x.reshape(-1, x.shape[-1]).double(), dense64(w)
    ref, bound = x64 @ w64.t(), x64.abs() @ w64.abs().t()
    if bias is not None:
        ref, bound = ref + bias.double(), bound + bias.double().abs()
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    err = (y.reshape(ref.shape).double() - ref).abs()
    tol = (ACC_TOL + OUT_TOL[x.dtype]) * bound + OUT_TOL[x.dtype] * ref.abs() + 1e-30
    assert (err <= tol).all(), f"max error {(err / (bound + 1e-30)).max():.3g} of sum |x||w|"


ROWS = list(range(1, 9)) + [15, 16, 17, 31, 33, 48, 63, 64, 65]  # 1..64 and one past
KS = [1, 5, 16, 37, 64, 100, 333, 1024]


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"e{f[0]}m{f[1]}")
def test_every_format_rows_and_k_tails_against_float64(fmt):
    for k in KS:
        w = make_weight(19, k, fmt, seed=k)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            assert_close(run(x, w), x, w)
            assert_close(run_gemv(x, w), x, w)


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"e{f[0]}m{f[1]}")
def test_gemv_decodes_every_code_exactly(fmt):
    # One-hot activations: output row i is column k of the weight, value * scale in float32,
    # exactly the reference's float32 dequantization (a code decoded wrongly would show).
    k = 200  # every code of every format appears, and a partial last step
    w = make_weight(23, k, fmt, seed=3)
    assert len(w.codes.unique()) == 2 ** (1 + sum(fmt))
    want = dense64(w).float().t()
    for rows in (1, 3, 4, 5, 40, 64):  # one tile, several tiles (and dequantize + GEMM for run)
        for k0 in range(0, k, rows):
            cols = torch.arange(k0, min(k, k0 + rows))
            x = torch.zeros(len(cols), k)
            x[torch.arange(len(cols)), cols] = 1.0
            assert torch.equal(run_gemv(x, w), want[cols]), (rows, k0)
            assert torch.equal(run(x, w), want[cols]), (rows, k0)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 4, 5, cpu_fpx.FPX_GEMV_MAX_ROWS, cpu_fpx.FPX_GEMV_MAX_ROWS + 1])
def test_dtypes_rows_and_bias(dtype, rows):
    for fmt in ((3, 2), (2, 2), (2, 1)):
        w = make_weight(21, 320, fmt, scale_dtype=dtype, seed=rows)
        x = torch.randn(1, rows, 320, generator=torch.Generator().manual_seed(3)).to(dtype)
        bias = torch.randn(21).to(dtype)
        assert_close(run(x, w, bias), x, w, bias)
        assert_close(run(x, w), x, w)
        assert_close(run_gemv(x, w, bias), x, w, bias)


@needs_ext
def test_rows_are_independent_of_the_rows_computed_with_them():
    w = make_weight(45, 576, (3, 2), torch.bfloat16)
    x = torch.randn(64, 576)
    together = run_gemv(x, w)
    for i in (0, 3, 4, 5, 63):
        assert torch.equal(run_gemv(x[i:i + 1], w)[0], together[i])
        assert torch.equal(run_gemv(x[:5], w)[min(i, 4)], together[min(i, 4)])
        assert torch.equal(run(x[i:i + 1], w)[0], together[i])  # the table's call at one row


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"e{f[0]}m{f[1]}")
def test_dequantize_is_the_references_bit_for_bit(fmt, dtype):
    weight = torch.randn(13, 203, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    t = FPxTensor.from_float(weight, *fmt)
    got = cpu_fpx.fpx_dequantize(t.qdata, t.scale, *fmt, 203, dtype)
    assert torch.equal(got, t.dequantize(dtype))


@needs_ext
def test_bad_fields_are_refused():
    w = make_weight(8, 64, (3, 2))
    with pytest.raises(RuntimeError, match="qdata"):
        cpu_fpx.fpx_linear_io(torch.randn(1, 64), w.qdata[:, :-1].contiguous(), w.scale, 3, 2, 64, None)
    with pytest.raises(RuntimeError, match="scale"):
        cpu_fpx.fpx_linear_io(torch.randn(1, 64), w.qdata, w.scale[:4].contiguous(), 3, 2, 64, None)
    with pytest.raises(RuntimeError, match="ebits, mbits"):
        cpu_fpx.fpx_linear_io(torch.randn(1, 64), w.qdata, w.scale, 4, 3, 64, None)
    with pytest.raises(RuntimeError, match="x: expected"):
        cpu_fpx.fpx_linear_io(torch.randn(1, 63), w.qdata, w.scale, 3, 2, 64, None)


# ---------------------------------------------------------------------- the table rows
@needs_ext
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"e{f[0]}m{f[1]}")
def test_fpx_tensors_run_the_kernel_and_agree_with_the_reference_kernel(fmt):
    gen = torch.Generator().manual_seed(sum(fmt))
    w = FPxTensor.from_float(torch.randn(40, 333, generator=gen).to(torch.bfloat16), *fmt)
    reference = next(k for k in registry.kernels_for("linear", "FPxTensor") if k.name == "reference")
    # The GEMV, then float32 dequantize + GEMM up to the bf16-GEMM row's rows (64 on AMX, 12 on AVX512-BF16).
    for rows in (1, 4, 7, max(cpu_gemm.min_rows("fpx") - 1, 8)):
        x = torch.randn(rows, 333, generator=gen).to(torch.bfloat16)
        assert registry.select_kernel("linear", x, w).name == "cpu_fpx_ext"
        y, ref = F.linear(x, w), reference.fn(x, w, None)
        assert y.dtype == ref.dtype == torch.bfloat16 and y.shape == ref.shape == (rows, 40)
        bound = x.double().abs() @ w.dequantize(torch.float64).abs().t()
        # The reference rounds the weight to bf16 first (2^-9 of each product) and sums in bf16's GEMM.
        assert ((y.double() - ref.double()).abs() <= 4 * OUT_TOL[torch.bfloat16] * bound + 1e-30).all()


@needs_ext
def test_amx_row_gives_the_references_bits():
    amx = next(k for k in registry.kernels_for("linear", "FPxTensor") if k.name == "cpu_fpx_bf16_gemm")
    w = FPxTensor.from_float(torch.randn(24, 256).to(torch.bfloat16), 2, 3)
    x = torch.randn(cpu_gemm.min_rows("fpx"), 256, dtype=torch.bfloat16)
    assert amx.when(x, w) and not amx.when(x[:-1], w) and not amx.when(x.float(), w)
    assert torch.equal(amx.fn(x, w, None), F.linear(x, w.dequantize(torch.bfloat16)))


# ---------------------------------------------------------------------- torch.compile
@needs_ext
def test_compiled_calls_are_one_opaque_op_and_agree_with_eager():
    w = make_weight(40, 384, (3, 2), torch.bfloat16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    f = torch.compile(lambda x: run(x, w) * 2, backend=backend, fullgraph=True)
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    assert torch.equal(f(x), run(x, w) * 2)
    ops = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("hf_aoq.fpx_linear_io_cpu" in op for op in ops) == 1, ops


@needs_ext
def test_inductor_agrees_with_eager_through_the_tensor():
    torch._dynamo.reset()
    lin = torch.nn.Linear(100, 24, bias=True)
    lin.weight = torch.nn.Parameter(FPxTensor.from_float(lin.weight.detach(), 2, 2), requires_grad=False)
    f = torch.compile(lin, backend="inductor", fullgraph=True)
    for rows in (1, 5, 70):
        x = torch.randn(rows, 100)
        with torch.no_grad():
            assert torch.equal(f(x), lin(x))


NO_EXT = """
import torch, torch.nn.functional as F
from hf_aoq.kernels import cpu_ext, registry
from hf_aoq.tensors.fpx import FPxTensor
assert not cpu_ext.available()
w = FPxTensor.from_float(torch.randn(24, 37, generator=torch.Generator().manual_seed(0)), 3, 2)
lin = torch.nn.Linear(37, 24)
lin.weight = torch.nn.Parameter(w, requires_grad=False)
compiled = torch.compile(lin, backend="inductor", fullgraph=True)
for rows in (1, 17, 64, 65):
    x = torch.randn(rows, 37)
    assert registry.select_kernel("linear", x, w).name == "reference"
    with torch.no_grad():
        ref = F.linear(x, w.dequantize(), lin.bias)
        assert torch.equal(lin(x), ref)
        torch.testing.assert_close(compiled(x), ref, rtol=1e-6, atol=1e-6)
print("OK")
"""


def test_without_the_extension_the_reference_runs_eager_and_compiled():
    env = dict(os.environ, HF_AOQ_NO_CPU_EXT="1", OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run([sys.executable, "-c", NO_EXT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


# ---------------------------------------------------------------------- the two builds
OUTPUTS = """
import json, sys, torch
from safetensors.torch import save_file
sys.path.insert(0, sys.argv[2])
from test_fpx_kernels import make_weight, run_gemv
from hf_aoq.kernels import cpu_ext
from hf_aoq.tensors.fpx import FORMATS
out = {}
for fmt in FORMATS:
    w = make_weight(37, 1000, fmt, torch.bfloat16, seed=sum(fmt))
    for rows in (1, 2, 5, 64):
        x = torch.randn(rows, 1000, generator=torch.Generator().manual_seed(rows)).bfloat16()
        out[f"{fmt} {rows}"] = run_gemv(x, w).contiguous()
save_file(out, sys.argv[1])
print("RESULT " + json.dumps({"isa": cpu_ext.chosen_isa(), "file": cpu_ext.load().__file__}))
"""


def _outputs(tmp, isa_env):
    import json

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
@needs_ext
def test_avx512_build_gives_the_avx2_builds_outputs(tmp_path):
    if cpu_ext.chosen_isa() != "avx512":
        pytest.skip("this CPU does not allow the AVX-512 build; only AVX2 runs here")
    avx2, out2 = _outputs(tmp_path, "avx2")
    avx512, out512 = _outputs(tmp_path, "avx512")
    assert avx2["isa"] == "avx2" and avx512["isa"] == "avx512" and avx2["file"] != avx512["file"]
    for key in out2:
        assert torch.equal(out2[key], out512[key]), key
