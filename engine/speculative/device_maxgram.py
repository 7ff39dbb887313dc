"""Max-Gram on the device: its proposal after a path whose tokens the host has not read.

Max-Gram's tail (``maxgram.MaxGramDrafter.extend_tree``) continues the draft model's deepest path.
On the host it needs that path's tokens, so a step whose tree is held on the device
(``draft_tree.HeldTokens``) would read the host once for them and again for verification.  Here the
same proposal is computed with tensor operations on the device, from the tokens where they are:

* every sequence's tokens are kept in a device table, one row a sequence, extended by what it
  gained since its last use (:class:`DeviceHistory`: one copy a call);
* the context's last ``max_ngram`` tokens (the sequence's, then the path's, gathered on the device)
  are compared with the tokens before every position at once, which gives the length of the suffix
  match ending there; the longest match, its occurrence by the host's order (in the prompt first,
  then the generated text, most recent first within each) and the continuation's length
  (``proposal_length``) follow with a few reductions;
* without a match, the bigram table (a successor per token, on the device) is chained.

The result is exactly what :meth:`MaxGramDrafter.propose` returns for the same context (``tests/
engine/speculative/test_device_maxgram.py`` compares them on random histories), padded with DEAD.
Nothing is read: a proposal that does not exist (a dead path, no match and no bigram) is DEAD
throughout, which verification skips as an absent node.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence as Seq

import numpy as np
import torch

from engine.device import to_device_many
from engine.speculative.draft_tree import DEAD, MAXGRAM, DraftTree, holders
from engine.speculative.view import SeqView

#: a context entry that does not exist (the sequence is shorter than the n-gram), and the history's padding
NO_TOKEN, NO_HISTORY = -2, -3


class DeviceHistory:
    """The tokens of sequences on one device: row ``row(seq)`` of :attr:`table` holds ``seq.tokens``
    (which only ever grow), brought up to date by :meth:`sync` with one copy for the whole batch.  A
    row is freed when its sequence is gone."""

    def __init__(self, device: torch.device, rows: int = 8, width: int = 1024) -> None:
        self.device = device
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self._row: "weakref.WeakKeyDictionary[SeqView, int]" = weakref.WeakKeyDictionary()
        self._synced = [0] * rows  # tokens of the row's sequence already in the table
        self._free = list(range(rows - 1, -1, -1))

    def sync(self, seqs: Seq[SeqView]) -> list[int]:
        """Each sequence's row, with its tokens up to date."""
        need = max(len(s.tokens) for s in seqs)
        if need > self.table.shape[1]:
            self._grow(width=1 << (need - 1).bit_length())
        rows = [self._row_of(s) for s in seqs]
        width = self.table.shape[1]
        where, values = [], []
        for s, r in zip(seqs, rows):
            done, n = self._synced[r], len(s.tokens)
            if n > done:
                where.append(np.arange(r * width + done, r * width + n))
                values.append(np.asarray(s.tokens[done:n], dtype=np.int32))
                self._synced[r] = n
        if where:
            at, vals = to_device_many([torch.from_numpy(np.concatenate(where)),
                                       torch.from_numpy(np.concatenate(values))], self.device)
            self.table.view(-1).index_copy_(0, at, vals)
        return rows

    def _row_of(self, seq: SeqView) -> int:
        row = self._row.get(seq)
        if row is None:
            if not self._free:
                self._grow(rows=2 * self.table.shape[0])
            row = self._free.pop()
            self._synced[row] = 0
            self._row[seq] = row
            weakref.finalize(seq, self._free.append, row)
        return row

    def _grow(self, rows: Optional[int] = None, width: Optional[int] = None) -> None:
        old = self.table
        rows, width = rows or old.shape[0], width or old.shape[1]
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        self.table[: old.shape[0], : old.shape[1]] = old
        self._free = list(range(rows - 1, old.shape[0] - 1, -1)) + self._free
        self._synced += [0] * (rows - len(self._synced))


