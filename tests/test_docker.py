"""The Dockerfile and compose files agree with the project (no Docker daemon needed).

An image cannot be built here, so these check what a build would trip over: every COPY source exists
and is not excluded by .dockerignore, the files the default preset names are copied, the image's
environment plus each compose overlay gives valid server settings that listen on the exposed port,
and Prometheus scrapes the port and path the server serves."""

from __future__ import annotations

import fnmatch
import re
import shlex
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
