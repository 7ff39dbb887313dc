#!/usr/bin/env bash
# Downloads, into .whl/, the wheels of the packages the GPU machine's image lacks (its python3 is 3.12
# with torch, transformers, tokenizers, numpy, httpx, prometheus-client, pytest and pytest-timeout, but
# no FastAPI, uvicorn, pydantic 2.14, xgrammar, gguf or openai), each at the version of this checkout's
# .venv, so that the GPU runs what CI tests.  Run it here, where PyPI is reachable; then carry .whl in
# the device call, where scripts/gpu_check.sh installs them into /tmp/site before anything else.
#   bash scripts/gpu_wheels.sh [PYTHON]        # PYTHON: the interpreter whose versions to match (.venv's)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
PACKAGES="gguf fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection typing_extensions
          opentelemetry-api xgrammar apache-tvm-ffi openai jiter sniffio httpx2 httpcore2 truststore idna h11
          anyio"
rm -rf .whl && mkdir -p .whl
pins=()
for p in $PACKAGES; do
    v=$("$PY" -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$v" ] || { echo "error: $p is not installed in $PY" >&2; exit 1; }
    pins+=("$p==$v")
done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "${pins[@]}"
ls .whl
du -sh .whl
