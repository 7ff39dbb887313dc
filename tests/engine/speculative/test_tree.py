"""Tree topology: node counts, level-major order, and sliced masks equal freshly built ones."""

import pytest
import torch

from engine.speculative.tree import TreeTopology, count_nodes, parse_widths


def fresh_mask(parents: list[int]) -> torch.Tensor:
    """Reference: root + nodes, each node sees the root, its ancestors and itself."""
    n = len(parents)
    m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    m[0, 0] = True
    for i in range(n):
        m[i + 1, 0] = m[i + 1, i + 1] = True
        p = parents[i]
        while p >= 0:
            m[i + 1, p + 1] = True
            p = parents[p]
    return m


def build_parents(widths):
    parents, prev = [], [-1]
    for k in widths:
        level = []
        for p in prev:
            for _ in range(k):
                level.append(len(parents))
                parents.append(p)
        prev = level
    return parents


def test_node_counts_match_the_spec():
    assert count_nodes((4, 2, 2)) == 28
    assert count_nodes((4, 2, 2, 1)) == 44
    assert TreeTopology((4, 2, 2, 1)).num_nodes == 44
    assert TreeTopology((4, 2, 2)).level_offsets == (0, 4, 12, 28)


@pytest.mark.parametrize("widths", [(1, 1, 1), (4, 2, 2), (3, 2, 1, 1), (2,)])
def test_full_mask_equals_fresh_mask(widths):
    topo = TreeTopology(widths)
    assert torch.equal(topo.mask, fresh_mask(build_parents(widths)))


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_depth_slice_equals_fresh_mask_and_is_a_view(depth):
    topo = TreeTopology((4, 2, 2))
    sub = topo.subtree((4, 2, 2)[:depth])
    assert torch.equal(sub.mask, fresh_mask(build_parents((4, 2, 2)[:depth])))
    assert sub.mask.data_ptr() == topo.mask.data_ptr()  # sliced, not rebuilt


@pytest.mark.parametrize("widths", [(2, 1), (3, 2, 1), (1, 1, 1), (4, 1, 2)])
def test_narrower_subtree_equals_fresh_mask(widths):
    topo = TreeTopology((4, 2, 2))
    sub = topo.subtree(widths)
    parents = build_parents(widths)
    assert sub.parent.tolist() == parents
    assert torch.equal(sub.mask, fresh_mask(parents))
    assert sub.level_offsets[-1] == count_nodes(widths)
    assert topo.subtree(widths) is sub  # computed once


def test_subtree_must_fit():
    topo = TreeTopology((2, 2))
    with pytest.raises(ValueError, match="does not fit"):
        topo.subtree((3,))
    with pytest.raises(ValueError, match="does not fit"):
        topo.subtree((2, 2, 1))


def test_parse_widths():
    assert parse_widths("4, 2,2") == (4, 2, 2)
    assert parse_widths("") == ()
    with pytest.raises(ValueError):
        parse_widths("4,0")
    with pytest.raises(ValueError):
        parse_widths("a,b")


def test_draft_laws_keep_level_rows_and_gather_them_in_order():
    """``DraftTree.q`` holds the draft model's laws as rows of its levels' probabilities; read one by one
    they are those rows, and ``gather_laws`` brings any mix of them (and laws held whole) back in the
    order asked, cut to the vocabulary, as float32."""
    from engine.speculative.draft_tree import DraftLaws, gather_laws

    gen = torch.Generator().manual_seed(0)
    level1 = torch.rand(3, 7, generator=gen)  # a padded vocabulary: 7 columns for 5 tokens
    level2 = torch.rand(4, 7, generator=gen, dtype=torch.float64)
    whole = torch.rand(5, generator=gen)
    laws = DraftLaws({9: whole})
    laws.set_row(1, level1, 2)
    laws.set_row(4, level2, 0)
    laws.set_row(5, level2, 3)
    laws.set_row(2, level1, 0)
    assert sorted(laws) == [1, 2, 4, 5, 9] and len(laws) == 5 and torch.equal(laws[5], level2[3])
    assert laws.where(9) == (whole, None) and laws.where(3) is None and laws.get(3) is None
    order = [5, 9, 1, 2, 4]
    got = gather_laws([laws.where(r) for r in order], 5)
    assert got.dtype == torch.float32 and got.shape == (5, 5)
    assert torch.equal(got, torch.stack([laws[r][:5].float() for r in order]))
    one_level = gather_laws([laws.where(2), laws.where(1)], 5)  # one source: one index, no reordering
    assert torch.equal(one_level, level1[[0, 2], :5])
    del laws[9]
    assert 9 not in laws and len(laws) == 4


def test_index_ranges_builds_each_rows_range_then_the_fill():
    from engine.speculative.draft_tree import index_ranges

    at, use = index_ranges([5, 0, 9], [2, 0, 4], 4, -7)
    assert at.tolist() == [[5, 6, -7, -7], [-7, -7, -7, -7], [9, 10, 11, 12]]
    assert use.tolist() == [[True, True, False, False], [False] * 4, [True] * 4]
