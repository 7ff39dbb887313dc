"""Target-initialised multi-candidate generation (arXiv 2409.10644): **lossy**, opt-in only
(``speculative.method = "target-init-lossy"``); every response using it carries a note saying so.

Instead of emitting one token drawn from the target at the end of a step, the step draws ``k``
distinct *candidate roots* from that target distribution (the top ``k`` at temperature 0) and emits
nothing for them yet.  The next step drafts a chain under every candidate (the draft tree
``(k, 1, 1, ...)`` with its first level forced to the candidates), the target verifies all of them in
one forward, each chain by the exact rule but without a correction token, and the step keeps the
candidate **whose chain survives longest** (ties: the first drawn) and emits it with its accepted
chain; then it draws the next candidates from the target after the last emitted token (from the
residual ``norm((p - q)+)`` when the kept chain ended in a rejected draft token, so that with
``k = 1`` the mode is exactly speculative sampling and all of its bias comes from the selection).

Why it is lossy: choosing among target samples by how well the *draft* continues them favours
tokens the draft likes; the chi-square harness measures the bias (``tests/engine/speculative/test_lossless.py``).

Bookkeeping: the last emitted token of a step stays out of the target cache (the engine's invariant:
the root is uncached), so the next block is ``[root, candidates, chains]`` exactly like any tree.  A
sequence's first step only draws candidates (it emits nothing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from engine.config import DrafterSettings, setting
from engine.device import Pending, to_device
from engine.registry import Method, drafter_settings, register_drafter, register_method, register_rule
from engine.sampler import SamplingTensors, finish_probs, sample_k_distinct
from engine.speculative.draft_tree import DEAD, DraftTree
from engine.speculative.drafter import DrafterContext
from engine.speculative.methods import DraftPlan, PlanInput
from engine.speculative.tree import TreeTopology
from engine.speculative.verify import (
    TreeBatch, emitted_logprobs, residual_rows, target_rows, unpack_logprobs, with_held_tokens,
)
from engine.speculative.walk import Coins, SeqStepResult, VerifyResult

if TYPE_CHECKING:
    from engine.speculative.view import SeqView

TARGET_INIT_METHOD, TARGET_INIT_RULE = "target-init-lossy", "target-init"
TARGET_INIT_SHARE = "target-init"  # the draft-tree drafter forces the candidates as level 1 (sub is (k, 1, ...))
TARGET_INIT_NOTE = ("lossy: target-initialised candidates keep the target-sampled token whose draft continuation "
                    "survives longest, which biases the output towards tokens the draft predicts well")


@drafter_settings("target_init")
@dataclass(frozen=True)
class TargetInitSettings(DrafterSettings):
    """The target-initialised mode's settings (``--target-init-k``, ...)."""

    k: int = setting(3, "target-initialised (lossy, opt-in): candidate roots", ge=1, le=16)
    depth: int = setting(3, "target-initialised: tokens per candidate chain", ge=1, le=32)

    @property
    def topology(self) -> TreeTopology:
        return init_topology(self.k, self.depth)


@functools.cache
def init_topology(k: int, depth: int) -> TreeTopology:
    """The mode's tree: ``k`` candidate roots, each with a chain below it."""
    return TreeTopology((k,) + (1,) * (depth - 1))


@register_drafter
class TargetInitDrafter:
    """The draft model's chains below last step's candidates: the plan's share is their tree, the
    (k, 1, ...) topology cut to the room (empty on a sequence's first step, which only draws them)."""

    name, stage = TARGET_INIT_SHARE, 10

    def __init__(self, proposer) -> None:
        self.proposer = proposer

    @classmethod
    def limits(cls, config, topology: TreeTopology) -> tuple[int, int]:
        nodes = TargetInitSettings.of(config).topology.num_nodes
        return nodes, nodes

    @classmethod
    def build(cls, ctx: DrafterContext) -> Optional["TargetInitDrafter"]:
        return cls(ctx.proposer) if ctx.proposer is not None else None

    def propose(self, seqs: list[SeqView], plans: list[DraftPlan], trees: list[DraftTree]) -> None:
        subs = [p.share(self.name) for p in plans]
        idx = [i for i, sub in enumerate(subs) if sub is not None and sub.num_nodes > 0]
        if not idx:
            return
        drafted = self.proposer.propose([seqs[i] for i in idx], [subs[i] for i in idx],
                                        [seqs[i].carry[TARGET_INIT_SHARE] for i in idx])
        for i, tree in zip(idx, drafted):
            trees[i] = tree


def plan_target_init(p: PlanInput) -> DraftPlan:
    """Chains below the candidates drawn last step, as deep as the room allows; a sequence's first step
    drafts nothing (its share is the empty tree) and only draws candidates."""
    settings = TargetInitSettings.of(p.config)
    topology = settings.topology
    if TARGET_INIT_SHARE not in p.seq.carry:
        return DraftPlan(TARGET_INIT_METHOD, p.empty, {TARGET_INIT_SHARE: topology.subtree(())})
    depth = min(settings.depth, p.room + 1)  # the candidate itself, then its chain
    return DraftPlan(TARGET_INIT_METHOD, p.empty, {TARGET_INIT_SHARE: topology.subtree(topology.widths[:depth])})


