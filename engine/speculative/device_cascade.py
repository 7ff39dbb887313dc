"""The vertical cascade with one host read a step (``maxgram_read_tree = false``, the GPU preset's way).

The host's cascade (``cascade.CascadeProposer``) reads the device after every review round: the next
round's Max-Gram guess continues the tokens the round kept, and the round's draft forward needs
their number for its positions and mask.  Here every round stays on the device:

* the step runs a number of rounds fixed before drafting (:class:`RoundCounts`: what the sequences'
  last chains needed, one more when a chain was left short, at most the depth);
* each round's guess is Max-Gram's proposal on the device (``device_maxgram``) after the sequence's
  tokens and the chain so far, whose length only the device knows;
* each round runs a block of fixed length through the draft (the guess, after the chain's unrun last
  token from the second round on), at positions shifted on the device by the chain's length
  (``position_shift``), seeing only the draft-cache entries of the chain's tokens (a mask made there);
* the draft reviews the guess exactly as :func:`cascade.review_guess` does, with tensor operations:
  a guess token is kept with probability ``q(g)`` (greedy: when it is the argmax), the first rejection
  draws a correction from ``norm((q - e_g)+)``, and a round that keeps its whole guess draws one more;
  the tokens, their laws and their draft-cache entries are written after the chain's end;
* a chain that reaches its depth stops growing; a round still runs for it (the shapes are fixed) and
  changes nothing.  A chain left short by the rounds is simply shorter (DEAD after its end).

Each chain token has law exactly ``q`` given the chain above it, and whether a token exists depends
only on the tokens before it, so the target's review of the chain is lossless as it is for the host's
cascade (``tests/exact_law.py`` enumerates both).  Max-Gram's tail follows the chain's end as a
proposal with a one-hot law (accepted with probability ``p(x)``, the residual ``norm((p - e_x)+)``:
a one-hot event).  The tokens, the draft-cache entries and the rounds each chain needed come back with
verification's one read (:class:`HeldChain`).

A round draws ``guess length + 1`` uniforms from a sampled request's generator whatever it keeps, where
the host's cascade draws one per guess token and one more: seeded outputs differ between the two ways
(each reproduces itself).
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence as Seq

import numpy as np
import torch

from engine.batching import Block
from engine.device import to_device_many
from engine.sampler import SamplingTensors, compute_probs, draw_uniforms, sample_from_probs
from engine.speculative.device_maxgram import NO_TOKEN, DeviceMaxGram
from engine.speculative.draft_tree import CASCADE, DEAD, SAMPLED, DraftTree, HeldTokens
from engine.speculative.proposer import DraftModelProposer
from engine.speculative.tree import SubTree
from engine.speculative.verify import without_rows
from engine.speculative.view import SeqView


class RoundCounts:
    """How many review rounds a step runs: as many as the batch's last chains needed to reach their
    depth (one more than they ran when a chain fell short), at most the step's depth.  A sequence
    not seen yet needs its depth (every round yields a token, so that many always fill the chain)."""

    def __init__(self) -> None:
        self._needed: "weakref.WeakKeyDictionary[SeqView, int]" = weakref.WeakKeyDictionary()

    def rounds(self, seqs: Seq[SeqView], depths: Seq[int]) -> int:
        return max(min(d, self._needed.get(s, d)) for s, d in zip(seqs, depths))

    def observe(self, seq: SeqView, needed: int) -> None:
        self._needed[seq] = needed


class DeviceCascade:
    """The vertical cascade's chains grown on the device, read once with verification.  ``maxgram``:
    the host's ``MaxGramDrafter``, whose proposals (at most ``guess`` tokens, ``maxgram_len``) are made
    on the draft's device, through ``torch.compile`` when ``compiled``, at a fixed ``width``."""

    def __init__(self, draft: DraftModelProposer, maxgram, guess: int, width: int, compiled: bool = False) -> None:
        self.draft = draft
        self.guess = guess
        self.rounds = RoundCounts()
        self._maxgram = lambda: DeviceMaxGram(maxgram, draft.cache.k.device, compiled=compiled, width=width)
        self._on_device: Optional[DeviceMaxGram] = None

    @property
    def maxgram(self) -> DeviceMaxGram:
        """Max-Gram on the draft's device, made at its first use (or by :meth:`warm_up`)."""
        if self._on_device is None:
            self._on_device = self._maxgram()
        return self._on_device

    def warm_up(self) -> None:
        """Compiles Max-Gram's proposal now (start-up) rather than in a request's first step."""
        self.maxgram.warm_up()

    def propose(self, seqs: list[SeqView], depths: list[int], tails: list[int],
                empties: list[SubTree]) -> list[DraftTree]:
        """Each sequence's chain of up to ``depths[s]`` reviewed tokens and Max-Gram's tail of up to
        ``tails[s]`` after it, as held trees (``empties[s]``: the sequence's empty draft-model subtree)."""
        draft, L, m = self.draft, self.guess, self.maxgram.maxgram.max_ngram
        roots = draft._catch_up(seqs).logits  # committed: the rounds' blocks are the only pending entries
        assert not any(draft.cache.pending_np[s.draft_slot] for s in seqs), "the catch-up commits"
        dev = roots.logits.device
        S, T = len(seqs), max(tails)
        rounds = self.rounds.rounds(seqs, depths)
        fixed = max(self.maxgram.width, L, T)  # Max-Gram's proposals at one width: one compiled graph
        known = np.full((S, m), NO_TOKEN, dtype=np.int64)  # each sequence's last tokens, before the chain
        for j, s in enumerate(seqs):
            own = s.tokens[-m:]
            known[j, m - len(own):] = own
        greedy = [s.request.sampling.greedy for s in seqs]
        known_t, depth_t, tail_t, greedy_t = to_device_many(
            [torch.from_numpy(known), torch.tensor(depths), torch.tensor(tails), torch.tensor(greedy)], dev)
        st = SamplingTensors.from_params([s.request.sampling for s in seqs], draft.vocab_size,
                                         [j for j in range(S) for _ in range(L + 1)], device=dev)
        history = _Histories(seqs, L, draft.vocab_size, dev)
        chains = _Chains(depth_t, max(depths) + T, L + (rounds - 1) * (L + 1), draft.vocab_size, rounds)
        frontier = draft._pad_vocab(roots.rows()).float()  # [S, vocab]: the law after the root
        at = 0  # pending entries the rounds appended so far
        for r in range(rounds):
            room = depth_t - chains.length
            guess = self.maxgram.after(seqs, chains.context(known_t), room.clamp(max=L), fixed)[:, :L]
            rows = L if r == 0 else L + 1  # from the second round on, the chain's last token first (unrun)
            ids = guess.clamp(min=0) if r == 0 else torch.cat([chains.last().clamp(min=0), guess.clamp(min=0)], 1)
            seen = torch.cat([chains.live[:, None, :at].expand(S, rows, at),
                              torch.ones(rows, rows, dtype=torch.bool, device=dev).tril().expand(S, rows, rows)], 2)
            blocks = [Block(s.draft_slot, [0] * rows, list(range(len(s.tokens), len(s.tokens) + rows)),
                          list(range(rows)), device_mask=seen[j]) for j, s in enumerate(seqs)]
            _, out = draft.forward(blocks, ids, None if r == 0 else chains.length - 1)
            block = draft._pad_vocab(out.rows().view(S, rows, -1)).float()  # [S, rows, vocab]
            raw = torch.cat([frontier[:, None], block], 1) if r == 0 else block  # [S, L + 1, vocab]
            if r:
                chains.ran_last(at)
            probs = compute_probs(raw.reshape(S * (L + 1), -1), st, *history.rows(guess)).view(S, L + 1, -1)
            kept, y = review(probs, guess, room, greedy_t, self._uniforms(seqs, greedy, L + 1, dev))
            history.add(*chains.append(guess, probs, kept, y, room, at if r == 0 else at + 1, r))
            at += rows
        if T:  # Max-Gram's tail after the chain's end
            chains.append_tail(self.maxgram.after(seqs, chains.context(known_t), tail_t, fixed)[:, :T])
        return self._trees(seqs, depths, tails, empties, chains)

    @staticmethod
    def _uniforms(seqs: list[SeqView], greedy: list[bool], n: int, dev: torch.device) -> torch.Tensor:
        """[S, n] uniforms, drawn from each sampled request's generator (greedy rows draw none: 0)."""
        return draw_uniforms([s.generator for s in seqs], [0 if g else n for g in greedy], device=dev) \
            if not all(greedy) else torch.zeros(len(seqs), n, device=dev)

    def _trees(self, seqs, depths, tails, empties, chains: "_Chains") -> list[DraftTree]:
        trees = []
        for j, (empty, d, t) in enumerate(zip(empties, depths, tails)):
            assert empty.num_nodes == 0
            tree = DraftTree(empty, [])
            tree.add_path(-1, [0] * (d + t), CASCADE, SAMPLED, list(chains.laws[j, : d + t]), merge=False)
            tree.held, tree.has_tail = d + t, True
            trees.append(tree)
        HeldChain(trees, chains.tokens, chains.entries, chains.needed, seqs, self.rounds).hold()
        return trees


