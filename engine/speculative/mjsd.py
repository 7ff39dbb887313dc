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

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.batching import Block
from engine.config import DrafterSettings, setting
from engine.device import tensor as device_tensor
from engine.device import Pending, to_host
from engine.registry import Method, drafter_settings, register_drafter, register_method, register_rule
from engine.sampler import SamplingTensors, apply_logit_bias, compute_probs, sample_tokens
from engine.speculative.draft_tree import DraftTree
from engine.speculative.drafter import DrafterContext
from engine.speculative.methods import DraftPlan, PlanInput
from engine.speculative.proposer import DraftModelProposer
from engine.speculative.tree import SubTree
from engine.speculative.verify import path_logprobs
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


@dataclass
class _Beams:
    seq: SeqView
    depth: int
    tokens: list[int] = field(default_factory=list)  # every node drafted, level by level
    parent: list[int] = field(default_factory=list)
    logq: list[float] = field(default_factory=list)  # log q of each node's token given its path
    entry: list[int] = field(default_factory=list)  # pending draft-cache entry, -1 = not run
    frontier: list[int] = field(default_factory=list)  # the current level's nodes
    score: list[float] = field(default_factory=list)  # joint log q of each frontier beam


class MjsdProposer:
    def __init__(self, draft: DraftModelProposer, beam: int = 4) -> None:
        self.draft = draft
        self.beam = beam

    def propose(self, seqs: list[SeqView], depths: list[int], empties: list[SubTree]) -> list[DraftTree]:
        logits, _ = self.draft._catch_up(seqs)
        beams = [_Beams(s, d) for s, d in zip(seqs, depths)]
        rows = [lg[None] for lg in logits]  # per sequence: [frontier beams, vocab] raw logits
        for level in range(1, max(depths) + 1):
            active = [j for j, b in enumerate(beams) if b.depth >= level]
            self._expand([beams[j] for j in active], [rows[j] for j in active])
            to_run = [j for j in active if beams[j].depth > level]
            if to_run:
                for j, lg in zip(to_run, self._run([beams[j] for j in to_run], level)):
                    rows[j] = lg
        trees = []
        for b, empty in zip(beams, empties):
            best = b.frontier[max(range(len(b.frontier)), key=lambda i: b.score[i])]
            path = []
            while best >= 0:
                path.append(best)
                best = b.parent[best]
            path.reverse()
            tree = DraftTree(empty, [])
            tree.add_path(-1, [b.tokens[i] for i in path], MJSD)
            tree.draft_index = [b.entry[i] for i in path]
            tree.joint_logq = [b.logq[i] for i in path]
            trees.append(tree)
        return trees

    def _expand(self, beams: list[_Beams], logits: list[torch.Tensor]) -> None:
        """The next level of every sequence: the ``beam`` best one-token extensions of its frontier
        beams, chosen on the device and read back once for all sequences."""
        picks = []
        for b, lg in zip(beams, logits):
            lq = joint_logprobs(self.draft._pad_vocab(lg), b.seq)  # [beams, vocab]
            base = device_tensor(b.score if b.frontier else [0.0], lq.device, torch.float32)
            total = (base[:, None] + lq).flatten()
            top = total.topk(min(self.beam, total.numel()))
            vocab = lq.shape[1]
            chosen = lq[top.indices // vocab, top.indices % vocab]
            picks.append(torch.stack([top.values.double(), top.indices.double(), chosen.double()]))  # exact in float64
        width = max(p.shape[1] for p in picks)
        host = to_host(torch.stack([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=-1.0) for p in picks]))[0]
        for b, lg, vals in zip(beams, logits, host.tolist()):
            vocab = self.draft.vocab_size  # q is over the target's vocabulary (_pad_vocab)
            parents = b.frontier if b.frontier else [-1]
            frontier, score = [], []
            for s, flat, lq in zip(*vals):
                if flat < 0:
                    break
                beam_i, tok = divmod(int(flat), vocab)
                b.tokens.append(tok)
                b.parent.append(parents[beam_i])
                b.logq.append(lq)
                b.entry.append(-1)
                frontier.append(len(b.tokens) - 1)
                score.append(s)
            b.frontier, b.score = frontier, score

    def _run(self, beams: list[_Beams], level: int) -> list[torch.Tensor]:
        cache = self.draft.cache
        blocks = []
        for b in beams:
            n, pend = len(b.frontier), int(cache.pending[b.seq.draft_slot])
            mask = torch.zeros(n, pend + n, dtype=torch.bool)
            for r, node in enumerate(b.frontier):
                anc = b.parent[node]
                while anc >= 0:
                    mask[r, b.entry[anc]] = True
                    anc = b.parent[anc]
                mask[r, pend + r] = True
                b.entry[node] = pend + r
            pos = len(b.seq.tokens) - 1 + level
            blocks.append(Block(b.seq.draft_slot, [b.tokens[i] for i in b.frontier], [pos] * n, list(range(n)), mask))
        _, logits = self.draft.forward(blocks)
        return logits


