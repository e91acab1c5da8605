"""The CPU kernels per instruction set: run-time ISA checks (kernels/cpu_isa.py), the bf16-GEMM rows
for many rows (kernels/cpu_gemm.py: exactly the reference's numbers), and the AVX-512 build against
the AVX2 build (the same outputs, bit for bit). Paths this CPU cannot run are skipped, saying so."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_aoq import Float8Tensor, Int4DQTensor, Int4Tensor, Int8Tensor
from hf_aoq.kernels import cpu_ext, cpu_gemm, cpu_isa, registry, select_kernel
from hf_aoq.kernels.reference import reference_linear
from hf_aoq.tensors.float8 import PerTensor

BF16_GEMM = cpu_isa.bf16_gemm_isa()  # "amx", "avx512_bf16" or None
needs_ext = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's CPU extension is not built here")
needs_bf16_gemm = pytest.mark.skipif(
    BF16_GEMM is None or not cpu_ext.available(),
    reason=f"this CPU (or OS) allows neither AMX-BF16 nor AVX512-BF16 ({cpu_isa.describe()['flags']}): "
           "the bf16-GEMM rows are skipped",
)


@pytest.fixture
def amx_rows_held_off(monkeypatch):
    """The panel rows (kernels/cpu_amx.py: AMX tiles, or AVX512-BF16's dot products without AMX)
    and the integer rows of int8 dynamic weights (kernels/cpu_int8dyn.py), above the bf16-GEMM
    rows, held off: these tests are about the bf16-GEMM rows, which still run wherever the others
    do not."""
    from hf_aoq.kernels import cpu_amx, cpu_int8dyn

    for rows in (cpu_amx.MIN_ROWS, cpu_amx.MIN_ROWS_AVX512_BF16):
        for fmt in rows:
            monkeypatch.setitem(rows, fmt, 1 << 30)
    monkeypatch.setattr(cpu_int8dyn, "_int8dyn_fits", lambda x, w: False)


@pytest.fixture
def fresh_probes(monkeypatch):
    """Capabilities and the AMX grant probed again inside the test, and again after it."""
    registry.forget_capabilities()
    yield monkeypatch
    monkeypatch.undo()
    registry.forget_capabilities()


def test_isa_environment_takes_sets_away(fresh_probes):
    fresh_probes.setenv("HF_AOQ_CPU_ISA", "avx2")
    assert not cpu_isa.avx512_allowed() and not cpu_isa.amx_bf16_allowed()
    assert cpu_isa.bf16_gemm_isa() is None
    assert cpu_ext.chosen_isa() in ("avx2", "generic")
    fresh_probes.setenv("HF_AOQ_CPU_ISA", "avx512")
    assert not cpu_isa.amx_bf16_allowed()
    assert cpu_isa.avx512_allowed() == (cpu_isa.describe()["torch_capability"] == "AVX512"
                                        and set(cpu_isa.AVX512_FLAGS) <= set(cpu_isa.build_cache.cpu_features()))


def test_no_isa_is_used_that_the_flags_do_not_list(fresh_probes):
    # A CPU (or VM) without the flags: nothing beyond AVX2 is chosen, whatever torch reports.
    fresh_probes.setattr(cpu_isa.build_cache, "cpu_features", lambda: frozenset({"avx2", "fma"}))
    assert not cpu_isa.avx512_allowed() and not cpu_isa.amx_bf16_allowed() and cpu_isa.bf16_gemm_isa() is None
    assert cpu_ext.chosen_isa() in ("avx2", "generic")


def test_amx_needs_the_kernels_grant(fresh_probes):
    # A VM may list AMX and still not let the process use it: without the grant, no AMX.
    fresh_probes.setattr(cpu_isa, "_amx_permitted", lambda: False)
    assert not cpu_isa.amx_bf16_allowed()
    assert cpu_isa.bf16_gemm_isa() != "amx"


def _weights(n=64, k=320):
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
    return {
        "int4 g64": Int4Tensor.from_float(w, 64).place(),
        "int4 g128 padded": Int4Tensor.from_float(w, 128).place(),  # k = 320: the last group padded
        "int4dq": Int4DQTensor.from_float(w, 32).place(),
        "int8": Int8Tensor.from_float(w),
        "int8 dynamic": Int8Tensor.from_float(w, act_quant="per_token"),
        "fp8 e4m3 per row": Float8Tensor.from_float(w),
        "fp8 e5m2 per tensor": Float8Tensor.from_float(w, torch.float8_e5m2, PerTensor()),
    }


FORMAT = {"int4 g64": "int4", "int4 g128 padded": "int4", "int4dq": "int4dq", "int8": "int8", "int8 dynamic": "int8",
          "fp8 e4m3 per row": "fp8", "fp8 e5m2 per tensor": "fp8"}


@needs_bf16_gemm
@pytest.mark.parametrize("name", list(FORMAT))
def test_bf16_gemm_rows_equal_the_reference_exactly(name, amx_rows_held_off):
    w = _weights()[name]
    rows = cpu_gemm.min_rows(FORMAT[name])
    bias = torch.randn(w.shape[0])
    for shape in ((rows, w.shape[1]), (2, rows + 3, w.shape[1])):
        x = torch.randn(*shape, dtype=torch.bfloat16)
        kernel = select_kernel("linear", x, w)
        assert kernel.name.endswith("_bf16_gemm"), kernel.name
        for b in (None, bias):
            y, ref = F.linear(x, w, b), reference_linear(x, w, b)
            assert y.dtype == torch.bfloat16 and y.shape == ref.shape
            assert torch.equal(y, ref), f"{name}: {(y.float() - ref.float()).abs().max()}"


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantized_weights_equal_the_references_bit_for_bit(dtype):
    # The C++ dequantization alone (also where no fast GEMM selects it), in both half dtypes.
    for name, w in _weights().items():
        if name == "int4dq":
            got = cpu_gemm.int4dq_dequantize(w.qdata, w.gparams, w.rparams, w.tparams, w.block_size[-1], w.shape[1], dtype)
        elif name.startswith("int4"):
            got = cpu_gemm.int4_dequantize(w.qdata, w.scale, w.block_size[-1], w.shape[1], dtype)
        elif name.startswith("int8"):
            got = cpu_gemm.int8_dequantize(w.qdata, w.scale, w.shape[1], dtype)
        else:
            scale = w.scale.reshape(-1).float().expand(w.shape[0]).contiguous()
            got = cpu_gemm.fp8_dequantize(w.qdata.view(torch.uint8), scale, cpu_gemm._FP8_SHIFT[w.qdata.dtype],
                                          w.shape[1], dtype)
        assert torch.equal(got, w.dequantize(dtype)), name


@needs_ext
@pytest.mark.parametrize("n, k, group", [(48, 334, 64), (80, 202, 32), (16, 98, 32), (32, 256, 256), (96, 100, 128)])
def test_int4_dequantized_weights_equal_the_references_for_part_blocks_and_columns(n, k, group):
    # Full 32-row blocks and a last block of 16 rows; columns not a multiple of 8 (the last group
    # padded) and a K of one group; every group size.
    torch.manual_seed(n + k)
    w = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
    weights = [Int4Tensor.from_float(w, group).place()]
    if group in (32, 64):
        weights.append(Int4DQTensor.from_float(w, group).place())
    for q in weights:
        if isinstance(q, Int4DQTensor):
            got = cpu_gemm.int4dq_dequantize(q.qdata, q.gparams, q.rparams, q.tparams, group, k, torch.bfloat16)
        else:
            got = cpu_gemm.int4_dequantize(q.qdata, q.scale, group, k, torch.bfloat16)
        want = q.dequantize(torch.bfloat16)
        assert got.shape == want.shape == (n, k)
        assert torch.equal(got, want), (type(q).__name__, (got.float() - want.float()).abs().max())


@needs_bf16_gemm
def test_bf16_gemm_rows_apply_only_where_they_win(amx_rows_held_off, fresh_probes):
    w = _weights()["int4 g64"]
    gemm = "cpu_int4_bf16_gemm"

    def chosen(rows, dtype=torch.bfloat16):
        return select_kernel("linear", torch.randn(rows, w.shape[1], dtype=dtype), w).name

    rows = cpu_gemm.min_rows("int4")
    assert rows == cpu_gemm.MIN_ROWS[BF16_GEMM]["int4"]
    assert chosen(rows - 1) != gemm and chosen(rows) == gemm
    for dtype in (torch.float32, torch.float16):  # float16: no AMX-FP16 here, the fp16 GEMM is slower
        assert chosen(rows, dtype) != gemm
    # Without AMX (taken away, or absent) AVX512-BF16's own limit applies; without AVX-512 there is no
    # native bf16 GEMM and the row never runs.
    fresh_probes.setenv("HF_AOQ_CPU_ISA", "avx512")
    registry.forget_capabilities()
    assert cpu_isa.bf16_gemm_isa() == "avx512_bf16"
    rows = cpu_gemm.MIN_ROWS["avx512_bf16"]["int4"]
    assert cpu_gemm.min_rows("int4") == rows and chosen(rows - 1) == "cpu_int4_ext" and chosen(rows) == gemm
    fresh_probes.setenv("HF_AOQ_CPU_ISA", "avx2")
    registry.forget_capabilities()
    assert chosen(4 * rows) == "cpu_int4_ext"


@needs_bf16_gemm
def test_bf16_gemm_rows_compile_without_graph_breaks(amx_rows_held_off):
    w = _weights()["int8"]
    x = torch.randn(cpu_gemm.min_rows("int8"), w.shape[1], dtype=torch.bfloat16)
    f = torch.compile(lambda x: F.linear(x, w), fullgraph=True)
    assert torch.equal(f(x), reference_linear(x, w, None))


# ---------------------------------------------------------------------- AVX-512 build against AVX2
# One subprocess per build (a temporary cache each), computing every CPU kernel's outputs on the
# same inputs; the integer sums are the same, so the outputs must be equal bit for bit.
OUTPUTS = """
import json, sys, torch, torch.nn.functional as F
from safetensors.torch import save_file
from hf_aoq import Float8Tensor, Int4DQTensor, Int4Tensor, Int8Tensor
from hf_aoq.kernels import cpu_amx, cpu_attention, cpu_dense, cpu_ext, cpu_fp8_dot, select_kernel
# The panel GEMM's AVX512-BF16 rows and float8's dot-product row exist in the AVX-512 build only
# (tests/kernels/test_cpu_amx.py and test_cpu_fp8_dot.py compare them with the reference): held
# off, so that both builds run the same rows.
for fmt in cpu_amx.MIN_ROWS_AVX512_BF16:
    cpu_amx.MIN_ROWS_AVX512_BF16[fmt] = 1 << 30
cpu_fp8_dot.FP8_DPBF16_MAX_ROWS = 0
torch.manual_seed(0)
w = torch.randn(96, 384) * 0.05
weights = {"int4": Int4Tensor.from_float(w.bfloat16(), 128).place(), "int4dq": Int4DQTensor.from_float(w, 32).place(),
           "int8": Int8Tensor.from_float(w), "fp8": Float8Tensor.from_float(w),
           "int8-int4": Int4Tensor.from_float(w, 32, act_quant="per_token", act_dtype=torch.int8).place(),
           "int4-int4 asym": Int4Tensor.from_float(w, 128, False, act_quant="per_token", act_dtype=torch.int4).place()}
# 112 rows, groups of 32 (an odd number of them): the AVX-512 build's 64-row step of the int4
# integer path beside a 32-row block and a 16-row tail; scale and zero in each float dtype.
w2 = torch.randn(112, 160) * 0.05
weights.update({f"int4 g32 112 {str(dt)[6:]}": Int4Tensor.from_float(w2.to(dt), 32).place()
                for dt in (torch.float32, torch.bfloat16, torch.float16)})
weights["int4dq g32 112"] = Int4DQTensor.from_float(w2, 32).place()
# 100 rows (the batch-1 int8/fp8 GEMVs' eight-row blocks and a block of four), K = 200 (a column tail).
w3 = torch.randn(100, 200) * 0.05
weights.update({"int8 100x200": Int8Tensor.from_float(w3), "fp8 100x200": Float8Tensor.from_float(w3)})
# 102 rows, K = 224: the int8 GEMV's int16 codes (half-precision rows) in groups of 32, blocks of
# eight and four rows with part blocks, single rows and row pairs.
weights["int8 102x224"] = Int8Tensor.from_float(torch.randn(102, 224) * 0.05)
out, kernels = {}, {}
for rows in (1, 2, 3, 4, 5, 8, 12):  # below the bf16-GEMM rows (which the reference test covers)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for name, q in weights.items():
            x = torch.randn(rows, q.shape[1], dtype=dtype)
            key = f"{name} {rows} {str(dtype)[6:]}"
            out[key] = F.linear(x, q).contiguous()
            kernels[key] = select_kernel("linear", x, q).name
# The plain bf16 GEMV (csrc/dense.cpp): 102 rows (blocks of four, the last one overlapping), K = 200
# (a column tail), one to four activation rows.
wd = (torch.randn(102, 200) * 0.05).bfloat16()
for rows in (1, 2, 3, 4):
    out[f"dense 102x200 {rows}"] = cpu_dense.dense_linear(torch.randn(rows, 200, dtype=torch.bfloat16), wd, None)
# The decode-step attention (csrc/attention.cpp): grouped heads, 37 positions (a tail of the
# softmax's 16 lanes), head sizes 64 and 80 (a column tail), a bool and a float mask.
for dtype in (torch.bfloat16, torch.float32):
    for d in (64, 80):
        q, k, v = torch.randn(2, 8, 1, d).to(dtype), torch.randn(2, 2, 37, d).to(dtype), torch.randn(2, 2, 37, d).to(dtype)
        masks = {"none": None, "bool": torch.rand(2, 1, 1, 37) < 0.8, "float": torch.randn(2, 1, 1, 37)}
        for name, mask in masks.items():
            out[f"attention {str(dtype)[6:]} d{d} {name}"] = cpu_attention.decode_attention(q, k, v, mask, d ** -0.5)
save_file(out, sys.argv[1])
ext = cpu_ext.load()
print("RESULT " + json.dumps({"isa": cpu_ext.chosen_isa(), "file": ext.__file__ if ext else None, "kernels": kernels}))
"""


def _outputs(tmp: Path, isa_env: str | None) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    env = dict(os.environ, HF_AOQ_EXTENSION_DIR=str(tmp / "cache"), OMP_WAIT_POLICY="PASSIVE")
    env.pop("HF_AOQ_CPU_ISA", None)
    if isa_env:
        env["HF_AOQ_CPU_ISA"] = isa_env
    path = tmp / "out.safetensors"
    proc = subprocess.run([sys.executable, "-c", OUTPUTS, str(path)], env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    return result, load_file(path)


@pytest.mark.slow  # two builds: 8 minutes on a busy 2-vCPU machine
@pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's CPU extension is not built here")
def test_avx512_build_gives_the_avx2_builds_outputs(tmp_path):
    if cpu_ext.chosen_isa() != "avx512":
        pytest.skip(f"this CPU does not allow the AVX-512 build ({cpu_isa.describe()}); only AVX2 runs here")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    avx2, out2 = _outputs(tmp_path / "a", "avx2")
    avx512, out512 = _outputs(tmp_path / "b", "avx512")  # AVX-512, AMX taken away
    assert avx2["isa"] == "avx2" and "_avx2_" in Path(avx2["file"]).parent.name
    assert avx512["isa"] == "avx512" and "_avx512_" in Path(avx512["file"]).parent.name
    assert avx2["kernels"] == avx512["kernels"]
    assert any("ext" in k for k in avx512["kernels"].values())
    assert out2.keys() == out512.keys()
    for key in out2:
        assert torch.equal(out2[key], out512[key]), f"{key} ({avx512['kernels'].get(key, 'dense_linear')})"
