"""Vertical cascade (CS Drafting, docs/algorithms.md §4.4): the draft model *reviews* Max-Gram's proposals
instead of writing every token itself.

Per sequence and step the cascade grows one chain of up to ``depth`` tokens in rounds.  Each round

1. asks Max-Gram for a guess ``g_1..g_L`` continuing the chain (possibly none);
2. runs the round's block (the chain's last token if the draft has not run it yet, then the guess)
   through the draft model in **one** forward, batched over sequences; pending draft-cache entries of
   rejected guesses from earlier rounds are masked out;
3. reviews the guess with the draft as the "target" and Max-Gram's one-hot law as the proposal,
   by the exact speculative-sampling rule: ``g_i`` is kept with probability ``q_i(g_i)``; at the first
   rejection a correction ``y ~ norm((q_i - e_{g_i})+)`` ends the round.  With no guess at all the
   round simply samples ``y ~ q``.  At temperature 0 the review keeps ``g_i`` iff it is the draft's
   argmax and the correction is the argmax.

Because the inner review is exact, every chain token has law exactly ``q_i`` (the draft's processed
distribution given the chain above it), so the target's final review treats the chain as ordinary
sampled draft tokens with those ``q``: the output is lossless whatever Max-Gram guessed.  A round
costs one draft forward and yields at least one token, and as many as Max-Gram guessed right.

The horizontal half of the cascade (Max-Gram writing the later depths) is appended by the runner
below the chain's last node (``MaxGramShare.tail``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.batching import Block
from engine.config import DrafterSettings, setting
from engine.device import tensor as device_tensor
from engine.device import to_device, to_host
from engine.registry import Method, drafter_settings, register_drafter, register_method
from engine.sampler import SamplingTensors, compute_probs, sample_from_probs
from engine.speculative.constrained import mask_rows, path_masks
from engine.speculative.device_cascade import DeviceCascade
from engine.speculative.draft_tree import CASCADE, SAMPLED, DraftTree
from engine.speculative.drafter import DrafterContext
from engine.speculative.maxgram import MAXGRAM_DRAFTER, MaxGramDrafter, MaxGramSettings, MaxGramShare
from engine.speculative.methods import DraftPlan, PlanInput
from engine.speculative.proposer import DraftModelProposer
from engine.speculative.tree import SubTree
from engine.speculative.verify import without_rows
from engine.speculative.view import SeqView
from engine.speculative.walk import Coins, onehot_residual

CASCADE_DRAFTER = CASCADE_METHOD = "cascade"

log = logging.getLogger(__name__)


@drafter_settings("cascade")
@dataclass(frozen=True)
class CascadeSettings(DrafterSettings):
    """The vertical cascade's settings (``--cascade-depth``; Max-Gram's own are its section's)."""

    depth: int = setting(4, "tokens the draft writes reviewing Max-Gram (cascade)", ge=0, le=64)


@dataclass
class _Chain:
    seq: SeqView
    depth: int  # tokens to draft
    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)  # law of each token given the chain above it
    entry: list[int] = field(default_factory=list)  # pending draft-cache entry of each token, -1 = not run
    frontier: Optional[torch.Tensor] = None  # [vocab] raw draft logits for the next token, when known
    pending: int = 0  # draft-cache entries appended this step (garbage included)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.depth


