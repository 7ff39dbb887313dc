#!/usr/bin/env bash
# Builds the Dockerfile, starts the image with a small model, and smokes it: waits for /health, sends
# one chat completion and one streamed chat completion through the openai client, reads /metrics,
# then removes the container.  Prints the build time, the image size and the time to ready.
# Too slow for CI (a cold build downloads torch and the dependencies; the first start compiles the
# CPU kernels, about a minute); tests/test_docker.py only checks its syntax and options.
#
#   scripts/image_smoke.sh                       # docker or podman, official python:3.11-slim base
#
# Where no image registry and no download.pytorch.org are reachable (only Debian's mirror and PyPI),
# make a Debian bookworm base locally and give the build a directory holding the CPU torch wheel:
#
#   docker/base/make_base.sh                     # debootstrap + import -> mcsd-base:bookworm
#   scripts/image_smoke.sh --base mcsd-base:bookworm --pip-find-links /opt/wheels
#   scripts/image_smoke.sh --make-base --base mcsd-base:bookworm --pip-find-links /opt/wheels   # both
#
# --pip-find-links DIR is served over HTTP on 127.0.0.1 for the build (which runs with host
# networking); a torch-<version>-cp*.whl in it pins TORCH_VERSION to that wheel's version (e.g.
# 2.13.0+cpu), and torch's own dependencies then come from --pip-index (default: PyPI).
#
# The model packs are read from --cache DIR (default: $MCSD_CACHE or ~/.cache/mcsd), whose models/ is
# mounted read-only at /cache/models over a fresh volume at /cache, so nothing is downloaded, the
# container's kernel build does not touch the host's cache, and the time to ready is a first start's.
# --reuse-cache mounts DIR itself read-write at /cache instead (a later start: kernels already built).
# Podman on hosts where crun cannot set rlimits: set `[containers] default_ulimits = []` and
# `[engine] runtime = "runc"` in /etc/containers/containers.conf.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

ENGINE=
BASE=
MAKE_BASE=0
FIND_LINKS=
PIP_INDEX=
TAG=mcsd-server:smoke
MODEL=smollm2-135m-instruct
DRAFT_MODEL=smollm2-135m-instruct
CACHE=${MCSD_CACHE:-$HOME/.cache/mcsd}
REUSE_CACHE=0
PORT=8000
THREADS=2
KEEP=0
TIMEOUT=900
SKIP_BUILD=0

usage() {
    cat <<EOF
Usage: scripts/image_smoke.sh [options]

Build the image, run it with a small model, smoke /health, a chat completion, a streamed chat
completion and /metrics, and remove the container.

  --engine docker|podman   container engine (default: whichever runs here, podman first)
  --base IMAGE             build FROM this local base image (BASE_IMAGE build arg) instead of
                           python:3.11-slim, e.g. mcsd-base:bookworm from docker/base/make_base.sh
  --make-base              make the --base image with docker/base/make_base.sh if it is missing
  --pip-find-links DIR     serve DIR (wheels, e.g. /opt/wheels with the CPU torch) to the build's pip
  --pip-index URL          pip index for the build (PIP_INDEX_URL; also torch's index with --pip-find-links)
  --tag IMAGE              image to build and run (default: $TAG)
  --skip-build             run the existing --tag image without building it
  --model NAME             target model pack (default: $MODEL)
  --draft-model NAME       draft model pack, '' for none (default: $DRAFT_MODEL)
  --cache DIR              host cache holding models/<pack> (default: \$MCSD_CACHE or ~/.cache/mcsd)
  --reuse-cache            mount the whole --cache read-write at /cache (kernels, cost model reused)
  --port PORT              port the server listens on, host networking (default: $PORT)
  --threads N              MCSD_THREADS in the container (default: $THREADS)
  --timeout SECONDS        longest wait for /health to answer 200 (default: $TIMEOUT)
  --keep                   leave the container running (and its cache volume) at the end
  -h, --help               this text
EOF
}

die() { echo "image_smoke: $*" >&2; exit 1; }
need() { if [ $# -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value"; fi; }

while [ $# -gt 0 ]; do
    case "$1" in
        --engine) need "$@"; ENGINE=$2; shift 2 ;;
        --base) need "$@"; BASE=$2; shift 2 ;;
        --make-base) MAKE_BASE=1; shift ;;
        --pip-find-links) need "$@"; FIND_LINKS=$2; shift 2 ;;
        --pip-index) need "$@"; PIP_INDEX=$2; shift 2 ;;
        --tag) need "$@"; TAG=$2; shift 2 ;;
        --skip-build) SKIP_BUILD=1; shift ;;
        --model) need "$@"; MODEL=$2; shift 2 ;;
        --draft-model) [ $# -ge 2 ] || die "--draft-model needs a value"; DRAFT_MODEL=$2; shift 2 ;;
        --cache) need "$@"; CACHE=$2; shift 2 ;;
        --reuse-cache) REUSE_CACHE=1; shift ;;
        --port) need "$@"; PORT=$2; shift 2 ;;
        --threads) need "$@"; THREADS=$2; shift 2 ;;
        --timeout) need "$@"; TIMEOUT=$2; shift 2 ;;
        --keep) KEEP=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "image_smoke: unknown option: $1" >&2; usage >&2; exit 2 ;;
    esac
