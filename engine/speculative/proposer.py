"""Draft-model proposer: grows each sequence's draft tree level by level.

Per step and per sequence the draft cache first catches up on the tokens it has not seen (the
root, plus the deepest accepted node of the previous step when the draft never ran it); those are
committed.  Then, for depth ``d = 1..s``, every node of depth ``d-1`` gets ``k_d`` children drawn
from its draft distribution ``q`` (without replacement by default; the top-``k_d`` tokens at
temperature 0), and the new level is run through the draft in one batched forward over all
sequences, attending to its ancestors through rows ``[C_{d-1}:C_d]`` of the prebuilt tree mask.
The deepest level is never run: its nodes have no children to sample.

An optional :class:`~engine.speculative.adaptive.SpecPolicy` is asked after each sampled level whether a
sequence grows another one; a tree that stops is cut to its depth-``d`` prefix (a cached slice of
the prebuilt topology), so the target verifies exactly the drafted nodes.
"""

from __future__ import annotations

from typing import Optional, Sequence as Sequence_

import numpy as np
import torch

from engine.batching import Block, BlockLogits, run_blocks
from engine.device import tensor as device_tensor
from engine.device import to_device, to_device_many, to_host
from engine.kv_cache import KVCache
from engine.models.model import Model
from engine.models.vocab import OutputVocab
from engine.registry import Method, register_drafter, register_method
from engine.sampler import (
    SamplingTensors, draw_uniforms, finish_probs, process_logits, sample_from_probs, sample_k_distinct,
)
from engine.speculative.adaptive import SpecPolicy, StepBudget
from engine.speculative.constrained import mask_rows, path_masks, tree_row_paths
from engine.speculative.draft_tree import DEAD, DraftTree, HeldTokens, index_ranges
from engine.speculative.drafter import DrafterContext
from engine.speculative.features import ParentStats, level_features, parent_stats
from engine.speculative.history import PathCounts
from engine.speculative.methods import DraftPlan, PlanInput
from engine.speculative.tree import SubTree, TreeTopology
from engine.speculative.view import SeqView

DRAFT_TREE_DRAFTER, MCSD = "draft-tree", "mcsd"


