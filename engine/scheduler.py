"""Continuous batching: admits waiting requests between steps and splits long prompts into chunks.

Every step runs at most ``prefill_chunk`` prompt tokens (so a long prompt never stalls running
streams for long) and one speculative step for every sequence whose prompt is cached.  A sequence
whose prefill completes in this step decodes in the same step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.prefix_cache import PrefixCache, common_prefix
from engine.sequence import Sequence, SeqStatus
from engine.speculative.methods import uses_draft


@dataclass
class SchedulerOutput:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, cache tokens up to)
    decode: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    """``rows``: the most entries a decoding step appends to a sequence's target cache (its
    verification block); ``entries``: to its draft cache (a draft tree).  Both come from the drafters
    (``engine.speculative.drafter.limits``) and size what a step may need from the block pools."""

    def __init__(self, config: EngineConfig, cache: KVCache, draft_cache: Optional[KVCache],
                 rows: int = 1, entries: int = 0) -> None:
        self.config = config
        self.cache = cache
        self.draft_cache = draft_cache
        self.rows, self.entries = rows + 1, entries + 1
        self.prefix = PrefixCache(cache, config.prefix_cache)
        self.draft_prefix = PrefixCache(draft_cache, config.prefix_cache) if draft_cache is not None else None
        self.queried_tokens = 0  # prompt tokens admitted, and of those found cached, since take_counts
        self.hit_tokens = 0
        self.preempted = 0  # sequences preempted, since take_counts
        self._sharing: dict[tuple[int, ...], list[Sequence]] = {}  # prompt key -> running sequences
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def schedule(self, admit: bool = True) -> SchedulerOutput:
        """The step's prefill chunks and decoding sequences.  When the pools cannot hold what they
        would append, the most recently admitted sequences are preempted (their blocks freed, their
        tokens kept) and recomputed later from the prefix cache, until the step fits.  ``admit``:
        False holds waiting requests back for this step (its forward already ran: ``decode_ahead``)."""
        for seq in self.running:  # what earlier steps committed becomes shareable
            self.prefix.publish(seq.slot, seq.tokens, seq.target_cached)
            if seq.draft_slot is not None:
                self.draft_prefix.publish(seq.draft_slot, seq.tokens, seq.draft_cached)
        if admit:
            self._admit()
        while True:
            out = self._plan()
            if self._fits(out) or len(self.running) == 1:
                break
            self._preempt(self.running[-1])
        for seq in out.decode:
            seq.status = SeqStatus.RUNNING  # prefilled (or found cached) up to its root
        return out

    def _plan(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.prefill_chunk
        for seq in self.running:
            goal = len(seq.tokens) - 1  # the last token is the first step's root (a preempted sequence's
            # output is recomputed with its prompt)
            if seq.status is SeqStatus.PREFILLING and budget > 0:
                end = min(goal, seq.target_cached + budget)
                if end > seq.target_cached:
                    out.prefill.append((seq, end))
                    budget -= end - seq.target_cached
                if end == goal:
                    out.decode.append(seq)
            elif seq.status is SeqStatus.RUNNING:
                out.decode.append(seq)
        return out

    def _fits(self, out: SchedulerOutput) -> bool:
        """Whether the pools hold what the step appends: prefill chunks, then each decoding sequence's
        verification block (and draft tree, after a catch-up of everything it has not seen)."""
        ends = {id(seq): end for seq, end in out.prefill}
        decoding = {id(seq) for seq in out.decode}
        need = need_draft = 0
        for seq in self.running:
            end = ends.get(id(seq), seq.target_cached)
            need += self.cache.blocks_needed(seq.slot, end + (self.rows if id(seq) in decoding else 0))
            if seq.draft_slot is not None and id(seq) in decoding:
                need_draft += self._draft_step(seq, seq.draft_slot)
        return need <= self.cache.free_blocks and (self.draft_cache is None or need_draft <= self.draft_cache.free_blocks)

    def _admit(self) -> None:
        # blocks left beside what the running sequences append next, per pool (updated per admission:
        # admitting thousands of sequences stays linear)
        room = [self.cache.free_blocks - sum(self._target_step(s, s.slot) for s in self.running)]
        if self.draft_cache is not None:
            room.append(self.draft_cache.free_blocks - sum(self._draft_step(s, s.draft_slot) for s in self.running
                                                           if s.draft_slot is not None))
        while self.waiting and len(self.running) < self.config.max_batch and self.cache.free_slots:
            seq = self.waiting[0]
            if self.draft_cache is not None and not self.draft_cache.free_slots:
                break
            key = self._prefix_key(seq)
            peers = self._sharing.get(key, []) if key is not None else []
            if self.prefix.enabled and any(self._still_prefilling_for(p, seq) for p in peers):
                break  # it will share what a running sequence is about to cache rather than prefill it too
            need = self._needs(seq)
            if any(n > r for n, r in zip(need, room)):
                break
            room = [r - n for r, n in zip(room, need)]
            self.waiting.popleft()
            got = self.prefix.acquire(seq.tokens)
            seq.slot, seq.target_cached = got.slot, got.cached
            if not seq.preemptions:
                seq.cached_prompt_tokens = got.cached
            self.queried_tokens += len(seq.tokens)
            self.hit_tokens += got.cached
            if self.draft_prefix is not None and uses_draft(seq):
                got = self.draft_prefix.acquire(seq.tokens)
                seq.draft_slot, seq.draft_cached = got.slot, got.cached
            seq.status = SeqStatus.PREFILLING
            self.running.append(seq)
            if key is not None:
                peers.append(seq)
                self._sharing[key] = peers

    def _needs(self, seq: Sequence) -> list[int]:
        """Blocks a waiting sequence takes from each pool for its prompt and first step (what the prefix
        cache holds for it is not new), so that admitting it never forces a preemption at once."""
        need = [self._target_step(seq, None) - self.prefix.cached_prefix(seq.tokens) // self.cache.block_size]
        if self.draft_cache is not None:
            need.append(self._draft_step(seq, None) - self.draft_prefix.cached_prefix(seq.tokens)
                        // self.draft_cache.block_size if uses_draft(seq) else 0)
        return need

    def _target_step(self, seq: Sequence, slot: Optional[int]) -> int:
        """More target blocks ``slot`` (None: a new one) needs for the sequence's tokens and a
        verification block."""
        return self.cache.blocks_needed(slot, len(seq.tokens) + self.rows)

    def _draft_step(self, seq: Sequence, slot: Optional[int]) -> int:
        """More draft blocks ``slot`` (None: a new one) needs for the sequence's tokens (a catch-up) and
        a draft tree."""
        return self.draft_cache.blocks_needed(slot, len(seq.tokens) + self.entries)

    def _preempt(self, seq: Sequence) -> None:
        """Frees the sequence's blocks (publishing them: its recomputation may find them still cached)
        and puts it first in the queue."""
        self._leave(seq)
        seq.preemptions += 1
        self.preempted += 1
        seq.target_cached = seq.draft_cached = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _leave(self, seq: Sequence, reusable: bool = True) -> None:
        """Takes a running sequence out of the batch and frees its slots."""
        self.running.remove(seq)
        key = self._prefix_key(seq)
        if key is not None:
            self._sharing[key].remove(seq)
            if not self._sharing[key]:
                del self._sharing[key]
        # cache position i holds token i; a stop string may have cut tokens the cache committed
        self.prefix.release(seq.slot, seq.tokens[:seq.target_cached] if reusable else None)
        seq.slot = None
        if seq.draft_slot is not None:
            self.draft_prefix.release(seq.draft_slot, seq.tokens[:seq.draft_cached] if reusable else None)
            seq.draft_slot = None

    @staticmethod
    def _still_prefilling_for(peer: Sequence, seq: Sequence) -> bool:
        """Whether ``peer`` is still prefilling part of the prompt prefix it shares with ``seq``
        (requests arriving together with one system prompt: the first prefills it, the others wait
        a step or so and share it)."""
        if peer.status is not SeqStatus.PREFILLING:
            return False
        shared = min(common_prefix(peer.tokens[:peer.num_prompt], seq.tokens), seq.num_prompt - 1)
        return peer.target_cached < shared

    def _prefix_key(self, seq: Sequence) -> Optional[tuple[int, ...]]:
        """The key running sequences are indexed by (their prompt's first 16 tokens, or first block if
        longer), None for a shorter prompt."""
        n = max(16, self.cache.block_size)
        return tuple(seq.tokens[:n]) if seq.num_prompt - 1 >= n else None

    def take_counts(self) -> tuple[int, int, int]:
        """(tokens admitted, of those found in the prefix cache, sequences preempted) since the last call."""
        out = self.queried_tokens, self.hit_tokens, self.preempted
        self.queried_tokens = self.hit_tokens = self.preempted = 0
        return out

    @property
    def free_slots(self) -> int:
        """Sequences the next step could still admit to the running batch."""
        free = min(self.config.max_batch - len(self.running), self.cache.free_slots)
        if self.draft_cache is not None:
            free = min(free, self.draft_cache.free_slots)
        return max(free, 0)

    def finish(self, seq: Sequence, reusable: bool = True) -> None:
        """Frees the sequence's slots at once (finished or aborted).  What they committed stays in the
        prefix cache unless ``reusable`` is False (a step failed: what they hold is unknown)."""
        if seq in self.running:
            self._leave(seq, reusable)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self._by_id.pop(seq.request_id, None)

    def stop_drafting(self, seq: Sequence) -> None:
        """Frees the draft slot of a sequence whose speculation failed (it decodes plainly from then
        on); what the slot holds is not offered to the prefix cache."""
        if seq.draft_slot is not None:
            self.draft_prefix.release(seq.draft_slot, None)
            seq.draft_slot = None

    def find(self, request_id: str) -> Optional[Sequence]:
        return self._by_id.get(request_id)
