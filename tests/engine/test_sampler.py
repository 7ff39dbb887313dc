"""Logits processing and sampling: exact cases on hand-built logits plus statistical checks."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import chisquare

from engine.request import SamplingParams
from engine.sampler import (
    SamplingTensors,
    compute_probs,
    draw_uniforms,
    make_generator,
    raw_logprobs,
    sample_from_probs,
    sample_k_distinct,
    sample_tokens,
    sample_without_replacement,
    token_count_matrix,
    top_logprobs,
)

INF = float("inf")
P_MIN = 1e-3  # chi-square acceptance threshold


def probs_for(logits, params, row_to_request=None, counts=None, prompt=None) -> torch.Tensor:
    logits = torch.as_tensor(logits, dtype=torch.float32)
    if logits.dim() == 1:
        logits = logits[None]
    st = SamplingTensors.from_params(params, logits.shape[-1], row_to_request)
    return compute_probs(logits, st, counts, prompt)


def softmax(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).softmax(-1)


def close(a, b, atol=1e-6) -> bool:
    return torch.allclose(torch.as_tensor(a).float(), torch.as_tensor(b).float(), atol=atol, rtol=0)


# ----------------------------------------------------------------------------- transforms, exact
def test_defaults_are_plain_softmax():
    logits = [1.0, 2.0, 0.5, -1.0]
    assert close(probs_for(logits, [SamplingParams()])[0], softmax(logits))


def test_logit_bias():
    p = probs_for([0.0, 0.0, 0.0, 0.0], [SamplingParams(logit_bias={1: 2.0, 3: -100.0})])
    assert close(p[0], softmax([0.0, 2.0, 0.0, -100.0]))


def test_repetition_penalty_uses_prompt_and_generated():
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5]])
    counts = torch.tensor([[0, 3, 0, 0]])
    prompt = torch.tensor([[True, False, False, False]])
    p = probs_for(logits, [SamplingParams(repetition_penalty=2.0)], counts=counts, prompt=prompt)
    assert close(p[0], softmax([1.0, -2.0, 1.0, 0.5]))  # positive / r, negative * r, once per token


def test_a_tiny_repetition_penalty_saturates_instead_of_giving_nan():
    """r = 1e-196 is a valid penalty (> 0) that divides positive logits past the float range: the
    tokens at +inf share the mass equally (softmax's limit), no row turns NaN, at any temperature."""
    logits = torch.tensor([[2.0, 3.0, -1.0, 1.0]])
    prompt = torch.tensor([[True, True, True, False]])
    counts = torch.zeros(1, 4, dtype=torch.long)
    for temperature in (1.0, 0.7):
        p = probs_for(logits, [SamplingParams(repetition_penalty=1e-196, temperature=temperature)],
                      counts=counts, prompt=prompt)
        assert torch.isfinite(p).all()
        assert close(p[0], [0.5, 0.5, 0.0, 0.0])


def test_a_tiny_repetition_penalty_leaves_forbidden_tokens_forbidden():
    """A grammar's forbidden tokens are at -inf before the penalties; r = 5e-324 (valid, > 0) is 0 in
    float32, and -inf * 0 would be NaN, which greedy argmax picks: they stay at -inf (found by the
    schemathesis fuzzer: a chat request with ``structured_outputs`` and that penalty)."""
    inf = float("-inf")
    logits = torch.tensor([[inf, 3.0, -1.0, inf], [inf, -2.0, -1.0, inf]])
    prompt = torch.tensor([[True, True, True, True]] * 2)
    counts = torch.zeros(2, 4, dtype=torch.long)
    for temperature in (0.0, 1.0):
        params = [SamplingParams(repetition_penalty=5e-324, temperature=temperature)] * 2
        p = probs_for(logits, params, counts=counts, prompt=prompt)
        assert not torch.isnan(p).any()
        assert (p[:, [0, 3]] == 0).all() and torch.allclose(p.sum(-1), torch.ones(2))


def test_presence_and_frequency_use_generated_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    counts = torch.tensor([[0, 3, 1, 0]])
    prompt = torch.tensor([[True, True, False, False]])
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)
    p = probs_for(logits, [params], counts=counts, prompt=prompt)
    assert close(p[0], softmax([1.0, 1.0 - 1.5 - 1.0, 1.0 - 0.5 - 1.0, 1.0]))


