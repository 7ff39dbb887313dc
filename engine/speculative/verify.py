"""Batched lossless verification: every sequence's tree of one step, as tensor operations on the
model's device, with one synchronization at the end.

The rule is the multi-candidate one written out in ``engine.speculative.walk`` (and proven in
``docs/algorithms.md``).  Here it runs for the whole batch at once:

1. **Trees as padded tensors** (:class:`TreeBatch`).  Sequence ``b``'s block row ``r`` (row 0 the
   root, node ``i`` row ``i + 1``) has its proposal events in verification order: ``node``,
   ``token`` and ``kind`` (``ONEHOT``: a deterministic proposal, law ``e_x``; ``SAMPLED``: drawn from
   the draft's ``q`` at that row, stored in ``q`` and pointed to by ``q_index``).  Rows are sorted by
   their number of events, so the rows that have an ``j``-th event are a prefix of length
   ``active[j]`` and each round works on a slice.
2. **Every row at once.**  A row's events are tried in order with the row's own random numbers
   (``u_accept[b, r, j]``): accepted when ``u * q(x) < p(x)`` (``q = 1`` for a one-hot event), and
   on a rejection the target law becomes the residual (``norm((p - q)+)``, or ``p`` without ``x``
   for a one-hot event) and, without replacement, ``x`` leaves ``q``.  Which event a row accepts does
   not depend on anything but the row, so all rows of all sequences run together, one round per
   event index.  Greedy rows take the first event whose token is the target's argmax.
3. **The walk** goes down from the root through each row's accepted child, ``depth`` rounds of
   ``gather``.  It ends at the first row with nothing accepted: its remaining law gives the final
   token (a *correction* when the row had events, a *bonus* when it had none), drawn by inverse CDF
   from ``u_final[b, row]``; greedy rows emit the argmax.
4. **One sync.**  The accepted paths, final rows and tokens (and the logprobs asked for) come back
   together through :func:`engine.device.to_host`.

Random numbers come from each request's seeded generator, ``rows * (events + 1)`` uniforms for its
own tree, drawn in one call per step (:func:`draw_tables`), so a seeded request draws the same
numbers whatever shares its batch (its tree itself may still depend on load: adaptive speculation).
The per-row walk driven by the same table (:class:`TableCoins`) gives identical results
(``tests/engine/speculative/test_verify.py``), which carries the walk's exact-law proofs over to this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

import numpy as np
import torch

from engine.device import tensor as device_tensor
from engine.device import Pending, to_device_many
from engine.grammar import apply_mask
from engine.registry import LOSSLESS_RULE, rule_factories
from engine.request import TokenLogprob
from engine.sampler import (
    SamplingTensors, draw_uniforms, finish_probs, process_logits, raw_logprobs, sample_from_probs,
)
from engine.speculative.constrained import allowed_rows
from engine.speculative.draft_tree import DEAD, SAMPLED, DraftTree, gather_laws, holders, joined
from engine.speculative.history import batch_histories
from engine.speculative.view import SeqView
from engine.speculative.walk import SeqStepResult, VerifyResult

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.speculative.methods import DraftPlan


@dataclass
class TreeBatch:
    """The step's trees, padded, on the device.  ``K`` rows have events (sorted by their number of
    events, most first); ``E`` is the most events of a row.

    A tree whose tokens are still on the device (``DraftTree.unread``: the draft model's tree, which
    the host has not read) enters with every drafted node's event, its tokens gathered on the device;
    ``ev_live`` marks the events whose token is not DEAD, and the walk skips the others exactly as if
    they were absent (they change neither the accepted event nor the residual laws)."""

    num_seqs: int
    num_rows: int  # R: block rows of the largest tree (1 + nodes)
    depth: int  # the deepest path: rounds of the walk
    tokens: torch.Tensor  # [B, R] long: the token of each block row (the root's is unused)
    num_events: torch.Tensor  # [B, R] long: live events per row (0: the walk ends there with a bonus)
    event_node: torch.Tensor  # [B, R, E] long: node of each event, -1 padding
    ev_rows: torch.Tensor  # [K] long: flat index ``b * R + r`` of the rows with events
    ev_token: torch.Tensor  # [K, E] long: the events' tokens (0 padding)
    ev_sampled: torch.Tensor  # [K, E] bool: SAMPLED (else ONEHOT)
    active: list[int]  # active[j]: rows with more than j events (a prefix of the K rows)
    kinds: list[tuple[bool, bool]]  # per event round j (host): any SAMPLED, any ONEHOT event among its rows
    q: torch.Tensor  # [K, V] float32: each row's draft law (zeros where it has no sampled event)
    shapes: list[tuple[int, int]]  # per sequence: its own rows and most events of a row (host)
    ev_live: Optional[torch.Tensor] = None  # [K, E] bool: the event's token is not DEAD (None: every event is)
    ev_valid: Optional[torch.Tensor] = None  # [K, E] bool: an event, not padding (j < the row's events)

    @classmethod
    def build(cls, trees: Sequence[DraftTree], vocab_size: int, device: torch.device) -> "TreeBatch":
        b = len(trees)
        r = max(1 + t.num_nodes for t in trees)
        depth = max((max(t.depths()) for t in trees if t.num_nodes), default=0)
        held_by = holders(trees)
        flat, base = joined(held_by)
        # every event of every tree as flat arrays (numpy: a step's events are hundreds at batch 32, and
        # per-event Python or per-element tensor writes cost more than the step's device work)
        tokens = np.zeros((b, r), dtype=np.int64)
        tok_src = np.full((b, r), -1, dtype=np.int64)  # where a token still on the device is (flat index)
        parts = []  # per tree: (rows, nodes, kinds, sources (flat index or -1), host tokens)
        for i, tree in enumerate(trees):
            holder = tree.unread
            if holder is None:
                known = np.asarray(tree.tokens, dtype=np.int64)
                tokens[i, 1: 1 + len(known)] = np.maximum(known, 0)
                rows, nodes, kinds = tree.event_table()
                src = np.full(len(nodes), -1, dtype=np.int64)
            else:  # every drafted node's event; which are live is known on the device only
                off, size = base[id(holder)] + holder.offset_of(tree), tree.num_held
                tok_src[i, 1: 1 + size] = np.arange(off, off + size)
                known = np.asarray([0] * size + tree.known_tokens_after(size), dtype=np.int64)  # appended: the host's
                tokens[i, 1 + size: 1 + len(known)] = known[size:]
                rows, nodes, kinds = tree.event_table(live_only=False)
                src = np.where(nodes < size, off + nodes, -1)
            parts.append((rows, nodes, kinds, src, np.where(src < 0, known[nodes], 0)))
        ev_b = np.repeat(np.arange(b), [len(p[0]) for p in parts])
        ev_row, ev_node, ev_kind, ev_src_flat, ev_tok_flat = (
            np.concatenate([p[f] for p in parts]) if parts else np.zeros(0, dtype=np.int64) for f in range(5))
        key = ev_b * r + ev_row  # events are grouped by row, rows ascending within a tree
        counts = np.bincount(key, minlength=b * r)  # events a row
        first = np.searchsorted(key, key)  # a row's first event (keys ascend: trees in order, rows ascending)
        ev_j = np.arange(len(key)) - first  # the event's place in its row
        row_keys = np.flatnonzero(counts)
        row_keys = row_keys[np.argsort(-counts[row_keys], kind="stable")]  # most events first; ties in (b, row) order
        k, e = len(row_keys), max(int(counts.max()) if len(key) else 0, 1)
        rank = np.empty(b * r, dtype=np.int64)
        rank[row_keys] = np.arange(k)
        ev_n = rank[key]
        event_node = np.full((b * r, e), -1, dtype=np.int64)
        event_node[key, ev_j] = ev_node
        ev_token, ev_src = np.zeros((k, e), dtype=np.int64), np.full((k, e), -1, dtype=np.int64)
        ev_sampled, ev_valid = np.zeros((k, e), dtype=bool), np.zeros((k, e), dtype=bool)
        ev_token[ev_n, ev_j], ev_src[ev_n, ev_j] = ev_tok_flat, ev_src_flat
        ev_sampled[ev_n, ev_j], ev_valid[ev_n, ev_j] = ev_kind == SAMPLED, True
        row_counts = counts[row_keys]
        active = [int(x) for x in (row_counts[:, None] > np.arange(e)[None, :]).sum(axis=0)]
        kinds = [(bool(ev_sampled[:k_j, j].any()), not bool(ev_sampled[:k_j, j].all())) for j, k_j in enumerate(active)]
        shapes = [(1 + t.num_nodes, int(c)) for t, c in zip(trees, counts.reshape(b, r).max(axis=1))]
        q = torch.zeros(k, vocab_size, dtype=torch.float32, device=device)
        if any(t.q for t in trees):  # each row's draft law, where the row has a sampled event
            at = np.flatnonzero(ev_sampled.any(axis=1))
            tree_of, row_of = np.divmod(row_keys[at], r)
            places = [trees[i].q.where(row) for i, row in zip(tree_of.tolist(), row_of.tolist())]
            q_at = [n for n, place in zip(at.tolist(), places) if place is not None]
            if q_at:  # a few hundred rows a step at batch 32: gathered by level, then one write
                q[device_tensor(q_at, device)] = gather_laws([p for p in places if p is not None], vocab_size).to(device)
        as_torch = [torch.from_numpy(x) for x in (tokens, event_node.reshape(b, r, e), row_keys, ev_token, ev_sampled)]
        if not held_by:
            host = [as_torch[0], torch.from_numpy(counts.reshape(b, r)), *as_torch[1:], torch.from_numpy(ev_valid)]
            *tensors, ev_valid = to_device_many(host, device)
            return cls(b, r, depth, *tensors, active, kinds, q, shapes, ev_valid=ev_valid)
        (tokens, event_node, ev_rows, ev_token, ev_sampled, ev_valid, ev_src, tok_src) = to_device_many(
            [*as_torch, torch.from_numpy(ev_valid), torch.from_numpy(ev_src), torch.from_numpy(tok_src)], device)
        held = flat.index_select(0, ev_src.clamp(min=0).view(-1)).view(k, e)
        on_device = ev_src >= 0
        ev_live = torch.where(on_device, held != DEAD, ev_valid)
        ev_token = torch.where(on_device, held.clamp(min=0), ev_token)
        held_tokens = flat.index_select(0, tok_src.clamp(min=0).view(-1)).view(b, r)
        tokens = torch.where(tok_src >= 0, held_tokens.clamp(min=0), tokens)
        num_events = torch.zeros(b * r, dtype=torch.long, device=device).index_add_(
            0, ev_rows, ev_live.sum(dim=1)).view(b, r)
        return cls(b, r, depth, tokens, num_events, event_node, ev_rows, ev_token, ev_sampled, active, kinds, q,
                   shapes, ev_live, ev_valid)


@dataclass
class Uniforms:
    """One step's random numbers: ``accept[b, r, j]`` for event ``j`` of row ``r``, ``final[b, r]``
    for a final token drawn at row ``r``."""

    accept: torch.Tensor  # [B, R, E] float32
    final: torch.Tensor  # [B, R] float32


def draw_tables(generators: Sequence[Optional[torch.Generator]], batch: TreeBatch, device: torch.device) -> Uniforms:
    """Each sequence's uniforms from its own generator, in one call: ``rows * (events + 1)`` for
    its own tree's rows and events, so what a seeded request draws does not depend on the other
    trees of the batch.  Greedy sequences (``None``) draw nothing; unused entries are 0.  Moved to
    ``device`` once."""
    b, r, e = len(generators), batch.num_rows, batch.ev_token.shape[1]
    tables = torch.zeros(b * r * e + b * r, dtype=torch.float32)  # the [B, R, E] table, then the [B, R] one
    drawn, at = [], []
    for i, (g, (rows, events)) in enumerate(zip(generators, batch.shapes)):
        if g is not None:  # (where its numbers go: numpy, one write for the batch, not two a sequence)
            drawn.append(torch.rand(rows * (events + 1), generator=g, dtype=torch.float32))
            at.append(((i * r + np.arange(rows)[:, None]) * e + np.arange(events)).reshape(-1))
            at.append(b * r * e + i * r + np.arange(rows))
    if drawn:
        tables[torch.from_numpy(np.concatenate(at))] = drawn[0] if len(drawn) == 1 else torch.cat(drawn)
    accept, final = to_device_many([tables[: b * r * e].view(b, r, e), tables[b * r * e:].view(b, r)], device)
    return Uniforms(accept, final)


@dataclass
class Outcome:
    """What verification decided, per sequence, on the host."""

    results: list[VerifyResult]
    logprobs: list[Optional[list[TokenLogprob]]]


class TableCoins:
    """The walk's coins (``engine.speculative.walk.Coins``) reading one sequence's uniform table,
    as :func:`verify_batch` does: the oracle of the tests, and a way to replay a step."""

    def __init__(self, accept: torch.Tensor, final: torch.Tensor) -> None:  # [R, E], [R]
        self.u_accept, self.u_final = accept, final

    def accept(self, p_x: float, q_x: float, row: int = 0, event: int = 0) -> bool:
        return float(self.u_accept[row, event]) * q_x < p_x

    def draw(self, p: torch.Tensor, row: int = 0) -> int:
        return int(sample_from_probs(p[None], self.u_final[row: row + 1])[0])

    def draw_distinct(self, p: torch.Tensor, k: int) -> list[int]:
        raise NotImplementedError("the table holds verification's uniforms only")


def verify_batch(x: torch.Tensor, st: SamplingTensors, trees: TreeBatch, uniforms: Optional[Uniforms],
                 without_replacement: bool = True, raw_logits: Optional[torch.Tensor] = None,
                 logprobs: Sequence[Optional[int]] = ()) -> Outcome:
    """Verifies ``trees`` against the target (:func:`start_verify`, then its one read)."""
    return start_verify(x, st, trees, uniforms, without_replacement, raw_logits, logprobs).result()


def start_verify(x: torch.Tensor, st: SamplingTensors, trees: TreeBatch, uniforms: Optional[Uniforms],
                 without_replacement: bool = True, raw_logits: Optional[torch.Tensor] = None,
                 logprobs: Sequence[Optional[int]] = ()) -> Pending:
    """Decides the step on the device; the :class:`~engine.device.Pending` it returns reads the
    decisions back (alone, or with other rules' in one synchronization) and unpacks the :class:`Outcome`.

    x: [B, R, V] the target's processed logits at every block row (logit_bias and penalties applied,
    each row with its own path's history: ``engine.sampler.process_logits``); st: the sampling
    parameters of those ``B * R`` rows; uniforms: the step's random numbers (``None`` when every
    row is greedy); raw_logits: [B, R, V] the model's logits, for ``logprobs[b]`` top alternatives
    (``None``: no logprobs for that sequence).
    """
    b, r, v = trees.num_seqs, trees.num_rows, x.shape[-1]
    x = x[:, :r]
    # the argmax (first of ties; faster than argmax on the CPU), which greedy rows take: not computed
    # when every row samples
    best = x.max(dim=-1).indices if st.any_greedy else None  # [B, R]
    greedy = st.greedy.view(b, r)
    flat_best = best.reshape(-1)[trees.ev_rows] if best is not None else None  # [K]
    probs = None
    # taken: [K] each row's accepted event, -1 where none is
    if st.all_greedy:  # each row takes its first event whose token is the argmax: every event at once
        hit = (trees.ev_token == flat_best[:, None]) & (trees.ev_valid if trees.ev_live is None else trees.ev_live)
        taken = first_true(hit)
    else:
        probs = finish_probs(x.reshape(b * r, v), st)  # [B*R, V]; greedy rows one-hot
        taken, residual = _try_events(probs, trees, uniforms,
                                      greedy.reshape(-1)[trees.ev_rows] if best is not None else None, flat_best,
                                      without_replacement)
        probs.index_copy_(0, trees.ev_rows, residual)  # a row's law once all its events are rejected
    child = torch.full((b * r,), -1, dtype=torch.long, device=x.device)
    picked = trees.event_node.view(b * r, -1)[trees.ev_rows].gather(1, taken.clamp(min=0)[:, None])[:, 0]
    child[trees.ev_rows] = torch.where(taken >= 0, picked, -1)
    child = child.view(b, r)
    # the walk: down through accepted children; a row without one leads to itself, so the walk stays
    # at its last row (one gather a level)
    seq = torch.arange(b, device=x.device)
    step_to = torch.where(child >= 0, child + 1, torch.arange(r, device=x.device))  # [B, R]
    visited = [torch.zeros(b, 1, dtype=torch.long, device=x.device)]
    for _ in range(trees.depth):
        visited.append(step_to.gather(1, visited[-1]))
    rows = torch.cat(visited, dim=1)  # [B, D+1]
    path = child.gather(1, rows[:, :-1])  # [B, D] accepted nodes, -1 past the last
    row = rows[:, -1]
    if probs is None:
        final = best[seq, row]
    else:
        final = sample_from_probs(probs.view(b, r, v)[seq, row], uniforms.final[seq, row])
        if best is not None:
            final = torch.where(greedy[seq, row], best[seq, row], final)
    bonus = trees.num_events[seq, row] == 0
    n = (path >= 0).sum(dim=1, keepdim=True)  # [B, 1] accepted nodes
    emitted = torch.cat([trees.tokens.gather(1, (path + 1).clamp(min=0)), torch.zeros_like(n)], dim=1)
    emitted.scatter_(1, n, final[:, None])  # [B, D+1]: the path's tokens, then the final token
    packed = [torch.cat([path, row[:, None], bonus[:, None].long(), emitted], dim=1)]
    if raw_logits is not None:
        emitted_rows = torch.cat([torch.zeros_like(n), (path + 1).clamp(min=0)], dim=1)  # [B, D+1]
        packed += emitted_logprobs(raw_logits[:, :r], emitted_rows, emitted, logprobs)
    # every tree empty: plain decoding (with logprobs), whose next roots the engine may run ahead
    return Pending(packed, lambda host: _unpack(host, trees.depth, logprobs),
                   next_roots=final if trees.depth == 0 else None)


def emitted_logprobs(raw: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                     logprobs: Sequence[Optional[int]]) -> list[torch.Tensor]:
    """The logprobs of emitted tokens, on the device, to be read with a step's decisions (none when
    no sequence asked for them).  raw: [B, R, V] the model's logits of the block rows; rows, tokens:
    [B, N] each emitted token's row and id (padding anywhere valid); ``logprobs[b]``: how many
    alternatives sequence ``b`` wants (``None``: no logprobs).  Returns ``[chosen [B, N]]``, then
    ``[ids, values]`` [B, N, k] of the ``k`` best when some sequence wants alternatives
    (:func:`unpack_logprobs` reads them)."""
    asked = [k for k in logprobs if k is not None]
    if not asked:
        return []
    top_k = max(asked)
    seq = torch.arange(rows.shape[0], device=rows.device)
    lp = raw_logprobs(raw[seq[:, None], rows])  # [B, N, V]
    out = [lp.gather(2, tokens[..., None])[..., 0]]
    if top_k > 0:
        vals, ids = lp.topk(top_k, dim=-1)
        out += [ids, vals]
    return out


def unpack_logprobs(host: list[torch.Tensor], i: int, tokens: list[int], k: Optional[int]
                    ) -> Optional[list[TokenLogprob]]:
    """Sequence ``i``'s :class:`TokenLogprob` list from :func:`emitted_logprobs`' tensors read back
    (``host``; empty when nobody asked), for its emitted ``tokens``; ``None`` when it asked for none."""
    if k is None or not host:
        return None
    n = len(tokens)
    chosen = host[0][i, :n].tolist()
    top_ids = host[1][i, :n, :k].tolist() if k > 0 else [[]] * n
    top_vals = host[2][i, :n, :k].tolist() if k > 0 else [[]] * n
    return [TokenLogprob(tokens[j], chosen[j], list(zip(top_ids[j], top_vals[j]))) for j in range(n)]


def _try_events(probs: torch.Tensor, trees: TreeBatch, uniforms: Uniforms, greedy: Optional[torch.Tensor],
                best: Optional[torch.Tensor], without_replacement: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounds over the event index for the ``K`` rows with events: returns the accepted event of
    each row (-1: all rejected) and each row's law after its rejected events.  ``greedy`` and
    ``best``: [K] each row's greedy flag and argmax (None: no row is greedy)."""
    rows = trees.ev_rows
    p = probs[rows]  # [K, V] copies, updated as events are rejected
    # q is read again only by a later round's sampled events: the rounds before the last such round
    # update it (without replacement), in a copy
    sampled_after = [any(kind[0] for kind in trees.kinds[j + 1:]) for j in range(len(trees.kinds))]
    update_q = [without_replacement and kind[0] and later for kind, later in zip(trees.kinds, sampled_after)]
    q = trees.q.clone() if any(update_q) else trees.q
    u = uniforms.accept.reshape(-1, uniforms.accept.shape[-1])[rows].double()  # [K, E]
    # [K, E]: a greedy row takes an event of the argmax
    hit = trees.ev_token == best[:, None] if best is not None else None
    accepted = torch.zeros_like(trees.ev_sampled)  # [K, E]: the events a row would accept; it takes the first
    for j, k in enumerate(trees.active):
        tok, sampled = trees.ev_token[:k, j], trees.ev_sampled[:k, j]
        pj, qj = p[:k], q[:k]
        any_sampled, any_onehot = trees.kinds[j]
        p_x = pj.gather(1, tok[:, None])[:, 0].double()
        if any_sampled:  # (a one-hot event's q(x) is 1)
            q_x = qj.gather(1, tok[:, None])[:, 0].double()
            ok = u[:k, j] * (torch.where(sampled, q_x, 1.0) if any_onehot else q_x) < p_x  # exact in float64
        else:
            ok = u[:k, j] < p_x
        if greedy is not None:
            ok = torch.where(greedy[:k], hit[:k, j], ok)
        live = None if trees.ev_live is None else trees.ev_live[:k, j]
        if live is not None:
            ok &= live
        accepted[:k, j] = ok
        # the law of the next event and of a final draw: a rejected row's residual (rows that accepted
        # are never the walk's last row, so updating them too changes nothing).  Each law is a few
        # passes over the vocabulary, so a round computes only the kinds its rows have (host-known).
        # A dead event (a DEAD token, ``ev_live``) leaves both laws as they are: it was never proposed.
        if any_sampled and any_onehot:
            new_p = torch.where(sampled[:, None], residual_rows(pj, qj), without_rows(pj, tok))
        else:
            new_p = residual_rows(pj, qj) if any_sampled else without_rows(pj, tok)
        _keep_live(pj, new_p, live)
        if update_q[j]:  # a one-hot event leaves q as it is
            new_q = torch.where(sampled[:, None], without_rows(qj, tok), qj)
            _keep_live(qj, new_q, live)
    return first_true(accepted), p


