"""Packs per-sequence blocks of different lengths into one model forward (padded to a rectangle on the
host; the model runs only the real rows, ``engine.models.llama.Packing``)."""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from engine.device import to_device
from engine.kv_cache import KVCache
from engine.models.model import ForwardOutput, Model
from engine.models.vocab import OutputVocab


@dataclass
class Block:
    """New tokens of one sequence for one forward.

    ``mask`` ([n, pending + n] bool) says which of the slot's pending entries and block tokens each
    block token sees (committed context is always visible); ``None`` is causal attention.
    ``logit_rows`` are the block indices whose logits are needed.  ``device_mask``: such a mask already
    on the model's device (the host has not read it), in place of ``mask``.
    """

    slot: int
    tokens: list[int]
    positions: list[int]
    logit_rows: list[int]
    mask: Optional[torch.Tensor] = None
    device_mask: Optional[torch.Tensor] = None


def block_ids(blocks: list[Block]) -> torch.Tensor:
    """The blocks' token ids [blocks, longest block] on the host, padded with 0."""
    t = max(len(bl.tokens) for bl in blocks)
    return torch.tensor([[*bl.tokens, *[0] * (t - len(bl.tokens))] for bl in blocks], dtype=torch.long)


def run_blocks(model: Model, cache: KVCache, blocks: list[Block], vocab: Optional[OutputVocab] = None,
               ids: Optional[torch.Tensor] = None,
               shift: Optional[torch.Tensor] = None) -> tuple[ForwardOutput, "BlockLogits"]:
    """One forward over all blocks; returns the raw output and each block's logits [rows, vocab]
    (``vocab``: a restricted output layer, -inf logits outside it).  ``ids``: the blocks' token ids
    already on the device ([blocks, longest block], padded), which the host has not read: the blocks'
    own ``tokens`` then only give their lengths.  ``shift``: [blocks] on the device, added there to
    each block's ``positions`` (a block whose place only the device knows)."""
    b = len(blocks)
    t = max(len(bl.tokens) for bl in blocks)
    k = max(max(len(bl.logit_rows) for bl in blocks), 1)
    # the rectangles are built as Python lists and made tensors once: a few torch calls per forward,
    # not a few per block (the host's time per step matters most when the device is fast)
    pos = torch.tensor([[*bl.positions, *[bl.positions[-1]] * (t - len(bl.positions))] for bl in blocks],
                       dtype=torch.long)
    every = list(range(t))
    if all(bl.logit_rows == every for bl in blocks):  # every row of full blocks (a level of trees of one
        rows = None  # shape, their verification): the output layer runs on the hidden states as they are
    else:
        rows = torch.tensor([[*bl.logit_rows, *[0] * (k - len(bl.logit_rows))] for bl in blocks], dtype=torch.long)
    mask = None
    if any(bl.mask is not None or bl.device_mask is not None for bl in blocks):
        pending = [int(cache.pending_np[bl.slot]) for bl in blocks]
        width = max(p + t for p in pending)
        # numpy: a write a distinct mask (a step's trees of one shape share their level's), not a few
        # tensor ops a block
        mask_np = np.zeros((b, t, width), dtype=bool)
        shared: dict[int, tuple[torch.Tensor, list[int]]] = {}  # a mask object -> the blocks that have it
        for i, bl in enumerate(blocks):
            n = len(bl.tokens)
            if bl.mask is None and bl.device_mask is None:  # causal over pending + block
                mask_np[i, :n, : pending[i]] = True
                mask_np[i, :n, pending[i]: pending[i] + n] = np.tri(n, dtype=bool)
            elif bl.mask is not None:
                shared.setdefault(id(bl.mask), (bl.mask, []))[1].append(i)
        for m, at in shared.values():
            m = m.numpy()
            which = slice(at[0], at[-1] + 1) if at[-1] - at[0] == len(at) - 1 else at
            mask_np[which, : m.shape[0], : m.shape[1]] = m
        mask = torch.from_numpy(mask_np)
        if any(bl.device_mask is not None for bl in blocks):  # the rest joins them on the device
            mask = to_device(mask, model.device)
            for i, bl in enumerate(blocks):
                if bl.device_mask is not None:
                    mask[i, : len(bl.tokens), : bl.device_mask.shape[1]] = bl.device_mask
    ids = to_device(block_ids(blocks), model.device) if ids is None else ids
    out = model(ids, pos, cache, [bl.slot for bl in blocks], block_mask=mask,
                num_new=[len(bl.tokens) for bl in blocks], logits_rows=rows,
                num_logits=[len(bl.logit_rows) for bl in blocks], vocab=vocab, position_shift=shift)
    return out, BlockLogits(out.logits, [len(bl.logit_rows) for bl in blocks])


class BlockLogits(Sequence_):
    """Each block's logits, ``[its logit rows, vocab]``: views of the forward's ``[blocks, rows,
    vocab]``, made when asked (the target's forwards ask for none), or a level's rows at once
    (:meth:`rows`)."""

    def __init__(self, logits: torch.Tensor, counts: list[int]) -> None:
        self.logits = logits
        self.counts = counts

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self.counts)))]
        return self.logits[i, : self.counts[i]]

    def rows(self, blocks: Optional[list[int]] = None) -> torch.Tensor:
        """The logit rows of ``blocks`` (default: all), block after block, ``[rows, vocab]``: a view of
        the forward's when they are all its blocks, in order, each with the same number of rows (a
        level of trees of one shape; a catch-up's roots), else one concatenation."""
        every = blocks is None or blocks == list(range(len(self.counts)))
        _, k, vocab = self.logits.shape
        if every and all(n == k for n in self.counts):
            return self.logits.reshape(-1, vocab)
        parts = [self[j] for j in (range(len(self.counts)) if blocks is None else blocks)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
