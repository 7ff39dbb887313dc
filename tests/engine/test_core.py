"""MCSD engine on tiny random models: greedy speculation is token-identical to plain decoding,
batching, stops inside multi-token steps, sampling options with speculation, accounting."""

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import GenerationRequest, SamplingParams, SpecOptions
from tests.engine_utils import run_engine
from tests.tiny import VOCAB, tiny_loaded

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [42]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request):
    target = tiny_loaded(request.param, seed=0)
    return target, tiny_loaded(request.param, seed=0), tiny_loaded(request.param, seed=1, layers=1)


def plain(target, prompts, **kw):
    outs, _ = run_engine(target, None, prompts, tree=(), **kw)
    return [o.tokens for o in outs]


@pytest.mark.parametrize("tree", [(1, 1, 1), (4, 2, 2), (3, 1, 1), (2, 2, 2, 1)])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculation_equals_plain_decoding(models, tree, batch):
    target, self_draft, other_draft = models
    prompts = PROMPTS[:batch]
    expected = plain(target, prompts, ignore_eos=True)
    for draft in (self_draft, other_draft):
        outs, _ = run_engine(target, draft, prompts, tree=tree, ignore_eos=True)
        assert [o.tokens for o in outs] == expected
    assert all(o.spec.accepted_tokens > 0 for o in run_engine(target, self_draft, prompts, tree=tree,
                                                              ignore_eos=True)[0])


def test_requests_joining_between_steps_match_one_at_a_time(models):
    target, self_draft, other_draft = models
    alone = [plain(target, [p], ignore_eos=True)[0] for p in PROMPTS]
    outs, _ = run_engine(target, other_draft, PROMPTS, max_batch=2, join_every=3, ignore_eos=True)
    assert [o.tokens for o in outs] == alone


def test_self_drafting_accepts_everything_and_counts_add_up(models):
    target, self_draft, _ = models
    outs, core = run_engine(target, self_draft, PROMPTS[:1], tree=(2, 2, 2), max_tokens=20, ignore_eos=True)
    o = outs[0]
    assert len(o.tokens) == 20 and o.finish_reason == "length"
    assert o.spec.steps == 5  # 4 tokens per step (3 accepted + bonus); the last step is capped by max_tokens
    stats = core.drain_step_stats()
    decode = [s for s in stats if s.num_seqs]
    assert sum(s.emitted_tokens for s in decode) == 20
    assert sum(s.accepted_tokens for s in decode) == o.spec.accepted_tokens == 20 - len(decode)
    assert sum(s.drafted_tokens for s in decode) == o.spec.drafted_tokens
    assert decode[0].accepted_by_depth == [1, 1, 1] and decode[0].accepted_by_rank == [3]
    assert decode[0].accepted_per_position == [1, 1, 1]


def test_stop_string_inside_a_multi_token_step_does_not_leak(models):
    target, self_draft, _ = models
    ref, _ = run_engine(target, None, PROMPTS[:1], tree=(), ignore_eos=True, max_tokens=16)
    words = ref[0].text.split()
    stop = " ".join(words[5:7])  # spans two tokens, reached in the middle of a 4-token step
    outs, _ = run_engine(target, self_draft, PROMPTS[:1], tree=(3, 1, 1), ignore_eos=True, max_tokens=16,
                         stop=[stop])
    assert outs[0].finish_reason == "stop"
    assert stop not in outs[0].text
    assert ref[0].text.startswith(outs[0].text)
    assert outs[0].text == ref[0].text[: ref[0].text.index(stop)]


def test_stop_token_and_max_tokens_inside_a_step(models):
    target, self_draft, _ = models
    ref = plain(target, PROMPTS[:1], ignore_eos=True, max_tokens=16)[0]
    stop_tok = ref[6]
    first = ref.index(stop_tok)
    outs, _ = run_engine(target, self_draft, PROMPTS[:1], tree=(4, 1, 1), ignore_eos=True, max_tokens=16,
                         stop_token_ids=[stop_tok])
    assert outs[0].tokens == ref[: first + 1] and outs[0].finish_reason == "stop"
    outs, _ = run_engine(target, self_draft, PROMPTS[:1], tree=(4, 1, 1), ignore_eos=True, max_tokens=7)
    assert outs[0].tokens == ref[:7] and outs[0].finish_reason == "length"


