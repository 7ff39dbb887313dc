"""Prefix reuse (engine.prefix_cache): the slot bookkeeping, and the engine's output with the cache
on equal to the output with it off, token for token, for chat turns and shared prompts."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache import CacheFullError, KVCache
from engine.prefix_cache import PrefixCache, common_prefix
from engine.request import GenerationRequest, SamplingParams, SpecOptions


# ------------------------------------------------------------------------------------------- slots
def small_cache(slots: int = 3) -> KVCache:
    return KVCache(num_layers=2, num_slots=slots, max_len=32, num_kv_heads=1, head_dim=2)


def test_common_prefix():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(5))]
        expect = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == expect == common_prefix(b, a)


def test_a_released_slot_serves_the_longest_prefix_and_never_the_last_prompt_token():
    cache = small_cache()
    pc = PrefixCache(cache, min_match=1)
    first = pc.acquire([1, 2, 3, 4])
    assert (first.cached, first.copied) == (0, False)
    cache.lens[first.slot] = 4  # as if it ran 4 tokens
    pc.release(first.slot, [1, 2, 3, 4])
    assert pc.held_tokens == 4
    again = pc.acquire([1, 2, 3, 4, 5, 6])
    assert (again.slot, again.cached) == (first.slot, 4) and int(cache.lens[again.slot]) == 4
    pc.release(again.slot, [1, 2, 3, 4])
    same = pc.acquire([1, 2, 3, 4])  # the whole prompt is cached: its last token still runs
    assert (same.slot, same.cached) == (first.slot, 3)
    pc.release(same.slot, [1, 2, 3, 4])
    other = pc.acquire([9, 9])  # no match: an empty slot, not the one holding a prefix
    assert other.slot != first.slot and other.cached == 0


def test_only_prefixes_of_min_match_tokens_are_reused():
    cache = small_cache()
    pc = PrefixCache(cache, min_match=16)
    held = list(range(20))
    s = pc.acquire(held)
    pc.release(s.slot, held)
    few = pc.acquire(list(range(10)) + [99] * 10)  # 10 shared tokens: below the minimum
    assert few.cached == 0 and few.slot != s.slot
    many = pc.acquire(list(range(18)) + [99])
    assert (many.slot, many.cached) == (s.slot, 18)
    short = pc.acquire(list(range(12)))  # a prompt shorter than the minimum is never looked up
    assert short.cached == 0 and pc.key(list(range(12))) is None


def test_eviction_is_least_recently_released_first():
    cache = small_cache(2)
    pc = PrefixCache(cache, min_match=1)
    a, b = pc.acquire([1, 1]), pc.acquire([2, 2])
    pc.release(a.slot, [1, 1, 1])
    pc.release(b.slot, [2, 2, 2])
    c = pc.acquire([3, 3])  # both hold something: the older goes
    assert c.slot == a.slot and c.cached == 0
    assert pc.acquire([2, 2, 2, 5]).slot == b.slot  # the newer one still serves its prefix
    with pytest.raises(CacheFullError):
        pc.acquire([4])


def test_a_running_sequences_prefix_is_copied():
    cache = small_cache()
    pc = PrefixCache(cache, min_match=1)
    src = pc.acquire([1, 2, 3, 4, 5])
    cache.k[:, src.slot, :5] = torch.arange(5.0)[None, :, None, None]
    cache.v[:, src.slot, :5] = -torch.arange(5.0)[None, :, None, None]
    cache.lens[src.slot] = 5
    got = pc.acquire([1, 2, 3, 9, 9], live=[(src.slot, [1, 2, 3, 4, 5])])
    assert got.copied and got.cached == 3 and got.slot != src.slot
    assert torch.equal(cache.k[:, got.slot, :3], cache.k[:, src.slot, :3])
    assert torch.equal(cache.v[:, got.slot, :3], cache.v[:, src.slot, :3])
    assert int(cache.lens[got.slot]) == 3


def test_a_held_slot_taken_by_someone_else_is_never_handed_out():
    cache = small_cache(2)
    pc = PrefixCache(cache, min_match=1)
    a, b = pc.acquire([1, 1]), pc.acquire([2, 2])
    pc.release(a.slot, [1, 1, 1])
    pc.release(b.slot, [2, 2, 2])
    taken = cache.allocate(a.slot)  # the least recently released slot, allocated behind the cache's back
    got = pc.acquire([3, 3])
    assert got.slot == b.slot and got.slot != taken


def test_a_slot_allocated_behind_the_caches_back_is_forgotten_and_disabled_reuses_nothing():
    cache = small_cache(1)
    pc = PrefixCache(cache, min_match=1)
    s = pc.acquire([1, 2])
    pc.release(s.slot, [1, 2, 3])
    cache.free(cache.allocate())  # e.g. a cost measurement wrote into it
    assert pc.acquire([1, 2, 3, 4]).cached == 0
    off = PrefixCache(small_cache(1), enabled=False, min_match=1)
    s = off.acquire([1, 2])
    off.release(s.slot, [1, 2, 3])
    assert off.acquire([1, 2, 3, 4]).cached == 0 and off.held_tokens == 0


# ------------------------------------------------------------------------------------------ engine
def make_core(pair, prefix_cache: bool, **config) -> EngineCore:
    target, draft = pair
    return EngineCore(target, draft, EngineConfig(max_batch=4, max_model_len=256, tree=(2, 2), load_aware=False,
                                                  prefix_cache=prefix_cache, **config))


def drive(core: EngineCore, requests: list[GenerationRequest], add_at: list[int]) -> dict[str, tuple[list[int], int]]:
    """Adds ``requests[i]`` at step ``add_at[i]``, steps to the end; request id -> (tokens, cached)."""
    out = {r.request_id: ([], 0) for r in requests}
    step = 0
    while step <= max(add_at) or core.has_unfinished():
        for r, at in zip(requests, add_at):
            if at == step:
                core.add_request(r)
        for o in core.step():
            tokens, _ = out[o.request_id]
            out[o.request_id] = (tokens + o.new_token_ids, o.cached_tokens)
        step += 1
    return out


def request(rid: str, prompt: list[int], method: str, temperature: float, max_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(temperature=temperature, seed=7, max_tokens=max_tokens,
                                                         ignore_eos=True), SpecOptions(method=method))


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["mcsd", "maxgram", "cascade"])
def test_chat_turns_reuse_the_conversation_and_answer_as_without_the_cache(tiny_pair, method, temperature):
    """Three turns, each prompt = the previous prompt + its answer + a new message: with the cache
    each turn prefills only its new message (and the previous answer's last token), and every answer
    is the same as without the cache."""
    rng = random.Random(3)
    first = [rng.randrange(2, 100) for _ in range(20)]
    messages = [[rng.randrange(2, 100) for _ in range(6)] for _ in range(2)]
    results = {}
    for on in (True, False):
        core = make_core(tiny_pair, on)
        prompt, turns = first, []
        for turn in range(3):
            got = drive(core, [request(f"t{turn}", prompt, method, temperature)], [0])[f"t{turn}"]
            turns.append(got)
            if turn < 2:
                prompt = prompt + got[0] + messages[turn]
        results[on] = turns
    assert [t for t, _ in results[True]] == [t for t, _ in results[False]]
    assert [c for _, c in results[False]] == [0, 0, 0]
    cached = [c for _, c in results[True]]
    assert cached[0] == 0 and cached[1] >= 20 + 12 - 1 and cached[2] >= cached[1] + 12 + 6


def test_a_shared_prompt_is_copied_from_a_running_sequence(tiny_pair):
    """Requests joining while one with the same long prefix runs copy its entries; the output is
    that of the cache-off engine."""
    rng = random.Random(1)
    system = [rng.randrange(2, 100) for _ in range(40)]
    prompts = [system + [rng.randrange(2, 100) for _ in range(4)] for _ in range(3)]
    runs, cores = {}, {}
    for on in (True, False):
        cores[on] = make_core(tiny_pair, on)
        reqs = [request(f"a{i}", p, "mcsd", 0.0, max_tokens=16) for i, p in enumerate(prompts)]
        runs[on] = drive(cores[on], reqs, [0, 1, 2])
    assert {k: t for k, (t, _) in runs[True].items()} == {k: t for k, (t, _) in runs[False].items()}
    assert [runs[True][f"a{i}"][1] for i in range(3)] == [0, 40, 40]
    for on, hits in ((True, 80), (False, 0)):
        stats = cores[on].drain_step_stats()
        assert sum(s.prefix_queried_tokens for s in stats) == 3 * 44
        assert sum(s.prefix_hit_tokens for s in stats) == hits


def test_requests_arriving_together_prefill_their_shared_prompt_once(tiny_pair):
    """Three requests with one 40-token system prompt, added in the same step: the first prefills
    it, the others wait until it is cached and copy it.  Same outputs as without the cache, and
    80 fewer prompt tokens prefilled."""
    rng = random.Random(2)
    system = [rng.randrange(2, 100) for _ in range(40)]
    prompts = [system + [rng.randrange(2, 100) for _ in range(4)] for _ in range(3)]
    runs, prefilled = {}, {}
    for on in (True, False):
        core = make_core(tiny_pair, on)
        runs[on] = drive(core, [request(f"b{i}", p, "mcsd", 0.0, max_tokens=16) for i, p in enumerate(prompts)],
                         [0, 0, 0])
        prefilled[on] = sum(s.prefill_tokens for s in core.drain_step_stats())
    assert {k: t for k, (t, _) in runs[True].items()} == {k: t for k, (t, _) in runs[False].items()}
    assert [runs[True][f"b{i}"][1] for i in range(3)] == [0, 40, 40]
    assert prefilled[False] - prefilled[True] == 80