class CascadeProposer:
    def __init__(self, draft: DraftModelProposer, maxgram: MaxGramDrafter) -> None:
        self.draft = draft
        self.maxgram = maxgram

    def propose(self, seqs: list[SeqView], depths: list[int], empties: list[SubTree]) -> list[DraftTree]:
        """``empties``: each sequence's (empty) draft-model subtree, which the chain is appended to."""
        logits = self.draft._catch_up(seqs).roots()
        chains = [_Chain(s, d, frontier=lg) for s, d, lg in zip(seqs, depths, logits)]
        while True:
            active = [c for c in chains if not c.done]
            if not active:
                break
            guesses = [self._guess(c) for c in active]
            to_run = [(c, g) for c, g in zip(active, guesses) if g or c.frontier is None]
            outs = self._run(to_run) if to_run else []
            run_out = {id(c): lg for (c, _), lg in zip(to_run, outs)}
            self._review(active, guesses, [run_out.get(id(c)) for c in active])
        trees = []
        for c, empty in zip(chains, empties):
            assert empty.num_nodes == 0
            tree = DraftTree(empty, [])
            tree.add_path(-1, c.tokens, CASCADE, SAMPLED, c.q)
            tree.draft_index = list(c.entry)
            trees.append(tree)
        return trees

    def _guess(self, c: _Chain) -> list[int]:
        props = self.maxgram.propose(c.seq, c.tokens, max_len=c.depth - len(c.tokens))
        return props[0].tokens if props else []

    def _run(self, to_run: list[tuple[_Chain, list[int]]]) -> list[torch.Tensor]:
        """One draft forward over every chain's block; returns each block's logits [rows, vocab]."""
        cache = self.draft.cache
        blocks = []
        for c, g in to_run:
            unrun = [c.tokens[-1]] if c.frontier is None else []
            toks = unrun + g
            start = len(c.seq.tokens) + len(c.tokens) - len(unrun)  # position of the block's first token
            n, pend = len(toks), int(cache.pending[c.seq.draft_slot])
            mask = torch.zeros(n, pend + n, dtype=torch.bool)
            live = [e for e in c.entry if e >= 0]  # the chain's run tokens; rejected guesses stay hidden
            mask[:, live] = True
            mask[:, pend:] = torch.ones(n, n, dtype=torch.bool).tril()
            if unrun:
                c.entry[-1] = pend
            c.pending = pend
            blocks.append(Block(c.seq.draft_slot, toks, list(range(start, start + n)), list(range(n)), mask))
        _, logits = self.draft.forward(blocks)
        return logits

    def _review(self, chains: list[_Chain], guesses: list[list[int]], logits: list[Optional[torch.Tensor]]) -> None:
        """Keeps each guess's prefix the draft accepts, then one corrected (or freshly sampled) token:
        every chain of the round at once, one read of the outcome (:func:`review_batch`)."""
        probs, bases = [], []
        for c, guess, lg in zip(chains, guesses, logits):
            if lg is None:  # nothing ran: sample from the known frontier
                rows = c.frontier[None]
            elif c.frontier is None:  # the block began with the chain's unrun last token
                rows = lg
            else:
                rows = torch.cat([c.frontier[None], lg])
            bases.append(c.pending + (1 if lg is not None and c.frontier is None else 0))  # entry of guess[0]
            # rows[i]: raw logits for the token after chain + guess[:i]
            probs.append(self._probs(c, guess, rows))
            c.frontier = None
        rooms = [c.depth - len(c.tokens) for c in chains]
        greedy = [c.seq.request.sampling.greedy for c in chains]
        uniforms = [None if g else torch.rand(len(guess) + 1, generator=c.seq.generator)
                    for c, guess, g in zip(chains, guesses, greedy)]
        outcome = review_batch(probs, guesses, rooms, greedy, uniforms)
        for c, guess, p, base, (kept, tokens) in zip(chains, guesses, probs, bases, outcome):
            for i, tok in enumerate(tokens):
                self._append(c, tok, p[i], base + i if i < kept else -1)  # a new token was not run yet

    def _append(self, c: _Chain, tok: int, q: torch.Tensor, entry: int) -> None:
        c.tokens.append(tok)
        c.q.append(q)
        c.entry.append(entry)

    def _probs(self, c: _Chain, guess: list[int], rows: torch.Tensor) -> torch.Tensor:
        """[len(guess)+1, vocab] the draft's processed law after chain + guess[:i] (penalties see the
        chain's own tokens, as the target's rows will)."""
        rows = self.draft._pad_vocab(rows[: len(guess) + 1]).float()
        seq, params = c.seq, c.seq.request.sampling
        if seq.grammar is not None:  # the chain's tokens are drawn from the masked q (speculative.constrained)
            paths = [c.tokens + guess[:i] for i in range(rows.shape[0])]
            rows = mask_rows(rows, path_masks(seq.grammar, paths, self.draft.vocab_size, rows.device))
        st = SamplingTensors.from_params([params], self.draft.vocab_size, [0] * rows.shape[0], device=rows.device)
        counts = prompt = None
        if params.needs_history:
            counts = seq.output_counts.expand(rows.shape[0], -1).clone()
            path = c.tokens + guess
            for i in range(rows.shape[0]):
                for t in path[: len(c.tokens) + i]:
                    counts[i, t] += 1
            if seq.prompt_mask is not None:
                prompt = seq.prompt_mask.expand(rows.shape[0], -1)
        return compute_probs(rows, st, counts, prompt)


