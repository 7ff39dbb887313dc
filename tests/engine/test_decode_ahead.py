"""Plain decoding with the next step's forward queued before the host reads this step's tokens
(``decode_ahead``, on by default on CUDA): the same tokens as without it for every sampling feature,
with requests joining, ending, aborted and preempted; nothing left in the caches; one read a step."""

from __future__ import annotations

import pytest
import torch

import engine.runner as engine_runner
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import GenerationRequest, SamplingParams, SpecOptions
from tests.device_check import DeviceCheck, mark_engine
from tests.engine.test_device import FEATURES

PLAIN_FEATURES = dict(FEATURES)


@pytest.fixture
def logits(monkeypatch):
    """The target's logits at each request's root, by (request id, tokens so far): a forward at a wrong
    position or over wrong cache entries changes them even where the drawn token stays the same."""
    seen: dict = {}
    original = engine_runner.ModelRunner._verify_all

    def spy(self, seqs, trees, plans, block_logits, *args, **kwargs):
        for i, s in enumerate(seqs):
            seen[(s.request_id, len(s.tokens))] = block_logits[i, 0].clone()
        return original(self, seqs, trees, plans, block_logits, *args, **kwargs)
    monkeypatch.setattr(engine_runner.ModelRunner, "_verify_all", spy)
    return seen


def same_logits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def count_forwards_ahead(monkeypatch) -> list[int]:
    """``[n]``: how many steps took their forward from the one queued ahead, counted from now."""
    count = [0]
    original = engine_runner.ModelRunner._from_ahead

    def spy(self, seqs, plans):
        forwards = original(self, seqs, plans)
        count[0] += bool(forwards)
        return forwards
    monkeypatch.setattr(engine_runner.ModelRunner, "_from_ahead", spy)
    return count


@pytest.fixture
def used(monkeypatch):
    return count_forwards_ahead(monkeypatch)


def drive(target, draft, requests, ahead: str, join_every: int = 0, abort_at: dict | None = None, **config):
    """Runs ``requests`` ((id, prompt, params, spec) tuples) to the end; ``join_every``: one joins every
    that many steps; ``abort_at``: request id -> step it is aborted at.  Returns each request's tokens
    and finish reason, and the engine."""
    config = {"max_batch": 8, **config}
    core = EngineCore(target, draft, EngineConfig.from_settings(max_model_len=128, tree=(2, 1), decode_ahead=ahead,
                                                                **config))
    out = {rid: [] for rid, *_ in requests}
    reasons: dict = {}
    logprobs: dict = {rid: [] for rid, *_ in requests}
    pending, steps = list(requests), 0
    while pending or core.has_unfinished():
        if pending and (join_every == 0 or steps % join_every == 0):
            take = pending if join_every == 0 else pending[:1]
            for rid, prompt, params, spec in take:
                core.add_request(GenerationRequest(rid, prompt, params, spec))
            pending = pending[len(take):]
        for rid, at in (abort_at or {}).items():
            if at == steps:
                core.abort_request(rid)
        for o in core.step():
            assert o.error is None, o.error
            out[o.request_id] += o.new_token_ids
            logprobs[o.request_id] += o.logprobs or []
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        steps += 1
    assert core.runner.ahead is None
    assert core.cache.used_blocks == 0 and core.cache.free_slots == core.cache.num_slots  # nothing left behind
    return out, reasons, core, logprobs


def requests(features: dict, max_tokens: int = 14, spec: bool = False):
    """One request a feature, each seeded (so that two runs draw alike), of different lengths."""
    return [(f"r{i}", [3 + i, 6, 7, 8, 9, 10], SamplingParams(max_tokens=max_tokens - (i % 3),
                                                              **{"seed": 100 + i, **params}),
             SpecOptions(enabled=spec)) for i, params in enumerate(features.values())]


@pytest.mark.parametrize("join_every", [0, 2], ids=["together", "joining"])
def test_every_sampling_feature_gives_the_same_tokens(tiny_pair, used, logits, join_every):
    """Greedy, sampled, top-k/p/min-p, seeded, logprobs, penalties (counted by the host after the
    forward ran ahead: sampling still waits for them), logit bias and stop strings, eight requests of
    different lengths, all at once or joining: the tokens, logprobs and finish reasons of the engine
    without it, from the same logits bit for bit (the CPU's rows are batch-invariant)."""
    target, draft = tiny_pair
    reqs = requests(PLAIN_FEATURES)
    base = drive(target, draft, reqs, "off", join_every)
    base_logits = dict(logits)
    logits.clear()
    used[0] = 0
    ahead = drive(target, draft, reqs, "on", join_every)
    assert ahead[:2] == base[:2] and ahead[3] == base[3]
    assert any(ahead[3].values())  # the logprobs request's
    assert same_logits(logits, base_logits)
    assert used[0] >= 5  # it ran ahead


