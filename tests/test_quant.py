"""Weight-only int8 drafts (engine.models.quant): the quantization error bound, the kernel against the
dequantized product, shapes torch's kernel cannot take staying unquantized, the original model left
untouched, and greedy output equal to plain decoding with an int8 draft.  Sampling needs no case of
its own: int8 only changes the draft's distribution q, and the chi-square tests (test_lossless.py)
already verify with drafts whose q differs from the target's; the q verification reads comes from
the same draft forward that sampled the candidates, whatever the weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.models.quant import Int8Linear, Int8Weight, int8_copy, is_int8
from tests.engine_utils import run_engine
from tests.tiny import tiny_loaded

PROMPTS = [[5, 17, 33, 8], [90, 2, 41], [7, 7, 7, 12, 60]]


@pytest.fixture(scope="module")
def pair():
    return tiny_loaded("qwen2", seed=0), tiny_loaded("qwen2", seed=1)


def test_quantization_error_is_at_most_half_a_step_per_row():
    w = torch.randn(40, 64) * torch.linspace(0.01, 3.0, 40)[:, None]  # rows of very different scales
    q = Int8Weight.quantize(w)
    assert q.q.dtype == torch.int8 and q.q.shape == w.shape and q.scale.shape == (40,)
    err = (q.dequantize() - w).abs().amax(dim=1)
    assert (err <= q.scale / 2 + 1e-6).all()
    assert (q.q.abs().amax(dim=1) == 127).all()  # each row uses the whole range


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_equals_the_dequantized_product(dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    q = Int8Weight.quantize(w)
    assert q.works()
    x = torch.randn(2, 3, 96, generator=gen).to(dtype)  # 6 rows: int8 (MAX_ROWS)
    got = q.linear(x, bias)
    want = (x.float() @ q.dequantize().float().T + bias.float())
    assert got.shape == (2, 3, 48) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_a_weight_the_kernel_cannot_take_stays_unquantized():
    lin = nn.Linear(40, 8, bias=False)  # K = 40: not a multiple of 16, the kernel would return garbage
    assert not Int8Weight.quantize(lin.weight).works()
    model = tiny_loaded("qwen2", seed=0).model
    model.layers[0].o_proj = nn.Linear(model.layers[0].q_size, model.cfg.hidden_size, bias=False)
    model.layers[0].o_proj.weight.data = torch.randn_like(model.layers[0].o_proj.weight)
    copy = int8_copy(model)
    assert isinstance(copy.layers[1].o_proj, Int8Linear)  # K = 64 works
    model.layers[0].o_proj = lin  # a shape the kernel refuses
    copy = int8_copy(model)
    assert copy.layers[0].o_proj is lin and isinstance(copy.layers[0].down_proj, Int8Linear)


def test_the_copy_is_int8_shares_embeddings_and_leaves_the_original_alone(pair):
    target, _ = pair
    model = target.model
    ids, pos = torch.tensor([[3, 9, 27, 4]]), torch.arange(4)[None]

    def logits(m):
        cache = m.new_cache(1, 16)
        return m(ids, pos, cache, [cache.allocate()]).logits

    before = logits(model)
    q = int8_copy(model)
    assert is_int8(q) and not is_int8(model)
    assert q.embed_tokens is model.embed_tokens and q.norm is model.norm
    assert all(isinstance(getattr(layer, n), Int8Linear) for layer in q.layers
               for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert isinstance(q.lm_head, Int8Linear) and isinstance(model.lm_head, nn.Linear)
    assert torch.equal(logits(model), before)
    after = logits(q)
    assert not torch.equal(after, before)  # it really runs int8 ...
    assert (after.argmax(-1) == before.argmax(-1)).float().mean() >= 0.75  # ... and stays close
    assert float((after - before).abs().max()) < 0.1 * float(before.abs().max())


@pytest.mark.parametrize("tree", [(1, 1, 1), (3, 2)])
def test_greedy_with_an_int8_draft_equals_plain_decoding(pair, tree):
    target, draft = pair
    expected, _ = run_engine(target, None, PROMPTS, tree=(), ignore_eos=True)
    outs, core = run_engine(target, draft, PROMPTS, tree=tree, ignore_eos=True, config={"draft_int8": True})
    assert [o.tokens for o in outs] == [o.tokens for o in expected]
    assert is_int8(core.runner.proposer.model) and not is_int8(draft.model)
    assert not is_int8(core.target.model)
    stats = core.drain_step_stats()
    assert sum(s.drafted_tokens for s in stats) > 0  # the int8 draft did draft


def test_int8_is_refused_off_the_cpu():
    meta = tiny_loaded("qwen2", seed=1).model.to("meta")
    with pytest.raises(ValueError, match="CPU only"):
        int8_copy(meta)


def test_the_engine_keeps_the_draft_as_it_is_off_the_cpu(caplog):
    from dataclasses import replace

    from engine.core import EngineCore

    draft = tiny_loaded("qwen2", seed=1)
    on_meta = replace(draft, model=draft.model.to("meta"))
    assert EngineCore._int8_draft(on_meta) is on_meta
    assert "CPU only" in caplog.text
    assert is_int8(EngineCore._int8_draft(tiny_loaded("qwen2", seed=1)).model)


def test_many_rows_take_the_original_weight_and_few_rows_take_int8():
    from engine.models import cpu_kernels
    from engine.models.quant import MAX_ROWS

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=gen)
    q = Int8Weight.quantize(w)
    assert q.dense is w
    few = torch.randn(1, MAX_ROWS, 64, generator=gen)
    many = torch.randn(1, MAX_ROWS + 1, 64, generator=gen)
    assert torch.equal(q.linear(many), cpu_kernels.linear(many, w))
    assert torch.equal(q.linear(few), q._int8(few)) and not torch.equal(q.linear(few), cpu_kernels.linear(few, w))
    # without the original, every product is int8
    only = Int8Weight(q.q, q.scale)
    torch.testing.assert_close(only.linear(many), q._int8(many))
