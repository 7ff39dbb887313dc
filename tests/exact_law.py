"""The exact output law of one speculative step, by enumeration: no sampling, no p-value.

Every random decision of a step is a *choice* with known probabilities: a draft child drawn from
``q`` (with or without replacement), a random stop, Max-Gram's guess kept by the draft's review, an
acceptance test ``u < p(x)/q(x)``, a correction or bonus draw.  :func:`enumerate_law` runs a step
function once per sequence of choices (depth first, replaying the prefix), multiplying the
probabilities of the choices made, so the law of what the step emits is exact up to float64 rounding.

The rule under test is the engine's own code: :func:`engine.speculative.walk.verify_sampled` and
``verify_target_init`` walk :class:`DraftTree` events built by the engine's ``add_path`` and Max-Gram's
``propose`` / ``extend_tree``; the cascade's inner review is ``engine.speculative.cascade.review_guess``.  Only
their random source is replaced (:class:`Replay` implements ``engine.speculative.walk.Coins``), and the
models are the toy tables of ``tests/toy.py`` in float64 (``p`` and ``q`` come from the engine's
``compute_probs``, renormalised in float64).

**What "exact" compares.**  A step from context ``c`` emits ``e`` (accepted tokens, then a correction or
bonus).  Extending every outcome by the target's own continuation to a fixed length ``L`` (the longest
possible emission) gives a law on ``V^L``; the step is lossless iff that law equals the target's
``p(s | c)`` for every ``s``.  Per-step exactness at every context is what the induction over steps
needs (each step starts from a context and the engine state it implies).

**Lazy trees.**  A draft-model tree's sibling groups are drawn when the walk first looks at them.  The
groups of rows the walk never visits do not change what it emits, and their probabilities sum to one,
so leaving them out is the same sum over every drafted tree, only shorter.  A rule that reads the whole
level (the threshold stop, Max-Gram's tail below the deepest leaf) draws it whole.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

import engine.speculative.walk as verify
from engine.grammar import apply_mask
from engine.models.vocab import OutputVocab
from engine.request import GenerationRequest, SamplingParams
from engine.sampler import SamplingTensors, compute_probs
from engine.sequence import Sequence
from engine.speculative.cascade import review_guess
from engine.speculative.constrained import GRAMMAR_DRAFTER, ForcedShare, GrammarDrafter, mask_rows
from engine.speculative.device_maxgram import DeviceMaxGram
from engine.speculative.draft_tree import CASCADE, DEAD, SAMPLED, DraftTree, HeldTokens
from engine.speculative.maxgram import BigramTable, MaxGramDrafter
from engine.speculative.methods import DraftPlan
from engine.speculative.target_init import draw_candidates, verify_target_init
from engine.speculative.tree import TreeTopology
from tests.grammar_toy import allowed_mask, toy_grammar
from tests.toy import random_table

VOCAB = 6
TARGET_TABLE, DRAFT_TABLE = random_table(VOCAB, 0), random_table(VOCAB, 1)
BIGRAMS = ((0, 1), (1, 2), (4, 5), (5, 0))
# the prompt of the end-to-end harness, and a context whose suffix "0 1" recurs (Max-Gram copies "4 0")
CONTEXTS = ((2, 3), (0, 1, 4, 0, 1))


@dataclass(frozen=True)
class Law:
    """One step's setting: drafter, tree, sampling parameters, and optionally a planted bug."""

    name: str
    widths: tuple[int, ...] = ()
    method: str = "mcsd"  # mcsd | maxgram | mcsd+maxgram | cascade | target-init
    without_replacement: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str = ""  # "random": each tree stops after each level with probability 1/2; "threshold": SpecDec++
    threshold: float = 0.5
    draft_vocab: tuple[int, ...] = ()  # the draft's output layer cut to these tokens
    maxgram_len: int = 2
    maxgram_branches: int = 2
    tail: int = 1  # Max-Gram tokens below the deepest drafted node (mcsd+maxgram, cascade)
    merge: bool = True  # Max-Gram's branches share nodes with equal drafted ones (False: siblings of their own)
    cascade_depth: int = 2
    rounds: int = 0  # the device cascade (maxgram_read_tree = false): this many review rounds, its tail one-hot
    k: int = 1  # target-initialised candidates
    sabotage: str = ""  # see :func:`planted`
    contexts: tuple[tuple[int, ...], ...] = CONTEXTS
    grammar: bool = False  # the toy grammar (tests/grammar_toy.py) constrains the output: the law is the masked target's
    forced: int = 2  # under the grammar: forced tokens a step drafts at most (engine.speculative.constrained)


