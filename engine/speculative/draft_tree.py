"""The tree one sequence verifies in one step, whoever drafted it.

A :class:`DraftTree` starts as the draft model's tree: a closed subtree of the engine's prebuilt
topology (``sub``), whose mask is a slice of the mask built once at start-up.  Other drafters
(Max-Gram, the cascade) *append* nodes after it with :meth:`DraftTree.add_path`; the mask of an
extended tree is the prebuilt slice plus one row per appended node (its parent's row and itself).

Node ``i`` sits at block row ``i + 1``; row 0 is the step's root.

**Proposals and q.**  Verification (``engine.speculative.verify``) tries, at every row, a list of
*proposal events* ``(node, kind)`` in order:

* ``ONEHOT``: a deterministic proposal (a statistical drafter).  Its law is the point mass on the
  node's token, so it is accepted with probability ``p(x)`` and a rejection turns the target
  distribution into ``norm((p - e_x)+)`` (``x`` removed).
* ``SAMPLED``: a token drawn from the draft model's ``q`` at that row (``DraftTree.q[row]``);
  accepted with ``min(1, p(x)/q(x))``, residual ``norm((p - q)+)``, and, when siblings were drawn
  without replacement, ``x`` removed from ``q`` for the next sampled sibling.

A row's one-hot events come first, then its sampled events.  **A node proposed by several drafters
is one node with one event per proposal**: when Max-Gram proposes a token the draft model also drew,
the node gets a ``ONEHOT`` event (tried first) and keeps its ``SAMPLED`` event.  Each event is an
ordinary speculative-sampling step whose candidate has exactly the stated law given everything tried
before it (Max-Gram's token is a function of the context; the draft's samples do not depend on it),
so by induction over the events the emitted token has law ``p``; a second event for a token already
rejected simply has acceptance probability 0 (``p(x)`` was zeroed by the residual) but still updates
the residual, as the proof requires.  ``tests/engine/speculative/test_drafters.py`` checks this distributionally.
Duplicate one-hot proposals of the same token at the same row (two Max-Gram branches with a shared
prefix) are one event: a deterministic proposal repeated carries no new information.
"""

from __future__ import annotations

import itertools
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np
import torch

from engine.device import to_device_many, to_host
from engine.speculative.features import NodeFeatures
from engine.speculative.tree import SubTree

if TYPE_CHECKING:
    from engine.grammar import Masks

#: a draft child slot that could not be filled (its parent's ``q`` had fewer tokens than the width)
DEAD = -1
ONEHOT, SAMPLED = 0, 1

#: drafter names used in per-method statistics (a node may carry several)
DRAFT_MODEL, MAXGRAM, CASCADE, BIGRAM = "draft", "maxgram", "cascade", "bigram"


class DraftLaws(MutableMapping):
    """Block row -> the [vocab] law its sampled children were drawn from (``DraftTree.q``).  The draft
    model's laws are rows of its levels' probabilities, kept as (level tensor, row index)
    (:meth:`set_row`) and made a tensor view only when read one by one: verification gathers a step's
    laws with one index per level (:func:`gather_laws`), not one view a row (hundreds a step at
    batch 32)."""

    def __init__(self, laws: Optional[dict[int, torch.Tensor]] = None) -> None:
        self._at: dict[int, tuple[torch.Tensor, Optional[int]]] = {row: (law, None) for row, law in (laws or {}).items()}

    def set_row(self, row: int, source: torch.Tensor, index: int) -> None:
        """Row ``row``'s law is ``source[index]``."""
        self._at[row] = (source, index)

    def where(self, row: int) -> Optional[tuple[torch.Tensor, Optional[int]]]:
        """(source, index) of the row's law (index None: the source is the law), or None."""
        return self._at.get(row)

    def __getitem__(self, row: int) -> torch.Tensor:
        source, index = self._at[row]
        return source if index is None else source[index]

    def __setitem__(self, row: int, law: torch.Tensor) -> None:
        self._at[row] = (law, None)

    def __delitem__(self, row: int) -> None:
        del self._at[row]

    def __iter__(self) -> Iterator[int]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)


