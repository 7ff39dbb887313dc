"""Max-Gram: a drafter with no neural cost (docs/algorithms.md §4.2, the bottom of the CS Drafting cascade).

To propose what follows a context it copies the continuation of the **longest suffix match**:

1. the longest ``n`` (``max_ngram`` down to ``min_ngram``) such that the context's last ``n`` tokens
   occur earlier in the sequence; among the occurrences of that n-gram, those **in the prompt** come
   first, then those in the generated text, most recent first;
2. when nothing matches, a **bigram table** chains the most frequent successor of the last token.
   The table is built at start-up from a corpus we ship, tokenized with the target's tokenizer
   (the default preset uses ``benchmarks/prompts/train.json``, the prompts acceptance heads are
   trained on: code and chat, disjoint from the benchmark prompts); none is used without a corpus.

Proposals are deterministic functions of the context, so for verification their law is one-hot
(``engine.speculative.draft_tree``).  How many tokens to propose follows the match length: a one-token
match predicts little, a long one often predicts many (``proposal_length``).

Every sequence has an n-gram index (n-gram -> positions where its continuation starts), extended
incrementally as tokens are accepted, so a lookup is a few dictionary probes.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import time
import weakref

import torch
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence as Seq

from engine.config import DrafterSettings, setting
from engine.registry import Method, drafter_settings, register_drafter, register_method
from engine.speculative.device_maxgram import DeviceMaxGram
from engine.speculative.draft_tree import BIGRAM, MAXGRAM, DraftTree
from engine.speculative.drafter import DrafterContext
from engine.speculative.methods import DraftPlan, PlanInput
from engine.speculative.view import SeqView


log = logging.getLogger(__name__)

MAXGRAM_DRAFTER = "maxgram"
MAXGRAM_METHOD, MCSD_MAXGRAM = "maxgram", "mcsd+maxgram"


@drafter_settings("maxgram")
@dataclass(frozen=True)
class MaxGramSettings(DrafterSettings):
    """Max-Gram's settings (``--maxgram-len``, ...; a ``[maxgram]`` table in a preset)."""

    len: int = setting(8, "most tokens per Max-Gram proposal from the root", ge=1, le=64)
    branches: int = setting(1, "Max-Gram proposals (distinct first tokens) per step", ge=1, le=8)
    max_ngram: int = setting(4, "longest suffix Max-Gram tries", ge=1, le=16)
    min_ngram: int = setting(1, "shortest suffix Max-Gram accepts as a match", ge=1, le=16)
    corpus: Optional[str] = setting(None, "text or prompts JSON for Max-Gram's bigram fallback", path=True)
    tail: int = setting(4, "Max-Gram tokens after the deepest drafted path (horizontal cascade)", ge=0, le=64)
    trust: int = setting(3, "a suffix match this long skips the draft model for the step (0 = never)", ge=0, le=64)
    read_tree: bool = setting(True, "Max-Gram reads the draft model's tree: its branches merge with equal drafted "
                              "nodes and its tail grows below the deepest drafted path.  False leaves the draft's "
                              "tokens on the device until verification reads them (one host read a step, for a "
                              "GPU): its branches become nodes of their own and its tail is proposed on the "
                              "device; the cascade's review rounds run there too")

    def validate(self) -> None:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"maxgram_min_ngram {self.min_ngram} > maxgram_max_ngram {self.max_ngram}")
        if self.corpus is not None and not Path(self.corpus).is_file():
            raise ValueError(f"maxgram_corpus {self.corpus} does not exist")


@dataclass(frozen=True)
class MaxGramShare:
    """Max-Gram's share of a step (a :class:`~engine.speculative.methods.DraftPlan` entry)."""

    length: int = 0  # tokens per branch from the root
    branches: int = 0  # branches from the root
    tail: int = 0  # tokens appended below the deepest drafted path (horizontal cascade; on the device, without a
    #                read, when the tree is held there and not merged: ``device_maxgram``)
    trust: int = 0  # a suffix match this long replaces the draft model for the step (0 = never)
    match_class: Optional[int] = None  # the root proposal's match class, when the length chooser capped it
    trusted: bool = False  # Max-Gram alone this step: its match reached ``trust`` (the planner's choice)
    merge: bool = True  # branches share nodes with equal drafted ones, the tail follows the first live deepest
    #                     node (both need the draft's tokens on the host)

    @property
    def rows(self) -> int:
        return self.length * self.branches + self.tail


@dataclass
class Proposal:
    tokens: list[int]
    match: int  # length of the matched suffix; 0 = the bigram table


