"""Max-Gram, the cascade and multi-drafter trees: lookup rules, merged trees and their masks, the
proposal-event rule for a node proposed by several drafters, and greedy equality for every method."""

from collections import Counter

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import SpecOptions
from engine.sequence import Sequence
from engine.speculative.draft_tree import MAXGRAM, ONEHOT, SAMPLED, DraftTree
from engine.registry import method_names
from engine.speculative.cascade import CASCADE_METHOD as CASCADE
from engine.speculative.maxgram import MAXGRAM_METHOD as M_MAXGRAM, MCSD_MAXGRAM, BigramTable, MaxGramDrafter, NgramIndex
from engine.speculative.tree import TreeTopology
from engine.speculative.walk import residual, verify_sampled
from engine.request import GenerationRequest, SamplingParams
from tests.engine_utils import run_engine
from tests.exact_law import Replay, enumerate_law
from tests.engine.speculative.test_tree import fresh_mask
from tests.tiny import tiny_loaded


def seq_of(prompt, output=()):
    s = Sequence.create(GenerationRequest("r", list(prompt), SamplingParams(max_tokens=64)), stream=None)
    s.tokens.extend(output)
    return s


# ---------------------------------------------------------------------------- Max-Gram lookup
def test_longest_suffix_match_wins_and_prompt_comes_first():
    # "1 2 3" continues with 9 in the prompt; "3" alone continues with 7 later in the output
    s = seq_of([1, 2, 3, 9, 9, 4, 3, 7], [5, 1, 2, 3])
    props = MaxGramDrafter(max_len=3, max_ngram=4).propose(s)
    assert props[0].match == 3 and props[0].tokens == [9, 9, 4]
    # a 1-gram match: occurrences in the prompt first (most recent there), then in the output
    s = seq_of([8, 6, 1, 8, 5], [2, 8, 4, 3, 8])
    props = MaxGramDrafter(max_len=8, max_ngram=2).propose(s, branches=3)
    assert [p.tokens[0] for p in props] == [5, 6, 4]
    assert all(p.match == 1 for p in props) and len(props[0].tokens) == 2  # 1-token match -> 2 tokens


def test_branches_have_distinct_first_tokens_and_path_extends_the_context():
    s = seq_of([4, 5, 6, 4, 5, 6, 4, 5, 7], [])
    d = MaxGramDrafter(max_len=4, max_ngram=3)
    props = d.propose(s, path=[4, 5], branches=4)
    firsts = [p.tokens[0] for p in props]
    assert len(set(firsts)) == len(firsts) and firsts[0] == 7  # "... 7 4 5" is not there; "5 7 4 5" -> ...
    assert d.propose(s, path=[4, 5], max_len=1)[0].tokens == [7]


def test_index_is_incremental_and_excludes_the_suffix_itself():
    idx = NgramIndex(2)
    toks = [1, 2, 1]
    idx.extend(toks)
    assert idx.continuations((1,), limit=3, split=3) == [1]  # the final "1" has no continuation yet
    toks += [3, 1]
    idx.extend(toks)
    assert idx.continuations((1,), limit=5, split=2) == [1, 3]  # prompt (< 2) first, then the rest, newest first
    assert idx.size == 5 and idx.continuations((2, 1), limit=5, split=5) == [3]


def test_root_match_follows_the_tokens_as_they_grow():
    s = seq_of([1, 2, 3, 9], [])
    d = MaxGramDrafter(max_len=4, max_ngram=3)
    assert d.root_match(s) is None  # "9" never appeared before, and no bigram table
    assert d.root_match(s) is None  # (asked again for the same tokens)
    s.tokens += [1, 2]
    assert d.root_match(s) == 2 == d.propose(s)[0].match  # "1 2" -> "3 9"
    s.tokens += [3]
    assert d.root_match(s) == 3 == d.propose(s)[0].match