register_method(Method(TARGET_INIT_METHOD, (TARGET_INIT_SHARE,), plan_target_init, lossy_note=TARGET_INIT_NOTE,
                       rule=TARGET_INIT_RULE, grammar=False, order=60))


def verify_target_init(accept: Callable[[int, int], bool], tokens: list[int],
                       children: list[list[int]]) -> tuple[VerifyResult, bool]:
    """``accept(row, node)``: the exact rule for one drafted node below block row ``row`` (the caller
    keeps the generator state).  Candidates are the root's children; each chain is walked until its first
    rejection.  Returns the best candidate with its accepted chain (no correction or bonus token) and
    whether that chain ended in a rejected node (then the next candidates come from the residual)."""
    best: list[int] = []
    best_rejected = False
    for cand in (c for c in children[0] if tokens[c] != DEAD):
        chain, row, rejected = [cand], cand + 1, False
        while True:
            kids = [c for c in children[row] if tokens[c] != DEAD]
            if not kids:
                break
            if not accept(row, kids[0]):
                rejected = True
                break
            chain.append(kids[0])
            row = kids[0] + 1
        if len(chain) > len(best):
            best, best_rejected = chain, rejected
    final_row = best[-1] + 1 if best else 0
    return VerifyResult(best, [tokens[i] for i in best], bonus=False, final_row=final_row,
                        rows=[0] + [1 + i for i in best[:-1]]), best_rejected


def draw_candidates(x: torch.Tensor, probs: torch.Tensor, st: SamplingTensors, k: int, coins: Coins) -> list[int]:
    """``k`` distinct candidate roots: the top ``k`` of the processed logits ``x`` [vocab] for greedy
    requests, else drawn without replacement from ``probs`` [vocab] (the target's sampling distribution
    there, or the residual left by a rejected draft token, so that ``k = 1`` is exact)."""
    if bool(st.greedy[0]):
        return x.topk(k).indices.tolist()
    return coins.draw_distinct(probs, k)


def start_target_init(x: torch.Tensor, st: SamplingTensors, trees: TreeBatch, u_accept: torch.Tensor,
                      u_cand: torch.Tensor, k: int, raw_logits: Optional[torch.Tensor] = None,
                      logprobs: Sequence[Optional[int]] = ()) -> Pending:
    """:func:`verify_target_init` and :func:`draw_candidates` for a batch, as tensor operations with
    one read (the pending's).

    x: [B, R, V] processed target logits of every block row; st: their sampling parameters (``B * R``
    rows); trees: the batch's trees (``(k, 1, ...)`` with the candidates as level 1); u_accept: [B, R]
    the acceptance uniform of
    each row's first live child; u_cand: [B, k] the uniforms of the next candidates; raw_logits:
    [B, R, V] the model's logits, for ``logprobs[b]`` alternatives (``None``: no logprobs).  The walk's
    decisions read exactly these numbers (:class:`TargetInitCoins`), so the two agree draw for draw.
    The pending returns, per sequence, ``(VerifyResult, next candidates, logprobs or None)``."""
    b, r, v = trees.num_seqs, trees.num_rows, x.shape[-1]
    dev = x.device
    x = x[:, :r]
    greedy = st.greedy.view(b, r)
    probs = finish_probs(x.reshape(b * r, v), st).view(b, r, v)
    seq = torch.arange(b, device=dev)
    # each row's first live child (the chain's next node) and whether the rule accepts it
    first = trees.event_node[:, :, 0]  # [B, R]; events are in sibling order and a chain row has one child
    tok = trees.tokens.gather(1, (first + 1).clamp(min=0))  # [B, R] the child's token
    q_row = torch.zeros(b * r, v, dtype=torch.float32, device=dev)
    q_row[trees.ev_rows] = trees.q
    q_x = q_row.view(b, r, v).gather(2, tok[..., None])[..., 0].double()
    p_x = probs.gather(2, tok[..., None])[..., 0].double()
    ok = torch.where(greedy, x.argmax(dim=-1) == tok, u_accept.double() * q_x < p_x) & (first >= 0)
    # chains: candidate c (a root child) grows while its rows accept their child
    cands = trees.event_node[:, 0]  # [B, E] the root's children in order (-1 padding)
    n_cand = cands.shape[1]
    chain = torch.full((b, n_cand, max(trees.depth, 1)), -1, dtype=torch.long, device=dev)
    chain[:, :, 0] = cands
    rejected = torch.zeros(b, n_cand, dtype=torch.bool, device=dev)
    node, alive = cands, cands >= 0
    for d in range(1, trees.depth):
        row = (node + 1).clamp(min=0)
        nxt, acc = first.gather(1, row), ok.gather(1, row)
        rejected |= alive & (nxt >= 0) & ~acc
        alive = alive & acc & (nxt >= 0)
        node = torch.where(alive, nxt, node)
        chain[:, :, d] = torch.where(alive, nxt, -1)
    length = (chain >= 0).sum(dim=2)  # [B, C]
    best = (length * (n_cand + 1) - torch.arange(n_cand, device=dev)).argmax(dim=1)  # longest; ties: the first
    best_chain = chain[seq, best]  # [B, D]
    best_len = length[seq, best]
    best_rejected = rejected[seq, best] & (best_len > 0)
    last = best_chain.gather(1, (best_len - 1).clamp(min=0)[:, None])[:, 0]
    final_row = torch.where(best_len > 0, last + 1, 0)
    # the next candidates, from the final row (the residual after a rejected draft token)
    p_final = probs[seq, final_row]
    q_final = q_row.view(b, r, v)[seq, final_row]
    law = torch.where(best_rejected[:, None], residual_rows(p_final, q_final), p_final)
    drawn = sample_k_distinct(law, u_cand)
    top = x[seq, final_row].topk(k, dim=-1).indices
    nxt_cands = torch.where(greedy[seq, final_row][:, None], top, drawn)
    best_tokens = trees.tokens.gather(1, (best_chain + 1).clamp(min=0))
    packed = [torch.cat([best_chain, best_tokens, best_len[:, None], final_row[:, None], nxt_cands], dim=1)]
    depth = best_chain.shape[1]
    if raw_logits is not None:  # the chain's rows: the root's, then each kept node's parent's
        rows = torch.cat([torch.zeros_like(best_chain[:, :1]), (best_chain[:, :-1] + 1).clamp(min=0)], dim=1)
        packed += emitted_logprobs(raw_logits[:, :r], rows, best_tokens, logprobs)

    def finish(host: list[torch.Tensor]) -> list[tuple[VerifyResult, list[int], Optional[list]]]:
        out = []
        for i, vals in enumerate(host[0].tolist()):
            n, final = vals[2 * depth], vals[2 * depth + 1]
            nodes = vals[:n]
            result = VerifyResult(nodes, vals[depth: depth + n], bonus=False, final_row=final,
                                  rows=[0] + [1 + node for node in nodes[:-1]])
            lps = unpack_logprobs(host[1:], i, result.tokens, logprobs[i] if i < len(logprobs) else None)
            out.append((result, [t for t in vals[2 * depth + 2: 2 * depth + 2 + k] if t >= 0], lps))
        return out

    return Pending(packed, finish)