def test_penalties_need_counts():
    with pytest.raises(ValueError, match="token_counts"):
        probs_for([1.0, 2.0], [SamplingParams(presence_penalty=0.5)])


def test_temperature():
    logits = [1.0, 2.0, 0.5]
    assert close(probs_for(logits, [SamplingParams(temperature=0.5)])[0], softmax([2.0, 4.0, 1.0]))


def test_top_k_and_ties_at_the_boundary():
    p = probs_for([3.0, 1.0, 2.0, 0.0], [SamplingParams(top_k=2)])[0]
    assert close(p, softmax([3.0, -INF, 2.0, -INF]))
    p = probs_for([3.0, 2.0, 2.0, 0.0], [SamplingParams(top_k=2)])[0]  # tie at the k-th value: both kept
    assert close(p, softmax([3.0, 2.0, 2.0, -INF]))
    for k in (0, -1, 4, 10):  # disabled
        assert close(probs_for([3.0, 2.0, 2.0, 0.0], [SamplingParams(top_k=k)])[0], softmax([3.0, 2.0, 2.0, 0.0]))


def test_top_p_smallest_set_with_mass_at_least_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    cases = {0.45: [1, 0, 0, 0], 0.6: [1, 1, 0, 0], 0.81: [1, 1, 1, 0], 0.97: [1, 1, 1, 1], 1.0: [1, 1, 1, 1]}
    for top_p, keep in cases.items():
        p = probs_for(logits, [SamplingParams(top_p=top_p)])[0]
        expect = torch.tensor([0.5, 0.3, 0.15, 0.05]) * torch.tensor(keep)
        assert close(p, expect / expect.sum()), top_p


def test_top_p_mass_exactly_p_stops_there():
    logits = torch.tensor([0.0, -math.log(2), -math.log(4), -math.log(8), -math.log(8)])
    if logits.softmax(-1).tolist() != [0.5, 0.25, 0.125, 0.0625, 0.0625]:
        pytest.skip("float32 softmax is not exact on this platform")
    p = probs_for(logits, [SamplingParams(top_p=0.75)])[0]  # 0.5 + 0.25 == 0.75 already reaches p
    assert close(p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0, 0.0]))


def test_top_p_keeps_at_least_one_token_and_all_ties():
    for tiny in (1e-6, 5e-324):  # the second rounds to 0 in float32 (found by schemathesis: a 500)
        p = probs_for([1.0, 3.0, 2.0], [SamplingParams(top_p=tiny)])[0]
        assert p.tolist() == [0.0, 1.0, 0.0], tiny
    p = probs_for([1.0, 1.0, 1.0, 0.0], [SamplingParams(top_p=0.5)])[0]  # 2 would do; the tie keeps 3
    assert close(p, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))


