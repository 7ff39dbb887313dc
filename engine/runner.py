"""Runs the models for one engine step: prefill chunks, and the speculative step (draft tree ->
one target forward over every sequence's tree -> lossless verification -> cache update).

Plain decoding is the same path with an empty tree: the block is just the root, and the
"verification" draws the next token from the target's distribution at the root.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional
from typing import Sequence as Sequence_

import torch

from engine.batching import Block, block_ids, run_blocks
from engine.device import DeviceTimer, Pending, finish_all, tensor as device_tensor, to_device, to_device_many
from engine.kv_cache import KVCache
from engine.models.model import Model
from engine.sequence import Sequence
from engine.speculative.draft_tree import DEAD, DRAFT_MODEL, DraftTree, holders, index_ranges
from engine.speculative.drafter import Drafter
from engine.registry import method
from engine.speculative.methods import DraftPlan
from engine.speculative.proposer import DraftModelProposer
from engine.speculative.tree import TreeTopology
from engine.speculative.verify import LOSSLESS, LosslessRule, VerifyRule
from engine.speculative.walk import SeqStepResult
from engine.speculative.walk import VerifyResult
from engine.stats import StepStats, add_at

log = logging.getLogger(__name__)


@dataclass
class StepOutcome:
    """What a decoding step did (``ModelRunner.step``)."""

    results: list[SeqStepResult] = field(default_factory=list)
    plans: list[DraftPlan] = field(default_factory=list)  # the plan each result followed, in the same order
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # ended, with the error
    stopped: list[Sequence] = field(default_factory=list)  # speculation failed: decoded plainly, from now on
    whole: bool = True  # the batch ran as one forward, so the step's time is the cost of its rows


@dataclass
class _Ahead:
    """The next step's target forward, run before the host read this step's tokens (``decode_ahead``):
    plain decoding of ``seqs`` from the roots the step drew on the device."""

    seqs: list[Sequence]
    logits: torch.Tensor  # [len(seqs), 1, vocab]


@dataclass
class _Forward:
    """Sequences drafted and run through the target together: their plans, trees and block logits."""

    seqs: list[Sequence]
    plans: list[DraftPlan]
    trees: list[DraftTree]
    logits: torch.Tensor  # [len(seqs), rows, vocab]
    seconds: float  # the target forward (queued, on a device: its work is timed with the verification)
    draft: DeviceTimer  # the drafting's device time, read after the step's read


class ModelRunner:
    def __init__(self, target: Model, target_cache: KVCache, vocab_size: int,
                 proposer: Optional[DraftModelProposer] = None, drafters: Sequence_[Drafter] = (),
                 rules: Optional[dict[str, VerifyRule]] = None, topology: Optional[TreeTopology] = None) -> None:
        """``proposer``: the draft model and its cache (None: no draft model); ``drafters``: what grows
        the trees, in stage order (``engine.speculative.drafter``); ``rules``: the lossy methods'
        verification rules by name (``engine.speculative.verify.build_rules``); ``topology``: the
        engine's tree (its empty subtree is the plan of a sequence whose speculation failed)."""
        self.empty = (topology or TreeTopology(())).subtree(())
        self.target = target
        self.cache = target_cache
        self.vocab_size = vocab_size
        self.proposer = proposer
        self.drafters = list(drafters)
        self._observers = [d for d in self.drafters if hasattr(d, "observe")]  # Drafter.observe is optional
        without = proposer is None or proposer.without_replacement
        self.rules: dict[str, VerifyRule] = {LOSSLESS: LosslessRule(vocab_size, without), **(rules or {})}
        self.ahead: Optional[_Ahead] = None  # the next step's forward, already queued (decode_ahead)

    # ------------------------------------------------------------------ prefill
    def prefill(self, chunks: list[tuple[Sequence, int]]) -> list[tuple[Sequence, Exception]]:
        """Caches ``seq.tokens[seq.target_cached:end]`` for each ``(seq, end)`` in the target.  Returns
        the sequences whose chunk failed, with the error: when the batch's forward fails, each chunk
        runs alone, so one prompt's failure is that request's alone.

        The draft model's cache is filled lazily: the proposer's catch-up runs whatever the draft has
        not seen the first time a sequence actually drafts with it, so requests that never use the
        draft model (Max-Gram, no speculation, a load-aware budget of plain decoding) never pay for it.
        """
        try:
            self._prefill(chunks)
            return []
        except Exception as exc:  # noqa: BLE001 - find whose it is
            if len(chunks) == 1:
                log.error("prefill failed for request %s", chunks[0][0].request_id, exc_info=exc)
                self.cache.discard(chunks[0][0].slot)
                return [(chunks[0][0], exc)]
            log.exception("prefill failed for a batch of %d chunks; running each alone", len(chunks))
        for s, _ in chunks:
            self.cache.discard(s.slot)
        failed = []
        for chunk in chunks:
            try:
                self._prefill([chunk])
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                log.exception("prefill failed for request %s", chunk[0].request_id)
                self.cache.discard(chunk[0].slot)
                failed.append((chunk[0], exc))
        return failed

    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> None:
        blocks = [Block(s.slot, s.tokens[s.target_cached:end], list(range(s.target_cached, end)), [])
                  for s, end in chunks]
        # one forward: chunks of different lengths run packed, so none is padded to the longest
        run_blocks(self.target, self.cache, blocks)
        for s, end in chunks:
            self.cache.commit(s.slot)
            s.target_cached = end

    # ------------------------------------------------------------------ decode
    def step(self, seqs: list[Sequence], plans: list[DraftPlan], stats: StepStats,
             ahead: bool = False, while_waiting: Optional[Callable[[], None]] = None) -> StepOutcome:
        """Drafts, verifies and updates the caches of ``seqs`` (``plans[i]``: what sequence i drafts).

        ``ahead``: when the step is plain decoding of the whole batch, the next step's forward of the
        same sequences is queued on the device before the host waits for this step's tokens
        (:meth:`_decode_ahead`); the next step then uses it (:attr:`ahead`) if its batch is among them.
        ``while_waiting``: host work for the time the device works; called once, when the step's read
        is queued (after the forward ahead) and before the host waits for it.

        One request's failure is that request's alone:

        * a sequence whose verification or cache update fails ends with the error (``failed``);
        * when drafting or the target forward fails for the batch, each sequence runs it alone (what
          a failed attempt left in the caches is rolled back first);
        * a sequence whose speculative step fails alone runs it again without speculation and decodes
          plainly from then on (its ``speculation_error``; ``stopped``).  Speculation only ever saves
          time, so its failure costs the request none of its output; one that fails without
          speculation ends with the error."""
        out = StepOutcome()
        ran_ahead = self._from_ahead(seqs, plans)
        forwards = ran_ahead or self._forward_isolated(seqs, plans, out, stats)
        t1 = time.perf_counter()
        for f in forwards:
            plan_of = {id(s): p for s, p in zip(f.seqs, f.plans)}
            committed: set[int] = set()  # sequences whose caches the step updated before its read
            go_ahead = ahead and len(forwards) == 1 and out.whole
            work, while_waiting = while_waiting, None  # once: the first read waits for all the step's work
            results, failed = self._verify_all(f.seqs, f.trees, f.plans, f.logits,  # logits: [B, rows, vocab]
                                               self._before_wait(f.seqs, committed, go_ahead, work))
            if committed:
                out.whole = False  # the step's time holds the next forward's launch
            for res, exc in zip(results, self._update_caches(results, committed)):
                if exc is not None:  # the engine ends this request, the others go on
                    log.error("cache update failed for request %s", res.seq.request_id, exc_info=exc)
                    failed.append((res.seq, exc))
                    continue
                out.results.append(res)
                out.plans.append(plan_of[id(res.seq)])
            out.failed += failed
        # the reads above waited for every forward's drafting: its device time is known now, without a
        # wait of its own; verification is the rest of the step until those reads
        end = time.perf_counter()
        for f in forwards:
            draft = f.draft.seconds()
            stats.draft_seconds += draft
            stats.verify_seconds += max(0.0, f.draft.host_seconds() + f.seconds - draft)
        stats.verify_seconds += end - t1
        if ran_ahead:
            out.whole = False  # its forward ran during the last step: the step's time is not its rows' cost
        return out

    def _before_wait(self, seqs: list[Sequence], committed: set[int], go_ahead: bool,
                     work: Optional[Callable[[], None]]) -> Optional[Callable[[list[Pending]], None]]:
        """What runs once a forward's read is queued, before the host waits for it: the next step's
        forward of ``seqs`` (``go_ahead``, :meth:`_decode_ahead`), then the host's ``work``."""
        if not go_ahead and work is None:
            return None

        def before_wait(pendings: list[Pending]) -> None:
            if go_ahead:
                self._decode_ahead(seqs, pendings, committed)
            if work is not None:
                work()
        return before_wait

    def _from_ahead(self, seqs: list[Sequence], plans: list[DraftPlan]) -> list[_Forward]:
        """The step's forward from :attr:`ahead`, when it ran this batch's plain step (every sequence
        among its own, every plan plain); else [] (and its entries are discarded)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return []
        at = {id(s): i for i, s in enumerate(ahead.seqs)}
        if all(id(s) in at for s in seqs) and all(p.plain for p in plans):
            logits = _rows_of(ahead.logits, [at[id(s)] for s in seqs])
            timer = DeviceTimer(self.target.device).start()
            timer.stop()
            return [_Forward(seqs, plans, [DraftTree(p.sub, []) for p in plans], logits, 0.0, timer)]
        self._undo(ahead)
        return []

    def drop_ahead(self) -> None:
        """Undoes a queued next forward (:attr:`ahead`) that no step will use."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            self._undo(ahead)

    def _undo(self, ahead: _Ahead) -> None:
        """Discards what a forward ahead wrote into the caches of its sequences still holding a slot."""
        for s in ahead.seqs:
            if s.slot is not None:
                self.cache.discard(s.slot)

    def _decode_ahead(self, seqs: list[Sequence], pendings: list[Pending], committed: set[int]) -> None:
        """Queues the next step's forward of ``seqs`` (the whole batch, decoding plainly) before the host
        waits for this step's tokens: each sequence's root entry is kept now (a plain step always keeps
        it), and the next forward runs the roots the step drew, still on the device, one position on.
        Any failure leaves things as they were: the step goes on without it."""
        if len(pendings) != 1 or pendings[0].next_roots is None or pendings[0].next_roots.shape[0] != len(seqs):
            return
        try:
            outcome = self.cache.keep_many([(s.slot, [0]) for s in seqs])
        except Exception:  # noqa: BLE001 - the step's own update tries again, and a failure there is per request
            log.exception("keeping the root entries before the read failed; decoding without going ahead")
            return
        for s, exc in zip(seqs, outcome):
            if exc is None:  # kept: the step's own update leaves it alone
                s.target_cached = len(s.tokens)
                committed.add(id(s))
        if len(committed) < len(seqs):
            log.error("keeping a root entry before the read failed; decoding without going ahead")
            return
        try:
            blocks = [Block(s.slot, [0], [len(s.tokens)], [0]) for s in seqs]
            out, _ = run_blocks(self.target, self.cache, blocks, ids=pendings[0].next_roots[:, None])
        except Exception:  # noqa: BLE001 - the next step runs its own forward
            log.exception("the forward ahead failed; the next step runs its own")
            for s in seqs:
                self.cache.discard(s.slot)
            return
        self.ahead = _Ahead(list(seqs), out.logits)

    def _forward(self, seqs: list[Sequence], plans: list[DraftPlan], stats: StepStats) -> _Forward:
        """Drafts the sequences' trees and runs the target over them, in one forward."""
        draft = DeviceTimer(self.target.device).start()
        trees = self._draft(seqs, plans)
        draft.stop()  # the host does not wait for the draft: the step's one read comes after verification
        t1 = time.perf_counter()
        blocks = []
        for seq, tree in zip(seqs, trees):
            root_pos = len(seq.tokens) - 1
            if tree.unread is not None:  # drafted tokens still on the device: gathered there (verification_ids)
                size = tree.num_held  # held on the device; nodes the host appended are its own
                toks = [seq.root] + [0] * size + tree.known_tokens_after(size)
            else:
                toks = [seq.root] + [t if t != DEAD else 0 for t in tree.tokens]
            pos = block_positions(root_pos, tree.depths())
            blocks.append(Block(seq.slot, toks, pos, list(range(len(toks))), tree.mask()))
        ids = verification_ids(blocks, trees, self.target.device) if any(t.unread is not None for t in trees) else None
        out, _ = run_blocks(self.target, self.cache, blocks, ids=ids)
        return _Forward(seqs, plans, trees, out.logits, time.perf_counter() - t1, draft)

    def _forward_isolated(self, seqs: list[Sequence], plans: list[DraftPlan], out: StepOutcome,
                          stats: StepStats) -> list[_Forward]:
        """The batch's forward; if it fails, each sequence's alone, and a sequence whose speculative
        forward fails alone, without speculation (see :meth:`step`)."""
        marks = [(s.draft_cached, s.draft_slot) for s in seqs]  # what a failed attempt is rolled back to
        try:
            return [self._forward(seqs, plans, stats)]
        except Exception as exc:  # noqa: BLE001 - find whose it is
            if len(seqs) == 1:
                return self._without_speculation(seqs[0], plans[0], marks[0], exc, out, stats)
            log.exception("drafting or the target forward failed for a batch of %d; running each sequence alone",
                          len(seqs))
        out.whole = False
        forwards = []
        for seq, plan, mark in zip(seqs, plans, marks):
            self._roll_back(seq, mark)
            try:
                forwards.append(self._forward([seq], [plan], stats))
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                forwards += self._without_speculation(seq, plan, mark, exc, out, stats)
        return forwards

    def _without_speculation(self, seq: Sequence, plan: DraftPlan, mark: tuple[int, Optional[int]],
                             exc: Exception, out: StepOutcome, stats: StepStats) -> list[_Forward]:
        """``seq``'s forward failed alone with ``exc``: again without speculation, if it speculated."""
        out.whole = False
        self._roll_back(seq, mark)
        if plan.plain:  # it drafted nothing: the target's own forward failed
            log.error("the target forward failed for request %s", seq.request_id, exc_info=exc)
            out.failed.append((seq, exc))
            return []
        log.error("speculation failed for request %s; its step runs again without it", seq.request_id,
                  exc_info=exc)
        try:
            forward = self._forward([seq], [DraftPlan(plan.method, self.empty)], stats)
        except Exception as exc2:  # noqa: BLE001 - the request cannot go on
            log.exception("the target forward failed for request %s", seq.request_id)
            self._roll_back(seq, mark)
            out.failed.append((seq, exc2))
            return []
        seq.speculation_error = f"{type(exc).__name__}: {exc}"
        stopped = f"speculation stopped after an engine error ({seq.speculation_error}); the rest was decoded plainly"
        seq.spec.note = f"{seq.spec.note}; {stopped}" if seq.spec.note else stopped  # a lossy method's note stays
        out.stopped.append(seq)
        return [forward]

    def _roll_back(self, seq: Sequence, mark: tuple[int, Optional[int]]) -> None:
        """Undoes what a failed attempt at ``seq``'s step left in the caches: the target's pending entries,
        and the draft's entries past ``mark`` (its ``draft_cached`` and draft slot before the step)."""
        self.cache.discard(seq.slot)
        draft_cached, draft_slot = mark
        if self.proposer is not None and draft_slot is not None:
            self.proposer.cache.rewind(draft_slot, draft_cached)
            seq.draft_cached = draft_cached

    def _verify_all(self, seqs: list[Sequence], trees: list[DraftTree], plans: list[DraftPlan],
                    logits: torch.Tensor, before_wait: Optional[Callable[[list[Pending]], None]] = None,
                    ) -> tuple[list[SeqStepResult], list[tuple[Sequence, Exception]]]:
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
            pendings = [start(idx, rule) for idx, rule in groups]
            wait = (lambda: before_wait(pendings)) if before_wait is not None else None
            for (idx, _), results in zip(groups, finish_all(pendings, wait)):
                done.update(zip(idx, results))
        except Exception:  # noqa: BLE001 - find whose it is: verify each sequence alone
            log.exception("verifying the batch failed; verifying its sequences one by one")
            self.drop_ahead()  # it ran from the tokens drawn the first time, which the second may not draw
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
        """Every drafter in stage order grows the trees its share of the plans asks for: those of the
        step's methods, and those that grow every method's (``every_method``)."""
        trees = [DraftTree(p.sub, []) for p in plans]
        named = {name for m in {p.method for p in plans} for name in method(m).drafters}
        for drafter in self.drafters:
            if drafter.name in named or getattr(drafter, "every_method", False):
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

    def _update_caches(self, results: list[SeqStepResult], done: frozenset[int] | set[int] = frozenset(),
                       ) -> list[Optional[Exception]]:
        """Each sequence's caches after its step: the target keeps root + accepted path, the draft the
        accepted nodes it ran (``KVCache.keep_many``: every sequence's entries move together).  When
        the rule says so (``SeqStepResult.last_is_root``), the last emitted token is the accepted
        path's last node, and it stays uncached (it is the next root).  One exception per result
        (None: updated); a sequence whose update failed is that sequence's failure alone.  ``done``:
        sequences (by ``id``) whose caches the step updated already (:meth:`_decode_ahead`)."""
        errors: list[Optional[Exception]] = [None] * len(results)
        target, draft = [], []  # (result index, slot, kept entries)
        for i, res in enumerate(results):
            if id(res.seq) in done:
                continue
            try:
                rows, kept = self._kept_entries(res)
            except Exception as exc:  # noqa: BLE001 - this sequence's alone
                errors[i] = exc
                continue
            target.append((i, res.seq.slot, rows))
            if kept is not None:
                draft.append((i, res.seq.draft_slot, kept))
        for cache, keeps in ((self.cache, target), (self.proposer.cache if self.proposer else None, draft)):
            if not keeps:
                continue
            try:
                outcome = cache.keep_many([(slot, kept) for _, slot, kept in keeps])
            except Exception as exc:  # noqa: BLE001 - the move itself failed: every sequence in it
                outcome = [exc] * len(keeps)
            for (i, _, _), exc in zip(keeps, outcome):
                errors[i] = errors[i] or exc
        for i, _, _ in target:
            seq, res = results[i].seq, results[i]
            if errors[i] is None:
                seq.target_cached = len(seq.tokens) + len(res.result.accepted) - (1 if res.last_is_root else 0)
        for i, _, kept in draft:
            if errors[i] is None:
                results[i].seq.draft_cached += len(kept)
        return errors

    def _kept_entries(self, res: SeqStepResult) -> tuple[list[int], Optional[list[int]]]:
        """What ``res``'s sequence keeps of its pending entries: the target's block rows, and the
        draft's entries (None without a draft cache)."""
        result, last_is_root = res.result, res.last_is_root
        accepted = result.accepted[:-1] if last_is_root else result.accepted
        if not last_is_root:
            rows = kept_block_rows(result)
        elif result.accepted:
            rows = kept_block_rows(result)[:-1]
        else:
            rows = []  # a first step only drew candidates: the root stays uncached
        kept = None
        if self.proposer is not None and res.seq.draft_slot is not None:
            kept = res.tree.draft_entries(accepted)
        return rows, kept


