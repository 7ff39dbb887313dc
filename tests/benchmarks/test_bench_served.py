"""``benchmarks/bench_served.py`` with tiny models: both paths deliver every token, and the ratio is
the two rates' quotient (each served round starts a client process: kept to one level here)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_served


@pytest.mark.parametrize("draft", [None, "tiny"], ids=["plain", "speculative"])
def test_served_and_engine_alone_deliver_the_same_tokens(tmp_path, capsys, draft):
    out = tmp_path / "served.json"
    argv = ["--concurrency", "3", "--max-tokens", "6", "--prompt-len", "5", "--rounds", "2", "--out", str(out)]
    bench_served.main(argv + (["--draft", draft] if draft else []))
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [3]
    for r in rows:
        assert r["tokens"] == r["concurrency"] * 6  # every stream's tokens, counted from its usage
        assert len(r["engine_rounds"]) == len(r["served_rounds"]) == 2
        assert r["ratio"] == pytest.approx(r["served_tok_s"] / r["engine_tok_s"])
        assert r["engine_tok_s"] > 0 and r["served_tok_s"] > 0
    assert "served / engine" in capsys.readouterr().out
