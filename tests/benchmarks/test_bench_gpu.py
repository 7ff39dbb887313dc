"""``benchmarks/bench_gpu.py`` on the CPU with tiny shapes: it must run end to end between the
sessions that have a GPU, and its numbers must add up."""

from __future__ import annotations

import json

from benchmarks import bench_gpu


def test_bench_gpu_runs_on_the_cpu_and_its_figures_add_up(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    bench_gpu.main(["--device", "cpu", "--dtype", "fp32", "--target-shape", "tiny", "--draft-shape", "tiny",
                    "--vocab", "101", "--rows", "1,4", "--reps", "1", "--batch", "2", "--new-tokens", "12",
                    "--rounds", "2", "--warmup-s", "0.1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["rows"] for r in result["forward"]] == [1, 4, 1, 4]
    assert all(r["ms"] > 0 for r in result["forward"])
    engine = result["engine"]
    assert {(r["config"], r["batch"]) for r in engine} == {
        (c, b) for c in ("plain", "mcsd, draft", "mcsd, target as draft") for b in (1, 2)}
    for r in engine:
        assert r["errors"] == 0 and len(r["tok_s_rounds"]) == 2 and len(r["tok_s_warmup"]) == 1
        assert len(r["step_ms_rounds"]) == 3 and all(ms and min(ms) > 0 for ms in r["step_ms_rounds"])
        assert r["host_ms_step"] <= r["ms_step"] * 1.001
        assert r["tok_s"] > 0 and r["declared"] >= 1
    plain = [r for r in engine if r["config"] == "plain"]
    assert all(0.8 <= r["tok_step"] <= 1.0 for r in plain)  # one token per sequence and step (fewer as they end)
    self_draft = [r for r in engine if r["config"] == "mcsd, target as draft"]
    assert all(r["tok_step"] > 1.5 for r in self_draft)  # the target drafting for itself is accepted
    assert "engine steps" in capsys.readouterr().out