def test_min_p_relative_to_max():
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = probs_for(base.log(), [SamplingParams(min_p=0.2)])[0]  # threshold 0.1
    assert close(p, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    p = probs_for(base.log(), [SamplingParams(min_p=1.0)])[0]
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_greedy_is_one_hot_on_processed_argmax():
    p = probs_for([1.0, 3.0, 2.0], [SamplingParams(temperature=0.0, top_k=1, top_p=0.1)])[0]
    assert p.tolist() == [0.0, 1.0, 0.0]
    p = probs_for([1.0, 3.0, 2.0], [SamplingParams(temperature=0.0, logit_bias={0: 5.0})])[0]
    assert p.tolist() == [1.0, 0.0, 0.0]
    p = probs_for([2.0, 3.0, 3.0], [SamplingParams(temperature=0.0)])[0]
    assert p.tolist() == [0.0, 1.0, 0.0]  # ties: first index
    counts = torch.tensor([[0, 1, 0]])
    p = probs_for([1.0, 3.0, 2.0], [SamplingParams(temperature=0.0, frequency_penalty=2.0)], counts=counts)[0]
    assert p.tolist() == [0.0, 0.0, 1.0]


def test_combination_order():
    # bias before the penalty (the penalty sees the biased sign), penalty before temperature,
    # and top-k / top-p / min-p see the tempered, penalised ranking
    logits = torch.tensor([[1.0, -0.5, 0.9, 0.2, -2.0]])
    counts = torch.tensor([[2, 0, 0, 0, 0]])
    params = SamplingParams(logit_bias={1: 1.5}, repetition_penalty=2.0, frequency_penalty=0.25,
                            temperature=0.5, top_k=3, top_p=0.85, min_p=0.1)
    x = torch.tensor([1.0, 1.0, 0.9, 0.2, -2.0])  # bias: token 1 goes from -0.5 to 1.0
    x[0] = x[0] / 2.0 - 0.5  # repetition then frequency: 0.0
    x = x / 0.5  # temperature: [0, 2, 1.8, 0.4, -4]
    x[[0, 4]] = -INF  # top-k 3 keeps tokens 1, 2, 3
    q = x.softmax(-1)  # about [0, .495, .405, .100, 0]: top-p 0.85 drops token 3
    assert q[1] < 0.85 < q[1] + q[2] and q[2] / q[1] > 0.1  # min-p 0.1 keeps token 2
    expect = torch.tensor([0.0, math.exp(2.0), math.exp(1.8), 0.0, 0.0])
    got = compute_probs(logits, SamplingTensors.from_params([params], 5), counts)
    assert close(got[0], expect / expect.sum())


def reference_probs(logits: list[float], p: SamplingParams, counts: list[int], prompt: list[bool]) -> list[float]:
    """Row-at-a-time reference in float64 with plain Python loops."""
    x = list(logits)
    for t, b in p.logit_bias.items():
        x[t] += b
    x = [(v / p.repetition_penalty if v > 0 else v * p.repetition_penalty) if (c > 0 or pr) else v
         for v, c, pr in zip(x, counts, prompt)]
    x = [v - p.frequency_penalty * c - p.presence_penalty * (c > 0) for v, c in zip(x, counts)]
    if p.greedy:
        best = max(range(len(x)), key=lambda i: (x[i], -i))
        return [float(i == best) for i in range(len(x))]
    x = [v / p.temperature for v in x]
    if 0 < p.top_k < len(x):
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [v if v >= kth else -INF for v in x]

    def norm(v):
        m = max(v)
        e = [math.exp(a - m) for a in v]
        return [a / sum(e) for a in e]

    if p.top_p < 1:
        order = sorted(range(len(x)), key=lambda i: -x[i])
        probs, mass, last = norm(x), 0.0, None
        for i in order:
            if mass >= p.top_p:
                break
            mass, last = mass + probs[i], x[i]
        x = [v if v >= last else -INF for v in x]
    if p.min_p > 0:
        probs = norm(x)
        x = [v if pr >= p.min_p * max(probs) else -INF for v, pr in zip(x, probs)]
    return norm(x)


def random_params(gen: torch.Generator, vocab: int) -> SamplingParams:
    r = lambda: float(torch.rand((), generator=gen))  # noqa: E731
    return SamplingParams(
        temperature=0.0 if r() < 0.2 else 0.3 + 1.5 * r(),
        top_k=int(torch.randint(0, vocab + 2, (), generator=gen)) if r() < 0.5 else 0,
        top_p=0.2 + 0.8 * r() if r() < 0.5 else 1.0,
        min_p=0.3 * r() if r() < 0.4 else 0.0,
        presence_penalty=2 * r() - 1 if r() < 0.4 else 0.0,
        frequency_penalty=2 * r() - 1 if r() < 0.4 else 0.0,
        repetition_penalty=0.5 + r() if r() < 0.4 else 1.0,
        logit_bias={int(torch.randint(0, vocab, (), generator=gen)): 3 * r()} if r() < 0.3 else {},
    )


def test_mixed_batch_matches_rows_alone_and_reference():
    gen = torch.Generator().manual_seed(0)
    vocab, n_req = 12, 16
    params = [random_params(gen, vocab) for _ in range(n_req)]
    rows = [i for i in range(n_req) for _ in range(2)]  # two tree rows per request, different histories
    logits = torch.randn(len(rows), vocab, generator=gen) * 2
    counts = torch.randint(0, 3, (len(rows), vocab), generator=gen)
    counts = counts * (torch.rand(len(rows), vocab, generator=gen) < 0.3)
    prompt = torch.rand(len(rows), vocab, generator=gen) < 0.2
    batch = probs_for(logits, params, rows, counts, prompt)
    for r, req in enumerate(rows):
        alone = probs_for(logits[r:r + 1], [params[req]], None, counts[r:r + 1], prompt[r:r + 1])
        assert close(batch[r], alone[0], atol=1e-7), (r, params[req])
        ref = reference_probs(logits[r].double().tolist(), params[req], counts[r].tolist(), prompt[r].tolist())
        assert close(batch[r], ref, atol=1e-5), (r, params[req])


def test_sampling_tensors_flags_and_validation():
    st = SamplingTensors.from_params([SamplingParams(), SamplingParams(temperature=0, top_k=3)], 10)
    assert not (st.any_top_k or st.any_top_p or st.any_min_p or st.any_penalty or st.any_bias or st.all_greedy)
    assert st.any_greedy
    st = SamplingTensors.from_params([SamplingParams(logit_bias={2: 1.0}, top_k=3)], 10, [0, 0, 0])
    assert st.num_rows == 3 and st.any_top_k and st.max_top_k == 3
    assert st.bias_index.tolist() == [2, 12, 22]
    with pytest.raises(ValueError, match="out of range"):
        SamplingTensors.from_params([SamplingParams(logit_bias={10: 1.0})], 10)
    with pytest.raises(ValueError):
        SamplingTensors.from_params([SamplingParams()], 10, [1])


def test_token_count_matrix():
    m = token_count_matrix([[1, 1, 3], [], [0]], 4)
    assert m.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


# ----------------------------------------------------------------------------- logprobs
def test_raw_and_top_logprobs():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    lp = raw_logprobs(logits)
    assert close(lp.exp().sum(-1), [1.0])
    chosen, ids, vals = top_logprobs(lp, torch.tensor([2]), 2)
    assert ids.tolist() == [[1, 2]] and close(vals, lp[:, [1, 2]]) and close(chosen, lp[:, 2])
    assert top_logprobs(lp, torch.tensor([0]), 0)[1].shape == (1, 0)


# ----------------------------------------------------------------------------- sampling, exact
def test_inverse_cdf_edges():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75])
    below_one = 1.0 - 2.0 ** -24  # largest float32 < 1
    for u, tok in [(0.0, 1), (0.2499, 1), (0.25, 3), (0.9, 3), (below_one, 3), (1.0, 3)]:
        assert sample_from_probs(probs[None], torch.tensor([u])).item() == tok, u
    tail_zero = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    for u in (below_one, 1.0):  # 1.0 is outside the contract; the clamp still avoids zero-prob tokens
        assert sample_from_probs(tail_zero, torch.tensor([u])).item() == 1
    unnormalised = torch.tensor([[0.0, 2.0, 0.0, 6.0]])  # e.g. a residual (p - q)+
    assert sample_from_probs(unnormalised, torch.tensor([0.24])).item() == 1
    assert sample_from_probs(unnormalised, torch.tensor([0.26])).item() == 3


