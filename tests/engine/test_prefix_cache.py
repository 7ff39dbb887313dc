"""The paged KV cache and prefix caching (engine.kv_cache, engine.prefix_cache): blocks, sharing,
eviction, preemption; and the engine's output with the cache on, with pages of several sizes and
with a pool too small for the batch, equal to the output with it off, token for token."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache import CacheFullError, KVCache
from engine.prefix_cache import PrefixCache, block_key, common_prefix, ROOT
from engine.request import GenerationRequest, SamplingParams, SpecOptions


# ------------------------------------------------------------------------------------------ blocks
def small_cache(slots: int = 3, blocks: int = 12, block_size: int = 4, max_len: int = 32) -> KVCache:
    return KVCache(num_layers=2, num_slots=slots, max_len=max_len, num_kv_heads=1, head_dim=2,
                   block_size=block_size, num_blocks=blocks)


def fill(cache: KVCache, slot: int, n: int, first: float = 0.0) -> None:
    """Appends ``n`` pending entries whose keys are ``first, first + 1, ...`` (values the negatives)."""
    start = int(cache.lens[slot] + cache.pending[slot])
    cache.reserve([slot], [n])
    rows = cache._rows(slot, torch.arange(start, start + n))
    vals = torch.arange(first, first + n, dtype=torch.float32)[None, :, None, None]
    cache.k[:, rows], cache.v[:, rows] = vals, -vals
    cache.advance([slot], [n])


def keys(cache: KVCache, slot: int) -> list[float]:
    """The committed keys of a slot, in position order (layer 0)."""
    n = int(cache.lens[slot])
    return cache.k[0, cache._rows(slot, torch.arange(n)), 0, 0].tolist()


def test_common_prefix():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(5))]
        expect = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == expect == common_prefix(b, a)


def test_blocks_follow_the_live_tokens_and_all_come_back():
    cache = small_cache()
    a, b = cache.allocate(), cache.allocate()
    fill(cache, a, 5)
    cache.commit(a)
    assert cache.tables[a] and len(cache.tables[a]) == 2 and cache.used_blocks == 2
    fill(cache, b, 3)
    assert cache.used_blocks == 3
    cache.discard(b)  # rolled back: its block is returned at once
    assert cache.tables[b] == [] and cache.used_blocks == 2
    fill(cache, a, 7, first=5)  # entries 5..11 pending: 3 blocks in all
    cache.commit(a)
    assert keys(cache, a) == list(range(12)) and len(cache.tables[a]) == 3
    cache.free(a)
    cache.free(b)
    assert cache.used_blocks == 0 and cache.free_blocks == cache.num_blocks == 12 and cache.free_slots == 3


def test_rewind_drops_committed_entries_past_a_length_and_returns_their_blocks():
    """What a failed step committed (a draft catch-up) is rolled back to the fill before the step."""
    cache = small_cache()
    s = cache.allocate()
    fill(cache, s, 5)
    cache.commit(s)
    fill(cache, s, 6, first=5)  # a catch-up: entries 5..10, committed, then a pending level
    cache.commit(s)
    fill(cache, s, 2, first=50)
    assert len(cache.tables[s]) == 4 and int(cache.pending[s]) == 2
    cache.rewind(s, 5)
    assert keys(cache, s) == [0, 1, 2, 3, 4] and int(cache.pending[s]) == 0
    assert len(cache.tables[s]) == 2 and cache.used_blocks == 2
    cache.rewind(s, 9)  # never past what is committed
    assert keys(cache, s) == [0, 1, 2, 3, 4]
    fill(cache, s, 3, first=5)  # the step's work, redone
    cache.commit(s)
    assert keys(cache, s) == list(range(8))


def test_keep_compacts_the_accepted_entries_across_block_boundaries_and_returns_the_rest():
    cache = small_cache()
    s = cache.allocate()
    fill(cache, s, 3)
    cache.commit(s)
    fill(cache, s, 9, first=100)  # pending 100..108 at positions 3..11, over blocks 0-2
    assert len(cache.tables[s]) == 3
    cache.keep(s, [1, 2, 6])  # 101, 102, 106 move to positions 3, 4, 5
    assert keys(cache, s) == [0, 1, 2, 101, 102, 106] and int(cache.pending[s]) == 0
    assert len(cache.tables[s]) == 2 and cache.used_blocks == 2  # the third block came back
    with pytest.raises(IndexError):
        fill(cache, s, 2)
        cache.keep(s, [2])


def test_keeping_several_slots_at_once_moves_them_all_in_one_copy(monkeypatch):
    """``keep_many``: every slot's kept entries as ``keep`` would leave them (moved across block
    boundaries, a prefix that moves nothing, nothing kept), with one copy of row indices to the device
    for all of them; a slot whose indices are out of range gets its error and is left as it was."""
    import engine.kv_cache as kv

    def setup():
        cache = small_cache(slots=4, blocks=16)
        slots = [cache.allocate() for _ in range(4)]
        for i, s in enumerate(slots):
            fill(cache, s, 3, first=10 * i)
            cache.commit(s)
            fill(cache, s, 6, first=100 + 10 * i)
        return cache, slots

    keeps = [[1, 2, 5], [0, 1], [], [4, 9]]  # moved, a prefix, nothing, out of range
    one, slots = setup()
    for s, idx in zip(slots[:3], keeps):
        one.keep(s, idx)
    with pytest.raises(IndexError):
        one.keep(slots[3], keeps[3])
    many, slots = setup()
    copies = []
    real = kv.to_device_many
    monkeypatch.setattr(kv, "to_device_many", lambda ts, dev: copies.append(len(ts)) or real(ts, dev))
    errors = many.keep_many(list(zip(slots, keeps)))
    assert [e is None for e in errors] == [True, True, True, False] and isinstance(errors[3], IndexError)
    assert copies == [2]  # the source and destination rows of every slot, together
    for s in slots:
        assert keys(many, s) == keys(one, s)
        assert int(many.pending[s]) == int(one.pending[s]) and many.tables[s] == one.tables[s]
    assert keys(many, slots[0]) == [0, 1, 2, 101, 102, 105] and keys(many, slots[1]) == [10, 11, 12, 110, 111]
    assert int(many.pending[slots[3]]) == 6  # left as it was


def test_the_pool_and_the_sequence_length_are_bounded():
    cache = small_cache(slots=2, blocks=8, max_len=32)
    a = cache.allocate()
    with pytest.raises(CacheFullError, match="per sequence"):
        cache.reserve([a], [33])
    fill(cache, a, 32)
    b = cache.allocate()
    with pytest.raises(CacheFullError, match="pool is full"):
        fill(cache, b, 1)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        small_cache(blocks=7, max_len=32)


def test_published_blocks_are_shared_then_kept_until_evicted_least_recently_freed_first():
    cache = small_cache(slots=3, blocks=6, max_len=24)
    a = cache.allocate()
    fill(cache, a, 8)
    cache.commit(a)
    k0, k1 = block_key(ROOT, [1, 2, 3, 4]), block_key(block_key(ROOT, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert cache.publish(a, 0, k0) and cache.publish(a, 1, k1)
    assert not cache.publish(a, 1, b"other")  # already published
    b = cache.allocate()
    cache.share(b, [cache.lookup(k0), cache.lookup(k1)])
    assert cache.tables[b] == cache.tables[a] and int(cache.lens[b]) == 8 and cache.used_blocks == 2
    assert keys(cache, b) == list(range(8))
    cache.free(a)
    assert cache.used_blocks == 2  # b still uses them
    cache.free(b)
    assert cache.used_blocks == 0 and cache.cached_blocks == 2 and cache.free_blocks == 6
    c = cache.allocate()
    fill(cache, c, 16)  # the 4 unused blocks first
    assert cache.evictions == 0 and cache.lookup(k1) is not None
    fill(cache, c, 4)  # then the tail block (freed first) is evicted first
    assert cache.lookup(k1) is None and cache.lookup(k0) is not None and cache.evictions == 1
    fill(cache, c, 2)
    assert cache.lookup(k0) is None and cache.evictions == 2
    cache.commit(c)
    with pytest.raises(ValueError, match="not full"):
        cache.publish(c, 5, b"partial")
    with pytest.raises(CacheFullError):
        cache.reserve([cache.allocate()], [1])


def test_a_prompt_shares_whole_cached_blocks_and_never_its_last_token():
    cache = small_cache()
    pc = PrefixCache(cache)
    first = pc.acquire([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert first.cached == 0
    fill(cache, first.slot, 9)
    cache.commit(first.slot)
    pc.release(first.slot, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert cache.cached_blocks == 2  # two full blocks; the partial third one is not published
    again = pc.acquire([1, 2, 3, 4, 5, 6, 7, 8, 20, 21])
    assert again.cached == 8 and keys(cache, again.slot) == list(range(8))
    assert pc.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8]) == 4  # the whole prompt cached: its last token still runs
    assert pc.cached_prefix([1, 2, 3, 9, 5, 6, 7, 8, 9]) == 0  # a change in the first block: nothing
    assert pc.cached_prefix([9, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    off = PrefixCache(small_cache(), enabled=False)
    s = off.acquire([1, 2, 3, 4, 5])
    fill(off.cache, s.slot, 5)
    off.cache.commit(s.slot)
    off.release(s.slot, [1, 2, 3, 4, 5])
    assert off.acquire([1, 2, 3, 4, 5, 6]).cached == 0 and off.cache.cached_blocks == 0


def test_a_running_sequences_blocks_are_shared_not_copied_and_a_failed_one_publishes_nothing_new():
    cache = small_cache()
    pc = PrefixCache(cache)
    run = pc.acquire([1, 2, 3, 4, 5, 6, 7, 8, 9])
    fill(cache, run.slot, 6)
    cache.commit(run.slot)
    pc.publish(run.slot, [1, 2, 3, 4, 5, 6])  # as the scheduler does after each step
    joined = pc.acquire([1, 2, 3, 4, 5, 6, 0, 0])
    assert joined.cached == 4 and cache.tables[joined.slot] == cache.tables[run.slot][:1]
    assert cache.ref[cache.tables[run.slot][0]] == 2
    fill(cache, run.slot, 3, first=6)
    cache.commit(run.slot)
    pc.release(run.slot, None)  # a failed step: its second block is not published
    assert pc.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == 4


# ------------------------------------------------------------------------------------------ engine
def make_core(pair, prefix_cache: bool, **config) -> EngineCore:
    target, draft = pair
    config = {"max_batch": 4, "max_model_len": 256, "tree": (2, 2), "load_aware": False, **config}
    return EngineCore(target, draft, EngineConfig.from_settings(prefix_cache=prefix_cache, **config))


def drive(core: EngineCore, requests: list[GenerationRequest], add_at: list[int],
          each_step=None) -> dict[str, tuple[list[int], int]]:
    """Adds ``requests[i]`` at step ``add_at[i]``, steps to the end (calling ``each_step(core)`` after
    each step); request id -> (tokens, cached)."""
    out = {r.request_id: ([], 0) for r in requests}
    step = 0
    while step <= max(add_at) or core.has_unfinished():
        for r, at in zip(requests, add_at):
            if at == step:
                core.add_request(r)
        for o in core.step():
            tokens, _ = out[o.request_id]
            out[o.request_id] = (tokens + o.new_token_ids, o.cached_tokens)
        if each_step is not None:
            each_step(core)
        step += 1
    return out


def request(rid: str, prompt: list[int], method: str, temperature: float, max_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(temperature=temperature, seed=7, max_tokens=max_tokens,
                                                         ignore_eos=True), SpecOptions(method=method))


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["mcsd", "maxgram", "cascade"])
def test_chat_turns_reuse_the_conversation_and_answer_as_without_the_cache(tiny_pair, method, temperature):
    """Three turns, each prompt = the previous prompt + its answer + a new message: with the cache
    each turn shares every full block of the previous turn (pages of 4) and prefills the rest, and
    every answer is the same as without the cache."""
    rng = random.Random(3)
    first = [rng.randrange(2, 100) for _ in range(20)]
    messages = [[rng.randrange(2, 100) for _ in range(6)] for _ in range(2)]
    results, held = {}, []
    for on in (True, False):
        core = make_core(tiny_pair, on, kv_block_size=4)
        prompt, turns = first, []
        for turn in range(3):
            got = drive(core, [request(f"t{turn}", prompt, method, temperature)], [0])[f"t{turn}"]
            turns.append(got)
            if on:
                held.append(len(prompt) + len(got[0]) - 1)  # what the turn committed (its last token is a root)
            if turn < 2:
                prompt = prompt + got[0] + messages[turn]
        results[on] = turns
        assert core.cache.used_blocks == 0
    assert [t for t, _ in results[True]] == [t for t, _ in results[False]]
    assert [c for _, c in results[False]] == [0, 0, 0]
    cached = [c for _, c in results[True]]
    assert cached == [0, held[0] // 4 * 4, held[1] // 4 * 4]


def test_a_shared_prompt_is_shared_with_a_running_sequence(tiny_pair):
    """Requests joining while one with the same long prefix runs share its published blocks (the
    same pool blocks, not copies); the output is that of the cache-off engine."""
    rng = random.Random(1)
    system = [rng.randrange(2, 100) for _ in range(40)]
    prompts = [system + [rng.randrange(2, 100) for _ in range(4)] for _ in range(3)]
    runs, cores, shared = {}, {}, []
    for on in (True, False):
        cores[on] = core = make_core(tiny_pair, on)
        reqs = [request(f"a{i}", p, "mcsd", 0.0, max_tokens=16) for i, p in enumerate(prompts)]
        runs[on] = drive(core, reqs, [0, 1, 2],
                         each_step=lambda c: shared.append(len({tuple(c.cache.tables[s.slot][:2])
                                                                for s in c.scheduler.running})))
    assert {k: t for k, (t, _) in runs[True].items()} == {k: t for k, (t, _) in runs[False].items()}
    assert [runs[True][f"a{i}"][1] for i in range(3)] == [0, 40, 40]  # ten blocks of 4
    assert 1 in shared[:5]  # with the cache, the three running sequences' first two blocks are the same ones
    for on, hits in ((True, 80), (False, 0)):
        stats = cores[on].drain_step_stats()
        assert sum(s.prefix_queried_tokens for s in stats) == 3 * 44
        assert sum(s.prefix_hit_tokens for s in stats) == hits


def test_requests_arriving_together_prefill_their_shared_prompt_once(tiny_pair):
    """Three requests with one 40-token system prompt, added in the same step: the first prefills
    it, the others wait until it is cached and share it.  Same outputs as without the cache, and
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


