"""Adaptive speculation: how much to draft, decided per step and per sequence (docs/algorithms.md §5).

Four hooks (:class:`SpecPolicy`) are all the engine sees, called by the planner and, while drafting,
by the draft model's proposer.  What one step decided travels explicitly in the :class:`StepBudget`
that ``budget`` returns; the policy keeps no per-step state of its own:

* ``budget(seqs)``: before drafting, the step's :class:`StepBudget`: its tree budget, a width config
  inside the configured tree (load awareness, :class:`~engine.speculative.cost_model.BudgetChooser`;
  ``widths=None`` = no cap), and what drafting decisions later in the step read;
* ``keep_drafting(seqs, trees, d, step)``: after the draft sampled depth ``d`` of each tree, whether it
  grows another level.  A tree that stops is cut to its depth-``d`` prefix, a slice of the prebuilt
  topology, and the target verifies exactly the nodes that were drafted;
* ``observe(results)``: after verification, learn from what was accepted;
* ``catch_up_pays(seq, step)``: after ``budget``, whether a sequence whose draft cache lags (its prompt, or
  steps without the draft) may catch up this step: never for its first token (time to first token
  stays that of plain decoding), then only when the expected saving over its remaining tokens exceeds
  the catch-up's measured cost (``engine.speculative.cost_model``); otherwise it decodes without the draft
  model this step.  The remaining tokens count at the measured share that comes from steps the draft
  model can draft (``draft_share``: a step ending in a long Max-Gram match is Max-Gram's alone).  For
  such a method, a sequence's first catch-up (its prompt) also waits until its own steps without the
  draft are estimated to have lost what the catch-up costs (ski rental, ``observe_trust``).  Until
  a few dozen first-level nodes have been verified, the acceptance estimates are still the prior, so
  one sequence at a time may catch up to measure them (a pessimistic prior would otherwise never be
  tested): one already drafting, else the one with the shortest lag; a few requests per mode at most.

**Stopping rule (SpecDec++, for trees).**  Every drafted node gets ``y_hat = P(accepted | parent
reached)`` from the acceptance head (when one is loaded for the request's temperature) or from the
:class:`OnlineCalibrator`.  A node's path survives with ``cum = prod(y_hat)`` along it.  After depth
``d``, a sequence keeps drafting only while some live depth-``d`` node has ``cum >= 1 - h`` (i.e. it
stops when ``1 - cum > h`` for every branch), and always while ``d < min_depth``.

**Levels must pay.**  The load-aware budget is chosen from marginal per-depth rates, which cannot
see that one sequence's path is nearly certain this step, nor that the threshold rule will stop most
of the batch early.  So a non-empty budget is extended by chain levels down to ``max_depth``, and at
every depth from ``min_depth`` on, the trees the threshold rule would grow are weighed together: the most
promising ones grow another level only when their summed expected gain ``sum(cum) * r[d + 1]`` beats
what the level costs in tokens at the step's planned rate (one draft forward over their nodes plus
the next level's verification rows on the block drafted so far, ``BudgetChooser.level_tokens``).
At batch 1 a confident path runs deep; in a loaded batch a level run for one or two sequences stalls
the others, and it stops.  Sequences whose catch-up does not pay are left out of the budget's plan.

**Losslessness.**  Decisions use only draft-side information of this step (drafted tokens, q, draft
hidden states) and statistics of *earlier* verifications.  Conditioned on everything before it, a
step verifies a tree whose shape is fixed before the target is consulted, so the exact rule keeps
the target's distribution for any threshold, head or calibrator state (chi-square tested).
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from engine.speculative.acceptance_head import AcceptanceHead
from engine.speculative.cost_model import BudgetChooser, CostModel, cost_key
from engine.speculative.features import NodeFeatures
from engine.speculative.tree import SubTree, TreeTopology

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.speculative.walk import SeqStepResult
    from engine.speculative.view import SeqView
    from engine.speculative.draft_tree import DraftTree

log = logging.getLogger(__name__)


@dataclass
class StepBudget:
    """What a policy decided for one step, handed back to it by the engine while the step drafts."""

    widths: Optional[tuple[int, ...]] = None  # the batch's tree budget; None = no cap
    block: float = 0.0  # verification rows of the step so far (the roots, then each level kept)
    decided: dict[int, tuple[SeqView, bool]] = field(default_factory=dict)  # catch-up decisions, by id(seq)
    rates: dict[bool, torch.Tensor] = field(default_factory=dict)  # calibrator rates read at planning, by greedy
    reach: dict[bool, torch.Tensor] = field(default_factory=dict)  # each topology node's P(accepted), by greedy
    probe: bool = False  # the smallest tree granted although it did not pay (the calibrator keeps learning)
    exploring: dict[bool, bool] = field(default_factory=dict)  # by greedy: a sequence already measures the prior
    # the draft model's price with every sequence drafting: seconds per token it saves, seconds per token
    saving: float = 0.0
    per_token: float = math.inf


class SpecPolicy:
    """The engine's speculation hooks; this base drafts the whole planned tree and learns nothing."""

    wants_features = False  # the proposer records NodeFeatures (q_token, depth, rank) per level
    wants_full_features = False  # ... plus entropy, top-k and the draft's hidden states
    level_stop = True  # keep_drafting is asked after each level (off: the planned depth stands, one read a tree)

    def budget(self, seqs: list[SeqView]) -> StepBudget:
        return StepBudget(None, float(len(seqs)))

    def keep_drafting(self, seqs: list[SeqView], trees: list["DraftTree"], depth: int,
                      step: Optional[StepBudget] = None) -> list[bool]:
        return [True] * len(trees)

    def observe(self, results: list["SeqStepResult"]) -> None:
        return None

    def planning_state(self) -> object:
        """What planning itself moves (not learning): counters that space out probe steps and the
        requests chosen to explore; :meth:`restore_planning` puts them back (``EngineCore.warm_up``)."""
        return None

    def restore_planning(self, state: object) -> None:
        return None

    def observe_trust(self, seq: SeqView, tokens: int, trusted: bool, drafted: bool,
                      step: Optional[StepBudget] = None) -> None:
        """A step of a sequence whose method trusts long Max-Gram matches: ``tokens`` emitted, whether
        Max-Gram alone drafted it (the draft model could not contribute), whether the draft model
        drafted in it, and the step's budget."""
        return None

    def catch_up_pays(self, seq: SeqView, step: Optional[StepBudget] = None) -> bool:
        """Whether the sequence may run its missing tokens through the draft this step (after ``budget``)."""
        return True

    def expected_accepted(self, seq: SeqView, sub: SubTree, step: Optional[StepBudget] = None) -> float:
        """Tokens the sequence's draft tree ``sub`` is expected to get accepted this step (0: no estimate)."""
        return 0.0


