"""Multi-token joint decoding (MJSD, arXiv 2407.09722): **lossy by design**, opt-in only
(``speculative.method = "mjsd-lossy"``); every response using it carries a note saying so.

Goal: output with lower perplexity under the target than greedy decoding, at speculative speed.

* **Draft:** beam search of width ``beam`` for ``depth`` tokens (one batched draft forward per level
  over every sequence's beams, each beam attending to its own ancestors); the beam with the highest
  joint draft log-probability becomes the step's chain.
* **Verify:** the target scores the chain in one forward; the longest prefix ``x_1..x_j`` whose
  cumulative ``sum_i [log p(x_i) - log q(x_i)] > log tau`` is accepted (``j = 0`` allowed), then one
  token is drawn from ``p`` after the accepted prefix (its argmax for greedy requests).

``p`` and ``q`` are the target's and draft's distributions after the request's logit bias, at its
temperature (temperature 1 for greedy requests, whose joint likelihoods are still meaningful).
Penalties are not supported with this method (the request is rejected with a clear message).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from engine.batching import Block
from engine.config import DrafterSettings, setting
from engine.device import tensor as device_tensor
from engine.device import Pending
from engine.registry import Method, drafter_settings, register_drafter, register_method, register_rule
from engine.sampler import SamplingTensors, apply_logit_bias, compute_probs, sample_tokens
from engine.speculative.draft_tree import DEAD, DraftTree, HeldTokens
from engine.speculative.drafter import DrafterContext
from engine.speculative.methods import DraftPlan, PlanInput
from engine.speculative.proposer import DraftModelProposer
from engine.speculative.tree import SubTree, TreeTopology
from engine.speculative.verify import emitted_logprobs, unpack_logprobs, with_held_tokens
from engine.speculative.view import SeqView
from engine.speculative.walk import SeqStepResult, VerifyResult

MJSD_DRAFTER, MJSD_METHOD, JOINT_RULE = "mjsd", "mjsd-lossy", "mjsd-joint"
MJSD_NOTE = ("lossy: joint decoding (MJSD) accepts draft tokens by joint likelihood, so the output is not "
             "distributed as the target's sampling would be")


@drafter_settings("mjsd")
@dataclass(frozen=True)
class MjsdSettings(DrafterSettings):
    """MJSD's settings (``--mjsd-beam``, ...)."""

    beam: int = setting(4, "MJSD (lossy, opt-in): draft beam width", ge=1, le=16)
    depth: int = setting(4, "MJSD: tokens drafted per step", ge=1, le=32)
    tau: float = setting(0.5, "MJSD: joint likelihood-ratio threshold", gt=0.0, le=1.0)

MJSD = "mjsd"  # drafter name in statistics


def joint_logprobs(logits: torch.Tensor, seq: SeqView) -> torch.Tensor:
    """[rows, vocab] log-probabilities MJSD scores with: logit bias, then the request's temperature
    (1 for greedy requests)."""
    params = seq.request.sampling
    st = SamplingTensors.from_params([params], logits.shape[-1], [0] * logits.shape[0], device=logits.device)
    x = apply_logit_bias(logits.to(torch.float32, copy=True), st)  # in place: never on the model's output
    return (x / (params.temperature if not params.greedy else 1.0)).log_softmax(dim=-1)


@functools.cache
def chain_topology(depth: int) -> TreeTopology:
    """A chain of ``depth`` nodes: the shape of every MJSD tree."""
    return TreeTopology((1,) * depth)


@dataclass
class _Level:
    """One beam level of one sequence, on the device: ``beam`` nodes."""

    tokens: torch.Tensor  # [beam] long
    parent: torch.Tensor  # [beam] long: the parent's beam in the level above (unused at level 1)
    logq: torch.Tensor  # [beam] float32: log q of the token given its path
    entry: int = -1  # the draft-cache pending entry of beam 0 when the level ran (beam i: entry + i), -1 = not run


