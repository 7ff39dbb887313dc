#!/usr/bin/env bash
# The fast suite under another torch release, on this machine's CPU: the GPU image's torch (2.11.0 as of
# 2026-11) before a GPU run, so that an incompatibility is found here, not in a device call's minutes.
# A venv of its own gets torch VERSION from PyPI (on x86-64 Linux a CUDA build: about 4.6 GB with its
# NVIDIA libraries, which run on the CPU without a GPU) and every other package at this checkout's
# .venv version (no dependency resolution), then runs pytest -m "not slow" (extra arguments go to pytest).
#   bash scripts/torch_compat.sh [VERSION] [pytest arguments...]     # VERSION: 2.11.0 by default
# The venv stays (VENV, default /tmp/mcsd-torch-VERSION): a second run reuses it.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-2.11.0}
shift || true
VENV=${VENV:-/tmp/mcsd-torch-$VERSION}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, fastapi" 2>/dev/null; then
    python3.11 -m venv "$VENV"
    "$VENV/bin/pip" install -q "torch==$VERSION"
    # the rest at .venv's versions; torch's own triton stays (it must match torch), and no project install
    .venv/bin/pip freeze --exclude-editable | grep -v -i -E '^(torch|triton|mcsd-server)==' > "$VENV/pins.txt"
    "$VENV/bin/pip" install -q --no-deps -r "$VENV/pins.txt"
fi
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__)"
exec "$VENV/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider "$@"