class _Chains:
    """The step's chains on the device, ``width`` columns each (the chain, then the tail; one more
    column takes the writes past them): their tokens (DEAD after the end), each token's law, its
    draft-cache entry (-1: not run), which of the rounds' ``span`` pending entries are the chain's, the
    chains' lengths and the rounds that filled them (one more than ``rounds`` where none did)."""

    def __init__(self, depth: torch.Tensor, width: int, span: int, vocab: int, rounds: int) -> None:
        S, dev = depth.shape[0], depth.device
        self.depth, self.width, self.span = depth, width, span
        self.tokens = torch.full((S, width + 1), DEAD, dtype=torch.long, device=dev)
        self.laws = torch.zeros(S, width + 1, vocab, dtype=torch.float32, device=dev)
        self.entries = torch.full((S, width + 1), -1, dtype=torch.long, device=dev)
        self.live = torch.zeros(S, span + 1, dtype=torch.bool, device=dev)
        self.length = torch.zeros(S, dtype=torch.long, device=dev)
        self.needed = torch.full((S,), rounds + 1, dtype=torch.long, device=dev)

    def context(self, known: torch.Tensor) -> torch.Tensor:
        """[S, m] the last ``m`` tokens of each sequence (``known``, [S, m]) followed by its chain."""
        m = known.shape[1]
        joined = torch.cat([known, self.tokens], 1)
        return joined.gather(1, self.length[:, None] + torch.arange(m, device=known.device)[None])

    def last(self) -> torch.Tensor:
        """[S, 1] each chain's last token."""
        return self.tokens.gather(1, (self.length - 1).clamp(min=0)[:, None])

    def ran_last(self, at: int) -> None:
        """The round's block began with each chain's last token at pending entry ``at``: where that
        token had not run before, that is its entry now, and the next rows see it."""
        last = (self.length - 1).clamp(min=0)[:, None]
        unrun = (self.entries.gather(1, last) < 0) & (self.length > 0)[:, None]
        self.entries.scatter_(1, torch.where(unrun, last, self.width), at)
        self.live.scatter_(1, torch.where(unrun, at, self.span), True)

    def append(self, guess: torch.Tensor, probs: torch.Tensor, kept: torch.Tensor, y: torch.Tensor,
               room: torch.Tensor, first_entry: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Round ``r``'s review (:func:`review`) after each chain: the kept guess tokens (which ran at
        pending entries from ``first_entry``), then ``y`` where there is room, each with its law
        ``probs[:, i]``.  Returns the tokens written and which were ([S, L + 1] each)."""
        cols = torch.arange(probs.shape[1], device=probs.device)[None]
        added = kept + (kept < room).long()
        tokens = torch.where(cols < kept[:, None], torch.cat([guess, guess[:, :1]], 1), y[:, None])
        written = cols < added[:, None]
        dest = torch.where(written, self.length[:, None] + cols, self.width)
        self.tokens.scatter_(1, dest, tokens)
        self.laws.scatter_(1, dest[:, :, None].expand(-1, -1, probs.shape[2]), probs)
        ran = cols < kept[:, None]
        self.entries.scatter_(1, dest, torch.where(ran, cols + first_entry, -1))
        self.live.scatter_(1, torch.where(ran, cols + first_entry, self.span), True)
        self.needed = torch.where((self.length < self.depth) & (self.length + added >= self.depth), r + 1,
                                  self.needed)
        self.length = self.length + added
        return tokens, written

    def append_tail(self, tail: torch.Tensor) -> None:
        """Max-Gram's ``tail`` [S, T] (DEAD after its end) after each chain's end, with one-hot laws: as
        a proposal of one token, accepted with probability ``p(x)``, residual ``norm((p - e_x)+)``."""
        T, vocab = tail.shape[1], self.laws.shape[2]
        dest = torch.where(tail >= 0, self.length[:, None] + torch.arange(T, device=tail.device)[None], self.width)
        self.tokens.scatter_(1, dest, tail)
        onehot = torch.zeros(tail.shape[0], T, vocab, dtype=torch.float32, device=tail.device)
        onehot.scatter_(2, tail.clamp(min=0)[:, :, None], 1.0)
        self.laws.scatter_(1, dest[:, :, None].expand(-1, -1, vocab), onehot)


def review(probs: torch.Tensor, guess: torch.Tensor, room: torch.Tensor, greedy: torch.Tensor,
           u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cascade.review_guess` for a batch of guesses, on the device: ``probs`` [S, L + 1, vocab]
    the draft's law after the chain and each prefix of the guess, ``guess`` [S, L] (DEAD past its
    end), ``room`` [S] tokens the chain may still take, ``greedy`` [S] bool, ``u`` [S, L + 1]
    uniforms (``u[:, i]`` decides ``guess[:, i]``, ``u[:, L]`` draws the last token).  Returns how many
    guess tokens are kept and the token drawn after them [S] (unused where ``room`` is taken up)."""
    L = guess.shape[1]
    g = guess.clamp(min=0)
    p_guess = probs[:, :L].gather(2, g[:, :, None])[:, :, 0]
    ok = torch.where(greedy[:, None], probs[:, :L].argmax(-1) == g, u[:, :L] < p_guess) & (guess >= 0)
    kept = ok.long().cumprod(1).sum(1).minimum(room.clamp(min=0))
    law = probs.gather(1, kept[:, None, None].expand(-1, 1, probs.shape[2]))[:, 0]  # after the kept prefix
    rejected = guess.gather(1, kept.clamp(max=L - 1)[:, None])[:, 0]
    was_rejected = (kept < L) & (rejected >= 0)  # the guess went on past the kept prefix: its token was refused
    residual = torch.where(was_rejected[:, None], without_rows(law, rejected.clamp(min=0)), law)
    y = torch.where(greedy, law.argmax(-1), sample_from_probs(residual, u[:, L]))
    return kept, y


