"""int8 drafts (``draft_int8``: the draft's linears in Q8_0 blocks through the GGUF kernels,
``engine.models.qweight.quantized_copy``): the copy shares what it does not quantize and leaves the
original alone, stays close to it, keeps shapes the blocks cannot take dense, and greedy output with an
int8 draft equals plain decoding.  Sampling needs no case of its own: int8 only changes the draft's
distribution q, and the exact-law tests (test_lossless.py) already verify drafts whose q differs from
the target's; the q verification reads comes from the same draft forward that sampled the candidates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.models.qweight import QuantLinear, quantized_copy
from tests.engine_utils import run_engine
from tests.tiny import tiny_loaded

PROMPTS = [[5, 17, 33, 8], [90, 2, 41], [7, 7, 7, 12, 60]]
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) for m in model.modules())


@pytest.fixture(scope="module")
def pair():
    return tiny_loaded("qwen2", seed=0), tiny_loaded("qwen2", seed=1)


def test_the_copy_is_q8_0_shares_the_rest_and_leaves_the_original_alone(pair):
    target, _ = pair
    model = target.model
    ids, pos = torch.tensor([[3, 9, 27, 4]]), torch.arange(4)[None]

    def logits(m):
        cache = m.new_cache(1, 16)
        return m(ids, pos, cache, [cache.allocate()]).logits

    before = logits(model)
    q = quantized_copy(model)
    assert is_quantized(q) and not is_quantized(model)
    assert q.embed_tokens is model.embed_tokens and q.norm is model.norm
    assert q.layers[0].input_layernorm is model.layers[0].input_layernorm
    assert all(isinstance(getattr(layer, n), QuantLinear) and getattr(layer, n).weight.type_name == "Q8_0"
               for layer in q.layers for n in LINEARS)
    assert isinstance(q.lm_head, QuantLinear) and isinstance(model.lm_head, nn.Linear)
    assert torch.equal(logits(model), before)
    after = logits(q)
    assert not torch.equal(after, before)  # it really runs the blocks ...
    assert torch.equal(after.argmax(-1), before.argmax(-1))  # ... and stays close
    assert float((after - before).abs().max()) < 0.05 * float(before.abs().max())


def test_a_linear_the_blocks_cannot_take_stays_dense():
    model = tiny_loaded("qwen2", seed=0).model
    lin = nn.Linear(40, model.layers[0].q_size, bias=False)  # K = 40: not a whole number of 32-blocks
    model.layers[0].down_proj = lin
    q = quantized_copy(model)
    assert q.layers[0].down_proj is lin and isinstance(q.layers[0].o_proj, QuantLinear)


@pytest.mark.parametrize("tree", [(1, 1, 1), (3, 2)])
def test_greedy_with_an_int8_draft_equals_plain_decoding(pair, tree):
    target, draft = pair
    expected, _ = run_engine(target, None, PROMPTS, tree=(), ignore_eos=True)
    outs, core = run_engine(target, draft, PROMPTS, tree=tree, ignore_eos=True, config={"draft_int8": True})
    assert [o.tokens for o in outs] == [o.tokens for o in expected]
    assert is_quantized(core.runner.proposer.model) and not is_quantized(draft.model)
    assert not is_quantized(core.target.model)
    stats = core.drain_step_stats()
    assert sum(s.drafted_tokens for s in stats) > 0  # the int8 draft did draft


def test_quantized_weights_are_refused_off_the_cpu():
    meta = tiny_loaded("qwen2", seed=1).model.to("meta")
    with pytest.raises(ValueError, match="CPU only"):
        quantized_copy(meta)


def test_the_engine_keeps_the_draft_as_it_is_off_the_cpu(caplog):
    from dataclasses import replace

    from engine.core import EngineCore

    draft = tiny_loaded("qwen2", seed=1)
    on_meta = replace(draft, model=draft.model.to("meta"))
    assert EngineCore._int8_draft(on_meta) is on_meta
    assert "CPU only" in caplog.text
    assert is_quantized(EngineCore._int8_draft(tiny_loaded("qwen2", seed=1)).model)
