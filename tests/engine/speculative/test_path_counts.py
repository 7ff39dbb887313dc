"""Tokens held on the device while the draft grows its trees (``proposer.DeviceTokens``): each level
is placed where the host would place it, and penalty counts of tree rows (``history.PathCounts``),
counted on the device from where the draft left the tokens, equal the counts from the host's tokens,
dead nodes included."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch

from engine.speculative.draft_tree import DEAD, DraftTree
from engine.speculative.history import PathCounts, batch_histories
from engine.speculative import proposer
from engine.speculative.proposer import DeviceTokens, DraftModelProposer
from engine.speculative.tree import TreeTopology

VOCAB = 11


class Seq:
    def __init__(self, counts):
        self.output_counts = counts
        self.prompt_mask = None


def trees_with_tokens(seed: int):
    topo = TreeTopology((3, 2, 2))
    rng = random.Random(seed)
    trees = []
    for widths in [(3, 2, 2), (2, 1), (1, 1, 1)]:
        sub = topo.subtree(widths)
        tokens = [rng.choice([DEAD] + list(range(VOCAB))) for _ in range(sub.num_nodes)]
        parents = sub.parent.tolist()[: sub.num_nodes]
        for i, p in enumerate(parents):  # a child of a dead node is dead, as drafted
            if p >= 0 and tokens[p] == DEAD:
                tokens[i] = DEAD
        trees.append(DraftTree(sub, tokens))
    return trees


def test_device_paths_equal_host_paths():
    for seed in range(20):
        trees = trees_with_tokens(seed)
        held = DeviceTokens(trees, torch.device("cpu"))
        for t, off in zip(trees, held.offsets):  # the draft's placement, without drawing
            held.flat[off: off + t.num_nodes] = torch.tensor(t.tokens)
        host, device, at = PathCounts(), PathCounts(), 0
        for t, off in zip(trees, held.offsets):
            rows = list(range(1 + t.num_nodes))
            host.add_tree(at, rows, t)
            device.add_tree(at, rows, t, held.flat, off)
            at += len(rows)
        base = torch.randint(0, 3, (at, VOCAB), dtype=torch.int32)
        want, got = host.into(base.clone()), device.into(base.clone())
        assert torch.equal(got, want)
        assert int((want - base).sum()) > 0  # some path tokens were counted


def test_held_trees_are_counted_without_reading_them():
    trees = trees_with_tokens(3)
    tokens = [list(t.tokens) for t in trees]
    seqs = [Seq(torch.randint(0, 2, (VOCAB,), dtype=torch.int32)) for _ in trees]
    rows = 1 + max(t.num_nodes for t in trees)
    want, _ = batch_histories(seqs, trees, rows, VOCAB, torch.device("cpu"))
    held = DeviceTokens(trees, torch.device("cpu"))
    for t, off, toks in zip(trees, held.offsets, tokens):
        held.flat[off: off + t.num_nodes] = torch.tensor(toks)
        t.tokens = [DEAD] * t.num_nodes  # what the host has before the read
    held.hold()
    got, _ = batch_histories(seqs, trees, rows, VOCAB, torch.device("cpu"))
    assert all(t.unread is held for t in trees)  # nothing read them
    assert torch.equal(got, want)


@pytest.mark.parametrize("shapes", [[(3, 2, 2)] * 4, [(3, 2, 2)], [(3, 2, 2), (2, 1), (1, 1, 1)], [(2, 2), (3, 1)]],
                         ids=["one-shape", "one-tree", "three-shapes", "two-shapes"])
def test_each_level_is_placed_on_the_device_where_the_host_places_it(shapes):
    """``DeviceTokens.place`` (one write for a first level of trees of one shape, a gather otherwise)
    leaves every node's token where ``DraftModelProposer._place`` puts it on the host: a row's
    ``rank``-th child, DEAD where the draw gave none or the parent is dead."""
    topo = TreeTopology((3, 2, 2))
    gen = torch.Generator().manual_seed(len(shapes))
    real, dead = proposer.to_device_many, 0
    for _ in range(10):
        subs = [topo.subtree(w) for w in shapes]
        trees, host = ([DraftTree(s, [DEAD] * s.num_nodes) for s in subs] for _ in range(2))
        held = DeviceTokens(trees, torch.device("cpu"))
        for d in range(1, max(s.max_depth for s in subs) + 1):
            active = [i for i, s in enumerate(subs) if s.max_depth >= d]
            rows = [len(DraftModelProposer._parent_rows(subs[i], d)) for i in active]
            first = [sum(rows[:j]) for j in range(len(active))]
            width = max(subs[i].widths[d - 1] for i in active)
            chosen = torch.randint(-1, VOCAB, (sum(rows), width), generator=gen)  # -1: DEAD, no draw
            with mock.patch.object(proposer, "to_device_many", side_effect=real) as copies:
                held.place(active, [trees[i] for i in active], d, first, chosen)
            if d == 1 and len(set(shapes)) == 1:  # one write, no index copied
                assert copies.call_count == 0
            DraftModelProposer._place([host[i] for i in active], d, chosen.tolist(), first)
        got = [held.flat[off: off + t.num_nodes].tolist() for t, off in zip(trees, held.offsets)]
        assert got == [t.tokens for t in host]
        dead += sum(tok == DEAD for t in host for tok in t.tokens)
    assert dead  # dead nodes occurred
