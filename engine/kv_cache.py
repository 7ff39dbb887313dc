"""Slot-based key/value cache with tentative appends.

Every sequence owns one *slot*: a fixed row of ``max_len`` positions in preallocated buffers,
so memory is bounded by ``num_slots * max_len`` and known at start-up.  A slot holds

* ``lens[slot]`` committed entries (the context the next forward attends to in full), then
* ``pending[slot]`` entries appended by forwards since the last commit (a draft tree, level by
  level, or the tree being verified).  Pending entries are visible to later forwards only through
  the attention mask the caller supplies.

After a speculative step the caller keeps an arbitrary subset of the pending entries (the accepted
path), compacted in place right after the committed ones (:meth:`keep`), or drops them all
(:meth:`discard`).  Plain decoding is ``forward`` then ``commit``.
"""

from __future__ import annotations

import torch


class CacheFullError(RuntimeError):
    """A sequence needs more positions than its slot holds, or no slot is free."""


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
    ) -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"num_slots and max_len must be >= 1, got {num_slots}, {max_len}")
        self.num_slots = num_slots
        self.max_len = max_len
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, pos, kv_heads, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lens = torch.zeros(num_slots, dtype=torch.long)  # committed entries, host-side
        self.pending = torch.zeros(num_slots, dtype=torch.long)  # tentative entries after lens
        self._free = list(range(num_slots - 1, -1, -1))
        self.allocations = [0] * num_slots  # per slot, how often it was allocated (who may trust its contents)

    # ----------------------------------------------------------------- slots
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def free_slot_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self, slot: int | None = None) -> int:
        """A free slot (``slot`` if given: it must be free), empty."""
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} KV cache slots are in use")
        if slot is None:
            slot = self._free.pop()
        else:
            self._free.remove(slot)  # ValueError if it is not free
        self.allocations[slot] += 1
        self.lens[slot] = 0
        self.pending[slot] = 0
        return slot

    def restore(self, slot: int, length: int) -> None:
        """Declares the first ``length`` entries of a just-allocated slot committed: they still hold
        what the slot's previous sequence wrote there (``engine.prefix_cache``; freeing never clears)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"cannot restore {length} entries in a slot of {self.max_len}")
        self.lens[slot] = length
        self.pending[slot] = 0

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copies the first ``length`` committed entries of slot ``src`` into slot ``dst`` (every
        layer) and commits them there."""
        if not 0 <= length <= int(self.lens[src]):
            raise ValueError(f"slot {src} holds {int(self.lens[src])} committed entries, not {length}")
        self.k[:, dst, :length] = self.k[:, src, :length]
        self.v[:, dst, :length] = self.v[:, src, :length]
        self.restore(dst, length)

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} is already free")
        self.lens[slot] = 0
        self.pending[slot] = 0
        self._free.append(slot)

    def usage(self) -> float:
        """Fraction of all positions holding committed entries (a gauge for metrics)."""
        return float(self.lens.sum()) / (self.num_slots * self.max_len)

    # --------------------------------------------------------------- appends
    def check_room(self, slots: list[int], block_len: int) -> None:
        for s in slots:
            need = int(self.lens[s] + self.pending[s]) + block_len
            if need > self.max_len:
                raise CacheFullError(
                    f"sequence in slot {s} needs {need} positions but the KV cache holds {self.max_len} "
                    f"per sequence (raise --max-model-len or shorten the request)"
                )

    def write(self, layer: int, slots: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores a block's keys/values at ``lens + pending`` of each slot.

        slots: [batch]; offsets: [batch, block] absolute positions; k, v: [batch, block, kv_heads, head_dim]
        """
        self.k[layer][slots[:, None], offsets] = k
        self.v[layer][slots[:, None], offsets] = v

    def advance(self, slots: list[int], counts: list[int]) -> None:
        """Marks ``counts`` more entries of each slot as pending (after a forward wrote them)."""
        for s, n in zip(slots, counts):
            self.pending[s] += n

    # ------------------------------------------------------ commit / rollback
    def commit(self, slot: int) -> None:
        """Keeps every pending entry."""
        self.lens[slot] += self.pending[slot]
        self.pending[slot] = 0

    def discard(self, slot: int) -> None:
        """Rolls back every pending entry."""
        self.pending[slot] = 0

    def keep(self, slot: int, keep_idx: list[int] | torch.Tensor) -> None:
        """Keeps the pending entries ``keep_idx`` (indices relative to the first pending entry,
        ascending), moved to sit right after the committed context; drops the rest."""
        idx = torch.as_tensor(keep_idx, dtype=torch.long)
        n = idx.numel()
        base = int(self.lens[slot])
        if n and (int(idx.max()) >= int(self.pending[slot]) or int(idx.min()) < 0):
            raise IndexError(f"keep indices {idx.tolist()} out of range of {int(self.pending[slot])} pending entries")
        if n and not torch.equal(idx, torch.arange(n)):
            src = (idx + base).to(self.k.device)
            # Gather first (copy), then scatter: source and destination ranges may overlap.
            self.k[:, slot, base:base + n] = self.k[:, slot, src]
            self.v[:, slot, base:base + n] = self.v[:, slot, src]
        self.lens[slot] = base + n
        self.pending[slot] = 0

    def truncate(self, slot: int, length: int) -> None:
        """Rolls committed entries back to ``length`` (drops pending ones too)."""
        if not 0 <= length <= int(self.lens[slot]):
            raise ValueError(f"cannot truncate slot {slot} of length {int(self.lens[slot])} to {length}")
        self.lens[slot] = length
        self.pending[slot] = 0
