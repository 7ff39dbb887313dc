"""The batched verifier (``engine.speculative.verify``) against the per-row walk
(``engine.speculative.walk``) on the same random numbers: identical accepted paths, tokens, final
rows and bonus flags for every tree shape, drafter mix, greedy and sampled rows mixed in one batch.
The walk's output law is proven exactly (``tests/exact_law.py``), so this carries the proof over."""

from __future__ import annotations

import random

import pytest
import torch

from engine.request import SamplingParams
from engine.sampler import SamplingTensors, raw_logprobs
from engine.speculative.draft_tree import DEAD, MAXGRAM, SAMPLED, DraftTree
from engine.speculative.proposer import DeviceTokens
from engine.speculative.tree import TreeTopology
from engine.speculative.verify import TableCoins, TreeBatch, draw_tables, start_verify, verify_batch
from engine.speculative.walk import verify_greedy, verify_sampled

CPU = torch.device("cpu")
SHAPES = [(), (1,), (3,), (1, 1, 1), (2, 1), (2, 2), (3, 2, 1), (4, 2, 2)]


def random_law(vocab: int, rng: random.Random, zeros: float = 0.3) -> torch.Tensor:
    w = torch.tensor([0.0 if rng.random() < zeros else rng.random() ** 3 for _ in range(vocab)])
    if w.sum() == 0:
        w[rng.randrange(vocab)] = 1.0
    return w / w.sum()


def random_tree(vocab: int, rng: random.Random, chains: bool = True) -> DraftTree:
    """A draft-model tree (children drawn without replacement from random laws; some slots DEAD)
    with Max-Gram-like one-hot chains appended, sharing nodes where tokens coincide (``chains``)."""
    widths = rng.choice(SHAPES)
    sub = TreeTopology(widths or (1,)).subtree(widths)
    parents = sub.parent.tolist()
    tokens, q = [], {}
    for i, par in enumerate(parents):
        row = par + 1
        if row not in q:
            q[row] = random_law(vocab, rng)
        taken = {tokens[j] for j in range(i) if parents[j] == par}
        dead = tokens and tokens[par] == DEAD if par >= 0 else False
        left = [t for t in range(vocab) if q[row][t] > 0 and t not in taken]
        tokens.append(DEAD if dead or not left or rng.random() < 0.1 else rng.choice(left))
    tree = DraftTree(sub, tokens, q=q)
    for _ in range(rng.randrange(3) if chains else 0):
        live = [i for i, t in enumerate(tree.tokens) if t != DEAD]
        parent = rng.choice([-1] + live)
        tree.add_path(parent, [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))], MAXGRAM)
    return tree


