"""A new speculation method is one drafter class, its settings and one ``Method`` record, registered
where they are defined: the engine's core, runner, scheduler, planner, cache sizing, configuration
and the server's flags take it without a change.  The toy here proposes the last token again as a
one-hot chain, as long as its ``repeat_len`` setting says; its greedy output must be plain
decoding's, its proposals must reach the verifier, and the cache must be sized for its trees.  A
(lossy) verification rule plugs in the same way: registered by name, named by its method."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import torch

from engine.config import DrafterSettings, EngineConfig, setting
from engine.device import Pending
from engine.registry import Method, drafter_settings, method_names, register_drafter, register_method, register_rule, unregister
from engine.speculative.draft_tree import DraftTree
from engine.speculative.drafter import DrafterContext
from engine.speculative.methods import DraftPlan, PlanInput
from engine.speculative.walk import SeqStepResult, VerifyResult
from engine.request import SpecOptions
from tests.engine_utils import run_engine


@dataclass(frozen=True)
class RepeatSettings(DrafterSettings):
    len: int = setting(6, "tokens the repeat drafter proposes", ge=1, le=16)  # the setting repeat_len


class RepeatDrafter:
    name, stage = "repeat", 80
    observed: list[tuple[int, int]] = []  # (drafted, accepted) per verified sequence-step, from observe()

    @classmethod
    def limits(cls, config, topology):
        return RepeatSettings.of(config).len, 0  # verification rows per tree; draft-cache entries per step

    @classmethod
    def build(cls, ctx: DrafterContext):
        return cls()  # needs no draft model

    def propose(self, seqs, plans, trees: list[DraftTree]) -> None:
        for seq, plan, tree in zip(seqs, plans, trees):
            n = plan.share(self.name, 0)  # its own share of the step, under its name
            if n:
                tree.add_path(-1, [seq.root] * n, "repeat")  # one-hot: verified exactly

    def observe(self, results, plans) -> None:  # optional: what the step's verification made of its trees
        for res, plan in zip(results, plans):
            if plan.share(self.name):
                RepeatDrafter.observed.append((res.tree.num_nodes, len(res.result.accepted)))


def plan_repeat(p: PlanInput) -> DraftPlan:
    n = min(RepeatSettings.of(p.config).len, p.room)
    return DraftPlan("repeat", p.empty, {"repeat": n} if n > 0 else {})


@pytest.fixture
def repeat_method():
    drafter_settings("repeat")(RepeatSettings)
    register_drafter(RepeatDrafter)
    RepeatDrafter.observed = []
    register_method(Method("repeat", ("repeat",), plan_repeat, needs_draft=False))
    try:
        yield
    finally:
        unregister(method="repeat", drafter="repeat", section="repeat")


def test_a_registered_method_runs_and_stays_lossless(tiny_target, repeat_method):
    prompts = [[5, 5, 5, 5, 5, 5], [3, 4, 3, 4], [7, 8, 9]]
    plain, _ = run_engine(tiny_target, None, prompts, tree=(), ignore_eos=True)
    outs, core = run_engine(tiny_target, None, prompts, tree=(), ignore_eos=True, spec=SpecOptions(method="repeat"),
                            config=dict(repeat_len=5))
    assert [o.tokens for o in outs] == [o.tokens for o in plain]
    assert sum(o.spec.drafted_tokens for o in outs) > 0  # the planner planned it and the drafter proposed
    assert max(o.spec.drafted_tokens / max(o.spec.steps, 1) for o in outs) <= 5  # as its setting says
    assert core.cache.max_len >= core.max_model_len + 5 + 1  # the cache was sized from its limits
    assert "repeat" in method_names()
    # it observed every step it drafted for, with what verification accepted of its proposals
    assert sum(d for d, _ in RepeatDrafter.observed) == sum(o.spec.drafted_tokens for o in outs)
    assert sum(a for _, a in RepeatDrafter.observed) == sum(o.spec.accepted_tokens for o in outs)


def test_a_drafter_that_fails_to_observe_fails_no_request(tiny_target, repeat_method, monkeypatch, caplog):
    def broken(self, results, plans):
        raise RuntimeError("observe bug")

    monkeypatch.setattr(RepeatDrafter, "observe", broken)
    prompts = [[5, 5, 5, 5], [7, 8, 9]]
    plain, _ = run_engine(tiny_target, None, prompts, tree=(), ignore_eos=True, max_tokens=8)
    outs, _ = run_engine(tiny_target, None, prompts, tree=(), ignore_eos=True, max_tokens=8,
                         spec=SpecOptions(method="repeat"))
    assert [o.tokens for o in outs] == [o.tokens for o in plain]
    assert all(o.finish_reason == "length" for o in outs)
    assert "failed to observe" in caplog.text


def test_a_registered_drafters_settings_are_server_settings(repeat_method):
    """Its settings section becomes ``--repeat-len`` / ``MCSD_REPEAT_LEN`` / a preset key, bounds
    included, and reaches the engine's config."""
    from server.settings import SettingsError, load_settings, settings_model

    model = settings_model()
    assert model.model_fields["repeat_len"].description == "tokens the repeat drafter proposes"
    config = load_settings(["--repeat-len", "3"], {}, model=model).engine_config()
    assert RepeatSettings.of(config).len == 3
    assert RepeatSettings.of(load_settings([], {"MCSD_REPEAT_LEN": "2"}, model=model).engine_config()).len == 2
    with pytest.raises(SettingsError, match="repeat_len .*--repeat-len"):
        load_settings(["--repeat-len", "17"], {}, model=model)
    assert RepeatSettings.of(EngineConfig()).len == 6
    with pytest.raises(ValueError, match="repeat_len must be >= 1"):
        EngineConfig.from_settings(repeat_len=0)