def test_bigram_fallback_only_without_a_match():
    table = BigramTable.from_token_lists([[1, 2, 3, 1, 2, 3, 1, 2, 4]])
    assert table.successor == {1: 2, 2: 3, 3: 1}  # 2->4 seen once: below min_count
    d = MaxGramDrafter(max_len=5, bigram=table, bigram_len=3)
    fresh = d.propose(seq_of([9, 8, 1]))  # "1" never appeared before
    assert fresh[0].match == 0 and fresh[0].tokens == [2, 3, 1]
    assert d.propose(seq_of([1, 7, 1]))[0].tokens == [7, 1]  # a real match wins
    assert MaxGramDrafter().propose(seq_of([9, 8, 1])) == []


def test_bigram_table_from_a_prompts_corpus(tmp_path):
    from tests.tiny import tiny_tokenizer
    tok = tiny_tokenizer(20)
    path = tmp_path / "corpus.json"
    path.write_text('[{"id": "a", "messages": [{"role": "user", "content": "w3 w4 w3 w4 w5"}]}]')
    table = BigramTable.from_corpus(tok, path)
    ids = tok.encode("w3 w4", add_special_tokens=False)
    assert table.successor[ids[0]] == ids[1]
    with pytest.raises(ValueError, match="does not exist"):
        BigramTable.from_corpus(tok, tmp_path / "missing.json")


# ---------------------------------------------------------------------------- merged trees
def test_merged_tree_shares_prefixes_and_its_mask_is_the_fresh_one():
    topo = TreeTopology((2, 2))
    sub = topo.subtree((2, 2))
    tree = DraftTree(sub, [10, 11, 20, 21, 22, 23])  # 10 -> 20, 21; 11 -> 22, 23
    chain = tree.add_path(-1, [10, 21, 30, 31], MAXGRAM)  # shares 10 -> 21, then two new nodes
    assert chain[:2] == [0, 3] and chain[2:] == [6, 7]
    again = tree.add_path(-1, [12, 13], MAXGRAM)  # a second root branch
    assert again == [8, 9]
    tail = tree.add_path(5, [40], MAXGRAM)  # below a draft leaf
    assert tree.parents() == [-1, -1, 0, 0, 1, 1, 3, 6, -1, 8, 5]
    assert tree.depths() == [1, 1, 2, 2, 2, 2, 3, 4, 1, 2, 3]
    assert tree.ranks()[6] == 0 and tree.ranks()[8] == 2
    assert torch.equal(tree.mask(), fresh_mask(tree.parents()))
    assert tree.node_sources(3) == {"draft", MAXGRAM} and tree.node_sources(2) == {"draft"}
    ev = tree.events()
    assert ev[0] == [(0, ONEHOT), (8, ONEHOT), (0, SAMPLED), (1, SAMPLED)]  # one-hot first
    assert ev[1] == [(3, ONEHOT), (2, SAMPLED), (3, SAMPLED)] and ev[6] == [(tail[0], ONEHOT)]
    tree.add_path(-1, [10, 21], MAXGRAM)  # a repeated deterministic proposal adds no event
    assert tree.events()[1].count((3, ONEHOT)) == 1
    tree.drafted_levels = 1  # the draft ran level 1 only: entries 0, 1
    assert tree.draft_entries([0, 3, 6]) == [0]


# ---------------------------------------------------------------------------- the merged-node rule
P = torch.tensor([0.35, 0.25, 0.2, 0.15, 0.05], dtype=torch.float64)
Q = torch.tensor([0.1, 0.4, 0.3, 0.1, 0.1], dtype=torch.float64)


def merged_row_law(onehot_token: int, skip_sampled_duplicate: bool = False) -> torch.Tensor:
    """Exact law of the emitted first token of a one-row tree: two draft candidates drawn without
    replacement from Q, plus Max-Gram's fixed proposal (merged with a draft candidate when equal)."""
    sub = TreeTopology((2,)).subtree((2,))

    def step(coins: Replay) -> tuple:
        tree = DraftTree(sub, coins.draw_distinct(Q, 2), q={0: Q})
        tree.add_path(-1, [onehot_token], MAXGRAM)
        events = tree.events()
        if skip_sampled_duplicate:  # a wrong rule: a merged node keeps only its one-hot proposal
            merged = {n for n, k in events[0] if k == ONEHOT}
            events[0] = [(n, k) for n, k in events[0] if k == ONEHOT or n not in merged]
        events += [[] for _ in range(4)]
        r = verify_sampled(lambda row: P, lambda row: tree.q[row], tree.tokens + [0] * 3, events, coins)
        return (r.tokens[0],)

    law = torch.zeros(len(P), dtype=torch.float64)
    for (tok,), pr in enumerate_law(step, last_draw_emitted=False).items():
        law[tok] += pr
    return law