def test_inverse_cdf_without_the_vocabulary_scan_is_the_reference_and_never_draws_zero_weight():
    """On the CPU the index is not mapped through a scan for the last positive token (the cdf never
    steps down there); on rows with long zero runs, tiny weights and uniforms up to the largest float
    below 1 it draws exactly what the scanned mapping draws, never a zero-weight token."""
    g = torch.Generator().manual_seed(11)
    rows, vocab = 512, 300
    probs = torch.rand(rows, vocab, generator=g) ** 8  # many tiny weights
    probs[torch.rand(rows, vocab, generator=g) < 0.7] = 0.0  # and long runs of zeros
    probs[:, -5:] = 0.0  # a zero tail
    probs[:, 0] += 1e-30
    u = torch.rand(rows, generator=g)
    u[::4] = 1.0 - 2.0 ** -24
    got = sample_from_probs(probs, u)
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
    last_positive = torch.where(probs > 0, torch.arange(vocab).expand_as(probs), -1).cummax(dim=-1).values
    want = last_positive.gather(1, idx).squeeze(1)
    assert bool((probs.gather(1, got[:, None]) > 0).all())
    assert torch.equal(got, want)


def test_k_distinct_exact_and_exhausted():
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25]])
    # draw 1: u=.6 -> cdf [.5,.5,.75,1] -> token 2; draw 2 on [.5,0,0,.25]: u=.7 -> .525 -> token 3
    assert sample_k_distinct(probs, torch.tensor([[0.6, 0.7, 0.1, 0.5]])).tolist() == [[2, 3, 0, -1]]