def batch_case(seed: int, vocab: int = 9, batch: int = 5):
    rng = random.Random(seed)
    trees = [random_tree(vocab, rng) for _ in range(batch)]
    params = [SamplingParams(temperature=0.0 if rng.random() < 0.3 else 1.0, max_tokens=8) for _ in trees]
    batch_trees = TreeBatch.build(trees, vocab, CPU)
    r = batch_trees.num_rows
    logits = torch.randn(batch, r, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    gens = [None if p.greedy else torch.Generator().manual_seed(seed * 31 + i) for i, p in enumerate(params)]
    uniforms = draw_tables(gens, batch_trees, CPU)
    st = SamplingTensors.from_params(params, vocab, [i for i in range(batch) for _ in range(r)])
    return trees, params, batch_trees, logits, st, uniforms


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("without_replacement", [True, False])
def test_batched_verifier_matches_the_walk(seed: int, without_replacement: bool) -> None:
    trees, params, batch_trees, logits, st, uniforms = batch_case(seed)
    logprobs = [seed % 4 if i % 2 else None for i in range(len(trees))]
    out = verify_batch(logits, st, batch_trees, uniforms, without_replacement, raw_logits=logits, logprobs=logprobs)
    probs = torch.softmax(logits, dim=-1)
    for b, (tree, p) in enumerate(zip(trees, params)):
        n = 1 + tree.num_nodes
        if p.greedy:
            best = logits[b, :n].argmax(-1).tolist()
            want = verify_greedy(lambda row: best[row], tree.tokens, tree.events())
        else:
            coins = TableCoins(uniforms.accept[b], uniforms.final[b])
            want = verify_sampled(lambda row: probs[b, row], lambda row: tree.q[row], tree.tokens, tree.events(),
                                  coins, without_replacement)
        got = out.results[b]
        assert (got.accepted, got.tokens, got.bonus, got.final_row, got.rows) == \
            (want.accepted, want.tokens, want.bonus, want.final_row, want.rows), f"sequence {b}"
        if logprobs[b] is None:
            assert out.logprobs[b] is None
            continue
        lp = raw_logprobs(logits[b, want.rows])
        assert [t.token_id for t in out.logprobs[b]] == want.tokens
        for j, t in enumerate(out.logprobs[b]):
            assert t.logprob == pytest.approx(float(lp[j, want.tokens[j]]), abs=1e-6)
            assert [i for i, _ in t.top] == lp[j].topk(logprobs[b]).indices.tolist()


@pytest.mark.parametrize("seed", [3, 11])
@pytest.mark.parametrize("greedy", [False, True], ids=["mixed", "all-greedy"])
def test_the_verification_step_compiles_as_one_graph(seed: int, greedy: bool) -> None:
    """``start_verify``'s device work (every decision, the walk, the logprobs) has no data-dependent
    host step: ``torch.compile(fullgraph=True)`` traces it whole, and the compiled step decides what the
    eager one does.  What varies with the batch (its trees' shape, which rows sample) is host-known."""
    trees, params, batch_trees, logits, st, uniforms = batch_case(seed)
    if greedy:
        st = SamplingTensors.from_params([SamplingParams(temperature=0.0, max_tokens=8)], 9,
                                         [0] * (len(trees) * batch_trees.num_rows))
        uniforms = None
    asked = [2 if i % 2 else None for i in range(len(trees))]

    def step(x: torch.Tensor) -> list[torch.Tensor]:
        return start_verify(x, st, batch_trees, uniforms, True, raw_logits=x, logprobs=asked).tensors

    torch._dynamo.reset()
    explain = torch._dynamo.explain(step)(logits)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    assert all(torch.equal(a, b) for a, b in zip(step(logits), compiled(logits)))


def test_all_greedy_batch_never_builds_probabilities() -> None:
    trees, _, batch_trees, logits, _, _ = batch_case(7)
    st = SamplingTensors.from_params([SamplingParams(temperature=0.0, max_tokens=8)], 9,
                                     [0] * (len(trees) * batch_trees.num_rows))
    out = verify_batch(logits, st, batch_trees, None)
    for b, tree in enumerate(trees):
        best = logits[b, : 1 + tree.num_nodes].argmax(-1).tolist()
        want = verify_greedy(lambda row: best[row], tree.tokens, tree.events())
        assert out.results[b].tokens == want.tokens and out.results[b].accepted == want.accepted


def test_seeded_tables_reproduce_and_do_not_depend_on_the_batch() -> None:
    rng = random.Random(3)
    trees = [random_tree(9, rng) for _ in range(6)]
    small = min(trees, key=lambda t: t.num_nodes)
    alone = draw_tables([torch.Generator().manual_seed(5)], TreeBatch.build([small], 9, CPU), CPU)
    batch = TreeBatch.build([trees[0], small, *trees], 9, CPU)
    mixed = draw_tables([None, torch.Generator().manual_seed(5)] + [torch.Generator().manual_seed(6)] * 6, batch, CPU)
    rows, events = alone.accept.shape[1:]
    assert torch.equal(alone.accept[0], mixed.accept[1, :rows, :events]) and not mixed.accept[1, rows:].any()
    assert torch.equal(alone.final[0], mixed.final[1, :rows])
    assert not mixed.accept[0].any() and not mixed.final[0].any()  # greedy: nothing drawn


def test_empty_trees_emit_one_token_from_the_root() -> None:
    sub = TreeTopology((2,)).subtree(())
    trees = [DraftTree(sub, []), DraftTree(sub, [])]
    batch = TreeBatch.build(trees, 5, CPU)
    assert batch.num_rows == 1 and batch.depth == 0 and batch.ev_rows.numel() == 0
    logits = torch.tensor([[[0.0, 3.0, 0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0, 0.0, 9.0]]])
    st = SamplingTensors.from_params([SamplingParams(temperature=0.0, max_tokens=4),
                                      SamplingParams(temperature=1.0, max_tokens=4)], 5)
    u = draw_tables([None, torch.Generator().manual_seed(0)], batch, CPU)
    out = verify_batch(logits, st, batch, u)
    assert out.results[0].tokens == [1] and out.results[0].bonus and out.results[0].accepted == []
    assert out.results[1].tokens == [4]  # probability 1 - 4e-4 of token 4 at T=1; the seed draws it


@pytest.mark.parametrize("nudge", [0, 1])
def test_acceptance_boundary_is_u_times_q_below_p(nudge: int) -> None:
    """``u * q(x) == p(x)`` rejects, the next float down accepts: the rule is ``u < p / q`` exactly
    (strict, so ``u == 0`` never accepts a token the target rules out)."""
    sub = TreeTopology((1,)).subtree(())
    tree = DraftTree(sub, [])
    tree.add_path(-1, [1], MAXGRAM)  # one one-hot proposal at the root (q = 1)
    batch = TreeBatch.build([tree], 4, CPU)
    logits = torch.tensor([[[0.0, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])
    p1 = torch.softmax(logits[0, 0], -1)[1]
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0, max_tokens=4)], 4, [0, 0])
    u = draw_tables([torch.Generator().manual_seed(1)], batch, CPU)
    u.accept[0, 0, 0] = torch.nextafter(p1, torch.tensor(0.0)) if nudge else p1
    got = verify_batch(logits, st, batch, u).results[0]
    want = verify_sampled(lambda row: torch.softmax(logits[0, row], -1), lambda row: None, tree.tokens,
                          tree.events(), TableCoins(u.accept[0], u.final[0]))
    assert got.accepted == want.accepted == ([0] if nudge else [])