# ----------------------------------------------------------------------------------- enumeration
class Replay:
    """:class:`engine.speculative.walk.Coins` that makes the choices of a given prefix, then the first
    possible one of every later choice, and records each choice with its probabilities."""

    def __init__(self, prefix: tuple[int, ...]) -> None:
        self.prefix = prefix
        self.trace: list[tuple[list[float], int]] = []
        self.prob = 1.0

    def choose(self, weights: list[float]) -> int:
        i = len(self.trace)
        pick = self.prefix[i] if i < len(self.prefix) else next(j for j, w in enumerate(weights) if w > 0)
        self.trace.append((weights, pick))
        self.prob *= weights[pick]
        return pick

    def accept(self, p_x: float, q_x: float, row: int = 0, event: int = 0) -> bool:
        a = float(p_x > 0) if q_x <= 0 else min(1.0, p_x / q_x)  # P(u * q < p) for u ~ U(0, 1)
        return self.choose([a, 1.0 - a]) == 0

    def draw(self, p: torch.Tensor, row: int = 0) -> int:
        w = p.tolist()
        total = sum(w)
        return self.choose([x / total for x in w])

    def draw_distinct(self, p: torch.Tensor, k: int) -> list[int]:
        out, w = [], p.tolist()
        while len(out) < k and sum(w) > 0:
            total = sum(w)
            out.append(self.choose([x / total for x in w]))
            w[out[-1]] = 0.0
        return out

    def bernoulli(self, a: float) -> bool:
        return self.choose([a, 1.0 - a]) == 0


def enumerate_law(step: Callable[[Replay], tuple], last_draw_emitted: bool = True) -> dict[tuple, float]:
    """The exact law of ``step(coins)``'s (hashable) result over every sequence of choices.

    ``last_draw_emitted``: when a run's last choice was a draw whose token ends the result (a step's
    correction or bonus token, appended and returned), its alternatives are the same result with the
    other token, so they are added without running the step again (the law is the same; the
    enumeration is about vocabulary-size times shorter)."""
    law: dict[tuple, float] = defaultdict(float)
    stack: list[tuple[int, ...]] = [()]
    while stack:
        prefix = stack.pop()
        coins = Replay(prefix)
        out = step(coins)
        picks = tuple(pick for _, pick in coins.trace)
        branch_to = len(coins.trace)
        if last_draw_emitted and len(coins.trace) > len(prefix) and out and out[-1] == picks[-1] \
                and len(coins.trace[-1][0]) == VOCAB:
            weights, pick = coins.trace[-1]
            for alt, w in enumerate(weights):
                if w > 0:
                    law[out[:-1] + (alt,)] += coins.prob / weights[pick] * w
            branch_to -= 1
        else:
            law[out] += coins.prob
        for depth in range(len(prefix), branch_to):
            weights, pick = coins.trace[depth]
            stack.extend(picks[:depth] + (alt,) for alt, w in enumerate(weights) if alt != pick and w > 0)
    return dict(law)


# ----------------------------------------------------------------------------------- the models
@lru_cache(maxsize=None)
def _probs(which: str, ctx: tuple[int, ...], temperature: float, top_p: float,
           cut: tuple[int, ...], grammar: str = "") -> torch.Tensor:
    """The processed next-token law of the target or the draft after ``ctx``, float64.  ``grammar``:
    "masked" applies the toy grammar's mask to the logits as the engine does (the target's with
    ``apply_mask``, the draft's with ``mask_rows``), before temperature and top-p; "late" masks the
    finished law instead (a planted bug)."""
    table = TARGET_TABLE if which == "target" else DRAFT_TABLE
    prev = ctx[-2] if len(ctx) >= 2 else VOCAB
    logits = table[ctx[-1], prev].clamp_min(1e-30).log()[None].float()
    if cut:
        logits = OutputVocab(cut, VOCAB).restrict(logits)
    allowed = allowed_mask(ctx[-1])[None]
    if grammar == "masked":
        logits = apply_mask(logits, allowed) if which == "target" else mask_rows(logits, allowed)
    st = SamplingTensors.from_params([SamplingParams(temperature=temperature, top_p=top_p)], VOCAB)
    p = compute_probs(logits, st)[0].double()
    if grammar == "late":
        p = p * allowed[0]
    return p / p.sum()