class OnlineCalibrator:
    """``P(node accepted | parent reached)`` from live verification results, without a head.

    Two estimates from exponentially decayed counts per ``(depth, rank)``:

    * ``rates()``: the marginal acceptance rate, for the load-aware budget (shrunk by
      ``prior_weight`` pseudo-observations to a fixed prior at depth 1, below it to the rate one
      level up);
    * ``predict(q)``: the draft's own confidence ``q(x)``, scaled by a calibration factor
      ``accepted / sum(q)`` of its cell and q-bin.  The factor keeps q's resolution inside a bin
      (greedy tokens at q = 0.999 and at 0.9 are not alike, and a deep chain of the former is what
      pays), and it starts at 1 (trust q) and shrinks towards the cell's factor, which shrinks
      towards the factor one level up, so an unseen depth reads as calibrated as the one above it.

    ``decay`` applies once per observed sequence-step (a memory of about ``1 / (1 - decay)`` steps).
    """

    Q_BINS = torch.tensor([0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 0.97])  # inner bin edges

    def __init__(self, max_depth: int, max_rank: int = 4, decay: float = 0.995, prior_weight: float = 4.0,
                 prior_first: float = 0.6, prior_ratio: float = 0.35) -> None:
        shape = (max(max_depth, 1), max_rank)
        self.prior = prior_first * prior_ratio ** torch.arange(max_rank, dtype=torch.float32)  # [ranks], depth 1
        self.hits = torch.zeros(shape)
        self.seen = torch.zeros(shape)
        self.q_sum = torch.zeros(shape)
        bins = len(self.Q_BINS) + 1
        self.bin_hits = torch.zeros(*shape, bins)
        self.bin_q_sum = torch.zeros(*shape, bins)
        self.decay = decay
        self.prior_weight = prior_weight

    def _cells(self, depth: torch.Tensor, rank: torch.Tensor, q: torch.Tensor):
        d = (depth - 1).clamp(0, self.hits.shape[0] - 1)
        r = rank.clamp(0, self.hits.shape[1] - 1)
        return d, r, torch.bucketize(q, self.Q_BINS)

    def _shrunk(self, hits: torch.Tensor, seen: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """[depths, ...] ``(hits + w * prior) / (seen + w)``, the prior being ``first`` at depth 1 and
        the estimate one level up below it."""
        w = self.prior_weight
        out = torch.empty_like(hits)
        prior = first
        for d in range(hits.shape[0]):
            out[d] = (hits[d] + w * prior) / (seen[d] + w)
            prior = out[d]
        return out

    def rates(self) -> torch.Tensor:
        """[depths, ranks] marginal acceptance estimates.  Depth 1 shrinks to the fixed prior; each
        deeper depth shrinks to the estimate one level up, so a depth the budget has not drafted yet
        (or not for a while: counts decay) is expected to do as well as the one above it, and gets
        drafted and measured, instead of being held at a pessimistic prior that never lets it run."""
        return self._shrunk(self.hits, self.seen, self.prior)

    def predict(self, depth: torch.Tensor, rank: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """depth, rank, q: [n] -> [n] estimates ``q * factor``, at most 1."""
        d, r, b = self._cells(depth, rank, q)
        w = self.prior_weight
        cell = self._shrunk(self.hits, self.q_sum, torch.ones(self.hits.shape[1]))  # [depths, ranks] factors
        factor = (self.bin_hits[d, r, b] + w * cell[d, r]) / (self.bin_q_sum[d, r, b] + w)
        return (q * factor).clamp(max=1.0)

    def update(self, depth: torch.Tensor, rank: torch.Tensor, q: torch.Tensor, accepted: torch.Tensor) -> None:
        """depth, rank, q, accepted: [n] nodes whose parent was reached (accepted: float 0/1)."""
        for t in (self.hits, self.seen, self.q_sum, self.bin_hits, self.bin_q_sum):
            t.mul_(self.decay)
        d, r, b = self._cells(depth, rank, q)
        q = q.float()
        self.hits.index_put_((d, r), accepted, accumulate=True)
        self.seen.index_put_((d, r), torch.ones_like(accepted), accumulate=True)
        self.q_sum.index_put_((d, r), q, accumulate=True)
        self.bin_hits.index_put_((d, r, b), accepted, accumulate=True)
        self.bin_q_sum.index_put_((d, r, b), q, accumulate=True)


def keep_extending(cum: torch.Tensor, depth: int, threshold: float, min_depth: int) -> bool:
    """The SpecDec++ rule on one tree level.  cum: [n] survival probability of each live node's path
    (0 for dead slots).  Keep drafting below ``min_depth``, else while some ``1 - cum <= h``."""
    if depth < min_depth:
        return True
    return bool(cum.numel()) and float(cum.max()) >= 1.0 - threshold


def verified_labels(res: "SeqStepResult") -> tuple[NodeFeatures, torch.Tensor, torch.Tensor]:
    """(features, reached, accepted) of one verified tree: ``reached`` [n] marks live nodes whose parent
    was reached by the walk (those carry a label), ``accepted`` [n] float 0/1."""
    feats = NodeFeatures.cat(res.tree.features)
    n = feats.num_nodes
    accepted = torch.zeros(n, dtype=torch.bool)
    accepted[[i for i in res.result.accepted if i < n]] = True  # nodes other drafters appended carry no features
    parent = res.tree.sub.parent[:n]
    reached = torch.where(parent >= 0, accepted[parent.clamp(min=0)], True) & feats.live
    return feats, reached, accepted.float()


class AdaptiveSpeculation(SpecPolicy):
    """Threshold stopping + online calibration (+ optional heads) + load-aware budgets."""

    wants_features = True
    SMALL_LAG = 4  # a lag this short catches up within the draft's first level forward, at no real cost
    HORIZON = 256  # tokens a request is assumed to still write at most (max_tokens is only an upper bound)
    EXPLORE_NODES = 32  # first-level verifications (decayed) below which catch-ups are allowed to measure them
    EXPLORE_REQUESTS = 3  # ... for this many requests per mode at most (then the estimates so far judge)

    def __init__(self, topology: TreeTopology, threshold: float = 0.5, min_depth: int = 1,
                 max_depth: Optional[int] = None, heads: tuple[AcceptanceHead, ...] = (),
                 cost: Optional[CostModel] = None, probe_every: int = 64, level_stop: bool = True) -> None:
        """``probe_every``: after this many steps in a row without speculation, one step drafts the
        smallest tree anyway, so the calibrator keeps learning whether speculation pays again.
        ``level_stop``: stop a tree level by level inside the step by the threshold rule (which reads
        each level on the host); off, the depth the budget planned stands and the tree is read once."""
        self.topology = topology
        self.level_stop = level_stop
        self.threshold = threshold
        self.min_depth = min_depth
        self.max_depth = len(topology.widths) if max_depth is None else max_depth
        self.heads = heads
        self.wants_full_features = bool(heads)
        self.calibrators = {g: OnlineCalibrator(self.max_depth) for g in (True, False)}  # by greedy
        self.chooser = BudgetChooser(topology, cost, min_depth, self.max_depth) if cost is not None else None
        self.probe_every = probe_every
        # By greedy: decayed tokens emitted in steps the draft model could draft, and all tokens, of
        # sequences whose method trusts long Max-Gram matches (see ``draft_share``).
        self._trust_tokens = {g: [0.0, 0.0] for g in (True, False)}
        self._explorers: dict[bool, set[str]] = {True: set(), False: set()}  # requests that caught up to explore
        # Per sequence of such a method: the seconds its steps without the draft model are estimated to
        # have lost before the draft first drafted for it, inf after (see ``observe_trust``).
        self._rent: "weakref.WeakKeyDictionary[SeqView, float]" = weakref.WeakKeyDictionary()
        self._idle_steps = 0
        self._chosen_depth = self.max_depth  # the last budget's depth (a probe's when it was one)

    def planning_state(self) -> object:
        return self._idle_steps, self._chosen_depth, {g: set(ids) for g, ids in self._explorers.items()}

    def restore_planning(self, state: object) -> None:
        self._idle_steps, self._chosen_depth, explorers = state
        self._explorers = {g: set(ids) for g, ids in explorers.items()}

    @classmethod
    def from_config(cls, config: "EngineConfig", topology: TreeTopology, target, draft, target_cache,
                    draft_cache, draft_vocab=None, max_rows: Optional[int] = None) -> "AdaptiveSpeculation":
        """Loads the configured heads and, when load-aware, measures the cost curves (a few seconds) up to
        blocks of ``1 + max_rows`` (the most rows a tree of any method has beyond its root; default: the
        largest draft tree's)."""
        heads = tuple(AcceptanceHead.load(p) for p in config.acceptance_heads)
        for path, head in zip(config.acceptance_heads, heads):
            if head.meta.hidden_size not in (0, draft.config.hidden_size):
                raise ValueError(f"acceptance head {path} expects draft hidden size {head.meta.hidden_size}, "
                                 f"the draft has {draft.config.hidden_size}")
            if (head.meta.target, head.meta.draft) != (target.source, draft.source):
                log.warning("acceptance head %s was trained for %s / %s, the engine runs %s / %s", path,
                            head.meta.target, head.meta.draft, target.source, draft.source)
        cost = None
        if config.load_aware:
            max_block = 1 + (topology.num_nodes if max_rows is None else max_rows)

            def measure() -> CostModel:
                return CostModel.measure(target.model, target_cache, draft.model, draft_cache, config.max_batch,
                                         topology, max_block=max_block, draft_vocab=draft_vocab)

            key = cost_key(target, draft, max_batch=config.max_batch, tree=list(topology.widths), max_block=max_block,
                           draft_vocab=None if draft_vocab is None else int(draft_vocab.ids.numel()),
                           batch_invariant=config.batch_invariant, kv_block_size=config.kv_block_size)
            cost = measure() if key is None else CostModel.stored(key, measure, reuse=config.cost_model_cache)
            log.info("cost model: target %s, draft %s", cost.target, cost.draft)
        return cls(topology, config.adaptive_threshold, config.adaptive_min_depth,
                   config.adaptive_max_depth, heads, cost, level_stop=config.adaptive_level_stop)

    def head_for(self, seq: SeqView) -> Optional[AcceptanceHead]:
        """The head trained for the request's temperature: the greedy head for greedy requests, else
        the sampled head with the closest temperature."""
        params = seq.request.sampling
        fits = [h for h in self.heads if (h.meta.temperature == 0) == params.greedy]
        return min(fits, key=lambda h: abs(h.meta.temperature - params.temperature), default=None)

    # ------------------------------------------------------------------ hooks
    def budget(self, seqs: list[SeqView]) -> StepBudget:
        step = StepBudget(self.topology.widths[: self.max_depth], float(len(seqs)))  # rows so far: the roots
        if self.chooser is None:
            return step
        spec = [s for s in seqs if s.request.spec.enabled and s.draft_slot is not None]
        step.rates = {g: self.calibrators[g].rates() for g in {s.request.sampling.greedy for s in spec}}
        choice = self._choose(spec, len(seqs) - len(spec), step)
        step.saving, step.per_token = self.chooser.saving, self.chooser.per_token  # every sequence drafting
        if choice:
            # Sequences whose catch-up does not pay decode plainly this step.  Plan the step without them:
            # a budget priced for every draft slot would make the few that draft pay alone for levels
            # priced as shared.  Their decision is the one taken at the first plan's saving.
            # While a mode's acceptance is still the prior, one sequence measures it: one already
            # drafting (its draft cache is warm), else the one with the shortest catch-up.
            for s in spec:
                if self._lag(s) <= self.SMALL_LAG:
                    step.exploring[s.request.sampling.greedy] = True
            step.decided = {}
            for s in sorted(spec, key=self._lag):
                step.decided[id(s)] = (s, self.catch_up_pays(s, step))
            drafting = [s for s in spec if step.decided[id(s)][1]]
            if len(drafting) < len(spec):
                choice = self._choose(drafting, len(seqs) - len(drafting), step)
        self._chosen_depth = len(choice)
        if choice or not spec:
            self._idle_steps = 0
            step.widths = choice + (1,) * (self.max_depth - len(choice)) if choice else choice  # deeper only if it pays
            return step
        self._idle_steps += 1
        if self._idle_steps < self.probe_every:
            step.widths = choice
            return step
        self._idle_steps = 0
        self._chosen_depth = self.min_depth
        step.widths = (1,) * self.min_depth  # a probe
        step.probe = True
        return step

    def _choose(self, spec: list[SeqView], plain: int, step: StepBudget) -> tuple[int, ...]:
        groups: dict[bool, int] = {}
        for s in spec:
            groups[s.request.sampling.greedy] = groups.get(s.request.sampling.greedy, 0) + 1
        return self.chooser.choose([(n, step.rates[g]) for g, n in groups.items()], plain)

    @staticmethod
    def _lag(seq: SeqView) -> int:
        return len(seq.tokens) - seq.draft_cached

    def catch_up_pays(self, seq: SeqView, step: Optional[StepBudget] = None) -> bool:
        decided = step.decided.get(id(seq)) if step is not None else None
        if decided is not None and decided[0] is seq:
            return decided[1]  # taken by this step's budget
        lag = self._lag(seq)
        if lag <= self.SMALL_LAG:
            return True
        if seq.num_output == 0:
            return False  # time to first token: the first step decodes plainly, the catch-up comes after
        if step is not None and step.probe:
            return False  # a probe learns from the drafts that cost nothing extra, never from a prompt's
            # catch-up (a probe that catches prompts up stalls every stream for a prompt's draft forward)
        if self.chooser is None:
            return True
        greedy = seq.request.sampling.greedy
        explorers = self._explorers[greedy]
        if float(self.calibrators[greedy].seen[0, 0]) < self.EXPLORE_NODES and (
                len(explorers) < self.EXPLORE_REQUESTS or seq.request.request_id in explorers):
            # The pair's acceptance is still the prior: measure it before judging the saving, with one
            # sequence at a time (at four streams, all four catching their prompts up to explore cost
            # more than the drafts won back), and a few requests at most (where Max-Gram drafts most
            # steps, the draft model runs too rarely to measure it soon, and every prompt's catch-up
            # was exploring).
            if step is None:
                return True
            if step.exploring.get(greedy):
                return False
            step.exploring[greedy] = True
            explorers.add(seq.request.request_id)
            return True
        remaining = min(seq.remaining, self.HORIZON) * self.draft_share(greedy)
        if not self.chooser.cost.catch_up_pays(lag, remaining, self.chooser.saving):
            return False
        rent = self._rent.get(seq)
        return rent is None or rent >= self.chooser.cost.catch_up_curve(lag)

    TRUST_DECAY = 0.995  # per observed sequence-step, as the calibrators
    TRUST_PRIOR = 16.0  # pseudo-tokens at share 1 (until measured, every token counts)

    def observe_trust(self, seq: SeqView, tokens: int, trusted: bool, drafted: bool,
                      step: Optional[StepBudget] = None) -> None:
        t = self._trust_tokens[seq.request.sampling.greedy]
        t[0] = self.TRUST_DECAY * t[0] + (0 if trusted else tokens)
        t[1] = self.TRUST_DECAY * t[1] + tokens
        # The first catch-up (the prompt) as ski rental: the draft model is bought once the steps that
        # went without it are estimated to have lost what the catch-up costs, and is then kept (later
        # catch-ups are a few tokens, priced by the payback test alone).  A step without the draft that
        # emitted k tokens lost about what plain decoding's token costs over the draft's (the budget's
        # saving), less the k - 1 tokens Max-Gram added at the draft's price per token; a step where
        # Max-Gram did better than that gains, down to nothing lost.  A request that copies its prompt
        # (code) never pays for the draft to read it; one writing novel text pays after a few steps.
        # As far as these estimates hold, whatever the request turns out to need, this costs at most
        # about twice the better of catching up at once and never (docs/algorithms.md §5.5).
        rent = self._rent.get(seq, 0.0)  # inf once bought: it stays so
        if drafted:
            rent = math.inf
        elif not trusted and step is not None and step.saving > 0:  # a choice that drafts: per_token finite
            rent = max(0.0, rent + step.saving - (tokens - 1) * step.per_token)
        self._rent[seq] = rent

    def draft_share(self, greedy: bool) -> float:
        """The share of emitted tokens that come from steps where the draft model can draft: a step whose
        context ends in a long Max-Gram match is Max-Gram's alone.  A catch-up pays back only over those
        tokens: on code that copies its prompt, most steps are Max-Gram's, and a prompt's catch-up can buy
        only a few draft tokens, slower than Max-Gram alone."""
        used, total = self._trust_tokens[greedy]
        return (used + self.TRUST_PRIOR) / (total + self.TRUST_PRIOR)

    def expected_accepted(self, seq: SeqView, sub: SubTree, step: Optional[StepBudget] = None) -> float:
        """The marginal acceptance rates read at planning, summed over the reach of ``sub``'s nodes."""
        if self.chooser is None or not sub.num_nodes:
            return 0.0
        g = seq.request.sampling.greedy
        reach = step.reach.get(g) if step is not None else None
        if reach is None:  # once per step and mode, not per sequence
            rates = step.rates.get(g) if step is not None else None
            reach = self.chooser.reach(rates if rates is not None else self.calibrators[g].rates())
            if step is not None:
                step.reach[g] = reach
        return float(reach[sub.nodes].sum())

    def keep_drafting(self, seqs: list[SeqView], trees: list["DraftTree"], depth: int,
                      step: Optional[StepBudget] = None) -> list[bool]:
        step = step if step is not None else StepBudget(None, float(len(seqs)))  # outside a planned step
        want, gains, sizes = [], [], []
        for seq, tree in zip(seqs, trees):
            y = self.predict(seq, tree.features[-1])
            k = tree.sub.widths[depth - 1]
            parent_cum = tree.scores[-1].repeat_interleave(k) if tree.scores else torch.ones(y.numel())
            cum = torch.where(tree.features[-1].live, parent_cum * y, 0.0)  # [level nodes]
            tree.scores.append(cum)
            want.append(keep_extending(cum, depth, self.threshold, self.min_depth))
            sizes.append(cum.numel())
            if self.chooser is not None:
                g = seq.request.sampling.greedy
                if g not in step.rates:  # a sequence this step's budget did not plan for
                    step.rates[g] = self.calibrators[g].rates()
                rates = step.rates[g]
                gains.append(float(cum.sum()) * float(rates[min(depth, rates.shape[0] - 1), 0]))  # one level deeper
        step.block += sum(sizes)
        if self.chooser is None or depth < self.min_depth:
            return want
        return self._levels_that_pay(trees, depth, want, gains, sizes, step.block)

    def _levels_that_pay(self, trees: list["DraftTree"], depth: int, want: list[bool], gains: list[float],
                         sizes: list[int], block: float) -> list[bool]:
        """Of the trees the threshold rule would grow, the most promising ones whose summed expected
        gain beats what the level costs them together (one draft forward over their depth-``depth``
        nodes plus the next level's verification rows, ``BudgetChooser.level_tokens``); none when no
        set pays.  A lone confident sequence in a busy batch thus stops where a level shared by many
        would have gone on."""
        order = sorted((i for i, w in enumerate(want) if w), key=lambda i: -gains[i])
        best, best_n = 0.0, 0
        gain = draft = rows = 0.0
        for n, i in enumerate(order, 1):
            gain += gains[i]
            draft += sizes[i]
            rows += sizes[i] * trees[i].sub.widths[depth]
            net = gain - self.chooser.level_tokens(block, draft, rows)
            if net > best:
                best, best_n = net, n
        go = set(order[:best_n])
        return [i in go for i in range(len(trees))]

    def predict(self, seq: SeqView, feats: NodeFeatures) -> torch.Tensor:
        head = self.head_for(seq)
        if head is not None:
            return head.predict(feats)
        cal = self.calibrators[seq.request.sampling.greedy]
        return cal.predict(feats.depth, feats.rank, feats.q_token)

    def observe(self, results: list["SeqStepResult"]) -> None:
        for res in results:
            if not res.tree.features:
                continue
            feats, reached, accepted = verified_labels(res)
            cal = self.calibrators[res.seq.request.sampling.greedy]
            cal.update(feats.depth[reached], feats.rank[reached], feats.q_token[reached], accepted[reached])
