"""Structured outputs in the engine: the grammar state (xgrammar on the tiny word-level vocabulary),
compile errors, and constrained decoding through the whole engine with speculation on.  The exact
law under a grammar is in ``tests/exact_law.py`` (``grammar_laws``) and end to end in
``tests/lossless.py``."""

from __future__ import annotations

import re

import pytest
import torch

from engine.grammar import EBNF, JSON, REGEX, GrammarError, Grammars, GrammarSpec, GrammarState, single_token, unpack
from engine.registry import method as method_of
from engine.request import GenerationRequest, RequestRejected, SamplingParams, SpecOptions
from tests.engine_utils import run_engine
from tests.grammar_toy import ToyMatcher, toy_state
from tests.tiny import VOCAB, tiny_tokenizer

# no allowed word is a prefix of another: xgrammar allows a token whose bytes start an allowed string
# ("w1" where "w11" may come), and this vocabulary has no token to go on with
PATTERN = r"w1(w3|w7|w9){2,4}w4w5w6w8"  # w1 and w4..w8 are forced; the grammar ends after w8
LOOP = r"w1(w3|w7|w9)+w4w5w6(w8|w6)*"  # never ends: requests run to max_tokens
METHODS = ["mcsd", "maxgram", "mcsd+maxgram", "cascade"]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [3, 3, 3, 3, 3]]


@pytest.fixture(scope="module")
def grammars():
    return Grammars(tiny_tokenizer(), VOCAB, [0])


def allowed(state: GrammarState, path: list[int]) -> list[int]:
    return unpack(state.masks([path]).bitmask, VOCAB)[0].nonzero()[:, 0].tolist()


def text_of(tokens: list[int]) -> str:
    """What the grammar sees of a token sequence (the word tokens' bytes, stop tokens excluded)."""
    return "".join(f"w{t}" for t in tokens if t not in (0, 2))


# ------------------------------------------------------------------------------ the grammar state
def test_masks_follow_paths_without_moving_the_committed_state(grammars):
    state = GrammarState(grammars.compile(GrammarSpec(REGEX, PATTERN)))
    assert allowed(state, []) == [1]
    assert allowed(state, [1]) == [3, 7, 9]
    assert allowed(state, [1, 7, 3]) == [3, 4, 7, 9]
    masks = state.masks([[1, 7], [5], [1, 5, 7]])  # [5] and [1, 5, ...] are forbidden
    assert masks.valid == [True, False, False]
    assert unpack(masks.bitmask, VOCAB)[1].nonzero()[:, 0].tolist() == [1]  # its longest allowed prefix's
    assert allowed(state, []) == [1]  # nothing committed
    assert state.commit([1, 7]) == 2 and allowed(state, []) == [3, 7, 9]


def test_forced_tokens_and_the_end_of_the_grammar(grammars):
    state = GrammarState(grammars.compile(GrammarSpec(REGEX, PATTERN)))
    assert state.forced([], 8) == [1]
    assert state.forced([1], 8) == []  # three choices there
    assert state.forced([1, 7, 3, 9, 3], 8) == [4, 5, 6, 8, 0]  # ... and the stop token ends it
    assert state.forced([1, 7, 3, 9, 3], 2) == [4, 5]
    assert state.forced([1, 5], 8) == []  # a forbidden path forces nothing
    assert state.commit([1, 7, 3, 4, 5, 6, 8, 0, 17, 18]) == 8  # what follows the stop token is not output
    assert state.terminated
    done = state.masks([[]])
    assert bool((done.bitmask == -1).all())  # a finished grammar is never filled: every token allowed


def test_tree_masks_mark_forbidden_and_dead_paths(grammars):
    state = GrammarState(grammars.compile(GrammarSpec(REGEX, PATTERN)))
    state.commit([1])
    # root -> 7 -> 3, root -> 5 (forbidden) -> 7, root -> dead
    masks = state.tree_masks([7, 5, -1, 3, 7], [-1, -1, -1, 0, 1])
    assert masks.valid == [True, True, False, False, True, False]


def test_single_token_reads_one_bit():
    row = torch.zeros(4, dtype=torch.int32)
    assert single_token(row, 128) is None
    row[2] = -(1 << 31)  # bit 31 of word 2: token 95
    assert single_token(row, 128) == 95
    row[0] = 1
    assert single_token(row, 128) is None