@pytest.mark.parametrize("opts", [
    dict(repetition_penalty=1.3), dict(presence_penalty=1.5, frequency_penalty=0.5),
    dict(logit_bias={7: 5.0, 9: -100.0}),
])
def test_greedy_with_penalties_and_bias_equals_plain(models, opts):
    target, self_draft, other_draft = models
    expected = plain(target, PROMPTS, ignore_eos=True, **opts)
    for draft in (self_draft, other_draft):
        outs, _ = run_engine(target, draft, PROMPTS, ignore_eos=True, **opts)
        assert [o.tokens for o in outs] == expected
    if "logit_bias" in opts:
        assert all(9 not in toks for toks in expected)


def test_seeded_sampling_reproduces_and_respects_top_k(models):
    target, _, other_draft = models
    kw = dict(temperature=0.9, top_k=3, seed=1234, ignore_eos=True, max_tokens=12)
    a, _ = run_engine(target, other_draft, PROMPTS, **kw)
    b, _ = run_engine(target, other_draft, PROMPTS[:2], **kw)
    assert [o.tokens for o in a[:2]] == [o.tokens for o in b]  # batch composition does not matter
    # top_k=3: every emitted token is among the target's 3 best at its position
    for prompt, o in zip(PROMPTS, a):
        ctx = list(prompt)
        for tok in o.tokens:
            with torch.no_grad():
                cache = target.model.new_cache(1, 64)
                slot = cache.allocate()
                logits = target.model(torch.tensor([ctx]), torch.arange(len(ctx))[None], cache, [slot]).logits[0, -1]
            assert tok in logits.topk(3).indices.tolist()
            ctx.append(tok)


def test_logprobs_match_plain_decoding(models):
    target, self_draft, _ = models
    ref, _ = run_engine(target, None, PROMPTS[:2], tree=(), ignore_eos=True, logprobs=3, max_tokens=10)
    spec, _ = run_engine(target, self_draft, PROMPTS[:2], ignore_eos=True, logprobs=3, max_tokens=10)
    for r, s in zip(ref, spec):
        assert [lp.token_id for lp in s.logprobs] == r.tokens
        for a, b in zip(r.logprobs, s.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 3


def test_per_request_speculation_options(models):
    target, self_draft, _ = models
    off, _ = run_engine(target, self_draft, PROMPTS[:2], ignore_eos=True, spec=SpecOptions(enabled=False))
    assert all(o.spec.drafted_tokens == 0 for o in off)
    capped, _ = run_engine(target, self_draft, PROMPTS[:1], ignore_eos=True, max_tokens=12,
                           spec=SpecOptions(max_depth=1))
    assert capped[0].spec.steps == 6  # 2 tokens per step
    narrow, _ = run_engine(target, self_draft, PROMPTS[:1], ignore_eos=True, max_tokens=12,
                           spec=SpecOptions(tree=(1, 1)))
    assert narrow[0].spec.drafted_tokens == 2 * narrow[0].spec.steps


def test_bad_requests_are_rejected_clearly(models):
    target, self_draft, _ = models
    core = EngineCore(target, self_draft, EngineConfig(max_batch=2, max_model_len=32, tree=(2, 2)))
    with pytest.raises(ValueError, match="maximum context length is 32"):
        core.add_request(GenerationRequest("a", [1] * 30, SamplingParams(max_tokens=8)))
    with pytest.raises(ValueError, match="does not fit"):
        core.add_request(GenerationRequest("b", [1, 2], SamplingParams(), SpecOptions(tree=(3,))))
    with pytest.raises(ValueError, match="token ids"):
        core.add_request(GenerationRequest("c", [VOCAB + 5], SamplingParams()))
    with pytest.raises(ValueError, match="empty"):
        core.add_request(GenerationRequest("d", [], SamplingParams()))
    assert not core.has_unfinished()


def test_abort_frees_slots_at_once(models):
    target, self_draft, _ = models
    core = EngineCore(target, self_draft, EngineConfig(max_batch=2, max_model_len=64, tree=(2, 2)))
    for i in range(3):
        core.add_request(GenerationRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True)))
    core.step()
    assert core.num_running == 2 and core.num_waiting == 1 and core.cache.free_slots == 0
    core.abort_request("r0")
    assert core.num_running == 1 and core.cache.free_slots == 1
    core.abort_request("r2")  # still waiting
    assert core.num_waiting == 0
    while core.has_unfinished():
        outs = core.step()
        assert all(o.request_id == "r1" for o in outs)
    assert core.cache.free_slots == 2 and core.runner.proposer.cache.free_slots == 2


