"""Lossless verification of one draft tree, walked row by row (multi-candidate speculative sampling).

The engine verifies a whole batch at once with tensor operations (``engine.speculative.verify``);
this walk is the rule written the plain way.  It is the tests' oracle (the batched verifier must give
identical results on the same random numbers), the exact-law harness enumerates its coins, and the
lossy target-initialised mode still walks with it.

Vocabulary.  The *root* is block row 0 (the last emitted token); tree node ``i`` is block row
``i + 1``.  Walking down from the root, at each row the children are tried in sampling order:

* a child is **accepted** when ``u < p(x) / q(x)``; the walk descends into it;
* a child is **rejected** otherwise; the target distribution becomes the residual
  ``p <- norm((p - q)+)`` and, when children were drawn without replacement, the rejected token is
  removed from ``q`` (``q[x] <- 0; q <- norm(q)``), exactly the law the next sibling was drawn from;
* when every child of a row is rejected, a **correction** token ``y ~ p`` (the current residual)
  is emitted and the step ends;
* when the walk reaches a row without children (a leaf or the drafted depth), a **bonus** token
  ``y ~ p_target(. | accepted path)`` is emitted.

``p`` for the children of row ``j`` is the target's output at row ``j`` (the parent), not at the
child's row.  One step emits ``len(accepted) + 1`` tokens.  Greedy requests (temperature 0) walk
the tree taking the child equal to the target's argmax, else emit the argmax.

Target rows are evaluated lazily (``p_of(row)``): a walk touches at most depth + 1 rows, so only
those are turned into probability vectors.

**Randomness.**  The rule's random decisions go through a :class:`Coins` object: an acceptance test
``u < p(x) / q(x)`` and a draw ``y ~ p``.  The engine's :class:`TorchCoins` makes them from the
request's seeded generator; the tests' exact-law harness (``tests/exact_law.py``) makes every outcome in
turn, with its probability, and so computes the rule's output law exactly instead of sampling it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from engine.request import TokenLogprob
from engine.sampler import draw_uniforms, sample_from_probs, sample_k_distinct
from engine.speculative.draft_tree import DEAD, ONEHOT, DraftTree
from engine.speculative.tree import SubTree
from engine.speculative.view import SeqView


@dataclass
class VerifyResult:
    accepted: list[int]  # accepted node indices (within the subtree), root-to-leaf order
    tokens: list[int]  # emitted tokens: the accepted nodes' tokens, then the final token
    bonus: bool  # True: the final token is a bonus (no child of the last row was rejected)
    final_row: int  # block row whose distribution produced the final token
    rows: list[int]  # block rows that produced each emitted token (for logprobs)


@dataclass
class SeqStepResult:
    """One sequence's outcome of a verified step (whichever rule verified it)."""

    seq: SeqView
    result: VerifyResult
    tree: DraftTree
    logprobs: Optional[list[TokenLogprob]] = None
    logits: Optional[torch.Tensor] = None  # [1+n, vocab] the target's raw logits of the block (for training heads)
    carry: Optional[dict[str, Any]] = None  # what the rule hands the sequence's next step (``SeqView.carry``,
    #                                         by key); the engine stores it once the step's tokens are output
    last_is_root: bool = False  # the rule leaves the last emitted token, an accepted node, out of the caches:
    #                             it is the next root (else the last token is a bonus / correction, never run)

    @property
    def drafted(self) -> int:
        """Live drafted nodes of the tree."""
        tokens = self.tree.tokens
        return len(tokens) - tokens.count(DEAD)


class Coins(Protocol):
    """The two random decisions of the rule."""

    def accept(self, p_x: float, q_x: float, row: int = 0, event: int = 0) -> bool:
        """True with probability ``min(1, p_x / q_x)`` (when ``q_x == 0``: iff ``p_x > 0``); ``row`` and
        ``event`` say which decision of the walk this is (a table of uniforms reads them)."""

    def draw(self, p: torch.Tensor, row: int = 0) -> int:
        """A token with probability ``p[y] / sum(p)`` (``p`` non-negative, positive sum)."""

    def draw_distinct(self, p: torch.Tensor, k: int) -> list[int]:
        """Up to ``k`` distinct tokens drawn one after the other without replacement (fewer when ``p``
        has fewer positive entries)."""