def test_it_waits_for_speculation(tiny_pair, used):
    """A step where any request speculates reads before its next forward: the tokens are the same, and
    nothing ran ahead while such a request was in the batch."""
    target, draft = tiny_pair
    reqs = requests({"greedy": FEATURES["greedy"], "sampled": FEATURES["sampled"]}, spec=True)
    reqs += requests({"logprobs": FEATURES["logprobs"]})
    reqs[-1] = ("r-logprobs", *reqs[-1][1:])
    base = drive(target, draft, reqs, "off")
    used[0] = 0
    ahead = drive(target, draft, reqs, "on")
    assert ahead[:2] == base[:2]
    assert used[0] == 0


def test_an_aborted_request_leaves_nothing_and_the_rest_go_on(tiny_pair, used, logits):
    target, draft = tiny_pair
    reqs = requests(PLAIN_FEATURES, max_tokens=16)
    base = drive(target, draft, reqs, "off", abort_at={"r1": 4, "r5": 7})
    base_logits = dict(logits)
    logits.clear()
    used[0] = 0
    ahead = drive(target, draft, reqs, "on", abort_at={"r1": 4, "r5": 7})
    assert ahead[:2] == base[:2] and same_logits(logits, base_logits)
    assert used[0] >= 5


def test_aborting_the_whole_batch_leaves_no_forward_queued(tiny_pair):
    """The last running request aborted between steps: the forward queued for it is undone at once, so
    the next request is admitted at the next step."""
    target, draft = tiny_pair
    core = EngineCore(target, draft, EngineConfig.from_settings(max_batch=8, max_model_len=128, decode_ahead="on"))
    (rid, prompt, params, spec), (rid2, prompt2, params2, spec2) = requests(PLAIN_FEATURES, max_tokens=14)[:2]
    core.add_request(GenerationRequest(rid, prompt, params, spec))
    for _ in range(3):
        core.step()
    assert core.runner.ahead is not None
    core.abort_request(rid)
    assert core.runner.ahead is None and core.cache.used_blocks == 0
    core.add_request(GenerationRequest(rid2, prompt2, params2, spec2))
    assert core.step()[0].new_token_ids  # admitted and prefilled at once


def test_a_forward_ahead_no_step_uses_is_undone(tiny_pair, logits, monkeypatch):
    """Dropped after every step that queued one (as when its batch changes): its cache entries are
    discarded, and each next step runs its own forward from the right place."""
    target, draft = tiny_pair
    reqs = requests(PLAIN_FEATURES)
    base = drive(target, draft, reqs, "off")
    base_logits = dict(logits)
    logits.clear()
    dropped = [0]
    original = EngineCore.step

    def step_then_drop(self):
        out = original(self)
        dropped[0] += self.runner.ahead is not None
        self.runner.drop_ahead()
        return out
    monkeypatch.setattr(EngineCore, "step", step_then_drop)
    ahead = drive(target, draft, reqs, "on")
    assert ahead[:2] == base[:2] and same_logits(logits, base_logits)
    assert dropped[0] >= 5


def test_preempted_sequences_come_back_with_the_same_tokens(tiny_pair, used, logits):
    """A pool too small for the batch: sequences are preempted and recomputed, ahead or not."""
    target, draft = tiny_pair
    reqs = requests(PLAIN_FEATURES, max_tokens=30)
    small = dict(kv_cache_tokens=200, kv_block_size=4)
    base = drive(target, draft, reqs, "off", **small)
    base_logits = dict(logits)
    logits.clear()
    assert sum(s.preemptions for s in base[2].drain_step_stats()) > 0
    used[0] = 0
    ahead = drive(target, draft, reqs, "on", **small)
    assert ahead[:2] == base[:2] and same_logits(logits, base_logits)
    assert sum(s.preemptions for s in ahead[2].drain_step_stats()) > 0 and used[0] >= 3


def test_a_step_reads_the_host_once(tiny_pair):
    """Under the device-check mode: no host tensor mixed into device math, and one read a step, the
    forward ahead queued before it."""
    target, draft = tiny_pair
    core = EngineCore(target, draft, EngineConfig.from_settings(max_batch=8, max_model_len=128, tree=(2, 1),
                                                                decode_ahead="on"))
    mark_engine(core)
    mode, counts = DeviceCheck(), []
    with mode:
        for rid, prompt, params, spec in requests(PLAIN_FEATURES):
            core.add_request(GenerationRequest(rid, prompt, params, spec))
        while core.has_unfinished():
            mode.reset()
            core.step()
            counts.append((sum(mode.syncs.values()), set(mode.syncs)))
    assert not mode.violations, mode.violations[0]
    assert max(n for n, _ in counts) == 1 and all(kinds <= {"to_host"} for _, kinds in counts)


