"""Runs the models for one engine step: prefill chunks, and the speculative step (draft tree ->
one target forward over every sequence's tree -> lossless verification -> cache update).

Plain decoding is the same path with an empty tree: the block is just the root, and the
"verification" draws the next token from the target's distribution at the root.
"""

from __future__ import annotations

import logging
import time
from typing import Optional
from typing import Sequence as Sequence_

import torch

from engine.batching import Block, run_blocks
from engine.device import Pending, finish_all, synchronize
from engine.kv_cache import KVCache
from engine.models.llama import LlamaModel
from engine.sequence import Sequence
from engine.speculative.draft_tree import DEAD, DraftTree
from engine.speculative.drafter import Drafter
from engine.speculative.methods import DraftPlan, method
from engine.speculative.proposer import DraftModelProposer
from engine.speculative.verify import LOSSLESS, LosslessRule, SeqStepResult, VerifyRule
from engine.speculative.walk import VerifyResult
from engine.stats import StepStats, add_at

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, target: LlamaModel, target_cache: KVCache, vocab_size: int,
                 proposer: Optional[DraftModelProposer] = None, drafters: Sequence_[Drafter] = (),
                 rules: Optional[dict[str, VerifyRule]] = None) -> None:
        """``proposer``: the draft model and its cache (None: no draft model); ``drafters``: what grows
        the trees, in stage order (``engine.speculative.drafter``); ``rules``: the lossy methods'
        verification rules by name (``engine.speculative.verify.build_rules``)."""
        self.target = target
        self.cache = target_cache
        self.vocab_size = vocab_size
        self.proposer = proposer
        self.drafters = list(drafters)
        self._observers = [d for d in self.drafters if hasattr(d, "observe")]  # Drafter.observe is optional
        without = proposer is None or proposer.without_replacement
        self.rules: dict[str, VerifyRule] = {LOSSLESS: LosslessRule(vocab_size, without), **(rules or {})}

    # ------------------------------------------------------------------ prefill
    def prefill(self, chunks: list[tuple[Sequence, int]]) -> None:
        """Caches ``seq.tokens[seq.target_cached:end]`` for each ``(seq, end)`` in the target.

        The draft model's cache is filled lazily: the proposer's catch-up runs whatever the draft has
        not seen the first time a sequence actually drafts with it, so requests that never use the
        draft model (Max-Gram, no speculation, a load-aware budget of plain decoding) never pay for it.
        """
        blocks = [Block(s.slot, s.tokens[s.target_cached:end], list(range(s.target_cached, end)), [])
                  for s, end in chunks]
        # one forward: chunks of different lengths run packed, so none is padded to the longest
        run_blocks(self.target, self.cache, blocks)
        for s, end in chunks:
            self.cache.commit(s.slot)
            s.target_cached = end

    # ------------------------------------------------------------------ decode
    def step(self, seqs: list[Sequence], plans: list[DraftPlan],
             stats: StepStats) -> tuple[list[SeqStepResult], list[tuple[Sequence, Exception]]]:
        """Drafts, verifies and updates the caches of ``seqs``.  Returns the results and the sequences
        whose own verification failed (with the error): one request's failure is that request's alone."""
        t0 = time.perf_counter()
        trees = self._draft(seqs, plans)
        synchronize(self.target.device)  # timings measure the device's work, not its queueing
        t1 = time.perf_counter()
        blocks = []
        for seq, tree in zip(seqs, trees):
            root_pos = len(seq.tokens) - 1
            toks = [seq.root] + [t if t != DEAD else 0 for t in tree.tokens]
            pos = block_positions(root_pos, tree.depths())
            blocks.append(Block(seq.slot, toks, pos, list(range(len(toks))), tree.mask()))
        out, _ = run_blocks(self.target, self.cache, blocks)
        results, failed = self._verify_all(seqs, trees, plans, out.logits)  # logits: [B, rows, vocab]
        kept = []
        for res in results:
            try:
                self._update_caches(res.seq, res.tree, res.result, res.last_is_root)
            except Exception as exc:  # noqa: BLE001 - the engine ends this request, the others go on
                log.exception("cache update failed for request %s", res.seq.request_id)
                failed.append((res.seq, exc))
                continue
            kept.append(res)
        synchronize(self.target.device)
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += time.perf_counter() - t1
        return kept, failed

    def _verify_all(self, seqs: list[Sequence], trees: list[DraftTree], plans: list[DraftPlan],
                    logits: torch.Tensor) -> tuple[list[SeqStepResult], list[tuple[Sequence, Exception]]]:
        """Verifies every tree by its method's rule (``Method.rule``; the lossless one when the rule
        declines the tree), each rule over its sequences at once, then reads every decision back
        together.  A failure is isolated to the sequences it belongs to: when the batch fails, each
        sequence is verified alone.  Results come in the order of ``seqs``."""
        by_rule: dict[str, list[int]] = {}
        for i, (plan, tree) in enumerate(zip(plans, trees)):
            name = method(plan.method).rule
            rule = self.rules.get(name)
            if rule is None:
                raise ValueError(f"method {plan.method!r} names verification rule {name!r}, which is not registered")
            by_rule.setdefault(name if rule.claims(plan, tree) else LOSSLESS, []).append(i)
        groups = [(idx, self.rules[name]) for name, idx in by_rule.items()]

        def start(idx: list[int], rule: VerifyRule) -> Pending:
            return rule.start([seqs[i] for i in idx], [trees[i] for i in idx], _rows_of(logits, idx))

        done: dict[int, SeqStepResult] = {}
        failed: list[tuple[Sequence, Exception]] = []
        try:  # every rule decides on the device, then one read for all of them
            for (idx, _), results in zip(groups, finish_all([start(idx, rule) for idx, rule in groups])):
                done.update(zip(idx, results))
        except Exception:  # noqa: BLE001 - find whose it is: verify each sequence alone
            log.exception("verifying the batch failed; verifying its sequences one by one")
            done.clear()
            for idx, rule in groups:
                for i in idx:
                    try:
                        done[i] = start([i], rule).result()[0]
                    except Exception as exc:  # noqa: BLE001 - the engine ends this request, the others go on
                        log.exception("verification failed for request %s", seqs[i].request_id)
                        failed.append((seqs[i], exc))
        return [done[i] for i in sorted(done)], failed

    def _draft(self, seqs: list[Sequence], plans: list[DraftPlan]) -> list[DraftTree]:
        """Every drafter in stage order grows the trees its share of the plans asks for."""
        trees = [DraftTree(p.sub, []) for p in plans]
        for drafter in self.drafters:
            drafter.propose(seqs, plans, trees)
        return trees

    def observe(self, results: list[SeqStepResult], plans: list[DraftPlan]) -> None:
        """Hands the step's outcome to every drafter that learns from it (``Drafter.observe``):
        ``results`` and the plans they followed, in the same order.  A drafter whose ``observe`` raises
        is logged; it fails no request."""
        for drafter in self._observers:
            try:
                drafter.observe(results, plans)
            except Exception:  # noqa: BLE001 - learning is optional; the step's tokens are already decided
                log.exception("drafter %s failed to observe the step", drafter.name)

    def _update_caches(self, seq: Sequence, tree: DraftTree, result: VerifyResult, last_is_root: bool = False) -> None:
        """Target keeps root + accepted path; the draft keeps the accepted nodes it ran.  In the
        target-initialised mode the last emitted token is the accepted path's last node, and it stays
        uncached (it is the next root)."""
        accepted = result.accepted[:-1] if last_is_root else result.accepted
        if not last_is_root:
            rows = kept_block_rows(result)
        elif result.accepted:
            rows = kept_block_rows(result)[:-1]
        else:
            rows = []  # a first step only drew candidates: the root stays uncached
        self.cache.keep(seq.slot, rows)
        seq.target_cached = len(seq.tokens) + len(result.accepted) - (1 if last_is_root else 0)
        if self.proposer is not None and seq.draft_slot is not None:
            kept = tree.draft_entries(accepted)
            self.proposer.cache.keep(seq.draft_slot, kept)
            seq.draft_cached += len(kept)