@pytest.mark.parametrize("seed", range(30))
def test_batched_target_init_matches_the_walk(seed: int) -> None:
    """The target-initialised (lossy) rule as tensors against ``verify_target_init`` +
    ``draw_candidates`` walked with the same numbers: the kept candidate and chain, the final row and
    the next candidates, and the emitted tokens' logprobs read with them; greedy and sampled rows mixed, DEAD
    candidates and empty first steps."""
    from engine.sampler import compute_probs
    from engine.speculative.target_init import TargetInitCoins, draw_candidates, start_target_init, verify_target_init
    from engine.speculative.walk import residual

    rng, vocab, k = random.Random(seed), 9, 3
    trees = []
    for _ in range(5):
        depth = rng.choice([0, 1, 2, 3])
        widths = (k,) + (1,) * (depth - 1) if depth else ()
        sub = TreeTopology((k, 1, 1)).subtree(widths)
        parents = sub.parent.tolist()
        tokens, q = [], {}
        for i, par in enumerate(parents):
            if par < 0:  # a candidate (forced from the target's draw; distinct)
                taken = set(tokens)
                tokens.append(DEAD if rng.random() < 0.15 else rng.choice([t for t in range(vocab) if t not in taken]))
            else:
                q[par + 1] = random_law(vocab, rng)
                left = [t for t in range(vocab) if q[par + 1][t] > 0]
                tokens.append(DEAD if tokens[par] == DEAD else rng.choice(left))
        trees.append(DraftTree(sub, tokens, q=q))
    params = [SamplingParams(temperature=0.0 if rng.random() < 0.3 else 0.8, max_tokens=8) for _ in trees]
    batch = TreeBatch.build(trees, vocab, CPU)
    r = batch.num_rows
    logits = torch.randn(len(trees), r, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    st = SamplingTensors.from_params(params, vocab, [i for i in range(len(trees)) for _ in range(r)])
    u_accept, u_cand = torch.rand(len(trees), r), torch.rand(len(trees), k)
    asked = [[None, 0, 3][b % 3] for b in range(len(trees))]  # logprobs: none, the token's, 3 alternatives
    got = start_target_init(logits, st, batch, u_accept, u_cand, k, raw_logits=logits, logprobs=asked).result()
    for b, (tree, p) in enumerate(zip(trees, params)):
        st1 = SamplingTensors.from_params([p], vocab)
        coins = TargetInitCoins(u_accept[b], u_cand[b])
        probs = lambda row: compute_probs(logits[b, row][None], st1)[0]  # noqa: E731

        def accept(row: int, node: int) -> bool:
            x = tree.tokens[node]
            if p.greedy:
                return int(logits[b, row].argmax()) == x
            return coins.accept(float(probs(row)[x]), float(tree.q[row][x]), row)

        want, rejected = verify_target_init(accept, tree.tokens, [[c for c, _ in evs] for evs in tree.events()])
        law = probs(want.final_row)
        if rejected and not p.greedy:
            law = residual(law, tree.q[want.final_row])
        cands = draw_candidates(logits[b, want.final_row], law, st1, k, coins)
        res, got_cands, lps = got[b]
        assert (res.accepted, res.tokens, res.final_row, res.rows) == \
            (want.accepted, want.tokens, want.final_row, want.rows), f"sequence {b}"
        assert got_cands == cands, f"sequence {b}"
        if asked[b] is None:
            assert lps is None
            continue
        assert [lp.token_id for lp in lps] == want.tokens
        for lp, row in zip(lps, want.rows):  # each token's logprob at its row, read with the decisions
            logp = logits[b, row].log_softmax(-1)
            assert lp.logprob == pytest.approx(float(logp[lp.token_id]), abs=1e-5)
            assert [t for t, _ in lp.top] == logp.topk(asked[b]).indices.tolist()


def test_plain_steps_take_the_short_path_to_the_same_tokens(monkeypatch) -> None:
    """Plain decoding's verification (``LosslessRule._start_plain``) draws exactly the tokens the general
    rule draws for empty trees, from the same uniforms, in a batch mixing greedy and seeded sampled
    requests with top-k / top-p / min-p, penalties and a logit bias, joining at different steps."""
    from engine.core import EngineCore
    from engine.config import EngineConfig
    from engine.request import GenerationRequest, SpecOptions
    from engine.speculative.verify import LosslessRule
    from tests.tiny import tiny_loaded

    target = tiny_loaded("llama", seed=0)
    common = dict(max_tokens=12, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, **common),
              SamplingParams(temperature=0.8, seed=1, **common),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=20, presence_penalty=0.5, seed=2, **common),
              SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.3, logit_bias={7: 5.0}, seed=3,
                             **common),
              SamplingParams(temperature=0.0, frequency_penalty=0.7, **common)]
    calls = []

    def run(short: bool) -> list[list[int]]:
        monkeypatch.setattr(LosslessRule, "plain_step", staticmethod(
            lambda seqs, trees: calls.append(short) is None and short and all(not t.num_nodes for t in trees)))
        core = EngineCore(target, None, EngineConfig.from_settings(max_batch=4, max_model_len=64, tree=()))
        out: dict[str, list[int]] = {}
        for step in range(200):
            if step < len(params):  # one request joins per step; the fifth waits for a free slot
                core.add_request(GenerationRequest(f"r{step}", [3 + step, 5, 7], params[step], SpecOptions()))
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if step >= len(params) and not core.has_unfinished():
                break
        return [out[f"r{i}"] for i in range(len(params))]

    general = run(False)
    short = run(True)
    assert short == general and all(len(t) == 12 for t in short)
    assert True in calls and False in calls