def gather_laws(places: list[tuple[torch.Tensor, Optional[int]]], vocab_size: int) -> torch.Tensor:
    """The laws at ``places`` (:meth:`DraftLaws.where`) as one float32 [len(places), vocab_size] tensor,
    in order: one index a source for the rows of a level, one stack for the laws held whole; the
    indices reach the device in one copy."""
    groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}  # id(source) -> (source, places, rows)
    whole_at, whole = [], []
    for n, (source, index) in enumerate(places):
        if index is None:
            whole_at.append(n)
            whole.append(source[:vocab_size].float())
        else:
            group = groups.setdefault(id(source), (source, [], []))
            group[1].append(n)
            group[2].append(index)
    order = whole_at + [n for _, at, _ in groups.values() for n in at]
    inverse = np.empty(len(order), dtype=np.int64)
    inverse[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
    in_order = bool((inverse == np.arange(len(order))).all())
    # rows not consecutive in their source, and the permutation back to ``places``' order, are indices
    # on the device: copied together
    sources = [(source, rows, rows == list(range(rows[0], rows[0] + len(rows)))) for source, _, rows in groups.values()]
    host = [torch.tensor(rows, dtype=torch.long) for _, rows, sliced in sources if not sliced]
    host += [] if in_order else [torch.from_numpy(inverse)]
    device = sources[0][0].device if sources else whole[0].device
    on_device = iter(to_device_many(host, device) if host else [])
    parts = [torch.stack(whole)] if whole else []
    for source, rows, sliced in sources:
        # consecutive rows: a slice, no index
        rows_of = source[rows[0]: rows[0] + len(rows)] if sliced else source.index_select(0, next(on_device))
        parts.append(rows_of[:, :vocab_size].float())
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out if in_order else out[next(on_device)]


def index_ranges(starts: list[int], lengths: list[int], width: int, fill: int) -> tuple[np.ndarray, np.ndarray]:
    """Row i: ``starts[i] + j`` for ``j < lengths[i]``, then ``fill``, ``width`` columns (int64), and where
    the range is (bool): index tables built on the host at once, not a few tensor writes a row."""
    cols = np.arange(width, dtype=np.int64)
    use = cols[None, :] < np.asarray(lengths, dtype=np.int64).reshape(-1, 1)
    return np.where(use, np.asarray(starts, dtype=np.int64).reshape(-1, 1) + cols[None, :], fill), use


@dataclass
class DraftTree:
    """What one sequence drafted in one step."""

    sub: SubTree
    tokens: list[int]  # [n] node tokens, DEAD where a child could not be drawn
    q: DraftLaws = field(default_factory=DraftLaws)  # block row -> [vocab] its sampled children's law
    drafted_levels: int = 0  # levels of ``sub`` actually run through the draft (s - 1)
    features: list[NodeFeatures] = field(default_factory=list)  # per sampled level, when the policy wants them
    scores: list[torch.Tensor] = field(default_factory=list)  # per level [level nodes], the policy's own use
    # nodes appended by other drafters (indices >= sub.num_nodes)
    extra_parent: list[int] = field(default_factory=list)  # parent node, -1 = the root
    extra_events: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # row -> [(node, kind)]
    sources: dict[int, set[str]] = field(default_factory=dict)  # node -> drafters (absent: the draft model)
    # node -> index of its entry among the draft cache's pending entries (-1: not run); None means
    # the draft model's usual layout: the first ``level_offsets[drafted_levels]`` nodes, in order
    draft_index: Optional[list[int]] = None
    joint_logq: Optional[torch.Tensor] = None  # MJSD (lossy): [n] log q of each chain token, on the device
    grammar_masks: Optional["Masks"] = None  # structured output: each row's allowed tokens (speculative.constrained)
    #: the device holder of ``tokens`` while the host has not read them (:class:`HeldTokens`); reading
    #: ``tokens`` reads them then, so only code that must not wait for the device looks here first
    unread: Optional["HeldTokens"] = field(default=None, repr=False, compare=False)
    #: how many of the first nodes a holder keeps (None: the drafted ones, ``num_sub``); nodes appended
    #: on the device (Max-Gram's tail, ``device_maxgram``) count too
    held: Optional[int] = None
    #: Max-Gram's tail came with the tree (the device cascade proposes it after its chain's end)
    has_tail: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.q, DraftLaws):  # laws given whole ({row: law}: tests, a drafter's own)
            self.q = DraftLaws(self.q)

    def cut(self, sub: SubTree) -> None:
        """Stop at ``sub``, a prefix of this tree's subtree (its first ``sub.num_nodes`` nodes).
        Only before other drafters appended nodes."""
        assert not self.extra_parent, "cut a tree before appending nodes to it"
        self.sub = sub
        self.tokens = self.tokens[: sub.num_nodes]
        self.grammar_masks = None

    # ------------------------------------------------------------------ shape
    @property
    def num_nodes(self) -> int:
        return len(self._tokens)  # known without reading tokens still on the device

    @property
    def num_sub(self) -> int:
        return self.sub.num_nodes

    @property
    def num_held(self) -> int:
        """The first nodes whose tokens a holder keeps while the tree is unread (the rest are the host's)."""
        return self.sub.num_nodes if self.held is None else self.held

    def parents(self) -> list[int]:
        return self.sub.parent_list + self.extra_parent

    def depths(self) -> list[int]:
        depth = list(self.sub.depth_list)
        for p in self.extra_parent:
            depth.append(1 + (depth[p] if p >= 0 else 0))
        return depth

    def ranks(self) -> list[int]:
        """Sibling rank: order among the parent's children (drafted children first)."""
        rank = list(self.sub.rank_list)
        if not self.extra_parent:
            return rank
        kids: dict[int, int] = {}
        for p in self.sub.parent_list:
            kids[p] = kids.get(p, 0) + 1
        for p in self.extra_parent:
            rank.append(kids.get(p, 0))
            kids[p] = kids.get(p, 0) + 1
        return rank

    def mask(self) -> Optional[torch.Tensor]:
        """[1+n, 1+n] bool block mask (root first); ``None`` for the empty tree."""
        if not self.num_nodes:
            return None
        if not self.extra_parent:
            return self.sub.mask
        m, n = self.num_sub, self.num_nodes
        # numpy, not torch: a row a node appended, for every tree of a step (a torch op's dispatch each)
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[: m + 1, : m + 1] = self.sub.mask.numpy()
        for j, p in enumerate(self.extra_parent):  # parents precede children
            row = m + 1 + j
            mask[row] = mask[p + 1]
            mask[row, row] = True
        return torch.from_numpy(mask)

    def known_tokens_after(self, n: int) -> list[int]:
        """The host's tokens of the nodes after the first ``n`` (appended ones)."""
        return self._tokens[n:]

    def known_token(self, node: int) -> int:
        """``node``'s token as the host knows it: right for a read tree and for nodes appended by the host
        (a held tree's drafted nodes are still on the device)."""
        return self._tokens[node]

    def node_sources(self, node: int) -> set[str]:
        return self.sources.get(node, {DRAFT_MODEL})

    # ------------------------------------------------------------------ proposals
    def events(self, live_only: bool = True) -> list[list[tuple[int, int]]]:
        """``out[row]``: proposal events ``(node, kind)`` at block row ``row``, in verification order
        (one-hot events first, then sampled ones; sampled siblings in sampling order).  ``live_only=False``:
        the drafted nodes' events whether their token is DEAD or not (read without the tokens)."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.num_nodes + 1)]
        sampled: list[list[tuple[int, int]]] = [[] for _ in range(self.num_nodes + 1)]
        tokens = self.tokens if live_only else None
        for i, p in enumerate(self.sub.parent_list):
            if tokens is None or tokens[i] != DEAD:
                sampled[p + 1].append((i, SAMPLED))
        for row, evs in self.extra_events.items():
            for ev in evs:
                (out if ev[1] == ONEHOT else sampled)[row].append(ev)
        return [o + s for o, s in zip(out, sampled)]

    def event_table(self, live_only: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`events` as arrays, one entry an event: (block row, node, kind), rows ascending, each
        row's events in verification order.  ``live_only``: events whose token is DEAD left out (reads
        the tokens); else every event, as ``events(live_only=False)`` (the extra nodes' too)."""
        rows, nodes = self.sub.sampled_events
        kinds = np.full(len(nodes), SAMPLED)
        if self.extra_events:
            extra = np.array([(row, node, kind) for row, evs in self.extra_events.items() for node, kind in evs],
                             dtype=np.int64).reshape(-1, 3)
            group = np.concatenate([np.ones(len(nodes), dtype=np.int64), np.where(extra[:, 2] == ONEHOT, 0, 2)])
            rows, nodes, kinds = (np.concatenate([a, extra[:, i]]) for i, a in enumerate((rows, nodes, kinds)))
            order = np.lexsort((np.arange(len(rows)), group, rows))  # one-hot, drafted, then appended sampled
            rows, nodes, kinds = rows[order], nodes[order], kinds[order]
        if live_only and len(nodes):
            live = np.asarray(self.tokens, dtype=np.int64)[nodes] != DEAD
            rows, nodes, kinds = rows[live], nodes[live], kinds[live]
        return rows, nodes, kinds

    def add_path(self, parent: int, tokens: list[int], source: str, kind: int = ONEHOT,
                 q: Optional[list[torch.Tensor]] = None, merge: bool = True) -> list[int]:
        """Appends a chain of proposals below node ``parent`` (-1 = the root), sharing existing nodes
        with the same token; returns the chain's node indices.  ``kind=SAMPLED`` chains carry the law
        each token was drawn from (``q[j]`` for ``tokens[j]``), stored at its parent's row.
        ``merge=False``: every token a node of its own, and the tree's tokens are not read (they may
        still be on the device); a sibling with the same token is then a second event for it, which the
        rule tries as it would on one node (lossless, ``tests/exact_law.py``)."""
        nodes, children = [], self._children_by_token() if merge else {}
        self.grammar_masks = None  # new rows
        for j, tok in enumerate(tokens):
            row = parent + 1
            node = children.get((parent, tok))
            if node is None:
                node = self.num_nodes
                self._tokens.append(tok)
                self.extra_parent.append(parent)
                children[(parent, tok)] = node
                self.sources[node] = {source}
            else:
                self.sources[node] = self.node_sources(node) | {source}
            evs = self.extra_events.setdefault(row, [])
            if kind == SAMPLED:
                assert row not in self.q or not any(c for c, k in evs if k == SAMPLED), \
                    "one sampled chain per row"
                self.q[row] = q[j]
                evs.append((node, SAMPLED))
            elif (node, ONEHOT) not in evs:
                evs.append((node, ONEHOT))
            nodes.append(node)
            parent = node
        return nodes

    def _children_by_token(self) -> dict[tuple[int, int], int]:
        out = {}
        for i, p in enumerate(self.parents()):
            if self.tokens[i] != DEAD:
                out.setdefault((p, self.tokens[i]), i)
        return out

    def path_to(self, node: int) -> list[int]:
        """Tokens from the root's child down to ``node`` (inclusive); [] for the root (-1)."""
        parents, out = self.parents(), []
        while node >= 0:
            out.append(self.tokens[node])
            node = parents[node]
        return out[::-1]

    def leaves(self) -> list[int]:
        """Live nodes without live children, deepest first."""
        parents = self.parents()
        has_child = {p for i, p in enumerate(parents) if self.tokens[i] != DEAD}
        depth = self.depths()
        live = [i for i in range(self.num_nodes) if self.tokens[i] != DEAD and i not in has_child]
        return sorted(live, key=lambda i: -depth[i])

    # ------------------------------------------------------------------ draft cache
    def draft_entries(self, accepted: list[int]) -> list[int]:
        """Pending draft-cache entries of the accepted path that the draft model ran (a prefix of the
        path: drafted nodes precede appended ones)."""
        if self.draft_index is None:
            ran = self.sub.level_offsets[self.drafted_levels]
            return [i for i in accepted if i < ran]
        out = []
        for i in accepted:
            e = self.draft_index[i] if i < len(self.draft_index) else -1
            if e < 0:
                break
            out.append(e)
        return out