class NgramIndex:
    """Where each n-gram (``n <= max_n``) of a growing token list ends: ``table[gram]`` lists, in
    ascending order, the positions right after its occurrences (where a continuation starts)."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.table: dict[tuple[int, ...], list[int]] = {}
        self.size = 0
        self.root: tuple[int, Optional[int]] = (-1, None)  # (size, the root proposal's match then): root_match

    def extend(self, tokens: Seq[int]) -> None:
        """Indexes ``tokens[self.size:]`` (``tokens`` only ever grows)."""
        for end in range(self.size + 1, len(tokens) + 1):
            for n in range(1, min(self.max_n, end) + 1):
                self.table.setdefault(tuple(tokens[end - n:end]), []).append(end)
        self.size = len(tokens)

    def continuations(self, gram: tuple[int, ...], limit: int, split: int) -> list[int]:
        """Continuation starts ``< limit`` of ``gram``: those ``< split`` (the prompt) first, then the
        rest, most recent first within each part."""
        pos, order = self.places(gram, limit, split)
        return [pos[i] for i in order]

    def places(self, gram: tuple[int, ...], limit: int, split: int) -> tuple[list[int], Iterable[int]]:
        """:meth:`continuations` as the gram's positions and the order to read them in (lazily: a
        proposal reads the first few of what may be thousands, a frequent token's)."""
        pos = self.table.get(gram)
        if not pos:
            return [], ()
        hi = bisect.bisect_left(pos, limit)
        mid = min(bisect.bisect_left(pos, split), hi)
        return pos, itertools.chain(range(mid - 1, -1, -1), range(hi - 1, mid - 1, -1))


