"""Speculation methods a request can ask for (``speculative.method``), and the per-step draft plan.

A method is an ``engine.registry.Method`` record: the drafters that grow its trees, its plan (how
much each of them drafts for one sequence in one step, a :class:`DraftPlan`) and its verification
rule.  Each is registered by the module of the drafter it is built on, next to that drafter's
settings (``engine.config.DrafterSettings``):

======================  =====================================================================  ===============
method                  what drafts the tree                                                   module
======================  =====================================================================  ===============
``mcsd``                the draft model: a multi-candidate tree (width per depth)              ``proposer``
``maxgram``             Max-Gram alone (prompt lookup + bigram table): no neural cost          ``maxgram``
``mcsd+maxgram``        one tree from both: the draft model's tree and Max-Gram's branches     ``maxgram``
                        at the root, merged (shared prefixes deduplicated), plus Max-Gram's
                        continuation below the draft's most likely leaf (horizontal cascade)
``cascade``             CS Drafting: the draft model reviews Max-Gram's guesses (vertical),    ``cascade``
                        Max-Gram writes the later depths (horizontal)
``mjsd-lossy``          **lossy**: joint decoding (MJSD): the draft's best beam, accepted by   ``mjsd``
                        joint likelihood ratio against a threshold
``target-init-lossy``   **lossy**: k target-sampled candidate roots, each with a draft chain;  ``target_init``
                        the longest-surviving one is kept
======================  =====================================================================  ===============

All but the ``*-lossy`` methods are lossless: the target's final review is the exact multi-candidate rule.
A lossy method is never a default; a response that used one carries a note saying so.

**Trusting Max-Gram.**  For ``mcsd+maxgram`` and ``cascade``, a step whose context ends in a long
suffix match (``maxgram_trust`` tokens or more; copying from the prompt or from a repetition) skips
the draft model and verifies Max-Gram's proposals alone: a long match is usually right, and then
the draft model's forwards are pure cost.  The choice depends only on the context, so it cannot bias
the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Optional

from engine.registry import method
from engine.speculative.tree import SubTree

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.speculative.view import SeqView


@dataclass(frozen=True)
class DraftPlan:
    """How much one sequence drafts in one step, by drafter.

    ``sub`` is the draft model's multi-candidate tree (the ``draft-tree`` drafter's share, and the base
    the chain drafters start from).  Every other drafter's share sits in ``shares`` under the
    drafter's name, in whatever form that drafter reads: a token count (``cascade``, ``mjsd``, a new
    drafter's), a ``maxgram.MaxGramShare``, or a tree (``target-init``: the chains below last step's
    candidates).  A drafter with no share drafts nothing for the sequence; the planner counts a
    share's verification rows with :func:`share_rows`."""

    method: str
    sub: SubTree  # the draft model's multi-candidate tree (possibly empty)
    shares: Mapping[str, Any] = field(default_factory=dict)  # drafter name -> its share of the step
    step: Optional[object] = None  # the policy's StepBudget for the step (engine.speculative.adaptive), shared

    def share(self, drafter: str, default: Any = None) -> Any:
        return self.shares.get(drafter, default)

    @property
    def plain(self) -> bool:
        """Whether the plan drafts nothing (the step decodes plainly for its sequence)."""
        return not self.sub.num_nodes and not self.shares

    def with_share(self, drafter: str, value: Any) -> "DraftPlan":
        return replace(self, shares={**self.shares, drafter: value})


def share_rows(share: Any) -> int:
    """The most verification rows a share adds to a tree: a token count, the share's ``rows``, or a
    tree's ``num_nodes`` (the target-initialised chains)."""
    if isinstance(share, bool):
        return 0  # a flag
    if isinstance(share, int):
        return share
    rows = getattr(share, "rows", None)
    return int(rows if rows is not None else getattr(share, "num_nodes", 0))


@dataclass(frozen=True)
class PlanInput:
    """What a method's plan reads for one sequence in one step (the planner builds it)."""

    seq: SeqView
    config: "EngineConfig"
    room: int  # tokens it may still draft beyond the next one (what remains, and the request's max_depth)
    draft_ok: bool  # the step's budget lets the draft model run for it (False: plain decoding is cheaper)
    sub: SubTree  # the draft model's tree: the request's (or the engine's), within the budget and the room
    empty: SubTree


def uses_draft(seq: SeqView) -> bool:
    """Whether the sequence's request speculates with a method that runs the draft model."""
    spec = seq.request.spec
    return bool(spec.enabled) and method(spec.method).needs_draft