class MjsdProposer:
    """The draft's beam search, every level's beams chosen on the device: the host learns the best
    beam with verification's read (:class:`HeldChains`)."""

    def __init__(self, draft: DraftModelProposer, beam: int = 4) -> None:
        self.draft = draft
        self.beam = beam

    def propose(self, seqs: list[SeqView], depths: list[int], empties: list[SubTree]) -> list[DraftTree]:
        logits = self.draft._catch_up(seqs).roots()
        levels: list[list[_Level]] = [[] for _ in seqs]
        rows = [lg[None] for lg in logits]  # per sequence: [frontier beams, vocab] raw logits
        scores: list[Optional[torch.Tensor]] = [None] * len(seqs)  # joint log q of each frontier beam
        for level in range(1, max(depths) + 1):
            active = [j for j, d in enumerate(depths) if d >= level]
            for j in active:
                scores[j] = self._expand(seqs[j], levels[j], rows[j], scores[j])
            to_run = [j for j in active if depths[j] > level]
            if to_run:
                for j, lg in zip(to_run, self._run([seqs[j] for j in to_run], [levels[j] for j in to_run], level)):
                    rows[j] = lg
        trees = []
        for lv, empty in zip(levels, empties):
            assert empty.num_nodes == 0
            topology = chain_topology(len(lv))
            tree = DraftTree(topology.subtree(topology.widths), [DEAD] * len(lv))
            tree.sources = {i: {MJSD} for i in range(len(lv))}
            trees.append(tree)
        HeldChains(trees, [self._best(lv, sc) for lv, sc in zip(levels, scores)]).hold()
        return trees

    def _expand(self, seq: SeqView, levels: list[_Level], logits: torch.Tensor,
                score: Optional[torch.Tensor]) -> torch.Tensor:
        """Appends the ``beam`` best one-token extensions of the frontier beams to ``levels``; returns
        their joint log q."""
        lq = joint_logprobs(self.draft._pad_vocab(logits), seq)  # [beams, vocab]
        total = (lq if score is None else score[:, None] + lq).flatten()
        top = total.topk(min(self.beam, total.numel()))
        vocab = lq.shape[1]  # q is over the target's vocabulary (_pad_vocab)
        levels.append(_Level(top.indices % vocab, top.indices // vocab, lq.flatten().index_select(0, top.indices)))
        return top.values

    def _run(self, seqs: list[SeqView], levels: list[list[_Level]], level: int) -> list[torch.Tensor]:
        """The newest level of every sequence through the draft, each beam attending to its own
        ancestors: its mask is gathered on the device from the beams' parents."""
        cache = self.draft.cache
        blocks, ids = [], []
        for seq, lv in zip(seqs, levels):
            n, pend = lv[-1].tokens.numel(), int(cache.pending[seq.draft_slot])
            lv[-1].entry = pend
            beam = torch.arange(n, device=lv[-1].tokens.device)
            cols = [pend + beam]  # itself
            for up in range(len(lv) - 1, 0, -1):  # its ancestors, level by level
                beam = lv[up].parent.index_select(0, beam)
                cols.append(lv[up - 1].entry + beam)
            mask = torch.zeros(n, pend + n, dtype=torch.bool, device=beam.device)
            mask.scatter_(1, torch.stack(cols, dim=1), True)
            pos = len(seq.tokens) - 1 + level
            blocks.append(Block(seq.draft_slot, [0] * n, [pos] * n, list(range(n)), device_mask=mask))
            ids.append(lv[-1].tokens)
        width = max(t.numel() for t in ids)
        ids_t = torch.stack([torch.nn.functional.pad(t, (0, width - t.numel())) for t in ids])
        _, logits = self.draft.forward(blocks, ids_t)
        return logits

    @staticmethod
    def _best(levels: list[_Level], score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The best beam's path, on the device: its tokens, log q and draft-cache entries (-1: not run)."""
        beam = score.argmax().view(1)  # the first of ties
        tokens, logq, entries = [], [], []
        for lv in reversed(levels):
            tokens.append(lv.tokens.index_select(0, beam))
            logq.append(lv.logq.index_select(0, beam))
            entries.append(beam + lv.entry if lv.entry >= 0 else torch.full_like(beam, -1))
            beam = lv.parent.index_select(0, beam)
        return torch.cat(tokens[::-1]), torch.cat(logq[::-1]), torch.cat(entries[::-1])


class HeldChains(HeldTokens):
    """The best beams of a step's MJSD trees (:class:`HeldTokens`): ``paths[j]`` is tree ``j``'s
    (tokens, log q, draft-cache entries), all on the device.  Each tree's ``joint_logq`` stays there;
    its entries come back with its tokens (``DraftTree.draft_index``)."""

    def __init__(self, trees: list[DraftTree], paths: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        super().__init__(trees)
        tokens = [t for t, _, _ in paths]
        self.flat = torch.cat(tokens + [tokens[0].new_zeros(1)])
        self.entries = torch.cat([e for _, _, e in paths])
        for tree, (_, logq, _) in zip(trees, paths):
            tree.joint_logq = logq

    def tensors(self) -> list[torch.Tensor]:
        return [self.flat, self.entries]

    def fill(self, host: list[torch.Tensor]) -> bool:
        """Every held tree's tokens and draft-cache entries."""
        if not super().fill(host):
            return False
        entries = host[1].tolist()
        for off, tree in zip(self.offsets, self.trees):
            tree.draft_index = entries[off: off + tree.num_sub]
        return True


def start_joint(chains: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, SeqView]], tau: float,
                logprobs: Sequence[Optional[int]] = ()) -> Pending:
    """Each chain ``(logits, tokens, logq, seq)`` (logits: [1+n, vocab] the target's raw logits of the
    root and the chain; tokens, logq: [n] on the device) decided on the device, with each sequence's
    ``logprobs[i]`` alternatives (``None``: no logprobs); the pending reads them all back at once and
    gives ``(VerifyResult, logprobs or None)`` per chain."""
    if not chains:
        return Pending([], lambda host: [])
    decided = [_decide_joint(*chain, tau) for chain in chains]
    packed = [torch.stack([d for d, _ in decided])]
    width = max(e.numel() for _, e in decided)
    emitted = torch.stack([torch.nn.functional.pad(e, (0, width - e.numel())) for _, e in decided])  # [B, n+1]
    if any(k is not None for k in logprobs):
        rows = torch.stack([torch.nn.functional.pad(lg, (0, 0, 0, width - lg.shape[0])) for lg, *_ in chains])
        packed += emitted_logprobs(rows, torch.arange(width, device=rows.device).expand(len(chains), -1), emitted,
                                   logprobs)
    packed.append(emitted)

    def finish(host: list[torch.Tensor]) -> list[tuple[VerifyResult, Optional[list]]]:
        out = []
        for i, ((_, tokens, _, _), (accepted, _)) in enumerate(zip(chains, host[0].tolist())):
            n = tokens.numel()
            emitted_i = host[-1][i, : accepted + 1].tolist()
            res = VerifyResult(list(range(accepted)), emitted_i, bonus=accepted == n, final_row=accepted,
                               rows=list(range(accepted + 1)))
            out.append((res, unpack_logprobs(host[1:-1], i, emitted_i, logprobs[i] if i < len(logprobs) else None)))
        return out
    return Pending(packed, finish)


class JointRule:
    """MJSD's rule (lossy): a drafted chain's prefix stands while its joint likelihood ratio against
    the target clears ``tau`` (:func:`start_joint`).  A step that drafted no chain takes the lossless
    rule."""

    def __init__(self, tau: float, vocab_size: int) -> None:
        self.tau = tau
        self.vocab_size = vocab_size

    def claims(self, plan: DraftPlan, tree: DraftTree) -> bool:
        return tree.joint_logq is not None

    def start(self, seqs: list[SeqView], trees: list[DraftTree], logits: torch.Tensor) -> Pending:
        rows = [logits[i, : 1 + t.num_nodes, : self.vocab_size] for i, t in enumerate(trees)]
        chains = [(lg, chain_tokens(t, lg.device), t.joint_logq, s) for lg, t, s in zip(rows, trees, seqs)]
        pending = start_joint(chains, self.tau, [s.request.sampling.logprobs for s in seqs])

        def results(decided: list) -> list[SeqStepResult]:
            return [SeqStepResult(seq, res, tree, lps, lg)
                    for seq, tree, lg, (res, lps) in zip(seqs, trees, rows, decided)]
        return with_held_tokens(trees, pending).then(results)


def chain_tokens(tree: DraftTree, device: torch.device) -> torch.Tensor:
    """[n] a chain's tokens on the device: gathered there while the host has not read them."""
    holder = tree.unread
    if holder is None:
        return device_tensor(tree.tokens, device)
    off = holder.offset_of(tree)
    return holder.flat[off: off + tree.num_sub]


register_rule(JOINT_RULE, lambda config, vocab_size: JointRule(MjsdSettings.of(config).tau, vocab_size))


def _decide_joint(logits: torch.Tensor, tokens: torch.Tensor, logq: torch.Tensor, seq: SeqView,
                  tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device: [2] the accepted prefix length and the final token, and [n + 1] the emitted
    tokens (the accepted prefix, then the final token; padded with the chain's tokens)."""
    dev, n = logits.device, tokens.numel()
    lp = joint_logprobs(logits, seq)
    # the longest prefix whose cumulative log ratio clears log(tau), decided on the device
    ratio = lp[torch.arange(n, device=dev), tokens].double() - logq.to(torch.float64)
    cleared = torch.cat([torch.zeros(1, dtype=torch.bool, device=dev), ratio.cumsum(0) > math.log(tau)])
    accepted_t = (cleared.long() * torch.arange(n + 1, device=dev)).max()  # the last prefix length that clears
    params = seq.request.sampling
    at = accepted_t.view(1)  # indexing by a tensor, not by its value: no read on the host
    if params.greedy:
        y = lp.index_select(0, at)[0].argmax()
    else:
        probs = compute_probs(logits.index_select(0, at).float(), seq.sampling_tensors)
        y = sample_tokens(probs, [seq.generator])[0]
    slots = torch.arange(n + 1, device=dev)
    emitted = torch.where(slots == accepted_t, y, torch.cat([tokens, tokens.new_zeros(1)]))
    return torch.stack([accepted_t, y]), emitted


@register_drafter
class MjsdDrafter:
    """MJSD's best beam (method ``mjsd-lossy``; verified by joint likelihood, :func:`verify_joint`)."""

    name, stage = MJSD_DRAFTER, 30

    def __init__(self, mjsd: MjsdProposer) -> None:
        self.mjsd = mjsd

    @classmethod
    def limits(cls, config, topology) -> tuple[int, int]:
        mj = MjsdSettings.of(config)
        return mj.depth, mj.beam * mj.depth

    @classmethod
    def build(cls, ctx: DrafterContext) -> Optional["MjsdDrafter"]:
        return cls(MjsdProposer(ctx.proposer, MjsdSettings.of(ctx.config).beam)) if ctx.proposer is not None else None

    def propose(self, seqs: list[SeqView], plans: list[DraftPlan], trees: list[DraftTree]) -> None:
        idx = [i for i, p in enumerate(plans) if p.share(self.name, 0) > 0]
        if not idx:
            return
        chains = self.mjsd.propose([seqs[i] for i in idx], [plans[i].share(self.name) for i in idx],
                                   [plans[i].sub for i in idx])
        for i, tree in zip(idx, chains):
            trees[i] = tree


def plan_mjsd(p: PlanInput) -> DraftPlan:
    """The best beam's depth (none when the step's budget keeps the draft model idle)."""
    if p.room <= 0:
        return DraftPlan(MJSD_METHOD, p.empty)
    return DraftPlan(MJSD_METHOD, p.empty, {MJSD_DRAFTER: min(MjsdSettings.of(p.config).depth, p.room) if p.draft_ok
                                            else 0})


register_method(Method(MJSD_METHOD, (MJSD_DRAFTER,), plan_mjsd, lossy_note=MJSD_NOTE, penalties=False, grammar=False,
                       rule=JOINT_RULE, order=50))
