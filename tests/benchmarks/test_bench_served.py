"""``benchmarks/bench_served.py`` with tiny models (and the fake engine): every path delivers every token,
the engine in-process or in its own process, and the ratio is the two rates' quotient (each served
round starts a client process: kept to one level here)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_served


@pytest.mark.parametrize("extra, modes", [
    ([], ["thread"]),
    (["--draft", "tiny", "--serve", "thread,process"], ["thread", "process"]),  # the engine process built alike
    (["--model", "fake", "--fake-step-ms", "2"], ["thread"]),
], ids=["plain", "speculative-thread-and-process", "fake-engine"])
def test_served_and_engine_alone_deliver_the_same_tokens(tmp_path, capsys, extra, modes):
    out = tmp_path / "served.json"
    argv = ["--concurrency", "3", "--max-tokens", "6", "--prompt-len", "5", "--rounds", "2", "--out", str(out)]
    bench_served.main(argv + extra)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["serve"]) for r in rows] == [(3, mode) for mode in modes]
    for r in rows:
        assert r["tokens"] == r["concurrency"] * 6  # every stream's tokens, counted from its usage
        assert len(r["engine_rounds"]) == len(r["served_rounds"]) == 2
        assert r["ratio"] == pytest.approx(r["served_tok_s"] / r["engine_tok_s"])
        assert r["engine_tok_s"] > 0 and r["served_tok_s"] > 0
    assert "served / engine" in capsys.readouterr().out
