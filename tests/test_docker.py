"""The Dockerfile and compose files agree with the project (no Docker daemon needed).

An image cannot be built here, so these check what a build would trip over: every COPY source exists
and is not excluded by .dockerignore, the files the default preset names are copied, the image's
environment plus each compose overlay gives valid server settings that listen on the exposed port,
and Prometheus scrapes the port and path the server serves."""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from server.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent


def _instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for op, rest in _instructions():
        if op == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def _copies() -> list[tuple[str, str]]:
    pairs = []
    for op, rest in _instructions():
        if op == "COPY" and "--from" not in rest:
            *sources, dest = shlex.split(rest)
            pairs.extend((src, dest) for src in sources)
    return pairs


def _ignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    parts = Path(path).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatch(prefix, pat.removeprefix("**/")) or fnmatch.fnmatch(prefix, pat)
               for pat in patterns for prefix in prefixes)


def _compose(name: str) -> dict:
    return yaml.safe_load((ROOT / "docker" / name).read_text())


def _compose_env(*names: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for name in names:
        for key, value in (_compose(name)["services"]["server"].get("environment") or {}).items():
            # ${VAR:-default} reads as its default, as compose does when VAR is unset
            env[key] = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))
    return env


def test_every_copy_source_exists_and_reaches_the_build_context():
    copies = _copies()
    assert copies, "the Dockerfile copies nothing"
    for src, _ in copies:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
        assert not _ignored(src), f"COPY {src}: excluded by .dockerignore"


def test_the_files_the_default_preset_names_are_in_the_image():
    settings = load_settings([], environ=_image_env())
    copied = {src.rstrip("/") for src, _ in _copies()}
    named = [settings.maxgram_corpus, settings.draft_vocab_file, *(settings.acceptance_heads or "").split(",")]
    assert settings.maxgram_corpus, "the default preset names a Max-Gram corpus"
    for path in filter(None, named):
        rel = (ROOT / path).resolve().relative_to(ROOT).as_posix()
        assert any(rel == c or rel.startswith(c + "/") for c in copied), f"{rel} is not copied"


@pytest.mark.parametrize("overlays", [("compose.yaml",), ("compose.yaml", "compose.gpu.yaml")])
def test_image_and_compose_environment_give_valid_settings_on_the_exposed_port(overlays):
    env = {**_image_env(), **_compose_env(*overlays)}
    settings = load_settings([], environ=env)
    assert settings.host == "0.0.0.0"  # reachable through the published port
    exposed = {int(rest.split("/")[0]) for op, rest in _instructions() if op == "EXPOSE"}
    assert settings.port in exposed
    published = {int(p.split(":")[-1]) for p in _compose("compose.yaml")["services"]["server"]["ports"]}
    assert settings.port in published
    if "compose.gpu.yaml" in overlays:
        assert settings.device == "cuda" and list(settings.tree) == [4, 2, 2, 1]


def test_entrypoint_runs_the_server_and_health_check_polls_health():
    ops = dict(_instructions())
    assert shlex.split(ops["ENTRYPOINT"].strip("[]").replace(",", " ")) == ["python", "-m", "server"]
    assert "/health" in ops["HEALTHCHECK"]


def test_prometheus_scrapes_the_server_metrics_endpoint():
    scrape = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics"
    target = scrape["static_configs"][0]["targets"][0]
    host, port = target.split(":")
    assert host in _compose("compose.yaml")["services"]
    assert int(port) == load_settings([], environ=_image_env()).port


# ---- scripts/image_smoke.sh: builds and smokes the image for real; too slow for CI, so only its syntax,
# options and what it checks are tested here.  The Dockerfile's defaults stay the official-python build.

SMOKE = ROOT / "scripts" / "image_smoke.sh"
MAKE_BASE = ROOT / "docker" / "base" / "make_base.sh"
SMOKE_OPTIONS = ["--engine", "--base", "--make-base", "--pip-find-links", "--pip-index", "--tag", "--skip-build",
                 "--model", "--draft-model", "--cache", "--reuse-cache", "--port", "--threads", "--timeout",
                 "--keep", "--help"]


def _bash(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=30, cwd=ROOT)


@pytest.mark.parametrize("script", [SMOKE, MAKE_BASE], ids=lambda p: p.name)
def test_smoke_scripts_parse_and_are_executable(script):
    assert script.stat().st_mode & 0o111, f"{script.name} is not executable"
    done = _bash("-n", str(script))
    assert done.returncode == 0, done.stderr


def test_smoke_script_help_lists_every_option():
    done = _bash(str(SMOKE), "--help")
    assert done.returncode == 0, done.stderr
    for option in SMOKE_OPTIONS:
        assert option in done.stdout, f"--help does not mention {option}"
    parsed = set(re.findall(r"^\s+(--[a-z-]+|-h\|--help)\)", SMOKE.read_text(), re.M))
    assert {o.split("|")[-1] for o in parsed} == set(SMOKE_OPTIONS), "options parsed and documented differ"


@pytest.mark.parametrize("args", [("--bogus",), ("--port",), ("--port", "http"), ("--make-base",),
                                  ("--engine", "lxc"), ("--model", "no-such-pack")],
                         ids=" ".join)
def test_smoke_script_rejects_bad_options_before_doing_anything(args, tmp_path):
    (tmp_path / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    done = _bash(str(SMOKE), "--cache", str(tmp_path), *args)
    assert done.returncode != 0
    assert "image_smoke:" in done.stderr, done.stderr
    assert "== engine" not in done.stdout  # refused before touching a container engine


def test_make_base_help_and_unknown_option():
    assert _bash(str(MAKE_BASE), "--help").returncode == 0
    done = _bash(str(MAKE_BASE), "--bogus")
    assert done.returncode != 0 and "unknown option" in done.stderr


def test_smoke_script_checks_health_chat_stream_and_metrics_and_cleans_up():
    text = SMOKE.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    for needle in ("/health", "/metrics", "stream=True", "chat.completions.create", "mcsd:", "trap cleanup EXIT",
                   'rm -f "$NAME"', "--network host", "BASE_IMAGE=", "PIP_FIND_LINKS=", "docker/base/make_base.sh"):
        assert needle in text, f"image_smoke.sh lacks {needle!r}"


def _build_args() -> dict[str, str]:
    """Every ARG's default (None: no default), the ones before FROM expanded as a build would."""
    args: dict[str, str | None] = {}
    for op, rest in _instructions():
        if op == "ARG":
            name, eq, default = rest.partition("=")
            args[name] = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1)) or "", default) if eq else None
    return args


def test_dockerfile_defaults_are_the_official_python_cpu_build():
    args = _build_args()
    froms = [rest for op, rest in _instructions() if op == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args["TORCH_VERSION"] == "2.13.0"
    # pip reads these from the build environment, and ignores them while empty (without --build-arg)
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        assert args.get(name) == "", f"ARG {name} must default to empty"
    torch_step = next(rest for op, rest in _instructions() if op == "RUN" and "torch==" in rest)
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_step


def test_dockerfile_still_documents_the_gpu_build():
    header = (ROOT / "Dockerfile").read_text().split("\nARG", 1)[0]
    assert "--gpus" in header and "TORCH_INDEX_URL=https://pypi.org/simple" in header and "MCSD_DEVICE=cuda" in header
