#!/usr/bin/env bash
# The checks that need a GPU, on a machine with CUDA and the project's dependencies installed:
# the CUDA tests (tests/engine/test_cuda.py, marker "gpu"), the GPU benchmark (benchmarks/bench_gpu.py: the
# captured floor, plain and speculative steps with and without CUDA graphs, the 7B shape, the projection)
# and the HTTP layer's served / engine ratio (benchmarks/bench_served.py).
#   bash scripts/gpu_wheels.sh                                  # here, where PyPI is reachable: .whl/
#   bash scripts/gpu_check.sh [RESULTS_DIR] [bench_gpu.py arguments...]   # there, with .whl carried
# Logs and the benchmarks' JSON go to RESULTS_DIR (default benchmarks/results).  Exits non-zero if
# any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-benchmarks/results}
shift || true
PY=${PYTHON:-python3}
mkdir -p "$DIR"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # the packages the machine lacks, as wheels (scripts/gpu_wheels.sh made them)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "error: installing .whl failed" >&2; exit 1; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$DIR/gpu_info.log"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
    2>&1 | tee -a "$DIR/gpu_info.log"
# Each part has a time limit (TESTS_S, BENCH_S, SERVED_S seconds), so that the whole script fits one
# device call of 10 minutes with room for the wheels and the imports: a part that hangs is cut, and the
# others still run.  Each part keeps what it measured as it goes (the CUDA tests that compile with
# Inductor come last in their file; bench_gpu.py saves its rows after every timed round, bench_served.py
# after every concurrency).
timeout "${TESTS_S:-160}" "$PY" -m pytest -q -m gpu -p no:cacheprovider --timeout 120 --durations=5 \
    tests/engine/test_cuda.py 2>&1 | tee "$DIR/gpu_tests.log"
tests=${PIPESTATUS[0]}
# without arguments: a run sized to fit (fewer new tokens, repetitions and trees than bench_gpu.py's
# defaults, speculation at batch 1 only, where its goals are; the compiled-layer rows, --compile, and
# the 7B shape are in)
[ "$#" -gt 0 ] || set -- --new-tokens 32 --reps 5 --rows 1,8,32 --trees "4,2,2;2,1,1" --spec-batches 1 --warmup-s 3
timeout "${BENCH_S:-290}" "$PY" benchmarks/bench_gpu.py --out "$DIR/gpu.json" \
    --host-profile "$DIR/gpu_host_profile.txt" "$@" 2>&1 | tee "$DIR/gpu_bench.log"
bench=${PIPESTATUS[0]}
# the HTTP layer at GPU speeds: served / engine-alone throughput at 8 and 32 streams
# , with the engine in the server's process and in one of its own (--engine-process)
timeout "${SERVED_S:-90}" "$PY" benchmarks/bench_served.py --device cuda --shape qwen2.5-1.5b --concurrency 8,32 \
    --max-tokens 128 --rounds 2 --serve thread,process --out "$DIR/served.json" 2>&1 | tee "$DIR/gpu_served.log"
served=${PIPESTATUS[0]}
echo "tests: exit $tests; benchmark: exit $bench; served: exit $served (124: cut at its time limit)"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$served" -eq 0 ]
