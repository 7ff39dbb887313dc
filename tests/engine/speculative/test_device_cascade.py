"""The vertical cascade on the device (``engine.speculative.device_cascade``, ``maxgram_read_tree =
false``): its review is the host's ``review_guess`` on the same numbers, every chain token carries the
draft's law after the chain above it (positions and masks set on the device), and the step reads the
host once."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import GenerationRequest, SamplingParams, SpecOptions
from engine.sampler import SamplingTensors, compute_probs, token_count_matrix
from engine.speculative.cascade import ReviewCoins, review_guess
from engine.speculative.device_cascade import DeviceCascade, RoundCounts, review
from engine.speculative.draft_tree import DEAD
from tests.toy import random_table

VOCAB = 7


def random_probs(n: int, gen: torch.Generator) -> torch.Tensor:
    probs = torch.rand(n, VOCAB, generator=gen) ** 3
    probs[torch.rand(n, VOCAB, generator=gen) < 0.3] = 0.0
    probs[:, 0] += 1e-3
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("seed", range(6))
def test_the_device_review_is_the_hosts_on_the_same_numbers(seed: int) -> None:
    """Batches of guesses of every length (DEAD after their end), rooms from 1 to past the guess,
    greedy and sampled rows mixed: the kept prefix and the token drawn after it are
    ``review_guess``'s with :class:`ReviewCoins` over the same uniforms.  No room: nothing kept."""
    gen = torch.Generator().manual_seed(seed)
    L, S = 4, 16
    for _ in range(10):
        probs = torch.stack([random_probs(L + 1, gen) for _ in range(S)])
        lengths = torch.randint(0, L + 1, (S,), generator=gen)
        guess = torch.randint(0, VOCAB, (S, L), generator=gen)
        guess[torch.arange(L)[None] >= lengths[:, None]] = DEAD
        room = torch.randint(1, L + 3, (S,), generator=gen)
        greedy = torch.rand(S, generator=gen) < 0.3
        u = torch.rand(S, L + 1, generator=gen)
        kept, y = review(probs, guess, room, greedy, u)
        for s in range(S):
            g = guess[s, : int(lengths[s])].tolist()
            want_kept, want = review_guess(probs[s, : len(g) + 1], g, int(room[s]), bool(greedy[s]),
                                           ReviewCoins(torch.cat([u[s, : len(g)], u[s, L:]])))
            assert int(kept[s]) == want_kept
            assert g[: want_kept] + ([int(y[s])] if want_kept < int(room[s]) else []) == want
    kept, _ = review(probs, guess, torch.zeros(S, dtype=torch.long), greedy, u)
    assert not kept.any()


def test_the_rounds_follow_what_the_last_chains_needed() -> None:
    class Seq:
        pass
    a, b = Seq(), Seq()
    counts = RoundCounts()
    assert counts.rounds([a, b], [4, 3]) == 4  # not seen: their depth
    counts.observe(a, 1)
    counts.observe(b, 2)
    assert counts.rounds([a, b], [4, 3]) == 2
    assert counts.rounds([a], [4]) == 1
    counts.observe(a, 9)  # a chain left short asks for more rounds than its depth: capped there
    assert counts.rounds([a], [4]) == 4


def greedy_continuation(model, start: list[int], n: int) -> list[int]:
    ids = list(start)
    for _ in range(n):
        cache = model.model.new_cache(1, len(ids) + 4, 4)
        ids.append(int(model.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, [0]).logits[0, -1].argmax()))
    return ids


def fresh_laws(draft, seq_tokens: list[int], chain: list[int], params: SamplingParams, output: list[int]):
    """The draft's processed law after ``seq_tokens + chain[:k]`` for every k, from one causal forward
    over the whole context in a cache of its own (no pending entries, no shifts, no masks)."""
    ids = seq_tokens + chain
    cache = draft.model.new_cache(1, len(ids) + 8, 4)
    out = draft.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, [0])
    raw = out.logits[0, len(seq_tokens) - 1:].float()  # [len(chain) + 1, vocab]
    st = SamplingTensors.from_params([params] * raw.shape[0], raw.shape[1])
    counts = prompt = None
    if params.needs_history:
        counts = token_count_matrix([output + chain[:k] for k in range(raw.shape[0])], raw.shape[1])
        prompt = token_count_matrix([seq_tokens[: len(seq_tokens) - len(output)]] * raw.shape[0], raw.shape[1]) > 0
    return compute_probs(raw, st, counts, prompt)