def test_sample_k_distinct_is_k_draws_with_the_drawn_zeroed():
    """Against its definition, written out: draw ``j`` is :func:`sample_from_probs` on the weights with
    the earlier draws zeroed, -1 once a row has no weight left (rows of 1-3 positive tokens, k = 4)."""
    gen = torch.Generator().manual_seed(5)
    probs = torch.rand(40, 30, generator=gen) ** 3
    probs[torch.rand(40, 30, generator=gen) < 0.5] = 0.0
    probs[:8, 3:] = 0.0  # at most 3 tokens with weight
    probs[8, :] = 0.0
    probs[9, :] = 0.0
    probs[9, 7] = 1e-40  # a denormal's weight still counts
    u = torch.rand(40, 4, generator=gen)
    weights, want = probs.clone(), []
    for j in range(4):
        alive = weights.sum(dim=-1) > 0
        tok = sample_from_probs(weights, u[:, j])
        want.append(torch.where(alive, tok, -1))
        weights.scatter_(1, tok[:, None], 0.0)
    got = sample_k_distinct(probs, u)
    assert torch.equal(got, torch.stack(want, dim=1))
    assert (got[:8, 3] == -1).all() and (got[8] == -1).all() and got[9].tolist() == [7, -1, -1, -1]
    assert sample_k_distinct(probs, u[:, :0]).shape == (40, 0)


# ----------------------------------------------------------------------------- randomness
def test_draw_uniforms_shape_and_padding():
    g = [make_generator(1), make_generator(2)]
    u = draw_uniforms(g, [3, 1])
    assert u.shape == (2, 3) and u[1, 1:].tolist() == [0.0, 0.0] and bool(((u >= 0) & (u < 1)).all())
    with pytest.raises(ValueError):
        draw_uniforms(g, [1])


@pytest.mark.parametrize("owner", [[0, 1, 0, 2, 0, 1, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]],
                         ids=["shared", "a-generator-a-row"])
def test_draw_uniforms_gives_each_row_what_one_draw_a_row_gives(owner: list[int]):
    """Rows of one generator, interleaved with others' and with rows drawing nothing, get the numbers
    one ``torch.rand`` a row in row order would give them, and the generators end in the same state."""
    widths = [2, 3, 0, 1, 4, 2, 0, 3]

    def gens():
        return [make_generator(s) for s in range(11, 11 + len(owner))]

    ours, ref = gens(), gens()
    u = draw_uniforms([ours[o] for o in owner], widths)
    want = torch.zeros(len(widths), max(widths))
    for r, (o, n) in enumerate(zip(owner, widths)):
        if n:
            want[r, :n] = torch.rand(n, generator=ref[o])
    assert torch.equal(u, want)
    assert all(torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b)) for a, b in zip(ours, ref))