class TargetInitRule:
    """The target-initialised mode's rule (lossy by design): :func:`start_target_init` for a group of
    sequences at once.  The accepted path's last node is the next root, left uncached."""

    def __init__(self, k: int, vocab_size: int) -> None:
        self.k = k
        self.vocab_size = vocab_size

    def claims(self, plan: DraftPlan, tree: DraftTree) -> bool:
        # the mode's own steps, a first one with no tree included (it draws the candidates); a request
        # whose speculation is off, or that has no draft slot, decodes plainly by the lossless rule
        return plan.share(TARGET_INIT_SHARE) is not None

    def start(self, seqs: list[SeqView], trees: list[DraftTree], logits: torch.Tensor) -> Pending:
        dev, k = logits.device, self.k
        batch, raw, x, st, params = target_rows(seqs, trees, logits, self.vocab_size)
        u_accept = torch.zeros(len(seqs), batch.num_rows)
        u_cand = torch.zeros(len(seqs), k)
        for i, (seq, tree, p) in enumerate(zip(seqs, trees, params)):
            if not p.greedy:  # its own rows and k, so what a seeded request draws does not depend on the batch
                rows = 1 + tree.num_nodes
                u = torch.rand(rows + k, generator=seq.generator)
                u_accept[i, :rows], u_cand[i] = u[:rows], u[rows:]
        pending = start_target_init(x, st, batch, to_device(u_accept, dev), to_device(u_cand, dev), k,
                                    raw_logits=raw, logprobs=[p.logprobs for p in params])

        def results(decided: list) -> list[SeqStepResult]:
            return [SeqStepResult(seq, res, tree, lps, raw[i, : 1 + tree.num_nodes], {TARGET_INIT_SHARE: cands},
                                  last_is_root=True)
                    for i, (seq, tree, (res, cands, lps)) in enumerate(zip(seqs, trees, decided))]
        return with_held_tokens(trees, pending).then(results)


register_rule(TARGET_INIT_RULE,
              lambda config, vocab_size: TargetInitRule(TargetInitSettings.of(config).k, vocab_size))


class TargetInitCoins:
    """The walk's coins reading :func:`start_target_init`'s numbers: the tests' oracle."""

    def __init__(self, u_accept: torch.Tensor, u_cand: torch.Tensor) -> None:  # [R], [k]
        self.u_accept, self.u_cand = u_accept, u_cand

    def accept(self, p_x: float, q_x: float, row: int = 0, event: int = 0) -> bool:
        return float(self.u_accept[row]) * q_x < p_x

    def draw(self, p: torch.Tensor, row: int = 0) -> int:
        raise NotImplementedError("target-initialised steps draw candidates, not single tokens")

    def draw_distinct(self, p: torch.Tensor, k: int) -> list[int]:
        return [t for t in sample_k_distinct(p[None], self.u_cand[None, :k])[0].tolist() if t >= 0]
