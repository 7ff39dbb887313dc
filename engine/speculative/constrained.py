"""Speculation under a grammar (structured outputs): masked rows, pruned trees, forced drafts.

Under a grammar the law to reproduce is the *masked* target's: at every block row the target's
logits lose the tokens the grammar forbids after that row's path, before logit bias, penalties,
temperature, top-k/p and min-p (``verify.processed_rows`` calls :func:`allowed_rows`).  The
acceptance rule is unchanged, so it stays exact with respect to that law, whatever proposed the
tree, provided each proposal event states its law truly:

* the draft model's sampled children come from its own rows masked the same way (:func:`mask_rows`,
  called by the proposer and the cascade), and that masked ``q`` is what verification is told;
* a one-hot proposal the grammar forbids has masked target probability 0: it is never accepted, and
  rejecting it leaves the law as it was, so removing it changes nothing.  :class:`GrammarDrafter`
  marks such nodes (and everything below them) dead before the target forward, so verification
  does not try them;
* a token the grammar *forces* (the only one allowed after a path) has masked probability 1: the
  same drafter appends the forced run below the deepest live leaf (or the root) as one-hot drafts
  that cost no draft forward.  They are verified like any node, so a forced token is accepted
  exactly when its path is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.config import DrafterSettings, setting
from engine.device import to_device
from engine.grammar import GrammarState, Masks, apply_mask, unpack, words
from engine.registry import drafter_settings, register_drafter
from engine.speculative.draft_tree import DEAD, DraftTree
from engine.speculative.drafter import DrafterContext
from engine.speculative.methods import DraftPlan
from engine.speculative.view import SeqView

GRAMMAR_DRAFTER = "grammar"


@drafter_settings("grammar")
@dataclass(frozen=True)
class GrammarSettings(DrafterSettings):
    forced: int = setting(16, "tokens the grammar forces that a step drafts at most (0: none)", ge=0, le=64)


@dataclass(frozen=True)
class ForcedShare:
    """The planner's share for the grammar drafter: the deepest a forced token may sit (the room).
    Its rows are unknown until the grammar is asked, so it prices none."""

    room: int
    rows: int = 0


def tree_masks(seq: SeqView, tree: DraftTree) -> Masks:
    """The allowed tokens at every block row of ``seq``'s tree (row 0 the root), cached in the tree."""
    if tree.grammar_masks is None or tree.grammar_masks.bitmask.shape[0] != 1 + tree.num_nodes:
        tree.grammar_masks = seq.grammar.tree_masks(tree.tokens, tree.parents())
    return tree.grammar_masks


def allowed_rows(seqs: list[SeqView], trees: list[DraftTree], rows: int, vocab_size: int,
                 device: torch.device) -> Optional[torch.Tensor]:
    """``[B, rows, vocab]`` bool: the tokens each tree row allows (every token for sequences without a
    grammar, and for padding rows); None when no sequence has a grammar.  Built on the host as
    bitmasks, moved once, unpacked on the device."""
    if all(s.grammar is None for s in seqs):
        return None
    bm = torch.full((len(seqs), rows, words(vocab_size)), -1, dtype=torch.int32)
    for i, (s, t) in enumerate(zip(seqs, trees)):
        if s.grammar is not None:
            m = tree_masks(s, t).bitmask[:rows]
            bm[i, : m.shape[0]] = m
    return unpack(to_device(bm, device), vocab_size)


def path_masks(grammar: GrammarState, paths: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[len(paths), vocab]`` bool on ``device``: the tokens allowed after each path."""
    return unpack(to_device(grammar.masks(paths).bitmask, device), vocab_size)


def mask_rows(x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A draft's logits ``x`` under the grammar's ``allowed`` tokens.  A row left with no finite logit
    (the draft's cut vocabulary misses every allowed token) becomes uniform over the allowed tokens:
    any law is a valid draft law, as long as verification is told the one sampled from."""
    y = apply_mask(x, allowed)
    empty = ~torch.isfinite(y).any(dim=-1, keepdim=True)
    return torch.where(empty & allowed, torch.zeros_like(y), y)


def tree_row_paths(tree: DraftTree, rows: list[int]) -> list[list[int]]:
    """The paths of block rows ``rows`` of ``tree`` (row 0: [], row ``i + 1``: node ``i``'s)."""
    return [tree.path_to(r - 1) if r else [] for r in rows]


@register_drafter
class GrammarDrafter:
    """Prunes what the grammar forbids from every constrained tree and appends the tokens it forces.
    Runs last, for every method (``every_method``): the planner gives each constrained sequence a
    :class:`ForcedShare`."""

    name, stage = GRAMMAR_DRAFTER, 95
    every_method = True

    def __init__(self, limit: int) -> None:
        self.limit = limit

    @classmethod
    def limits(cls, config, topology) -> tuple[int, int]:
        return GrammarSettings.of(config).forced, 0

    @classmethod
    def build(cls, ctx: DrafterContext) -> "GrammarDrafter":
        return cls(GrammarSettings.of(ctx.config).forced)

    def propose(self, seqs: list[SeqView], plans: list[DraftPlan], trees: list[DraftTree]) -> None:
        for seq, plan, tree in zip(seqs, plans, trees):
            if seq.grammar is None:
                continue
            self._prune(seq, tree)
            share = plan.share(self.name)
            if share is not None and self.limit:
                self._extend(seq, tree, share.room)

    @staticmethod
    def _prune(seq: SeqView, tree: DraftTree) -> None:
        """Marks the nodes whose path the grammar forbids dead (their subtrees with them)."""
        if not tree.num_nodes:
            return
        masks = tree_masks(seq, tree)
        for i, ok in enumerate(masks.valid[1:]):
            if not ok:
                tree.tokens[i] = DEAD

    def _extend(self, seq: SeqView, tree: DraftTree, room: int) -> None:
        """Appends the run the grammar forces below the deepest live leaf (the root if none), and its
        rows' masks to the tree's, so verification fills no row twice."""
        leaves = tree.leaves()
        leaf = leaves[0] if leaves else -1
        depth = tree.depths()[leaf] if leaf >= 0 else 0
        path = tree.path_to(leaf)
        forced = seq.grammar.forced(path, min(self.limit, room - depth))
        if not forced:
            return
        before = tree_masks(seq, tree)
        tree.add_path(leaf, forced, GRAMMAR_DRAFTER)  # a leaf has no live child: every token is a new node
        run = seq.grammar.masks([path + forced[: k + 1] for k in range(len(forced))])
        tree.grammar_masks = Masks(torch.cat([before.bitmask, run.bitmask]), before.valid + run.valid)
