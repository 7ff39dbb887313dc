"""Draft-side features of drafted tree nodes, for the acceptance head and the online calibrator.

Every feature of a node describes what the draft knew when it drew the node: its parent's draft
distribution ``q`` (the law the children were drawn from; at temperature 0 the softmax of the
processed logits) and, optionally, the draft's final hidden state at the parent's row.

* ``q_token``   q(x) of the node's own token;
* ``entropy``   entropy of q at the parent (nats);
* ``top_probs`` the parent's ``TOP_K`` largest probabilities of q, descending (zero-padded);
* ``depth``     1-based distance from the step's root; ``rank`` 0-based sibling order.

Labels (used by ``train_head`` and the calibrator) are ``P(node accepted | parent reached)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

TOP_K = 10
DEPTH_BUCKETS = 8  # depth one-hot: 1..7, 8+
RANK_BUCKETS = 4  # rank one-hot: 0..2, 3+
CHEAP_FEATURES = (
    ["entropy"] + [f"top{i + 1}" for i in range(TOP_K)] + ["q_token", "log_q_token"]
    + [f"depth={d + 1}" for d in range(DEPTH_BUCKETS)] + [f"rank={r}" for r in range(RANK_BUCKETS)]
)


@dataclass
class NodeFeatures:
    """Features of ``n`` drafted nodes (one tree level, or several levels concatenated in node order).
    ``entropy``/``top_probs``/``hidden`` are ``None`` when the consumer asked only for ``q_token``."""

    depth: torch.Tensor  # [n] int64, 1-based
    rank: torch.Tensor  # [n] int64
    q_token: torch.Tensor  # [n] float32
    live: torch.Tensor  # [n] bool, False where the slot is DEAD (no token could be drawn)
    entropy: Optional[torch.Tensor] = None  # [n] float32
    top_probs: Optional[torch.Tensor] = None  # [n, TOP_K] float32
    hidden: Optional[torch.Tensor] = None  # [n, hidden] the draft's final hidden state at the parent

    @property
    def num_nodes(self) -> int:
        return int(self.depth.numel())

    @staticmethod
    def cat(parts: list["NodeFeatures"]) -> "NodeFeatures":
        def join(name: str) -> Optional[torch.Tensor]:
            vals = [getattr(p, name) for p in parts]
            return None if any(v is None for v in vals) else torch.cat(vals)

        return NodeFeatures(*(join(n) for n in ("depth", "rank", "q_token", "live", "entropy", "top_probs",
                                                "hidden")))

    def cheap_matrix(self) -> torch.Tensor:
        """[n, len(CHEAP_FEATURES)] in the order of ``CHEAP_FEATURES``."""
        if self.entropy is None or self.top_probs is None:
            raise ValueError("cheap_matrix needs entropy and top-k features (full features)")
        logq = self.q_token.clamp_min(1e-10).log()
        depth = torch.nn.functional.one_hot((self.depth - 1).clamp(0, DEPTH_BUCKETS - 1), DEPTH_BUCKETS)
        rank = torch.nn.functional.one_hot(self.rank.clamp(0, RANK_BUCKETS - 1), RANK_BUCKETS)
        return torch.cat([self.entropy[:, None], self.top_probs, self.q_token[:, None], logq[:, None],
                          depth.float(), rank.float()], dim=1)


@dataclass
class ParentStats:
    """Per parent row of one sampling call: q of the drawn children, and (full) entropy / top-k."""

    q_children: torch.Tensor  # [rows, width] q(x) of each drawn child (0 where none was drawn)
    entropy: Optional[torch.Tensor]  # [rows]
    top_probs: Optional[torch.Tensor]  # [rows, TOP_K]


def parent_stats(logits: torch.Tensor, probs: Optional[torch.Tensor], greedy: torch.Tensor,
                 chosen: torch.Tensor, full: bool) -> ParentStats:
    """q statistics of every parent row.

    logits: [rows, vocab] processed draft logits; probs: [rows, vocab] the sampling law of sampled
    rows (None when every row is greedy); greedy: [rows] bool; chosen: [rows, width] drawn children
    (negative = none).  Greedy rows use softmax(logits) as q.  Only ``full`` touches the whole
    vocabulary beyond one log-sum-exp per row.  Results stay on the logits' device; the proposer
    brings them to the host, where the policy runs, with the level's tokens (:meth:`ParentStats.tensors`).
    """
    tok = chosen.clamp(min=0)
    if full:
        q = logits.softmax(dim=-1)
        if probs is not None:
            q = torch.where(greedy[:, None], q, probs)
        top = q.topk(min(TOP_K, q.shape[-1]), dim=-1).values
        top = torch.nn.functional.pad(top, (0, TOP_K - top.shape[-1]))
        entropy = torch.special.entr(q).sum(dim=-1)
        qx = q.gather(1, tok)
    else:
        entropy = top = None
        qx = (logits.gather(1, tok) - logits.logsumexp(dim=-1, keepdim=True)).exp()  # greedy rows' q
        if probs is not None:
            qx = torch.where(greedy[:, None], qx, probs.gather(1, tok))
    return ParentStats(torch.where(chosen >= 0, qx, 0.0), entropy, top)


def level_features(stats: ParentStats, rows: slice, width: int, depth: int, tokens: list[int],
                   hidden: Optional[torch.Tensor]) -> NodeFeatures:
    """Features of one tree's depth-``depth`` nodes: ``rows`` are its parent rows in ``stats`` (level
    order), each with ``width`` children; hidden: [parents, hidden] or None; tokens: the level's
    tokens (negative = DEAD)."""
    parents = rows.stop - rows.start
    n = parents * width
    expand = lambda t: None if t is None else t[rows].repeat_interleave(width, dim=0)  # noqa: E731
    return NodeFeatures(
        depth=torch.full((n,), depth, dtype=torch.long),
        rank=torch.arange(width).repeat(parents),
        q_token=stats.q_children[rows, :width].reshape(-1),
        live=torch.tensor(tokens) >= 0,
        entropy=expand(stats.entropy), top_probs=expand(stats.top_probs),
        hidden=None if hidden is None else hidden.float().repeat_interleave(width, dim=0),
    )