def target(law: Law, ctx: tuple[int, ...]) -> torch.Tensor:
    mode = ("late" if law.sabotage == "mask_after_top_p" else "masked") if law.grammar else ""
    return _probs("target", tuple(ctx), law.temperature, law.top_p, (), mode)


def draft(law: Law, ctx: tuple[int, ...]) -> torch.Tensor:
    mode = "masked" if law.grammar and law.sabotage != "draft_unmasked" else ""
    return _probs("draft", tuple(ctx), law.temperature, law.top_p, law.draft_vocab, mode)


def target_joint(law: Law, ctx: tuple[int, ...], length: int) -> dict[tuple[int, ...], float]:
    """``p(s | ctx)`` for every ``s`` in ``V^length``."""
    out = {}
    stack: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while stack:  # depth first over prefixes of positive probability (a grammar zeroes most)
        s, pr = stack.pop()
        if len(s) == length:
            out[s] = pr
            continue
        p = target(law, tuple(ctx) + s).tolist()
        stack.extend((s + (x,), pr * px) for x, px in enumerate(p) if px > 0 or not law.grammar)
    return out


def extend(law: Law, ctx: tuple[int, ...], emitted: dict[tuple, float], length: int) -> dict[tuple, float]:
    """Each emitted sequence continued by the target to ``length`` tokens: the law the step must match."""
    out: dict[tuple, float] = defaultdict(float)
    for e, pr in emitted.items():
        if len(e) >= length:
            out[e[:length]] += pr
            continue
        for rest, pr_rest in target_joint(law, tuple(ctx) + e, length - len(e)).items():
            out[e + rest] += pr * pr_rest
    return dict(out)


# ----------------------------------------------------------------------------------- drafting
class LazyTree:
    """A draft-model tree of shape ``law.widths`` whose sibling groups (and random stops) are drawn
    from ``coins`` when first looked at.  ``tokens[i]``, ``events[row]`` and ``q(row)`` are what the
    verifier reads."""

    def __init__(self, law: Law, ctx: tuple[int, ...], coins: Replay) -> None:
        self.law, self.ctx, self.coins = law, ctx, coins
        self.parent, self.depth, self.children = _shape(law.widths)
        self.drawn: dict[int, int] = {}
        self.levels = 1  # levels drafted so far (level 1 always)
        self.stopped = False
        self.tokens = _Lookup(self.token)
        self.events = _Lookup(lambda row: [(c, SAMPLED) for c in self.children[row]
                                           if self.depth[c] <= self.drafted_depth(self.depth[c])])

    def path(self, node: int) -> tuple[int, ...]:
        out = []
        while node >= 0:
            out.append(self.token(node))
            node = self.parent[node]
        return tuple(out[::-1])

    def context(self, row: int) -> tuple[int, ...]:
        return self.ctx + (self.path(row - 1) if row > 0 else ())

    def q(self, row: int) -> torch.Tensor:
        return draft(self.law, self.context(row))

    def token(self, node: int) -> int:
        if node not in self.drawn:
            row = self.parent[node] + 1
            if row > 0 and self.token(row - 1) == DEAD:
                raise AssertionError("the verifier looked below a dead node")
            group = self.children[row]
            q = self.q(row)
            if self.law.without_replacement:
                toks = self.coins.draw_distinct(q, len(group))
            else:
                toks = [self.coins.draw(q) for _ in group]
            for c, t in itertools.zip_longest(group, toks, fillvalue=DEAD):
                self.drawn[c] = t
        return self.drawn[node]

    def drafted_depth(self, depth: int) -> int:
        """Draws the stop decisions up to ``depth``; returns how many levels were drafted (so far)."""
        while not self.stopped and self.levels < min(depth, len(self.law.widths)):
            if self.keep_drafting(self.levels):
                self.levels += 1
            else:
                self.stopped = True
        return self.levels

    def keep_drafting(self, d: int) -> bool:
        if self.law.stop == "random":
            return self.coins.bernoulli(0.5)
        if self.law.stop == "threshold":  # SpecDec++ with q as the acceptance estimate
            live = [i for i, dep in enumerate(self.depth) if dep == d and self.token(i) != DEAD]
            return any(self.cum(i) >= 1.0 - self.law.threshold for i in live)
        return True

    def cum(self, node: int) -> float:
        out = 1.0
        while node >= 0:
            out *= float(self.q(self.parent[node] + 1)[self.token(node)])
            node = self.parent[node]
        return out

    def eager(self) -> DraftTree:
        """The whole drafted tree as the engine holds it: the drafted levels' subtree, node tokens
        (level-major) and the law of each row's sampled children."""
        levels = self.drafted_depth(len(self.law.widths))
        sub = TreeTopology(self.law.widths).subtree(self.law.widths[:levels])
        toks: list[int] = []
        for i in range(sub.num_nodes):  # nothing is drawn below a dead node (a grammar leaves few tokens)
            p = self.parent[i]
            toks.append(DEAD if p >= 0 and toks[p] == DEAD else self.token(i))
        rows = {p + 1 for i, p in enumerate(self.parent[: sub.num_nodes]) if toks[i] != DEAD}
        return DraftTree(sub, toks, q={row: self.q(row) for row in rows})