def _rows_of(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``logits[index]`` (no copy when ``index`` is every row in order)."""
    if index == list(range(logits.shape[0])):
        return logits
    return logits[device_tensor(index, logits.device)]


def verification_ids(blocks: list[Block], trees: list[DraftTree], device: torch.device) -> torch.Tensor:
    """Token ids [len(blocks), longest block] on the device: the blocks' own tokens, and the tokens of
    trees still on the device (``DraftTree.unread``) gathered there, so the host need not read them
    before the target runs."""
    base = block_ids(blocks)
    b, t = base.shape
    ids = to_device(base, device)
    for holder in holders(trees):
        mine = [tr.unread is holder for tr in trees]
        # column 0 (the root) and what others hold: the root stand-in (a live 0, unused)
        at, use = index_ranges([holder.offset_of(tr) - 1 if m else 0 for tr, m in zip(trees, mine)],
                               [1 + tr.num_held if m else 0 for tr, m in zip(trees, mine)], t, holder.root)
        at[:, 0], use[:, 0] = holder.root, False
        at, use = to_device_many([torch.from_numpy(at), torch.from_numpy(use)], device)
        ids = torch.where(use, holder.flat.index_select(0, at.view(-1)).view(b, t).clamp(min=0), ids)
    return ids


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
    drafted = res.drafted
    stats.num_seqs += 1
    if drafted:
        stats.num_spec_seqs += 1
    stats.drafted_tokens += drafted
    stats.accepted_tokens += len(r.accepted)
    stats.bonus_tokens += int(r.bonus and bool(tokens))
    for d in range(len(r.accepted)):  # the accepted path has a node at each depth down to its length
        add_at(stats.accepted_per_position, d)
        add_at(stats.accepted_by_depth, d)
    if not tokens:
        return
    if drafted == len(tokens) and not tree.extra_parent:  # the draft model's whole subtree: counted once per shape
        for d, n in enumerate(tree.sub.level_widths):
            add_at(stats.drafted_by_depth, d, n)
        for k, n in enumerate(tree.sub.rank_counts):
            add_at(stats.drafted_by_rank, k, n)
        _count_methods(tree, range(drafted), stats.drafted_by_method)
        rank = tree.sub.rank_list
    else:
        depth, rank = tree.depths(), tree.ranks()
        live = [i for i, t in enumerate(tokens) if t != DEAD]
        for d, n in Counter(depth[i] for i in live).items():
            add_at(stats.drafted_by_depth, d - 1, n)
        for k, n in Counter(rank[i] for i in live).items():
            add_at(stats.drafted_by_rank, k, n)
        _count_methods(tree, live, stats.drafted_by_method)
    for k, n in Counter(rank[i] for i in r.accepted).items():
        add_at(stats.accepted_by_rank, k, n)
    _count_methods(tree, r.accepted, stats.accepted_by_method)


def _count_methods(tree: DraftTree, nodes: Sequence_[int], by_method: dict[str, int]) -> None:
    """Counts ``nodes`` by drafter (a node may have several)."""
    if not tree.sources:  # every node the draft model's
        if nodes:
            by_method[DRAFT_MODEL] = by_method.get(DRAFT_MODEL, 0) + len(nodes)
        return
    sources, own = tree.sources, 0  # (a node with no entry is the draft model's alone: DraftTree.node_sources)
    for i in nodes:
        found = sources.get(i)
        if found is None:
            own += 1
            continue
        for m in found:
            by_method[m] = by_method.get(m, 0) + 1
    if own:
        by_method[DRAFT_MODEL] = by_method.get(DRAFT_MODEL, 0) + own
