"""Token histories of tree rows, for penalties that depend on what was generated so far.

The distribution at block row ``r`` continues the sequence's output plus the drafted path down to
``r``'s node, so its penalty counts are the sequence's output counts plus that path's tokens.
Built only for requests that use penalties.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.device import to_device
from engine.speculative.view import SeqView


def path_tokens(row: int, tokens: list[int], parent: list[int]) -> list[int]:
    """Tokens of the nodes from the root's first child down to block row ``row``'s node."""
    out, node = [], row - 1
    while node >= 0:
        if tokens[node] >= 0:
            out.append(tokens[node])
        node = parent[node]
    return out[::-1]


@dataclass
class RowHistory:
    counts: torch.Tensor  # [rows, vocab] int32 generated-token counts
    prompt_mask: Optional[torch.Tensor]  # [rows, vocab] bool, or None

    @classmethod
    def for_rows(cls, seq: SeqView, tokens: list[int], parent: list[int], rows: list[int]) -> "RowHistory":
        """``parent[i]``: node ``i``'s parent node (-1 = the root)."""
        base = seq.output_counts  # [vocab]
        counts = base.expand(len(rows), -1).clone()
        at, toks = [], []
        for j, row in enumerate(rows):
            path = path_tokens(row, tokens, parent)
            at += [j] * len(path)
            toks += path
        if toks:
            _count(counts, at, toks)
        mask = seq.prompt_mask.expand(len(rows), -1) if seq.prompt_mask is not None else None
        return cls(counts, mask)

    def tensors(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self.counts, self.prompt_mask


def batch_histories(seqs: list[SeqView], trees: list, rows: int, vocab_size: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Penalty inputs for ``rows`` block rows of every sequence's tree (``trees[b]``: a
    ``DraftTree``), flattened ``b * rows + r``: generated-token counts [B * rows, vocab] int32 and
    the prompt mask [B * rows, vocab] bool.  Sequences without penalties get zeros (their penalty
    parameters are neutral, so the rows are unchanged)."""
    b = len(seqs)
    base = torch.stack([s.output_counts if s.output_counts is not None
                        else torch.zeros(vocab_size, dtype=torch.int32, device=device) for s in seqs])
    counts = base[:, None, :].expand(b, rows, vocab_size).reshape(b * rows, vocab_size).clone()
    at, toks = [], []
    for i, (seq, tree) in enumerate(zip(seqs, trees)):
        if seq.output_counts is None:
            continue
        parents = tree.parents()
        for row in range(1 + tree.num_nodes):
            path = path_tokens(row, tree.tokens, parents)
            at += [i * rows + row] * len(path)
            toks += path
    if toks:
        _count(counts, at, toks)
    masks = torch.stack([s.prompt_mask if s.prompt_mask is not None
                         else torch.zeros(vocab_size, dtype=torch.bool, device=device) for s in seqs])
    return counts, masks[:, None, :].expand(b, rows, vocab_size).reshape(b * rows, vocab_size)


def _count(counts: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """``counts[rows[i], tokens[i]] += 1`` for every ``i``, indices moved to the counts' device once."""
    index = to_device(torch.tensor([rows, tokens], dtype=torch.long), counts.device)
    counts.index_put_((index[0], index[1]), torch.ones(len(tokens), dtype=counts.dtype, device=counts.device),
                      accumulate=True)