class BigramTable:
    """The most frequent successor of each token in a corpus."""

    def __init__(self, successor: dict[int, int]) -> None:
        self.successor = successor

    @classmethod
    def from_token_lists(cls, lists: Seq[Seq[int]], min_count: int = 2) -> "BigramTable":
        pairs: Counter = Counter()
        for toks in lists:
            pairs.update(zip(toks, toks[1:]))
        best: dict[int, tuple[int, int]] = {}
        for (a, b), c in pairs.items():
            if c >= min_count and (a not in best or c > best[a][1]):
                best[a] = (b, c)
        return cls({a: b for a, (b, _) in best.items()})

    @classmethod
    def from_corpus(cls, tokenizer, path: str | Path) -> "BigramTable":
        """``path``: a ``.txt`` file, or a prompts JSON file (a list of ``{"messages": [...]}`` or
        ``{"prompt": ...}`` objects, as in ``benchmarks/prompts``)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"Max-Gram corpus {path} does not exist")
        if path.suffix == ".json":
            texts = []
            for item in json.loads(path.read_text()):
                if "messages" in item:
                    texts.extend(m["content"] for m in item["messages"] if isinstance(m.get("content"), str))
                elif "prompt" in item:
                    texts.append(item["prompt"])
        else:
            texts = path.read_text().split("\n\n")
        return cls.from_token_lists([tokenizer.encode(t, add_special_tokens=False) for t in texts if t])

    def chain(self, last: int, length: int) -> list[int]:
        out = []
        while len(out) < length and last in self.successor:
            last = self.successor[last]
            out.append(last)
        return out


class MaxGramDrafter:
    def __init__(self, max_len: int = 8, max_ngram: int = 4, min_ngram: int = 1,
                 bigram: Optional[BigramTable] = None, bigram_len: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"Max-Gram needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_len < 1:
            raise ValueError(f"Max-Gram proposal length must be >= 1, got {max_len}")
        self.max_len = max_len
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.bigram = bigram
        self.bigram_len = bigram_len
        self._index: "weakref.WeakKeyDictionary[SeqView, NgramIndex]" = weakref.WeakKeyDictionary()

    def proposal_length(self, match: int, cap: int) -> int:
        """Tokens worth proposing after a ``match``-token suffix match (1 -> 2, 2 -> 4, 3+ -> all)."""
        return min(cap, self.max_len, 2 * match if match < 3 else self.max_len)

    def index(self, seq: SeqView) -> NgramIndex:
        idx = self._index.get(seq)
        if idx is None:
            idx = self._index[seq] = NgramIndex(self.max_ngram)
        idx.extend(seq.tokens)
        return idx

    def root_match(self, seq: SeqView) -> Optional[int]:
        """The suffix match length of the proposal from the root (0: the bigram table); None if there
        is no proposal.  Kept until the sequence's tokens grow: a step's planning asks up to twice a
        sequence (the trust test, the length caps)."""
        idx = self.index(seq)
        if idx.root[0] != idx.size:  # (tokens only ever grow)
            props = self._propose(idx, seq, (), 1, 1)
            idx.root = (idx.size, props[0].match if props else None)
        return idx.root[1]

    def propose(self, seq: SeqView, path: Seq[int] = (), max_len: Optional[int] = None,
                branches: int = 1) -> list[Proposal]:
        """Up to ``branches`` proposals with distinct first tokens for what follows
        ``seq.tokens + path``; each at most ``max_len`` tokens (default: the drafter's)."""
        cap = self.max_len if max_len is None else max_len
        if cap < 1 or branches < 1:
            return []
        return self._propose(self.index(seq), seq, path, cap, branches)

    def _propose(self, idx: NgramIndex, seq: SeqView, path: Seq[int], cap: int, branches: int) -> list[Proposal]:
        toks = seq.tokens
        context = list(toks[-self.max_ngram:]) + list(path)
        out: list[Proposal] = []
        firsts: set[int] = set()
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            gram = tuple(context[-n:])
            length = self.proposal_length(n, cap)
            pos, order = idx.places(gram, len(toks), seq.num_prompt)
            for i in order:
                start = pos[i]
                cont = toks[start:start + length]
                if cont and cont[0] not in firsts:
                    firsts.add(cont[0])
                    out.append(Proposal(list(cont), n))
                    if len(out) == branches:
                        return out
        if not out and self.bigram is not None and context:
            cont = self.bigram.chain(context[-1], min(cap, self.bigram_len))
            if cont:
                out.append(Proposal(cont, 0))
        return out

    def extend_tree(self, seq: SeqView, tree: DraftTree, tail: int = 0, length: int = 0, branches: int = 0,
                    merge: bool = True) -> None:
        """Appends Max-Gram's one-hot proposals to ``tree``: a ``tail`` of up to that many tokens below its
        deepest live node (the most likely path among equals; the horizontal cascade), then up to
        ``branches`` proposals of up to ``length`` tokens from the root, merged with equal nodes, or
        (``merge=False``) as nodes of their own, without reading the tree's tokens (a held tree's tail
        is then the device's: ``DeviceMaxGram.tails``)."""
        if tail and tree.tokens:
            leaf = tree.leaves()[0]
            for prop in self.propose(seq, tree.path_to(leaf), tail):
                tree.add_path(leaf, prop.tokens, MAXGRAM if prop.match else BIGRAM)
        if length and branches:
            for prop in self.propose(seq, (), length, branches):
                tree.add_path(-1, prop.tokens, MAXGRAM if prop.match else BIGRAM, merge=merge)


MATCH_CLASSES = 4  # what a proposal is known to come from: 0 = the bigram table, 1, 2, 3 = a match of 1, 2, 3+


def match_class(match: int) -> int:
    return min(match, MATCH_CLASSES - 1)


class LengthChooser:
    """Load-aware cap on Max-Gram's proposal length, like the draft tree's budget
    (``engine.speculative.cost_model``): a proposal costs nothing to draft but every token of it is a row of
    the verification forward, which on a busy batch is no longer free.

    A proposal's worth depends on where it comes from: a long suffix match is usually right, a
    bigram guess rarely.  So statistics are kept per **match class** (``match_class``: bigram table,
    match of 1, 2, 3+) and per proposal position ``i``, over steps whose tree Max-Gram alone drafted,
    as two conditional rates, each shrunk to a prior by ``prior_weight`` pseudo-observations:

    * ``e[c, i] = P(the proposal has a token at i | it has one at i - 1)``, learnt only where the cap
      let it be seen (a proposal cut by its cap says nothing about what lies beyond);
    * ``a[c, i] = P(the token at i is accepted | it exists and every token before it was)``.

    With cap ``L`` a class-``c`` sequence verifies ``1 + sum_{i<L} prod_{j<=i} e`` rows and emits
    ``1 + sum_{i<L} prod_{j<=i} e * a`` tokens; the chooser picks the caps (coordinate ascent over
    classes) that maximise tokens per second of the measured target cost curve over the whole batch.
    Positions that a small cap keeps unseen keep their prior (rather than fading to nothing), so a
    cap grows again as soon as the load allows it; after ``probe_every`` steps in a row with every cap
    0 the full length is granted once, so the statistics keep up when speculation starts paying
    again.  Counts decay, because the text being written changes.
    """

    def __init__(self, curve, max_len: int, prior_weight: float = 2.0, prior_extend: float = 0.9,
                 prior_rates: Seq[float] = (0.3, 0.5, 0.6, 0.7), probe_every: int = 64, decay: float = 0.995) -> None:
        self.curve = curve  # CostCurve: seconds of a target forward by total rows
        self.decay = decay
        self.max_len = max_len
        self.caps = sorted({c for c in (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if c < max_len} | {max_len})
        self.weight = prior_weight
        self.prior_extend = prior_extend
        self.prior_accept = torch.tensor([float(r) for r in prior_rates])[:, None].expand(MATCH_CLASSES, max_len)
        shape = (MATCH_CLASSES, max_len)
        self.extend_seen, self.extend_hits = torch.zeros(shape), torch.zeros(shape)
        self.accept_seen, self.accept_hits = torch.zeros(shape), torch.zeros(shape)
        self.probe_every = probe_every
        self._idle = 0

    def planning_state(self) -> int:
        """The steps since a cap last let Max-Gram propose (what spaces out its probes)."""
        return self._idle

    def restore_planning(self, state: int) -> None:
        self._idle = state

    def expected(self) -> tuple[list[list[float]], list[list[float]]]:
        """(rows, tokens): ``[class][cap]`` expected proposal rows and accepted tokens, cap 0..max_len."""
        w = self.weight
        extend = (self.extend_hits + w * self.prior_extend) / (self.extend_seen + w)
        accept = (self.accept_hits + w * self.prior_accept) / (self.accept_seen + w)
        exists = extend.cumprod(1)
        zero = torch.zeros(MATCH_CLASSES, 1)
        rows = torch.cat([zero, exists.cumsum(1)], 1)
        tokens = torch.cat([zero, (exists * accept.cumprod(1)).cumsum(1)], 1)
        return rows.tolist(), tokens.tolist()

    def choose(self, counts: Seq[int], other_rows: int, other_tokens: Optional[float] = None) -> list[int]:
        """The cap of each match class for this step; ``counts[c]``: this step's Max-Gram sequences
        of class ``c``; ``other_rows``: verification rows of the rest of the batch, expected to emit
        ``other_tokens`` tokens (default: one per row, as plainly decoding sequences do)."""
        caps = [self.max_len] * MATCH_CLASSES
        if not any(counts):
            return caps
        rows, acc = self.expected()
        other_tokens = float(other_rows) if other_tokens is None else other_tokens

        def rate(caps: list[int]) -> float:
            tokens = other_tokens + sum(n * (1 + acc[c][caps[c]]) for c, n in enumerate(counts))
            secs = self.curve(other_rows + sum(n * (1 + rows[c][caps[c]]) for c, n in enumerate(counts)))
            return tokens / max(secs, 1e-9)

        for _ in range(2):  # coordinate ascent: the classes share one forward
            for c in (c for c, n in enumerate(counts) if n):
                best, best_rate = caps[c], -1.0
                for cap in self.caps:
                    trial = caps[:c] + [cap] + caps[c + 1:]
                    r = rate(trial)
                    if r > best_rate * 1.0001:
                        best, best_rate = cap, r
                caps[c] = best
        if any(caps[c] for c, n in enumerate(counts) if n):
            self._idle = 0
            return caps
        self._idle += 1
        if self._idle >= self.probe_every:
            self._idle = 0
            return [self.max_len] * MATCH_CLASSES
        return caps

    def observe(self, klass: int, proposed: int, accepted: int, cap: Optional[int] = None) -> None:
        """One step of a Max-Gram-only tree: its match class, longest proposal, accepted length and the
        cap it was proposed under (default: the full length)."""
        cap = self.max_len if cap is None else min(cap, self.max_len)
        proposed, accepted = min(proposed, cap), min(accepted, proposed)
        for t in (self.extend_seen, self.extend_hits, self.accept_seen, self.accept_hits):
            t[klass].mul_(self.decay)
        self.extend_seen[klass, :min(proposed + 1, cap)] += 1  # positions whose existence was visible
        self.extend_hits[klass, :proposed] += 1
        self.accept_seen[klass, :min(accepted + 1, proposed)] += 1  # existing tokens whose prefix was accepted
        self.accept_hits[klass, :accepted] += 1


@register_drafter
class MaxGramTreeDrafter:
    """Max-Gram's one-hot proposals: a tail below the deepest drafted path and branches from the root
    (methods ``maxgram``, ``mcsd+maxgram``, ``cascade``).  No draft model needed."""

    name, stage = MAXGRAM_DRAFTER, 90

    def __init__(self, maxgram: MaxGramDrafter, compile_on_cuda: bool = False, tail: int = 0) -> None:
        """``compile_on_cuda``: held trees' tails on a CUDA device through ``torch.compile``
        (``graph_compile``); ``tail``: the longest tail the settings ask for."""
        self.maxgram = maxgram
        self.compile_on_cuda = compile_on_cuda
        self.tail = tail
        self._on_device: dict[torch.device, DeviceMaxGram] = {}  # the tails of held trees, by device

    def on_device(self, device: torch.device) -> DeviceMaxGram:
        """The tails' proposer on ``device`` (made, and compiled on CUDA, the first time)."""
        dmg = self._on_device.get(device)
        if dmg is None:
            compiled = self.compile_on_cuda and device.type == "cuda"
            dmg = self._on_device[device] = DeviceMaxGram(self.maxgram, device, compiled=compiled, width=self.tail)
            if compiled:
                t0 = time.perf_counter()
                log.info("compiling Max-Gram's tail proposal on %s", device)
                dmg.warm_up()
                log.info("Max-Gram's tail proposal compiled in %.1f s", time.perf_counter() - t0)
        return dmg

    @classmethod
    def limits(cls, config, topology) -> tuple[int, int]:
        mg = MaxGramSettings.of(config)
        return MaxGramShare(mg.len, mg.branches, mg.tail).rows, 0  # its largest share

    @classmethod
    def build(cls, ctx: DrafterContext) -> "MaxGramTreeDrafter":
        """On CUDA with ``graph_compile`` and the draft's tree held there (``maxgram_read_tree = false``),
        the tails' proposer is compiled now, at start-up."""
        mg = MaxGramSettings.of(ctx.config)
        drafter = cls(ctx.maxgram, ctx.config.graph_compile, mg.tail)
        pool = getattr(getattr(ctx.proposer, "cache", None), "k", None)  # the draft's KV pool: its device
        if pool is not None and pool.device.type == "cuda" and ctx.config.graph_compile and not mg.read_tree \
                and mg.tail:
            drafter.on_device(pool.device)
        return drafter

    def propose(self, seqs: list[SeqView], plans: list[DraftPlan], trees: list[DraftTree]) -> None:
        """Each planned share: the tail, then the branches.  The tails of unmerged held trees (the draft's
        tokens still on the device) are proposed there, all at once, so that the step reads once."""
        shares = [plan.share(self.name) for plan in plans]
        held = [i for i, (share, tree) in enumerate(zip(shares, trees))
                if share is not None and share.tail and not share.merge and tree.unread is not None
                and tree.num_sub and tree.num_nodes == tree.num_sub]
        if held:
            on_device = self.on_device(trees[held[0]].unread.flat.device)
            on_device.tails([seqs[i] for i in held], [trees[i] for i in held], [shares[i].tail for i in held])
        done = set(held)
        for i, (seq, share, tree) in enumerate(zip(seqs, shares, trees)):
            if share is not None:
                tail = 0 if i in done or tree.has_tail else share.tail
                self.maxgram.extend_tree(seq, tree, tail, share.length, share.branches, share.merge)


def plan_maxgram(p: PlanInput) -> DraftPlan:
    """Max-Gram alone: its branches from the root."""
    if p.room <= 0:
        return DraftPlan(MAXGRAM_METHOD, p.empty)
    mg = MaxGramSettings.of(p.config)
    return DraftPlan(MAXGRAM_METHOD, p.empty, {MAXGRAM_DRAFTER: MaxGramShare(length=min(mg.len, p.room),
                                                                           branches=mg.branches)})


def plan_mcsd_maxgram(p: PlanInput) -> DraftPlan:
    """The draft model's tree, Max-Gram's branches beside it and its tail below the deepest path (without
    ``maxgram_read_tree``: branches of their own, the tail proposed on the device)."""
    if p.room <= 0:
        return DraftPlan(MCSD_MAXGRAM, p.empty)
    mg, sub = MaxGramSettings.of(p.config), p.sub
    tail = min(mg.tail, p.room - sub.max_depth) if sub.num_nodes else 0
    share = MaxGramShare(length=min(mg.len, p.room), branches=mg.branches, tail=tail, trust=mg.trust,
                         merge=mg.read_tree)
    return DraftPlan(MCSD_MAXGRAM, sub, {MAXGRAM_DRAFTER: share})


register_method(Method(MAXGRAM_METHOD, (MAXGRAM_DRAFTER,), plan_maxgram, needs_draft=False, order=20))
register_method(Method(MCSD_MAXGRAM, ("draft-tree", MAXGRAM_DRAFTER), plan_mcsd_maxgram, order=30))