def test_seeded_generators_reproduce_independent_of_batch():
    probs = torch.softmax(torch.randn(1, 50, generator=torch.Generator().manual_seed(3)), -1)
    alone = [sample_tokens(probs, [make_generator(123)]).item() for _ in range(3)]
    g = make_generator(123)
    seq_alone = [sample_tokens(probs, [g]).item() for _ in range(20)]
    g, other = make_generator(123), make_generator(None)
    seq_batch = [sample_tokens(probs.expand(2, -1), [other, g])[1].item() for _ in range(20)]
    assert seq_alone == seq_batch and len(set(alone)) == 1
    a = sample_without_replacement(probs, 4, [make_generator(7)])
    b = sample_without_replacement(probs, 4, [make_generator(7)])
    assert torch.equal(a, b) and len(set(a[0].tolist())) == 4


# ----------------------------------------------------------------------------- sampling, statistical
def test_sample_from_probs_matches_distribution():
    p = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.4, 0.1])
    n = 40_000
    g = make_generator(2024)
    toks = sample_tokens(p.expand(n, -1), [g] * n)
    counts = torch.bincount(toks, minlength=6)
    assert counts[1] == 0
    keep = p > 0
    assert chisquare(counts[keep].numpy(), (p[keep] * n).numpy()).pvalue > P_MIN


def ordered_tuple_law(p: list[float], k: int, replacement: bool) -> dict[tuple[int, ...], float]:
    law = {}
    pool = itertools.product(range(len(p)), repeat=k) if replacement else itertools.permutations(range(len(p)), k)
    for tup in pool:
        prob, left = 1.0, 1.0
        for t in tup:
            prob *= p[t] / left
            left -= 0.0 if replacement else p[t]
        law[tup] = prob
    return law


def test_sample_without_replacement_matches_exact_joint_law():
    p = [0.4, 0.25, 0.2, 0.1, 0.05]
    n, k = 30_000, 3
    toks = sample_without_replacement(torch.tensor([p]).expand(n, -1), k, [make_generator(99)] * n)
    observed: dict[tuple[int, ...], int] = {}
    for tup in map(tuple, toks.tolist()):
        observed[tup] = observed.get(tup, 0) + 1
    law = ordered_tuple_law(p, k, replacement=False)
    assert set(observed) <= set(law)  # always k distinct tokens
    keys = sorted(law)
    obs = [observed.get(t, 0) for t in keys]
    assert chisquare(obs, [law[t] * n for t in keys]).pvalue > P_MIN
    # the test has power: the naive "renormalise nothing" law (with replacement, conditioned on distinct)
    naive = ordered_tuple_law(p, k, replacement=True)
    z = sum(naive[t] for t in keys)
    assert chisquare(obs, [naive[t] / z * n for t in keys]).pvalue < 1e-6


def test_a_draft_levels_sampling_compiles_as_one_graph():
    """What a draft level does on the device for its rows (penalties, bias, temperature, top-k/p/min-p,
    then children drawn without replacement) has no data-dependent host step:
    ``torch.compile(fullgraph=True)`` traces it whole and draws what the eager code draws."""
    from engine.sampler import finish_probs, process_logits

    params = [SamplingParams(temperature=0.8, top_p=0.7, top_k=20, min_p=0.05, max_tokens=4, presence_penalty=0.5,
                             frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={5: 3.0}),
              SamplingParams(temperature=1.0, max_tokens=4)]
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    st = SamplingTensors.from_params(params, vocab, [0, 0, 1])
    x = torch.randn(3, vocab, generator=gen)
    counts = torch.randint(0, 3, (3, vocab), dtype=torch.int32, generator=gen)
    prompt = torch.rand(3, vocab, generator=gen) < 0.2
    u = torch.rand(3, 2, generator=gen)

    def level(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = finish_probs(process_logits(logits, st, counts, prompt), st)
        return sample_k_distinct(probs, u), probs

    torch._dynamo.reset()
    explain = torch._dynamo.explain(level)(x)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    compiled = torch.compile(level, fullgraph=True, backend="eager")
    assert all(torch.equal(a, b) for a, b in zip(level(x), compiled(x)))