def test_a_node_proposed_by_two_drafters_keeps_the_target_distribution():
    """The documented rule (engine.speculative.draft_tree): one event per proposal, one-hot first.  The first
    token has law P exactly; dropping the merged node's sampled event biases it."""
    for token in range(len(P)):
        assert torch.allclose(merged_row_law(onehot_token=token), P, atol=1e-12, rtol=0), token
    bad = merged_row_law(onehot_token=1, skip_sampled_duplicate=True)  # token 1 is Q's likeliest
    assert (bad - P).abs().max() > 1e-2


def test_onehot_residual_removes_the_token():
    p = torch.tensor([0.5, 0.3, 0.2])
    from engine.speculative.walk import remove_candidate
    assert torch.allclose(remove_candidate(p, 0), residual(p, torch.tensor([1.0, 0.0, 0.0])))


# ---------------------------------------------------------------------------- greedy equality
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 4, 3, 4, 3], [10, 11, 12, 13, 14, 10, 11, 12], [42, 42, 42]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request):
    return (tiny_loaded(request.param, seed=0), tiny_loaded(request.param, seed=0),
            tiny_loaded(request.param, seed=1, layers=1))


@pytest.mark.parametrize("method", [M_MAXGRAM, MCSD_MAXGRAM, MCSD_MAXGRAM + "-unread", CASCADE])
@pytest.mark.parametrize("batch", [1, 4])
def test_every_method_is_token_identical_to_plain_greedy(models, method, batch):
    """``mcsd+maxgram-unread``: ``maxgram_read_tree=False``, the draft's tokens kept on the device."""
    target, self_draft, other_draft = models
    prompts = PROMPTS[:batch]
    expected = [o.tokens for o in run_engine(target, None, prompts, tree=(), ignore_eos=True, max_tokens=32)[0]]
    # load_aware=False: Max-Gram's length cap would otherwise follow timings measured on this machine
    cfg = dict(maxgram_len=4, maxgram_branches=2, maxgram_tail=3, cascade_depth=3, load_aware=False,
               maxgram_read_tree=not method.endswith("-unread"))
    method = method.removesuffix("-unread")
    for draft in (self_draft, other_draft):
        outs, core = run_engine(target, draft, prompts, tree=(2, 1), ignore_eos=True, max_tokens=32, config=cfg,
                                spec=SpecOptions(method=method))
        assert [o.tokens for o in outs] == expected, (method, draft.source)
        assert core.cache.free_slots == core.cache.num_slots
    by_method = Counter()
    for s in core.drain_step_stats():
        by_method.update(s.drafted_by_method)
    assert by_method[MAXGRAM] > 0 or by_method["bigram"] > 0 or method == CASCADE
    if method != M_MAXGRAM:
        assert by_method["draft" if method == MCSD_MAXGRAM else "cascade"] > 0


def test_maxgram_needs_no_draft_model_and_penalties_logprobs_still_match(models):
    target, _, other_draft = models
    kw = dict(ignore_eos=True, max_tokens=24, frequency_penalty=0.5, logprobs=2)
    base = run_engine(target, None, PROMPTS, tree=(), **kw)[0]
    alone = run_engine(target, None, PROMPTS, tree=(), spec=SpecOptions(method=M_MAXGRAM), **kw)[0]
    both = run_engine(target, other_draft, PROMPTS, tree=(2, 1), spec=SpecOptions(method=MCSD_MAXGRAM), **kw)[0]
    for outs in (alone, both):
        assert [o.tokens for o in outs] == [o.tokens for o in base]
        for o, b in zip(outs, base):
            assert [lp.token_id for lp in o.logprobs] == [lp.token_id for lp in b.logprobs]
            assert [lp.logprob for lp in o.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)
    assert all(o.spec.note is None for o in alone)


