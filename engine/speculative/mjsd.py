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

import torch

from engine.batching import Block
from engine.sampler import SamplingTensors, apply_logit_bias, compute_probs, sample_tokens
from engine.sequence import Sequence
from engine.speculative.draft_tree import DraftTree
from engine.speculative.proposer import DraftModelProposer
from engine.speculative.tree import SubTree
from engine.speculative.walk import VerifyResult

MJSD = "mjsd"  # drafter name in statistics
LOSSY_NOTE = ("lossy: joint decoding (MJSD) accepts draft tokens by joint likelihood, so the output is not "
              "distributed as the target's sampling would be")


def joint_logprobs(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """[rows, vocab] log-probabilities MJSD scores with: logit bias, then the request's temperature
    (1 for greedy requests)."""
    params = seq.request.sampling
    st = SamplingTensors.from_params([params], logits.shape[-1], [0] * logits.shape[0])
    x = apply_logit_bias(logits.float(), st)
    return (x / (params.temperature if not params.greedy else 1.0)).log_softmax(dim=-1)


@dataclass
class _Beams:
    seq: Sequence
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

    def propose(self, seqs: list[Sequence], depths: list[int], empties: list[SubTree]) -> list[DraftTree]:
        logits, _ = self.draft._catch_up(seqs)
        beams = [_Beams(s, d) for s, d in zip(seqs, depths)]
        rows = [lg[None] for lg in logits]  # per sequence: [frontier beams, vocab] raw logits
        for level in range(1, max(depths) + 1):
            active = [j for j, b in enumerate(beams) if b.depth >= level]
            for j in active:
                self._expand(beams[j], rows[j])
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

    def _expand(self, b: _Beams, logits: torch.Tensor) -> None:
        """The next level: the ``beam`` best one-token extensions of the frontier beams."""
        lq = joint_logprobs(self.draft._pad_vocab(logits), b.seq)  # [beams, vocab]
        base = torch.tensor(b.score if b.frontier else [0.0])
        total = (base[:, None] + lq).flatten()
        k = min(self.beam, total.numel())
        top = total.topk(k)
        vocab = lq.shape[1]
        parents = b.frontier if b.frontier else [-1]
        frontier, score = [], []
        for s, flat in zip(top.values.tolist(), top.indices.tolist()):
            beam_i, tok = divmod(flat, vocab)
            b.tokens.append(tok)
            b.parent.append(parents[beam_i])
            b.logq.append(float(lq[beam_i, tok]))
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


def verify_joint(logits: torch.Tensor, tokens: list[int], logq: list[float], seq: Sequence,
                 tau: float) -> VerifyResult:
    """logits: [1+n, vocab] the target's raw logits of the root and the chain."""
    lp = joint_logprobs(logits, seq)
    total, accepted = 0.0, 0
    for i, (tok, lq) in enumerate(zip(tokens, logq)):
        total += float(lp[i, tok]) - lq
        if total > math.log(tau):
            accepted = i + 1
    row = accepted
    params = seq.request.sampling
    if params.greedy:
        y = int(lp[row].argmax())
    else:
        probs = compute_probs(logits[row][None].float(), seq.sampling_tensors)
        y = int(sample_tokens(probs, [seq.generator])[0])
    path = list(range(accepted))
    return VerifyResult(path, tokens[:accepted] + [y], bonus=accepted == len(tokens), final_row=row,
                        rows=list(range(accepted + 1)))
