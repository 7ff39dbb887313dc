"""The decoder stack compiles as one graph: ``torch.compile(model.hidden_states, fullgraph=True)``
traces every op of a forward (our CPU kernels through their shape-only versions, the paged cache's
writes, the attention over the pool) without a graph break, at fixed shape buckets, and computes
what the eager forward computes.  Checked with the ``eager`` backend: capturing the whole graph is
the property; code generation is the backend's business (inductor on a GPU)."""

from __future__ import annotations

import pytest
import torch

from engine.models import cpu_kernels
from engine.models.qweight import quantized_copy
from tests.tiny import tiny_loaded


def forward_both(model, ids, pos, block_mask=None):
    """Hidden states of one forward, eager and compiled, each on a fresh cache of the same layout."""
    outs = []
    for compiled in (False, True):
        cache = model.new_cache(ids.shape[0], 64, block_size=4)
        slots = [cache.allocate() for _ in range(ids.shape[0])]
        if ids.shape[0] > 1:  # scattered blocks: the batch reads the pool through its rows
            for s in reversed(slots):
                cache.reserve([s], [5])
        cache.reserve(slots, [ids.shape[1]] * len(slots))
        ctx = model._context(cache, slots, pos, block_mask)
        fn = torch.compile(model.hidden_states, fullgraph=True, backend="eager") if compiled else model.hidden_states
        outs.append((fn(ids, ctx), cache.k.clone()))
    return outs


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "q8_0"])
@pytest.mark.parametrize("shape", ["decode-1", "tree-4"])
def test_the_decoder_stack_compiles_without_graph_breaks(weights, shape):
    """fp32 and bf16 weights, and GGUF blocks (a Q8_0 copy: the integer kernels)."""
    torch._dynamo.reset()
    if weights == "q8_0":
        if not cpu_kernels.available():
            pytest.skip("the quantized kernels need the CPU kernels")
        model = quantized_copy(tiny_loaded("llama", seed=0).model.to(torch.bfloat16), "q8_0")
    else:
        model = tiny_loaded("llama", seed=0).model.to(getattr(torch, weights))
    if shape == "decode-1":
        ids, pos, mask = torch.tensor([[5]]), torch.tensor([[0]]), None
    else:
        ids = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(0))
        pos = torch.tensor([0, 1, 1, 2, 2, 3]).expand(4, 6)
        mask = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                             [1, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]], dtype=torch.bool)
        mask = mask.expand(4, 6, 6)
    (eager, k_eager), (compiled, k_compiled) = forward_both(model, ids, pos, mask)
    assert torch.equal(eager, compiled) and torch.equal(k_eager, k_compiled)
    explain = torch._dynamo.explain(model.hidden_states)(ids, model._context(
        *_fresh(model, ids.shape[0], ids.shape[1]), pos, mask))
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    if cpu_kernels.available():  # the CPU kernels are in the graph, not around it
        ops = {str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"}
        assert any("mcsd_cpu" in op for op in ops), ops


def _fresh(model, batch: int, block: int):
    cache = model.new_cache(batch, 64, block_size=4)
    slots = [cache.allocate() for _ in range(batch)]
    cache.reserve(slots, [block] * batch)
    return cache, slots
