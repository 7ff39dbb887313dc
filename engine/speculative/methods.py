"""Speculation methods a request can ask for (``speculative.method``), and the per-step draft plan.

A method is a :class:`Method` record: the drafters that grow its trees, its plan (how much each of
them drafts for one sequence in one step) and its verification rule.  Each is registered by the
module of the drafter it is built on, next to that drafter's settings (``engine.config.DrafterSettings``):

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
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from engine.speculative.tree import SubTree

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.speculative.view import SeqView

LOSSLESS_RULE = "lossless"  # engine.speculative.verify.LOSSLESS: the multi-candidate rule


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


@dataclass(frozen=True)
class Method:
    """A speculation method: its drafters (``engine.speculative.drafter``, in the order they grow the
    tree), its plan (how much each may draft this step), and what the engine must know about it."""

    name: str
    drafters: tuple[str, ...]
    plan: Callable[[PlanInput], "DraftPlan"]
    needs_draft: bool = True  # runs the draft model (without one, the server turns speculation off)
    rule: str = LOSSLESS_RULE  # the verification rule (engine.speculative.verify.register_rule)
    lossy_note: Optional[str] = None  # a lossy method's note on every response (None: lossless)
    penalties: bool = True  # supports presence / frequency / repetition penalties
    grammar: bool = True  # verifies under a grammar (structured outputs: the masked target's law)
    order: int = 100  # where it is listed among the methods (the settings' choices, errors, docs)


_REGISTRY: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Makes ``method`` one a request can name (``speculative.method``)."""
    if method.name in _REGISTRY:
        raise ValueError(f"speculation method {method.name!r} is registered twice")
    _REGISTRY[method.name] = method
    return method


def _load_all() -> None:
    from engine.speculative.drafter import _load_builtin  # late: drafters import this module

    _load_builtin()


def method(name: str) -> Method:
    """The registered method ``name`` (ValueError with the choices if unknown)."""
    if name not in _REGISTRY:
        _load_all()  # a drafter module not imported yet may register it
    if name not in _REGISTRY:
        raise ValueError(f"unknown speculation method {name!r}; choose one of {', '.join(method_names())}")
    return _REGISTRY[name]


def methods() -> list[Method]:
    """Every registered method, in listing order."""
    _load_all()
    return sorted(_REGISTRY.values(), key=lambda m: m.order)


def method_names() -> tuple[str, ...]:
    """Names of every registered method (the settings' and the API's choices)."""
    return tuple(m.name for m in methods())


def check_method(name: str) -> str:
    method(name)
    return name


def uses_draft(seq: SeqView) -> bool:
    """Whether the sequence's request speculates with a method that runs the draft model."""
    spec = seq.request.spec
    return bool(spec.enabled) and method(spec.method).needs_draft
