"""Our runtime's logits equal transformers' own implementation (fp32, max abs diff < 1e-4), for each
architecture: the Llama family (``llama``, ``qwen2``) and Qwen3 (``engine.models.qwen3``)."""

import pytest
import torch

from engine.kv_cache import CacheFullError
from engine.models.config import ModelConfig, UnsupportedModelError
from tests.tiny import VOCAB, hf_logits, ours_from_hf, tiny_hf

TOL = 1e-4


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def pair(request):
    hf = tiny_hf(request.param)
    return hf, ours_from_hf(hf)


def prefill(model, cache, slot, ids):
    out = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, [slot])
    cache.commit(slot)
    return out.logits[0]


def test_prefill_matches_reference(pair):
    hf, ours = pair
    cache = ours.new_cache(2, 64)
    ids = torch.randint(0, VOCAB, (20,)).tolist()
    got = prefill(ours, cache, cache.allocate(), ids)
    assert (got - hf_logits(hf, ids)).abs().max() < TOL


def test_incremental_decode_matches_reference(pair):
    hf, ours = pair
    cache = ours.new_cache(1, 64)
    slot = cache.allocate()
    ids = torch.randint(0, VOCAB, (16,)).tolist()
    ref = hf_logits(hf, ids)
    prefill(ours, cache, slot, ids[:6])
    for i in range(6, 16):
        out = ours(torch.tensor([[ids[i]]]), torch.tensor([[i]]), cache, [slot])
        cache.commit(slot)
        assert (out.logits[0, 0] - ref[i]).abs().max() < TOL


def tree_example():
    """A 2-level tree under a context: root children a, b; a's children c, d; b's child e.
    Level-major order [a, b, c, d, e]; parents [-1, -1, 0, 0, 1]."""
    parents = [-1, -1, 0, 0, 1]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    depth = torch.tensor([0, 0, 1, 1, 1])
    return parents, mask, depth


def path_to(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_block_equals_sequential_paths(pair):
    hf, ours = pair
    ctx = torch.randint(0, VOCAB, (9,)).tolist()
    tokens = torch.randint(0, VOCAB, (5,)).tolist()
    parents, mask, depth = tree_example()
    cache = ours.new_cache(1, 64)
    slot = cache.allocate()
    prefill(ours, cache, slot, ctx)
    out = ours(torch.tensor([tokens]), (len(ctx) + depth)[None], cache, [slot], block_mask=mask[None])
    for node in range(5):
        seq = ctx + [tokens[j] for j in path_to(parents, node)]
        assert (out.logits[0, node] - hf_logits(hf, seq)[-1]).abs().max() < TOL


def test_keep_subset_then_continue(pair):
    """Keep the accepted path [b, e] of the tree, then decode on: equals the plain sequence."""
    hf, ours = pair
    ctx = torch.randint(0, VOCAB, (7,)).tolist()
    tokens = torch.randint(0, VOCAB, (5,)).tolist()
    parents, mask, depth = tree_example()
    cache = ours.new_cache(1, 64)
    slot = cache.allocate()
    prefill(ours, cache, slot, ctx)
    ours(torch.tensor([tokens]), (len(ctx) + depth)[None], cache, [slot], block_mask=mask[None])
    cache.keep(slot, [1, 4])
    assert int(cache.lens[slot]) == len(ctx) + 2
    nxt = 17
    out = ours(torch.tensor([[nxt]]), torch.tensor([[len(ctx) + 2]]), cache, [slot])
    ref = hf_logits(hf, ctx + [tokens[1], tokens[4], nxt])[-1]
    assert (out.logits[0, 0] - ref).abs().max() < TOL


def test_rollback_discards_block(pair):
    hf, ours = pair
    ctx = torch.randint(0, VOCAB, (5,)).tolist()
    cache = ours.new_cache(1, 32)
    slot = cache.allocate()
    prefill(ours, cache, slot, ctx)
    ours(torch.tensor([[3, 4, 5]]), torch.tensor([[5, 6, 7]]), cache, [slot])
    cache.discard(slot)
    out = ours(torch.tensor([[9]]), torch.tensor([[5]]), cache, [slot])
    assert (out.logits[0, 0] - hf_logits(hf, ctx + [9])[-1]).abs().max() < TOL


def test_batch_of_mixed_lengths_and_trees(pair):
    """Two sequences of different lengths in one forward: one decodes a token, one verifies a tree."""
    hf, ours = pair
    a = torch.randint(0, VOCAB, (4,)).tolist()
    b = torch.randint(0, VOCAB, (11,)).tolist()
    cache = ours.new_cache(3, 64)
    sa, sb = cache.allocate(), cache.allocate()
    prefill(ours, cache, sa, a)
    prefill(ours, cache, sb, b)
    parents, mask, depth = tree_example()
    tokens = torch.randint(0, VOCAB, (5,)).tolist()
    block_mask = torch.zeros(2, 5, 5, dtype=torch.bool)
    block_mask[0, 0, 0] = True  # sequence a: one real token, the rest padding
    block_mask[1] = mask
    ids = torch.tensor([[42, 0, 0, 0, 0], tokens])
    positions = torch.stack([torch.arange(5) + len(a), len(b) + depth])
    out = ours(ids, positions, cache, [sa, sb], block_mask=block_mask, num_new=[1, 5])
    assert (out.logits[0, 0] - hf_logits(hf, a + [42])[-1]).abs().max() < TOL
    for node in range(5):
        seq = b + [tokens[j] for j in path_to(parents, node)]
        assert (out.logits[1, node] - hf_logits(hf, seq)[-1]).abs().max() < TOL
    assert int(cache.pending[sa]) == 1 and int(cache.pending[sb]) == 5


def test_logits_rows_selects_positions(pair):
    _, ours = pair
    cache = ours.new_cache(1, 32)
    slot = cache.allocate()
    ids = torch.randint(0, VOCAB, (1, 6))
    full = ours(ids, torch.arange(6)[None], cache, [slot]).logits
    cache.discard(slot)
    last = ours(ids, torch.arange(6)[None], cache, [slot], logits_rows=torch.tensor([[5]])).logits
    assert torch.allclose(last[0, 0], full[0, 5], atol=1e-6)


def test_cache_full_is_a_clear_error():
    hf = tiny_hf("llama")
    ours = ours_from_hf(hf)
    cache = ours.new_cache(1, 8)
    slot = cache.allocate()
    with pytest.raises(CacheFullError, match="needs 9 positions"):
        ours(torch.zeros(1, 9, dtype=torch.long), torch.arange(9)[None], cache, [slot])
    with pytest.raises(CacheFullError, match="slots are in use"):
        cache.allocate()
    cache.free(slot)
    assert cache.allocate() == slot


def test_unsupported_architecture_names_supported_ones():
    with pytest.raises(UnsupportedModelError, match="llama, qwen2, mistral, qwen3"):
        ModelConfig.from_hf({"model_type": "gpt2", "hidden_size": 8})
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'yarn'"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                             "num_hidden_layers": 1, "num_attention_heads": 2,
                             "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_bf16_runs_close_to_fp32():
    hf = tiny_hf("qwen2")
    ours = ours_from_hf(hf, torch.bfloat16)
    cache = ours.new_cache(1, 32)
    ids = torch.randint(0, VOCAB, (12,)).tolist()
    got = prefill(ours, cache, cache.allocate(), ids)
    ref = hf_logits(hf, ids)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.1
