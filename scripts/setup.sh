#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with its test extras.
# torch is pinned to a CPU-friendly release first so the range in pyproject.toml
# does not pull a multi-GB CUDA build on machines that have no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --progress-bar off --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
    python -m pip install --quiet --progress-bar off "torch==${TORCH_VERSION:-2.13.0}"
fi
python -m pip install --quiet --progress-bar off -e ".[test]"