@lru_cache(maxsize=None)
def _shape(widths: tuple[int, ...]) -> tuple[list[int], list[int], list[list[int]]]:
    """Parents, depths and each block row's children (in rank order) of the tree ``widths``."""
    sub = TreeTopology(widths).subtree(widths)
    parent, depth = sub.parent.tolist(), sub.depth.tolist()
    children: list[list[int]] = [[] for _ in range(len(parent) + 1)]
    for i, p in enumerate(parent):
        children[p + 1].append(i)
    return parent, depth, children


class _Lookup:
    def __init__(self, get: Callable[[int], object]) -> None:
        self.get = get

    def __getitem__(self, i: int):
        return self.get(i)


def seq_for(ctx: tuple[int, ...], grammar: bool = False) -> Sequence:
    """The engine's sequence for ``ctx`` (under the toy grammar, starting after ``ctx``'s last token)."""
    request = GenerationRequest("exact", list(ctx), SamplingParams(max_tokens=8),
                                grammar=toy_grammar(ctx[-1]) if grammar else None)
    return Sequence.create(request, stream=None)


def constrain(law: Law, seq: Sequence, tree: DraftTree) -> None:
    """Under the grammar, what the engine does to a drafted tree before verification: the grammar
    drafter prunes the nodes the grammar forbids and appends the tokens it forces."""
    if law.grammar:
        plan = DraftPlan(law.method, tree.sub, {GRAMMAR_DRAFTER: ForcedShare(room=8)})
        GrammarDrafter(law.forced).propose([seq], [plan], [tree])


def maxgram(law: Law) -> MaxGramDrafter:
    return MaxGramDrafter(max_len=law.maxgram_len, bigram=BigramTable(dict(BIGRAMS)), bigram_len=law.maxgram_len)


