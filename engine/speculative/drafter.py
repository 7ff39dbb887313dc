"""The drafter interface, and the registry of drafters by name.

A drafter grows the step's trees.  The runner creates one empty :class:`DraftTree` per decoding
sequence, then hands the batch to every drafter in stage order; each reads its own share of each
sequence's :class:`~engine.speculative.methods.DraftPlan` (the planner wrote it) and grows, or
replaces, the trees it has work for.  Verification does not care who drafted a node: every node
carries its proposal events (``engine.speculative.draft_tree``), and a method whose trees need
another rule than the lossless one names it (``Method.rule``).  After verification, drafters that
learn from the outcome see it (:meth:`Drafter.observe`).

The drafters, in stage order:

==================  ======  =========================================================  ==========
name                stage   module                                                     rule
==================  ======  =========================================================  ==========
``draft-tree``      10      ``proposer``: the draft model's multi-candidate tree        tree
``target-init``     10      ``target_init``: the draft model's chains below the         target-init
                            target-sampled candidates
``cascade``         20      ``cascade``: the draft model reviewing Max-Gram's guesses   tree
``mjsd``            30      ``mjsd``: beam search, verified by joint likelihood         joint
``maxgram``         90      ``maxgram``: one-hot tails and root branches                tree
==================  ======  =========================================================  ==========

A new drafter is one module: a class with this interface, registered with
``engine.registry.register_drafter``, its settings (``engine.config.DrafterSettings``,
``registry.drafter_settings``) and a ``registry.Method`` naming it so requests can ask for it
(``registry.register_method``), plus its tests (``CONTRIBUTING.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

from engine.config import EngineConfig
from engine.registry import drafter_classes, methods
from engine.speculative.draft_tree import DraftTree
from engine.speculative.methods import DraftPlan
from engine.speculative.tree import TreeTopology
from engine.speculative.view import SeqView
from engine.speculative.walk import SeqStepResult


@dataclass
class DrafterContext:
    """What drafters are built from.  The two shared drafting engines are typed loosely because
    their modules are drafters themselves (they import this one)."""

    config: EngineConfig
    topology: TreeTopology  # the largest draft tree
    maxgram: Any  # engine.speculative.maxgram.MaxGramDrafter: the n-gram index the planner also reads
    proposer: Optional[Any] = None  # engine.speculative.proposer.DraftModelProposer: the draft model with its
    #                                 cache; None: no draft model


class Drafter(Protocol):
    name: str  # the registry key (methods name their drafters by it)
    stage: int  # drafters run in increasing stage order within a step
    # a drafter whose class sets ``every_method = True`` grows the trees of every method (the grammar's
    # forced tokens, ``constrained``): its limits count in every method's

    @classmethod
    def limits(cls, config: EngineConfig, topology: TreeTopology) -> tuple[int, int]:
        """``(rows, entries)``: the most verification rows it adds to one tree, and the most
        draft-cache entries it appends for one sequence in one step (the caches are sized from these)."""

    @classmethod
    def build(cls, ctx: DrafterContext) -> Optional["Drafter"]:
        """The drafter for this engine, or None when it cannot run here (e.g. no draft model)."""

    def propose(self, seqs: list[SeqView], plans: list[DraftPlan], trees: list[DraftTree]) -> None:
        """Grows (or replaces) ``trees[i]``, the step's tree of ``seqs[i]``, as ``plans[i]`` allows;
        sequences whose plan gives this drafter nothing are left alone."""

    def observe(self, results: list[SeqStepResult], plans: list[DraftPlan]) -> None:
        """Optional (a drafter without it learns nothing): the step's outcome, once per step, every
        verified sequence's result (its tree, accepted path and emitted tokens) with the plan it
        followed, in the same order (``ModelRunner.observe``)."""


def build_drafters(ctx: DrafterContext) -> list[Drafter]:
    """Every registered drafter this engine can run, in stage order."""
    drafters = [d for d in (cls.build(ctx) for cls in drafter_classes().values()) if d is not None]
    return sorted(drafters, key=lambda d: d.stage)


def limits(config: EngineConfig, topology: TreeTopology) -> tuple[int, int]:
    """``(rows, entries)`` over every method: the most verification rows one tree may have beyond its
    root, and the most draft-cache entries one sequence may append in a step (a method's drafters
    add up: they grow the same tree)."""
    classes = drafter_classes()
    always = tuple(name for name, cls in classes.items() if getattr(cls, "every_method", False))
    rows = entries = 0
    for m in methods():
        r, e = zip(*(classes[name].limits(config, topology) for name in dict.fromkeys(m.drafters + always)))
        rows, entries = max(rows, sum(r)), max(entries, sum(e))
    return rows, entries
