"""The serving benchmark end to end: it starts ``python -m server --config tiny-test`` on tiny random HF
directories made here (as tests/server/test_settings.py does), runs two concurrency levels in both modes,
stops the server and writes its JSON; plus the pure helpers (percentiles, token attribution, goals)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_serving import (
    MODES, RequestResult, apply_timing, evaluate_goals, main, percentile, token_events,
)
from tools.prompts import Prompt, interleave_sources
from tests.fakes import make_tokenizer
from tests.tiny import save_tiny_pair

PROMPTS = "benchmarks/prompts/smoke.json"  # short: bench.json's prompts exceed the tiny context


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Target and draft HF directories (byte-level tokenizer with a chat template), seeds 0 and 1."""
    root = tmp_path_factory.mktemp("tiny-models")
    save_tiny_pair(root, make_tokenizer())
    return root


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_benchmark_end_to_end_on_tiny_server(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "serving.json"
    status = main(["--config", "tiny-test", "--concurrency", "1,2", "--requests-per-level", "2", "--max-tokens", "8",
                   "--ignore-eos", "--prompts", PROMPTS, "--out", str(out), "--startup-timeout", "120",
                   "--request-timeout", "60", "--grace", "15", "--",
                   "--model", str(tiny_dirs / "target"), "--draft-model", str(tiny_dirs / "draft"),
                   "--served-model-name", "tiny"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    report = json.loads(out.read_text())
    assert report["interrupted"] is False and report["server"]["exit_status"] == 0
    assert report["server"]["model"] == "tiny" and report["settings"]["token_timing"].startswith("logprobs")
    assert all(w["ok"] for w in report["warmup"]) and len(report["warmup"]) == 2

    levels = report["results"]
    assert [(lv["concurrency"], lv["mode"]) for lv in levels] == [
        (1, "spec"), (1, "nospec"), (2, "nospec"), (2, "spec")]  # ABBA interleaving
    for lv in levels:
        assert (lv["requests"], lv["sent"], lv["completed"], lv["errors"]) == (2, 2, 2, 0), lv["error_messages"]
        assert not lv["truncated"] and lv["wall_s"] > 0
        assert lv["completion_tokens"] == 16 == lv["streamed_tokens"]  # ignore_eos: exactly max_tokens each
        assert lv["output_throughput_tok_s"] > 0 and lv["request_throughput_req_s"] > 0
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            stats = lv[key]
            assert 0 < stats["p50"] <= stats["p99"], (key, stats)
        assert lv["ttft_ms"]["p50"] < lv["e2e_ms"]["p50"]
        assert lv["itl_samples"] <= 14 and lv["itl_samples"] > 0  # at most 7 per request after the first token
        assert lv["tpot_ms_mean"] > 0
        assert [(r["index"], r["prompt_id"]) for r in lv["per_request"]] == [(0, "smoke/code"), (1, "smoke/chat")]
        spec = lv["spec_totals"]
        if lv["mode"] == "spec":
            assert spec["drafted_tokens"] > 0 and 0 <= lv["acceptance_rate_mean"] <= 1
            assert lv["mean_accepted_length"] >= 1
        else:
            assert spec == {"steps": 0, "drafted_tokens": 0, "accepted_tokens": 0}
            assert lv["acceptance_rate_mean"] is None
    goals = report["goals"]
    assert [g["concurrency"] for g in goals["spec_vs_nospec"]] == [1, 2]
    assert all(g["ratio"] > 0 for g in goals["spec_vs_nospec"])
    assert {s["mode"]: (s["low"], s["high"]) for s in goals["scaling"]} == {"spec": (1, 2), "nospec": (1, 2)}
    assert goals["throughput_scaling_pass"] is None  # the 3x goal is judged on 8 vs 1 only
    assert "| mode | conc |" in printed and "spec / nospec throughput at c=2" in printed


def test_percentile_and_prompt_order():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0
    assert percentile(range(101), 99) == 99 and percentile([], 50) is None
    msgs = ({"role": "user", "content": "x"},)
    ps = [Prompt(i, msgs) for i in ("a/1", "a/2", "a/3", "b/1")]
    assert [p.id for p in interleave_sources(ps)] == ["a/1", "b/1", "a/2", "a/3"]


def test_tokens_are_attributed_per_chunk():
    # logprobs: exact counts; the role-only chunk never appears; a 3-token chunk gives 3 samples of dt/3
    res = RequestResult("p", start=0.0, completion_tokens=5)
    apply_timing(res, [(1.0, 1, 2), (1.6, 3, 9), (2.0, 1, 0)])
    assert res.ttft == 1.0 and res.itl == pytest.approx([0.2, 0.2, 0.2, 0.4]) and res.chunks == 3
    assert res.tpot == pytest.approx(1.0 / 4)
    # without logprobs: completion tokens spread by character share, adding up exactly
    est = token_events([(1.0, None, 1), (2.0, None, 1), (3.0, None, 2)], 8)
    assert est == [(1.0, 2), (2.0, 2), (3.0, 4)] and sum(k for _, k in est) == 8


def test_goals():
    def level(mode, c, thr, errors=0):
        return {"mode": mode, "concurrency": c, "output_throughput_tok_s": thr, "completed": 4, "errors": errors,
                "truncated": False}

    goals = evaluate_goals([level("spec", 1, 10), level("nospec", 1, 8), level("spec", 8, 35),
                            level("nospec", 8, 40), level("spec", 4, 20, errors=1)])
    assert goals["throughput_scaling_pass"] is True and goals["spec_never_slower_pass"] is False
    assert [(g["concurrency"], g["pass"]) for g in goals["spec_vs_nospec"]] == [(1, True), (8, False)]
    assert set(MODES) == {"spec", "nospec", "fixed"} and MODES["fixed"]["adaptive"] is False
    assert goals["adaptive_vs_best_fixed_or_nospec"] == []  # no fixed levels
    goals = evaluate_goals([level("spec", 1, 10), level("fixed", 1, 9), level("nospec", 1, 8),
                            level("spec", 8, 35), level("fixed", 8, 30), level("nospec", 8, 36)])
    assert [(g["concurrency"], g["pass"]) for g in goals["adaptive_vs_best_fixed_or_nospec"]] == [(1, True), (8, False)]