def verify_joint(chains: list[tuple[torch.Tensor, list[int], list[float], SeqView]], tau: float) -> list[VerifyResult]:
    """Each chain ``(logits, tokens, logq, seq)`` (logits: [1+n, vocab] the target's raw logits of the
    root and the chain) decided on the device, all read back at once."""
    return start_joint(chains, tau).result()


def start_joint(chains: list[tuple[torch.Tensor, list[int], list[float], SeqView]], tau: float) -> Pending:
    """:func:`verify_joint` decided on the device; the pending reads it back."""
    decided = [_decide_joint(*chain, tau) for chain in chains]

    def finish(host: list[torch.Tensor]) -> list[VerifyResult]:
        out = []
        for (_, tokens, _, _), (accepted, y) in zip(chains, host[0].tolist() if host else []):
            out.append(VerifyResult(list(range(accepted)), tokens[:accepted] + [y], bonus=accepted == len(tokens),
                                    final_row=accepted, rows=list(range(accepted + 1))))
        return out
    return Pending([torch.stack(decided)] if decided else [], finish)


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
        pending = start_joint([(lg, t.tokens, t.joint_logq, s) for lg, t, s in zip(rows, trees, seqs)], self.tau)

        def results(decided: list[VerifyResult]) -> list[SeqStepResult]:
            out = []
            for seq, tree, lg, res in zip(seqs, trees, rows, decided):
                k = seq.request.sampling.logprobs
                out.append(SeqStepResult(seq, res, tree, path_logprobs(lg, res, k) if k is not None else None, lg))
            return out
        return pending.then(results)


register_rule(JOINT_RULE, lambda config, vocab_size: JointRule(MjsdSettings.of(config).tau, vocab_size))


def _decide_joint(logits: torch.Tensor, tokens: list[int], logq: list[float], seq: SeqView,
                  tau: float) -> torch.Tensor:
    """[2] on the device: the accepted prefix length and the final token."""
    dev, n = logits.device, len(tokens)
    lp = joint_logprobs(logits, seq)
    # the longest prefix whose cumulative log ratio clears log(tau), decided on the device
    ratio = lp[torch.arange(n, device=dev), device_tensor(tokens, dev)].double() - device_tensor(logq, dev, torch.float64)
    cleared = torch.cat([torch.zeros(1, dtype=torch.bool, device=dev), ratio.cumsum(0) > math.log(tau)])
    accepted_t = (cleared.long() * torch.arange(n + 1, device=dev)).max()  # the last prefix length that clears
    params = seq.request.sampling
    at = accepted_t.view(1)  # indexing by a tensor, not by its value: no read on the host
    if params.greedy:
        y = lp.index_select(0, at)[0].argmax()
    else:
        probs = compute_probs(logits.index_select(0, at).float(), seq.sampling_tensors)
        y = sample_tokens(probs, [seq.generator])[0]
    return torch.stack([accepted_t, y])


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