@pytest.mark.parametrize("method", method_names())
def test_a_request_naming_any_method_with_speculation_off_decodes_plainly(models, method):
    """Speculation off (or no draft model) is plain decoding whatever method the request names: its
    steps take the lossless rule, not the method's own.  (The target-initialised rule once took such
    steps, drew candidates every step and never emitted a token.)  Bounded, so a hang fails."""
    target, _, other_draft = models
    expected = [o.tokens for o in run_engine(target, None, PROMPTS, tree=(), ignore_eos=True, max_tokens=12)[0]]
    for draft in (other_draft, None):
        core = EngineCore(target, draft, EngineConfig(max_batch=4, max_model_len=64, tree=(2, 1) if draft else (),
                                                      load_aware=False))
        for i, p in enumerate(PROMPTS):
            core.add_request(GenerationRequest(f"r{i}", list(p), SamplingParams(max_tokens=12, temperature=0.0,
                                                                                ignore_eos=True),
                                               SpecOptions(enabled=False, method=method)))
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        for _ in range(200):
            if not core.has_unfinished():
                break
            for o in core.step():
                out[o.request_id] += o.new_token_ids
        assert not core.has_unfinished(), (method, draft)
        assert [out[f"r{i}"] for i in range(len(PROMPTS))] == expected, (method, draft)


def test_a_draft_method_without_a_draft_model_says_so(models):
    target = models[0]
    outs, _ = run_engine(target, None, PROMPTS[:1], tree=(), max_tokens=4, spec=SpecOptions(method=CASCADE))
    assert "'cascade'" in outs[0].spec.note and "maxgram" in outs[0].spec.note


def test_maxgram_accepts_on_a_looping_target():
    """A toy target whose greedy output depends on the last two tokens must loop; once it does,
    Max-Gram's copies are the target's own continuation and get accepted."""
    from tests.lossless import loaded
    target = loaded(0)
    outs, core = run_engine(target, None, [[2, 3]], tree=(), ignore_eos=True, max_tokens=40,
                            spec=SpecOptions(method=M_MAXGRAM), config=dict(load_aware=False))
    plain = run_engine(target, None, [[2, 3]], tree=(), ignore_eos=True, max_tokens=40,
                       )[0]
    assert outs[0].tokens == plain[0].tokens
    assert outs[0].spec.accepted_tokens >= 20 and outs[0].spec.steps < 20


# ---------------------------------------------------------------------------- MJSD (lossy)
def target_nll(target, prompt, toks) -> float:
    """Mean negative log-likelihood of ``toks`` after ``prompt`` under the target (temperature 1)."""
    from engine.batching import Block, run_blocks
    cache = target.model.new_cache(1, 256)
    slot = cache.allocate()
    ids = list(prompt) + list(toks)
    _, lg = run_blocks(target.model, cache, [Block(slot, ids, list(range(len(ids))), list(range(len(ids))))])
    lp = lg[0].float().log_softmax(-1)
    return -sum(float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(toks)) / len(toks)