# ----------------------------------------------------------------------------------- one step
def step_law(law: Law, ctx: tuple[int, ...]) -> tuple[dict[tuple, float], int]:
    """The exact law of the tokens one step emits from ``ctx``, and the longest possible emission."""
    ctx = tuple(ctx)
    p_of_ctx = lambda c: target(law, c)  # noqa: E731
    if law.method == "target-init":
        return enumerate_law(lambda coins: _target_init_step(law, ctx, coins)), len(law.widths) + 1
    if law.method == "mcsd":
        def step(coins: Replay) -> tuple:
            tree = LazyTree(law, ctx, coins)
            res = verify.verify_sampled(lambda row: p_of_ctx(tree.context(row)), tree.q, tree.tokens, tree.events,
                                        coins, law.without_replacement ^ (law.sabotage == "replacement_mismatch"))
            return tuple(res.tokens)
        return enumerate_law(step), len(law.widths) + 1

    def step(coins: Replay) -> tuple:  # eager trees: the draft model's (if any), then Max-Gram's
        seq, mg = seq_for(ctx, law.grammar), maxgram(law)
        if law.method == "cascade" and law.rounds:  # the device's: fixed rounds, the tail as one-hot laws
            tree = DraftTree(TreeTopology((1,)).subtree(()), [])
            chain, chain_q = _cascade_chain(law, ctx, seq, mg, coins)
            props = mg.propose(seq, chain, max_len=law.tail) if law.tail else []
            tail = props[0].tokens if props else []
            tree.add_path(-1, chain + tail, CASCADE, SAMPLED, chain_q + [onehot(t) for t in tail], merge=False)
        elif law.method == "cascade":
            tree = DraftTree(TreeTopology((1,)).subtree(()), [])
            chain, chain_q = _cascade_chain(law, ctx, seq, mg, coins)
            tree.add_path(-1, chain, CASCADE, SAMPLED, chain_q)
            mg.extend_tree(seq, tree, tail=law.tail)
        elif law.method == "maxgram":
            tree = DraftTree(TreeTopology((1,)).subtree(()), [])
            mg.extend_tree(seq, tree, length=law.maxgram_len, branches=law.maxgram_branches)
        elif not law.merge and law.tail:  # the GPU preset: the draft's tokens held, Max-Gram's tail on the device
            tree = LazyTree(law, ctx, coins).eager()
            _hold(tree)
            DeviceMaxGram(mg, torch.device("cpu")).tails([seq], [tree], [law.tail])
            mg.extend_tree(seq, tree, 0, law.maxgram_len, law.maxgram_branches, merge=False)
        else:  # mcsd+maxgram
            tree = LazyTree(law, ctx, coins).eager()
            mg.extend_tree(seq, tree, law.tail, law.maxgram_len, law.maxgram_branches, law.merge)
        constrain(law, seq, tree)

        def row_ctx(row: int) -> tuple[int, ...]:
            return ctx + (tuple(tree.path_to(row - 1)) if row > 0 else ())
        res = verify.verify_sampled(lambda row: p_of_ctx(row_ctx(row)), lambda row: tree.q[row], tree.tokens,
                                    tree.events(), coins, law.without_replacement)
        return tuple(res.tokens)
    return enumerate_law(step), max(len(law.widths), law.cascade_depth if law.method == "cascade" else 0,
                                    law.maxgram_len) + law.tail + 1 + (law.forced if law.grammar else 0)


class _Held(HeldTokens):
    """A drafted tree's tokens moved to a tensor, as the proposer leaves a tree it drafted on the device."""

    def __init__(self, tree: DraftTree) -> None:
        super().__init__([tree])
        self.flat = torch.tensor(list(tree.tokens) + [0])


def _hold(tree: DraftTree) -> None:
    _Held(tree).hold()
    tree.tokens = [DEAD] * tree.num_nodes  # placeholders: reading the tokens reads the holder


def onehot(token: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), VOCAB).float()


def _cascade_chain(law: Law, ctx, seq, mg, coins) -> tuple[list[int], list[torch.Tensor]]:
    """The vertical cascade's chain: rounds of Max-Gram's guess reviewed by the draft (the engine's
    ``review_guess``), each chain token with the draft law it has: until the chain is whole (the
    host's), or ``law.rounds`` rounds, which may leave it short (the device's)."""
    chain: list[int] = []
    chain_q: list[torch.Tensor] = []
    rounds = 0
    while len(chain) < law.cascade_depth and (not law.rounds or rounds < law.rounds):
        rounds += 1
        props = mg.propose(seq, chain, max_len=law.cascade_depth - len(chain))
        guess = props[0].tokens if props else []
        probs = torch.stack([draft(law, ctx + tuple(chain) + tuple(guess[:i])) for i in range(len(guess) + 1)])
        kept, toks = review_guess(probs, guess, law.cascade_depth - len(chain), False, coins)
        chain += toks
        chain_q += [probs[i] for i in range(len(toks))]
    return chain, chain_q


