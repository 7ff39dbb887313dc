"""Paged key/value cache with tentative appends and shared, content-addressed blocks.

Keys and values live in one *pool* of fixed-size blocks per model (``block_size`` positions each),
preallocated at start-up and sized in tokens, so memory is bounded and known, and grows per
sequence with the tokens it holds, not with ``max_len``.  A sequence owns a *slot*: a handle with a
*block table* (the pool blocks holding its positions ``0, 1, ...`` in order) and two counters:

* ``lens[slot]`` committed entries (the context the next forward attends to in full), then
* ``pending[slot]`` entries appended by forwards since the last commit (a draft tree, level by
  level, or the tree being verified).  Pending entries are visible to later forwards only through
  the attention mask the caller supplies.

After a speculative step the caller keeps an arbitrary subset of the pending entries (the accepted
path), compacted in place right after the committed ones (:meth:`keep`), or drops them all
(:meth:`discard`); blocks no longer covered are returned to the pool.  Plain decoding is
``forward`` then ``commit``.

Blocks are reference-counted.  A full committed block can be *published* under a key (the hash of
every token up to its end, ``engine.prefix_cache``); another sequence whose prompt starts with
the same tokens shares it instead of recomputing it.  Published blocks are never written again:
every write lands at or after ``lens``, which lies past every full committed block.  When its last
user frees it, a published block stays in the pool, still findable, until the pool needs the space:
then the least recently freed one is evicted (LRU).

Addressing: position ``p`` of a slot is pool row ``table[p // block_size] * block_size +
p % block_size``.  Block 0 is a scratch block never handed out: table entries past a slot's blocks
point to it, so padded rows of a batched forward write there and reads past a sequence's end (always
masked) see finite values.  On the CPU the attention reads the pool in place through those rows
(``cpu_kernels.paged_attention``); elsewhere a forward gathers each sequence's rows (SDPA over
gathered pages), and a batch of one whose blocks are consecutive in the pool reads a view instead.
"""

from __future__ import annotations

import heapq
import math
import mmap
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

from engine.device import to_device_many


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor for a pool.  On the CPU it lives in an anonymous memory mapping, whose pages
    the kernel zero-fills when they are first touched: allocating the pool costs neither time nor
    resident memory until sequences use it (``torch.zeros`` writes every byte of the pools at
    start-up, seconds for the default pair).  Elsewhere ``torch.zeros``."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # private: untouched pages read as the kernel's zero page (a shared mapping would fill them on a read),
    # and a forked process gets a copy-on-write pool, as with torch.zeros
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype).view(shape)  # kept alive


class CacheFullError(RuntimeError):
    """A sequence needs more positions than a sequence may hold, no slot is free, or the pool is out of blocks."""


