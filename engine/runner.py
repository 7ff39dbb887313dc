"""Runs the models for one engine step: prefill chunks, and the speculative step (draft tree ->
one target forward over every sequence's tree -> lossless verification -> cache update).

Plain decoding is the same path with an empty tree: the block is just the root, and the
"verification" draws the next token from the target's distribution at the root.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional
from typing import Sequence as Sequence_

import torch

from engine.batching import Block, run_blocks
from engine.device import Pending, finish_all, synchronize, to_device, to_host
from engine.device import tensor as device_tensor
from engine.kv_cache import KVCache
from engine.models.llama import LlamaModel
from engine.request import TokenLogprob
from engine.sampler import SamplingTensors, process_logits, raw_logprobs
from engine.sequence import Sequence
from engine.speculative.draft_tree import DEAD, DraftTree
from engine.speculative.drafter import Drafter
from engine.speculative.history import batch_histories
from engine.speculative.methods import DraftPlan
from engine.speculative.mjsd import start_joint
from engine.speculative.proposer import DraftModelProposer
from engine.speculative.target_init import start_target_init
from engine.speculative.verify import TreeBatch, draw_tables, start_verify
from engine.speculative.walk import VerifyResult
from engine.stats import StepStats, add_at

log = logging.getLogger(__name__)


@dataclass
class SeqStepResult:
    seq: Sequence
    result: VerifyResult
    tree: DraftTree
    logprobs: Optional[list[TokenLogprob]] = None
    logits: Optional[torch.Tensor] = None  # [1+n, vocab] the target's raw logits of the block (for training heads)
    next_candidates: Optional[list[int]] = None  # target-initialised mode: the next step's candidate roots

    @property
    def drafted(self) -> int:
        """Live drafted nodes of the tree."""
        return sum(1 for t in self.tree.tokens if t != DEAD)


class ModelRunner:
    def __init__(self, target: LlamaModel, target_cache: KVCache, vocab_size: int,
                 proposer: Optional[DraftModelProposer] = None, drafters: Sequence_[Drafter] = (),
                 mjsd_tau: float = 0.5, target_init_k: int = 3) -> None:
        """``proposer``: the draft model and its cache (None: no draft model); ``drafters``: what grows
        the trees, in stage order (``engine.speculative.drafter``)."""
        self.target = target
        self.cache = target_cache
        self.vocab_size = vocab_size
        self.proposer = proposer
        self.drafters = list(drafters)
        self.mjsd_tau = mjsd_tau
        self.target_init_k = target_init_k

    # ------------------------------------------------------------------ prefill
    def prefill(self, chunks: list[tuple[Sequence, int]]) -> None:
        """Caches ``seq.tokens[seq.target_cached:end]`` for each ``(seq, end)`` in the target.

        The draft model's cache is filled lazily: the proposer's catch-up runs whatever the draft has
        not seen the first time a sequence actually drafts with it, so requests that never use the
        draft model (Max-Gram, no speculation, a load-aware budget of plain decoding) never pay for it.
        """
        blocks = [Block(s.slot, s.tokens[s.target_cached:end], list(range(s.target_cached, end)), [])
                  for s, end in chunks]
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
        kept, plan_of = [], {id(s): p for s, p in zip(seqs, plans)}
        for res in results:
            try:
                self._update_caches(res.seq, res.tree, res.result, plan_of[id(res.seq)].init)
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
        """Verifies every tree: the lossless methods together (``engine.speculative.verify``), the
        lossy ones by their own rules.  A failure is isolated to the sequences it belongs to: when the
        batch fails, each sequence is verified alone.  Results come in the order of ``seqs``."""
        init = [i for i, p in enumerate(plans) if p.init]
        joint = [i for i, t in enumerate(trees) if t.joint_logq is not None and i not in init]
        lossless = [i for i in range(len(seqs)) if i not in init and i not in joint]
        done: dict[int, SeqStepResult] = {}
        failed: list[tuple[Sequence, Exception]] = []

        def batched(idx: list[int]) -> Pending:
            return self._verify_batch([seqs[i] for i in idx], [trees[i] for i in idx], _rows_of(logits, idx))

        def joint_rule(idx: list[int]) -> Pending:
            rows = [logits[i, : 1 + trees[i].num_nodes, : self.vocab_size] for i in idx]
            pending = start_joint([(lg, trees[i].tokens, trees[i].joint_logq, seqs[i]) for lg, i in zip(rows, idx)],
                                  self.mjsd_tau)
            return pending.then(lambda results: [self._joint_result(seqs[i], trees[i], res, lg)
                                                 for i, lg, res in zip(idx, rows, results)])

        def init_rule(idx: list[int]) -> Pending:
            return self._verify_target_init([seqs[i] for i in idx], [trees[i] for i in idx], _rows_of(logits, idx))

        groups = [(idx, rule) for idx, rule in ((lossless, batched), (joint, joint_rule), (init, init_rule)) if idx]
        try:  # every rule decides on the device, then one read for all of them
            for (idx, _), results in zip(groups, finish_all([rule(idx) for idx, rule in groups])):
                done.update(zip(idx, results))
        except Exception:  # noqa: BLE001 - find whose it is: verify each sequence alone
            log.exception("verifying the batch failed; verifying its sequences one by one")
            done.clear()
            for idx, rule in groups:
                for i in idx:
                    try:
                        done[i] = rule([i]).result()[0]
                    except Exception as exc:  # noqa: BLE001 - the engine ends this request, the others go on
                        log.exception("verification failed for request %s", seqs[i].request_id)
                        failed.append((seqs[i], exc))
        return [done[i] for i in sorted(done)], failed

    def _target_rows(self, seqs: list[Sequence], trees: list[DraftTree], logits: torch.Tensor):
        """The batch's trees as tensors, the raw logits of their rows [B, R, V], the processed ones
        (logit bias, and penalties with each row's own path) and the rows' sampling parameters."""
        dev, v = logits.device, self.vocab_size
        batch = TreeBatch.build(trees, v, dev)
        b, r = len(seqs), batch.num_rows
        raw = logits[:, :r, :v]
        params = [s.request.sampling for s in seqs]
        st = SamplingTensors.from_params(params, v, [i for i in range(b) for _ in range(r)], device=dev)
        x = raw
        if st.any_bias or st.any_penalty:
            counts, prompt = batch_histories(seqs, trees, r, v, dev) if st.any_penalty else (None, None)
            x = process_logits(raw.reshape(b * r, v), st, counts, prompt).view(b, r, v)
        return batch, raw, x, st, params

    def _verify_batch(self, seqs: list[Sequence], trees: list[DraftTree], logits: torch.Tensor) -> Pending:
        """The lossless rule for ``seqs`` at once, decided on the device (the pending reads it back);
        logits: [B, rows, vocab'] their raw block logits."""
        dev = logits.device
        batch, raw, x, st, params = self._target_rows(seqs, trees, logits)
        uniforms = None
        if not st.all_greedy:
            gens = [None if p.greedy else s.generator for s, p in zip(seqs, params)]
            uniforms = draw_tables(gens, batch, dev)
        without = self.proposer is None or self.proposer.without_replacement
        pending = start_verify(x, st, batch, uniforms, without, raw_logits=raw, logprobs=[p.logprobs for p in params])
        return pending.then(lambda outcome: [
            SeqStepResult(s, res, t, lps, raw[i, : 1 + t.num_nodes])
            for i, (s, t, res, lps) in enumerate(zip(seqs, trees, outcome.results, outcome.logprobs))])

    def _draft(self, seqs: list[Sequence], plans: list[DraftPlan]) -> list[DraftTree]:
        """Every drafter in stage order grows the trees its share of the plans asks for."""
        trees = [DraftTree(p.sub, []) for p in plans]
        for drafter in self.drafters:
            drafter.propose(seqs, plans, trees)
        return trees

    def _verify_target_init(self, seqs: list[Sequence], trees: list[DraftTree], logits: torch.Tensor) -> Pending:
        """The target-initialised mode's own rule (lossy by design, ``engine.speculative.target_init``)
        for ``seqs`` at once, decided on the device."""
        dev, k = logits.device, self.target_init_k
        batch, raw, x, st, params = self._target_rows(seqs, trees, logits)
        u_accept = torch.zeros(len(seqs), batch.num_rows)
        u_cand = torch.zeros(len(seqs), k)
        for i, (seq, tree, p) in enumerate(zip(seqs, trees, params)):
            if not p.greedy:  # its own rows and k, so what a seeded request draws does not depend on the batch
                rows = 1 + tree.num_nodes
                u = torch.rand(rows + k, generator=seq.generator)
                u_accept[i, :rows], u_cand[i] = u[:rows], u[rows:]
        pending = start_target_init(x, st, batch, to_device(u_accept, dev), to_device(u_cand, dev), k)

        def results(decided: list) -> list[SeqStepResult]:
            out = []
            for i, (seq, tree, p, (res, cands)) in enumerate(zip(seqs, trees, params, decided)):
                lg = raw[i, : 1 + tree.num_nodes]
                lps = self._logprobs(lg, res, p.logprobs) if p.logprobs is not None else None
                out.append(SeqStepResult(seq, res, tree, lps, lg, cands))
            return out
        return pending.then(results)

    def _joint_result(self, seq: Sequence, tree: DraftTree, result: VerifyResult, logits: torch.Tensor) -> SeqStepResult:
        k = seq.request.sampling.logprobs
        lps = self._logprobs(logits, result, k) if k is not None else None
        return SeqStepResult(seq, result, tree, lps, logits)

    @staticmethod
    def _logprobs(logits: torch.Tensor, result: VerifyResult, k: int) -> list[TokenLogprob]:
        """The emitted tokens' logprobs and ``k`` best alternatives (the lossy rules' walk; the
        batched verifier computes its own)."""
        dev = logits.device
        lp = raw_logprobs(logits[device_tensor(result.rows, dev)])  # [emitted, vocab]
        chosen = lp.gather(1, device_tensor(result.tokens, dev)[:, None]).squeeze(1)
        top_vals, top_ids = lp.topk(k, dim=-1) if k > 0 else (chosen[:, None], chosen[:, None])
        chosen, top_vals, top_ids = (t.tolist() for t in to_host(chosen, top_vals, top_ids))
        return [TokenLogprob(tok, chosen[j], list(zip(top_ids[j], top_vals[j])) if k > 0 else [])
                for j, tok in enumerate(result.tokens)]

    def _update_caches(self, seq: Sequence, tree: DraftTree, result: VerifyResult, init: bool = False) -> None:
        """Target keeps root + accepted path; the draft keeps the accepted nodes it ran.  In the
        target-initialised mode the last emitted token is the accepted path's last node, and it stays
        uncached (it is the next root)."""
        accepted = result.accepted[:-1] if init else result.accepted
        if not init:
            rows = kept_block_rows(result)
        elif result.accepted:
            rows = kept_block_rows(result)[:-1]
        else:
            rows = []  # a first step only drew candidates: the root stays uncached
        self.cache.keep(seq.slot, rows)
        seq.target_cached = len(seq.tokens) + len(result.accepted) - (1 if init else 0)
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