class DraftModelProposer:

    def __init__(self, model: Model, cache: KVCache, vocab_size: int, without_replacement: bool = True,
                 topology: Optional[TreeTopology] = None, policy: Optional[SpecPolicy] = None,
                 chunk: int = 512, vocab: Optional[OutputVocab] = None) -> None:
        self.model = model
        self.vocab = vocab  # the draft's output layer restricted to frequent tokens (q = 0 elsewhere); None = all
        self.chunk = chunk  # catch-up tokens per forward
        self.cache = cache
        self.vocab_size = vocab_size  # the target's vocabulary: q is padded to it
        self.without_replacement = without_replacement
        self.topology = topology  # needed only with a policy: the source of cut subtrees
        self.policy = policy

    def propose(self, seqs: list[SeqView], subs: list[SubTree], forced: Optional[list[Optional[list[int]]]] = None,
                step: Optional[StepBudget] = None) -> list[DraftTree]:
        """``forced[j]``: tokens that replace sequence ``j``'s first level (target-initialised candidates,
        a lossy mode); the draft then grows its tree below them as usual, without the policy.
        ``step``: what the policy decided for this step (its budget), handed back to it per level."""
        trees = [DraftTree(sub, [DEAD] * sub.num_nodes) for sub in subs]
        forced = forced or [None] * len(seqs)
        # the tokens stay on the device until the tree is whole, when nothing on the host needs them per level
        kept = DeviceTokens(trees, self.cache.k.device) if self._on_device(seqs) else None
        frontier = self._catch_up(seqs)  # the draft's outputs at the next level's parents
        for d in range(1, max(sub.max_depth for sub in subs) + 1):
            active = [i for i, t in enumerate(trees) if t.sub.max_depth >= d]
            if not active:
                break
            self._sample_level([seqs[i] for i in active], [trees[i] for i in active], d, frontier, kept, active)
            if d == 1 and any(f is not None for f in forced):
                self._force_first_level(trees, forced, kept)
            deeper = [i for i in active if trees[i].sub.max_depth > d and forced[i] is None]
            self._apply_policy(seqs, trees, deeper, d, step)
            to_run = [i for i in active if trees[i].sub.max_depth > d]
            if to_run:
                frontier = self._run_level(seqs, trees, to_run, d, kept)
        if kept is not None:  # read with the step's verification (LosslessRule), or by whoever reads them first
            kept.hold()
        return trees

    @staticmethod
    def _force_first_level(trees: list[DraftTree], forced: list, kept: Optional["DeviceTokens"]) -> None:
        """Each tree with ``forced`` tokens (known on the host: the candidates last step's read
        brought back) gets them as its first level, padded with DEAD."""
        for i, tokens in enumerate(forced):
            if tokens is not None:
                k = trees[i].sub.widths[0]
                level = (list(tokens) + [DEAD] * k)[:k]
                if kept is not None:
                    kept.force(i, level)
                else:
                    trees[i].tokens[:k] = level

    def _on_device(self, seqs: list[SeqView]) -> bool:
        """Whether the step's tokens can stay on the device until its trees are whole (one read for
        the whole tree instead of one per level): nothing on the host reads a level's tokens before
        the next level is drawn: no grammar (its masks follow each row's path) and no per-level
        policy decision (the policy's features, when it learns from them, are read back with the
        tree).  Penalties count each row's path on the device (``history.PathCounts``); a forced first
        level is copied there."""
        if self._level_stop and any(s.request.spec.adaptive is not False for s in seqs):
            return False
        return all(s.grammar is None for s in seqs)

    @property
    def _level_stop(self) -> bool:
        """Whether the policy is asked after each level whether a tree grows another (``SpecPolicy``)."""
        return self.policy is not None and getattr(self.policy, "level_stop", True)

    def _apply_policy(self, seqs: list[SeqView], trees: list[DraftTree], deeper: list[int], d: int,
                      step: Optional[StepBudget]) -> None:
        """Asks the policy whether each tree that could grow past depth ``d`` does; cuts the others."""
        deeper = [i for i in deeper if seqs[i].request.spec.adaptive is not False]
        if not self._level_stop or not deeper:
            return  # (without the per-level stop, the depth was chosen when the step was planned)
        keep = self.policy.keep_drafting([seqs[i] for i in deeper], [trees[i] for i in deeper], d, step)
        for i, k in zip(deeper, keep):
            if not k:
                trees[i].cut(self.topology.subtree(trees[i].sub.widths[:d]))

    # ------------------------------------------------------------------ draft forwards
    def forward(self, blocks: list[Block], ids: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None):
        """One draft forward over ``blocks`` (every drafter that runs the draft model goes through here;
        ``ids``: their tokens already on the device, ``shift``: their positions' offsets there,
        ``run_blocks``)."""
        return run_blocks(self.model, self.cache, blocks, self.vocab, ids=ids, shift=shift)

    def _catch_up(self, seqs: list[SeqView]) -> "Frontier":
        """The draft's outputs at every sequence's root (block and tree ``j``: ``seqs[j]``).

        A sequence drafting for the first time catches up on its whole prompt (draft prefill is lazy,
        see ``ModelRunner.prefill``), at most ``chunk`` tokens per forward."""
        # Blocks of different lengths run packed (no padding), so a prompt's last chunk and a lag of a
        # token or two share the one forward.
        for s in seqs:
            while len(s.tokens) - s.draft_cached > self.chunk:
                self.forward([Block(s.draft_slot, s.tokens[s.draft_cached: s.draft_cached + self.chunk],
                                    list(range(s.draft_cached, s.draft_cached + self.chunk)), [])])
                self.cache.commit(s.draft_slot)
                s.draft_cached += self.chunk
        blocks = []
        for s in seqs:
            new = s.tokens[s.draft_cached:]
            blocks.append(Block(s.draft_slot, new, list(range(s.draft_cached, len(s.tokens))), [len(new) - 1]))
        out, lg = self.forward(blocks)
        for j, s in enumerate(seqs):
            self.cache.commit(s.draft_slot)
            s.draft_cached = len(s.tokens)
        return Frontier(lg, out.hidden, [slice(len(b.tokens) - 1, len(b.tokens)) for b in blocks], range(len(seqs)))

    def _run_level(self, seqs, trees, to_run: list[int], d: int, kept: Optional["DeviceTokens"] = None) -> "Frontier":
        """Level ``d`` of the trees ``to_run`` through the draft: the outputs at their depth-``d`` nodes."""
        blocks = []
        for i in to_run:
            sub, seq = trees[i].sub, seqs[i]
            lv = sub.level(d)
            mask = sub.level_masks[d - 1]  # rows C_{d-1}:C_d, cols :C_d
            toks = [0] * (lv.stop - lv.start) if kept is not None else [t if t != DEAD else 0 for t in trees[i].tokens[lv]]
            root_pos = len(seq.tokens) - 1
            blocks.append(Block(seq.draft_slot, toks, [root_pos + d] * len(toks), list(range(len(toks))), mask))
            trees[i].drafted_levels = d
        out, logits = self.forward(blocks, None if kept is None else kept.level_ids(trees, to_run, d))
        return Frontier(logits, out.hidden, [slice(0, len(bl.tokens)) for bl in blocks], to_run)

    # ------------------------------------------------------------------ sampling children
    def _sample_level(self, seqs: list[SeqView], trees: list[DraftTree], d: int, frontier: "Frontier",
                      kept: Optional["DeviceTokens"], which: list[int]) -> None:
        """Draws the depth-``d`` children of every sequence's depth-(d-1) nodes, all sequences at once.

        ``which[j]``: tree ``j``'s index among the step's trees: in ``frontier`` (the draft's logits and
        hidden states at its depth-(d-1) nodes, in level order) and, when the step's tokens stay on the
        device, in ``kept``; else the level's tokens are read back now.
        """
        parent_rows = [self._parent_rows(t.sub, d) for t in trees]
        row_seq = [j for j, rows in enumerate(parent_rows) for _ in rows]
        x = self._pad_vocab(frontier.logit_rows(which)).float()  # [rows, vocab]
        dev = x.device
        st = SamplingTensors.from_params([s.request.sampling for s in seqs], self.vocab_size, row_seq, device=dev)
        counts, prompt = self._histories(seqs, trees, parent_rows, dev, kept, which)
        x = process_logits(x, st, counts, prompt)
        x = self._constrain(seqs, trees, parent_rows, x)
        widths = [t.sub.widths[d - 1] for t in trees]
        width = max(widths)
        greedy = [seqs[j].request.sampling.greedy for j in row_seq]  # host-side: no read of st.greedy
        g_rows = [r for r in range(len(row_seq)) if greedy[r]]
        s_rows = [r for r in range(len(row_seq)) if not greedy[r]]
        # a level whose rows all draw one way (the usual case) takes every row as it is: no index
        # copied to the device, no gather and no write back
        chosen = None if not g_rows or not s_rows else \
            torch.full((x.shape[0], width), DEAD, dtype=torch.long, device=dev)
        if g_rows:
            at = device_tensor(g_rows, dev) if s_rows else None
            best = (x if at is None else x[at]).topk(width, dim=-1)
            top = torch.where(torch.isfinite(best.values), best.indices, DEAD)  # a token the grammar forbids
            if at is None:  # (-inf) is no child
                chosen = top
            else:
                chosen[at] = top
        first = [0] * len(trees)  # first row of each sequence
        for r in range(len(row_seq) - 1, -1, -1):
            first[row_seq[r]] = r
        probs = None
        if s_rows:
            probs = finish_probs(x, st)  # [rows, vocab]; greedy rows (one-hot) unused
            gens = [seqs[row_seq[r]].generator for r in s_rows]
            row_widths = [widths[row_seq[r]] for r in s_rows]
            if g_rows:
                at = device_tensor(s_rows, dev)
                chosen[at] = self._sample(probs[at], row_widths, gens, width)
            else:
                chosen = self._sample(probs, row_widths, gens, width)
            for r in s_rows:
                j = row_seq[r]
                trees[j].q.set_row(parent_rows[j][r - first[j]], probs, r)  # a row of probs: no view made
        # what the policy learns from the level, on the device (it runs on the host)
        features = self.policy is not None and self.policy.wants_features
        full = features and self.policy.wants_full_features
        device_side = [chosen]
        if features:
            stats = parent_stats(x, probs, st.greedy, chosen, full)
            device_side += [stats.q_children] + ([stats.entropy, stats.top_probs] if full else [])
            device_side += frontier.hidden_of(which) if full else []
        if kept is not None:  # read with the whole tree, later
            kept.place(which, trees, d, first, chosen)
            if features:
                kept.keep_features(which, d, parent_rows, first, full, device_side[1:])
            return
        # the level's one read: its tokens, and the policy's features
        host = to_host(*device_side)
        self._place(trees, d, host[0].tolist(), first)
        if features:
            record_features(trees, d, parent_rows, first, full, host[1:])

    def _constrain(self, seqs: list[SeqView], trees: list[DraftTree], parent_rows: list[list[int]],
                   x: torch.Tensor) -> torch.Tensor:
        """The level's draft rows masked by each constrained sequence's grammar after the row's path
        (``constrained.mask_rows``), so its children are drawn from the masked ``q``."""
        if all(s.grammar is None for s in seqs):
            return x
        parts, at = [], 0
        for s, t, rows in zip(seqs, trees, parent_rows):
            part = x[at: at + len(rows)]
            at += len(rows)
            if s.grammar is not None:
                allowed = path_masks(s.grammar, tree_row_paths(t, rows), self.vocab_size, x.device)
                part = mask_rows(part, allowed)
            parts.append(part)
        return torch.cat(parts)

    @staticmethod
    def _place(trees: list[DraftTree], d: int, chosen: list[list[int]], first: list[int]) -> None:
        """Level ``d`` of ``trees`` from the host's copy of ``chosen`` (:func:`level_slots`)."""
        for j, node, row, rank, parent in zip(*(a.tolist() for a in level_slots(trees, d, first))):
            tree = trees[j]
            tok = chosen[row][rank] if parent < 0 or tree.tokens[parent] != DEAD else DEAD
            tree.tokens[node] = tok if tok >= 0 else DEAD

    def _histories(self, seqs, trees, parent_rows, device: torch.device, kept: Optional["DeviceTokens"] = None,
                   which: Optional[list[int]] = None):
        """Penalty histories of every parent row (None when no sequence uses penalties); the paths of
        trees whose tokens stay on the device (``kept``, tree ``j`` at ``which[j]``) are counted there."""
        if not any(s.request.sampling.needs_history for s in seqs):
            return None, None
        counts, prompts, paths, at = [], [], PathCounts(), 0
        for j, (s, t, rows) in enumerate(zip(seqs, trees, parent_rows)):
            n = len(rows)
            if s.request.sampling.needs_history:
                counts.append(s.output_counts.expand(n, -1))
                prompts.append(s.prompt_mask.expand(n, -1) if s.prompt_mask is not None
                               else torch.zeros(n, self.vocab_size, dtype=torch.bool, device=device))
                if kept is None:
                    paths.add_tree(at, rows, t)
                else:
                    paths.add_tree(at, rows, t, kept.flat, kept.offsets[which[j]])
            else:
                counts.append(torch.zeros(n, self.vocab_size, dtype=torch.int32, device=device))
                prompts.append(torch.zeros(n, self.vocab_size, dtype=torch.bool, device=device))
            at += n
        return paths.into(torch.cat(counts)), torch.cat(prompts)

    @staticmethod
    def _parent_rows(sub: SubTree, d: int) -> list[int]:
        if d == 1:
            return [0]
        prev = sub.level(d - 1)
        return [1 + i for i in range(prev.start, prev.stop)]

    def _sample(self, probs: torch.Tensor, widths: list[int], generators: list[torch.Generator],
                width: int) -> torch.Tensor:
        """probs: [rows, vocab] -> [rows, width] children in sampling order (row r fills widths[r];
        each row draws exactly widths[r] uniforms from its request's generator)."""
        u = draw_uniforms(generators, widths, device=probs.device)
        if u.shape[1] < width:
            u = torch.nn.functional.pad(u, (0, width - u.shape[1]))
        if self.without_replacement:
            out = sample_k_distinct(probs, u)
        else:
            out = torch.stack([sample_from_probs(probs, u[:, j]) for j in range(width)], dim=1)
        if min(widths) == width:  # every row fills the width: nothing past a row's own
            return out
        cols = torch.arange(width, device=probs.device)[None, :]
        return torch.where(cols < device_tensor(widths, probs.device)[:, None], out, DEAD)

    def _pad_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (extra target tokens get -inf: q = 0)."""
        v = logits.shape[-1]
        if v == self.vocab_size:
            return logits
        if v > self.vocab_size:
            return logits[..., : self.vocab_size]
        pad = logits.new_full((*logits.shape[:-1], self.vocab_size - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


class Frontier:
    """The draft's logits and hidden states at the nodes whose children the next level draws, from one
    forward: block ``j`` holds tree ``trees[j]``'s nodes (a catch-up's block: its root alone).  A
    level asks for its trees' logit rows at once (a view of the forward's when every tree of the last
    forward goes on with the same shape) and for hidden states only when the policy reads them."""

    def __init__(self, logits: BlockLogits, hidden: torch.Tensor, rows: list[slice], trees: Sequence_[int]) -> None:
        self.logits = logits
        self.hidden = hidden  # the forward's [blocks, block, hidden]
        self.rows = rows  # block j's nodes among its rows
        self.trees = trees

    def _blocks(self, trees: list[int]) -> list[int]:
        if trees == list(self.trees):
            return list(range(len(trees)))
        at = {t: j for j, t in enumerate(self.trees)}
        return [at[t] for t in trees]

    def logit_rows(self, trees: list[int]) -> torch.Tensor:
        """``[their nodes, vocab]``: the nodes of ``trees``, tree after tree."""
        return self.logits.rows(self._blocks(trees))

    def hidden_of(self, trees: list[int]) -> list[torch.Tensor]:
        """Each tree's ``[its nodes, hidden]``."""
        return [self.hidden[j, self.rows[j]] for j in self._blocks(trees)]

    def roots(self) -> list[torch.Tensor]:
        """Each block's first row's logits ``[vocab]``: a catch-up's, the law after each root."""
        return [lg[0] for lg in self.logits]