done

[[ $PORT =~ ^[0-9]+$ ]] || die "--port must be a number, not '$PORT'"
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "--timeout must be a number of seconds, not '$TIMEOUT'"
[[ $THREADS =~ ^[0-9]+$ ]] || die "--threads must be a number, not '$THREADS'"
[ "$MAKE_BASE" = 0 ] || [ -n "$BASE" ] || die "--make-base needs --base IMAGE (e.g. mcsd-base:bookworm)"
[ -z "$FIND_LINKS" ] || [ -d "$FIND_LINKS" ] || die "--pip-find-links $FIND_LINKS: not a directory"
[ -d "$CACHE/models/$MODEL" ] || die "no model pack $CACHE/models/$MODEL (fetch it: python -m tools.fetch $MODEL)"
[ -z "$DRAFT_MODEL" ] || [ -d "$CACHE/models/$DRAFT_MODEL" ] || die "no model pack $CACHE/models/$DRAFT_MODEL"

if [ -z "$ENGINE" ]; then
    if command -v podman >/dev/null && podman info >/dev/null 2>&1; then ENGINE=podman
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker
    else die "neither podman nor docker can run containers here (podman info / docker info fail)"
    fi
fi
case "$ENGINE" in docker|podman) ;; *) die "--engine must be docker or podman, not '$ENGINE'" ;; esac
command -v "$ENGINE" >/dev/null || die "$ENGINE is not installed"

PY=python3
if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; fi
"$PY" -c "import openai" 2>/dev/null || die "$PY has no openai package (pip install openai)"

NAME=mcsd-smoke-$$
VOLUME=
SERVER_PID=
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mcsd-smoke.XXXXXX")

cleanup() {
    local rc=$?
    [ -z "$SERVER_PID" ] || kill "$SERVER_PID" 2>/dev/null || true
    if [ "$KEEP" = 1 ]; then
        if "$ENGINE" inspect "$NAME" >/dev/null 2>&1; then
            echo "== kept container $NAME (http://127.0.0.1:$PORT); remove it with:"
            echo "   $ENGINE rm -f $NAME${VOLUME:+ && $ENGINE volume rm $VOLUME}"
        fi
    else
        "$ENGINE" rm -f "$NAME" >/dev/null 2>&1 || true
        [ -z "$VOLUME" ] || "$ENGINE" volume rm -f "$VOLUME" >/dev/null 2>&1 || true
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

human() {
    awk -v b="$1" 'BEGIN { split("B KB MB GB TB", u); i = 1; while (b >= 1000 && i < 5) { b /= 1000; i++ }
                           printf "%.2f %s", b, u[i] }'
}
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

echo "== engine: $ENGINE ($("$ENGINE" --version 2>/dev/null | head -1))"

