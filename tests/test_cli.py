"""The README's quick-start job, run as a user would."""
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open


def test_demo_quantizes_saves_reloads_and_generates(tmp_path):
    out = tmp_path / "int4"
    result = subprocess.run(
        [sys.executable, "-m", "hf_aoq", "demo", "--out", str(out), "--new-tokens", "8"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("  int4: ") for line in lines), result.stdout
    ratio = next(line for line in lines if line.startswith("int4/bf16: size "))
    assert float(ratio.split("size ")[1].split("x")[0]) < 0.6  # embeddings stay bf16 by default
    shards = list(Path(out).glob("*.safetensors"))
    assert shards
    with safe_open(str(shards[0]), framework="pt") as f:
        assert "hf_aoq" in (f.metadata() or {})


def test_cli_errors_are_one_line():
    result = subprocess.run([sys.executable, "-m", "hf_aoq", "demo", "--group-size", "48"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "invalid choice" in result.stderr
