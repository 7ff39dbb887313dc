"""Batched logits processing and sampling.

One *row* is one next-token prediction.  Rows of a batch may belong to different requests (different
:class:`SamplingParams`), and several rows may belong to the same request: the nodes of a speculative
draft or verification tree, each with its own token history.  :class:`SamplingTensors` packs the
per-row parameters once per step; every transform is then a tensor op over ``[rows, vocab]``.

Pipeline of :func:`compute_probs` (the order of vLLM / HF; see ``SamplingParams``)::

    logit_bias -> repetition penalty -> presence/frequency penalties -> temperature
               -> top-k -> top-p -> min-p -> softmax

All filters work in logit space by setting removed tokens to ``-inf``, so the single final softmax
renormalises once and a row whose filters are disabled is computed exactly as it would be alone.
The vector returned is exactly the distribution a token is then drawn from; speculative verification
uses it as ``p`` (target) and ``q`` (draft).

Randomness comes from per-request CPU ``torch.Generator`` objects, so a seeded request reproduces
whatever else shares its batch: each request draws its own uniforms in a fixed order.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from engine.device import to_device, to_device_many
from engine.request import SamplingParams

_NEG_INF = float("-inf")

#: the packings made last (:meth:`SamplingTensors.from_params`), most recent last
_PACKED: "OrderedDict[tuple, tuple[tuple[SamplingParams, ...], SamplingTensors]]" = OrderedDict()
_PACKED_MAX = 16


# --------------------------------------------------------------------------- parameters
@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors, plus host-side fast-path flags.

    Disabled filters hold neutral values (``top_k == vocab``, ``top_p == 1``, ``min_p == 0``,
    penalties 0 / 1); greedy rows hold ``temperature == 1`` and no filters, since their result is the
    one-hot argmax anyway.  ``logit_bias`` is sparse: ``bias_index`` are flat indices
    ``row * vocab + token`` into the logits, added with one ``scatter_add``.
    """

    temperature: torch.Tensor  # [rows] float32
    greedy: torch.Tensor  # [rows] bool
    top_k: torch.Tensor  # [rows] int64, in [1, vocab]
    top_p: torch.Tensor  # [rows] float32, in (0, 1]
    min_p: torch.Tensor  # [rows] float32, in [0, 1]
    repetition_penalty: torch.Tensor  # [rows] float32
    presence_penalty: torch.Tensor  # [rows] float32
    frequency_penalty: torch.Tensor  # [rows] float32
    bias_index: torch.Tensor  # [nnz] int64
    bias_value: torch.Tensor  # [nnz] float32
    vocab_size: int
    max_top_k: int  # largest enabled top_k (0 when none)
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_repetition: bool
    any_presence_frequency: bool
    any_greedy: bool
    all_greedy: bool

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def any_penalty(self) -> bool:
        return self.any_repetition or self.any_presence_frequency

    @property
    def any_bias(self) -> bool:
        return self.bias_index.numel() > 0

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        row_to_request: Optional[Sequence[int]] = None,
        device: torch.device | str = "cpu",
    ) -> "SamplingTensors":
        """Pack ``params`` (one per request) for rows ``r`` using ``params[row_to_request[r]]``.

        ``row_to_request=None`` means one row per request.  Built on the host, moved once.  The same
        request objects over the same rows give the packing made last time (a step packs its batch
        once a draft level and once for verification, much the same from step to step): nothing here
        is written after it is made, and a request's parameters do not change.
        """
        row_list = tuple(range(len(params)) if row_to_request is None else row_to_request)
        key = (tuple(map(id, params)), row_list, vocab_size, str(device))
        hit = _PACKED.get(key)
        if hit is not None:  # the entry holds its params, so their ids name them still
            _PACKED.move_to_end(key)
            return hit[1]
        packed = cls._pack(params, vocab_size, row_list, device)
        _PACKED[key] = (tuple(params), packed)  # holding the params keeps their ids from being reused
        if len(_PACKED) > _PACKED_MAX:
            _PACKED.popitem(last=False)
        return packed

    @classmethod
    def _pack(cls, params: Sequence[SamplingParams], vocab_size: int, row_to_request: Sequence[int],
              device: torch.device | str) -> "SamplingTensors":
        rows = torch.as_tensor(row_to_request, dtype=torch.long)  # [rows]
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= len(params)):
            raise ValueError(f"row_to_request must index into {len(params)} params")

        def per_row(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype)[rows]

        greedy = per_row([p.greedy for p in params], torch.bool)
        sampled = ~greedy
        top_k = per_row([_effective_top_k(p.top_k, vocab_size) for p in params], torch.long)
        top_k = torch.where(sampled, top_k, vocab_size)
        top_p = torch.where(sampled, per_row([p.top_p for p in params]), 1.0)
        min_p = torch.where(sampled, per_row([p.min_p for p in params]), 0.0)
        temperature = torch.where(sampled, per_row([p.temperature for p in params]), 1.0)
        rep = per_row([p.repetition_penalty for p in params])
        pres = per_row([p.presence_penalty for p in params])
        freq = per_row([p.frequency_penalty for p in params])
        bias_index, bias_value = _sparse_bias(params, rows, vocab_size)
        enabled_k = top_k[top_k < vocab_size]

        host = dict(temperature=temperature, greedy=greedy, top_k=top_k, top_p=top_p, min_p=min_p,
                    repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
                    bias_index=bias_index, bias_value=bias_value)
        return cls(
            **dict(zip(host, to_device_many(list(host.values()), torch.device(device)))),
            vocab_size=vocab_size,
            max_top_k=int(enabled_k.max()) if enabled_k.numel() else 0,
            any_top_k=enabled_k.numel() > 0,
            any_top_p=bool((top_p < 1.0).any()),
            any_min_p=bool((min_p > 0.0).any()),
            any_repetition=bool((rep != 1.0).any()),
            any_presence_frequency=bool(((pres != 0.0) | (freq != 0.0)).any()),
            any_greedy=bool(greedy.any()),
            all_greedy=bool(greedy.all()),
        )


    def repeat_rows(self, n: int) -> "SamplingTensors":
        """This one-row packing repeated for ``n`` rows (tree nodes of one request), without
        re-reading the params."""
        if self.num_rows != 1:
            raise ValueError("repeat_rows needs a one-row SamplingTensors")
        rep = lambda t: t.expand(n).contiguous()  # noqa: E731
        offsets = torch.arange(n, device=self.bias_index.device)[:, None] * self.vocab_size
        return dataclasses.replace(
            self, temperature=rep(self.temperature), greedy=rep(self.greedy), top_k=rep(self.top_k),
            top_p=rep(self.top_p), min_p=rep(self.min_p), repetition_penalty=rep(self.repetition_penalty),
            presence_penalty=rep(self.presence_penalty), frequency_penalty=rep(self.frequency_penalty),
            bias_index=(offsets + self.bias_index[None, :]).flatten(),
            bias_value=self.bias_value.repeat(n))