def test_bad_grammars_are_refused_by_name(grammars):
    bad = [GrammarSpec(JSON, '{"type": "foo"}', "response_format.json_schema.schema"),
           GrammarSpec(JSON, "{not json", "structured_outputs.json"),
           GrammarSpec(REGEX, "w1(", "structured_outputs.regex"),
           GrammarSpec(EBNF, "root ::= undefined_rule", "structured_outputs.grammar"),
           GrammarSpec(JSON, '{"type": "string", "description": "' + "x" * 70000 + '"}', "response_format")]
    for spec in bad:
        with pytest.raises(GrammarError) as info:
            grammars.compile(spec)
        assert info.value.param == spec.param and str(info.value)
    good = GrammarSpec(JSON, '{"type": "object"}')
    assert grammars.compile(good) is grammars.compile(good)  # cached


def test_the_toy_matcher_rolls_back_to_its_committed_state():
    state = toy_state(0)
    assert state.forced([1], 4) == [2]  # 1 forces 2; 2 allows three
    assert state.masks([[1, 2], [3]]).valid == [True, True]
    assert isinstance(state.matcher, ToyMatcher) and state.matcher.stack == [0]


# ------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("method", METHODS)
def test_greedy_constrained_speculation_equals_plain_constrained_decoding(tiny_pair, grammars, method):
    target, draft = tiny_pair
    for pattern, finish in ((PATTERN, "stop"), (LOOP, "length")):
        spec = GrammarSpec(REGEX, pattern)
        plain, _ = run_engine(target, draft, PROMPTS, spec=SpecOptions(enabled=False), grammar=spec, max_tokens=20)
        fast, core = run_engine(target, draft, PROMPTS, spec=SpecOptions(method=method), grammar=spec, max_tokens=20)
        assert [c.tokens for c in fast] == [c.tokens for c in plain]
        for c in fast:
            assert c.finish_reason == finish
            if finish == "stop":
                assert re.fullmatch(pattern, text_of(c.tokens))
            else:  # a prefix the grammar accepts token by token (commit raises on a refused token)
                assert GrammarState(grammars.compile(spec)).commit(c.tokens) == len(c.tokens)
        assert core.cache.used_blocks == 0


@pytest.mark.parametrize("method", METHODS)
def test_sampled_constrained_outputs_match_the_grammar(tiny_pair, method):
    target, draft = tiny_pair
    spec = GrammarSpec(REGEX, PATTERN)
    outs, _ = run_engine(target, draft, PROMPTS * 2, spec=SpecOptions(method=method), grammar=spec,
                         max_tokens=20, temperature=1.0, seed=5, top_p=0.9)
    for c in outs:
        assert c.finish_reason == "stop" and re.fullmatch(PATTERN, text_of(c.tokens)), c.tokens


@pytest.mark.parametrize("method", [None] + [m for m in METHODS if method_of(m).penalties])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_vanishing_repetition_penalty_keeps_to_the_grammar(tiny_pair, method, temperature):
    """``repetition_penalty=5e-324`` (valid: > 0) is 0 in float32; the grammar's forbidden tokens,
    at -inf, must not become NaN under it (the schemathesis fuzzer found greedy argmax picking
    one: "the grammar refused committed token")."""
    target, draft = tiny_pair
    spec = GrammarSpec(REGEX, PATTERN)
    options = SpecOptions(enabled=False) if method is None else SpecOptions(method=method)
    outs, _ = run_engine(target, draft, PROMPTS, spec=options, grammar=spec, max_tokens=20, temperature=temperature,
                         seed=2, repetition_penalty=5e-324)
    for c in outs:
        assert c.finish_reason == "stop" and re.fullmatch(PATTERN, text_of(c.tokens)), c.tokens


