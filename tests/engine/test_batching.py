"""Packing blocks into forwards (``engine/batching.py``): prefill chunks of very different lengths are
not padded to the longest one."""

from __future__ import annotations

import random

import pytest

from engine import batching, runner
from tests.engine_utils import run_engine


def padded_rows(lengths: list[int], groups: list[list[int]]) -> int:
    return sum(max(lengths[i] for i in g) * len(g) for g in groups)


@pytest.mark.parametrize("seed", range(20))
def test_groups_cover_every_block_once_within_the_padding_bound(seed):
    rng = random.Random(seed)
    lengths = [rng.randrange(1, 300) for _ in range(rng.randrange(1, 9))]
    groups = batching.padding_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        real = sum(lengths[i] for i in g)
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= 1.25 * real


def test_mixed_prompts_split_and_similar_ones_share_a_forward():
    lengths = [157, 64, 43, 41]  # four chat prompts that arrived together
    groups = batching.padding_groups(lengths)
    assert padded_rows(lengths, groups) <= 1.1 * sum(lengths)  # 326 rows for 305 tokens
    assert padded_rows(lengths, [[0, 1, 2, 3]]) == 628  # what one padded forward computed
    assert batching.padding_groups([20, 19, 18, 20]) == [[0, 3, 1, 2]]  # one forward, nearly no padding


def test_the_engine_prefills_mixed_prompts_without_padding_them_and_decodes_as_alone(tiny_target, monkeypatch):
    """Prefill rows actually run stay within the bound, and each request's greedy output is the one
    it gets prefilled alone."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 100) for _ in range(n)] for n in (60, 7, 25, 9)]  # no shared prefixes
    rows: list[int] = []
    real = runner.run_blocks

    def counting(model, cache, blocks, vocab=None):
        if not any(b.logit_rows for b in blocks):  # a prefill forward
            rows.append(len(blocks) * max(len(b.tokens) for b in blocks))
        return real(model, cache, blocks, vocab)

    monkeypatch.setattr(runner, "run_blocks", counting)
    together, _ = run_engine(tiny_target, None, prompts, tree=(), max_tokens=6, ignore_eos=True)
    monkeypatch.setattr(runner, "run_blocks", real)
    assert 0 < sum(rows) <= 1.25 * sum(len(p) - 1 for p in prompts)  # the last prompt token is the root
    for p, out in zip(prompts, together):
        alone, _ = run_engine(tiny_target, None, [p], tree=(), max_tokens=6, ignore_eos=True)
        assert out.tokens == alone[0].tokens
