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
