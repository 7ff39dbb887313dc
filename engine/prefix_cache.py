"""Prefix reuse over the slot cache: a new request starts from the longest cached prefix of its prompt.

Streaming chat clients resend the whole conversation every turn, and agents resend the same system
prompt every call.  A finished sequence's slot still holds the keys and values of everything it
committed (its prompt and its answer); :class:`PrefixCache` remembers which tokens those are and,
when a request is admitted, hands it the free slot whose contents share the longest prefix with its
prompt, so that only the rest is prefilled.  When the longest shared prefix sits in a slot that is
still running (eight agents arriving together with one system prompt), it is copied into the new
slot instead: one tensor copy per cache instead of a prefill.  Free slots are reused least recently
released first, so the cache evicts LRU.

Lossless: in batch-invariant mode (``EngineConfig.batch_invariant``, the default) a key or value
row is bitwise the same whether it was computed in a prefill chunk, a decoding step or a verified
tree, so reused entries are exactly what a prefill would write and the output is token-identical with
the cache on and off.  At most ``len(prompt) - 1`` tokens are reused: the last prompt token is the
first step's root, never cached.

One instance per :class:`KVCache` (target and draft); the slot is the unit.  A paged cache would
share blocks instead of copying them; the interface (``acquire`` / ``release``) stays.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional

from engine.kv_cache import KVCache


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on C-speed slice comparisons
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Acquired:
    slot: int
    cached: int  # leading prompt tokens whose entries the slot already holds
    copied: bool  # they were copied from a running sequence's slot


class PrefixCache:
    """Which tokens each free slot of ``cache`` still holds, and who gets which slot.

    Only prefixes of at least ``min_match`` tokens are reused, and candidates are found through an
    index on their first ``min_match`` tokens, so admitting a request costs the same whatever the
    number of slots (the exact-law tests run batches of thousands)."""

    def __init__(self, cache: KVCache, enabled: bool = True, min_match: int = 16) -> None:
        self.cache = cache
        self.enabled = enabled
        self.min_match = max(1, min_match)
        self._held: dict[int, list[int]] = {}  # free slot -> the tokens its committed entries are for
        self._stamp: dict[int, int] = {}  # free slot -> its allocation count at release (a later
        # allocation by anyone else, e.g. a cost measurement, invalidates what it held)
        self._lru: OrderedDict[int, None] = OrderedDict()  # held slots, least recently released first
        self._index: dict[tuple[int, ...], set[int]] = {}  # key(tokens) -> held slots

    def key(self, tokens: list[int]) -> Optional[tuple[int, ...]]:
        """The index key of a token sequence (its first ``min_match`` tokens), None if shorter."""
        return tuple(tokens[:self.min_match]) if len(tokens) >= self.min_match else None

    def prompt_key(self, prompt: list[int]) -> Optional[tuple[int, ...]]:
        """The key a prompt is looked up by: that of all but its last token (never cached)."""
        return self.key(prompt[:len(prompt) - 1])

    @property
    def held_tokens(self) -> int:
        """Tokens held by free slots (reusable, evictable)."""
        return sum(len(t) for t in self._held.values())

    def acquire(self, prompt: list[int], live: Iterable[tuple[int, list[int]]] = ()) -> Acquired:
        """A slot for a new sequence with ``prompt``, holding the longest reusable prefix of it.

        ``live``: ``(slot, committed tokens)`` of running sequences to copy from (those sharing the
        prompt's key: see :meth:`key`).  Raises :class:`engine.kv_cache.CacheFullError` if no slot
        is free."""
        limit = len(prompt) - 1
        key = self.prompt_key(prompt) if self.enabled else None
        best_slot, best = None, 0
        for slot in list(self._index.get(key, ())) if key is not None else ():
            if self._stamp[slot] != self.cache.allocations[slot]:
                self._forget(slot)  # allocated behind our back since it was released
                continue
            n = min(common_prefix(prompt, self._held[slot]), limit)
            if n > best:
                best_slot, best = slot, n
        source, copy_n = None, 0
        if key is not None and limit > best:
            for slot, tokens in live:
                n = min(common_prefix(prompt, tokens), limit, int(self.cache.lens[slot]))
                if n > max(best, copy_n):
                    source, copy_n = slot, n
        if best_slot is None or copy_n > best:
            best_slot, best = self._coldest(), 0
        slot = self.cache.allocate(best_slot)
        self._forget(slot)
        if source is not None and copy_n > best:
            self.cache.copy_prefix(source, slot, copy_n)
            return Acquired(slot, copy_n, True)
        self.cache.restore(slot, best)
        return Acquired(slot, best, False)

    def release(self, slot: int, tokens: Optional[list[int]]) -> None:
        """Frees ``slot``; ``tokens`` are those its committed entries hold, in order (None: unknown,
        e.g. after a failed step; the slot is then reused only as empty)."""
        self.cache.free(slot)
        key = self.key(tokens) if self.enabled and tokens else None
        if key is not None:
            self._held[slot] = list(tokens)
            self._stamp[slot] = self.cache.allocations[slot]
            self._lru[slot] = None
            self._index.setdefault(key, set()).add(slot)

    def clear(self) -> None:
        for slot in list(self._held):
            self._forget(slot)

    def _coldest(self) -> Optional[int]:
        """The free slot to overwrite: one holding nothing (the oldest free first), else the least
        recently released; None when no slot is free."""
        for slot in self.cache.free_slot_ids():  # the free list's oldest entries first
            if slot not in self._held:
                return slot
        for slot in list(self._lru):  # every free slot holds something: evict the least recently released
            if self._stamp[slot] == self.cache.allocations[slot]:
                return slot
            self._forget(slot)  # allocated behind our back (and maybe still in use): not ours to give
        return None

    def _forget(self, slot: int) -> None:
        tokens = self._held.pop(slot, None)
        if tokens is None:
            return
        del self._stamp[slot], self._lru[slot]
        members = self._index[self.key(tokens)]
        members.discard(slot)
        if not members:
            del self._index[self.key(tokens)]
