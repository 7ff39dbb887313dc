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

import functools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from engine.speculative.tree import SubTree, TreeTopology

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.sequence import Sequence

MCSD, MAXGRAM, MCSD_MAXGRAM, CASCADE = "mcsd", "maxgram", "mcsd+maxgram", "cascade"
MJSD_LOSSY, TARGET_INIT_LOSSY = "mjsd-lossy", "target-init-lossy"
LOSSLESS_RULE = "lossless"  # engine.speculative.verify.LOSSLESS: the multi-candidate rule
JOINT_RULE, TARGET_INIT_RULE = "mjsd-joint", "target-init"  # the lossy rules (their modules register them)
MJSD_NOTE = ("lossy: joint decoding (MJSD) accepts draft tokens by joint likelihood, so the output is not "
             "distributed as the target's sampling would be")
TARGET_INIT_NOTE = ("lossy: target-initialised candidates keep the target-sampled token whose draft continuation "
                    "survives longest, which biases the output towards tokens the draft predicts well")


@dataclass(frozen=True)
class DraftPlan:
    """How much one sequence drafts in one step, by drafter.

    ``sub`` is the draft model's multi-candidate tree (the ``draft-tree`` drafter's share, and the base
    the chain drafters start from).  Every other drafter's share sits in ``shares`` under the
    drafter's name, in whatever form that drafter reads: a token count (``cascade``, ``mjsd``, a new
    drafter's), a :class:`MaxGramShare`, or a flag (``target-init``).  A drafter with no share drafts
    nothing for the sequence; the planner counts a share's verification rows with :func:`share_rows`."""

    method: str
    sub: SubTree  # the draft model's multi-candidate tree (possibly empty)
    shares: Mapping[str, Any] = field(default_factory=dict)  # drafter name -> its share of the step
    step: Optional[object] = None  # the policy's StepBudget for the step (engine.speculative.adaptive), shared

    def share(self, drafter: str, default: Any = None) -> Any:
        return self.shares.get(drafter, default)

    def with_share(self, drafter: str, value: Any) -> "DraftPlan":
        return replace(self, shares={**self.shares, drafter: value})


MAXGRAM_DRAFTER, CASCADE_DRAFTER, MJSD_DRAFTER = "maxgram", "cascade", "mjsd"
TARGET_INIT_SHARE = "target-init"  # the draft-tree drafter forces the candidates as level 1 (sub is (k, 1, ...))


@dataclass(frozen=True)
class MaxGramShare:
    """Max-Gram's share of a step (``engine.speculative.maxgram``)."""

    length: int = 0  # tokens per branch from the root
    branches: int = 0  # branches from the root
    tail: int = 0  # tokens appended below the deepest drafted path (horizontal cascade)
    trust: int = 0  # a suffix match this long replaces the draft model for the step (0 = never)
    match_class: Optional[int] = None  # the root proposal's match class, when the length chooser capped it
    trusted: bool = False  # Max-Gram alone this step: its match reached ``trust`` (the planner's choice)

    @property
    def rows(self) -> int:
        return self.length * self.branches + self.tail


def share_rows(share: Any) -> int:
    """The most verification rows a share adds to a tree: a token count, or the share's ``rows``."""
    if isinstance(share, bool):
        return 0  # a flag (target-init): its rows are ``sub``'s
    return share if isinstance(share, int) else int(getattr(share, "rows", 0))


@dataclass(frozen=True)
class PlanInput:
    """What a method's plan reads for one sequence in one step (the planner builds it)."""

    seq: "Sequence"
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


def _mcsd(p: PlanInput) -> "DraftPlan":
    return DraftPlan(MCSD, p.sub if p.room > 0 else p.empty)


def _maxgram(p: PlanInput) -> "DraftPlan":
    if p.room <= 0:
        return DraftPlan(MAXGRAM, p.empty)
    cfg = p.config
    share = MaxGramShare(length=min(cfg.maxgram_len, p.room), branches=cfg.maxgram_branches)
    return DraftPlan(MAXGRAM, p.empty, {MAXGRAM_DRAFTER: share})