def test_long_prompt_is_prefilled_in_chunks_while_others_decode(models):
    target, self_draft, _ = models
    core = EngineCore(target, self_draft, EngineConfig(max_batch=2, max_model_len=256, tree=(2,), prefill_chunk=16))
    core.add_request(GenerationRequest("short", [1, 2], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)))
    core.step()
    core.add_request(GenerationRequest("long", list(range(1, 90)), SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)))
    short_tokens_during_prefill = 0
    for _ in range(5):  # 88 prompt tokens at 16 per step: the short stream keeps flowing
        outs = core.step()
        short_tokens_during_prefill += sum(len(o.new_token_ids) for o in outs if o.request_id == "short")
        assert core.drain_step_stats()[-1].prefill_tokens <= 16
    assert short_tokens_during_prefill >= 5
    ref = plain(target, [list(range(1, 90))], ignore_eos=True, max_tokens=4)[0]
    got = []
    while core.has_unfinished():
        got += [t for o in core.step() if o.request_id == "long" for t in o.new_token_ids]
    assert got == ref


def test_a_request_that_cannot_speculate_says_why(models):
    target, _, _ = models
    outs, _ = run_engine(target, None, PROMPTS[:1], tree=(), max_tokens=4, spec=SpecOptions(enabled=True))
    assert outs[0].spec.note and "without a draft model" in outs[0].spec.note
    outs, _ = run_engine(target, None, PROMPTS[:1], tree=(), max_tokens=4, spec=SpecOptions(enabled=False))
    assert outs[0].spec.note is None


@pytest.mark.parametrize("stage", ["verify", "postprocess"])
def test_one_failing_request_ends_alone_and_the_batch_goes_on(stage, monkeypatch):
    """A request whose verification (or detokenization) raises finishes with an error and frees its
    slots; the other requests of the same batches produce exactly what they produce without it."""
    import engine.core as core_mod
    from engine.speculative.verify import LosslessRule

    target, draft = tiny_loaded("llama", seed=0), tiny_loaded("llama", seed=1, layers=1)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    expected, _ = run_engine(target, draft, prompts, tree=(2, 1), ignore_eos=True, max_tokens=12)
    calls = {"n": 0}
    if stage == "verify":
        real = LosslessRule.start

        def flaky(self, seqs, *args, **kwargs):
            r1 = next((s for s in seqs if s.request_id == "r1"), None)
            if r1 is not None and r1.num_output >= 1:  # from its second decode step: the batch fails,
                calls.setdefault("at", r1.num_output)  # then r1 alone when each is verified alone
                if r1.num_output == calls["at"]:
                    raise RuntimeError("planted verification failure")
            return real(self, seqs, *args, **kwargs)
        monkeypatch.setattr(LosslessRule, "start", flaky)
    else:
        real = core_mod.EngineCore._postprocess

        def flaky(self, res, stats):
            if res.seq.request_id == "r1":
                calls["n"] += 1
                if calls["n"] == 2:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted detokenizer failure")
            return real(self, res, stats)
        monkeypatch.setattr(core_mod.EngineCore, "_postprocess", flaky)
    outs, core = run_engine(target, draft, prompts, tree=(2, 1), ignore_eos=True, max_tokens=12)
    assert outs[1].finish_reason == "error" and len(outs[1].tokens) < 12
    assert [o.tokens for i, o in enumerate(outs) if i != 1] == [o.tokens for i, o in enumerate(expected) if i != 1]
    assert all(o.finish_reason == "length" for i, o in enumerate(outs) if i != 1)
    assert core.cache.free_slots == core.cache.num_slots and not core.has_unfinished()
    draft_cache = core.runner.proposer.cache
    assert draft_cache.free_slots == draft_cache.num_slots


