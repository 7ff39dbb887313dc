"""Blocks of different lengths in one forward run packed (engine.models.llama.Packing): the linears see
only the real rows, and every row's logits, hidden state and cache entries are those of its
sequence run alone."""

import pytest
import torch

from engine.batching import Block, run_blocks
from engine.models import llama, qweight
from engine.models.llama import Packing
from tests.tiny import VOCAB, ours_from_hf, tiny_hf


def chain_mask(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def models():
    """fp32, bf16 (our batch-invariant kernel) and GGUF Q8_0 blocks (our integer kernels)."""
    hf = tiny_hf("qwen2", layers=2)
    yield "fp32", ours_from_hf(hf)
    yield "bf16", ours_from_hf(hf, torch.bfloat16)
    if qweight.available():
        yield "q8_0", qweight.quantized_copy(ours_from_hf(hf, torch.bfloat16), "q8_0")


@pytest.fixture(params=list(range(3)), ids=["fp32", "bf16", "q8_0"])
def model(request):
    found = list(models())
    if request.param >= len(found):
        pytest.fail("the CPU kernels did not build: the q8_0 case cannot run")
    return found[request.param]


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(model, contexts, new_blocks, masks):
    """Prefills each context in its own slot, then runs ``new_blocks`` in one forward; returns the
    per-block logits, the hidden states and the cache after it."""
    cache = model.new_cache(len(contexts), 64)
    slots = [cache.allocate() for _ in contexts]
    for s, ctx in zip(slots, contexts):
        run_blocks(model, cache, [Block(s, ctx, list(range(len(ctx))), [])])
        cache.commit(s)
    blocks = [Block(s, toks, [len(ctx) + i for i in range(len(toks))], list(range(len(toks))), m)
              for s, ctx, toks, m in zip(slots, contexts, new_blocks, masks)]
    out, per_block = run_blocks(model, cache, blocks)
    return per_block, out.hidden, cache, slots


def test_packed_rows_equal_each_sequence_alone(model):
    """A tree of five among three single tokens: each row's logits are its sequence's own, bitwise for
    the batch-invariant kernels (bf16, Q8_0), and the cache entries written are the real ones only."""
    name, m = model
    contexts = prompts(4)
    new = [[5, 6, 7, 8, 9], [11], [12], [13]]
    masks = [chain_mask(5), None, None, None]
    together, hidden, cache, slots = run(m, contexts, new, masks)
    for i in range(4):
        alone, alone_hidden, alone_cache, (slot,) = run(m, [contexts[i]], [new[i]], [masks[i]])
        if name == "fp32":  # MKL's fp32 GEMM is not batch-invariant
            assert torch.allclose(together[i], alone[0], atol=1e-4)
        else:
            assert torch.equal(together[i], alone[0]), f"row {i} changed when batched with padding ({name})"
            n = len(new[i])
            assert torch.equal(hidden[i, :n], alone_hidden[0, :n])
        assert int(cache.pending[slots[i]]) == len(new[i])
    assert hidden.shape[:2] == (4, 5) and not hidden[1, 1:].any()  # padding unpacked as zeros


def test_padding_runs_no_linear_rows(monkeypatch):
    """The linears of a [4, 5] forward with 8 real tokens multiply 8 rows; the output layer runs the
    wanted logit rows only."""
    m = ours_from_hf(tiny_hf("llama", layers=1))
    rows_seen = []
    real_linear = llama.linear

    def counting(x, weight, bias=None):
        rows_seen.append((x.reshape(-1, x.shape[-1]).shape[0], weight.shape[0]))
        return real_linear(x, weight, bias)

    monkeypatch.setattr(llama, "linear", counting)
    run(m, prompts(4), [[5, 6, 7, 8, 9], [11], [12], [13]], [chain_mask(5), None, None, None])
    forward = rows_seen[-5:]  # qkv, o, gate_up, down, lm_head of the batched forward
    assert [r for r, _ in forward[:4]] == [8, 8, 8, 8]
    assert forward[4] == (8, VOCAB)


def test_unwanted_logit_rows_repeat_the_first():
    """``num_logits`` rows of each row are computed; the padding of ``logits_rows`` repeats the row's
    first wanted logits (finite, never a neighbour's)."""
    m = ours_from_hf(tiny_hf("llama", layers=1))
    cache = m.new_cache(2, 32)
    a, b = cache.allocate(), cache.allocate()
    ids = torch.tensor([[3, 4, 5], [6, 0, 0]])
    pos = torch.tensor([[0, 1, 2], [0, 0, 0]])
    rows = torch.tensor([[0, 2], [0, 0]])
    out = m(ids, pos, cache, [a, b], num_new=[3, 1], logits_rows=rows, num_logits=[2, 1])
    cache.discard(a), cache.discard(b)
    full = m(ids, pos, cache, [a, b], num_new=[3, 1])  # every row, unpacked to [2, 3, vocab]
    assert out.logits.shape == (2, 2, VOCAB)
    assert torch.allclose(out.logits[0], full.logits[0, [0, 2]], atol=1e-5)
    assert torch.allclose(out.logits[1, 0], full.logits[1, 0], atol=1e-5)
    assert torch.equal(out.logits[1, 1], out.logits[1, 0])
    assert not full.logits[1, 1:].any()  # padded rows of an all-rows forward are zeros


def test_packing_is_none_without_padding():
    assert Packing.of([3, 3], 3, torch.device("cpu")) is None
    p = Packing.of([3, 1], 3, torch.device("cpu"))
    assert p.rows.tolist() == [0, 1, 2, 3] and p.lengths == [3, 1]
    x = torch.arange(6).view(2, 3)
    assert p.pack(x).tolist() == [[0, 1, 2, 3]]
    assert p.unpack(p.pack(x)).tolist() == [[0, 1, 2], [3, 0, 0]]


@pytest.mark.parametrize("kernel", ["ours", "sdpa"])
def test_the_gathering_attention_unpacks_and_packs_around_itself(monkeypatch, kernel):
    """Off the CPU's paged kernel (a GPU: keys gathered, SDPA with the full mask), packed queries are
    unpacked to the rectangle for the attention and packed back: the same logits as the paged path."""
    from engine.models import cpu_kernels
    m = ours_from_hf(tiny_hf("qwen2", layers=2))
    contexts, new = prompts(3, seed=5), [[5, 6, 7, 8], [11], [12, 13]]
    masks = [chain_mask(4), None, chain_mask(2)]
    paged, _, _, _ = run(m, contexts, new, masks)
    monkeypatch.setattr(cpu_kernels, "paged_attention_applies", lambda pool: False)
    if kernel == "sdpa":
        monkeypatch.setattr(cpu_kernels, "_invariant_attention", lambda: False)
    gathered, _, cache, slots = run(m, contexts, new, masks)
    for a, b in zip(paged, gathered):
        assert torch.allclose(a, b, atol=1e-4)
    assert [int(cache.pending[s]) for s in slots] == [4, 1, 2]