def _keep_live(law: torch.Tensor, new: torch.Tensor, live: Optional[torch.Tensor]) -> None:
    """``law`` (rows of the round's laws, in place) becomes ``new`` where its event is live (all rows
    when ``live`` is None): written once, not built apart and copied in."""
    if live is None:
        law.copy_(new)
    else:
        torch.where(live[:, None], new, law, out=law)


def first_true(mask: torch.Tensor) -> torch.Tensor:
    """Each row's first True column of ``mask`` [K, E] bool, -1 where there is none (argmax gives the
    first of equal maxima, on every device)."""
    return torch.where(mask.any(dim=1), mask.int().argmax(dim=1), -1)


def residual_rows(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise ``norm((p - q)+)``, ``p`` where it vanishes (as ``walk.residual``)."""
    r = (p - q).clamp_(min=0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total, p)


def without_rows(p: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """Row-wise ``p`` with ``tok`` removed, renormalised (as ``walk.remove_candidate``)."""
    out = p.scatter(1, tok[:, None], 0.0)
    total = out.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, out / total, out)


def _unpack(host: list[torch.Tensor], depth: int, logprobs: Sequence[Optional[int]]) -> Outcome:
    results, lps = [], []
    for i, vals in enumerate(host[0].tolist()):
        accepted = [node for node in vals[:depth] if node >= 0]
        final_row, bonus, n = vals[depth], bool(vals[depth + 1]), len(accepted) + 1
        tokens = vals[depth + 2: depth + 2 + n]
        results.append(VerifyResult(accepted, tokens, bonus, final_row, [0] + [a + 1 for a in accepted]))
        lps.append(unpack_logprobs(host[1:], i, tokens, logprobs[i] if i < len(logprobs) else None))
    return Outcome(results, lps)


# ------------------------------------------------------------------ rules
# A verification rule decides, for a group of sequences, which drafted tokens stand.  The lossless
# multi-candidate rule above is the default; a lossy method names its own rule (``Method.rule``), which
# its module registers (``engine.registry.register_rule``).  The runner groups a step's sequences by rule, starts every
# group on the device, then reads them all back at once.

LOSSLESS = LOSSLESS_RULE


class VerifyRule(Protocol):
    """How a group of sequences' trees is verified, decided on the device."""

    def claims(self, plan: "DraftPlan", tree: DraftTree) -> bool:
        """Whether this rule verifies ``tree``, drafted under ``plan`` (else the lossless rule does: e.g.
        nothing was drafted, or the request's speculation is off this step)."""

    def start(self, seqs: list[SeqView], trees: list[DraftTree], logits: torch.Tensor) -> Pending:
        """Starts verifying; the pending gives a :class:`SeqStepResult` per sequence, in order.
        logits: [B, rows, vocab'] the sequences' raw block logits."""


def with_held_tokens(trees: Sequence[DraftTree], pending: Pending) -> Pending:
    """``pending`` reading back, in the same synchronization, the tokens of ``trees`` still on the
    device (``DraftTree.unread``), which it fills in before its own answer is made."""
    held_by = holders(trees)
    if not held_by:
        return pending
    n, finish = len(pending.tensors), pending.finish
    held = [h.tensors() for h in held_by]

    def fill_then_finish(host: list[torch.Tensor]):
        at = n
        for holder, tensors in zip(held_by, held):
            holder.fill(host[at: at + len(tensors)])
            at += len(tensors)
        return finish(host[:n])

    return Pending(pending.tensors + [t for ts in held for t in ts], fill_then_finish)


def build_rules(config: "EngineConfig", vocab_size: int) -> dict[str, VerifyRule]:
    """Every registered (lossy) rule, built for this engine."""
    return {name: factory(config, vocab_size) for name, factory in rule_factories().items()}


def target_rows(seqs: list[SeqView], trees: list[DraftTree], logits: torch.Tensor, vocab_size: int):
    """The batch's trees as tensors, the raw logits of their rows [B, R, V], the processed ones (logit
    bias, and penalties with each row's own path) and the rows' sampling parameters."""
    batch = TreeBatch.build(trees, vocab_size, logits.device)
    return (batch, *processed_rows(seqs, trees, logits, batch.num_rows, vocab_size))


def processed_rows(seqs: list[SeqView], trees: list[DraftTree], logits: torch.Tensor, r: int, vocab_size: int):
    """The raw logits of the trees' first ``r`` block rows [B, r, V], the processed ones (the grammar's
    mask, logit bias, penalties) and the rows' sampling parameters (:func:`target_rows` without the
    trees as tensors)."""
    dev, v, b = logits.device, vocab_size, len(seqs)
    raw = logits[:, :r, :v]
    params = [s.request.sampling for s in seqs]
    st = SamplingTensors.from_params(params, v, [i for i in range(b) for _ in range(r)], device=dev)
    allowed = allowed_rows(seqs, trees, r, v, dev)  # structured output: the grammar's mask, before all else
    x = raw if allowed is None else apply_mask(raw, allowed)
    if st.any_bias or st.any_penalty:
        counts, prompt = batch_histories(seqs, trees, r, v, dev) if st.any_penalty else (None, None)
        x = process_logits(x.reshape(b * r, v), st, counts, prompt).view(b, r, v)
    return raw, x, st, params


class LosslessRule:
    """The lossless multi-candidate rule (:func:`start_verify`) for any tree."""

    def __init__(self, vocab_size: int, without_replacement: bool) -> None:
        self.vocab_size = vocab_size
        self.without_replacement = without_replacement

    def claims(self, plan: "DraftPlan", tree: DraftTree) -> bool:
        return True

    def start(self, seqs: list[SeqView], trees: list[DraftTree], logits: torch.Tensor) -> Pending:
        dev = logits.device
        if self.plain_step(seqs, trees):
            return self._start_plain(seqs, trees, logits)
        batch, raw, x, st, params = target_rows(seqs, trees, logits, self.vocab_size)
        uniforms = None
        if not st.all_greedy:
            gens = [None if p.greedy else s.generator for s, p in zip(seqs, params)]
            uniforms = draw_tables(gens, batch, dev)
        pending = with_held_tokens(trees, start_verify(x, st, batch, uniforms, self.without_replacement,
                                                       raw_logits=raw, logprobs=[p.logprobs for p in params]))
        return pending.then(lambda outcome: [
            SeqStepResult(s, res, t, lps, raw[i, : 1 + t.num_nodes])
            for i, (s, t, res, lps) in enumerate(zip(seqs, trees, outcome.results, outcome.logprobs))])

    @staticmethod
    def plain_step(seqs: list[SeqView], trees: list[DraftTree]) -> bool:
        """Whether the step is plain decoding that :meth:`_start_plain` decides: every tree empty, no
        logprobs asked for."""
        return all(not t.num_nodes for t in trees) and all(s.request.sampling.logprobs is None for s in seqs)

    def _start_plain(self, seqs: list[SeqView], trees: list[DraftTree], logits: torch.Tensor) -> Pending:
        """Plain decoding (every tree empty, no logprobs): what :func:`start_verify` decides for empty
        trees, the same token from the same uniform, without the tree machinery around it (which costs
        more than the decision over a large vocabulary).  Greedy rows
        take the first argmax of the processed logits; sampled rows draw from ``finish_probs`` with the
        one uniform their generator gives an empty tree (``draw_tables``)."""
        dev = logits.device
        raw, x, st, params = processed_rows(seqs, trees, logits, 1, self.vocab_size)  # [B, 1, V]
        x = x[:, 0]
        best = x.max(dim=-1).indices if st.any_greedy else None  # [B] the first argmax, as start_verify's
        if st.all_greedy:
            tokens = best
        else:
            gens = [None if p.greedy else s.generator for s, p in zip(seqs, params)]
            u = draw_uniforms(gens, [0 if p.greedy else 1 for p in params], device=dev)[:, 0]
            tokens = sample_from_probs(finish_probs(x, st), u)
            if best is not None:
                tokens = torch.where(st.greedy, best, tokens)

        def unpack(host: list[torch.Tensor]) -> list[SeqStepResult]:
            return [SeqStepResult(s, VerifyResult([], [tok], True, 0, [0]), t, None, raw[i])
                    for i, (s, t, tok) in enumerate(zip(seqs, trees, host[0].tolist()))]
        return Pending([tokens], unpack, next_roots=tokens)
