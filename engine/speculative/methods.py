"""Speculation methods a request can ask for (``speculative.method``) and the per-step draft plan.

======================  =====================================================================  =========
method                  what drafts the tree                                                   draft model
======================  =====================================================================  =========
``mcsd``                the draft model: a multi-candidate tree (width per depth)              yes
``maxgram``             Max-Gram alone (prompt lookup + bigram table): no neural cost          no
``mcsd+maxgram``        one tree from both: the draft model's tree and Max-Gram's branches     yes
                        at the root, merged (shared prefixes deduplicated), plus Max-Gram's
                        continuation below the draft's most likely leaf (horizontal cascade)
``cascade``             CS Drafting: the draft model reviews Max-Gram's guesses (vertical),    yes
                        Max-Gram writes the later depths (horizontal)
``mjsd-lossy``          **lossy**: joint decoding (MJSD): the draft's best beam, accepted by   yes
                        joint likelihood ratio against a threshold (``engine.speculative.mjsd``)
``target-init-lossy``   **lossy**: k target-sampled candidate roots, each with a draft chain;  yes
                        the longest-surviving one is kept (``engine.speculative.target_init``)
======================  =====================================================================  =========

All but the ``*-lossy`` methods are lossless: the target's final review is the exact multi-candidate rule.
A lossy method is never a default; a response that used one carries a note saying so.

**Trusting Max-Gram.**  For ``mcsd+maxgram`` and ``cascade``, a step whose context ends in a long
suffix match (``maxgram_trust`` tokens or more; copying from the prompt or from a repetition) skips
the draft model and verifies Max-Gram's proposals alone: a long match is usually right, and then
the draft model's forwards are pure cost.  The choice depends only on the context, so it cannot bias
the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.speculative.tree import SubTree

MCSD, MAXGRAM, MCSD_MAXGRAM, CASCADE = "mcsd", "maxgram", "mcsd+maxgram", "cascade"
MJSD_LOSSY, TARGET_INIT_LOSSY = "mjsd-lossy", "target-init-lossy"
METHODS = (MCSD, MAXGRAM, MCSD_MAXGRAM, CASCADE, MJSD_LOSSY, TARGET_INIT_LOSSY)
NEEDS_DRAFT = {MCSD, MCSD_MAXGRAM, CASCADE, MJSD_LOSSY, TARGET_INIT_LOSSY}
LOSSY = {MJSD_LOSSY, TARGET_INIT_LOSSY}
#: the drafters (``engine.speculative.drafter``) each method's trees come from
METHOD_DRAFTERS = {
    MCSD: ("draft-tree",), MAXGRAM: ("maxgram",), MCSD_MAXGRAM: ("draft-tree", "maxgram"),
    CASCADE: ("cascade", "maxgram"), MJSD_LOSSY: ("mjsd",), TARGET_INIT_LOSSY: ("draft-tree",),
}


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown speculation method {method!r}; choose one of {', '.join(METHODS)}")
    return method


@dataclass(frozen=True)
class DraftPlan:
    """How much one sequence drafts in one step, by drafter."""

    method: str
    sub: SubTree  # the draft model's multi-candidate tree (possibly empty)
    maxgram: int = 0  # Max-Gram tokens per branch from the root
    branches: int = 0  # Max-Gram branches from the root
    cascade: int = 0  # chain tokens the vertical cascade writes (draft model reviewing Max-Gram)
    tail: int = 0  # Max-Gram tokens appended below the deepest drafted path (horizontal cascade)
    trust: int = 0  # a Max-Gram match this long replaces the draft model for the step (0 = never)
    mjsd: int = 0  # chain tokens MJSD (lossy) drafts by beam search
    init: bool = False  # target-initialised (lossy): ``sub`` is (k, 1, ...) with the candidates as level 1
    maxgram_class: Optional[int] = None  # the root proposal's match class, when the length chooser capped it
    trusted: bool = False  # Max-Gram alone this step: its suffix match reached ``trust`` (the planner's choice)
    step: Optional[object] = None  # the policy's StepBudget for the step (engine.speculative.adaptive), shared