def level_slots(trees: list[DraftTree], d: int, first: list[int]) -> tuple[np.ndarray, ...]:
    """Where each depth-``d`` node of ``trees`` comes from, as int64 arrays with an entry a node:
    ``(tree j, node, row of the sampled children it is in, its rank there, parent node or -1 for the
    root)``.  A node takes its row's ``rank``-th child, DEAD when its parent is (both placements follow
    this).  Trees of one shape share their level's arrays (``SubTree.level_slots``): a few numpy calls
    a shape, not a few Python calls a node."""
    groups: dict[int, tuple[SubTree, list[int]]] = {}
    for j, tree in enumerate(trees):
        groups.setdefault(id(tree.sub), (tree.sub, []))[1].append(j)
    parts = []
    for sub, js in groups.values():
        node, pj, rank, up = sub.level_slots[d - 1]
        at = np.asarray(js, dtype=np.int64)[:, None]
        rows = np.asarray([first[j] for j in js], dtype=np.int64)[:, None] + pj
        parts.append([np.broadcast_to(at, rows.shape), np.broadcast_to(node, rows.shape), rows,
                      np.broadcast_to(rank, rows.shape), np.broadcast_to(up, rows.shape)])
    if not parts:
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(5))
    return tuple(np.concatenate([p[i].reshape(-1) for p in parts]) for i in range(5))


