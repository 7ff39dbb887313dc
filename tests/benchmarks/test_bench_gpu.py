"""``benchmarks/bench_gpu.py`` on the CPU with tiny shapes: it must run end to end between the
sessions that have a GPU, and its numbers must add up: ratios to the floor, to plain decoding, and
the projection's arithmetic from a ``bench_spec.py`` result."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_gpu


def test_bench_gpu_runs_on_the_cpu_and_its_figures_add_up(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    spec = tmp_path / "spec_code.json"
    spec.write_text(json.dumps(dict(args=dict(source="HumanEval"), rows=[
        dict(config="plain", temperature=0.0, block_eff=1.0), dict(config="tree 2,1", temperature=0.0, block_eff=2.5),
        dict(config="chain 1", temperature=0.7, block_eff=1.5), dict(config="tree 9,9", temperature=0.0, block_eff=3.0),
        # Max-Gram's rows run as the GPU preset's (the draft's tree unread): only its "u" row is projected
        dict(config="tree+maxgram 2,1", temperature=0.0, block_eff=4.0),
        dict(config="tree+maxgram 2,1 u", temperature=0.0, block_eff=3.5),
        # the cascade's likewise: the "u" row (its review rounds on the device)
        dict(config="cascade", temperature=0.0, block_eff=3.2), dict(config="cascade u", temperature=0.0, block_eff=3.1)])))
    bench_gpu.main(["--device", "cpu", "--dtype", "fp32", "--target-shape", "tiny", "--draft-shape", "tiny",
                    "--big-shape", "", "--vocab", "101", "--rows", "1,4", "--reps", "1", "--batches", "1,2",
                    "--spec-batches", "1", "--trees", "2,1;1", "--new-tokens", "12", "--prompt-len", "16",
                    "--context", "64", "--rounds", "2", "--warmup-s", "0.1", "--acceptance", str(spec),
                    "--engine-warm-up", "on",
                    "--host-profile", str(tmp_path / "profile.txt"), "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(r["layers"], r["rows"]) for r in result["forward"]] == [("eager", 1), ("eager", 4), ("compiled", 1),
                                                                      ("compiled", 4)]
    assert {(f["shape"], f["batch"]) for f in result["floor"]} == {("tiny", 1), ("tiny", 2)}
    assert all(f["ms"] > 0 for f in result["floor"])
    engine = result["engine"]
    assert sorted((r["config"], r["batch"], r["graphs"], r["compiled"]) for r in engine) == sorted([
        ("plain", 1, True, False), ("plain", 1, False, False), ("plain", 2, True, False), ("plain", 2, False, False),
        (bench_gpu.READ_FIRST, 1, True, False), (bench_gpu.READ_FIRST, 2, True, False),
        ("mcsd 2,1", 1, True, False), ("mcsd 1", 1, True, False), ("maxgram", 1, True, False),
        ("cascade", 1, True, False), ("mcsd+maxgram 2,1", 1, True, False), ("adaptive (GPU preset)", 1, True, False),
        ("mcsd 2,1, a read per level", 1, True, False), ("mcsd, target as draft", 1, True, False),
        ("mcsd 2,1", 1, False, False),
        # --compile: the same with every layer compiled before capture (on the CPU, where nothing is
        # captured, the rows run uncompiled: the plumbing is what is tested here)
        ("plain", 1, True, True), ("plain", 2, True, True), ("mcsd 2,1", 1, True, True),
        ("mcsd+maxgram 2,1", 1, True, True), ("adaptive (GPU preset)", 1, True, True)])
    floor = {f["batch"]: f["ms"] for f in result["floor"]}
    for r in engine:
        assert r["errors"] == 0 and len(r["tok_s_rounds"]) == 2 and len(r["tok_s_warmup"]) == 1
        assert r["host_ms_step"] <= r["ms_step"] * 1.001
        assert r["tok_s"] > 0 and r["declared"] >= 1
        assert r["x_floor"] == pytest.approx(r["ms_step"] / floor[r["batch"]])
        assert r["warmup_x"] == pytest.approx(r["tok_s"] / r["tok_s_warmup"][0])
    plain = [r for r in engine if r["config"] == "plain"]
    assert all(0.8 <= r["tok_step"] <= 1.0 for r in plain)  # one token per sequence and step (fewer as they end)
    self_draft = [r for r in engine if r["config"] == "mcsd, target as draft"]
    assert all(r["tok_step"] > 1.5 for r in self_draft)  # the target drafting for itself is accepted
    assert [r["declared"] for r in engine if r["config"] == "mcsd 2,1"] == [1.0] * 3  # the tree comes with verification
    assert [r["declared"] for r in engine if r["config"] == "mcsd+maxgram 2,1"] == [1.0] * 2  # Max-Gram reads no tree
    assert [r["declared"] for r in engine if r["config"] == "cascade"] == [1.0]  # its rounds on the device
    # the same tree read after every level (never stopping): the same tokens, more reads
    (levels,) = [r for r in engine if r["config"] == "mcsd 2,1, a read per level"]
    (once,) = [r for r in engine if r["config"] == "mcsd 2,1" and r["graphs"] and not r["compiled"]]
    assert levels["tok_step"] == once["tok_step"] and levels["declared"] > 2
    projection = result["projection"]
    assert [(p["config"], p["temperature"], p["compiled"]) for p in projection] == [
        ("tree 2,1", 0.0, False), ("chain 1", 0.7, False), ("tree+maxgram 2,1 u", 0.0, False), ("cascade u", 0.0, False),
        ("tree 2,1", 0.0, True), ("tree+maxgram 2,1 u", 0.0, True)]  # compiled: the first tree only
    (cascade,) = [r for r in engine if r["config"] == "cascade"]
    assert projection[3]["projected"] == pytest.approx(3.1 * plain[0]["ms_step"] / cascade["ms_step"])
    assert plain[0]["batch"] == 1 and plain[0]["graphs"] and not plain[0]["compiled"]
    for p, compiled in ((projection[0], False), (projection[4], True)):  # each against plain decoding of its kind
        plain_ms = [r["ms_step"] for r in plain if r["batch"] == 1 and r["graphs"] and r["compiled"] == compiled]
        step_ms = [r["ms_step"] for r in engine if r["config"] == "mcsd 2,1" and r["graphs"]
                   and r["compiled"] == compiled]
        assert p["projected"] == pytest.approx(2.5 * plain_ms[0] / step_ms[0])
    assert "==== mcsd" in (tmp_path / "profile.txt").read_text()
    printed = capsys.readouterr().out
    assert "engine steps" in printed and "PROJECTION (not measured)" in printed
    assert printed.count("the first core warmed up as a server does") == 1  # the process's first core only


def test_the_floor_decoder_attends_only_to_what_it_cached():
    model = bench_gpu.FloorDecoder("tiny", 101, 2, 32, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        model.pos.fill_(3)
        first = model()
        model.k[:, :, :, 4:] = 100.0  # positions past the one written: masked out
        model.v[:, :, :, 4:] = 100.0
        model.k[:, :, :, 3] = 7.0  # overwritten by the step itself
        again = model()
        model.k[:, :, :, 2] = 1.0  # a cached position: seen
        changed = model()
    assert first.shape == (2, 1, 101) and torch.isfinite(first).all()
    assert torch.equal(first, again) and not torch.equal(first, changed)
