"""Draft-tree topology: built once for the largest tree, then sliced per step.

A width config ``k = (k1, ..., kγ)`` gives every depth-(d-1) node ``k_d`` children.  Nodes are
stored level-major (BFS) and, within a level, grouped by parent in parent order, children in
sampling order.  Node count up to depth ``d`` is ``C_d = sum_{e<=d} prod_{j<=e} k_j``.

Index 0 of every *block* is the step's root: the last emitted token, not yet in the target's
cache.  Tree node ``i`` (0-based among nodes) sits at block index ``i + 1``.

Because nodes are level-major, the first ``C_s`` nodes form a closed subtree for every ``s``: a
step that drafts only ``s`` levels uses the top-left slice ``mask[:1+C_s, :1+C_s]``.  A narrower
width config ``k' <= k`` selects the nodes whose sibling rank is ``< k'_d`` at every depth of
their path; those index sets are computed once per distinct ``k'`` and cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


def parse_widths(spec: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """``"4,2,2"`` or ``[4, 2, 2]`` -> ``(4, 2, 2)``; ``""`` / ``()`` is the empty tree."""
    if isinstance(spec, str):
        spec = [s for s in spec.replace(" ", "").split(",") if s]
    try:
        widths = tuple(int(k) for k in spec)
    except (TypeError, ValueError):
        raise ValueError(f"tree widths must be integers like '4,2,2', got {spec!r}") from None
    if any(k < 1 for k in widths):
        raise ValueError(f"tree widths must be >= 1, got {list(widths)}")
    return widths


def count_nodes(widths: tuple[int, ...]) -> int:
    total, level = 0, 1
    for k in widths:
        level *= k
        total += level
    return total


@dataclass(frozen=True)
class SubTree:
    """A closed subtree of the full topology, as used by one sequence in one step."""

    widths: tuple[int, ...]
    nodes: torch.Tensor  # [n] indices into the full topology's nodes, level-major
    level_offsets: tuple[int, ...]  # C_0=0, C_1, ..., C_s within ``nodes``
    parent: torch.Tensor  # [n] parent as an index into ``nodes``; -1 = root
    depth: torch.Tensor  # [n] 1-based
    rank: torch.Tensor  # [n] sibling rank
    mask: torch.Tensor  # [1+n, 1+n] bool, block order (root first)

    @property
    def num_nodes(self) -> int:
        return self.level_offsets[-1]  # C_s (a host int: asked hundreds of times a step at batch 32)

    @property
    def max_depth(self) -> int:
        return len(self.widths)

    @cached_property
    def parent_list(self) -> list[int]:
        """``parent`` as a list (made once; callers copy before changing it)."""
        return self.parent.tolist()

    @cached_property
    def depth_list(self) -> list[int]:
        return self.depth.tolist()

    @cached_property
    def rank_list(self) -> list[int]:
        return self.rank.tolist()

    @cached_property
    def level_widths(self) -> list[int]:
        """Nodes at each depth (``[d - 1]``)."""
        return [b - a for a, b in zip(self.level_offsets, self.level_offsets[1:])]

    @cached_property
    def rank_counts(self) -> list[int]:
        """Nodes of each sibling rank."""
        return np.bincount(self.rank.numpy(), minlength=1).tolist() if self.num_nodes else []

    @cached_property
    def sampled_events(self) -> tuple[np.ndarray, np.ndarray]:
        """Every node as its parent's row's event, in verification order: (block row, node) arrays,
        rows ascending, a row's children in node order (made once: a step's trees share subtrees)."""
        rows = self.parent.numpy() + 1
        order = np.argsort(rows, kind="stable")
        return rows[order], order

    def level(self, d: int) -> slice:
        """Node positions (within this subtree) of depth ``d`` (1-based)."""
        return slice(self.level_offsets[d - 1], self.level_offsets[d])

    @cached_property
    def level_masks(self) -> list[torch.Tensor]:
        """``[d - 1]``: what depth ``d``'s nodes see of the tree's nodes, [its nodes, ``C_d``] (the
        rows of :attr:`mask` below the root, its columns up to the level's end, the root's left out):
        a level's draft forward's mask, made once for every tree of this shape."""
        return [self.mask[1 + a: 1 + b, 1: 1 + b] for a, b in zip(self.level_offsets, self.level_offsets[1:])]

    @cached_property
    def level_slots(self) -> list[tuple[np.ndarray, ...]]:
        """``[d - 1]``: depth ``d``'s nodes as int64 arrays (a draft level's placement, made once for every
        tree of this shape): the nodes, each one's parent row among the level's sampled rows (its
        parent's place in level ``d - 1``), its rank among that row's children, and its parent node
        (-1: the root)."""
        out = []
        for d, k in enumerate(self.widths, start=1):
            lv = self.level(d)
            n = np.arange(lv.stop - lv.start, dtype=np.int64)
            pj = n // k
            out.append((lv.start + n, pj, n % k, np.full_like(n, -1) if d == 1 else self.level(d - 1).start + pj))
        return out


class TreeTopology:
    """Parents, depths, ranks and the topology-aware causal mask of the largest tree."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        self.widths = parse_widths(widths)
        parent, depth, rank = [], [], []
        prev_level = [-1]  # the root
        for d, k in enumerate(self.widths, start=1):
            level = []
            for p in prev_level:
                for r in range(k):
                    level.append(len(parent))
                    parent.append(p)
                    depth.append(d)
                    rank.append(r)
            prev_level = level
        self.parent = torch.tensor(parent, dtype=torch.long)  # [N]
        self.depth = torch.tensor(depth, dtype=torch.long)  # [N]
        self.rank = torch.tensor(rank, dtype=torch.long)  # [N]
        self.num_nodes = len(parent)
        self.mask = self._build_mask(parent)  # [1+N, 1+N]
        self._subtrees: dict[tuple[int, ...], SubTree] = {}

    @staticmethod
    def _build_mask(parent: list[int]) -> torch.Tensor:
        n = len(parent)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True  # everyone sees the root
        mask[0, 0] = True
        for i, p in enumerate(parent):  # ancestors' rows are complete before their children's
            mask[i + 1] = mask[p + 1] if p >= 0 else mask[0]
            mask[i + 1, i + 1] = True
        return mask

    @cached_property
    def level_offsets(self) -> tuple[int, ...]:
        offs, level = [0], 1
        for k in self.widths:
            level *= k
            offs.append(offs[-1] + level)
        return tuple(offs)

    def subtree(self, widths: tuple[int, ...]) -> SubTree:
        """The subtree with width config ``widths`` (each ``<=`` ours, no deeper than ours)."""
        widths = tuple(widths)
        cached = self._subtrees.get(widths)
        if cached is not None:
            return cached
        if len(widths) > len(self.widths) or any(a > b for a, b in zip(widths, self.widths)):
            raise ValueError(f"tree {list(widths)} does not fit in the engine's tree {list(self.widths)}")
        if widths == self.widths[: len(widths)]:
            idx = torch.arange(self.level_offsets[len(widths)])  # a prefix: the top-left slice
        else:
            idx = self._select(widths)
        sub = self._make_subtree(widths, idx)
        self._subtrees[widths] = sub
        return sub

    def _select(self, widths: tuple[int, ...]) -> torch.Tensor:
        keep = torch.zeros(self.num_nodes, dtype=torch.bool)
        for i in range(self.level_offsets[len(widths)]):
            d, p = int(self.depth[i]), int(self.parent[i])
            keep[i] = int(self.rank[i]) < widths[d - 1] and (p < 0 or bool(keep[p]))
        return keep.nonzero().flatten()

    def _make_subtree(self, widths: tuple[int, ...], idx: torch.Tensor) -> SubTree:
        remap = torch.full((self.num_nodes,), -1, dtype=torch.long)
        remap[idx] = torch.arange(idx.numel())
        par = self.parent[idx]
        parent = torch.where(par >= 0, remap[par.clamp(min=0)], par)
        n = idx.numel()
        if torch.equal(idx, torch.arange(n)):
            mask = self.mask[: n + 1, : n + 1]  # a prefix of the level-major order: a slice, no copy
        else:
            block_idx = torch.cat([torch.zeros(1, dtype=torch.long), idx + 1])
            mask = self.mask[block_idx][:, block_idx]
        offs, level = [0], 1
        for k in widths:
            level *= k
            offs.append(offs[-1] + level)
        return SubTree(widths=widths, nodes=idx, level_offsets=tuple(offs), parent=parent,
                       depth=self.depth[idx], rank=self.rank[idx],
                       mask=mask)