def _strided(at: np.ndarray, groups: int) -> Optional[tuple[int, int, int]]:
    """``(offset, stride, 1)`` when ``at`` is ``groups`` runs of consecutive entries, each run the
    same distance after the last, so ``flat[at]`` is a strided view of ``flat``; else None."""
    if not len(at) or len(at) % groups:
        return None
    runs = at.reshape(groups, -1)
    stride = int(runs[1, 0] - runs[0, 0]) if groups > 1 else 0
    want = runs[0, 0] + stride * np.arange(groups)[:, None] + np.arange(runs.shape[1])[None, :]
    apart = groups == 1 or stride >= runs.shape[1]  # (runs that do not overlap)
    return (int(at[0]), stride, 1) if apart and np.array_equal(runs, want) else None


def record_features(trees: list[DraftTree], d: int, parent_rows: list[list[int]], first: list[int], full: bool,
                    host: list[torch.Tensor]) -> None:
    """The level's features, for the policy, from the host copies of what ``_sample_level`` computed:
    q of the children, then (``full``) entropy, top probabilities and each tree's parents' draft hidden
    states.  The trees' tokens must be on the host."""
    stats = ParentStats(host[0], host[1] if full else None, host[2] if full else None)
    hidden = host[3:] if full else [None] * len(trees)
    for j, tree in enumerate(trees):
        rows = slice(first[j], first[j] + len(parent_rows[j]))
        tree.features.append(level_features(stats, rows, tree.sub.widths[d - 1], d,
                                            tree.tokens[tree.sub.level(d)], hidden[j]))