# ---- base image -------------------------------------------------------------------------------
if [ -n "$BASE" ] && ! "$ENGINE" image inspect "$BASE" >/dev/null 2>&1; then
    [ "$MAKE_BASE" = 1 ] || die "no base image $BASE; make it with docker/base/make_base.sh --tag $BASE (or pass --make-base)"
    "$ROOT/docker/base/make_base.sh" --tag "$BASE" --engine "$ENGINE"
fi

# ---- build ------------------------------------------------------------------------------------
BUILD_TIME=skipped
if [ "$SKIP_BUILD" = 0 ]; then
    args=(--network host -t "$TAG" -f "$ROOT/Dockerfile")
    [ -z "$BASE" ] || args+=(--build-arg "BASE_IMAGE=$BASE")
    [ -z "$PIP_INDEX" ] || args+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX")
    if [ -n "$FIND_LINKS" ]; then
        # A local HTTP server, as the build cannot see host directories; 127.0.0.1 through host networking.
        # A fixed port: the URL is a build arg, part of the layer cache key of every RUN after it.
        LINKS_PORT=$("$PY" -c 'import socket
s = socket.socket()
try: s.bind(("127.0.0.1", 38917))
except OSError: s.bind(("127.0.0.1", 0))  # taken: any port, and the pip layers are not reused
print(s.getsockname()[1])')
        "$PY" -m http.server --bind 127.0.0.1 --directory "$FIND_LINKS" "$LINKS_PORT" >"$WORK/links.log" 2>&1 &
        SERVER_PID=$!
        for _ in $(seq 50); do
            "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$LINKS_PORT/', timeout=1)" 2>/dev/null && break
            sleep 0.2
        done
        args+=(--build-arg "PIP_FIND_LINKS=http://127.0.0.1:$LINKS_PORT/")
        wheel=$(find "$FIND_LINKS" -maxdepth 1 -name 'torch-*-cp*.whl' -printf '%f\n' | sort -V | tail -1)
        if [ -n "$wheel" ]; then
            version=${wheel#torch-}; version=${version%%-*}
            args+=(--build-arg "TORCH_VERSION=$version" --build-arg "TORCH_INDEX_URL=${PIP_INDEX:-https://pypi.org/simple}")
            echo "== torch $version from $FIND_LINKS/$wheel"
        fi
    fi
    echo "== build $TAG: $ENGINE build ${args[*]} $ROOT"
    start=$(now)
    set +e  # the steps as they start; the whole log only if the build fails
    "$ENGINE" build "${args[@]}" "$ROOT" 2>&1 | tee "$WORK/build.log" | grep --line-buffered -E '^(STEP|Step|#[0-9]+ \[)'
    status=${PIPESTATUS[0]}
    set -e
    [ "$status" = 0 ] || { tail -40 "$WORK/build.log" >&2; die "the build failed (exit $status; log above)"; }
    BUILD_TIME=$(since "$start")s
    [ -z "$SERVER_PID" ] || { kill "$SERVER_PID" 2>/dev/null || true; SERVER_PID=; }
    echo "== built in $BUILD_TIME"
fi
"$ENGINE" image inspect "$TAG" >/dev/null 2>&1 || die "no image $TAG (build it, or drop --skip-build)"
SIZE=$("$ENGINE" image inspect --format '{{.Size}}' "$TAG")
echo "== image $TAG: $(human "$SIZE") ($SIZE bytes)"
"$ENGINE" run --rm --network host --entrypoint python "$TAG" -c \
    'import sys, torch; print("== python", sys.version.split()[0], "torch", torch.__version__)'

# ---- run --------------------------------------------------------------------------------------
mounts=()
if [ "$REUSE_CACHE" = 1 ]; then
    mounts+=(-v "$CACHE:/cache")
else
    VOLUME=mcsd-smoke-cache-$$
    "$ENGINE" volume create "$VOLUME" >/dev/null
    mounts+=(-v "$VOLUME:/cache" -v "$CACHE/models:/cache/models:ro")
fi
envs=(-e "MCSD_HOST=127.0.0.1" -e "MCSD_PORT=$PORT" -e "MCSD_THREADS=$THREADS" -e "MCSD_MODEL=$MODEL"
      -e "MCSD_DRAFT_MODEL=$DRAFT_MODEL" -e "MCSD_SERVED_MODEL_NAME=$MODEL")
if "$PY" -c "import socket, sys; s = socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $PORT)) != 0)"; then
    die "port $PORT is in use here (--port)"
fi
echo "== run $NAME: $MODEL${DRAFT_MODEL:+ + draft $DRAFT_MODEL}, port $PORT, $THREADS threads"
start=$(now)
"$ENGINE" run -d --name "$NAME" --network host "${mounts[@]}" "${envs[@]}" "$TAG" >/dev/null

URL=http://127.0.0.1:$PORT
deadline=$(( $(date +%s) + TIMEOUT ))
until "$PY" -c "import urllib.request as u; u.urlopen('$URL/health', timeout=2)" 2>/dev/null; do
    if [ "$("$ENGINE" inspect --format '{{.State.Running}}' "$NAME" 2>/dev/null)" != true ]; then
        "$ENGINE" logs "$NAME" 2>&1 | tail -40 >&2
        die "the container stopped before /health answered (logs above)"
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
        "$ENGINE" logs "$NAME" 2>&1 | tail -40 >&2
        die "/health did not answer 200 within ${TIMEOUT}s (logs above)"
    fi
    sleep 2
done
READY_TIME=$(since "$start")s
echo "== ready in $READY_TIME (/health 200)"
"$ENGINE" logs "$NAME" 2>&1 | grep -E 'compiling|engine ready|cost model: measured|loading' | sed 's/^/   | /' || true

# ---- smoke: chat, streamed chat, structured output, /metrics ---------------------------------------
"$PY" - "$URL" "$MODEL" <<'EOF'
import json
import sys
import time
import urllib.request

from openai import OpenAI

url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=url + "/v1", api_key="none", timeout=300)
print("== models:", [m.id for m in client.models.list().data])

messages = [{"role": "user", "content": "Name three colors, comma separated."}]
t0 = time.perf_counter()
reply = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
text = reply.choices[0].message.content
print(f"== chat ({time.perf_counter() - t0:.2f}s, {reply.usage.completion_tokens} tokens, "
      f"finish {reply.choices[0].finish_reason}): {text!r}")
assert text and text.strip(), "empty chat reply"

t0 = time.perf_counter()
chunks, parts, finish = 0, [], None
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                            stream=True):
    chunks += 1
    if chunk.choices:
        parts.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