def _target_init_step(law: Law, ctx: tuple[int, ...], coins: Replay) -> tuple:
    """A target-initialised step from ``ctx`` whose candidates come from the target there: the kept
    candidate and its accepted chain, then the token the next step would start from with one candidate
    (drawn from the law the engine draws the next candidates from)."""
    st = SamplingTensors.from_params([SamplingParams(temperature=law.temperature, top_p=law.top_p)], VOCAB)
    p0 = target(law, ctx)
    cands = draw_candidates(p0.log(), p0, st, law.k, coins)
    tree = LazyTree(law, ctx, coins)
    for c, t in itertools.zip_longest(tree.children[0], cands, fillvalue=DEAD):
        tree.drawn[c] = t

    def accept(row: int, node: int) -> bool:
        x = tree.tokens[node]
        return coins.accept(float(target(law, tree.context(row))[x]), float(tree.q(row)[x]))

    res, rejected = verify_target_init(accept, tree.tokens, [[c for c, _ in tree.events[r]]
                                                              for r in range(len(tree.children))])
    probs = target(law, tree.context(res.final_row))
    if rejected:
        probs = verify.residual(probs, tree.q(res.final_row))
    return tuple(res.tokens) + (coins.draw(probs),)


# ----------------------------------------------------------------------------------- the check
def deviation(law: Law) -> tuple[float, float]:
    """(max absolute difference, total variation) between the step's extended law and the target's,
    the worst over the law's contexts; also checks the law sums to one."""
    worst_abs = worst_tv = 0.0
    with planted(law.sabotage):
        for ctx in law.contexts:
            emitted, length = step_law(law, ctx)
            total = sum(emitted.values())
            assert abs(total - 1.0) < 1e-12, f"{law.name}: the enumerated law sums to {total!r}"
            got, want = extend(law, ctx, emitted, length), target_joint(law, ctx, length)
            diffs = [abs(got.get(s, 0.0) - want.get(s, 0.0)) for s in set(got) | set(want)]
            worst_abs, worst_tv = max(worst_abs, max(diffs)), max(worst_tv, 0.5 * sum(diffs))
    return worst_abs, worst_tv


@contextmanager
def planted(name: str):
    """Bugs planted in the verification rule; each must move the law measurably."""
    saved = dict(vars(verify))
    try:
        if name == "no_q_renorm":  # a rejected sibling is removed from q without renormalising
            def broken_remove(q, x):
                q = q.clone()
                q[x] = 0.0
                return q
            verify.remove_candidate = broken_remove
        elif name == "onehot_no_residual":  # a rejected Max-Gram token stays in the target law
            verify.onehot_residual = lambda p, x: p
        elif name == "residual_skipped":  # after a rejected draft child the next sibling meets p, not norm((p-q)+)
            verify.residual = lambda p, q: p
        elif name not in ("", "replacement_mismatch", "mask_after_top_p", "draft_unmasked"):  # applied in step_law
            # and in target() / draft()
            raise ValueError(name)
        yield
    finally:
        for key in ("remove_candidate", "onehot_residual", "residual"):
            setattr(verify, key, saved[key])