class DeviceTokens(HeldTokens):
    """The drafted tokens of a step's trees while the draft grows them (:class:`HeldTokens`): each
    level's children are placed from the sampled ``chosen`` rows by a gather (a child of a dead node is
    dead), and the next level's token ids are gathered from here.  The policy's features of each level
    come back with the tokens."""

    def __init__(self, trees: list[DraftTree], device: torch.device) -> None:
        super().__init__(trees)  # ``which`` below indexes ``trees``
        flat = torch.full((self.root + 1,), DEAD, dtype=torch.long)
        flat[self.root] = 0
        self.flat = to_device(flat, device)
        # per sampled level, the policy's features still on the device: (which, depth, parent rows, first
        # rows, full, tensors); recorded once the tokens are read
        self.levels: list[tuple] = []

    def place(self, which: list[int], trees: list[DraftTree], d: int, first: list[int],
              chosen: torch.Tensor) -> None:
        """Level ``d`` of ``trees`` (tree ``j`` is entry ``which[j]``) from ``chosen`` [rows, width]."""
        width = chosen.shape[1]
        j, node, row, rank, up = level_slots(trees, d, first)
        off = np.asarray(self.offsets, dtype=np.int64)[np.asarray(which, dtype=np.int64)][j]
        dst, src = off + node, row * width + rank
        # A chosen entry is a token or DEAD.  Below the root every parent is alive; a level of trees of
        # one shape takes ``chosen`` in order (src is every entry) into consecutive nodes: then the level
        # is one write, with no index copied to the device
        in_order = len(src) == chosen.numel() and np.array_equal(src, np.arange(len(src)))
        view = _strided(dst, chosen.shape[0]) if d == 1 and in_order else None
        if view is not None:  # (at batch 1 a slice; else every tree's first level, trees of one size apart)
            self.flat.as_strided(chosen.shape, view[1:], view[0]).copy_(chosen)
            return
        parent = np.where(up < 0, self.root, off + up)
        dst_t, src_t, parent_t = to_device_many([torch.from_numpy(x) for x in (dst, src, parent)], self.flat.device)
        tok = chosen.reshape(-1) if in_order else chosen.reshape(-1).index_select(0, src_t)
        if d > 1:  # a child of a dead node is dead
            tok = torch.where(self.flat.index_select(0, parent_t) != DEAD, tok, DEAD)
        self.flat.index_copy_(0, dst_t, tok)

    def force(self, which: int, tokens: list[int]) -> None:
        """The first nodes of tree ``which`` become ``tokens`` (host-known; DEAD allowed)."""
        off = self.offsets[which]
        src = to_device(torch.tensor(tokens, dtype=torch.long), self.flat.device)
        self.flat[off: off + len(tokens)] = src

    def level_ids(self, trees: list[DraftTree], to_run: list[int], d: int) -> torch.Tensor:
        """Token ids [len(to_run), widest level] of level ``d`` of the trees ``to_run`` (dead: 0)."""
        levels = [trees[i].sub.level(d) for i in to_run]
        lengths = [lv.stop - lv.start for lv in levels]
        at, _ = index_ranges([lv.start + self.offsets[i] for i, lv in zip(to_run, levels)], lengths, max(lengths),
                             self.root)
        ids = self.flat.index_select(0, to_device(torch.from_numpy(at.reshape(-1)), self.flat.device)).view(at.shape)
        return ids.clamp(min=0)

    def keep_features(self, which: list[int], d: int, parent_rows: list[list[int]], first: list[int], full: bool,
                      tensors: list[torch.Tensor]) -> None:
        """A level's features for the policy (``record_features``), read back with the tokens."""
        self.levels.append((list(which), d, parent_rows, first, full, tensors))

    def tensors(self) -> list[torch.Tensor]:
        """What the host reads back: the tokens, then every kept level's features."""
        return [self.flat] + [t for level in self.levels for t in level[5]]

    def fill(self, host: list[torch.Tensor]) -> bool:
        """Every held tree's tokens, then its kept features, from ``host``."""
        if not super().fill(host):
            return False
        at = 1
        for which, d, parent_rows, first, full, tensors in self.levels:
            record_features([self.trees[i] for i in which], d, parent_rows, first, full, host[at: at + len(tensors)])
            at += len(tensors)
        return True


