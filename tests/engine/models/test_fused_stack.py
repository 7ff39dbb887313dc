"""The decoder stack as one operator call (``FusedStack``, ``csrc/decoder.cpp``): bitwise the layer loop's
logits and cache contents, for every forward the engine makes (prefill, one-token decoding, a packed batch
of different block lengths with tree masks, scattered cache blocks), for weights in one block type or
several side by side (padded groups, a q/k/v bias), fp32 and bf16; rebuilt when a layer's weights change,
and not used where a weight is dense."""

import copy

import pytest
import torch

from engine.models import cpu_kernels, llama, qweight
from engine.models.qweight import StackedWeight
from engine.models.qweight import QuantLinear, quantize_linears
from tests.tiny import tiny_loaded

pytestmark = pytest.mark.skipif(not qweight.available(), reason="CPU kernels unavailable on this machine")

TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


def forwards(model, fused: bool, monkeypatch) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The logits of a prefill, a decoding step, and a packed batch of three sequences (one with a tree
    block), on one fresh cache whose blocks are scattered between the sequences; and the cache's pools."""
    monkeypatch.setattr(llama, "fused_layers_enabled", lambda: fused)
    cache = model.new_cache(3, 48, block_size=4)
    slots = [cache.allocate() for _ in range(3)]
    gen = torch.Generator().manual_seed(0)
    out = []
    for s in slots:  # prompts of 6, 9 and 5 tokens, allocated in turns: no sequence's blocks are consecutive
        cache.reserve([s], [3])
    for s, n in zip(slots, (6, 9, 5)):
        ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen)
        out.append(model(ids, torch.arange(n)[None], cache, [s]).logits)
        cache.commit(s)
    lens = [6, 9, 5]
    out.append(model(torch.tensor([[7]]), torch.tensor([[6]]), cache, [slots[0]]).logits)  # a decoding step
    cache.commit(slots[0])
    lens[0] += 1
    # one step of three sequences: 1, 4 (a tree) and 2 new tokens, packed
    ids = torch.randint(0, model.cfg.vocab_size, (3, 4), generator=gen)
    depth = torch.tensor([0, 1, 1, 2])
    pos = torch.stack([torch.tensor(n) + depth for n in lens])
    mask = torch.zeros(3, 4, 4, dtype=torch.bool)
    mask[0, :1, :1] = True
    mask[1] = TREE
    mask[2, :2, :2] = torch.tril(torch.ones(2, 2, dtype=torch.bool))
    out.append(model(ids, pos, cache, slots, block_mask=mask, num_new=[1, 4, 2]).logits)
    return out, cache.k.clone(), cache.v.clone()


def assert_fused_equals_loop(model, monkeypatch):
    loop, k_loop, v_loop = forwards(model, False, monkeypatch)
    fused, k_fused, v_fused = forwards(model, True, monkeypatch)
    assert model.__dict__["_fused"][1] is not None, "the fused stack did not apply"
    for a, b in zip(fused, loop):
        assert torch.equal(a, b)
    assert torch.equal(k_fused, k_loop) and torch.equal(v_fused, v_loop)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_the_fused_stack_computes_the_layer_loops_bits(kind, dtype, fmt, monkeypatch):
    lm = tiny_loaded(kind, seed=0, dtype=dtype, hidden=256, intermediate=288)  # q4_k: down_proj falls back to Q8_0
    model = quantize_linears(copy.deepcopy(lm.model), fmt)
    assert_fused_equals_loop(model, monkeypatch)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_parts_of_several_types_side_by_side_with_padded_groups(kind, monkeypatch):
    """q/k/v as a StackedWeight of a Q4_K part and a Q8_0 part of 36 and 92 rows (both end in a padded
    group of 8); with qwen2's bias, added after the parts."""
    lm = tiny_loaded(kind, seed=0, dtype=torch.bfloat16, hidden=256, intermediate=288)
    model = quantize_linears(copy.deepcopy(lm.model), "q8_0")
    for layer, dense in zip(model.layers, lm.model.layers):
        w = dense.qkv_proj.weight.float()
        layer.qkv_proj = QuantLinear(StackedWeight([qweight.quantize_q4_k(w[:36]), qweight.quantize_q8_0(w[36:])]),
                                     dense.qkv_proj.bias)
    assert all(p.packed and p.n % 8 for p in model.layers[0].qkv_proj.weight.parts)
    assert_fused_equals_loop(model, monkeypatch)


def test_the_stack_is_rebuilt_when_a_weight_changes_and_not_used_for_dense_weights(monkeypatch):
    lm = tiny_loaded("llama", seed=0, dtype=torch.bfloat16)
    model = quantize_linears(copy.deepcopy(lm.model), "q8_0")
    assert_fused_equals_loop(model, monkeypatch)
    first = model.__dict__["_fused"][1]
    model.layers[1].down_proj = QuantLinear(qweight.quantize_q8_0(torch.randn(64, 96)))
    assert_fused_equals_loop(model, monkeypatch)
    assert model.__dict__["_fused"][1] is not first
    model.layers[0].o_proj = lm.model.layers[0].o_proj  # one dense linear: the layer loop runs
    forwards(model, True, monkeypatch)
    assert model.__dict__["_fused"][1] is None


def test_a_compiled_forward_traces_the_layer_loop():
    """torch.compile traces the layers one by one (the fused operator is for eager CPU forwards)."""
    if not cpu_kernels.available():
        pytest.skip("needs the CPU kernels")
    model = quantize_linears(copy.deepcopy(tiny_loaded("llama", seed=0, dtype=torch.bfloat16).model), "q8_0")
    torch._dynamo.reset()
    cache = model.new_cache(1, 16)
    slot = cache.allocate()
    cache.reserve([slot], [1])
    ctx = model._context(cache, [slot], torch.tensor([[0]]), None)
    seen = []
    compiled = torch.compile(model.hidden_states, fullgraph=True,
                             backend=lambda gm, _: seen.append(gm) or gm.forward)
    compiled(torch.tensor([[5]]), ctx)
    ops = {str(n.target) for gm in seen for n in gm.graph.nodes if n.op == "call_function"}
    assert "mcsd_cpu.quant_linear" in ops and not any("decoder_stack" in op for op in ops)
