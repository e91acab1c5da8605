"""scripts/gpu_check.sh and scripts/gpu_bench.py on a machine without a GPU: the dry run says
what would run and touches nothing; the benchmark lists the cases the issue asks for."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_prints_the_steps_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    steps = [line for line in done.stdout.splitlines() if line.startswith("+ ")]
    text = "\n".join(steps)
    for expected in ("tests/kernels/test_cuda.py", "tests/integrations/test_transformers_cuda.py",
                     "tests/kernels/test_cuda_contracts.py",
                     "-k compile", "scripts/gpu_bench.py --out " + str(out / "bench.json"),
                     "scripts/gpu_bench.py --crossover --iters 20 --out " + str(out / "crossover.json"),
                     str(out / "tests.xml"), str(out / "env.json")):
        assert expected in done.stdout, expected
    named = {w for w in done.stdout.split() if w.startswith("tests/") and w.endswith(".py")}
    assert named and all((ROOT / w).is_file() for w in named), named  # test files that moved fail here
    assert all(s.startswith("+ timeout") or "timeout" in s for s in steps if "python" in s)  # every step is bounded
    assert not out.exists() and not (ROOT / "gpu_check_out").exists()


def test_unknown_arguments_are_refused():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--nope"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage" in done.stderr


def test_the_benchmark_covers_every_scheme_at_1_16_and_512_rows():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    listed = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--list"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    cases = json.loads(listed.stdout)
    assert {(c["scheme"], c["rows"]) for c in cases} >= {
        (s, m) for s in ("int4", "int4dq", "int8", "int8-dynamic", "fp8", "fp8-dynamic") for m in (1, 16, 512)
    }
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_bench
    finally:
        sys.path.pop(0)
    for scheme in gpu_bench.SCHEMES:
        assert gpu_bench.config_of(scheme) is not None
    no_gpu = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert no_gpu.returncode == 2 and "no CUDA device" in no_gpu.stderr


def test_the_crossover_rows_give_the_triton_limits():
    """--crossover times the int4 and Int4DQ GEMV, GEMM and dequantize + cuBLAS over 1 .. 512
    rows (each where it may win) and the fp8 quantizer at 1, 16 and 512; `crossovers` reads off
    where the GEMM overtakes the GEMV and dequantize + cuBLAS the GEMM."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_bench
    finally:
        sys.path.pop(0)
    from hf_aoq.kernels.triton_kernels import TRITON_GEMM_MAX_ROWS, TRITON_GEMV_MAX_ROWS

    cases = gpu_bench.crossover_cases()
    for scheme in ("int4", "int4dq"):
        rows = {kernel: {c["rows"] for c in cases if c["scheme"] == scheme and c["kernel"] == kernel}
                for kernel in ("gemv", "gemm", "dequantize_mm")}
        assert {1, 16} <= rows["gemv"] and {2, 16, 512} <= rows["gemm"] and {16, 512} <= rows["dequantize_mm"]
        # Both sides of both limits are measured.
        for limit in (TRITON_GEMV_MAX_ROWS, TRITON_GEMM_MAX_ROWS):
            assert any(m <= limit for m in rows["gemm"]) and any(m > limit for m in rows["gemm"])
        assert min(rows["gemv"]) <= TRITON_GEMV_MAX_ROWS < max(rows["gemv"])
    assert {c["rows"] for c in cases if c["scheme"] == "fp8-quantize"} == {1, 16, 512}
    times = {("gemv", 8): 1.0, ("gemm", 8): 1.2, ("gemv", 16): 2.0, ("gemm", 16): 1.5, ("gemm", 32): 2.0,
             ("dequantize_mm", 32): 3.0, ("gemm", 64): 4.0, ("dequantize_mm", 64): 3.5}
    rows = [{"scheme": "int4", "kernel": kernel, "rows": m, "ms": ms} for (kernel, m), ms in times.items()]
    found = gpu_bench.crossovers(rows)
    assert found["int4"] == {"gemm_beats_gemv_from": 16, "dequantize_mm_beats_gemm_from": 64}
    assert found["int4dq"] == {"gemm_beats_gemv_from": None, "dequantize_mm_beats_gemm_from": None}
    assert found["TRITON_GEMV_MAX_ROWS"] == TRITON_GEMV_MAX_ROWS
    for case in cases:  # every row names a kernel crossover_kernels has
        if case["scheme"] != "fp8-quantize":
            assert case["kernel"] in ("gemv", "gemm", "dequantize_mm")