def _rows_of(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``logits[index]`` (no copy when ``index`` is every row in order)."""
    if index == list(range(logits.shape[0])):
        return logits
    return logits[torch.tensor(index, dtype=torch.long, device=logits.device)]


def block_positions(root_pos: int, depths: list[int]) -> list[int]:
    """Position ids of a verification block: the root's, then root + depth for every node
    (siblings share a position)."""
    return [root_pos] + [root_pos + d for d in depths]


def kept_block_rows(result: VerifyResult) -> list[int]:
    """Target cache entries kept after verification: the root and the accepted path.  The final
    (bonus or correction) token is not cached: it is the next step's root."""
    return [0] + [1 + i for i in result.accepted]


def record_step(stats: StepStats, res: SeqStepResult) -> None:
    """Adds one sequence's drafted/accepted accounting to the step's stats."""
    r, tree, tokens = res.result, res.tree, res.tree.tokens
    stats.num_seqs += 1
    if res.drafted:
        stats.num_spec_seqs += 1
    stats.drafted_tokens += res.drafted
    stats.accepted_tokens += len(r.accepted)
    stats.bonus_tokens += int(r.bonus and bool(tokens))
    for d in range(1, len(r.accepted) + 1):
        add_at(stats.accepted_per_position, d - 1)
    if not tokens:
        return
    depth, rank = tree.depths(), tree.ranks()
    for i, t in enumerate(tokens):
        if t != DEAD:
            add_at(stats.drafted_by_depth, depth[i] - 1)
            add_at(stats.drafted_by_rank, rank[i])
            for m in tree.node_sources(i):
                stats.drafted_by_method[m] = stats.drafted_by_method.get(m, 0) + 1
    for i in r.accepted:
        add_at(stats.accepted_by_depth, depth[i] - 1)
        add_at(stats.accepted_by_rank, rank[i])
        for m in tree.node_sources(i):
            stats.accepted_by_method[m] = stats.accepted_by_method.get(m, 0) + 1
