"""``EngineCore.warm_up`` (``warm_up``; ``auto``: on CUDA): before it serves, the engine runs a few
requests of its own, greedy and sampled, alone and batched, with its speculation.  It must leave the
engine as it found it: idle, nothing held in either cache, no statistics, nothing learned (the planner
and the drafters see none of its steps), so the requests after it get what a cold engine gives."""

from __future__ import annotations

import pytest

import engine.runner as engine_runner
import engine.speculative.planner as engine_planner
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import GenerationRequest, SamplingParams

CONFIG = dict(max_model_len=128, max_batch=4, tree=(2, 1), adaptive=True, load_aware=True,
              spec_method="mcsd+maxgram")


def core_of(pair, **config) -> EngineCore:
    target, draft = pair
    return EngineCore(target, draft, EngineConfig.from_settings(**{**CONFIG, **config}))


@pytest.fixture
def learned(monkeypatch) -> list[str]:
    """Which of the planner and the runner were asked to learn from a step, in order."""
    calls: list[str] = []
    for name, cls in (("planner", engine_planner.Planner), ("runner", engine_runner.ModelRunner)):
        original = cls.observe

        def spy(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(cls, "observe", spy)
    return calls


def generate(core: EngineCore) -> dict[str, list[int]]:
    """Two greedy and two seeded sampled requests, batched, to the end."""
    prompts = [[5, 9, 3, 7, 5, 9, 3, 7, 2], [11, 4, 8, 11, 4, 8, 1], [6, 6, 2, 9, 6, 6, 2], [3, 1, 4, 1, 5, 9, 2, 6]]
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=20, temperature=0.8 if i % 2 else 0.0, seed=100 + i if i % 2 else None,
                                ignore_eos=True)
        core.add_request(GenerationRequest(f"r{i}", ids, params))
    out: dict[str, list[int]] = {}
    while core.has_unfinished():
        for o in core.step():
            assert o.error is None, o.error
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_it_runs_on_cuda_only_unless_asked(tiny_pair) -> None:
    assert core_of(tiny_pair).warm_up() == 0  # "auto" on the CPU
    assert core_of(tiny_pair, warm_up="off").warm_up() == 0


def test_it_leaves_the_engine_as_it_found_it(tiny_pair, learned) -> None:
    core = core_of(tiny_pair, warm_up="on")
    planning = core.planner.planning_state()
    moved = []  # what planning moved during the warm-up (a probe counter, a request chosen to explore)
    original = core.planner.restore_planning
    core.planner.restore_planning = lambda state: (moved.append(core.planner.planning_state() != state),
                                                   original(state))
    steps = core.warm_up()
    assert steps > 3
    assert not learned, "the warm-up's steps taught the planner or the drafters"
    assert moved == [True] and core.planner.planning_state() == planning
    assert not core.has_unfinished() and core.drain_step_stats() == []
    for pool in (core.cache, core.runner.proposer.cache):
        assert pool.used_blocks == 0 and pool.cached_blocks == 0  # nothing held, no prompt left cached
    assert core.scheduler.prefix.enabled and core.scheduler.draft_prefix.enabled
    assert core.runner.ahead is None
    generate(core)
    assert "planner" in learned and "runner" in learned  # learning is back for the requests that follow
    assert core.drain_step_stats()


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-tree", "adaptive"])
def test_the_requests_after_it_get_what_a_cold_engine_gives(tiny_pair, adaptive: bool) -> None:
    """With a fixed tree, every request's tokens; with adaptive speculation, whose plans follow measured
    step times (so a seeded request's tokens may differ between two cold engines too), the greedy ones."""
    config = dict(adaptive=adaptive, load_aware=adaptive)
    cold = generate(core_of(tiny_pair, **config))
    warm = core_of(tiny_pair, warm_up="on", **config)
    warm.warm_up()
    got = generate(warm)
    compared = ["r0", "r1", "r2", "r3"] if not adaptive else ["r0", "r2"]
    assert {r: got[r] for r in compared} == {r: cold[r] for r in compared}


def test_it_refuses_an_engine_with_requests(tiny_pair) -> None:
    core = core_of(tiny_pair, warm_up="on")
    core.add_request(GenerationRequest("r", [1, 2, 3], SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError):
        core.warm_up()
