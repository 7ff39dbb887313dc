"""Blocks of different lengths in one forward (``engine/batching.py``, ``engine.models.llama.Packing``):
the engine's linears run the real rows only, in prefill and in verification, and each request's
greedy output is the one it gets alone."""

from __future__ import annotations

import random

from engine import runner
from engine.models import llama
from tests.engine_utils import run_engine


def prefill_linear_rows(monkeypatch) -> list[list[int]]:
    """For every prefill call of the engine, the rows of every linear it ran, in order."""
    calls: list[list[int]] = []
    real_linear, real_prefill = llama.linear, runner.ModelRunner.prefill
    active: list[list[int]] = []

    def counting(x, weight, bias=None):
        if active:
            active[-1].append(x.reshape(-1, x.shape[-1]).shape[0])
        return real_linear(x, weight, bias)

    def prefill(self, chunks):
        active.append([])
        try:
            return real_prefill(self, chunks)
        finally:
            calls.append(active.pop())

    monkeypatch.setattr(llama, "linear", counting)
    monkeypatch.setattr(runner.ModelRunner, "prefill", prefill)
    return calls


def test_the_engine_prefills_mixed_prompts_without_padding_them_and_decodes_as_alone(tiny_target, monkeypatch):
    """Four prompts of 60, 7, 25 and 9 tokens prefill in forwards whose linears see exactly their
    tokens (a padded forward would run 4 x 59 rows), and each request's greedy output is the one it
    gets prefilled alone."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 100) for _ in range(n)] for n in (60, 7, 25, 9)]  # no shared prefixes
    calls = prefill_linear_rows(monkeypatch)
    layers = 4 * tiny_target.model.cfg.num_layers  # qkv, o, gate_up, down per layer, then the output layer
    together, _ = run_engine(tiny_target, None, prompts, tree=(), max_tokens=6, ignore_eos=True)
    monkeypatch.undo()
    tokens = sum(len(p) - 1 for p in prompts)  # the last prompt token is each sequence's first root
    assert sum(c[0] for c in calls) == tokens  # one forward's worth of rows per call, no padding
    for c in calls:
        assert len(c) == layers + 1 and c[:layers] == [c[0]] * layers
    for p, out in zip(prompts, together):
        alone, _ = run_engine(tiny_target, None, [p], tree=(), max_tokens=6, ignore_eos=True)
        assert out.tokens == alone[0].tokens


def test_block_logits_give_each_block_its_rows_and_a_level_at_once():
    """``run_blocks``' logits: block ``i``'s first ``counts[i]`` rows, one at a time or several blocks'
    rows together, block after block: a view of the forward's when they are every block and all full."""
    import torch

    from engine.batching import BlockLogits

    logits = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)
    full = BlockLogits(logits, [2, 2, 2])
    assert len(full) == 3 and torch.equal(full[1], logits[1]) and [t.shape[0] for t in full] == [2, 2, 2]
    whole = full.rows()
    assert torch.equal(whole, logits.reshape(6, 4)) and whole.data_ptr() == logits.data_ptr()  # no copy
    assert torch.equal(full.rows([2, 0]), torch.cat([logits[2], logits[0]]))
    ragged = BlockLogits(logits, [1, 2, 1])
    assert torch.equal(ragged[0], logits[0, :1]) and len(ragged[0:2]) == 2
    assert torch.equal(ragged.rows(), torch.cat([logits[0, :1], logits[1], logits[2, :1]]))
    assert torch.equal(ragged.rows([1]), logits[1])
