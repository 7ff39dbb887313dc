"""Token histories of tree rows, for penalties that depend on what was generated so far.

The distribution at block row ``r`` continues the sequence's output plus the drafted path down to
``r``'s node, so its penalty counts are the sequence's output counts plus that path's tokens.
Built only for requests that use penalties.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.sequence import Sequence


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
    def for_rows(cls, seq: Sequence, tokens: list[int], parent: list[int], rows: list[int]) -> "RowHistory":
        """``parent[i]``: node ``i``'s parent node (-1 = the root)."""
        base = seq.output_counts  # [vocab]
        counts = base.expand(len(rows), -1).clone()
        for j, row in enumerate(rows):
            toks = path_tokens(row, tokens, parent)
            if toks:
                counts[j].index_add_(0, torch.tensor(toks), torch.ones(len(toks), dtype=counts.dtype))
        mask = seq.prompt_mask.expand(len(rows), -1) if seq.prompt_mask is not None else None
        return cls(counts, mask)

    def tensors(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self.counts, self.prompt_mask