def _effective_top_k(top_k: int, vocab_size: int) -> int:
    """0 / -1 / >= vocab all mean 'disabled', stored as ``vocab_size``."""
    return vocab_size if top_k <= 0 or top_k >= vocab_size else top_k


def _sparse_bias(
    params: Sequence[SamplingParams], rows: torch.Tensor, vocab_size: int  # rows: [rows]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``(row * vocab + token, bias)`` pairs for every row of every request with a logit_bias."""
    req, tok, val = [], [], []
    for i, p in enumerate(params):
        for t, b in p.logit_bias.items():
            if t >= vocab_size:
                raise ValueError(f"logit_bias token id {t} is out of range for vocab size {vocab_size}")
            req.append(i)
            tok.append(t)
            val.append(float(b))
    if not req:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float32)
    entry_req = torch.tensor(req, dtype=torch.long)  # [entries]
    row_idx, entry_idx = (rows[:, None] == entry_req[None, :]).nonzero(as_tuple=True)  # [nnz] each
    index = row_idx * vocab_size + torch.tensor(tok, dtype=torch.long)[entry_idx]
    return index, torch.tensor(val, dtype=torch.float32)[entry_idx]


def token_count_matrix(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:  # -> [rows, vocab] int32
    """``out[r, t]`` = occurrences of ``t`` in ``token_ids[r]`` (build ``token_counts`` or, via ``> 0``,
    ``prompt_mask``).  One ``index_put_`` with accumulation; no loop over tokens on the device."""
    flat = [t for ids in token_ids for t in ids]
    row = [r for r, ids in enumerate(token_ids) for _ in ids]
    out = torch.zeros(len(token_ids), vocab_size, dtype=torch.int32, device=device)
    if flat:
        idx = tuple(to_device_many([torch.tensor(row), torch.tensor(flat)], torch.device(device)))
        out.index_put_(idx, torch.ones(len(flat), dtype=torch.int32, device=device), accumulate=True)
    return out


# --------------------------------------------------------------------------- transforms
def apply_logit_bias(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:  # logits: [rows, vocab]
    """Add the sparse logit_bias in place with one ``scatter_add_`` over the flattened logits."""
    if st.any_bias:
        logits.view(-1).scatter_add_(0, st.bias_index, st.bias_value)
    return logits


def apply_penalties(
    logits: torch.Tensor,  # [rows, vocab] float32
    st: SamplingTensors,
    token_counts: Optional[torch.Tensor],  # [rows, vocab] int/float: generated-token counts
    prompt_mask: Optional[torch.Tensor],  # [rows, vocab] bool: token occurs in the prompt
) -> torch.Tensor:
    """Apply history penalties.

    ``token_counts[r, t]`` counts ``t`` among the *generated* tokens on row ``r``'s path (for a tree
    node: the request's completion so far plus the path from the tree root down to and including that
    node).  ``prompt_mask[r, t]`` says ``t`` occurs in the prompt.

    * repetition (HF / vLLM): every token seen in prompt or completion, once regardless of count:
      ``l > 0 -> l / r`` else ``l * r``;
    * frequency and presence (OpenAI), completion only:
      ``l -= frequency * count + presence * (count > 0)``.

    Neutral values (``r == 1``, penalties 0) leave a row bit-identical, so no per-row masking is needed.
    """
    if not st.any_penalty:
        return logits
    if token_counts is None:
        raise ValueError("token_counts is required when a repetition/presence/frequency penalty is set")
    seen = token_counts > 0  # [rows, vocab]
    if st.any_repetition:
        in_history = seen if prompt_mask is None else seen | prompt_mask
        r = st.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / r, logits * r)
        # a token already at -inf (the grammar forbids it) stays there: a penalty that is 0 in float32
        # (a valid r below 1e-45) would make it -inf * 0 = NaN, which argmax and sampling can pick
        logits = torch.where(in_history & (logits > float("-inf")), penalised, logits)
    if st.any_presence_frequency:
        logits = logits - st.frequency_penalty[:, None] * token_counts.to(logits.dtype)
        logits = logits - st.presence_penalty[:, None] * seen.to(logits.dtype)
    return logits


def apply_top_k(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:  # [rows, vocab]
    """Keep tokens whose logit is >= the k-th largest logit of the row.

    Ties at the k-th value are all kept (as HF's ``TopKLogitsWarper``), so the result does not depend on
    token order; rows may keep more than k tokens when the boundary is tied.  Uses ``topk`` up to the
    largest enabled k, not a full sort.
    """
    top_vals = logits.topk(st.max_top_k, dim=-1).values  # [rows, max_top_k]
    kth = top_vals.gather(1, (st.top_k.clamp(max=st.max_top_k) - 1)[:, None])  # [rows, 1]
    kth = torch.where((st.top_k < st.vocab_size)[:, None], kth, _NEG_INF)
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:  # [rows, vocab], [rows]
    """Nucleus filter: keep the smallest set of most likely tokens whose mass is >= ``top_p``.

    In descending order, token ``i`` is kept iff the mass strictly before it is ``< top_p``; the first
    token always is (mass 0), so at least one token survives.  The kept set is then widened to every
    token whose logit equals the last kept one (ties are all kept, independent of token order).
    ``top_p == 1`` rows are left untouched (no float-rounding loss of the tail).  Masses are float32
    cumulative sums; a ``top_p`` within rounding of a partial sum may go either way.
    """
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [rows, vocab]
    sorted_probs = sorted_logits.softmax(dim=-1)
    cum = sorted_probs.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    # >= 1: the top token has mass 0 before it, but a top_p below float32's range (5e-324) rounds to 0
    n_keep = (mass_before < top_p[:, None]).sum(dim=-1).clamp(min=1)  # [rows]
    n_keep = torch.where(top_p >= 1.0, logits.shape[-1], n_keep)
    threshold = sorted_logits.gather(1, (n_keep - 1)[:, None])  # [rows, 1]
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:  # [rows, vocab], [rows]
    """Drop tokens with ``prob < min_p * max_prob``, i.e. ``logit < max_logit + log(min_p)``.

    Done in logit space (exact, and ``min_p == 0`` gives ``log 0 = -inf``: nothing removed).  The most
    likely token always survives.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]  # [rows, 1]
    return logits.masked_fill(logits < threshold, _NEG_INF)


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> [rows, vocab] float32
    """Greedy distribution: 1.0 on the argmax (first index among equal maxima), 0 elsewhere."""
    out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return out.scatter_(1, logits.max(dim=-1, keepdim=True).indices, 1.0)  # argmax, first of ties (faster)


def compute_probs(
    logits: torch.Tensor,  # [rows, vocab] any float dtype
    st: SamplingTensors,
    token_counts: Optional[torch.Tensor] = None,  # [rows, vocab]
    prompt_mask: Optional[torch.Tensor] = None,  # [rows, vocab] bool
) -> torch.Tensor:  # -> [rows, vocab] float32
    """The exact distribution each row samples from (see the module docstring for the order).

    Greedy rows (temperature 0) get a one-hot vector on the argmax of the biased and penalised logits.
    Disabled filters are skipped for the whole batch via the host-side flags, so the common case
    (no top-k / top-p / min-p) never sorts the vocabulary.
    """
    return finish_probs(process_logits(logits, st, token_counts, prompt_mask), st)


def process_logits(
    logits: torch.Tensor,  # [rows, vocab] any float dtype
    st: SamplingTensors,
    token_counts: Optional[torch.Tensor] = None,  # [rows, vocab]
    prompt_mask: Optional[torch.Tensor] = None,  # [rows, vocab] bool
) -> torch.Tensor:  # -> [rows, vocab] float32
    """The history-dependent first half: logit_bias, then penalties, in float32.  Greedy decisions
    (argmax, top-k children) are taken on these logits.  ``logits`` is never written: the bias is added
    in place into a copy, and penalties make a tensor of their own; without either, float32 logits come
    back as they are (a [rows, vocab] copy saved; no caller writes the result)."""
    x = logits.to(torch.float32, copy=st.any_bias)
    x = apply_logit_bias(x, st)
    return apply_penalties(x, st, token_counts, prompt_mask)


def finish_probs(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:  # [rows, vocab] -> [rows, vocab]
    """The second half: temperature, top-k, top-p, min-p, softmax; greedy rows one-hot."""
    if st.all_greedy:
        return one_hot_argmax(x)
    greedy_probs = one_hot_argmax(x) if st.any_greedy else None
    x = x / st.temperature[:, None]
    if st.any_repetition:
        # A small repetition penalty divides positive logits past the float range (r = 1e-196 is valid):
        # saturated, the tokens at +inf share the mass as their limit does, where softmax would give NaN.
        x = x.clamp(max=torch.finfo(x.dtype).max)
    if st.any_top_k:
        x = apply_top_k(x, st)
    if st.any_top_p:
        x = apply_top_p(x, st.top_p)
    if st.any_min_p:
        x = apply_min_p(x, st.min_p)
    probs = x.softmax(dim=-1)
    if greedy_probs is not None:
        probs = torch.where(st.greedy[:, None], greedy_probs, probs)
    return probs


# --------------------------------------------------------------------------- logprobs
def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> [rows, vocab] float32
    """Log-softmax of the model's raw logits (what OpenAI ``logprobs`` report, as vLLM's default)."""
    return torch.log_softmax(logits.float(), dim=-1)


def top_logprobs(
    logprobs: torch.Tensor,  # [rows, vocab]
    chosen: torch.Tensor,  # [rows] int64
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [rows], [rows, k], [rows, k]
    """Logprob of the chosen token and the ``k`` best ``(ids, logprobs)``, best first."""
    chosen_lp = logprobs.gather(1, chosen.long()[:, None]).squeeze(1)
    top_vals, top_ids = logprobs.topk(k, dim=-1)
    return chosen_lp, top_ids, top_vals


# --------------------------------------------------------------------------- randomness
def make_generator(seed: Optional[int] = None) -> torch.Generator:
    """Per-request CPU generator: seeded from ``seed`` when given, else from the OS entropy pool."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed if seed is not None else secrets.randbits(63)) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def draw_uniforms(
    generators: Sequence[torch.Generator],
    n_per_row: Sequence[int],
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # -> [rows, max(n_per_row)] float32
    """Draw ``n_per_row[r]`` uniforms in [0, 1) from ``generators[r]`` (CPU), then move once.

    Rows sharing a request share its generator object and draw in row order, so a seeded request's
    stream does not depend on the other requests in the batch.  Unused trailing entries are 0.
    """
    if len(generators) != len(n_per_row):
        raise ValueError(f"{len(generators)} generators for {len(n_per_row)} rows")
    width = max(n_per_row, default=0)
    out = torch.zeros(len(n_per_row), width, dtype=torch.float32)
    if not width:
        return to_device(out, torch.device(device))
    # one draw per generator, of its rows' total: a CPU generator's numbers are one stream, so the
    # rows get what one draw a row, in row order, would give them (a row per tree node: hundreds a
    # step, so the grouping is numpy's, not a few Python calls a row)
    counts = np.asarray(n_per_row, dtype=np.int64)
    owners = list(dict.fromkeys(generators))  # distinct generators, in order of their first row
    if len(owners) == len(generators):  # a row a generator: one draw each, in place
        totals, order = counts, np.arange(len(counts))
    else:
        number = {id(g): i for i, g in enumerate(owners)}
        owner = np.fromiter(map(number.__getitem__, map(id, generators)), dtype=np.int64, count=len(generators))
        totals = np.bincount(owner, weights=counts, minlength=len(owners)).astype(np.int64)
        order = np.argsort(owner, kind="stable")  # each generator's rows, in row order
    drawn = [torch.rand(int(n), generator=g, dtype=torch.float32)
             for g, n in zip(owners, totals.tolist()) if n > 0]
    c = counts[order]
    starts = np.repeat(np.cumsum(c) - c, c)  # each number's row's first place in the draws
    at = np.repeat(order * width, c) + np.arange(len(starts)) - starts
    out.view(-1)[torch.from_numpy(at)] = drawn[0] if len(drawn) == 1 else torch.cat(drawn)
    return to_device(out, torch.device(device))


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [rows, vocab], [rows]
    """Inverse-CDF sampling: the first token whose cumulative weight exceeds ``u * total``.

    ``probs`` needs only be non-negative with a positive row sum (a residual ``(p - q)+`` works
    unnormalised).  With ``right=True`` a zero-weight token is never the first whose cdf exceeds the
    target, as long as the cdf does not step down and the target stays below the total: the target is
    held one ulp below the total (``u * total`` can round up to it).  The CPU's cumsum is sequential
    (a double accumulator, rounded to float per entry), so its cdf never steps down.  A device's
    parallel scan can, by an ulp; there the index is mapped to the last positive-weight token at or
    before it, so the result always has positive probability.  (That mapping is a scan over the whole
    vocabulary, dearer on the CPU than the rest of sampling, so it runs on devices only.)  Returns
    ``[rows]`` int64.
    """
    return _draw(probs, u)[0]


def _draw(probs: torch.Tensor, u: torch.Tensor, zero: Optional[torch.Tensor] = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_from_probs`' tokens [rows], and each row's total weight [rows] (its cdf's last
    entry: positive exactly when some weight is, as weights are not negative).  ``zero``: a 0 of the
    probabilities' dtype and device (made here if not given: a caller drawing several times makes it once)."""
    cdf = probs.cumsum(dim=-1)  # [rows, vocab]
    total = cdf[:, -1:]  # [rows, 1]
    below = torch.nextafter(total, torch.zeros_like(total) if zero is None else zero)
    target = torch.minimum(u.to(cdf.dtype)[:, None] * total, below)
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    if probs.device.type == "cpu":
        return idx.squeeze(1), total[:, 0]
    positions = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
    last_positive = torch.where(probs > 0, positions, -1).cummax(dim=-1).values  # [rows, vocab]
    return last_positive.gather(1, idx).clamp_(min=0).squeeze(1), total[:, 0]


def sample_tokens(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` ([rows, vocab]) using one uniform from each row's generator."""
    u = draw_uniforms(generators, [1] * probs.shape[0], device=probs.device)[:, 0]
    return sample_from_probs(probs, u)


def sample_k_distinct(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [rows, vocab], [rows, k]
    """Sequential sampling without replacement, driven by given uniforms (see below).

    Draw ``j`` takes a token from the row's weights with the previous draws zeroed;
    :func:`sample_from_probs` rescales ``u`` by the remaining total, which is exactly renormalisation.
    When a row's support is exhausted (fewer than ``k`` positive tokens) the remaining entries are -1.
    Returns ``[rows, k]`` int64.
    """
    k = u.shape[1]
    if k == 0:
        return torch.empty(u.shape, dtype=torch.long, device=probs.device)
    weights = probs.clone() if k > 1 else probs  # (the draws zero what they took, in a copy)
    zero = probs.new_zeros(())
    tokens, totals = [], []
    for j in range(k):  # loop over the k draws, not over tokens
        tok, total = _draw(weights, u[:, j], zero)
        tokens.append(tok)
        totals.append(total)
        if j + 1 < k:
            weights.scatter_(1, tok[:, None], 0.0)
    alive = torch.stack(totals, dim=1) > 0  # the row still had weight
    return torch.where(alive, torch.stack(tokens, dim=1), -1)


def sample_without_replacement(
    probs: torch.Tensor,  # [rows, vocab]
    k: int,
    generators: Sequence[torch.Generator],
) -> torch.Tensor:  # -> [rows, k] int64
    """``k`` distinct tokens per row, in sampling order, drawn sequentially without replacement.

    Draft-tree children must follow exactly this law (verification removes each rejected child from
    ``q`` and renormalises).  Sequential renormalisation is that law by definition and needs only
    ``k`` uniforms per row from the per-request CPU generators.  The Gumbel-top-k trick is exact only in
    real arithmetic: it needs ``vocab`` draws per row from those generators, and float32 Gumbel noise
    ``-log(-log u)`` is bounded (about 16.6 for ``u <= 1 - 2**-24``), which distorts small probabilities.
    """
    u = draw_uniforms(generators, [k] * probs.shape[0], device=probs.device)
    return sample_k_distinct(probs, u)