def toy_pair():
    """Table-driven models (``tests/toy.py``) with one peaked table, the target drafting for itself:
    the text follows the draft's likeliest continuations, so Max-Gram guesses them and the draft keeps
    them.  A wrong position, mask or cache entry scrambles the toy's table."""
    from tests.lossless import loaded_table
    model = loaded_table(random_table(12, 1, concentration=0.05), max_len=128)
    return model, model


@pytest.mark.parametrize("models", ["tiny", "toy"])
@pytest.mark.parametrize("penalties", [False, True], ids=["plain", "penalties"])
def test_every_chain_token_has_the_drafts_law_after_the_chain_above_it(tiny_pair, monkeypatch, penalties, models):
    """Sampled requests of different lengths, several steps: each chain token's law is the draft's
    processed law after the sequence and the chain above it, computed afresh; the tail after the
    chain is one-hot.  So the rounds' positions, masks and draft-cache entries (committed after each
    step, read by the next step's catch-up) are right.  The first step runs every round and fills each
    chain to its depth.  The tiny Llama pair's laws are flat (its draft keeps few guesses); the toy
    draft's are peaked and its prompts its own continuations, so Max-Gram guesses what it would say
    and most rounds keep several tokens."""
    target, draft = tiny_pair if models == "tiny" else toy_pair()
    depth, tail = 5, 2
    config = EngineConfig.from_settings(max_batch=4, max_model_len=64, tree=(1,), spec_method="cascade",
                                        cascade_depth=depth, maxgram_len=3, maxgram_tail=tail,
                                        maxgram_read_tree=False, load_aware=False)
    core = EngineCore(target, draft, config)
    seen = []
    original = DeviceCascade.propose

    def spy(self, seqs, depths, tails, empties):
        trees = original(self, seqs, depths, tails, empties)
        seen.append([(list(s.tokens), s.num_output, s.request.sampling, t) for s, t in zip(seqs, trees)])
        return trees
    monkeypatch.setattr(DeviceCascade, "propose", spy)
    extra = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3) if penalties else {}
    starts = ([5, 6, 7], [9, 10], [3, 4, 5]) if models == "tiny" else ([2, 3], [7], [4, 1, 9])
    prompts = [greedy_continuation(draft, start, 8 if models == "tiny" else 24) for start in starts]
    for i, p in enumerate(prompts):
        core.add_request(GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0.8, seed=i, **extra),
                                           SpecOptions()))
    while core.has_unfinished():
        core.step()
    assert len(seen) >= 3
    kept = 0  # chain tokens past the first that ran through the draft: guesses it kept
    for step, chains in enumerate(seen):
        for tokens, num_output, params, tree in chains:
            nodes = tree.tokens
            live = [t for t in nodes if t != DEAD]
            assert nodes[: len(live)] == live  # a chain: DEAD only after its end
            fresh = fresh_laws(draft, tokens, live, params, tokens[len(tokens) - num_output:])
            chain = 0
            while chain < len(live) and torch.allclose(tree.q[chain], fresh[chain], atol=1e-5):
                chain += 1
            for k in range(chain, len(live)):  # the tail: one-hot proposals
                assert tree.q[k][live[k]] == 1.0 and tree.q[k].sum() == 1.0, (step, k)
            assert len(live) - chain <= tail
            assert chain >= 1 and all(tree.q[k][live[k]] > 0 for k in range(chain))
            if step == 0:
                assert chain == depth  # every round ran: the chains are whole
            kept += sum(e >= 0 for e in tree.draft_index[1:chain])
    if models == "toy":
        assert kept >= 20


def test_greedy_output_is_plain_decodings(tiny_pair):
    """The device cascade (and the target as its own draft, which keeps most guesses) writes what plain
    decoding writes, token for token, four requests together."""
    target, draft = tiny_pair
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9], [3, 4, 5, 3, 4], [1, 2, 3, 4, 5, 6]]

    def run(draft_model, method):
        config = EngineConfig.from_settings(max_batch=4, max_model_len=96, tree=(1,), spec_method="cascade",
                                            cascade_depth=4, maxgram_len=4, maxgram_tail=2,
                                            maxgram_read_tree=False, load_aware=False)
        core = EngineCore(target, draft_model, config)
        for i, p in enumerate(prompts):
            core.add_request(GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=24, temperature=0.0),
                                               SpecOptions(enabled=method != "plain")))
        outs: dict[str, list[int]] = {}
        while core.has_unfinished():
            for o in core.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        stats = core.drain_step_stats()
        return outs, sum(s.drafted_tokens for s in stats), sum(s.accepted_tokens for s in stats)

    plain, _, _ = run(draft, "plain")
    for d in (draft, target):
        outs, drafted, accepted = run(d, "cascade")
        assert outs == plain
        assert drafted > 0
    assert accepted > 0  # with the target drafting, guesses were kept
