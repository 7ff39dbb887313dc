"""Runs the models for one engine step: prefill chunks, and the speculative step (draft tree ->
one target forward over every sequence's tree -> lossless verification -> cache update).

Plain decoding is the same path with an empty tree: the block is just the root, and the
"verification" draws the next token from the target's distribution at the root.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from engine.batching import Block, run_blocks
from engine.kv_cache import KVCache
from engine.models.llama import LlamaModel
from engine.request import TokenLogprob
from engine.sampler import compute_probs, raw_logprobs
from engine.sequence import Sequence
from engine.spec.history import RowHistory
from engine.spec.proposer import DraftModelProposer, DraftTree
from engine.spec.tree import SubTree
from engine.spec.verify import DEAD, VerifyResult, children_of, verify_greedy, verify_sampled
from engine.stats import StepStats, add_at


@dataclass
class SeqStepResult:
    seq: Sequence
    result: VerifyResult
    tree: DraftTree
    drafted: int  # live drafted nodes
    logprobs: Optional[list[TokenLogprob]] = None
    logits: Optional[torch.Tensor] = None  # [1+n, vocab] the target's raw logits of the block (for training heads)


class ModelRunner:
    def __init__(self, target: LlamaModel, target_cache: KVCache, vocab_size: int,
                 proposer: Optional[DraftModelProposer] = None) -> None:
        self.target = target
        self.cache = target_cache
        self.vocab_size = vocab_size
        self.proposer = proposer

    # ------------------------------------------------------------------ prefill
    def prefill(self, chunks: list[tuple[Sequence, int]]) -> None:
        """Caches ``seq.tokens[seq.target_cached:end]`` for each ``(seq, end)`` (target and draft)."""
        blocks = [Block(s.slot, s.tokens[s.target_cached:end], list(range(s.target_cached, end)), [])
                  for s, end in chunks]
        run_blocks(self.target, self.cache, blocks)
        for s, end in chunks:
            self.cache.commit(s.slot)
            s.target_cached = end
        drafted = [(s, end) for s, end in chunks if s.draft_slot is not None]
        if drafted and self.proposer is not None:
            dblocks = [Block(s.draft_slot, s.tokens[s.draft_cached:end], list(range(s.draft_cached, end)), [])
                       for s, end in drafted]
            run_blocks(self.proposer.model, self.proposer.cache, dblocks)
            for s, end in drafted:
                self.proposer.cache.commit(s.draft_slot)
                s.draft_cached = end

    # ------------------------------------------------------------------ decode
    def step(self, seqs: list[Sequence], subs: list[SubTree], stats: StepStats) -> list[SeqStepResult]:
        t0 = time.perf_counter()
        trees = self._draft(seqs, subs)
        t1 = time.perf_counter()
        blocks = []
        for seq, tree in zip(seqs, trees):
            root_pos = len(seq.tokens) - 1
            toks = [seq.root] + [t if t != DEAD else 0 for t in tree.tokens]
            pos = block_positions(root_pos, tree.sub)
            blocks.append(Block(seq.slot, toks, pos, list(range(len(toks))),
                                tree.sub.mask if tree.sub.num_nodes else None))
        _, logits = run_blocks(self.target, self.cache, blocks)  # each [1+n, vocab]
        results = [self._verify(seq, tree, lg) for seq, tree, lg in zip(seqs, trees, logits)]
        for r, tree in zip(results, trees):
            self._update_caches(r.seq, tree, r.result)
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += time.perf_counter() - t1
        return results

    def _draft(self, seqs: list[Sequence], subs: list[SubTree]) -> list[DraftTree]:
        trees = [DraftTree(sub, []) for sub in subs]
        idx = [i for i, sub in enumerate(subs) if sub.num_nodes > 0]
        if idx and self.proposer is not None:
            drafted = self.proposer.propose([seqs[i] for i in idx], [subs[i] for i in idx])
            for i, tree in zip(idx, drafted):
                trees[i] = tree
        return trees

    def _verify(self, seq: Sequence, tree: DraftTree, logits: torch.Tensor) -> SeqStepResult:
        """logits: [1+n, vocab] target logits of the root and the tree nodes."""
        params = seq.request.sampling
        children = children_of(tree.sub) if tree.tokens else [[]]
        logits = logits[:, : self.vocab_size]
        st = seq.sampling_tensors

        def processed(row: int) -> torch.Tensor:
            hist = RowHistory.for_rows(seq, tree.tokens, tree.sub, [row]) if params.needs_history else None
            return compute_probs(logits[row][None], st, *(hist.tensors() if hist else (None, None)))[0]

        if params.greedy:
            if st.any_bias or params.needs_history:
                result = verify_greedy(lambda r: int(processed(r).argmax()), tree.tokens, children)
            else:
                best = logits.argmax(dim=-1).tolist()
                result = verify_greedy(lambda r: best[r], tree.tokens, children)
        else:
            result = verify_sampled(processed, lambda r: tree.q[r], tree.tokens, children,
                                    seq.generator, self.proposer is None or self.proposer.without_replacement)
        drafted = sum(1 for t in tree.tokens if t != DEAD)
        lps = self._logprobs(logits, result, params.logprobs) if params.logprobs is not None else None
        return SeqStepResult(seq, result, tree, drafted, lps, logits)

    @staticmethod
    def _logprobs(logits: torch.Tensor, result: VerifyResult, k: int) -> list[TokenLogprob]:
        rows = torch.tensor(result.rows)
        lp = raw_logprobs(logits[rows])  # [emitted, vocab]
        chosen = torch.tensor(result.tokens)
        chosen_lp = lp.gather(1, chosen[:, None]).squeeze(1).tolist()
        top_vals, top_ids = lp.topk(k, dim=-1) if k > 0 else (None, None)
        out = []
        for j, tok in enumerate(result.tokens):
            top = list(zip(top_ids[j].tolist(), top_vals[j].tolist())) if k > 0 else []
            out.append(TokenLogprob(tok, chosen_lp[j], top))
        return out

    def _update_caches(self, seq: Sequence, tree: DraftTree, result: VerifyResult) -> None:
        """Target keeps root + accepted path; the draft keeps the accepted nodes it ran."""
        self.cache.keep(seq.slot, kept_block_rows(result))
        seq.target_cached = len(seq.tokens) + len(result.accepted)
        if tree.tokens and self.proposer is not None:
            ran = tree.sub.level_offsets[tree.drafted_levels]
            kept = [i for i in result.accepted if i < ran]
            self.proposer.cache.keep(seq.draft_slot, kept)
            seq.draft_cached += len(kept)


def block_positions(root_pos: int, sub: SubTree) -> list[int]:
    """Position ids of a verification block: the root's, then root + depth for every node
    (siblings share a position)."""
    return [root_pos] + (root_pos + sub.depth).tolist()


def kept_block_rows(result: VerifyResult) -> list[int]:
    """Target cache entries kept after verification: the root and the accepted path.  The final
    (bonus or correction) token is not cached: it is the next step's root."""
    return [0] + [1 + i for i in result.accepted]


def record_step(stats: StepStats, res: SeqStepResult) -> None:
    """Adds one sequence's drafted/accepted accounting to the step's stats."""
    r, sub, tokens = res.result, res.tree.sub, res.tree.tokens
    stats.num_seqs += 1
    if res.drafted:
        stats.num_spec_seqs += 1
    stats.drafted_tokens += res.drafted
    stats.accepted_tokens += len(r.accepted)
    stats.bonus_tokens += int(r.bonus and bool(tokens))
    for d in range(1, len(r.accepted) + 1):
        add_at(stats.accepted_per_position, d - 1)
    depth, rank = sub.depth.tolist(), sub.rank.tolist()
    for i, t in enumerate(tokens):
        if t != DEAD:
            add_at(stats.drafted_by_depth, depth[i] - 1)
            add_at(stats.drafted_by_rank, rank[i])
    for i in r.accepted:
        add_at(stats.accepted_by_depth, depth[i] - 1)
        add_at(stats.accepted_by_rank, rank[i])
