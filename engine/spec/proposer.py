"""Draft-model proposer: grows each sequence's draft tree level by level.

Per step and per sequence the draft cache first catches up on the tokens it has not seen (the
root, plus the deepest accepted node of the previous step when the draft never ran it); those are
committed.  Then, for depth ``d = 1..s``, every node of depth ``d-1`` gets ``k_d`` children drawn
from its draft distribution ``q`` (without replacement by default; the top-``k_d`` tokens at
temperature 0), and the new level is run through the draft in one batched forward over all
sequences, attending to its ancestors through rows ``[C_{d-1}:C_d]`` of the prebuilt tree mask.
The deepest level is never run: its nodes have no children to sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.batching import Block, run_blocks
from engine.kv_cache import KVCache
from engine.models.llama import LlamaModel
from engine.sampler import (
    SamplingTensors, apply_logit_bias, apply_penalties, compute_probs, draw_uniforms, sample_from_probs,
    sample_k_distinct,
)
from engine.sequence import Sequence
from engine.spec.history import RowHistory
from engine.spec.tree import SubTree
from engine.spec.verify import DEAD


@dataclass
class DraftTree:
    """What one sequence drafted in one step."""

    sub: SubTree
    tokens: list[int]  # [n] node tokens, DEAD where a child could not be drawn
    q: dict[int, torch.Tensor] = field(default_factory=dict)  # block row -> [vocab] its children's law
    drafted_levels: int = 0  # levels actually run through the draft (s - 1)


class DraftModelProposer:
    def __init__(self, model: LlamaModel, cache: KVCache, vocab_size: int, without_replacement: bool = True) -> None:
        self.model = model
        self.cache = cache
        self.vocab_size = vocab_size  # the target's vocabulary: q is padded to it
        self.without_replacement = without_replacement

    def propose(self, seqs: list[Sequence], subs: list[SubTree]) -> list[DraftTree]:
        trees = [DraftTree(sub, [DEAD] * sub.num_nodes) for sub in subs]
        parent_logits = self._catch_up(seqs)  # [batch, vocab]: q at the root
        frontier = {i: parent_logits[i][None] for i in range(len(seqs))}  # seq -> [parents, vocab]
        max_depth = max(sub.max_depth for sub in subs)
        for d in range(1, max_depth + 1):
            active = [i for i in range(len(seqs)) if subs[i].max_depth >= d]
            for i in active:
                self._sample_level(seqs[i], trees[i], d, frontier[i])
            to_run = [i for i in active if subs[i].max_depth > d]
            if to_run:
                logits = self._run_level(seqs, trees, to_run, d)
                frontier = dict(zip(to_run, logits))
        return trees

    # ------------------------------------------------------------------ draft forwards
    def _catch_up(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        blocks = []
        for s in seqs:
            new = s.tokens[s.draft_cached:]
            blocks.append(Block(s.draft_slot, new, list(range(s.draft_cached, len(s.tokens))), [len(new) - 1]))
        _, logits = run_blocks(self.model, self.cache, blocks)
        for s in seqs:
            self.cache.commit(s.draft_slot)
            s.draft_cached = len(s.tokens)
        return [lg[0] for lg in logits]

    def _run_level(self, seqs, trees, to_run: list[int], d: int) -> list[torch.Tensor]:
        blocks = []
        for i in to_run:
            sub, seq = trees[i].sub, seqs[i]
            lv = sub.level(d)
            mask = sub.mask[1 + lv.start: 1 + lv.stop, 1: 1 + lv.stop]  # rows C_{d-1}:C_d, cols :C_d
            toks = [t if t != DEAD else 0 for t in trees[i].tokens[lv]]
            root_pos = len(seq.tokens) - 1
            blocks.append(Block(seq.draft_slot, toks, [root_pos + d] * len(toks), list(range(len(toks))), mask))
            trees[i].drafted_levels = d
        _, logits = run_blocks(self.model, self.cache, blocks)
        return logits

    # ------------------------------------------------------------------ sampling children
    def _sample_level(self, seq: Sequence, tree: DraftTree, d: int, logits: torch.Tensor) -> None:
        """logits: [parents, vocab] draft logits of the depth-(d-1) nodes, in level order."""
        sub = tree.sub
        lv = sub.level(d)
        k = sub.widths[d - 1]
        parent_rows = self._parent_rows(sub, d)  # block rows of the parents, in level order
        params = seq.request.sampling
        logits = self._pad_vocab(logits)
        history = RowHistory.for_rows(seq, tree.tokens, sub, parent_rows) if params.needs_history else None
        st = SamplingTensors.from_params([params], self.vocab_size, [0] * len(parent_rows))
        if params.greedy:
            chosen = self._top_k(logits, st, history, k)
        else:
            probs = compute_probs(logits, st, *(history.tensors() if history else (None, None)))
            chosen = self._sample(probs, k, seq.generator)
            for j, row in enumerate(parent_rows):
                tree.q[row] = probs[j]
        alive_parent = [row == 0 or tree.tokens[row - 1] != DEAD for row in parent_rows]
        flat = chosen.tolist()
        for j, node in enumerate(range(lv.start, lv.stop)):
            parent_j, r = divmod(j, k)
            tok = flat[parent_j][r] if alive_parent[parent_j] else DEAD
            tree.tokens[node] = tok if tok >= 0 else DEAD

    @staticmethod
    def _parent_rows(sub: SubTree, d: int) -> list[int]:
        if d == 1:
            return [0]
        prev = sub.level(d - 1)
        return [1 + i for i in range(prev.start, prev.stop)]

    def _top_k(self, logits, st, history, k: int) -> torch.Tensor:
        """Greedy trees take the ``k`` best tokens of the processed draft logits."""
        x = apply_logit_bias(logits.float().clone(), st)
        if history is not None:
            x = apply_penalties(x, st, *history.tensors())
        return x.topk(k, dim=-1).indices

    def _sample(self, probs: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
        """[parents, vocab] -> [parents, k] children, drawn in sampling order."""
        u = draw_uniforms([generator] * probs.shape[0], [k] * probs.shape[0])
        if self.without_replacement:
            return sample_k_distinct(probs, u)
        return torch.stack([sample_from_probs(probs, u[:, j]) for j in range(k)], dim=1)

    def _pad_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (extra target tokens get -inf: q = 0)."""
        v = logits.shape[-1]
        if v == self.vocab_size:
            return logits
        if v > self.vocab_size:
            return logits[..., : self.vocab_size]
        pad = logits.new_full((*logits.shape[:-1], self.vocab_size - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