def test_mjsd_mechanics_and_its_lower_perplexity_with_a_perfect_draft(models):
    """Beam width 1 with the target as its own draft is greedy decoding exactly (every ratio is 1);
    width 4 finds continuations the target itself rates likelier than greedy's (MJSD's aim)."""
    target, self_draft, _ = models
    base = run_engine(target, None, PROMPTS, tree=(), ignore_eos=True, max_tokens=24)[0]
    run = lambda beam: run_engine(target, self_draft, PROMPTS, tree=(1,), ignore_eos=True, max_tokens=24,  # noqa: E731
                                  spec=SpecOptions(method="mjsd-lossy"), config=dict(mjsd_beam=beam))[0]
    narrow, wide = run(1), run(4)
    assert [o.tokens for o in narrow] == [o.tokens for o in base]
    assert all(o.spec.note.startswith("lossy") and o.spec.accepted_tokens > 0 for o in wide)
    nll = lambda outs: sum(target_nll(target, p, o.tokens) for p, o in zip(PROMPTS, outs))  # noqa: E731
    assert nll(wide) < nll(base)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_mjsds_device_beams_are_the_beam_search_over_fresh_forwards(models, monkeypatch, temperature):
    """The beams MJSD chooses on the device, each level run through the draft under a mask gathered
    from the beams' parents, against a beam search on the host whose every path runs through a
    fresh draft forward of the whole context: the best beam's tokens and log q, every step of
    several requests (batched, different depths as the room runs out)."""
    from engine.batching import Block, run_blocks
    from engine.speculative.mjsd import JointRule, chain_tokens, joint_logprobs

    target, _, draft = models
    beam, depth = 3, 4
    seen = []
    real = JointRule.start

    def start(self, seqs, trees, logits):
        for seq, tree in zip(seqs, trees):
            seen.append((list(seq.tokens), seq, chain_tokens(tree, logits.device).tolist(), tree.joint_logq.tolist()))
        return real(self, seqs, trees, logits)

    monkeypatch.setattr(JointRule, "start", start)
    run_engine(target, draft, PROMPTS, tree=(1,), max_tokens=10, temperature=temperature, seed=5,
               spec=SpecOptions(method="mjsd-lossy"), config=dict(mjsd_beam=beam, mjsd_depth=depth))
    assert len(seen) >= len(PROMPTS)

    def draft_logits(ids):
        cache = draft.model.new_cache(1, 64)
        slot = cache.allocate()
        _, lg = run_blocks(draft.model, cache, [Block(slot, ids, list(range(len(ids))), [len(ids) - 1])])
        return lg[0]

    for context, seq, tokens, logq in seen:
        beams = [([], [], 0.0)]  # (path, log q of each token, joint log q)
        for _ in range(len(tokens)):
            grown = []
            for path, lqs, score in beams:
                lq = joint_logprobs(mjsd_pad(draft_logits(context + path), target.config.vocab_size), seq)[0]
                grown += [(path + [t], lqs + [float(lq[t])], score + float(lq[t])) for t in range(lq.numel())]
            beams = sorted(grown, key=lambda b: -b[2])[:beam]
        path, lqs, _ = beams[0]
        assert tokens == path, (context, tokens, path)
        assert logq == pytest.approx(lqs, abs=1e-4)


def mjsd_pad(logits, vocab):
    v = logits.shape[-1]
    return logits[..., :vocab] if v >= vocab else torch.nn.functional.pad(logits, (0, vocab - v), value=float("-inf"))


def test_mjsd_rejects_penalties_and_is_never_the_default(models):
    from engine.config import EngineConfig
    target, _, other = models
    with pytest.raises(ValueError, match="penalties"):
        run_engine(target, other, PROMPTS[:1], tree=(1,), spec=SpecOptions(method="mjsd-lossy"),
                   presence_penalty=0.5)
    with pytest.raises(ValueError, match="mjsd_tau"):
        EngineConfig.from_settings(mjsd_tau=0.0)
    outs, _ = run_engine(target, other, PROMPTS[:1], tree=(1,), max_tokens=4)
    assert outs[0].spec.note is None


def test_maxgram_length_follows_load_and_acceptance():
    from engine.speculative.cost_model import CostCurve
    from engine.speculative.maxgram import LengthChooser
    flat = CostCurve((1.0, 100.0), (1.0, 1.01))  # verification rows are nearly free
    steep = CostCurve((1.0, 100.0), (1.0, 100.0))  # every row costs as much as a token of plain decoding
    long_matches = lambda n: [0, 0, 0, n]  # noqa: E731  (sequences per match class)
    assert LengthChooser(flat, 8).choose(long_matches(1), 0)[3] == 8
    busy = LengthChooser(steep, 8, probe_every=3)
    assert busy.choose(long_matches(8), 0)[3] == 0  # acceptance < 1 per row: plain decoding pays best
    assert busy.choose(long_matches(8), 0)[3] == 0 and busy.choose(long_matches(8), 0)[3] == 8  # ... probes
    mid = CostCurve((1.0, 16.0, 100.0), (1.0, 1.2, 20.0))  # rows nearly free up to 16, then costly
    good = LengthChooser(mid, 8)
    for _ in range(400):
        good.observe(3, 8, 8)  # everything accepted
    assert good.choose(long_matches(1), 0)[3] == 8  # one sequence: 9 rows still fit the cheap part
    assert good.choose(long_matches(8), 0)[3] == 1  # eight: 16 rows is the sweet spot
    poor = LengthChooser(mid, 8)
    for _ in range(400):
        poor.observe(3, 8, 0)  # nothing accepted: even cheap rows are not worth it
    assert poor.choose(long_matches(1), 0)[3] == 0


