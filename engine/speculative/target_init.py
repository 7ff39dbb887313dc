"""Target-initialised multi-candidate generation (arXiv 2409.10644): **lossy**, opt-in only
(``speculative.method = "target-init-lossy"``); every response using it carries a note saying so.

Instead of emitting one token drawn from the target at the end of a step, the step draws ``k``
distinct *candidate roots* from that target distribution (the top ``k`` at temperature 0) and emits
nothing for them yet.  The next step drafts a chain under every candidate (the draft tree
``(k, 1, 1, ...)`` with its first level forced to the candidates), the target verifies all of them in
one forward, each chain by the exact rule but without a correction token, and the step keeps the
candidate **whose chain survives longest** (ties: the first drawn) and emits it with its accepted
chain; then it draws the next candidates from the target after the last emitted token (from the
residual ``norm((p - q)+)`` when the kept chain ended in a rejected draft token, so that with
``k = 1`` the mode is exactly speculative sampling and all of its bias comes from the selection).

Why it is lossy: choosing among target samples by how well the *draft* continues them favours
tokens the draft likes; the chi-square harness measures the bias (``tests/engine/speculative/test_lossless.py``).

Bookkeeping: the last emitted token of a step stays out of the target cache (the engine's invariant:
the root is uncached), so the next block is ``[root, candidates, chains]`` exactly like any tree.  A
sequence's first step only draws candidates (it emits nothing).
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.sampler import SamplingTensors
from engine.speculative.draft_tree import DEAD
from engine.speculative.walk import Coins, VerifyResult

LOSSY_NOTE = ("lossy: target-initialised candidates keep the target-sampled token whose draft continuation "
              "survives longest, which biases the output towards tokens the draft predicts well")


def verify_target_init(accept: Callable[[int, int], bool], tokens: list[int],
                       children: list[list[int]]) -> tuple[VerifyResult, bool]:
    """``accept(row, node)``: the exact rule for one drafted node below block row ``row`` (the caller
    keeps the generator state).  Candidates are the root's children; each chain is walked until its first
    rejection.  Returns the best candidate with its accepted chain (no correction or bonus token) and
    whether that chain ended in a rejected node (then the next candidates come from the residual)."""
    best: list[int] = []
    best_rejected = False
    for cand in (c for c in children[0] if tokens[c] != DEAD):
        chain, row, rejected = [cand], cand + 1, False
        while True:
            kids = [c for c in children[row] if tokens[c] != DEAD]
            if not kids:
                break
            if not accept(row, kids[0]):
                rejected = True
                break
            chain.append(kids[0])
            row = kids[0] + 1
        if len(chain) > len(best):
            best, best_rejected = chain, rejected
    final_row = best[-1] + 1 if best else 0
    return VerifyResult(best, [tokens[i] for i in best], bonus=False, final_row=final_row,
                        rows=[0] + [1 + i for i in best[:-1]]), best_rejected


def draw_candidates(x: torch.Tensor, probs: torch.Tensor, st: SamplingTensors, k: int, coins: Coins) -> list[int]:
    """``k`` distinct candidate roots: the top ``k`` of the processed logits ``x`` [vocab] for greedy
    requests, else drawn without replacement from ``probs`` [vocab] (the target's sampling distribution
    there, or the residual left by a rejected draft token, so that ``k = 1`` is exact)."""
    if bool(st.greedy[0]):
        return x.topk(k).indices.tolist()
    return coins.draw_distinct(probs, k)