class TorchCoins:
    """:class:`Coins` from a torch generator: one uniform per decision, in the order they are made, so a
    seeded request reproduces."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def accept(self, p_x: float, q_x: float, row: int = 0, event: int = 0) -> bool:
        u = float(torch.rand((), generator=self.generator))
        # u < p/q without dividing by a tiny q; strict, so a token the target rules out (p = 0) is
        # never accepted, even when the draw is exactly 0
        return u * q_x < p_x

    def draw(self, p: torch.Tensor, row: int = 0) -> int:
        u = torch.rand(1, generator=self.generator)
        return int(sample_from_probs(p[None], u)[0])

    def draw_distinct(self, p: torch.Tensor, k: int) -> list[int]:
        u = draw_uniforms([self.generator], [k])
        return [t for t in sample_k_distinct(p[None], u)[0].tolist() if t >= 0]


def children_of(sub: SubTree) -> list[list[int]]:
    """``out[row]`` = node indices whose parent is block row ``row``, in sampling (rank) order."""
    out: list[list[int]] = [[] for _ in range(sub.num_nodes + 1)]
    for i, p in enumerate(sub.parent.tolist()):
        out[p + 1].append(i)
    return out


def verify_greedy(argmax_of: Callable[[int], int], tokens: list[int],
                  events: list[list[tuple[int, int]]]) -> VerifyResult:
    """Greedy tree walk. ``argmax_of(row)`` is the target's (processed) argmax at block row ``row``;
    ``tokens[i]`` is node ``i``'s drafted token; ``events[row]`` its proposals (see ``draft_tree``)."""
    row, accepted, rows = 0, [], []
    while True:
        best = argmax_of(row)
        kids = [c for c, _ in events[row] if tokens[c] != DEAD]
        nxt = next((c for c in kids if tokens[c] == best), None)
        rows.append(row)
        if nxt is None:
            emitted = [tokens[i] for i in accepted] + [best]
            return VerifyResult(accepted, emitted, bonus=not kids, final_row=row, rows=rows)
        accepted.append(nxt)
        row = nxt + 1


def verify_sampled(
    p_of: Callable[[int], torch.Tensor],  # row -> target probs [vocab] (exact sampling distribution)
    q_of: Callable[[int], torch.Tensor],  # row -> draft probs [vocab] its children were drawn from
    tokens: list[int],
    events: list[list[tuple[int, int]]],
    coins: Coins,
    without_replacement: bool = True,
) -> VerifyResult:
    """Multi-candidate speculative sampling along the tree (see the module docstring).
    ``events[row]``: the proposals at ``row`` as ``(node, kind)``; a ``ONEHOT`` proposal has law
    ``e_x`` (accept with ``p(x)``, residual ``p`` without ``x``), a ``SAMPLED`` one law ``q_of(row)``."""
    row, accepted, rows = 0, [], []
    while True:
        rows.append(row)
        kids = [(c, k) for c, k in events[row] if tokens[c] != DEAD]
        p = p_of(row)
        if not kids:
            y = coins.draw(p, row)
            return VerifyResult(accepted, [tokens[i] for i in accepted] + [y], True, row, rows)
        q = None
        taken = None
        for j, (c, kind) in enumerate(kids):
            x = tokens[c]
            if kind == ONEHOT:
                if coins.accept(float(p[x]), 1.0, row, j):
                    taken = c
                    break
                p = onehot_residual(p, x)
                continue
            q = q_of(row) if q is None else q
            if coins.accept(float(p[x]), float(q[x]), row, j):
                taken = c
                break
            p = residual(p, q)
            if without_replacement:
                q = remove_candidate(q, x)
        if taken is None:
            y = coins.draw(p, row)
            return VerifyResult(accepted, [tokens[i] for i in accepted] + [y], False, row, rows)
        accepted.append(taken)
        row = taken + 1


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm((p - q)+)``; keeps ``p`` when the residual vanishes (only possible when ``p == q``
    up to rounding, where rejection itself had probability zero)."""
    r = (p - q).clamp_(min=0.0)
    total = r.sum()
    return r / total if total > 0 else p


def onehot_residual(p: torch.Tensor, x: int) -> torch.Tensor:
    """``norm((p - e_x)+)`` after a rejected one-hot proposal: ``x`` drops out, the rest renormalised."""
    return remove_candidate(p, x)


def remove_candidate(q: torch.Tensor, x: int) -> torch.Tensor:
    """``q`` of the next sibling when siblings are drawn without replacement: ``x`` removed,
    renormalised (exactly the law the next candidate was drawn from)."""
    q = q.clone()
    q[x] = 0.0
    total = q.sum()
    return q / total if total > 0 else q