def held(trees: list[DraftTree]) -> DeviceTokens:
    """``trees``' tokens moved into a :class:`DeviceTokens`, as the proposer leaves a draft tree whose
    tokens the host has not read; their host lists hold placeholders until something reads them."""
    holder = DeviceTokens(trees, CPU)
    holder.flat = torch.tensor([t for tree in trees for t in tree.tokens] + [0])
    for tree in trees:
        tree.tokens = [DEAD] * tree.num_nodes
    holder.hold()
    return holder


def device_tails(holder: DeviceTokens, trees: list[DraftTree], vocab: int, rng: random.Random) -> None:
    """Most held trees get a one-hot chain below their deepest level's first node whose tokens are held
    too (as ``device_maxgram`` appends Max-Gram's tail), DEAD past a random end and below a DEAD
    node, and some a host branch from the root after it."""
    grown, values = [], []
    for tree in trees:
        if not tree.num_nodes or rng.random() < 0.3:
            continue
        leaf = tree.sub.level(tree.sub.max_depth).start
        n, live = rng.randrange(1, 4), rng.randrange(0, 4)
        dead = int(holder.flat[holder.offset_of(tree) + leaf]) == DEAD
        values += [DEAD if dead or j >= live else rng.randrange(vocab) for j in range(n)]
        tree.add_path(leaf, [0] * n, MAXGRAM, merge=False)
        grown.append((tree, n))
    if grown:
        holder.append(grown, torch.tensor(values), list(range(len(values))))
    for tree in trees:
        if rng.random() < 0.3:
            tree.add_path(-1, [rng.randrange(vocab)], MAXGRAM, merge=False)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("without_replacement", [True, False])
