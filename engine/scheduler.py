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
from engine.speculative.methods import NEEDS_DRAFT


@dataclass
class SchedulerOutput:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, cache tokens up to)
    decode: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, config: EngineConfig, cache: KVCache, draft_cache: Optional[KVCache]) -> None:
        self.config = config
        self.cache = cache
        self.draft_cache = draft_cache
        self.prefix = PrefixCache(cache, config.prefix_cache)
        self.draft_prefix = PrefixCache(draft_cache, config.prefix_cache) if draft_cache is not None else None
        self.queried_tokens = 0  # prompt tokens admitted, and of those found cached, since take_prefix_counts
        self.hit_tokens = 0
        self._sharing: dict[tuple[int, ...], list[Sequence]] = {}  # prefix key -> running sequences
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def schedule(self) -> SchedulerOutput:
        self._admit()
        out = SchedulerOutput()
        budget = self.config.prefill_chunk
        for seq in self.running:
            if seq.status is SeqStatus.PREFILLING and budget > 0:
                goal = seq.num_prompt - 1  # the last prompt token is the first step's root
                end = min(goal, seq.target_cached + budget)
                if end > seq.target_cached:
                    out.prefill.append((seq, end))
                    budget -= end - seq.target_cached
                if end == goal:
                    seq.status = SeqStatus.RUNNING
            if seq.status is SeqStatus.RUNNING:
                out.decode.append(seq)
        return out

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_batch and self.cache.free_slots:
            if self.draft_cache is not None and not self.draft_cache.free_slots:
                break
            key = self._prefix_key(self.waiting[0])
            peers = self._sharing.get(key, []) if key is not None else []
            if self.prefix.enabled and any(self._still_prefilling_for(p, self.waiting[0]) for p in peers):
                break  # it will copy what a running sequence is about to cache rather than prefill it too
            seq = self.waiting.popleft()
            got = self.prefix.acquire(seq.tokens, ((s.slot, s.tokens[:s.target_cached]) for s in peers))
            seq.slot, seq.target_cached = got.slot, got.cached
            seq.cached_prompt_tokens = got.cached
            self.queried_tokens += seq.num_prompt
            self.hit_tokens += got.cached
            if self.draft_prefix is not None and seq.request.spec.enabled and seq.request.spec.method in NEEDS_DRAFT:
                got = self.draft_prefix.acquire(seq.tokens, ((s.draft_slot, s.tokens[:s.draft_cached])
                                                             for s in peers if s.draft_slot is not None))
                seq.draft_slot, seq.draft_cached = got.slot, got.cached
            seq.status = SeqStatus.PREFILLING
            self.running.append(seq)
            if key is not None:
                peers.append(seq)
                self._sharing[key] = peers

    @staticmethod
    def _still_prefilling_for(peer: Sequence, seq: Sequence) -> bool:
        """Whether ``peer`` is still prefilling part of the prompt prefix it shares with ``seq``
        (requests arriving together with one system prompt: the first prefills it, the others wait
        a step or so and copy it)."""
        if peer.status is not SeqStatus.PREFILLING:
            return False
        shared = min(common_prefix(peer.tokens[:peer.num_prompt], seq.tokens), seq.num_prompt - 1)
        return peer.target_cached < shared

    def _prefix_key(self, seq: Sequence) -> Optional[tuple[int, ...]]:
        """The prefix cache's index key of the sequence's prompt, or None."""
        return self.prefix.prompt_key(seq.tokens[:seq.num_prompt])

    def take_prefix_counts(self) -> tuple[int, int]:
        """(prompt tokens admitted, of those found in the prefix cache) since the last call."""
        out = self.queried_tokens, self.hit_tokens
        self.queried_tokens = self.hit_tokens = 0
        return out

    @property
    def free_slots(self) -> int:
        """Sequences the next step could still admit to the running batch."""
        free = min(self.config.max_batch - len(self.running), self.cache.free_slots)
        if self.draft_cache is not None:
            free = min(free, self.draft_cache.free_slots)
        return max(free, 0)

    def finish(self, seq: Sequence, reusable: bool = True) -> None:
        """Frees the sequence's slots at once (finished or aborted).  Their committed entries stay
        in the prefix cache unless ``reusable`` is False (a step failed: what they hold is unknown)."""
        if seq in self.running:
            self.running.remove(seq)
            key = self._prefix_key(seq)
            if key is not None:
                self._sharing[key].remove(seq)
                if not self._sharing[key]:
                    del self._sharing[key]
        elif seq in self.waiting:
            self.waiting.remove(seq)
        # cache position i holds token i; a stop string may have cut tokens the cache committed
        if seq.slot is not None:
            self.prefix.release(seq.slot, seq.tokens[:seq.target_cached] if reusable else None)
            seq.slot = None
        if seq.draft_slot is not None and self.draft_prefix is not None:
            self.draft_prefix.release(seq.draft_slot, seq.tokens[:seq.draft_cached] if reusable else None)
            seq.draft_slot = None
        seq.status = SeqStatus.FINISHED
        self._by_id.pop(seq.request_id, None)

    def find(self, request_id: str) -> Optional[Sequence]:
        return self._by_id.get(request_id)
