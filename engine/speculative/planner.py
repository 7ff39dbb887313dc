"""One object decides each step's speculation for the batch: the planner.

For every decoding sequence it writes a :class:`~engine.speculative.methods.DraftPlan`: how much each
drafter of the request's method may draft this step.  It reads

* the request (method, its own tree, ``max_depth``, ``adaptive``) and what it may still write;
* the speculation policy's batch budget (``engine.speculative.adaptive``: the load-aware tree
  budget, and whether a lagging draft cache's catch-up pays), when the engine is adaptive;
* Max-Gram's suffix match: a match of ``maxgram_trust`` tokens or more makes the step Max-Gram's
  alone (see ``engine.speculative.methods``), and the load-aware length chooser caps Max-Gram's
  proposals per match class on the measured cost of verification rows.

Verification rows have one price: the policy's measured cost curve
(:class:`~engine.speculative.cost_model.LiveCurve`), which the length chooser reads too and which
learns from every step's verification time.  After the step, :meth:`Planner.observe` hands the
outcome to the policy, the length chooser and that curve, in one call.  Nothing else in the engine decides how much to draft: the runner drafts and verifies
what the plans say, and the draft model's proposer asks the policy whether to grow a level.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Optional

from engine.config import EngineConfig
from engine.registry import method
from engine.speculative.adaptive import SpecPolicy, StepBudget
from engine.speculative.constrained import GRAMMAR_DRAFTER, ForcedShare
from engine.speculative.cost_model import LiveCurve, measure_curve
from engine.speculative.draft_tree import BIGRAM, DEAD, DRAFT_MODEL, MAXGRAM
from engine.speculative.drafter import DrafterContext
from engine.speculative.maxgram import (
    MATCH_CLASSES, MAXGRAM_DRAFTER, BigramTable, LengthChooser, MaxGramDrafter, MaxGramSettings, MaxGramShare,
    match_class,
)
from engine.speculative.methods import DraftPlan, PlanInput, share_rows
from engine.speculative.tree import SubTree, TreeTopology
from engine.speculative.view import SeqView

MAXGRAM_SOURCES = frozenset({MAXGRAM, BIGRAM})  # the sources of a node Max-Gram proposed

if TYPE_CHECKING:
    from engine.kv_cache import KVCache
    from engine.models.model import Model
    from engine.speculative.proposer import DraftModelProposer
    from engine.speculative.walk import SeqStepResult


class Planner:
    def __init__(self, config: EngineConfig, topology: TreeTopology, maxgram: MaxGramDrafter,
                 policy: Optional[SpecPolicy] = None, lengths: Optional[LengthChooser] = None) -> None:
        """``topology``: the largest tree; ``maxgram``: the Max-Gram drafter whose suffix matches the
        plans read (the drafters share it); ``lengths``: Max-Gram's load-aware length chooser (None:
        proposals are capped only by the config)."""
        self.config = config
        self.topology = topology
        self.maxgram = maxgram
        self.policy = policy
        self.lengths = lengths
        self.mixed = MixedRows()

    @classmethod
    def build(cls, config: EngineConfig, topology: TreeTopology, policy: Optional[SpecPolicy], tokenizer,
              target: "Model", cache: "KVCache") -> "Planner":
        """The engine's planner: Max-Gram from its settings (its bigram fallback from ``maxgram_corpus``),
        and with ``load_aware`` its length chooser on the target's cost curve (the policy's when it
        measured one, else measured here: a few forwards of ``target`` over ``cache``)."""
        mg = MaxGramSettings.of(config)
        bigram = BigramTable.from_corpus(tokenizer, mg.corpus) if mg.corpus else None
        maxgram = MaxGramDrafter(mg.len, mg.max_ngram, mg.min_ngram, bigram)
        lengths = None
        if config.load_aware:
            budget = getattr(policy, "chooser", None)
            if budget is not None:
                verify = budget.verify  # one price of verification rows for the draft tree and Max-Gram
            else:
                b, n = config.max_batch, mg.len
                points = [(x, y) for x in sorted({1, max(1, b // 2), b}) for y in sorted({1, 1 + n // 2, 1 + n})]
                verify = LiveCurve(measure_curve(target, cache, points, reps=2))
            lengths = LengthChooser(verify, mg.len)
        return cls(config, topology, maxgram, policy, lengths)

    def drafter_context(self, proposer: Optional["DraftModelProposer"]) -> DrafterContext:
        """What the drafters are built from: this planner's settings, tree and Max-Gram index (the
        drafters that read Max-Gram share the planner's), and the draft model's proposer."""
        return DrafterContext(self.config, self.topology, self.maxgram, proposer)

    def plan(self, seqs: list[SeqView]) -> list[DraftPlan]:
        """This step's plan of every sequence, in order."""
        step = self.policy.budget(seqs) if self.policy is not None else None
        plans = [self._trust(seq, self._plan(seq, step)) for seq in seqs]
        plans = self._cap_maxgram(seqs, plans, step)
        plans = self._price_mixed_rows(seqs, plans)
        plans = [self._forced(seq, p) for seq, p in zip(seqs, plans)]
        # the step's budget travels with the plans: the proposer hands it back to the policy per level
        return plans if step is None else [replace(p, step=step) for p in plans]

    def plain(self, seqs: list[SeqView]) -> list[DraftPlan]:
        """Plans that draft nothing (the step decodes plainly): what the engine falls back to when
        planning fails."""
        empty = self.topology.subtree(())
        return [DraftPlan(s.request.spec.method or self.config.spec_method, empty) for s in seqs]

    def planning_state(self) -> tuple:
        """What planning moves besides learning (the policy's and Max-Gram's probe counters, the
        requests chosen to explore); :meth:`restore_planning` puts it back, so that steps the engine
        runs for itself (``EngineCore.warm_up``) leave no trace in later plans."""
        return (None if self.policy is None else self.policy.planning_state(),
                None if self.lengths is None else self.lengths.planning_state())

    def restore_planning(self, state: tuple) -> None:
        policy, lengths = state
        if self.policy is not None:
            self.policy.restore_planning(policy)
        if self.lengths is not None:
            self.lengths.restore_planning(lengths)

    def observe(self, results: list["SeqStepResult"], plans: list[DraftPlan],
                verify_seconds: Optional[float] = None) -> None:
        """Learns from the step: ``results`` and the plans they followed, in the same order, and what
        verifying them took (None: not measured, e.g. a step where some sequence failed)."""
        verify = self.verify
        if verify is not None and verify_seconds is not None and results:
            verify.observe(sum(1 + len(r.tree.tokens) for r in results), verify_seconds)
        self._observe_maxgram(results, plans)
        if self.policy is not None:
            for res, plan in zip(results, plans):
                mg = plan.share(MAXGRAM_DRAFTER)
                if mg is not None and mg.length and mg.trust:  # a method that lets long matches draft alone
                    self.policy.observe_trust(res.seq, len(res.result.accepted) + 1, mg.trusted,
                                              drafted=res.tree.num_sub > 0, step=plan.step)
            self.policy.observe(results)

    @property
    def verify(self) -> Optional[LiveCurve]:
        """The measured price of verification rows both choosers read (None when not load-aware)."""
        return None if self.lengths is None else self.lengths.curve

    @staticmethod
    def _room(seq: SeqView) -> int:
        """Tokens the sequence may draft this step beyond the next one: what remains, and its max_depth."""
        room, cap = seq.remaining - 1, seq.request.spec.max_depth
        return room if cap is None else min(room, cap)

    def _forced(self, seq: SeqView, plan: DraftPlan) -> DraftPlan:
        """A constrained sequence that speculates may draft the tokens its grammar forces, as deep as
        its room (``constrained.GrammarDrafter``)."""
        spec = seq.request.spec
        if seq.grammar is None or not spec.enabled or seq.speculation_error is not None:
            return plan
        room = self._room(seq)
        return plan.with_share(GRAMMAR_DRAFTER, ForcedShare(room)) if room > 0 else plan

    def _trust(self, seq: SeqView, plan: DraftPlan) -> DraftPlan:
        """Max-Gram alone for this step when the context ends in a long suffix match; the choice reads
        only the context, so it cannot bias the output."""
        mg = plan.share(MAXGRAM_DRAFTER)
        if mg is None or not mg.trust or not mg.length:
            return plan
        match = self.maxgram.root_match(seq)
        if match is None or match < mg.trust:
            return plan
        return DraftPlan(plan.method, self.topology.subtree(()),
                         {MAXGRAM_DRAFTER: MaxGramShare(mg.length, max(mg.branches, 1), trust=mg.trust, trusted=True)})

    def _cap_maxgram(self, seqs: list[SeqView], plans: list[DraftPlan],
                     step: Optional[StepBudget] = None) -> list[DraftPlan]:
        """Caps Max-Gram's root proposals by the load-aware length chooser, per match class, priced
        together with the rest of the step: the rows of every other share and the tokens the policy
        expects them to emit.  A trusted sequence drafts nothing else (:meth:`_trust`), so it adds no
        draft-tree rows; a cap of 0 makes it decode plainly this step, as priced."""
        if self.lengths is None:
            return plans
        shares: list[Optional[MaxGramShare]] = [p.share(MAXGRAM_DRAFTER) for p in plans]
        roots = [self.maxgram.root_match(s) if mg is not None and mg.length and mg.branches else None
                 for s, mg in zip(seqs, shares)]
        match = [m if s.request.spec.adaptive is not False else None for s, m in zip(seqs, roots)]
        if all(m is None for m in match):
            return plans
        counts = [0] * MATCH_CLASSES
        others = 0  # verification rows the caps do not change
        tokens = 0.0  # and the tokens those rows are expected to emit
        for seq, m, root, p, mg in zip(seqs, match, roots, plans, shares):
            rows = p.sub.num_nodes + sum(share_rows(v) for k, v in p.shares.items() if k != MAXGRAM_DRAFTER)
            if self.policy is not None and p.sub.num_nodes:
                tokens += self.policy.expected_accepted(seq, p.sub, step)
            if m is None:  # uncapped: its whole share, but nothing from the root without a match there
                others += 1 + rows + (0 if mg is None else mg.tail if root is None else mg.rows)
                tokens += 1.0  # its root's token (the capped ones' is in the length chooser's count)
            else:
                counts[match_class(m)] += 1
                others += rows + mg.tail  # zero for a trusted plan
        caps = self.lengths.choose(counts, others, tokens)
        return [p if m is None else p.with_share(MAXGRAM_DRAFTER, replace(
                    mg, length=min(mg.length, caps[match_class(m)]), match_class=match_class(m)))
                for m, p, mg in zip(match, plans, shares)]

    def _price_mixed_rows(self, seqs: list[SeqView], plans: list[DraftPlan]) -> list[DraftPlan]:
        """Max-Gram's rows in a plan where the draft model drafts too (its branches from the root and
        its tail below the drafted path) compete with the draft's own nodes, and they earn what they earn
        there, not what Max-Gram alone earns (on prose, far fewer of them are accepted than in steps
        Max-Gram drafts alone).  They stay in the plan while their
        measured rate (:class:`MixedRows`, per mode) pays for a verification row at the step's price:
        the cost curve's next row over the seconds per token the budget chose."""
        chooser = getattr(self.policy, "chooser", None)
        verify = self.verify
        if chooser is None or verify is None or not math.isfinite(chooser.per_token):
            return plans
        block = sum(1 + p.sub.num_nodes + sum(share_rows(v) for v in p.shares.values()) for p in plans)
        price = (verify(block + 1) - verify(block)) / max(chooser.per_token, 1e-9)  # tokens a row costs
        out = []
        for seq, p in zip(seqs, plans):
            mg = p.share(MAXGRAM_DRAFTER)
            if p.sub.num_nodes and mg is not None and mg.rows and not mg.trusted:
                greedy = seq.request.sampling.greedy
                self.mixed.tick(greedy)
                if self.mixed.rate(greedy) < price:
                    p = p.with_share(MAXGRAM_DRAFTER, replace(mg, length=0, tail=0))
            out.append(p)
        return out

    def _observe_maxgram(self, results: list[SeqStepResult], plans: list[DraftPlan]) -> None:
        for res in results:  # Max-Gram's own rows (not also the draft's) in trees the draft model drafted
            tree = res.tree
            if tree.num_sub and tree.sources:  # a node with no sources entry is the draft model's alone
                tokens = tree.tokens
                own = [i for i, src in tree.sources.items()
                       if tokens[i] != DEAD and src & MAXGRAM_SOURCES and DRAFT_MODEL not in src]
                if own:
                    accepted = set(res.result.accepted)
                    self.mixed.observe(res.seq.request.sampling.greedy, len(own), sum(i in accepted for i in own))
        if self.lengths is None:
            return
        for res, plan in zip(results, plans):
            tree, mg = res.tree, plan.share(MAXGRAM_DRAFTER)
            if tree.tokens and not tree.num_sub and tree.draft_index is None and mg is not None \
                    and mg.match_class is not None:
                # Max-Gram alone drafted it (also when trusting it replaced the draft model)
                self.lengths.observe(mg.match_class, max(tree.depths()), len(res.result.accepted), mg.length)

    def _plan(self, seq: SeqView, step: Optional[StepBudget] = None) -> DraftPlan:
        """What each drafter of the request's method may draft this step: the method's own plan
        (``engine.speculative.methods``), given the room, the draft model's tree within the budget, and
        whether the budget lets the draft model run (a budget of plain decoding also stops the vertical
        cascade and MJSD, which run it; Max-Gram has no drafting cost and always proposes)."""
        budget = step.widths if step is not None else None
        spec, cfg = seq.request.spec, self.config
        empty = self.topology.subtree(())
        if spec.adaptive is False:
            budget = None  # this request asked for its whole tree every step
        elif budget != () and seq.draft_slot is not None and self.policy is not None \
                and not self.policy.catch_up_pays(seq, step):
            budget = ()  # the draft lags too far behind for this request to gain from catching up (or
            # this is its first token, which never waits for the draft to read the prompt)
        room = self._room(seq)
        if not spec.enabled or seq.speculation_error is not None:
            return DraftPlan(spec.method or cfg.spec_method, empty)
        m = method(spec.method)
        if m.needs_draft and seq.draft_slot is None:
            return DraftPlan(spec.method, empty)
        return m.plan(PlanInput(seq, cfg, room, budget != (), self._subtree(seq, budget), empty))

    def _subtree(self, seq: SeqView, budget: Optional[tuple[int, ...]] = None) -> SubTree:
        """The largest tree this sequence may draft this step: its request's tree (or the engine's),
        within the step's budget (a width config; ``None`` = no cap), its max_depth and what remains."""
        spec = seq.request.spec
        if not spec.enabled or seq.draft_slot is None or seq.speculation_error is not None:
            return self.topology.subtree(())
        widths = spec.tree if spec.tree is not None else self.topology.widths
        if budget is not None:
            widths = tuple(min(a, b) for a, b in zip(widths, budget))
        depth = min(len(widths), seq.remaining - 1)
        if spec.max_depth is not None:
            depth = min(depth, spec.max_depth)
        return self.topology.subtree(tuple(widths[: max(depth, 0)]))


class MixedRows:
    """The acceptance of Max-Gram's own rows in trees the draft model drafted too, per mode (greedy or
    sampled): decayed counts shrunk to ``prior`` by ``weight`` pseudo-rows.  The counts also decay at
    every plan that could use the rows (``tick``), so evidence that kept them out fades and they are
    tried again: a rate measured once is not kept for ever."""

    def __init__(self, prior: float = 0.3, weight: float = 8.0, decay: float = 0.99) -> None:
        self.prior, self.weight, self.decay = prior, weight, decay
        self.hits = {True: 0.0, False: 0.0}
        self.seen = {True: 0.0, False: 0.0}

    def rate(self, greedy: bool) -> float:
        return (self.hits[greedy] + self.weight * self.prior) / (self.seen[greedy] + self.weight)

    def tick(self, greedy: bool) -> None:
        self.hits[greedy] *= self.decay
        self.seen[greedy] *= self.decay

    def observe(self, greedy: bool, rows: int, accepted: int) -> None:
        self.hits[greedy] += accepted
        self.seen[greedy] += rows