class _Histories:
    """Penalty histories of the rounds' rows (output counts, the chain's tokens so far and each row's
    guess prefix) on the device; nothing when no sequence uses penalties."""

    def __init__(self, seqs: list[SeqView], L: int, vocab: int, dev: torch.device) -> None:
        self.used = any(s.request.sampling.needs_history for s in seqs)
        self.L, self.vocab = L, vocab
        if not self.used:
            return
        zeros = torch.zeros(vocab, dtype=torch.int32, device=dev)
        counts = torch.stack([s.output_counts if s.request.sampling.needs_history else zeros for s in seqs])
        self.counts = torch.nn.functional.pad(counts, (0, 1))  # [S, vocab + 1]: the last column takes the dead
        no = torch.zeros(vocab, dtype=torch.bool, device=dev)
        self.prompt = torch.stack([s.prompt_mask if s.request.sampling.needs_history and s.prompt_mask is not None
                                   else no for s in seqs])

    def rows(self, guess: torch.Tensor):
        """(counts, prompt mask) of every row [S * (L + 1), vocab] (row ``i`` of a sequence: the chain so
        far and ``guess[:i]``), or (None, None)."""
        if not self.used:
            return None, None
        S, L, V = guess.shape[0], self.L, self.vocab
        earlier = torch.arange(L, device=guess.device)[None, :] < torch.arange(L + 1, device=guess.device)[:, None]
        at = torch.where(earlier[None] & (guess >= 0)[:, None, :], guess[:, None, :], V)  # [S, L + 1, L]
        rows = self.counts[:, None, :].expand(S, L + 1, V + 1).clone()
        rows.scatter_add_(2, at, torch.ones_like(at, dtype=rows.dtype))
        return rows[:, :, :V].reshape(S * (L + 1), V), self.prompt[:, None].expand(S, L + 1, V).reshape(S * (L + 1), V)

    def add(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        """The chain's new ``tokens`` [S, n] (where ``valid``) count from the next round on."""
        if self.used:
            at = torch.where(valid, tokens.clamp(min=0), self.vocab)
            self.counts.scatter_add_(1, at, torch.ones_like(at, dtype=self.counts.dtype))


class HeldChain(HeldTokens):
    """The device cascade's chains (:class:`HeldTokens`): tree ``j``'s tokens are row ``j`` of
    ``chain``; its draft-cache entries (``DraftTree.draft_index``) and the rounds its chain needed
    (for :class:`RoundCounts`) come back with them."""

    def __init__(self, trees: list[DraftTree], chain: torch.Tensor, entries: torch.Tensor, needed: torch.Tensor,
                 seqs: list[SeqView], rounds: RoundCounts) -> None:
        super().__init__(trees)
        at = np.concatenate([np.arange(j * chain.shape[1], j * chain.shape[1] + t.num_nodes)
                             for j, t in enumerate(trees)])
        at_t = to_device_many([torch.from_numpy(at)], chain.device)[0]
        self.flat = torch.cat([chain.view(-1).index_select(0, at_t), chain.new_zeros(1)])
        self.entries = entries.view(-1).index_select(0, at_t)
        self.needed = needed
        self.seqs, self.rounds = seqs, rounds

    def tensors(self) -> list[torch.Tensor]:
        return [self.flat, self.entries, self.needed]

    def fill(self, host: list[torch.Tensor]) -> bool:
        if not super().fill(host):
            return False
        entries, needed = host[1].tolist(), host[2].tolist()
        for off, tree, seq, n in zip(self.offsets, self.trees, self.seqs, needed):
            tree.draft_index = entries[off: off + tree.num_held]
            self.rounds.observe(seq, n)
        return True
