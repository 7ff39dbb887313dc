"""The batch-invariant CPU attention (engine/models/csrc/attention.cpp): SDPA's values, and each query's
output bitwise independent of the other queries, the batch, kv padding and where its keys sit."""

import pytest
import torch
import torch.nn.functional as F

from engine.models import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels unavailable on this machine")

ATTN = torch.ops.mcsd_cpu.attention if cpu_kernels.available() else None


def inputs(b=2, hq=6, hkv=2, t=5, length=37, d=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, length, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, length, d, generator=g).to(dtype)
    mask = torch.rand(b, 1, t, length, generator=g) < 0.7
    mask[..., 0] = True  # every query may attend to something
    return q, k, v, mask


def run(q, k, v, mask):
    return ATTN(q, k, v, mask, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("d", [64, 20])  # 20: a head dimension with a scalar tail
def test_matches_sdpa(dtype, tol, d):
    q, k, v, mask = inputs(dtype=dtype, d=d)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    got = run(q, k, v, mask)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    no_mask = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    torch.testing.assert_close(run(q, k, v, None).float(), no_mask, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_query_is_computed_alone(dtype):
    q, k, v, mask = inputs(dtype=dtype)
    full = run(q, k, v, mask)
    for b in range(q.shape[0]):
        for t in range(q.shape[2]):
            alone = run(q[b:b + 1, :, t:t + 1], k[b:b + 1], v[b:b + 1], mask[b:b + 1, :, t:t + 1])
            assert torch.equal(alone, full[b:b + 1, :, t:t + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run(q, k, v, mask), full)
    finally:
        torch.set_num_threads(threads)


def test_padding_and_key_placement_do_not_change_the_result():
    """A query sees only its allowed keys in order: extra masked keys (a batch's longer kv_len) and
    the same keys at other cache positions (a tree's tokens before compaction) give the same bits."""
    q, k, v, _ = inputs(b=1, t=1, length=20)
    allowed = [0, 1, 2, 3, 7, 12, 13]
    mask = torch.zeros(1, 1, 1, 20, dtype=torch.bool)
    mask[..., allowed] = True
    spread = run(q, k, v, mask)
    compact = run(q, k[:, :, allowed], v[:, :, allowed], None)
    assert torch.equal(spread, compact)
    pad_k = torch.cat([k, torch.randn(1, 2, 9, 64)], dim=2)
    pad_v = torch.cat([v, torch.randn(1, 2, 9, 64)], dim=2)
    assert torch.equal(run(q, pad_k, pad_v, torch.cat([mask, torch.zeros(1, 1, 1, 9, dtype=torch.bool)], -1)), spread)


def test_strided_inputs_and_a_query_with_nothing_to_attend():
    q, k, v, mask = inputs()
    # the engine's layout: the cache is [B, L, H, D], read transposed
    kt, vt = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
    assert not kt.is_contiguous()
    assert torch.equal(run(q, kt, vt, mask), run(q, k, v, mask))
    mask[0, 0, 2] = False
    out = run(q, k, v, mask)
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2])) and out[0, :, 1].abs().sum() > 0
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        run(q, k[:, :1].expand(-1, 4, -1, -1), v[:, :1].expand(-1, 4, -1, -1), mask)


def test_the_wrapper_takes_sdpa_off_the_cpu_kernels_path(monkeypatch):
    q, k, v, mask = inputs(dtype=torch.float16)  # fp16: not a kernel dtype
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.equal(cpu_kernels.attention(q, k, v, mask), want)


