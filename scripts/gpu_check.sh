#!/usr/bin/env bash
# The GPU check, for the day a GPU is lent (about 15 minutes, the machine's start included):
# installs what is missing, runs the cuda-marked tests and a short benchmark, and writes JSON
# into $OUT (default ./gpu_check_out). About 5 minutes on an H200.
#
#   bash scripts/gpu_check.sh             # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run   # print what it would run (any machine), exit 0
#   bash scripts/gpu_check.sh --tp2       # also: tensor-parallel loading on 2 GPUs over NCCL
#                                         # (tests/integrations/test_tensor_parallel{,_moe}.py: dense
#                                         # and MoE experts under TP and EP, ~2 minutes)
#
# The GPU machine may have no network: wheels under ./wheels (if there) are installed from
# there, nothing is downloaded. An older torch there is fine: hf_aoq's CUDA rows check the torch
# version as capabilities (tinygemm and float8 need >= 2.5) and fall back to the reference.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
TP2=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --tp2) TP2=1 ;;
    *) echo "usage: $0 [--dry-run] [--tp2]" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-./gpu_check_out}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
# hf_aoq's C++ CPU extension would build first (a minute of a fresh machine): the CPU side of
# these tests runs aten's CPU kernels instead (HF_AOQ_NO_CPU_EXT= builds and uses it).
export HF_AOQ_NO_CPU_EXT=${HF_AOQ_NO_CPU_EXT-1}
# Each step has its own limit, 5 minutes in all; what a step finished is kept when it is cut.
TEST_TIMEOUT=${TEST_TIMEOUT:-135}
COMPILE_TIMEOUT=${COMPILE_TIMEOUT:-50}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-70}
CROSSOVER_TIMEOUT=${CROSSOVER_TIMEOUT:-45}
TP_TIMEOUT=${TP_TIMEOUT:-300}

run() {  # print a step; run it unless --dry-run
  echo "+ $*"
  [ "$DRY" = 1 ] || "$@"
}

run mkdir -p "$OUT"
# 1. What is missing (hf_aoq itself runs from this checkout).
if [ -d wheels ]; then
  run timeout 120 "$PY" -m pip install --quiet --no-index --find-links wheels wheels/*.whl
fi
run timeout 60 "$PY" -c "import torch, transformers, safetensors, pytest; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# 2. What this GPU and torch allow, as hf_aoq's kernel table sees it.
run timeout 60 env PYTHONPATH="$PWD" "$PY" -c "
import json, sys, torch, hf_aoq
from hf_aoq.kernels import registry
d = torch.device('cuda', torch.cuda.current_device())
caps = {n: registry.capable((c,), d) for n, c in registry._CAPABILITIES.items() if c.device_type == 'cuda'}
json.dump({'torch': torch.__version__, 'cuda': torch.version.cuda, 'device': torch.cuda.get_device_name(),
           'capability': torch.cuda.get_device_capability(), 'capabilities': caps}, open(sys.argv[1], 'w'), indent=1)
" "$OUT/env.json"
# 3. The cuda-marked tests (and the CPU contract checks, a few seconds), as JUnit XML; the
#    torch.compile tests (slowest) apart, so that a timeout there keeps the other results.
PYTEST=(env PYTHONPATH="$PWD" "$PY" -m pytest -q -p no:cacheprovider)
run timeout "$TEST_TIMEOUT" "${PYTEST[@]}" tests/kernels/test_cuda_contracts.py tests/kernels/test_cuda.py tests/integrations/test_transformers_cuda.py \
  -k "not compile" --junitxml "$OUT/tests.xml"
tests_rc=$?
run timeout "$COMPILE_TIMEOUT" "${PYTEST[@]}" tests/kernels/test_cuda.py -k compile --junitxml "$OUT/tests_compile.xml"
compile_rc=$?
# 3b. With --tp2: the tensor-parallel test on 2 GPUs over NCCL (it runs over gloo on CPU in CI).
tp2_rc=0
if [ "$TP2" = 1 ]; then
  run timeout "$TP_TIMEOUT" env HF_AOQ_TP_BACKEND=nccl "${PYTEST[@]}" tests/integrations/test_tensor_parallel.py \
    tests/integrations/test_tensor_parallel_moe.py -k two_processes --junitxml "$OUT/tests_tp2.xml"
  tp2_rc=$?
fi
# 4. The benchmark (run even if a test failed: its figures say where).
run env PYTHONPATH="$PWD" timeout "$BENCH_TIMEOUT" "$PY" scripts/gpu_bench.py --out "$OUT/bench.json"
bench_rc=$?
# 5. The Triton crossovers: int4 / Int4DQ GEMV, GEMM and dequantize + cuBLAS at 1 .. 512 rows
#    (what TRITON_GEMV_MAX_ROWS and TRITON_GEMM_MAX_ROWS should be), and the fp8 quantizer.
run env PYTHONPATH="$PWD" timeout "$CROSSOVER_TIMEOUT" "$PY" scripts/gpu_bench.py --crossover --iters 20 \
  --out "$OUT/crossover.json"
crossover_rc=$?
[ "$DRY" = 1 ] && exit 0
echo "{\"tests_rc\": $tests_rc, \"compile_rc\": $compile_rc, \"bench_rc\": $bench_rc, \"crossover_rc\": $crossover_rc, \"tp2_rc\": $tp2_rc}" > "$OUT/summary.json"
echo "gpu_check: tests rc=$tests_rc, compile tests rc=$compile_rc, bench rc=$bench_rc, crossover rc=$crossover_rc, tp2 rc=$tp2_rc; results in $OUT"
[ "$tests_rc" = 0 ] && [ "$compile_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$crossover_rc" = 0 ] && [ "$tp2_rc" = 0 ]