class DeviceMaxGram:
    """:meth:`MaxGramDrafter.propose` (one branch) for a batch of contexts whose last tokens are on
    the device.  ``maxgram``: the host's ``maxgram.MaxGramDrafter``, whose settings and bigram table
    this follows (that module imports this one)."""

    def __init__(self, maxgram, device: torch.device) -> None:
        self.maxgram = maxgram
        self.device = device
        self.history = DeviceHistory(device)
        self.successor: Optional[torch.Tensor] = None  # [vocab seen + 1] long: the bigram table, -1 = none
        if maxgram.bigram is not None and maxgram.bigram.successor:
            table = maxgram.bigram.successor
            succ = torch.full((max(max(table), max(table.values())) + 2,), -1, dtype=torch.long)
            succ[torch.tensor(list(table.keys()))] = torch.tensor(list(table.values()))
            self.successor = succ.to(device)

    def context(self, seqs: Seq[SeqView], paths: Seq[Seq[int]], flat: torch.Tensor) -> torch.Tensor:
        """[S, max_ngram] long: each context's last ``max_ngram`` tokens, the sequence's then its
        path's, where ``paths[s]`` lists the path's token positions in ``flat`` (a device tensor).
        NO_TOKEN where the context is shorter."""
        m = self.maxgram.max_ngram
        at = np.full((len(seqs), m), -1, dtype=np.int64)
        known = np.full((len(seqs), m), NO_TOKEN, dtype=np.int64)
        for s, (seq, path) in enumerate(zip(seqs, paths)):
            from_path = min(len(path), m)
            if from_path:
                at[s, m - from_path:] = path[len(path) - from_path:]
            tail = list(seq.tokens[max(0, len(seq.tokens) - (m - from_path)):]) if m > from_path else []
            if tail:
                known[s, m - from_path - len(tail): m - from_path] = tail
        at_t, known_t = to_device_many([torch.from_numpy(at), torch.from_numpy(known)], self.device)
        return torch.where(at_t >= 0, flat.index_select(0, at_t.clamp(min=0).view(-1)).view(at_t.shape), known_t)

    def propose(self, seqs: Seq[SeqView], context: torch.Tensor, caps: Seq[int], width: int) -> torch.Tensor:
        """[S, width] long: the proposal after each context (``context`` [S, max_ngram], from
        :meth:`context`), at most ``caps[s]`` tokens, DEAD past its end.  A context whose last token is
        DEAD (a path below a node that was not drawn) proposes nothing."""
        mg, dev = self.maxgram, self.device
        m, s_n = mg.max_ngram, len(seqs)
        rows = self.history.sync(seqs)
        lengths = [len(s.tokens) for s in seqs]
        w = max(lengths)
        host = torch.tensor([lengths, [s.num_prompt for s in seqs], list(caps), rows], dtype=torch.long)
        n_tok, n_prompt, cap, row = to_device_many([host], dev)[0]
        hist = self.history.table.index_select(0, row)[:, :w].long()  # [S, W]
        padded = torch.cat([torch.full((s_n, m), NO_HISTORY, dtype=torch.long, device=dev), hist], dim=1)
        # eq[:, k, j]: the token k + 1 places before position j equals the context's k-th last one
        eq = torch.stack([padded[:, m - 1 - k: m - 1 - k + w] == context[:, m - 1 - k, None] for k in range(m)], 1)
        pos = torch.arange(w, device=dev)
        valid = (pos >= 1) & (pos < n_tok[:, None])  # where a continuation can start: before the last token
        run = torch.where(valid, eq.long().cumprod(dim=1).sum(dim=1), 0)  # [S, W] the suffix match ending there
        best = run.max(dim=1).values  # [S] the longest match
        matched = best >= mg.min_ngram
        order = torch.where(run >= best[:, None], pos + torch.where(pos < n_prompt[:, None], w, 0), -1)
        start = order.argmax(dim=1)  # the prompt's most recent occurrence first, then the text's
        length = torch.where(best < 3, 2 * best, mg.max_len).clamp(max=mg.max_len).minimum(cap)
        offs = torch.arange(width, device=dev)
        at = start[:, None] + offs
        cont = hist.gather(1, at.clamp(max=w - 1))
        cont = torch.where(matched[:, None] & (offs < length[:, None]) & (at < n_tok[:, None]), cont, DEAD)
        if self.successor is not None:
            chain, last = [], context[:, m - 1]
            size = self.successor.shape[0]
            for _ in range(min(width, mg.bigram_len)):
                nxt = self.successor.index_select(0, last.clamp(0, size - 1))
                last = torch.where((last >= 0) & (last < size), nxt, DEAD)
                chain.append(last)
            bigram = torch.stack(chain, 1)
            bigram = torch.where(offs[: bigram.shape[1]] < cap.clamp(max=mg.bigram_len)[:, None], bigram, DEAD)
            if bigram.shape[1] < width:
                bigram = torch.cat([bigram, torch.full((s_n, width - bigram.shape[1]), DEAD, dtype=torch.long,
                                                       device=dev)], 1)
            cont = torch.where(matched[:, None], cont, bigram)
        return torch.where(context[:, m - 1: m] >= 0, cont, DEAD)

    def tails(self, seqs: Seq[SeqView], trees: Seq[DraftTree], lengths: Seq[int]) -> None:
        """Appends to each held tree (``tree.unread``, nothing appended yet) a chain of ``lengths[s]``
        Max-Gram nodes below the first node of its deepest level (the draft's most likely path), their
        tokens computed and kept on the device (``HeldTokens.append``): the horizontal cascade without
        a read.  The host's tail (``extend_tree``) hangs below the first *live* deepest node; here a
        dead one (no token drawn) gets a dead tail.  Nodes past a proposal's end are DEAD."""
        held = holders(trees)
        flats = [h.flat for h in held]
        base, at = {}, 0
        for h, f in zip(held, flats):
            base[id(h)] = at
            at += f.numel()
        flat = flats[0] if len(flats) == 1 else torch.cat(flats)
        leaves, paths = [], []
        for tree in trees:
            assert tree.unread is not None and tree.num_nodes == tree.num_sub, "a held tree, before appending"
            leaf = tree.sub.level(tree.sub.max_depth).start
            off = base[id(tree.unread)] + tree.unread.offset_of(tree)
            path, node, parent = [], leaf, tree.sub.parent_list
            while node >= 0:
                path.append(off + node)
                node = parent[node]
            leaves.append(leaf)
            paths.append(path[::-1])
        width = max(lengths)
        tokens = self.propose(seqs, self.context(seqs, paths, flat), lengths, width).view(-1)
        by_holder: dict[int, tuple] = {}
        for s, (tree, leaf, n) in enumerate(zip(trees, leaves, lengths)):
            tree.add_path(leaf, [0] * n, MAXGRAM, merge=False)  # the host's placeholders: the tokens are held
            grown, where = by_holder.setdefault(id(tree.unread), (tree.unread, {}, []))[1:]
            grown[id(tree)] = n
            where.extend(range(s * width, s * width + n))
        for holder, grown, where in by_holder.values():
            holder.append(grown, tokens, where)