class HeldTokens:
    """The drafted tokens of a step's trees, on the device until the host reads them: verification
    gathers them there (``verify.TreeBatch``, ``runner.verification_ids``) and reads them back with its
    decisions, in the step's one read (:meth:`fill`); whoever reads a tree's ``tokens`` before that
    reads them all (:meth:`read`).  Flat: tree ``j``'s node ``n`` is entry ``offsets[j] + n`` of
    ``flat`` (which a subclass fills); the last entry is a live stand-in for every root.  A subclass
    may bring more back with the tokens (:meth:`tensors`, :meth:`fill`)."""

    flat: torch.Tensor

    def __init__(self, trees: list[DraftTree]) -> None:
        sizes = [t.num_nodes for t in trees]
        self.trees = trees  # every tree of the step, in the drafter's order
        self.offsets = list(itertools.accumulate(sizes, initial=0))[:-1]
        self.root = sum(sizes)
        self._offset_of = {id(t): off for t, off in zip(trees, self.offsets)}

    def hold(self) -> None:
        """The trees are whole: their tokens stay here until read (``DraftTree.unread``)."""
        for t in self.trees:
            t.unread = self

    def offset_of(self, tree: DraftTree) -> int:
        """Where ``tree``'s first node is in :attr:`flat`."""
        return self._offset_of[id(tree)]

    def tensors(self) -> list[torch.Tensor]:
        """What the host reads back: the tokens first."""
        return [self.flat]

    def append(self, grown: list[tuple[DraftTree, int]], values: torch.Tensor, at: list[int]) -> None:
        """Each ``(tree, n)`` of ``grown`` (trees of :attr:`trees`) holds ``n`` more nodes after its held
        ones: the last ``n`` the host appended to it, with placeholder tokens.  Their tokens are
        ``values[at]`` (a device tensor; ``at`` lists the first tree's new nodes, then the next
        tree's...).  The flat layout is rebuilt: a few device operations and one copy, no read."""
        more = {id(t): n for t, n in grown}
        old = [(t, self._offset_of[id(t)], t.num_held) for t in self.trees]
        sizes = [size + more.get(id(t), 0) for t, _, size in old]
        offsets = list(itertools.accumulate(sizes, initial=0))[:-1]
        root = sum(sizes)
        src = np.concatenate([np.arange(off, off + size) for _, off, size in old] + [np.array([self.root])])
        dst = np.concatenate([np.arange(off, off + size) for (_, _, size), off in zip(old, offsets)]
                             + [np.array([root])])
        first_new = {id(t): off + size for (t, _, size), off in zip(old, offsets)}
        added = np.concatenate([np.arange(first_new[id(t)], first_new[id(t)] + n) for t, n in grown])
        src_t, dst_t, added_t, at_t = to_device_many(
            [torch.from_numpy(x.astype(np.int64)) for x in (src, dst, added, np.asarray(at))], self.flat.device)
        flat = torch.full((root + 1,), DEAD, dtype=self.flat.dtype, device=self.flat.device)
        flat.index_copy_(0, dst_t, self.flat.index_select(0, src_t))
        flat.index_copy_(0, added_t, values.index_select(0, at_t).to(flat.dtype))
        self.flat, self.offsets, self.root = flat, offsets, root
        self._offset_of = {id(t): off for t, off in zip(self.trees, offsets)}
        for t, size in zip(self.trees, sizes):
            t.held = size

    def read(self) -> None:
        """Reads every held tree's tokens now, in one host read."""
        self.fill(to_host(*self.tensors()))

    def fill(self, host: list[torch.Tensor]) -> bool:
        """Every held tree's tokens from ``host`` (:meth:`tensors` read back, with other results or by
        :meth:`read`); False when they were filled already."""
        if all(tree.unread is not self for tree in self.trees):
            return False
        flat = host[0].tolist()
        for off, tree in zip(self.offsets, self.trees):
            if tree.unread is self:
                tree.unread = None
                size = tree.num_held  # nodes the host appended since (``add_path(merge=False)``) are its own
                tree.tokens = flat[off: off + size] + tree.known_tokens_after(size)
        return True


def holders(trees) -> list:
    """The distinct holders (``DraftTree.unread``) of the ``trees`` whose tokens are still on the
    device, in the trees' order."""
    return list({id(t.unread): t.unread for t in trees if t.unread is not None}.values())


def joined(held: list) -> tuple[Optional[torch.Tensor], dict[int, int]]:
    """The flats of the holders ``held`` as one device tensor (the one flat itself when there is one
    holder; None for none), and where each holder's starts in it, by ``id``."""
    starts = dict(zip(map(id, held), itertools.accumulate([0] + [h.flat.numel() for h in held])))
    if not held:
        return None, starts
    return (held[0].flat if len(held) == 1 else torch.cat([h.flat for h in held])), starts


def _read_tokens(tree: DraftTree) -> list[int]:
    if tree.unread is not None:  # the first host read of a tree whose tokens are still on the device
        tree.unread.read()
    return tree._tokens


def _set_tokens(tree: DraftTree, tokens: list[int]) -> None:
    tree._tokens = tokens


DraftTree.tokens = property(_read_tokens, _set_tokens, doc="""[n] node tokens, DEAD where a child could not be
drawn; read from the device first if they are still there (``unread``)""")