def test_maxgram_length_is_chosen_per_match_class():
    """Bigram guesses that are never accepted lose their rows under load; long matches keep theirs."""
    from engine.speculative.cost_model import CostCurve
    from engine.speculative.maxgram import LengthChooser
    mid = CostCurve((1.0, 24.0, 100.0), (1.0, 1.3, 20.0))
    chooser = LengthChooser(mid, 8)
    for _ in range(400):
        chooser.observe(0, 2, 0)  # bigram: proposes 2, never accepted
        chooser.observe(3, 8, 6)  # long match: 6 of 8 accepted
    caps = chooser.choose([4, 0, 0, 4], 0)
    assert caps[0] == 0 and caps[3] >= 4, caps


def test_maxgram_length_learns_nothing_beyond_its_cap():
    """A proposal cut by its cap says nothing about the tokens after the cap: a class capped to 1 token
    under load keeps its prior beyond it, so its cap can grow again when the load drops."""
    from engine.speculative.cost_model import CostCurve
    from engine.speculative.maxgram import LengthChooser
    chooser = LengthChooser(CostCurve((1.0, 100.0), (1.0, 100.0)), 8)
    for _ in range(400):
        chooser.observe(3, 1, 1, cap=1)  # proposed 1 (its cap), accepted
        chooser.observe(1, 2, 1)  # a match of 1 that ends after 2 tokens, the second rejected
    rows, tokens = chooser.expected()
    assert rows[3][1] > 0.99 and tokens[3][1] > 0.98  # seen: always there, always accepted
    assert 0.85 < rows[3][2] - rows[3][1] < 0.95  # unseen: the prior continuation rate (0.9)
    assert rows[1][3] - rows[1][2] < 0.02  # seen to end at 2 tokens
    assert tokens[1][2] - tokens[1][1] < 0.02  # and the second token rejected
    chooser.curve = CostCurve((1.0, 16.0, 100.0), (1.0, 1.2, 20.0))  # the load dropped
    assert chooser.choose([0, 0, 0, 1], 0)[3] == 8


# ---------------------------------------------------------------------------- target-initialised (lossy)
def test_target_init_with_one_candidate_is_greedy_and_the_mode_is_labelled(models):
    """With k = 1 the candidate is the target's argmax, so greedy output equals plain decoding: this checks
    the mode's cache bookkeeping (the last emitted token stays uncached, the first step only draws)."""
    target, self_draft, other_draft = models
    base = run_engine(target, None, PROMPTS, tree=(), ignore_eos=True, max_tokens=24)[0]
    for draft in (self_draft, other_draft):
        for k in (1, 3):
            outs, core = run_engine(target, draft, PROMPTS, tree=(1,), ignore_eos=True, max_tokens=24,
                                    spec=SpecOptions(method="target-init-lossy"),
                                    config=dict(target_init_k=k, target_init_depth=3, load_aware=False))
            assert all(len(o.tokens) == 24 and o.spec.note.startswith("lossy") for o in outs)
            assert core.cache.free_slots == core.cache.num_slots
            if k == 1 or draft is self_draft:  # a perfect draft never prefers a worse candidate
                assert [o.tokens for o in outs] == [o.tokens for o in base]


