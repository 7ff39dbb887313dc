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

from engine.device import to_device, to_device_many
from engine.graphs import compile_dynamic
from engine.speculative.draft_tree import DEAD, MAXGRAM, DraftTree, holders, joined
from engine.speculative.view import SeqView

#: a context entry that does not exist (the sequence is shorter than the n-gram), and the history's padding
NO_TOKEN, NO_HISTORY = -2, -3


class DeviceHistory:
    """The tokens of sequences on one device: row ``row`` of :attr:`table` holds a sequence's tokens
    (which only ever grow) after ``pad`` columns of NO_HISTORY, and NO_HISTORY after them, so that
    every n-gram up to ``pad`` long ending at any position, and every continuation, is a slice.
    :meth:`plan` says what to copy to bring a batch's rows up to date; a row is freed when its
    sequence is gone."""

    def __init__(self, device: torch.device, pad: int, rows: int = 8, width: int = 1024) -> None:
        self.device, self.pad = device, pad
        self.table = torch.full((rows, pad + width), NO_HISTORY, dtype=torch.long, device=device)
        self._row: "weakref.WeakKeyDictionary[SeqView, int]" = weakref.WeakKeyDictionary()
        self._synced = [0] * rows  # tokens of the row's sequence already in the table
        self._free = list(range(rows - 1, -1, -1))

    def plan(self, seqs: Seq[SeqView], room: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Each sequence's row, and where in the flat table which tokens go to bring them up to date
        (:meth:`write`); the table has ``room`` columns of NO_HISTORY after the longest."""
        need = self.pad + max(len(s.tokens) for s in seqs) + room
        if need > self.table.shape[1]:
            self._grow(width=1 << (need - 1).bit_length())
        rows = [self._row_of(s) for s in seqs]
        width = self.table.shape[1]
        where, values = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
        for s, r in zip(seqs, rows):
            done, n = self._synced[r], len(s.tokens)
            if n > done:
                where.append(np.arange(r * width + self.pad + done, r * width + self.pad + n))
                values.append(np.asarray(s.tokens[done:n], dtype=np.int64))
                self._synced[r] = n
        return rows, np.concatenate(where), np.concatenate(values)

    def write(self, at: torch.Tensor, values: torch.Tensor) -> None:
        if at.numel():
            self.table.view(-1).index_copy_(0, at, values)

    def _row_of(self, seq: SeqView) -> int:
        row = self._row.get(seq)
        if row is None:
            if not self._free:
                self._grow(rows=2 * self.table.shape[0])
            row = self._free.pop()
            if self._synced[row]:
                self.table[row].fill_(NO_HISTORY)  # the last owner's tokens
            self._synced[row] = 0
            self._row[seq] = row
            weakref.finalize(seq, self._free.append, row)
        return row

    def _grow(self, rows: Optional[int] = None, width: Optional[int] = None) -> None:
        old = self.table
        rows, width = rows or old.shape[0], width or old.shape[1]
        self.table = torch.full((rows, width), NO_HISTORY, dtype=torch.long, device=self.device)
        self.table[: old.shape[0], : old.shape[1]] = old
        self._free = list(range(rows - 1, old.shape[0] - 1, -1)) + self._free
        self._synced += [0] * (rows - len(self._synced))


def match_tokens(hist: torch.Tensor, context: torch.Tensor, n_prompt: torch.Tensor, cap: torch.Tensor,
                 lengths: torch.Tensor, successor: Optional[torch.Tensor], min_ngram: int, bigram_len: int,
                 width: int) -> torch.Tensor:
    """The proposals as tensor operations (no read, no copy; ``torch.compile`` fuses them):
    ``hist`` [S, m + W + width] the sequences' rows (:class:`DeviceHistory`), ``context`` [S, m] each
    context's last ``m`` tokens, ``n_prompt`` and ``cap`` [S], ``lengths`` [m + 1] the proposal length
    of each match length, ``successor`` the bigram table (its last entry -1) or None.  Returns
    [S, width] tokens, DEAD past each proposal's end."""
    m = context.shape[1]
    w = hist.shape[1] - m - width
    # windows[:, j]: the m tokens before position j; run: how many of the context's last ones they end with
    eq = hist[:, : m + w - 1].unfold(1, m, 1) == context[:, None, :]  # [S, W, m]
    run = eq.flip(-1).cumprod(-1).sum(-1) * (hist[:, m: m + w] >= 0)  # a continuation must start there
    best = run.max(dim=1).values
    pos = torch.arange(w, device=hist.device)
    prio = torch.where(pos < n_prompt[:, None], pos + w, pos)  # the prompt's occurrences first, then the text's
    # the most recent of each: the greatest priority, whose value says its position (priorities are
    # distinct).  Not ``argmax``: Inductor in torch 2.11 (the GPU image's) fuses that argmax wrongly
    # here with dynamic sizes (a start of 0 for batches of two or more; 2.13 does not)
    top = torch.where(run >= best[:, None], prio, -1).max(dim=1).values
    start = torch.where(top >= w, top - w, top)
    size = lengths[best].minimum(cap)
    offs = torch.arange(width, device=hist.device)
    cont = hist.gather(1, m + start[:, None] + offs)
    cont = torch.where((offs < size[:, None]) & (best >= min_ngram)[:, None] & (cont >= 0), cont, DEAD)
    if successor is not None and bigram_len:
        top = successor.shape[0] - 1  # its -1: DEAD and tokens past the table have no successor
        last, chain = context[:, m - 1], []
        for _ in range(min(width, bigram_len)):
            last = successor[last.clamp(max=top).remainder(top + 1)]
            chain.append(last)
        bigram = torch.stack(chain, 1)
        bigram = torch.where(offs[: bigram.shape[1]] < cap[:, None], bigram, DEAD)
        bigram = torch.nn.functional.pad(bigram, (0, width - bigram.shape[1]), value=DEAD)
        cont = torch.where((best >= min_ngram)[:, None], cont, bigram)
    return torch.where(context[:, m - 1:] >= 0, cont, DEAD)  # below a dead node: nothing


class DeviceMaxGram:
    """:meth:`MaxGramDrafter.propose` (one branch) for a batch of contexts whose last tokens are on
    the device.  ``maxgram``: the host's ``maxgram.MaxGramDrafter``, whose settings and bigram table
    this follows (that module imports this one).  ``compiled``: the proposal's tensor operations run
    through ``torch.compile`` (a few fused kernels instead of about forty launches).  ``width``: the
    proposals' width, fixed (at least the longest tail asked for) so that a compiled graph does not
    change with the room a request has left; 0: each call's longest."""

    def __init__(self, maxgram, device: torch.device, compiled: bool = False, width: int = 0) -> None:
        self.maxgram = maxgram
        self.device = device
        self.width = width
        m = maxgram.max_ngram
        self.history = DeviceHistory(device, m)
        self.lengths = to_device(torch.tensor([maxgram.proposal_length(n, maxgram.max_len) for n in range(m + 1)],
                                              dtype=torch.long), device)
        self.successor: Optional[torch.Tensor] = None  # the bigram table: a successor per token, -1 = none
        if maxgram.bigram is not None and maxgram.bigram.successor:
            table = maxgram.bigram.successor
            succ = torch.full((max(max(table), max(table.values())) + 2,), -1, dtype=torch.long)
            succ[torch.tensor(list(table.keys()))] = torch.tensor(list(table.values()))
            self.successor = to_device(succ, device)
        self._match = compile_dynamic(match_tokens) if compiled else match_tokens

    def propose(self, seqs: Seq[SeqView], paths: Seq[Seq[int]], flat: torch.Tensor, caps: Seq[int],
                width: int) -> torch.Tensor:
        """[S, width] long: the proposal after each ``seqs[s].tokens + path`` (at most ``caps[s]``
        tokens, DEAD past its end), where ``paths[s]`` lists the path's token positions in ``flat`` (a
        device tensor).  A path whose last token is DEAD (below a node that was not drawn) gets
        nothing.  One copy to the device, no read."""
        m = self.maxgram.max_ngram
        at = np.full((len(seqs), m), -1, dtype=np.int64)  # context tokens still on the device: where in flat
        known = np.full((len(seqs), m), NO_TOKEN, dtype=np.int64)  # the others
        for s, (seq, path) in enumerate(zip(seqs, paths)):
            from_path = min(len(path), m)
            if from_path:
                at[s, m - from_path:] = path[len(path) - from_path:]
            own = seq.tokens[max(0, len(seq.tokens) - (m - from_path)):] if m > from_path else []
            if own:
                known[s, m - from_path - len(own): m - from_path] = own
        hist, n_prompt, (at_t, known_t, caps_t) = self._history(seqs, width, [at, known, np.asarray(caps)])
        context = torch.where(at_t >= 0, flat[at_t.clamp(min=0)], known_t)
        return self._proposal(hist, context, n_prompt, caps_t, width)

    def after(self, seqs: Seq[SeqView], context: torch.Tensor, caps: torch.Tensor, width: int) -> torch.Tensor:
        """[S, width] long: the proposal after each context, ``context`` [S, max_ngram] its last tokens
        (NO_TOKEN before a sequence's first), at most ``caps[s]`` tokens; both on the device already (a
        context that ends past what the host knows: ``device_cascade``).  One copy, no read."""
        hist, n_prompt, _ = self._history(seqs, width, [])
        return self._proposal(hist, context, n_prompt, caps, width)

    def _history(self, seqs: Seq[SeqView], width: int, extra: list[np.ndarray]):
        """The batch's rows of the history brought up to date ([S, max_ngram + longest + width]), each
        sequence's prompt length and the ``extra`` host arrays, on the device in one copy."""
        m = self.maxgram.max_ngram
        rows, sync_at, sync_values = self.history.plan(seqs, width)
        info = np.array([rows, [s.num_prompt for s in seqs]], dtype=np.int64)
        sync_at_t, sync_values_t, info_t, *extra_t = to_device_many(
            [torch.from_numpy(x.astype(np.int64)) for x in (sync_at, sync_values, info, *extra)], self.device)
        self.history.write(sync_at_t, sync_values_t)
        w = max(len(s.tokens) for s in seqs)
        return self.history.table[info_t[0], : m + w + width], info_t[1], extra_t

    def _proposal(self, hist, context, n_prompt, caps, width: int) -> torch.Tensor:
        mg = self.maxgram
        return self._match(hist, context, n_prompt, caps, self.lengths, self.successor, mg.min_ngram,
                           mg.bigram_len, width)

    def warm_up(self) -> None:
        """Runs the proposal once for one context and once for two, so that compiling it (one graph
        for a single sequence, one for more) happens now, at start-up, not in a request's step."""
        width = max(self.width, 1)
        for n in (1, 2):
            seqs = [_Tokens(list(range(8)) * 2) for _ in range(n)]
            self.propose(seqs, [[0]] * n, torch.zeros(1, dtype=torch.long, device=self.device), [width] * n, width)

    def tails(self, seqs: Seq[SeqView], trees: Seq[DraftTree], lengths: Seq[int]) -> None:
        """Appends to each held tree (``tree.unread``, nothing appended yet) a chain of ``lengths[s]``
        Max-Gram nodes below the first node of its deepest level (the draft's most likely path), their
        tokens computed and kept on the device (``HeldTokens.append``): the horizontal cascade without
        a read.  The host's tail (``extend_tree``) hangs below the first *live* deepest node; here a
        dead one (no token drawn) gets a dead tail.  Nodes past a proposal's end are DEAD."""
        held = holders(trees)
        flat, base = joined(held)
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
        width = max(self.width, *lengths)
        tokens = self.propose(seqs, paths, flat, lengths, width).view(-1)  # sequence s's at s * width + i
        for holder in held:
            grown, where = [], []
            for s, (tree, leaf, n) in enumerate(zip(trees, leaves, lengths)):
                if tree.unread is holder:
                    tree.add_path(leaf, [0] * n, MAXGRAM, merge=False)  # placeholders: the tokens are held
                    grown.append((tree, n))
                    where.extend(range(s * width, s * width + n))
            holder.append(grown, tokens, where)


class _Tokens:
    """A stand-in sequence for :meth:`DeviceMaxGram.warm_up`."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.num_prompt = tokens, len(tokens) // 2