# ------------------------------------------------------------------------------- pages and the pool
def mixed_requests(rng: random.Random, method: str, n: int = 6) -> list[GenerationRequest]:
    system = [rng.randrange(2, 100) for _ in range(24)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(2, 100) for _ in range(rng.randrange(1, 30))]
        prompt = system + tail if i % 2 else tail + system  # half share a prefix
        reqs.append(request(f"m{i}", prompt, method, 0.0 if i % 3 == 0 else 0.8, max_tokens=rng.randrange(8, 40)))
    return reqs


@pytest.mark.parametrize("method", ["mcsd", "maxgram", "cascade"])
def test_pages_of_any_size_give_the_same_outputs(tiny_pair, method):
    """Greedy and seeded sampled requests of several lengths joining at different steps: the same
    tokens with pages of 1, 3, 16 and 64 positions as with one page per sequence and no prefix cache;
    a tree's accepted path crosses block boundaries all the time with pages of 1 and 3."""
    reqs = mixed_requests(random.Random(5), method)
    add_at = [0, 0, 1, 3, 3, 7]
    ref = drive(make_core(tiny_pair, False, kv_block_size=512), reqs, add_at)
    for bs in (1, 3, 16, 64):
        core = make_core(tiny_pair, True, kv_block_size=bs)
        got = drive(core, reqs, add_at)
        assert {k: t for k, (t, _) in got.items()} == {k: t for k, (t, _) in ref.items()}, bs
        assert core.cache.used_blocks == 0 and core.runner.proposer.cache.used_blocks == 0