@pytest.mark.parametrize("stage", ["draft", "forward", "batch-forward", "prefill", "plan", "learn", "keep"])
def test_a_failure_outside_verification_costs_only_its_own_request(stage, monkeypatch):
    """Drafting, the target forward, prefill, planning and learning fail in turn, with the batch in flight:
    * ``draft``: r1's drafting raises (after its draft cache caught up) from its second step on.  The
      batch's step runs each sequence alone; r1's again without speculation, and r1 decodes plainly
      from then on (its note says why, its draft slot is freed), still with exactly its tokens;
    * ``forward``: the target forward raises whenever r1 is in it: r1 ends with the error;
    * ``batch-forward``: one forward of several sequences raises once: each runs alone, nobody fails;
    * ``prefill``: r1's prompt fails to prefill: r1 ends with the error before any token;
    * ``plan`` / ``learn``: the planner raises while planning one step (that step decodes plainly) or
      every time it learns from one (logged);
    * ``keep``: r1's cache update fails after a step (the batch's sequences are kept together,
      ``KVCache.keep_many``): r1 ends with the error, the others are kept.
    The other requests produce exactly their tokens, and every slot and block is freed at the end."""
    import engine.runner as runner_mod
    from engine.runner import ModelRunner
    from engine.speculative.planner import Planner
    from engine.speculative.proposer import DraftModelProposer

    target, draft = tiny_loaded("llama", seed=0), tiny_loaded("llama", seed=1, layers=1)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    expected, _ = run_engine(target, draft, prompts, tree=(2, 1), ignore_eos=True, max_tokens=12)
    state = {"slot": None, "decode": False, "raised": 0, "r1_slot": None, "keeps": 0}
    core_cache = [None]
    real_forward, real_run_blocks = ModelRunner._forward, runner_mod.run_blocks

    def forward(self, seqs, plans, stats):  # notes what the target forward is about to run
        r1 = next((s for s in seqs if s.request_id == "r1"), None)
        core_cache[0] = self.cache
        state["r1_slot"] = r1.slot if r1 is not None else None
        state["slot"] = r1.slot if r1 is not None and r1.num_output >= 2 else None
        state["decode"] = True
        try:
            return real_forward(self, seqs, plans, stats)
        finally:
            state["decode"] = False

    def run_blocks(model, cache, blocks, *args, **kwargs):
        out = real_run_blocks(model, cache, blocks, *args, **kwargs)  # the forward writes its entries, then fails
        if stage == "forward" and state["decode"] and any(b.slot == state["slot"] for b in blocks):
            state["raised"] += 1
            raise RuntimeError("planted target failure")
        if stage == "batch-forward" and state["decode"] and len(blocks) > 1 and not state["raised"]:
            state["raised"] += 1
            raise RuntimeError("planted failure of a batch")
        if stage == "prefill" and not state["decode"] and any(b.tokens == [9, 10] for b in blocks):
            state["raised"] += 1
            raise RuntimeError("planted prefill failure")
        return out

    monkeypatch.setattr(ModelRunner, "_forward", forward)
    monkeypatch.setattr(runner_mod, "run_blocks", run_blocks)
    if stage == "draft":
        real_level = DraftModelProposer._run_level

        def run_level(self, seqs, trees, to_run, d, *kept):
            if any(seqs[i].request_id == "r1" and seqs[i].num_output >= 1 for i in to_run):
                state["raised"] += 1
                raise RuntimeError("planted drafting failure")
            return real_level(self, seqs, trees, to_run, d, *kept)
        monkeypatch.setattr(DraftModelProposer, "_run_level", run_level)
    elif stage == "plan":
        real_plan = Planner.plan

        def plan(self, seqs):
            state["raised"] += 1
            if state["raised"] == 3:
                raise RuntimeError("planted planning failure")
            return real_plan(self, seqs)
        monkeypatch.setattr(Planner, "plan", plan)
    elif stage == "learn":
        def observe(self, *args, **kwargs):
            state["raised"] += 1
            raise RuntimeError("planted learning failure")
        monkeypatch.setattr(Planner, "observe", observe)
    elif stage == "keep":  # r1's target cache update fails at its fourth step; the batch's others are kept
        from engine.kv_cache import KVCache
        real_keep = KVCache._keep_bookkeeping

        def keep(self, slot, keep_idx):
            if self is core_cache[0] and slot == state["r1_slot"] and state["keeps"] == 3:
                state["raised"] += 1
                raise IndexError("planted cache update failure")
            if self is core_cache[0] and slot == state["r1_slot"]:
                state["keeps"] += 1
            return real_keep(self, slot, keep_idx)
        monkeypatch.setattr(KVCache, "_keep_bookkeeping", keep)

    outs, core = run_engine(target, draft, prompts, tree=(2, 1), ignore_eos=True, max_tokens=12)
    assert state["raised"] >= 1  # the failure happened
    r1_fails = stage in ("forward", "prefill", "keep")
    survivors = [0, 2] if r1_fails else [0, 1, 2]
    assert [outs[i].tokens for i in survivors] == [expected[i].tokens for i in survivors]
    assert all(outs[i].finish_reason == "length" for i in survivors)
    if r1_fails:
        assert outs[1].finish_reason == "error"
        assert len(outs[1].tokens) == {"prefill": 0, "forward": 2}.get(stage, len(outs[1].tokens))
        assert stage != "keep" or 0 < len(outs[1].tokens) < 12
    if stage == "draft":  # r1 stopped speculating, and said so; the others went on drafting
        assert "speculation stopped" in outs[1].spec.note and "planted drafting failure" in outs[1].spec.note
        assert outs[1].spec.steps < expected[1].spec.steps and outs[0].spec.steps == expected[0].spec.steps
        assert sum(s.speculation_failures for s in core.drain_step_stats()) == 1
    else:
        assert all(o.spec.note is None for o in outs)
    assert not core.has_unfinished() and core.cache.free_slots == core.cache.num_slots
    assert core.cache.used_blocks == 0 and not core.cache.pending.any()
    draft_cache = core.runner.proposer.cache
    assert draft_cache.free_slots == draft_cache.num_slots and draft_cache.used_blocks == 0