@pytest.mark.parametrize("method", ["target-init-lossy", "mcsd", "mcsd+maxgram"])
def test_a_tiny_repetition_penalty_is_served(models, method):
    """A repetition penalty of 1e-196 (valid: > 0) puts the seen tokens' positive logits at +inf.  Its
    probabilities were NaN, so the target-initialised mode drew no candidate, emitted nothing, and its
    next step's draft catch-up had no token to read (an engine error found by schemathesis).  Every
    request now runs to its length, sampled, and frees its slots."""
    target, _, other_draft = models
    outs, core = run_engine(target, other_draft, PROMPTS, tree=(2, 1), ignore_eos=True, max_tokens=12,
                            temperature=1.0, seed=3, repetition_penalty=1e-196,
                            spec=SpecOptions(method=method), config=dict(load_aware=False))
    assert all(len(o.tokens) == 12 for o in outs)
    assert core.cache.free_slots == core.cache.num_slots


@pytest.mark.parametrize("method", ["mcsd", "mcsd+maxgram", "cascade"])
def test_lazy_draft_cache_tracks_the_sequence_under_continuous_batching(models, method):
    """Draft prefill is lazy and its catch-up chunked: after every step, every running sequence's
    draft cache holds exactly ``draft_cached`` committed entries and nothing pending, while requests
    of mixed lengths (several longer than the chunk) join and leave."""
    import random
    from engine.config import EngineConfig
    from engine.core import EngineCore
    target, _, other = models
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 100) for _ in range(rng.randrange(3, 70))] for _ in range(10)]
    core = EngineCore(target, other, EngineConfig(max_batch=3, tree=(2, 2), prefill_chunk=16, load_aware=False,
                                                  max_model_len=max(map(len, prompts)) + 30))
    for i, p in enumerate(prompts):
        core.add_request(GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.8, max_tokens=30, seed=i),
                                           SpecOptions(method=method)))
    cache = core.runner.proposer.cache
    while core.has_unfinished():
        core.step()
        for s in core.scheduler.running:
            if s.draft_slot is not None:
                assert int(cache.pending[s.draft_slot]) == 0
                assert int(cache.lens[s.draft_slot]) == s.draft_cached <= len(s.tokens)
    assert cache.free_slots == cache.num_slots


def test_batched_cascade_review_matches_the_walk_on_the_same_numbers():
    """``review_batch`` (every chain of a round at once, one read) against ``review_guess`` driven by
    the same uniforms: identical kept prefixes and tokens, greedy and sampled, with and without room."""
    from engine.speculative.cascade import ReviewCoins, review_batch, review_guess

    gen = torch.Generator().manual_seed(11)
    for trial in range(40):
        chains = []
        for _ in range(5):
            n = int(torch.randint(0, 5, (), generator=gen))
            probs = torch.rand(n + 1, 7, generator=gen) ** 3
            probs[torch.rand(n + 1, 7, generator=gen) < 0.3] = 0.0
            probs[:, 0] += 1e-3
            probs = probs / probs.sum(-1, keepdim=True)
            guess = torch.randint(0, 7, (n,), generator=gen).tolist()
            greedy = bool(torch.rand((), generator=gen) < 0.3)
            u = None if greedy else torch.rand(n + 1, generator=gen)
            chains.append((probs, guess, int(torch.randint(1, 6, (), generator=gen)), greedy, u))
        got = review_batch(*map(list, zip(*chains)))
        for (probs, guess, room, greedy, u), result in zip(chains, got):
            want = review_guess(probs, guess, room, greedy, None if greedy else ReviewCoins(u))
            assert result == want, (trial, guess, room, greedy)