streamed = "".join(parts)
print(f"== streamed chat ({time.perf_counter() - t0:.2f}s, {chunks} chunks, finish {finish}): {streamed!r}")
assert chunks > 1 and streamed.strip(), "the stream brought no text"
assert streamed == text, "greedy streamed text differs from the plain reply"

schema = {"type": "object", "required": ["colors"], "additionalProperties": False,
          "properties": {"colors": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}}
t0 = time.perf_counter()
reply = client.chat.completions.create(model=model, messages=messages, max_tokens=96, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "colors", "schema": schema}})
data = json.loads(reply.choices[0].message.content)  # the grammar (xgrammar) makes it valid JSON
assert isinstance(data.get("colors"), list), data
print(f"== structured output ({time.perf_counter() - t0:.2f}s): {data}")

metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
lines = [line for line in metrics.splitlines() if line.startswith("mcsd:")]
print(f"== /metrics: {len(lines)} mcsd: samples, e.g.")
keys = ("mcsd:request_success", "mcsd:generation_tokens", "mcsd:prompt_tokens",
        "mcsd:spec_decode_num_draft_tokens", "mcsd:spec_decode_num_accepted_tokens_total")
for line in lines:
    if line.startswith(keys) and "_created" not in line:
        print("   ", line)
assert any(line.startswith("mcsd:request_success") for line in lines), "no mcsd:request_success in /metrics"
EOF

echo "== summary: engine $ENGINE, image $TAG $(human "$SIZE"), build $BUILD_TIME, ready $READY_TIME"
echo "== smoke passed"