def review_batch(probs: list[torch.Tensor], guesses: list[list[int]], rooms: list[int], greedy: list[bool],
                 uniforms: list[Optional[torch.Tensor]]) -> list[tuple[int, list[int]]]:
    """:func:`review_guess` for several chains, as tensor operations on the draft's device with one
    read of the outcome.  ``uniforms[j]`` (host, ``len(guess) + 1``; ``None`` when greedy):
    ``u[i]`` decides ``guess[i]``, ``u[-1]`` draws the final token.  :func:`review_guess` with
    :class:`ReviewCoins` over the same numbers gives the same result (``tests/engine/speculative/test_drafters.py``)."""
    if not probs:
        return []
    dev = probs[0].device
    packed = []
    for p, guess, room, g, u in zip(probs, guesses, rooms, greedy, uniforms):
        n = len(guess)
        tok = device_tensor(guess + [0], dev)  # [n + 1]; the pad is never a guess
        if g:
            ok = p[:n].argmax(dim=-1) == tok[:n]
        else:
            u = to_device(u, dev)
            ok = u[:n] < p[:n].gather(1, tok[:n, None])[:, 0]  # kept with probability p(g): strict, as the walk
        lead = ok.long().cumprod(dim=0).sum() if n else torch.zeros((), dtype=torch.long, device=dev)
        kept = lead.clamp(max=room)
        at = kept.view(1)  # indexing by a tensor, not by its value: no read on the host
        law = p.index_select(0, at)[0]  # [vocab] the law after the kept prefix
        if g:
            y = law.argmax()
        else:
            residual = without_rows(law[None], tok.index_select(0, at))  # walk.onehot_residual
            y = sample_from_probs(torch.where(kept < n, residual, law[None]), u[n:])[0]
        packed.append(torch.stack([kept, y]))
    host = to_host(torch.stack(packed))[0].tolist()
    out = []
    for (kept, y), guess, room in zip(host, guesses, rooms):
        out.append((kept, guess[:kept] + ([y] if kept < room else [])))
    return out


class ReviewCoins:
    """:func:`review_guess`'s coins reading a table as :func:`review_batch` does (the tests' oracle)."""

    def __init__(self, u: torch.Tensor) -> None:  # [len(guess) + 1]
        self.u = u

    def accept(self, p_x: float, q_x: float, row: int = 0, event: int = 0) -> bool:
        return float(self.u[row]) * q_x < p_x

    def draw(self, p: torch.Tensor, row: int = 0) -> int:
        return int(sample_from_probs(p[None], self.u[-1:])[0])

    def draw_distinct(self, p: torch.Tensor, k: int) -> list[int]:
        raise NotImplementedError


def review_guess(probs: torch.Tensor, guess: list[int], room: int, greedy: bool, coins: Coins) -> tuple[int, list[int]]:
    """The draft's exact review of Max-Gram's ``guess`` (the inner level of the cascade).

    ``probs[i]`` [vocab]: the draft's processed law of the token after the chain and ``guess[:i]``
    (``len(guess) + 1`` rows, or one when there is no guess).  ``guess[i]`` is kept with probability
    ``probs[i][guess[i]]`` (its one-hot law against the draft as the "target"); at the first rejection
    a correction ``y ~ norm((probs[i] - e_g)+)`` ends the round; when every guess is kept (or there is
    none) the round draws ``y ~ probs[len(guess)]``.  Greedy: a guess is kept iff it is the argmax, and
    ``y`` is the argmax.  So token ``i`` of the result has law exactly ``probs[i]``.

    Returns ``(kept, tokens)``: ``tokens[:kept]`` is the kept prefix of the guess, followed by ``y``
    unless ``room`` tokens were already kept."""
    tokens: list[int] = []
    for i, g in enumerate(guess):
        p = probs[i]
        ok = int(p.argmax()) == g if greedy else coins.accept(float(p[g]), 1.0, i)
        if not ok:
            return i, tokens + [int(p.argmax()) if greedy else coins.draw(onehot_residual(p, g), i)]
        tokens.append(g)
        if len(tokens) == room:
            return i + 1, tokens
    p = probs[len(guess)]
    return len(guess), tokens + [int(p.argmax()) if greedy else coins.draw(p, len(guess))]


