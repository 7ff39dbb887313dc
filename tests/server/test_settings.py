"""Settings precedence and validation, presets, and ``python -m server`` as a real process."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.__main__ import main
from server.settings import CONFIG_DIR, Settings, SettingsError, load_settings
from tests import ROOT



def test_defaults_and_precedence(tmp_path):
    assert load_settings([], {}).tree == (4, 2, 2)
    preset = tmp_path / "p.toml"
    preset.write_text('[server]\nmax_batch = 3\nport = 9000\ntree = [2, 2]\ncors-origins = ["http://a"]\n')
    s = load_settings(["--config", str(preset), "--port", "9100"], {"MCSD_PORT": "9050", "MCSD_MAX_QUEUE": "5"})
    assert (s.max_batch, s.port, s.max_queue, s.tree, s.cors_origins) == (3, 9100, 5, (2, 2), ["http://a"])
    env = load_settings([], {"MCSD_CONFIG": str(preset), "MCSD_TREE": "3,1", "MCSD_CORS_ORIGINS": "http://x, http://y",
                             "MCSD_METRICS_AUTH": "true"})
    assert env.tree == (3, 1) and env.cors_origins == ["http://x", "http://y"] and env.metrics_auth
    flags = load_settings(["--no-spec-enabled", "--api-key", "k", "--served-model-name", "m"], {})
    assert not flags.spec_enabled and flags.api_key == "k" and flags.model_id == "m"


def test_presets_parse():
    default = load_settings(["--config", "default"], {})
    assert (default.model, default.draft_model) == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    assert (default.dtype, default.device, default.threads) == ("bf16", "cpu", 2)
    for path in CONFIG_DIR.glob("*.toml"):
        load_settings(["--config", str(path)], {})


def test_relative_shipped_files_resolve_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = load_settings(["--maxgram-corpus", "benchmarks/prompts/train.json",
                       "--acceptance-heads", "benchmarks/prompts/bench.json, no/such/head.safetensors",
                       "--draft-vocab", "32768", "--draft-vocab-file", "configs/draft_vocab/qwen2.5.safetensors"], {})
    assert Path(s.maxgram_corpus) == ROOT / "benchmarks/prompts/train.json"
    assert (s.draft_vocab, Path(s.draft_vocab_file)) == (32768, ROOT / "configs/draft_vocab/qwen2.5.safetensors")
    assert s.acceptance_heads == (str(ROOT / "benchmarks/prompts/bench.json"), "no/such/head.safetensors")


@pytest.mark.parametrize("argv, env, fragment", [
    (["--max-queue", "0"], {}, "max_queue (from --max-queue)"),
    ([], {"MCSD_PORT": "http"}, "port (from MCSD_PORT)"),
    (["--tree", "4,x"], {}, "tree widths must be integers"),
    (["--dtype", "int3"], {}, "unknown dtype"),
    (["--device", "tpu"], {}, "unsupported device"),
    ([], {"MCSD_DRAFT_VOCAB": "-5"}, "draft_vocab (from MCSD_DRAFT_VOCAB)"),
    (["--config", "no-such-preset"], {}, "not found"),
])
def test_bad_settings_are_explained(argv, env, fragment):
    with pytest.raises(SettingsError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        load_settings(argv, env)


def test_unknown_preset_key(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("max_batchh: 3\n")
    with pytest.raises(SettingsError, match="max_batchh .*unknown setting"):
        load_settings(["--config", str(preset)], {})


def test_a_drafters_settings_may_be_a_preset_table(tmp_path):
    """``[maxgram] len = 5`` is ``maxgram_len = 5``; a flag still wins over the preset."""
    from engine.speculative.cascade import CascadeSettings
    from engine.speculative.maxgram import MaxGramSettings

    preset = tmp_path / "p.toml"
    preset.write_text("max_batch = 3\n[maxgram]\nlen = 5\nmin-ngram = 2\n[cascade]\ndepth = 6\n")
    config = load_settings(["--config", str(preset), "--cascade-depth", "7"], {}).engine_config()
    mg = MaxGramSettings.of(config)
    assert (config.max_batch, mg.len, mg.min_ngram, CascadeSettings.of(config).depth) == (3, 5, 2, 7)
    preset.write_text("[maxgram]\nlenn = 5\n")
    with pytest.raises(SettingsError, match="maxgram_lenn .*unknown setting"):
        load_settings(["--config", str(preset)], {})


def test_main_without_model_exits_2(capsys, monkeypatch):
    monkeypatch.delenv("MCSD_MODEL", raising=False)
    monkeypatch.delenv("MCSD_CONFIG", raising=False)
    assert main([]) == 2
    assert "no model given" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_cli_serves_a_local_model_directory(tmp_path):
    """``python -m server`` on tiny HF directories, warming up first (``--warm-up on``, CUDA's default):
    /health 503 or 200, a completion, clean SIGINT exit."""
    from tests.fakes import make_tokenizer
    from tests.tiny import save_tiny_pair

    save_tiny_pair(tmp_path, make_tokenizer())
    port = _free_port()
    env = {**os.environ, "MCSD_MAX_MODEL_LEN": "128", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "server", "--config", "tiny-test", "--model", str(tmp_path / "target"),
                             "--draft-model", str(tmp_path / "draft"), "--port", str(port), "--served-model-name", "t",
                             "--warm-up", "on"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"model": "t", "prompt": "hello", "max_tokens": 4,
                                                      "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "Application shutdown complete" in out, out
    assert re.search(r"warmed up: \d+ engine steps", out), out


@pytest.mark.slow
def test_cli_exits_1_when_loading_fails(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "server", "--config", "tiny-test", "--model", str(tmp_path / "none")],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "model loading failed" in proc.stderr


def test_engine_settings_come_from_the_engine_config_alone():
    """Every server-visible EngineConfig field and every drafter's setting (``<section>_<field>``) is
    a setting with its declared default, help and bounds, settable by flag, environment and preset,
    and ``engine_config()`` hands it over unchanged."""
    import dataclasses

    from engine.config import EngineConfig
    from engine.registry import sections
    from engine.speculative.maxgram import MaxGramSettings
    from engine.speculative.mjsd import MjsdSettings

    fields = [(f.name, f) for f in dataclasses.fields(EngineConfig) if f.metadata.get("server", True)]
    fields += [(f"{name}_{f.name}", f) for name, cls in sections().items() for f in dataclasses.fields(cls)]
    assert {"maxgram_len", "cascade_depth", "mjsd_tau", "target_init_k"} <= {name for name, _ in fields}
    assert {name for name, _ in fields} <= set(Settings.model_fields)
    assert "without_replacement" not in Settings.model_fields and "drafters" not in Settings.model_fields
    for name, f in fields:
        info = Settings.model_fields[name]
        assert info.default == f.default and info.description == f.metadata["help"], name
    s = load_settings(["--maxgram-max-ngram", "3", "--adaptive-min-depth", "2", "--no-load-aware"],
                      {"MCSD_MJSD_TAU": "0.25"})
    config = s.engine_config()
    assert (MaxGramSettings.of(config).max_ngram, config.adaptive_min_depth, config.load_aware,
            MjsdSettings.of(config).tau) == (3, 2, False, 0.25)
    assert config.tree == EngineConfig().tree and config.max_batch == EngineConfig().max_batch
    with pytest.raises(SettingsError, match="maxgram_branches .*--maxgram-branches.*less than or equal to 8"):
        load_settings(["--maxgram-branches", "9"], {})
    with pytest.raises(SettingsError, match="spec_method"):
        load_settings(["--spec-method", "nope"], {})