@pytest.mark.parametrize("method", ["mcsd", "maxgram"])
def test_a_pool_too_small_for_the_batch_preempts_and_gives_the_same_outputs(tiny_pair, method):
    """A pool of 136 positions (little more than one sequence's worth) for six requests: sequences are
    preempted when it runs out, recomputed later (from their own cached blocks when still there), and every
    request ends with the tokens it gets from a pool that holds them all; no block is left in use."""
    reqs = mixed_requests(random.Random(6), method)
    add_at = [0, 0, 0, 1, 1, 2]
    ref = drive(make_core(tiny_pair, False), reqs, add_at)
    core = make_core(tiny_pair, True, kv_block_size=8, max_model_len=96, kv_cache_tokens=136)
    got = drive(core, reqs, add_at)
    assert {k: t for k, (t, _) in got.items()} == {k: t for k, (t, _) in ref.items()}
    stats = core.drain_step_stats()
    assert sum(s.preemptions for s in stats) > 0
    assert core.cache.used_blocks == 0 and core.runner.proposer.cache.used_blocks == 0
    assert core.cache.free_slots == core.cache.num_slots


def test_a_storm_of_aborts_leaks_no_block(tiny_pair):
    """Forty requests on a small pool, a third of them aborted at random steps (waiting, prefilling,
    decoding, preempted): at the end every block and slot of both pools is free."""
    rng = random.Random(7)
    core = make_core(tiny_pair, True, kv_block_size=4, max_model_len=80, kv_cache_tokens=160)
    reqs = [request(f"s{i}", [rng.randrange(2, 100) for _ in range(rng.randrange(2, 50))], "mcsd", 0.7,
                    max_tokens=rng.randrange(4, 30)) for i in range(40)]
    doomed = {r.request_id: rng.randrange(0, 30) for r in rng.sample(reqs, 13)}
    for r in reqs:
        core.add_request(r)
    step = 0
    while core.has_unfinished():
        for rid, at in doomed.items():
            if at == step:
                core.abort_request(rid)
        assert not [o.error for o in core.step() if o.error]
        step += 1
    for cache in (core.cache, core.runner.proposer.cache):
        assert cache.used_blocks == 0 and cache.free_slots == cache.num_slots
        assert sum(cache.ref) == 0


def test_a_pool_smaller_than_one_request_is_refused_at_start_up(tiny_pair):
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        make_core(tiny_pair, True, max_model_len=256, kv_cache_tokens=200)


def test_a_cpu_pool_is_zero_and_takes_no_memory_until_touched():
    """``zeroed_pool``: an anonymous mapping on the CPU, zero-filled by the kernel page by page."""
    import os

    from engine.kv_cache import zeroed_pool

    def resident_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    before = resident_mib()
    pool = zeroed_pool((4, 8192, 4, 1024), torch.bfloat16, "cpu")  # 256 MiB
    assert resident_mib() - before < 16
    assert pool.shape == (4, 8192, 4, 1024) and pool.dtype == torch.bfloat16
    pool[1, 5] = 3.0
    after_write = resident_mib()
    assert float(pool[2:4].float().sum()) == 0.0  # reading 128 MiB of untouched pages makes nothing resident
    assert resident_mib() - after_write < 16
    assert float(pool[1, 5].sum()) == 3.0 * 4 * 1024 and float(pool.float().abs().sum()) == 3.0 * 4 * 1024
    empty = zeroed_pool((0, 4), torch.float32, "cpu")
    assert empty.shape == (0, 4)