def test_trees_held_on_the_device_verify_as_the_walk(seed: int, without_replacement: bool) -> None:
    """The draft model's trees, their tokens still on the device (``DraftTree.unread``), with tails
    held there too and host branches, batched with host trees: built without reading them, every
    held node enters as an event and the DEAD ones are skipped.  Against the walk over the live events, each reading the uniform its event had in
    the table: the same accepted paths, tokens, final rows and bonus flags."""
    rng = random.Random(1000 + seed)
    vocab, n_held = 9, 3
    trees = [random_tree(vocab, rng, chains=False) for _ in range(n_held)] + [random_tree(vocab, rng) for _ in range(2)]
    holder = held(trees[:n_held])
    device_tails(holder, trees[:n_held], vocab, rng)
    params = [SamplingParams(temperature=0.0 if rng.random() < 0.3 else 1.0, max_tokens=8) for _ in trees]
    batch = TreeBatch.build(trees, vocab, CPU)
    assert all(t.unread is holder for t in trees[:n_held])  # built without a read
    r = batch.num_rows
    logits = torch.randn(len(trees), r, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    gens = [None if p.greedy else torch.Generator().manual_seed(seed * 31 + i) for i, p in enumerate(params)]
    uniforms = draw_tables(gens, batch, CPU)
    st = SamplingTensors.from_params(params, vocab, [i for i in range(len(trees)) for _ in range(r)])
    structural = [t.events(live_only=False) for t in trees[:n_held]]
    out = verify_batch(logits, st, batch, uniforms, without_replacement)
    probs = torch.softmax(logits, dim=-1)
    for b, (tree, p) in enumerate(zip(trees, params)):
        events = tree.events()  # the live ones (a held tree's tokens are read here)
        if p.greedy:
            best = logits[b, : 1 + tree.num_nodes].argmax(-1).tolist()
            want = verify_greedy(lambda row: best[row], tree.tokens, events)
        else:
            accept = uniforms.accept[b].clone()
            if b < n_held:  # the live events' uniforms, in the order the walk reads them
                for row, evs in enumerate(structural[b]):
                    at = [j for j, (node, _) in enumerate(evs) if tree.tokens[node] != DEAD]
                    accept[row, : len(at)] = uniforms.accept[b, row, at]
            coins = TableCoins(accept, uniforms.final[b])
            want = verify_sampled(lambda row: probs[b, row], lambda row: tree.q[row], tree.tokens, events, coins,
                                  without_replacement)
        got = out.results[b]
        assert (got.accepted, got.tokens, got.bonus, got.final_row) == \
            (want.accepted, want.tokens, want.bonus, want.final_row), f"sequence {b}"


def test_verification_reads_held_tokens_with_its_decisions() -> None:
    """One read: the pending of the lossless rule brings the held tokens back with its decisions."""
    from engine.device import sync_listeners
    from engine.speculative.verify import start_verify, with_held_tokens

    rng = random.Random(4)
    trees = [random_tree(9, rng, chains=False) for _ in range(3)]
    want = [list(t.tokens) for t in trees]
    held(trees)
    batch = TreeBatch.build(trees, 9, CPU)
    logits = torch.randn(3, batch.num_rows, 9)
    st = SamplingTensors.from_params([SamplingParams(temperature=0.0, max_tokens=4)] * 3, 9,
                                     [i for i in range(3) for _ in range(batch.num_rows)])
    reads = []
    sync_listeners.append(reads.append)
    try:
        with_held_tokens(trees, start_verify(logits, st, batch, None)).result()
    finally:
        sync_listeners.remove(reads.append)
    assert reads == ["to_host"]
    assert all(t.unread is None for t in trees) and [t.tokens for t in trees] == want


@pytest.mark.parametrize("seed", range(30))
def test_a_trees_event_table_is_its_events_as_arrays(seed: int) -> None:
    """``DraftTree.event_table`` (what ``TreeBatch.build`` reads) lists ``events()`` row by row, in
    verification order: appended one-hot chains first, DEAD nodes dropped only when asked."""
    rng = random.Random(500 + seed)
    tree = random_tree(9, rng)
    if rng.random() < 0.5 and tree.num_nodes:  # a sampled chain of its own below a live node or the root
        live = [i for i, t in enumerate(tree.tokens) if t != DEAD]
        parent = rng.choice([-1] + live)
        if not any(k == SAMPLED for c, k in tree.extra_events.get(parent + 1, []) if c >= tree.num_sub):
            tree.add_path(parent, [rng.randrange(9)], "cascade", kind=SAMPLED, q=[random_law(9, rng)], merge=False)
    for live_only in (True, False):
        rows, nodes, kinds = tree.event_table(live_only)
        want = [(row, c, k) for row, evs in enumerate(tree.events(live_only)) for c, k in evs]
        if live_only:  # events() drops the drafted DEAD nodes; nothing appended is DEAD
            assert all(tree.tokens[c] != DEAD for _, c, _ in want)
        assert list(zip(rows.tolist(), nodes.tolist(), kinds.tolist())) == want