def test_a_quantized_model_is_batch_invariant_end_to_end():
    """Every linear in Q8_0 blocks plus this attention: a sequence's logits are bitwise the same decoded
    token by token, fed as one block, and batched next to a longer sequence (padding, a mask)."""
    from engine.models.qweight import quantized_copy
    from tests.tiny import tiny_loaded

    model = quantized_copy(tiny_loaded("qwen2", seed=0).model)
    seq, other = [5, 17, 33, 8, 9, 41, 2], [90, 2, 41, 7, 7, 12, 60, 3, 3, 11]

    def fresh(n_slots):
        cache = model.new_cache(n_slots, 32)
        return cache, [cache.allocate() for _ in range(n_slots)]

    cache, (s,) = fresh(1)  # prompt, then one token at a time
    model(torch.tensor([seq[:4]]), torch.arange(4)[None], cache, [s])
    cache.commit(s)
    steps = []
    for i in range(4, len(seq)):
        steps.append(model(torch.tensor([[seq[i]]]), torch.tensor([[i]]), cache, [s]).logits[0, 0])
        cache.commit(s)
    steps = torch.stack(steps)

    cache, (s,) = fresh(1)  # the same tokens as one block after the prompt
    model(torch.tensor([seq[:4]]), torch.arange(4)[None], cache, [s])
    cache.commit(s)
    block = model(torch.tensor([seq[4:]]), torch.arange(4, len(seq))[None], cache, [s]).logits[0]
    assert torch.equal(block, steps)

    cache, (s, o) = fresh(2)  # batched beside a longer sequence
    model(torch.tensor([seq[:4] + [0] * 6, other]), torch.arange(10)[None].expand(2, 10), cache, [s, o],
          num_new=[4, 10])
    cache.commit(s), cache.commit(o)
    batched = []
    for i in range(4, len(seq)):
        out = model(torch.tensor([[seq[i]], [3]]), torch.tensor([[i], [10 + i]]), cache, [s, o]).logits
        batched.append(out[0, 0])
        cache.commit(s), cache.commit(o)
    assert torch.equal(torch.stack(batched), steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", [True, False], ids=["block-mask", "causal"])
def test_paged_attention_equals_attention_over_the_gathered_rows(dtype, tree):
    """``paged_attention`` reads scattered pool rows with the mask given over the new block only;
    ``attention`` over the same rows gathered, with the full mask ``build_mask`` makes, gives bitwise
    the same output (same allowed keys, same order), for sequences of different lengths in one batch."""
    from engine.models.llama import build_mask

    g = torch.Generator().manual_seed(3)
    b, hq, hkv, t, d, pool = 3, 4, 2, 5, 32, 200
    lens = torch.tensor([7, 0, 21])
    pending = torch.tensor([2, 0, 4]) if tree else torch.zeros(3, dtype=torch.long)
    start = lens + pending
    kv_len = int(start.max()) + t
    rows = torch.stack([torch.randperm(pool, generator=g)[:kv_len] for _ in range(b)])  # scattered pages
    k_pool = torch.randn(pool, hkv, d, generator=g).to(dtype)
    v_pool = torch.randn(pool, hkv, d, generator=g).to(dtype)
    q = torch.randn(b, hq, t, d, generator=g).to(dtype)
    block_mask = (torch.rand(b, t, int(pending.max()) + t, generator=g) < 0.6) if tree else None
    got = cpu_kernels.paged_attention(q, k_pool, v_pool, rows, lens, start, block_mask)
    keys, values = k_pool[rows].transpose(1, 2), v_pool[rows].transpose(1, 2)  # [b, hkv, kv_len, d]
    want = run(q, keys, values, build_mask(lens, start, t, kv_len, block_mask))
    assert got.dtype == dtype and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="out of the pool"):
        cpu_kernels.paged_attention(q, k_pool, v_pool, rows + pool, lens, start, block_mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", [True, False], ids=["block-mask", "causal"])
def test_packed_paged_attention_equals_the_padded_call(dtype, tree):
    """Blocks of 5, 1 and 3 real queries packed as [1, Hq, 9, D] with ``counts``: each real query's
    output is bitwise its output in the padded [3, Hq, 5, D] call, and a malformed packing is refused."""
    g = torch.Generator().manual_seed(4)
    b, hq, hkv, t, d, pool = 3, 4, 2, 5, 32, 200
    counts = torch.tensor([5, 1, 3])
    lens = torch.tensor([7, 12, 0])
    pending = torch.tensor([2, 0, 4]) if tree else torch.zeros(3, dtype=torch.long)
    start = lens + pending
    kv_len = int(start.max()) + t
    rows = torch.stack([torch.randperm(pool, generator=g)[:kv_len] for _ in range(b)])
    k_pool = torch.randn(pool, hkv, d, generator=g).to(dtype)
    v_pool = torch.randn(pool, hkv, d, generator=g).to(dtype)
    q = torch.randn(b, hq, t, d, generator=g).to(dtype)
    block_mask = (torch.rand(b, t, int(pending.max()) + t, generator=g) < 0.6) if tree else None
    padded = cpu_kernels.paged_attention(q, k_pool, v_pool, rows, lens, start, block_mask)
    packed_q = torch.cat([q[i, :, :n] for i, n in enumerate(counts.tolist())], dim=1)[None]  # [1, hq, 9, d]
    got = cpu_kernels.paged_attention(packed_q, k_pool, v_pool, rows, lens, start, block_mask, counts)
    want = torch.cat([padded[i, :, :n] for i, n in enumerate(counts.tolist())], dim=1)[None]
    assert got.shape == (1, hq, 9, d) and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="packed q"):
        cpu_kernels.paged_attention(packed_q[:, :, :8], k_pool, v_pool, rows, lens, start, block_mask, counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 64, 80, 128])
def test_the_tiled_path_gives_the_one_key_at_a_time_bits(dtype, d):
    """Head dimensions that are multiples of 16 take the tiled path (four keys per dot, a tile of
    values into outputs held in registers).  Padded with 4 zero dimensions, the same heads take the
    one-key-at-a-time path, whose extra terms are exact zeros: the outputs must be the same bits.  And
    where the CPU has AVX-512, its variant of the tiled path must give them too."""
    q, k, v, mask = inputs(t=7, length=45, d=d, dtype=dtype, seed=3)
    pad = lambda x: F.pad(x, (0, 4))  # noqa: E731
    scale = d ** -0.5
    one_at_a_time = ATTN(pad(q), pad(k), pad(v), mask, scale)[..., :d]
    before = torch.ops.mcsd_cpu.vector_isa()
    try:
        assert torch.ops.mcsd_cpu.vector_isa("avx2") == "avx2"
        assert torch.equal(ATTN(q, k, v, mask, scale), one_at_a_time)
        if "avx512f" in (cpu_kernels.cpu_flags() or ()):
            assert torch.ops.mcsd_cpu.vector_isa("avx512") == "avx512"
            assert torch.equal(ATTN(q, k, v, mask, scale), one_at_a_time)
        else:
            with pytest.raises(RuntimeError, match="no AVX-512F"):
                torch.ops.mcsd_cpu.vector_isa("avx512")
    finally:
        torch.ops.mcsd_cpu.vector_isa(before)
    with pytest.raises(RuntimeError, match="expected 'avx512'"):
        torch.ops.mcsd_cpu.vector_isa("sse")
