"""scripts/benchmark.py end to end on a tiny random Llama: the report's fields and sane values.

No assertion on speed: the machine is shared and tiny models measure mostly overhead."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hf_aoq.kernels import cpu_ext

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmark.py"


def test_benchmark_runs_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--layers", "1", "--configs", "bf16,int4,int4dq,int4-head,int4dq-head,int8-head,int8dyn-head,quanto-int8",
         "--no-fidelity", "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--bandwidth-mb", "32",
         "--prefill-tokens", "32", "--decode-tokens", "4", "--repeats", "2", "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| config |" in result.stdout and "| bf16 |" in result.stdout and "| int4 |" in result.stdout

    report = json.loads(out.read_text())
    assert report["read_bandwidth_bytes_per_s"] > 0
    probes = report["read_bandwidth_probes"]  # the limit takes the fastest probe
    assert report["read_bandwidth_bytes_per_s"] == max(probes.values()) and "torch sum" in probes
    if cpu_ext.available():
        assert any(k.startswith("hf_aoq's load-only probe") for k in probes), probes
    results = report["results"]
    for name in ("bf16", "int4", "int4dq", "int4-head", "int4dq-head", "int8-head", "int8dyn-head"):
        r = results[name]
        assert "error" not in r and "reload_error" not in r, r
        for key in ("load_s", "load_peak_rss_mb", "prefill_s", "decode_tps", "save_bytes", "reload_s",
                    "reload_peak_rss_mb", "model_bytes", "bytes_per_token", "decode_limit_tps"):
            assert r[key] > 0 and math.isfinite(r[key]), (name, key, r[key])
        assert r["vs_bf16"]["decode_tps"] > 0
        assert r["reload_model_bytes"] == r["model_bytes"]
    # The machine, the kernels each config ran, and decode at batch 4 and 16 (tests/kernels/test_cpu_isa.py
    # covers the ISA checks themselves).
    machine = report["machine"]
    for key in ("cpu", "flags", "torch_capability", "hf_aoq_extension_isa", "torch_threads", "torch"):
        assert key in machine, key
    for name in ("bf16", "int4", "int4dq"):
        assert results[name]["decode_tps_b4"] > 0 and results[name]["decode_tps_b16"] > 0, name
    assert results["bf16"]["kernels_decode"] == []  # no quantized weight: no row of hf_aoq's table
    assert any(k.startswith("linear Int4Tensor: ") for k in results["int4"]["kernels_decode"])
    assert any(k.startswith("linear Int4DQTensor: ") for k in results["int4dq"]["kernels_prefill"])
    assert "% of limit" in result.stdout and "decode b16 tok/s" in result.stdout and "kernels in prefill" in result.stdout
    assert results["int4"]["model_bytes"] < results["bf16"]["model_bytes"]
    assert results["int4-head"]["model_bytes"] < results["int4"]["model_bytes"]  # lm_head quantized too
    assert any(k.startswith("linear Int8Tensor: ") for k in results["int8-head"]["kernels_decode"])
    # int8dyn-head: the integer rows where the avx512 build runs, the lm_head among them.
    if cpu_ext.available() and cpu_ext.chosen_isa() == "avx512":
        assert any(k.startswith("linear Int8Tensor: cpu_int8dyn_vnni") for k in results["int8dyn-head"]["kernels_decode"])
        assert any(k.startswith("linear Int8Tensor: cpu_int8dyn_") for k in results["int8dyn-head"]["kernels_prefill"])
    # The lm_head left in bf16 runs hf_aoq's GEMV at the decode step (hf_aoq/dense_linear.py), once a
    # token; quantized with the rest (int4-head), it does not. Each layer's attention runs hf_aoq's
    # decode-step kernel (hf_aoq/decode_attention.py); the bf16 model's, transformers' own.
    if cpu_ext.available() and cpu_ext.chosen_isa() in ("avx2", "avx512"):
        assert "linear bf16: dense_linear (1)" in results["int4"]["kernels_decode"]
        assert "attention: decode_attention (1)" in results["int4-head"]["kernels_decode"]
    for name in ("int4-head", "int4dq-head"):
        assert not any(k.startswith("linear bf16: ") for k in results[name]["kernels_decode"]), name
    assert results["int4dq-head"]["model_bytes"] < results["int4dq"]["model_bytes"]
    assert results["int4"]["save_bytes"] < results["bf16"]["save_bytes"]
    assert results["bf16"]["vs_bf16"]["model_bytes"] == 1.0
    # optimum-quanto is optional: either it ran, or it was skipped with a note
    assert "quanto-int8" in results or any("quanto" in n for n in report["notes"])
    assert any("fidelity skipped" in n for n in report["notes"])
    assert report["complete"] is True

    rendered = subprocess.run([sys.executable, str(SCRIPT), "--render", str(out)], capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0 and "| int4 |" in rendered.stdout, rendered.stderr


def test_benchmark_rejects_unknown_config(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--configs", "bf16,int7", "--out", ""],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "int7" in result.stderr


def test_benchmark_moe_runs_with_quantized_experts(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--moe", "--layers", "1", "--configs", "bf16,int4",
         "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--bandwidth-mb", "32", "--batches", "1",
         "--prefill-tokens", "32", "--decode-tokens", "4", "--repeats", "2", "--threads", "1", "--fidelity-tokens", "16"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "Mixtral" in report["model"] and "e4-k2" in report["model"]
    bf16, int4 = report["results"]["bf16"], report["results"]["int4"]
    for r in (bf16, int4):
        assert "error" not in r and "reload_error" not in r and r["decode_tps"] > 0, r
        assert r["bytes_per_token"] < r["model_bytes"]  # only the top-2 of 4 experts are read per token
    assert int4["model_bytes"] < 0.6 * bf16["model_bytes"]  # the experts quantized (bf16 embeddings and lm_head remain)
    assert 10 < int4["sqnr_db"] < float("inf")  # measured on the MoE itself, not SmolLM2
    assert any(k.startswith("linear Int4Tensor: ") for k in int4["kernels_decode"])


def _calls(rows: list[str]) -> int:
    return sum(int(r.rsplit("(", 1)[1].rstrip(")")) for r in rows)


def test_benchmark_named_schemes_intx_and_calibrated_fp8_static(tmp_path):
    """Two of config_for_scheme's schemes as benchmark rows: int3 (IntxTensor) and fp8-static,
    whose activation scales are calibrated before timing, on the same linears as every other
    config (lm_head stays bf16 although the calibrated recipe names weights exactly)."""
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--layers", "1", "--configs", "bf16,int3,fp8-static",
         "--no-fidelity", "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--bandwidth-mb", "32",
         "--batches", "1", "--prefill-tokens", "32", "--decode-tokens", "4", "--repeats", "2", "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    for name in ("int3", "fp8-static"):
        r = results[name]
        assert "error" not in r and "reload_error" not in r and r["decode_tps"] > 0, (name, r)
        assert r["reload_model_bytes"] == r["model_bytes"] < results["bf16"]["model_bytes"]
    def quantized(names):  # the lm_head, left in bf16, may run hf_aoq's dense GEMV ("linear bf16: ..."), and the
        return [k for k in names if not k.startswith(("linear bf16: ", "attention: "))]  # attention its kernel

    assert all(k.startswith("linear IntxTensor: ") for k in quantized(results["int3"]["kernels_decode"]))
    assert all(k.startswith("linear Float8Tensor: ") for k in quantized(results["fp8-static"]["kernels_decode"]))
    assert results["fp8-static"]["calibrate_s"] > 0 and "calibrate_s" not in results["int3"]
    assert _calls(results["fp8-static"]["kernels_decode"]) == _calls(results["int3"]["kernels_decode"]) > 0


@pytest.mark.slow
def test_benchmark_compiled_rows(tmp_path):
    """--compiled: decode with a static KV cache and the step compiled, beside the eager rows, with
    ratios to eager bf16, the compile timed apart and the opaque ops a compiled step calls."""
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--layers", "1", "--configs", "bf16,int4", "--no-fidelity",
         "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--bandwidth-mb", "32", "--batches", "1,4",
         "--prefill-tokens", "16", "--decode-tokens", "4", "--repeats", "1", "--threads", "1", "--compiled"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    for name in ("bf16", "int4"):
        r = results[name]
        for key in ("decode_tps", "compiled_decode_tps", "compiled_decode_tps_b4", "compile_s", "compile_s_b4"):
            assert r[key] > 0 and math.isfinite(r[key]), (name, key, r)
        assert r["vs_bf16"]["compiled_decode_tps"] == r["compiled_decode_tps"] / results["bf16"]["decode_tps"]
        assert r["compiled_vs_eager"]["decode_tps_b4"] == r["compiled_decode_tps_b4"] / r["compiled_eager_decode_tps_b4"]
    assert results["bf16"]["kernels_decode_compiled"] == []
    if any("_ext" in k for k in results["int4"]["kernels_decode"]):  # hf_aoq's C++ rows: opaque ops in the graph
        # and the bf16 lm_head's GEMV (hf_aoq/dense_linear.py) and the decode-step attention
        # (hf_aoq/decode_attention.py), where they ran eagerly
        eager = results["int4"]["kernels_decode"]
        attention = ["hf_aoq::decode_attention_cpu (1)"] if "attention: decode_attention (1)" in eager else []
        dense = ["hf_aoq::dense_linear_io_cpu (1)"] if "linear bf16: dense_linear (1)" in eager else []
        assert results["int4"]["kernels_decode_compiled"] == attention + dense + ["hf_aoq::int4_linear_io_cpu (7)"]
    assert "Compiled decode" in result.stdout and "b4 compiled tok/s" in result.stdout