def test_maxgram_length_chooser_prices_sequences_without_a_match_as_one_row(models, monkeypatch):
    """A sequence whose context has no suffix match proposes nothing from the root, so it adds one
    verification row (its root) to the batch the chooser prices, not its share's whole length: priced
    at 1 + 8 rows, four unmatched sequences made a busy batch look large, and on a curve flat there
    the matched ones were given long proposals as if free."""
    from engine.speculative import maxgram
    target, _, _ = models
    seen: list[tuple[int, int, int, float]] = []  # (sequences, with a match, rows and tokens priced for the rest)
    real = maxgram.LengthChooser.choose

    def choose(self, counts, other_rows, other_tokens=None):
        seen.append((n_seqs[0], sum(counts), other_rows, other_tokens))
        return real(self, counts, other_rows, other_tokens)

    monkeypatch.setattr(maxgram.LengthChooser, "choose", choose)
    from engine.speculative import planner as planner_mod
    n_seqs = [0]
    original = planner_mod.Planner.plan

    def plan(self, seqs):
        n_seqs[0] = len(seqs)
        return original(self, seqs)

    monkeypatch.setattr(planner_mod.Planner, "plan", plan)
    repeating = [5, 6, 7, 8, 9] * 6  # suffix matches from the start
    distinct = [list(range(10 + 20 * i, 30 + 20 * i)) for i in range(3)]  # no match at first
    outs, _ = run_engine(target, None, [repeating] + distinct, tree=(), max_tokens=8, ignore_eos=True,
                         spec=SpecOptions(method="maxgram"), config=dict(load_aware=True, maxgram_len=8))
    assert seen and any(n > matched for n, matched, _, _ in seen)  # some steps had unmatched sequences
    for n, matched, others, tokens in seen:
        assert others == n - matched  # one root row each, nothing for a share that cannot propose
        assert tokens == n - matched  # and the root's token: no draft tree, so nothing more
    base, _ = run_engine(target, None, [repeating] + distinct, tree=(), max_tokens=8, ignore_eos=True)
    assert [o.tokens for o in outs] == [o.tokens for o in base]


def test_max_gram_rows_beside_the_draft_stay_while_their_measured_rate_pays_a_row():
    """In plans where the draft model drafts too, Max-Gram's root branches and tail stay while the rate
    measured for such rows (``MixedRows``, per mode) beats what a verification row costs in tokens at the
    step's chosen seconds per token; below it they go, and the evidence fades so that they come back."""
    from types import SimpleNamespace

    from engine.config import EngineConfig
    from engine.speculative.cost_model import CostCurve, LiveCurve
    from engine.speculative.maxgram import LengthChooser, MaxGramDrafter, MaxGramShare
    from engine.speculative.methods import DraftPlan
    from engine.speculative.planner import Planner
    from engine.speculative.tree import TreeTopology

    topo = TreeTopology((2, 1))
    curve = LiveCurve(CostCurve((1.0, 8.0), (0.050, 0.120)))  # 10 ms a row
    policy = SimpleNamespace(chooser=SimpleNamespace(per_token=0.040))  # a row costs 0.25 tokens
    planner = Planner(EngineConfig.from_settings(tree=(2, 1)), topo, MaxGramDrafter(), policy,
                      LengthChooser(curve, 8))
    seq = SimpleNamespace(request=SimpleNamespace(sampling=SimpleNamespace(greedy=False)))
    mg = MaxGramShare(length=4, branches=1, tail=2)
    mixed = DraftPlan("mcsd+maxgram", topo.subtree((2, 1)), {"maxgram": mg})
    alone = DraftPlan("mcsd+maxgram", topo.subtree(()), {"maxgram": mg})

    def rows_kept() -> tuple[int, int]:
        out = planner._price_mixed_rows([seq, seq], [mixed, alone])
        return out[0].share("maxgram").rows, out[1].share("maxgram").rows

    assert rows_kept() == (6, 6)  # the prior (0.3) pays a row at 0.25 tokens
    planner.mixed.observe(False, 100, 10)  # 10% accepted beside the draft
    assert rows_kept() == (0, 6)  # the draft's plan loses them; Max-Gram alone is the length chooser's
    planner.mixed.observe(True, 100, 60)  # greedy rows are a mode of their own
    seq.request.sampling.greedy = True
    assert rows_kept() == (6, 6)
    seq.request.sampling.greedy = False
    for _ in range(400):  # plans keep coming; the low rate measured long ago fades back to the prior
        planner._price_mixed_rows([seq], [mixed])
    assert rows_kept() == (6, 6)
    policy.chooser.per_token = float("inf")  # a budget of plain decoding: nothing to price
    planner.mixed.observe(False, 1000, 0)
    assert rows_kept() == (6, 6)
