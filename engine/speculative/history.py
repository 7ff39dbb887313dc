"""Token histories of tree rows, for penalties that depend on what was generated so far.

The distribution at block row ``r`` continues the sequence's output plus the drafted path down to
``r``'s node, so its penalty counts are the sequence's output counts plus that path's tokens.
Built only for requests that use penalties.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.device import to_device, to_device_many
from engine.speculative.view import SeqView


class PathCounts:
    """Penalty counts of tree rows: a row's count of token ``t`` is the sequence's output count plus
    the occurrences of ``t`` on the drafted path down to the row's node.

    A path's tokens come from the host when its tree has been read, or are gathered on the device
    from where the draft left them (``flat``, ``proposer.DeviceTokens``): then counting needs no read,
    so a batch with penalties still reads once a step.  ``add`` lists rows; ``into`` adds them up.
    """

    def __init__(self) -> None:
        self._host_at: list[int] = []
        self._host_tokens: list[int] = []
        self._device: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}  # id(flat) -> (flat, at, entries)

    def add(self, at: int, row: int, parent: list[int], tokens: list[int], flat: Optional[torch.Tensor] = None,
            offset: int = 0, size: int = 0) -> None:
        """Row ``at`` of the counts gets block row ``row``'s path: ``parent[i]`` is node ``i``'s parent
        (-1 = the root); node ``i``'s token is ``flat[offset + i]`` (device) for ``i < size``, else
        ``tokens[i]`` (host)."""
        node = row - 1
        if flat is not None:
            _, ats, entries = self._device.setdefault(id(flat), (flat, [], []))
        while node >= 0:
            if node < size:
                ats.append(at)
                entries.append(offset + node)
            elif tokens[node] >= 0:
                self._host_at.append(at)
                self._host_tokens.append(tokens[node])
            node = parent[node]

    def add_tree(self, at: int, rows: list[int], tree, flat: Optional[torch.Tensor] = None, offset: int = 0) -> None:
        """Rows ``rows`` of ``tree`` into counts rows ``at, at + 1, ...``: its drafted tokens from ``flat``
        (all its nodes, while the draft grows it), or from where a held tree's are (``tree.unread``), or
        from the host; the nodes the host appended from the host."""
        size = tree.num_nodes if flat is not None else 0
        if flat is None and tree.unread is not None:
            flat, offset, size = tree.unread.flat, tree.unread.offset_of(tree), tree.num_held
        parent = tree.parents()
        tokens = tree.tokens if flat is None else tree.known_tokens_after(0)
        for j, row in enumerate(rows):
            self.add(at + j, row, parent, tokens, flat, offset, size)

    def into(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` [rows, vocab] with every listed path added (in place)."""
        if self._host_tokens:
            _count(counts, self._host_at, self._host_tokens)
        for flat, ats, entries in self._device.values():
            at, entry = to_device_many([torch.tensor(ats, dtype=torch.long), torch.tensor(entries, dtype=torch.long)],
                                       counts.device)
            tok = flat.index_select(0, entry)  # DEAD (-1) where a node was not drawn: counts nothing
            counts.index_put_((at, tok.clamp(min=0)), (tok >= 0).to(counts.dtype), accumulate=True)
        return counts


def batch_histories(seqs: list[SeqView], trees: list, rows: int, vocab_size: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Penalty inputs for ``rows`` block rows of every sequence's tree (``trees[b]``: a
    ``DraftTree``), flattened ``b * rows + r``: generated-token counts [B * rows, vocab] int32 and
    the prompt mask [B * rows, vocab] bool.  Sequences without penalties get zeros (their penalty
    parameters are neutral, so the rows are unchanged).  Held trees are counted on the device."""
    b = len(seqs)
    base = torch.stack([s.output_counts if s.output_counts is not None
                        else torch.zeros(vocab_size, dtype=torch.int32, device=device) for s in seqs])
    counts = base[:, None, :].expand(b, rows, vocab_size).reshape(b * rows, vocab_size).clone()
    paths = PathCounts()
    for i, (seq, tree) in enumerate(zip(seqs, trees)):
        if seq.output_counts is not None:
            paths.add_tree(i * rows, list(range(1 + tree.num_nodes)), tree)
    paths.into(counts)
    masks = torch.stack([s.prompt_mask if s.prompt_mask is not None
                         else torch.zeros(vocab_size, dtype=torch.bool, device=device) for s in seqs])
    return counts, masks[:, None, :].expand(b, rows, vocab_size).reshape(b * rows, vocab_size)


def _count(counts: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """``counts[rows[i], tokens[i]] += 1`` for every ``i``, indices moved to the counts' device once."""
    index = to_device(torch.tensor([rows, tokens], dtype=torch.long), counts.device)
    counts.index_put_((index[0], index[1]), torch.ones(len(tokens), dtype=counts.dtype, device=counts.device),
                      accumulate=True)