@dataclass
class Addresses:
    """Where one forward writes its block and what it reads, per sequence (see :meth:`KVCache.addresses`)."""

    write: torch.Tensor  # [batch, block] pool rows on the device
    read: torch.Tensor  # [batch, kv_len] pool rows on the device
    view_start: Optional[int] = None  # a batch of one over consecutive blocks: its pool row 0 (a slice)
    write_start: int = 0  # with the view: the slot position the block is written at


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        block_size: int = 4,
        num_blocks: Optional[int] = None,
    ) -> None:
        """``max_len``: the most positions one sequence may hold; ``num_blocks``: the pool (default:
        ``num_slots`` sequences of ``max_len``, so that the pool never runs dry)."""
        if num_slots < 1 or max_len < 1 or block_size < 1:
            raise ValueError(f"num_slots, max_len and block_size must be >= 1, got {num_slots}, {max_len}, {block_size}")
        self.num_slots = num_slots
        self.max_len = max_len
        self.block_size = block_size
        self.max_blocks = self.blocks_for(max_len)  # per sequence
        self.num_blocks = num_slots * self.max_blocks if num_blocks is None else num_blocks
        if self.num_blocks < self.max_blocks:
            raise ValueError(f"a pool of {self.num_blocks} blocks of {block_size} ({self.num_blocks * block_size} "
                             f"tokens) cannot hold one sequence of {max_len} positions")
        rows = (self.num_blocks + 1) * block_size  # + the scratch block 0
        shape = (num_layers, rows, num_kv_heads, head_dim)  # [layers, pool rows, kv_heads, head_dim]
        self.k, self.v = zeroed_pool(shape, dtype, device), zeroed_pool(shape, dtype, device)
        self.lens = torch.zeros(num_slots, dtype=torch.long)  # committed entries, host-side
        self.pending = torch.zeros(num_slots, dtype=torch.long)  # tentative entries after lens
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]  # per slot, its blocks in order
        self.table = torch.zeros(num_slots, self.max_blocks, dtype=torch.long)  # host mirror, 0 = scratch
        # numpy views of the same memory, for the bookkeeping's one-element reads and writes and the
        # forwards' host inputs (a tensor element costs a dispatch; a step makes a few a sequence)
        self.lens_np, self.pending_np, self.table_np = self.lens.numpy(), self.pending.numpy(), self.table.numpy()
        self._consecutive = [True] * num_slots  # each slot's blocks are b, b + 1, ... (read as a view)
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.ref = [0] * (self.num_blocks + 1)  # users of each block
        self._free = set(range(1, self.num_blocks + 1))  # unused, holding nothing anyone may look up
        self._free_heap = list(range(1, self.num_blocks + 1))  # lowest first (lazy: entries may be stale)
        self._cached: OrderedDict[int, None] = OrderedDict()  # unused but published: least recently freed first
        self._key_of: dict[int, bytes] = {}  # published block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> published block
        self.evictions = 0  # published blocks overwritten to make room
        self.captured = None  # engine.graphs.CapturedForwards: this cache's forwards at fixed shapes, if any

    # ----------------------------------------------------------------- slots
    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def allocate(self) -> int:
        """A free slot, empty."""
        if not self._free_slots:
            raise CacheFullError(f"all {self.num_slots} KV cache slots are in use")
        slot = self._free_slots.pop()
        self.lens_np[slot] = 0
        self.pending_np[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Returns the slot and its blocks (published ones stay findable until evicted)."""
        if slot in self._free_slots:
            raise ValueError(f"slot {slot} is already free")
        self._trim(slot, 0)
        self.lens_np[slot] = 0
        self.pending_np[slot] = 0
        self._free_slots.append(slot)

    # ---------------------------------------------------------------- blocks
    @property
    def free_blocks(self) -> int:
        """Blocks a sequence could take now: unused ones, and published ones nobody uses (evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Published blocks nobody uses: kept for a later prefix hit until the space is needed."""
        return len(self._cached)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def blocks_needed(self, slot: Optional[int], positions: int) -> int:
        """More blocks ``slot`` (None: a new sequence) needs to hold ``positions`` entries."""
        have = len(self.tables[slot]) if slot is not None else 0
        return max(0, self.blocks_for(positions) - have)

    def usage(self) -> float:
        """Fraction of the pool's blocks in use by sequences (a gauge for metrics)."""
        return self.used_blocks / self.num_blocks

    def lookup(self, key: bytes) -> Optional[int]:
        """The published block under ``key``, if any."""
        return self._block_of.get(key)

    def publish(self, slot: int, index: int, key: bytes) -> bool:
        """Makes the slot's ``index``-th block, full and committed, findable under ``key``.  False if
        another block already holds that key (this one stays private) or this one has a key."""
        block = self.tables[slot][index]
        if (index + 1) * self.block_size > int(self.lens_np[slot]):
            raise ValueError(f"block {index} of slot {slot} is not full of committed entries")
        if key in self._block_of or block in self._key_of:
            return False
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def share(self, slot: int, blocks: list[int]) -> None:
        """Makes published ``blocks`` the committed prefix of an empty slot (one more user each)."""
        if self.tables[slot] or int(self.lens_np[slot]) or int(self.pending_np[slot]):
            raise ValueError(f"slot {slot} is not empty")
        for b in blocks:
            if b not in self._key_of:
                raise ValueError(f"block {b} is not published")
            self._take(b)
            self._append(slot, b)
        self.lens_np[slot] = len(blocks) * self.block_size

    def _take(self, block: int) -> None:
        if self.ref[block] == 0:
            self._cached.pop(block, None)
            self._free.discard(block)
        self.ref[block] += 1

    def _drop(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if block in self._key_of:
                self._cached[block] = None  # most recently freed: evicted last
            else:
                self._free.add(block)
                heapq.heappush(self._free_heap, block)
                if len(self._free_heap) > 2 * self.num_blocks:  # stale entries of blocks taken as 'after + 1'
                    self._free_heap = sorted(self._free)

    def _new_block(self, after: Optional[int]) -> int:
        """An unused block (the one right after ``after`` when free: consecutive blocks read as a
        view), else the least recently freed published one, evicted."""
        if after is not None and after + 1 in self._free:
            block = after + 1
        elif self._free:
            block = heapq.heappop(self._free_heap)
            while block not in self._free:
                block = heapq.heappop(self._free_heap)
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.evictions += 1
        else:
            raise CacheFullError(f"the KV cache pool is full ({self.num_blocks} blocks of {self.block_size})")
        self._take(block)
        return block

    def _append(self, slot: int, block: int) -> None:
        table = self.tables[slot]
        self.table_np[slot, len(table)] = block
        self._consecutive[slot] = not table or (self._consecutive[slot] and block == table[-1] + 1)
        table.append(block)

    def _trim(self, slot: int, positions: int) -> None:
        """Returns the blocks past the first ``positions`` entries (last first: LRU evicts tails first)."""
        table, keep = self.tables[slot], self.blocks_for(positions)
        if len(table) <= keep:
            return  # nothing to return (the host mirror is zero past the slot's blocks already)
        while len(table) > keep:
            self._drop(table.pop())
        self.table_np[slot, keep:] = 0
        if not self._consecutive[slot]:
            self._consecutive[slot] = all(b == a + 1 for a, b in zip(table, table[1:]))

    # --------------------------------------------------------------- appends
    def reserve(self, slots: list[int], counts: list[int]) -> None:
        """Blocks for ``counts`` more entries after each slot's ``lens + pending``."""
        for s, n in zip(slots, counts):
            need = int(self.lens_np[s] + self.pending_np[s]) + n
            if need > self.max_len:
                raise CacheFullError(
                    f"sequence in slot {s} needs {need} positions but the KV cache holds {self.max_len} "
                    f"per sequence (raise --max-model-len or shorten the request)")
            table = self.tables[s]
            while len(table) * self.block_size < need:
                self._append(s, self._new_block(table[-1] if table else None))

    def addresses(self, slots: list[int], start: torch.Tensor, block: int, kv_len: int,
                  device: torch.device, start_on_device: Optional[torch.Tensor] = None) -> Addresses:
        """Pool rows of a forward writing ``block`` entries at ``start`` ([batch], host) of each slot and
        reading ``kv_len`` entries per slot.  Only the block tables ([batch, blocks], small) cross to the
        device, and ``start`` unless the caller has it there already (``start_on_device``); the rows are
        computed there."""
        bs = self.block_size
        if len(slots) == 1:
            table = self.tables[slots[0]]
            if table and self._consecutive[slots[0]] and len(table) * bs >= kv_len:  # consecutive: a view
                read = torch.arange(table[0] * bs, table[0] * bs + kv_len, device=device)[None]
                s0 = int(start[0])
                return Addresses(read[:, s0:s0 + block], read, table[0] * bs, s0)
        nb = self.blocks_for(kv_len)
        tables = torch.zeros(len(slots), nb, dtype=torch.long)
        width = min(nb, self.max_blocks)
        tables[:, :width] = self.table[torch.tensor(slots, dtype=torch.long), :width]
        pos = torch.arange(kv_len, device=device)
        tables, start = to_device_many([tables, start if start_on_device is None else start_on_device], device)
        read = tables[:, pos // bs] * bs + pos % bs  # [batch, kv_len]
        offsets = start[:, None] + torch.arange(block, device=device)
        return Addresses(read.gather(1, offsets), read)

    def advance(self, slots: list[int], counts: list[int]) -> None:
        """Marks ``counts`` more entries of each slot as pending (after a forward wrote them)."""
        for s, n in zip(slots, counts):
            self.pending_np[s] += n

    # ------------------------------------------------------ commit / rollback
    def commit(self, slot: int) -> None:
        """Keeps every pending entry."""
        self.lens_np[slot] += self.pending_np[slot]
        self.pending_np[slot] = 0

    def discard(self, slot: int) -> None:
        """Rolls back every pending entry."""
        self.pending_np[slot] = 0
        self._trim(slot, int(self.lens_np[slot]))

    def rewind(self, slot: int, length: int) -> None:
        """Rolls back every pending entry and the committed ones past ``length`` (a step that failed
        after committing some: its work is redone).  Entries below ``length`` are untouched, so blocks
        shared through the prefix cache, which a step never writes, stay as they are."""
        self.lens_np[slot] = min(int(self.lens_np[slot]), length)
        self.discard(slot)

    def keep(self, slot: int, keep_idx: list[int] | torch.Tensor) -> None:
        """Keeps the pending entries ``keep_idx`` (indices relative to the first pending entry,
        ascending), moved to sit right after the committed context; drops the rest."""
        (error,) = self.keep_many([(slot, keep_idx)])
        if error is not None:
            raise error

    def keep_many(self, keeps: list[tuple[int, list[int] | torch.Tensor]]) -> list[Optional[Exception]]:
        """:meth:`keep` for several slots (``(slot, keep_idx)`` each, distinct slots): every entry that
        moves, of every slot, in one copy of row indices to the device and one gather and one scatter
        a pool, not a few per sequence.  A slot whose indices are out of range is left as it was; its
        error is returned in its place (None where the slot kept its entries)."""
        errors: list[Optional[Exception]] = []
        src: list[int] = []
        dst: list[int] = []
        for slot, keep_idx in keeps:
            try:
                moves = self._keep_bookkeeping(slot, keep_idx)
            except IndexError as exc:
                errors.append(exc)
                continue
            errors.append(None)
            if moves is not None:
                src += moves[0]
                dst += moves[1]
        if src:
            src_t, dst_t = to_device_many([torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)],
                                          self.k.device)
            # Gather first (copy), then scatter: source and destination ranges may overlap within a
            # slot (different slots hold different blocks).
            self.k[:, dst_t] = self.k[:, src_t]
            self.v[:, dst_t] = self.v[:, src_t]
        return errors

    def _keep_bookkeeping(self, slot: int, keep_idx: list[int] | torch.Tensor) -> Optional[tuple[list[int], list[int]]]:
        """Checks ``keep_idx`` and makes the slot's kept entries committed (host state only); returns the
        pool rows to move (source, destination), or None when the kept entries are the first ones
        (nothing moves).  Raises IndexError, changing nothing, for indices out of range.  Plain Python
        on the slot's block list: a few entries a sequence, each a tensor op's dispatch otherwise."""
        base, pending = int(self.lens_np[slot]), int(self.pending_np[slot])
        idx = keep_idx.tolist() if isinstance(keep_idx, torch.Tensor) else [int(i) for i in keep_idx]
        n = len(idx)
        if n and (max(idx) >= pending or min(idx) < 0):
            raise IndexError(f"keep indices {idx} out of range of {pending} pending entries")
        moves = None
        if idx != list(range(n)):  # rows computed before _trim returns blocks
            table, bs = self.tables[slot], self.block_size
            moves = ([table[p // bs] * bs + p % bs for p in (base + i for i in idx)],
                     [table[p // bs] * bs + p % bs for p in range(base, base + n)])
        self.lens_np[slot] = base + n
        self.pending_np[slot] = 0
        self._trim(slot, base + n)
        return moves

    def _rows(self, slot: int, positions: torch.Tensor) -> torch.Tensor:
        """Pool rows of a slot's positions (host)."""
        return self.table[slot, positions // self.block_size] * self.block_size + positions % self.block_size