def test_forced_tokens_are_drafted_for_free_and_always_accepted(tiny_pair):
    target, draft = tiny_pair
    spec = GrammarSpec(REGEX, PATTERN)
    outs, core = run_engine(target, draft, PROMPTS, spec=SpecOptions(method="maxgram"), grammar=spec, max_tokens=20)
    stats = core.drain_step_stats()
    forced = sum(s.drafted_by_method.get("grammar", 0) for s in stats)
    assert forced >= 3 * 5  # w1, then w4, w5, w6, w8 and the stop token, per request
    assert sum(s.accepted_by_method.get("grammar", 0) for s in stats) == forced
    steps = sum(s.num_seqs for s in stats)
    # each request: one step to w1 (+ the next token), at most four for the middle, one for the forced tail
    assert steps <= 3 * 6, steps
    without, _ = run_engine(target, draft, PROMPTS, spec=SpecOptions(method="maxgram"), grammar=spec, max_tokens=20,
                            config={"grammar_forced": 0})
    assert [c.tokens for c in without] == [c.tokens for c in outs]


def test_a_request_without_a_grammar_is_untouched_by_one_in_its_batch(tiny_pair, grammars):
    target, draft = tiny_pair
    free, _ = run_engine(target, draft, PROMPTS, max_tokens=12)
    spec = GrammarSpec(REGEX, PATTERN)
    mixed, _ = run_engine(target, draft, PROMPTS, grammar=[None, spec, None], max_tokens=12)
    assert mixed[0].tokens == free[0].tokens and mixed[2].tokens == free[2].tokens
    assert re.fullmatch(PATTERN, text_of(mixed[1].tokens))


def test_ignore_eos_still_ends_at_the_end_of_the_grammar(tiny_pair):
    target, draft = tiny_pair
    outs, _ = run_engine(target, draft, PROMPTS, grammar=GrammarSpec(REGEX, PATTERN), max_tokens=30, ignore_eos=True)
    for c in outs:
        assert c.finish_reason == "stop" and re.fullmatch(PATTERN, text_of(c.tokens))


def test_lossy_methods_refuse_a_grammar(tiny_pair, grammars):
    from engine.config import EngineConfig
    from engine.core import EngineCore

    target, draft = tiny_pair
    core = EngineCore(target, draft, EngineConfig.from_settings(max_batch=2, max_model_len=128, tree=(2, 1)))
    compiled = core.grammars.compile(GrammarSpec(REGEX, PATTERN))
    for name in ("mjsd-lossy", "target-init-lossy"):
        req = GenerationRequest("r", [1, 2], SamplingParams(), SpecOptions(method=name), compiled)
        with pytest.raises(RequestRejected) as info:
            core.check_request(req)
        assert info.value.param == "speculative.method"


def _syncs_per_step(pair, method: str, grammar) -> int:
    """The most host reads of a decoding step (the device-check mode, ``tests/device_check.py``), two
    requests, one sampled with penalties; fails on any host/device mixing."""
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from tests.device_check import DeviceCheck, mark_engine

    core = EngineCore(*pair, EngineConfig.from_settings(max_batch=2, max_model_len=128, tree=(2, 1), spec_method=method))
    mark_engine(core)
    compiled = core.grammars.compile(grammar) if grammar is not None else None
    mode, worst = DeviceCheck(), 0
    with mode:
        for i, params in enumerate((dict(temperature=0.0), dict(temperature=0.8, seed=1, presence_penalty=0.5))):
            core.add_request(GenerationRequest(f"r{i}", [3 + i, 6, 7], SamplingParams(max_tokens=8, **params),
                                               SpecOptions(), compiled))
        while core.has_unfinished():
            mode.reset()
            assert not [o.error for o in core.step() if o.error]
            worst = max(worst, sum(mode.syncs.values()))
    assert not mode.violations, mode.violations[0]
    return worst


@pytest.mark.parametrize("method", METHODS)
def test_constrained_steps_read_the_host_once_per_draft_level(tiny_pair, method):
    """A constrained tree is read level by level (the grammar's masks follow each row's path, which
    the host walks), then verified: at most one read per level of the (2, 1) tree plus one (the
    cascade: one per review round, ``cascade_depth`` 4, plus one).  The masks themselves cross to the
    device without a read (as bitmasks, unpacked there), and a free batch, penalties included, reads
    no more than a constrained one."""
    constrained, free = (_syncs_per_step(tiny_pair, method, g) for g in (GrammarSpec(REGEX, LOOP), None))
    assert free <= constrained <= (4 if method == "cascade" else 2) + 1
