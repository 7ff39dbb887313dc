"""A new speculation method is one drafter class and one ``Method`` record, registered where they are
defined: the engine's core, runner, scheduler, planner and cache sizing take it without a change.
The toy here proposes the last token again as a one-hot chain; its greedy output must be plain
decoding's, its proposals must reach the verifier, and the cache must be sized for its trees."""

from __future__ import annotations

import pytest

from engine.speculative import drafter as drafter_module
from engine.speculative import methods as methods_module
from engine.speculative.draft_tree import DraftTree
from engine.speculative.drafter import DrafterContext, register
from engine.speculative.methods import DraftPlan, Method, PlanInput, register_method
from engine.request import SpecOptions
from tests.engine_utils import run_engine


class RepeatDrafter:
    name, stage = "repeat", 80

    @classmethod
    def limits(cls, config, topology):
        return 6, 0  # verification rows per tree beyond the root; draft-cache entries per step

    @classmethod
    def build(cls, ctx: DrafterContext):
        return cls()  # needs no draft model

    def propose(self, seqs, plans, trees: list[DraftTree]) -> None:
        for seq, plan, tree in zip(seqs, plans, trees):
            if plan.method == "repeat" and plan.maxgram:
                tree.add_path(-1, [seq.root] * plan.maxgram, "repeat")  # one-hot: verified exactly


def plan_repeat(p: PlanInput) -> DraftPlan:
    return DraftPlan("repeat", p.empty, maxgram=min(6, p.room) if p.room > 0 else 0)


@pytest.fixture
def repeat_method():
    register(RepeatDrafter)
    register_method(Method("repeat", ("repeat",), plan_repeat, needs_draft=False))
    try:
        yield
    finally:
        del drafter_module._REGISTRY["repeat"], methods_module._REGISTRY["repeat"]


def test_a_registered_method_runs_and_stays_lossless(tiny_target, repeat_method):
    prompts = [[5, 5, 5, 5, 5, 5], [3, 4, 3, 4], [7, 8, 9]]
    plain, _ = run_engine(tiny_target, None, prompts, tree=(), ignore_eos=True)
    outs, core = run_engine(tiny_target, None, prompts, tree=(), ignore_eos=True, spec=SpecOptions(method="repeat"))
    assert [o.tokens for o in outs] == [o.tokens for o in plain]
    assert sum(o.spec.drafted_tokens for o in outs) > 0  # the planner planned it and the drafter proposed
    assert core.cache.max_len >= core.max_model_len + 6 + 1  # the cache was sized from its limits
    assert "repeat" in methods_module.method_names()
