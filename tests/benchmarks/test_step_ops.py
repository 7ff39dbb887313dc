"""``benchmarks/step_ops.py``: what a step asks of a GPU's host, counted on the CPU.  Its counts
hold the engine to what the GPU issue asks: one read a step, the forwards a tree needs, and a step's
device operations and copies that do not grow with the batch (no per-sequence launches)."""

from __future__ import annotations

import json

from benchmarks import step_ops


def test_step_ops_counts_a_steps_launches_and_they_do_not_grow_with_the_batch(tmp_path):
    out = tmp_path / "step_ops.json"
    step_ops.main(["--configs", "plain;mcsd:2,1", "--batches", "1,8", "--temperatures", "0,0.7", "--steps", "2",
                   "--time-steps", "3", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = {(r["config"], r["batch"], r["temperature"]): r for r in result["steps"]}
    assert len(rows) == 8
    for (config, batch, temperature), r in rows.items():
        assert r["reads"] == 1 and r["steps"] == 2
        assert r["forwards"] == (1 if config == "plain" else 3)  # a draft forward a level, then the target's
        assert r["device_ops"] > 0 and r["h2d"] >= 1
        assert r["torch_calls"] >= r["device_ops"] and r["py_calls"] > r["torch_calls"] / 2  # every call, views too
        assert 0 < r["host_ms"] < 1000  # timed outside the forwards
        if config == "plain":  # the next forward is queued before the read (decode_ahead): no serial time
            assert r["serial_ms"] == 0
        else:
            assert 0 < r["serial_ms"] <= r["host_ms"]  # from a read to the next forward: part of the host's time
        # vectorized over the batch: eight sequences launch what one does, but for whether any kept
        # entries move this step (one copy, a gather and a scatter a pool, for every sequence at once)
        one = rows[(config, 1, temperature)]
        assert r["device_ops"] <= one["device_ops"] + 8 and r["h2d"] <= one["h2d"] + 2, (config, temperature)
    assert rows[("mcsd:2,1", 1, 0.0)]["device_ops"] > rows[("plain", 1, 0.0)]["device_ops"]
    eager, compiled = result["forward"]
    assert (eager["layers"], compiled["layers"]) == ("eager", "compiled")
    assert 20 <= eager["per_layer"] <= 40 and compiled["per_layer"] <= 10  # Inductor fused the elementwise work


def test_step_ops_times_the_host_in_cpu_time_on_request(tmp_path):
    out = tmp_path / "step_ops.json"
    step_ops.main(["--configs", "mcsd:2,1", "--batches", "1", "--temperatures", "0", "--steps", "1",
                   "--time-steps", "3", "--no-forward", "--clock", "thread", "--out", str(out)])
    result = json.loads(out.read_text())
    (row,) = result["steps"]
    assert result["args"]["clock"] == "thread" and 0 < row["serial_ms"] <= row["host_ms"] < 1000