def _mcsd_maxgram(p: PlanInput) -> "DraftPlan":
    if p.room <= 0:
        return DraftPlan(MCSD_MAXGRAM, p.empty)
    cfg, sub = p.config, p.sub
    share = MaxGramShare(length=min(cfg.maxgram_len, p.room), branches=cfg.maxgram_branches,
                         tail=min(cfg.maxgram_tail, p.room - sub.max_depth) if sub.num_nodes else 0,
                         trust=cfg.maxgram_trust)
    return DraftPlan(MCSD_MAXGRAM, sub, {MAXGRAM_DRAFTER: share})


def _cascade(p: PlanInput) -> "DraftPlan":
    if p.room <= 0:
        return DraftPlan(CASCADE, p.empty)
    cfg = p.config
    depth = min(cfg.cascade_depth, p.room) if p.draft_ok else 0  # the review runs the draft model
    share = MaxGramShare(length=min(cfg.maxgram_len, p.room), tail=min(cfg.maxgram_tail, p.room - depth),
                         trust=cfg.maxgram_trust)
    return DraftPlan(CASCADE, p.empty, {CASCADE_DRAFTER: depth, MAXGRAM_DRAFTER: share})


def _mjsd(p: PlanInput) -> "DraftPlan":
    if p.room <= 0:
        return DraftPlan(MJSD_LOSSY, p.empty)
    return DraftPlan(MJSD_LOSSY, p.empty, {MJSD_DRAFTER: min(p.config.mjsd_depth, p.room) if p.draft_ok else 0})


@functools.cache
def init_topology(k: int, depth: int) -> TreeTopology:
    """The target-initialised mode's tree: ``k`` candidate roots, each with a chain below it."""
    return TreeTopology((k,) + (1,) * (depth - 1))


def _target_init(p: PlanInput) -> "DraftPlan":
    if p.seq.init_candidates is None:  # the first step only draws candidates
        return DraftPlan(TARGET_INIT_LOSSY, p.empty, {TARGET_INIT_SHARE: True})
    cfg = p.config
    topology = init_topology(cfg.target_init_k, cfg.target_init_depth)
    depth = min(cfg.target_init_depth, p.room + 1)  # the candidate itself, then its chain
    return DraftPlan(TARGET_INIT_LOSSY, topology.subtree(topology.widths[:depth]), {TARGET_INIT_SHARE: True})


_REGISTRY: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Makes ``method`` one a request can name (``speculative.method``)."""
    if method.name in _REGISTRY:
        raise ValueError(f"speculation method {method.name!r} is registered twice")
    _REGISTRY[method.name] = method
    return method


for _m in (Method(MCSD, ("draft-tree",), _mcsd),
           Method(MAXGRAM, ("maxgram",), _maxgram, needs_draft=False),
           Method(MCSD_MAXGRAM, ("draft-tree", "maxgram"), _mcsd_maxgram),
           Method(CASCADE, ("cascade", "maxgram"), _cascade),
           Method(MJSD_LOSSY, ("mjsd",), _mjsd, lossy_note=MJSD_NOTE, penalties=False, rule=JOINT_RULE),
           Method(TARGET_INIT_LOSSY, ("draft-tree",), _target_init, lossy_note=TARGET_INIT_NOTE,
                  rule=TARGET_INIT_RULE)):
    register_method(_m)

METHODS = tuple(_REGISTRY)  # the built-in ones (method_names(): with the drafter modules' own)


def _load_all() -> None:
    from engine.speculative.drafter import _load_builtin  # late: drafters import this module

    _load_builtin()


def method(name: str) -> Method:
    """The registered method ``name`` (ValueError with the choices if unknown)."""
    if name not in _REGISTRY:
        _load_all()  # a drafter module not imported yet may register it
    if name not in _REGISTRY:
        raise ValueError(f"unknown speculation method {name!r}; choose one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def methods() -> list[Method]:
    """Every registered method, the built-in ones first."""
    _load_all()
    return list(_REGISTRY.values())


def method_names() -> tuple[str, ...]:
    """Names of every registered method (the settings' and the API's choices)."""
    return tuple(m.name for m in methods())


def check_method(name: str) -> str:
    method(name)
    return name


def uses_draft(seq: "Sequence") -> bool:
    """Whether the sequence's request speculates with a method that runs the draft model."""
    spec = seq.request.spec
    return bool(spec.enabled) and method(spec.method).needs_draft