@register_drafter
class CascadeDrafter:
    """The vertical cascade's chains (method ``cascade``; Max-Gram's tail follows at its own stage, or
    comes with the chain from the device cascade).  With ``maxgram_read_tree = false`` the rounds run on
    the device and the step reads once (``device_cascade``), but for a sequence under a grammar, whose
    masks follow each round's tokens on the host."""

    name, stage = CASCADE_DRAFTER, 20

    def __init__(self, cascade: CascadeProposer, on_device: Optional[DeviceCascade] = None) -> None:
        self.cascade = cascade
        self.on_device = on_device

    @classmethod
    def limits(cls, config, topology) -> tuple[int, int]:
        depth = CascadeSettings.of(config).depth
        return depth, depth * (MaxGramSettings.of(config).len + 1)  # a round runs its guess

    @classmethod
    def build(cls, ctx: DrafterContext) -> Optional["CascadeDrafter"]:
        """On CUDA with ``graph_compile``, the device cascade's Max-Gram is compiled now, at start-up."""
        if ctx.proposer is None:
            return None
        mg = MaxGramSettings.of(ctx.config)
        on_device = None
        if not mg.read_tree:
            compiled = ctx.config.graph_compile and ctx.proposer.cache.k.device.type == "cuda"
            on_device = DeviceCascade(ctx.proposer, ctx.maxgram, mg.len, max(mg.len, mg.tail), compiled)
            if compiled:
                t0 = time.perf_counter()
                on_device.warm_up()
                log.info("the device cascade's Max-Gram compiled in %.1f s", time.perf_counter() - t0)
        return cls(CascadeProposer(ctx.proposer, ctx.maxgram), on_device)

    def propose(self, seqs: list[SeqView], plans: list[DraftPlan], trees: list[DraftTree]) -> None:
        idx = [i for i, p in enumerate(plans) if p.share(self.name, 0) > 0]
        if not idx:
            return
        picked, depths, empties = [seqs[i] for i in idx], [plans[i].share(self.name) for i in idx], \
            [plans[i].sub for i in idx]
        if self.on_device is not None and all(s.grammar is None for s in picked):
            tails = [getattr(plans[i].share(MAXGRAM_DRAFTER), "tail", 0) for i in idx]
            chains = self.on_device.propose(picked, depths, tails, empties)
        else:
            chains = self.cascade.propose(picked, depths, empties)
        for i, tree in zip(idx, chains):
            trees[i] = tree


def plan_cascade(p: PlanInput) -> DraftPlan:
    """The draft model reviews Max-Gram's guesses for the first depths (when the budget lets it run),
    Max-Gram's tail writes the later ones."""
    if p.room <= 0:
        return DraftPlan(CASCADE_METHOD, p.empty)
    mg = MaxGramSettings.of(p.config)
    depth = min(CascadeSettings.of(p.config).depth, p.room) if p.draft_ok else 0  # the review runs the draft
    share = MaxGramShare(length=min(mg.len, p.room), tail=min(mg.tail, p.room - depth), trust=mg.trust)
    return DraftPlan(CASCADE_METHOD, p.empty, {CASCADE_DRAFTER: depth, MAXGRAM_DRAFTER: share})


register_method(Method(CASCADE_METHOD, (CASCADE_DRAFTER, MAXGRAM_DRAFTER), plan_cascade, order=40))
