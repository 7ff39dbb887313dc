"""Prefix caching over the paged cache: a new request starts from the longest cached prefix of its prompt.

Streaming chat clients resend the whole conversation every turn, and agents resend the same system
prompt every call.  Every full block of committed entries is *published* under a key that names the
exact tokens it and every block before it hold (a chained BLAKE2b digest); a new request walks its
prompt block by block, shares each published block it finds (no copy: one more reference) and
prefills only the rest.  Blocks are published as sequences commit them, so a request also shares
what a running sequence has cached (eight agents with one system prompt), and they outlive their
sequence until the pool needs the space (least recently freed first, ``engine.kv_cache``).

Lossless: in batch-invariant mode (``EngineConfig.batch_invariant``, the default) a key or value
row is bitwise the same whether it was computed in a prefill chunk, a decoding step or a verified
tree, so shared entries are exactly what a prefill would write and the output is token-identical with
the cache on and off.  At most ``len(prompt) - 1`` tokens are reused, in whole blocks: the last
prompt token is the first step's root, never cached.

One instance per :class:`KVCache` (target and draft).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Optional

from engine.kv_cache import KVCache

ROOT = b"mcsd-prefix"  # the key chain's seed


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


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a block holding ``tokens`` after the blocks whose key is ``parent``: a 128-bit
    BLAKE2b digest of both, so equal keys mean equal prefixes (a collision is as likely as a
    random 128-bit match)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass
class Acquired:
    slot: int
    cached: int  # leading prompt tokens whose entries the slot shares from the cache


class PrefixCache:
    """Which blocks of ``cache`` hold which prefixes; who shares what."""

    def __init__(self, cache: KVCache, enabled: bool = True) -> None:
        self.cache = cache
        self.enabled = enabled
        self.block_size = cache.block_size
        self._published: dict[int, tuple[int, bytes]] = {}  # slot -> (its blocks published, key of the last)

    def acquire(self, prompt: list[int]) -> Acquired:
        """A slot for a new sequence with ``prompt``, sharing the longest cached prefix of it in whole
        blocks.  Raises :class:`engine.kv_cache.CacheFullError` if no slot is free."""
        slot = self.cache.allocate()
        blocks, key = self._walk(prompt)
        self.cache.share(slot, blocks)
        self._published[slot] = (len(blocks), key)
        return Acquired(slot, len(blocks) * self.block_size)

    def cached_prefix(self, prompt: list[int]) -> int:
        """Leading tokens of ``prompt`` that :meth:`acquire` would share now (a probe: nothing changes)."""
        return len(self._walk(prompt)[0]) * self.block_size

    def _walk(self, prompt: list[int]) -> tuple[list[int], bytes]:
        """The published blocks holding the prompt's leading whole blocks (never its last token), and
        the key of the last one found."""
        blocks, key, bs = [], ROOT, self.block_size
        if self.enabled:
            for i in range((len(prompt) - 1) // bs):
                nxt = block_key(key, prompt[i * bs:(i + 1) * bs])
                block = self.cache.lookup(nxt)
                if block is None:
                    break
                blocks.append(block)
                key = nxt
        return blocks, key

    def publish(self, slot: int, tokens: list[int], count: Optional[int] = None) -> None:
        """Publishes the slot's full committed blocks not yet published; ``tokens[:count]`` are those
        its committed entries hold, in order (cache position i holds token i)."""
        if not self.enabled:
            return
        done, key = self._published[slot]
        bs = self.block_size
        n = len(tokens) if count is None else min(count, len(tokens))
        if n // bs <= done:  # the common case on every step: no new full block (and no cache read)
            return
        full = min(n, int(self.cache.lens_np[slot])) // bs
        for i in range(done, full):
            key = block_key(key, tokens[i * bs:(i + 1) * bs])
            self.cache.publish(slot, i, key)  # False when another block holds it already: this one stays private
        self._published[slot] = (full, key)

    def release(self, slot: int, tokens: Optional[list[int]]) -> None:
        """Frees ``slot`` after publishing what it holds (``tokens``; None: unknown, e.g. after a
        failed step: only what was published before stays)."""
        if tokens:
            self.publish(slot, tokens)
        del self._published[slot]
        self.cache.free(slot)