@register_drafter
class DraftTreeDrafter:
    """The draft model's multi-candidate tree: the plan's ``sub`` (methods ``mcsd``, ``mcsd+maxgram``)."""

    name, stage = DRAFT_TREE_DRAFTER, 10

    def __init__(self, proposer: DraftModelProposer) -> None:
        self.proposer = proposer

    @classmethod
    def limits(cls, config, topology: TreeTopology) -> tuple[int, int]:
        return topology.num_nodes, topology.num_nodes

    @classmethod
    def build(cls, ctx: DrafterContext) -> Optional["DraftTreeDrafter"]:
        return cls(ctx.proposer) if ctx.proposer is not None else None

    def propose(self, seqs: list[SeqView], plans: list[DraftPlan], trees: list[DraftTree]) -> None:
        idx = [i for i, p in enumerate(plans) if p.sub.num_nodes > 0]
        if not idx:
            return
        drafted = self.proposer.propose([seqs[i] for i in idx], [plans[i].sub for i in idx], step=plans[idx[0]].step)
        for i, tree in zip(idx, drafted):
            trees[i] = tree


def plan_mcsd(p: PlanInput) -> DraftPlan:
    """The draft model's tree, as the budget and the room allow."""
    return DraftPlan(MCSD, p.sub if p.room > 0 else p.empty)


register_method(Method(MCSD, (DRAFT_TREE_DRAFTER,), plan_mcsd, order=10))
