"""Lossless verification of a draft tree against the target (multi-candidate speculative sampling).

Vocabulary.  The *root* is block row 0 (the last emitted token); tree node ``i`` is block row
``i + 1``.  Walking down from the root, at each row the children are tried in sampling order:

* a child is **accepted** when ``u <= p(x) / q(x)``; the walk descends into it;
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.sampler import sample_from_probs
from engine.spec.draft_tree import DEAD, ONEHOT
from engine.spec.tree import SubTree


@dataclass
class VerifyResult:
    accepted: list[int]  # accepted node indices (within the subtree), root-to-leaf order
    tokens: list[int]  # emitted tokens: the accepted nodes' tokens, then the final token
    bonus: bool  # True: the final token is a bonus (no child of the last row was rejected)
    final_row: int  # block row whose distribution produced the final token
    rows: list[int]  # block rows that produced each emitted token (for logprobs)


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
    generator: torch.Generator,
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
            y = _draw(p, generator)
            return VerifyResult(accepted, [tokens[i] for i in accepted] + [y], True, row, rows)
        q = None
        taken = None
        for c, kind in kids:
            x = tokens[c]
            u = float(torch.rand((), generator=generator))
            if kind == ONEHOT:
                if u <= float(p[x]):
                    taken = c
                    break
                p = onehot_residual(p, x)
                continue
            q = q_of(row) if q is None else q
            if u * float(q[x]) <= float(p[x]):  # u <= p/q without dividing by a tiny q
                taken = c
                break
            p = residual(p, q)
            if without_replacement:
                q = remove_candidate(q, x)
        if taken is None:
            y = _draw(p, generator)
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


def _draw(p: torch.Tensor, generator: torch.Generator) -> int:
    u = torch.rand(1, generator=generator)
    return int(sample_from_probs(p[None], u)[0])