@pytest.mark.parametrize("overlap", ["on", "auto"])
@pytest.mark.parametrize("spec", [True, False])
def test_deferred_host_work_runs_while_the_next_step_is_on_the_device(models, spec, overlap, monkeypatch):
    """Work deferred after a step (its accounting, the server's metrics) runs in the next step: with
    ``defer_host_work`` (CUDA's default) once that step's forwards are queued and before the host waits
    for its read (``EngineCore.defer``), else (the CPU's) at its end; what no read runs, the end of the
    next step does; a job that raises fails nothing."""
    import engine.device as engine_device

    target, _, draft = models
    core = EngineCore(target, draft, EngineConfig.from_settings(max_batch=2, max_model_len=128, tree=(2, 1),
                                                                defer_host_work=overlap))
    assert core.overlap_host_work == (overlap == "on")
    events: list[str] = []
    monkeypatch.setattr(engine_device, "sync_listeners",
                        [*engine_device.sync_listeners, lambda label: events.append(label)])
    core.add_request(GenerationRequest("a", [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True),
                                       SpecOptions(enabled=spec)))
    core.defer(lambda: events.append("before the first step"))
    emitted = sum(len(o.new_token_ids) for o in core.step())  # a prefill and its first token
    before_read = events.index("before the first step") < events.index("to_host")
    assert before_read == core.overlap_host_work  # that step's read ran it, or its end
    for _ in range(3):
        events.clear()
        core.defer(lambda: 1 / 0)  # logged; the next job and the step go on
        core.defer(lambda: events.append("work"))
        outputs = core.step()
        assert events[0 if core.overlap_host_work else -1] == "work" and "to_host" in events
        assert outputs[0].new_token_ids
        emitted += len(outputs[0].new_token_ids)
    events.clear()
    core.defer(lambda: events.append("work"))
    core.abort_request("a")
    assert core.step() == [] and events == ["work"]  # nothing ran on the device: the step's end ran it
    stats = core.drain_step_stats()
    assert sum(s.emitted_tokens for s in stats) == emitted and (sum(s.drafted_tokens for s in stats) > 0) == spec