def test_the_static_path_gives_the_same_tokens(tiny_pair, used):
    """The fixed-shape forwards a CUDA graph replays (run eagerly here), ahead of the read."""
    target, draft = tiny_pair
    reqs = requests(PLAIN_FEATURES)
    base = drive(target, draft, reqs, "off", static_shapes=True)
    used[0] = 0
    ahead = drive(target, draft, reqs, "on", static_shapes=True)
    assert ahead[:2] == base[:2] and used[0] >= 5
    assert ahead[2].cache.captured.replays > 0


def test_auto_is_on_for_cuda_only(tiny_pair):
    target, draft = tiny_pair
    assert not EngineCore(target, draft, EngineConfig.from_settings(max_model_len=64)).decode_ahead  # the CPU
    assert EngineCore(target, draft, EngineConfig.from_settings(max_model_len=64, decode_ahead="on")).decode_ahead


def test_speculation_resumes_when_the_planner_wants_it(tiny_pair, used, monkeypatch):
    """The planner is still asked every step: a batch that decoded plainly ahead of its reads goes back
    to speculating (a step later) when the planner plans drafting again, as a load-aware budget does
    when the batch shrinks.  Here the planner plans plain steps for the first four steps, then its own
    plans; greedy, the tokens are those of the engine without decoding ahead (a seeded request's would
    not be: its step after the plain ones decodes plainly, which draws other numbers than a
    speculative step)."""
    from engine.speculative.planner import Planner

    original = Planner.plan
    calls = [0]

    def plain_first(self, seqs):
        calls[0] += 1
        return self.plain(seqs) if calls[0] <= 4 else original(self, seqs)
    monkeypatch.setattr(Planner, "plan", plain_first)
    target, draft = tiny_pair
    reqs = requests({"greedy": FEATURES["greedy"], "logit-bias": FEATURES["logit-bias"]}, max_tokens=20, spec=True)
    base = drive(target, draft, reqs, "off")
    drafted_base = sum(s.drafted_tokens for s in base[2].drain_step_stats())
    calls[0] = 0
    used[0] = 0
    ahead = drive(target, draft, reqs, "on")
    assert ahead[:2] == base[:2]
    assert used[0] >= 3  # the plain steps ran ahead
    assert sum(s.drafted_tokens for s in ahead[2].drain_step_stats()) > 0 < drafted_base  # then it drafted


def test_a_batch_verified_again_drops_its_forward_ahead(tiny_pair, logits, monkeypatch):
    """When reading a step's decisions fails after the forward ahead was queued, each sequence is
    verified again alone, drawing anew: the forward ahead ran from the first draws, so it is undone and
    the next step runs its own.  Seeded sampling, the failure at the same step with and without
    decoding ahead: the same tokens, from the same logits."""
    target, draft = tiny_pair
    reqs = requests({k: FEATURES[k] for k in ("sampled", "top-p", "seed", "penalties")})
    real = engine_runner.finish_all
    calls = [0]

    def failing_once(pendings, before_wait=None):
        out = real(pendings, before_wait)
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("planted: unpacking the read failed")
        return out
    monkeypatch.setattr(engine_runner, "finish_all", failing_once)
    base = drive(target, draft, reqs, "off")
    base_logits = dict(logits)
    logits.clear()
    calls[0] = 0
    ahead = drive(target, draft, reqs, "on")
    assert ahead[:2] == base[:2] and same_logits(logits, base_logits)


def test_a_full_batch_decodes_ahead_while_others_wait(tiny_pair, monkeypatch):
    """Requests waiting for a slot do not stop decoding ahead: none of them could join anyway."""
    target, draft = tiny_pair
    reqs = requests(PLAIN_FEATURES)
    base = drive(target, draft, reqs, "off", max_batch=3)
    waiting_ahead = [0]  # steps that began with a forward queued while requests waited
    original = EngineCore.step

    def counting(self):
        waiting_ahead[0] += bool(self.scheduler.waiting) and self.runner.ahead is not None
        return original(self)
    monkeypatch.setattr(EngineCore, "step", counting)
    ahead = drive(target, draft, reqs, "on", max_batch=3)
    assert ahead[:2] == base[:2] and waiting_ahead[0] >= 5