class AcceptAllRule:
    """A deliberately lossy toy rule: every drafted token stands, then the target's greedy token.  It
    counts each sequence's steps in what it hands the next step (``SeqStepResult.carry``)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.started = vocab_size, 0
        self.seen: list[int] = []  # the count each verified step found carried over, in order

    def claims(self, plan: DraftPlan, tree: DraftTree) -> bool:
        return tree.num_nodes > 0

    def start(self, seqs, trees, logits) -> Pending:
        self.started += 1
        self.seen += [s.carry.get("accept-all", 0) for s in seqs]
        n = [t.num_nodes for t in trees]
        last = torch.stack([logits[i, k, : self.vocab_size].argmax() for i, k in enumerate(n)])

        def finish(host):
            return [SeqStepResult(s, VerifyResult(list(range(k)), list(t.tokens) + [y], bonus=True, final_row=k,
                                                  rows=list(range(k + 1))), t,
                                  carry={"accept-all": s.carry.get("accept-all", 0) + 1})
                    for s, t, k, y in zip(seqs, trees, n, host[0].tolist())]
        return Pending([last], finish)


@pytest.fixture
def accept_all_method(repeat_method):
    rules = []
    register_rule("accept-all", lambda config, vocab_size: rules.append(AcceptAllRule(vocab_size)) or rules[-1])
    register_method(Method("repeat-all", ("repeat",), plan_repeat_all, needs_draft=False, rule="accept-all",
                           lossy_note="toy: every drafted token is accepted", penalties=False))
    try:
        yield rules
    finally:
        unregister(method="repeat-all", rule="accept-all")


def plan_repeat_all(p: PlanInput) -> DraftPlan:
    return DraftPlan("repeat-all", p.empty, {"repeat": min(3, p.room)} if p.room > 0 else {})


def test_a_registered_verification_rule_verifies_its_methods_trees(tiny_target, accept_all_method):
    """The method's rule, not the lossless one, decides its trees: each step emits the 3 drafted
    copies of the root, then the target's token; a request of another method in the same batch keeps
    the lossless rule and plain decoding's output."""
    prompts = [[3, 4, 3, 9], [7, 8, 9]]
    plain, _ = run_engine(tiny_target, None, prompts, tree=(), ignore_eos=True, max_tokens=8)
    outs, core = run_engine(tiny_target, None, prompts, tree=(), ignore_eos=True, max_tokens=8,
                            spec=[SpecOptions(method="repeat-all"), SpecOptions(enabled=False)])
    rule = accept_all_method[-1]
    assert rule.started > 0
    assert outs[0].tokens[:3] == [9, 9, 9] and outs[0].tokens[4:7] == [outs[0].tokens[3]] * 3
    assert outs[0].tokens != plain[0].tokens  # lossy, as the toy says
    assert outs[1].tokens == plain[1].tokens
    assert rule.seen == list(range(len(rule.seen)))  # the core kept what each step carried to the next


def test_a_method_that_refuses_penalties_is_refused_them(tiny_target, accept_all_method):
    """``Method.penalties = False`` is the whole rule: the core refuses such a request by name."""
    from engine.request import GenerationRequest, RequestRejected, SamplingParams

    _, core = run_engine(tiny_target, None, [[3, 4]], tree=(), max_tokens=1)
    req = GenerationRequest("r", [3, 4], SamplingParams(max_tokens=2, presence_penalty=0.5),
                            spec=SpecOptions(method="repeat-all"))
    with pytest.raises(RequestRejected, match="'repeat-all' does not support presence"):
        core.check_request(req)
    core.check_request(GenerationRequest("r", [3, 4], SamplingParams(max_tokens=2), spec=SpecOptions(method="repeat-all")))