def lossless_laws() -> list[Law]:
    """The lossless settings, one per tree shape, width mix and drafter of the engine."""
    return [
        Law("chain", (1, 1)),
        Law("tree-2x2", (2, 2)),
        Law("tree-3x1-with-replacement", (3, 1), without_replacement=False),
        Law("tree-4-T0.6", (4,), temperature=0.6),
        Law("tree-2x2-with-replacement-T0.6-top_p", (2, 2), without_replacement=False, temperature=0.6, top_p=0.8),
        Law("tree-3x2-top_p", (3, 2), top_p=0.7),
        Law("tree-2x2-random-stop", (2, 2), stop="random"),
        Law("tree-3x2-threshold-stop-T0.6", (3, 2), temperature=0.6, stop="threshold"),
        Law("chain-1x1x1-threshold-stop", (1, 1, 1), stop="threshold", threshold=0.8),
        Law("maxgram-with-bigrams", method="maxgram"),
        Law("tree-2x1+maxgram-merged-T0.6", (2, 1), method="mcsd+maxgram", temperature=0.6),
        # maxgram_read_tree = false: Max-Gram's branches beside equal drafted siblings, without a tail and
        # with its tail proposed on the device below the held tree
        Law("tree-2x1+maxgram-unmerged-T0.6", (2, 1), method="mcsd+maxgram", temperature=0.6, tail=0, merge=False),
        Law("tree-3x1+maxgram-unmerged-top_p", (3, 1), method="mcsd+maxgram", top_p=0.8, tail=0, merge=False),
        Law("tree-2x1+maxgram-unmerged-device-tail-T0.6", (2, 1), method="mcsd+maxgram", temperature=0.6, tail=2,
            merge=False),
        Law("tree-1x1+maxgram-unmerged-device-tail-top_p", (1, 1), method="mcsd+maxgram", top_p=0.8, tail=2,
            merge=False),
        Law("cascade-maxgram-draft-target", method="cascade"),
        # the device cascade: a fixed number of rounds (a chain may stay short), the tail's laws one-hot
        Law("cascade-device-1-round-T0.6", method="cascade", rounds=1, cascade_depth=3, tail=1, temperature=0.6),
        Law("cascade-device-2-rounds-top_p", method="cascade", rounds=2, cascade_depth=3, tail=2, top_p=0.8),
        # the draft's output layer cut to tokens 0, 1, 3, 5: q(2) = q(4) = 0
        Law("tree-2x2-draft-vocab-cut-T0.6", (2, 2), temperature=0.6, draft_vocab=(0, 1, 3, 5)),
        Law("target-init-k1", (1, 1), method="target-init", k=1),
        *grammar_laws(),
    ]


def grammar_laws() -> list[Law]:
    """Under the toy grammar (tests/grammar_toy.py: masked rows, pruned one-hot proposals, forced drafts):
    the law is the masked target's for every tree shape and drafter mix."""
    return [
        Law("grammar-tree-2x2", (2, 2), grammar=True),
        Law("grammar-tree-3x1-with-replacement-T0.6", (3, 1), without_replacement=False, temperature=0.6, grammar=True),
        Law("grammar-tree-3x2-top_p", (3, 2), top_p=0.7, grammar=True),
        Law("grammar-tree-2x2-draft-vocab-cut", (2, 2), draft_vocab=(0, 1, 3, 5), grammar=True),
        Law("grammar-maxgram-with-bigrams", method="maxgram", grammar=True),
        Law("grammar-tree-2x1+maxgram-merged-T0.6", (2, 1), method="mcsd+maxgram", temperature=0.6, grammar=True),
        Law("grammar-cascade-maxgram-draft-target", method="cascade", grammar=True),
    ]


def planted_laws() -> list[Law]:
    return [
        Law("no q renormalisation", (3,), sabotage="no_q_renorm"),
        Law("no residual after a one-hot rejection", method="maxgram", sabotage="onehot_no_residual"),
        Law("residual skipped after a rejected draft child", (2, 2), sabotage="residual_skipped"),
        Law("with-replacement siblings verified as without", (3, 1), without_replacement=False,
            sabotage="replacement_mismatch"),
        Law("grammar mask applied after top-p", (2, 1), method="mcsd+maxgram", top_p=0.7, grammar=True,
            sabotage="mask_after_top_p"),
        Law("grammar: draft sampled unmasked, forbidden nodes pruned", (2, 1), method="mcsd+maxgram", grammar=True,
            sabotage="draft_unmasked"),
    ]


def lossy_law(k: int) -> Law:
    """The lossy target-initialised mode with ``k`` candidates (one context: k = 3 enumerates 120
    candidate orders times three chains)."""
    return Law(f"target-init-k{k}", (k, 1), method="target-init", k=k, contexts=CONTEXTS[:1])


if __name__ == "__main__":  # prints the table the closing notes quote
    import time
    for law in lossless_laws() + planted_laws() + [lossy_law(2), lossy_law(3)]:
        t0 = time.perf_counter()
        dev, tv = deviation(law)
        print(f"{law.name:48s} max |diff| {dev:9.2e}   TV {tv:9.2e}   {time.perf_counter() - t0:6.2f} s")
