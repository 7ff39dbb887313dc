"""``benchmarks/bench_spec.py``'s config language: each option sets the engine setting it names, and
options that do not apply to a config are refused rather than ignored."""

from __future__ import annotations

import pytest

from benchmarks.bench_spec import parse_configs


def test_the_gpu_presets_speculation_reads_as_a_config():
    (c,) = parse_configs("adaptive+maxgram:4,2,2:u:ns")
    assert (c["tree"], c["method"], c["adaptive"]) == ((4, 2, 2), "mcsd+maxgram", True)
    assert c["config"]["maxgram_read_tree"] is False and c["config"]["adaptive_level_stop"] is False
    (stop,) = parse_configs("adaptive:4,2,2")
    assert "adaptive_level_stop" not in stop["config"]  # the engine's default: the level-by-level stop


def test_the_cascade_reads_as_a_config():
    host, device = parse_configs("cascade;cascade:6:u")
    assert host["method"] == device["method"] == "cascade"
    assert (host["config"]["cascade_depth"], host["config"]["maxgram_read_tree"]) == (4, True)
    assert (device["config"]["cascade_depth"], device["config"]["maxgram_read_tree"]) == (6, False)


@pytest.mark.parametrize("item", ["tree:4,2,2:ns", "adaptive:4,2,2:u", "adaptive+maxgram:4,2:ns:ns", "chain:1:x",
                                  "cascade:u:u", "cascade:4:5", "cascade:ns"])
def test_options_that_do_not_apply_are_refused(item):
    with pytest.raises(SystemExit, match="unknown config"):
        parse_configs(item)
