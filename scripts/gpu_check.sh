#!/usr/bin/env bash
# The checks that need a GPU, on a machine with CUDA and the project's dependencies installed:
# the CUDA tests (tests/engine/test_cuda.py, marker "gpu") and the GPU benchmark (benchmarks/bench_gpu.py).
#   bash scripts/gpu_check.sh [RESULTS_DIR] [bench_gpu.py arguments...]
# Logs and the benchmark's JSON go to RESULTS_DIR (default benchmarks/results).  Exits non-zero if
# either part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-benchmarks/results}
shift || true
PY=${PYTHON:-python3}
mkdir -p "$DIR"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$DIR/gpu_info.log"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
    2>&1 | tee -a "$DIR/gpu_info.log"
"$PY" -m pytest -q -m gpu -p no:cacheprovider --timeout 300 --durations=5 tests/engine/test_cuda.py 2>&1 \
    | tee "$DIR/gpu_tests.log"
tests=${PIPESTATUS[0]}
"$PY" benchmarks/bench_gpu.py --out "$DIR/gpu.json" --host-profile "$DIR/gpu_host_profile.txt" "$@" 2>&1 | tee "$DIR/gpu_bench.log"
bench=${PIPESTATUS[0]}
echo "tests: exit $tests; benchmark: exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
