"""Adaptive speculation: the SpecDec++ stopping rule stops exactly where it says (min/max depth
honoured), the online calibrator converges, the budget chooser picks plain decoding when
verification is prohibitive and the whole tree when it is free, acceptance heads round-trip, and
greedy output with adaptive depth is token-identical to plain decoding on tiny models."""

import dataclasses

import math

import pytest
import torch

from engine.config import EngineConfig
from engine.request import SpecOptions
from engine.speculative.acceptance_head import AcceptanceHead, HeadMeta
from engine.speculative.adaptive import AdaptiveSpeculation, OnlineCalibrator, StepBudget, keep_extending
from engine.speculative.cost_model import BudgetChooser, CostCurve, CostModel, LiveCurve, measure_curve
from engine.speculative.features import CHEAP_FEATURES, NodeFeatures
from engine.speculative.draft_tree import DraftTree
from engine.speculative.tree import TreeTopology
from tests.engine_utils import run_engine
from tests.tiny import tiny_loaded

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [42]]
ZERO = CostCurve((1.0,), (0.0,))


class ScriptedY(AdaptiveSpeculation):
    """y_hat from a script: ``y[d-1]`` is a number (every depth-d node) or a list (per node of the level).
    Records (subtree nodes, live drafted nodes, verified block rows) of every verified tree."""

    def __init__(self, topology, y, **kw):
        super().__init__(topology, **kw)
        self.y = y
        self.verified = []

    def observe(self, results):
        super().observe(results)
        self.verified += [(r.tree.sub.num_nodes, r.drafted, r.logits.shape[0]) for r in results]

    def predict(self, seq, feats):
        y = torch.as_tensor(self.y[int(feats.depth[0]) - 1], dtype=torch.float32)
        return y.expand(feats.num_nodes) if y.dim() == 0 else y


def drafted_depth(policy, widths, dead=(), seq=None):
    """Drives ``keep_drafting`` level by level as the proposer does; returns the depth it stops at."""
    sub = policy.topology.subtree(widths)
    tree = DraftTree(sub, [1] * sub.num_nodes)
    step = StepBudget(widths, 1.0)  # one step of one sequence: its root row, then the levels it keeps
    for d in range(1, sub.max_depth + 1):
        lv = sub.level(d)
        live = torch.tensor([i not in dead for i in range(lv.start, lv.stop)])
        n = lv.stop - lv.start
        tree.features.append(NodeFeatures(torch.full((n,), d), sub.rank[lv], torch.full((n,), 0.5), live))
        if d == sub.max_depth or not policy.keep_drafting([seq], [tree], d, step)[0]:
            return d


CHAIN = (1, 1, 1, 1, 1)


@pytest.mark.parametrize("y,h,min_depth,expected", [
    ([0.9] * 5, 0.3, 1, 4),  # cum .9 .81 .729 .656 -> 1 - .656 > .3 at depth 4
    ([0.9] * 5, 0.3, 5, 5),  # min_depth forces the whole chain
    ([0.5] * 5, 0.3, 1, 1),
    ([0.5] * 5, 0.3, 3, 3),  # below min_depth it goes on, then stops at once
    ([0.95, 0.2, 0.99, 0.99, 0.99], 0.5, 1, 2),
    ([0.01] * 5, 1.0, 1, 5),  # h = 1 never stops
    ([0.999] * 5, 0.0, 2, 2),  # h = 0 stops as soon as allowed
])
def test_threshold_rule_on_a_chain(y, h, min_depth, expected):
    policy = ScriptedY(TreeTopology(CHAIN), y, threshold=h, min_depth=min_depth)
    assert drafted_depth(policy, CHAIN) == expected


def test_threshold_rule_follows_the_best_branch_of_a_tree():
    topo = TreeTopology((2, 2, 2, 1))
    # depth 1: [.9, .5]; depth 2 under node 0: [.1, .1], under node 1: [.99, .99] -> best path .495
    y = [[0.9, 0.5], [0.1, 0.1, 0.99, 0.99], [0.8] * 8, [1.0] * 8]
    assert drafted_depth(ScriptedY(topo, y, threshold=0.6), (2, 2, 2, 1)) == 3  # .495 >= .4; then .396 < .4
    assert drafted_depth(ScriptedY(topo, y, threshold=0.5), (2, 2, 2, 1)) == 2  # .495 < .5
    # the only branch worth extending is dead (no token could be drawn there): stop
    assert drafted_depth(ScriptedY(topo, y, threshold=0.6), (2, 2, 2, 1), dead={4, 5}) == 2



class GreedySeq:
    draft_slot = 0
    num_output = 5
    tokens: list = []
    draft_cached = 0
    request = type("R", (), {"spec": type("S", (), {"enabled": True}), "sampling": type("P", (), {"greedy": True})})


class LaggingSeq(GreedySeq):
    """A greedy sequence whose draft cache lags ``lag`` tokens, with ``remaining`` tokens to write (a
    request of its own)."""

    made = 0

    def __init__(self, lag, remaining):
        self.tokens, self.draft_cached, self.remaining = [0] * (lag + 10), 10, remaining
        LaggingSeq.made += 1
        self.request = type("R", (type(self).request,), {"request_id": f"lagging-{LaggingSeq.made}"})


def test_a_confident_path_drafts_deeper_than_the_budget_when_a_level_pays():
    """Verification costs 1 s whatever its size, a draft level 0.3 s; at the prior rates (0.6) the
    budget is one level, and one more level pays when the path's expected gain ``cum * 0.6`` exceeds
    0.3 s in tokens of the plan's 1.3 s / 1.6 tokens (0.369), i.e. for ``cum > 0.615``."""
    topo = TreeTopology((1,) * 6)
    cost = CostModel(CostCurve((1.0, 1000.0), (1.0, 1.0)), CostCurve((1.0, 1000.0), (0.3, 0.3)))

    def depth(y):
        policy = ScriptedY(topo, y, threshold=0.9, cost=cost)
        budget = policy.budget([GreedySeq()]).widths
        assert policy._chosen_depth == 1 and budget == (1,) * 6
        assert policy.chooser.level_tokens(2, 1, 1) == pytest.approx(0.3 / (1.3 / 1.6))
        return drafted_depth(policy, budget, seq=GreedySeq())

    assert depth([0.95] * 6) == 6  # cum .95 .90 .86 .81 .77: every level pays
    assert depth([0.95, 0.6, 0.99, 0.99, 0.99, 0.99]) == 2  # cum .57 after depth 2: gain .34 < .369
    assert depth([0.95, 0.7, 0.99, 0.99, 0.99, 0.99]) == 6  # cum .665: gain .40
    assert depth([0.5] * 6) == 1  # the threshold rule alone would go on (h = 0.9), the cost says stop
    busy = BudgetChooser(topo, CostModel(CostCurve((1.0, 1000.0), (1.0, 1.0 + 999 * 0.2)), cost.draft), 1, 6)
    rates = OnlineCalibrator(6).rates()
    busy.choose([(1, rates)], plain=0)
    alone = busy.level_tokens(2, 1, 1)
    busy.choose([(1, rates)], plain=7)  # the same sequence among 7 that decode plainly: rows cost more
    assert busy.level_tokens(9, 1, 1) > alone
    # verification gets 1 s slower past 4 rows: the third level below the budget pays for that step
    stepped = CostModel(CostCurve((1.0, 4.0, 5.0, 1000.0), (1.0, 1.0, 2.0, 2.0)), cost.draft)
    policy = ScriptedY(topo, [0.95] * 6, threshold=0.9, cost=stepped)
    budget = policy.budget([GreedySeq()]).widths
    assert budget == (1,) * 6 and policy._chosen_depth == 1
    per_token = 1.3 / 1.6
    assert [policy.chooser.level_tokens(rows, 1, 1) for rows in (2, 3, 4)] == pytest.approx(
        [0.3 / per_token, 0.3 / per_token, 1.3 / per_token])
    assert drafted_depth(policy, budget, seq=GreedySeq()) == 3  # 4 rows; a fourth level would cost 1.6 tokens

class PerSeqY(AdaptiveSpeculation):
    """y_hat = ``seq.y[d - 1]`` for every depth-d node of the sequence's tree."""

    def predict(self, seq, feats):
        return torch.full((feats.num_nodes,), seq.y[int(feats.depth[0]) - 1])


def grown(policy, ys, widths=(1,) * 4):
    """Sequences with per-depth y_hat ``ys[j]`` draft together; returns each one's depth."""
    seqs = [type("Seq", (GreedySeq,), {"y": y})() for y in ys]
    step = policy.budget(seqs)
    sub = policy.topology.subtree(tuple(min(a, b) for a, b in zip(widths, step.widths)))
    trees = [DraftTree(sub, [1] * sub.num_nodes) for _ in seqs]
    depth, active = [sub.max_depth] * len(seqs), list(range(len(seqs)))
    for d in range(1, sub.max_depth):
        lv = sub.level(d)
        for i in active:
            n = lv.stop - lv.start
            trees[i].features.append(NodeFeatures(torch.full((n,), d), sub.rank[lv], torch.full((n,), 0.5),
                                                  torch.ones(n, dtype=torch.bool)))
        keep = policy.keep_drafting([seqs[i] for i in active], [trees[i] for i in active], d, step)
        for i, k in zip(list(active), keep):
            if not k:
                depth[i] = d
                active.remove(i)
    return depth


def test_a_level_grows_only_when_the_trees_that_grow_it_pay_for_it_together():
    """A draft forward costs 0.3 s whatever its size, verification 1 s whatever its size.  For two
    sequences at the prior rates (0.6) the plan is one level at 1.3 s / 3.2 tokens, so a level costs
    0.3 / 0.406 = 0.74 tokens: a path with cum 0.95 (gain 0.57) does not pay for it alone, two do, and a
    less sure path (cum 0.4, gain 0.24) pays the rest for the sure one."""
    cost = CostModel(CostCurve((1.0, 1000.0), (1.0, 1.0)), CostCurve((1.0, 1000.0), (0.3, 0.3)))
    policy = PerSeqY(TreeTopology((1,) * 4), threshold=0.9, cost=cost)
    sure, unsure, hopeless = [0.95, 1.0, 1.0, 1.0], [0.4, 1.0, 1.0, 1.0], [0.05, 1.0, 1.0, 1.0]
    assert grown(policy, [sure, hopeless]) == [1, 1]  # the hopeless one fails the threshold (cum < 0.1)
    assert policy.chooser.level_tokens(3, 1, 1) == pytest.approx(0.3 / (1.3 / 3.2))
    assert grown(policy, [sure, sure]) == [4, 4]
    assert grown(policy, [sure, unsure]) == [4, 4]  # 0.57 + 0.24 > 0.74, and deeper levels keep paying
    assert grown(policy, [unsure, unsure]) == [1, 1]  # 0.48 < 0.74
    # the same sure path alone in a batch of one pays: its own plan is 1.3 s / 1.6 tokens (a level: 0.37)
    assert grown(policy, [sure]) == [4]


def test_keep_extending_exact_cases():
    assert keep_extending(torch.tensor([0.3, 0.71]), 2, threshold=0.3, min_depth=1)
    assert not keep_extending(torch.tensor([0.3, 0.69]), 2, threshold=0.3, min_depth=1)
    assert keep_extending(torch.tensor([0.0]), 1, threshold=0.3, min_depth=2)
    assert not keep_extending(torch.tensor([]), 2, threshold=0.3, min_depth=1)


def test_calibrator_converges_on_synthetic_data():
    """True P(accept) = a[d, r] * q with q ~ U(0, 1): the bin estimates reach the bin means of the truth."""
    g = torch.Generator().manual_seed(0)
    a = torch.tensor([[0.95, 0.5], [0.8, 0.4], [0.6, 0.3]])  # [depth, rank]
    cal = OnlineCalibrator(max_depth=3, decay=0.9995)
    for _ in range(4000):
        depth = torch.randint(1, 4, (16,), generator=g)
        rank = torch.randint(0, 2, (16,), generator=g)
        q = torch.rand(16, generator=g)
        accepted = (torch.rand(16, generator=g) < a[depth - 1, rank] * q).float()
        cal.update(depth, rank, q, accepted)
    edges = torch.cat([torch.zeros(1), OnlineCalibrator.Q_BINS, torch.ones(1)])
    mids = (edges[1:] + edges[:-1]) / 2
    for d in range(3):
        for r in range(2):
            est = cal.predict(torch.full((len(mids),), d + 1), torch.full((len(mids),), r), mids)
            wide = (edges[1:] - edges[:-1]) >= 0.1  # well-populated bins
            assert (est - a[d, r] * mids)[wide].abs().max() < 0.06, (d, r, est, a[d, r] * mids)
            assert abs(float(cal.rates()[d, r]) - float(a[d, r]) / 2) < 0.04  # E[a q] = a / 2



def test_calibrator_scales_q_and_keeps_its_resolution_inside_a_bin():
    """A fresh calibrator trusts the draft (estimate = q); once a cell shows the draft over-confident,
    every q in it is scaled down, and two greedy tokens in the top bin (0.975 and 0.999) stay apart:
    a chain of the latter is what pays to draft deep, a bin average would blur them."""
    q = torch.tensor([0.05, 0.5, 0.975, 0.999])
    ones = torch.ones(4, dtype=torch.long)
    fresh = OnlineCalibrator(max_depth=2)
    assert torch.allclose(fresh.predict(ones, 0 * ones, q), q)
    assert torch.allclose(fresh.predict(2 * ones, 0 * ones, q), q)  # unseen depth: as calibrated as depth 1
    cal = OnlineCalibrator(max_depth=2, decay=1.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(400):  # depth 1, top bin: accepted with probability 0.9 q
        qs = 0.97 + 0.03 * torch.rand(8, generator=g)
        cal.update(torch.ones(8, dtype=torch.long), torch.zeros(8, dtype=torch.long), qs,
                   (torch.rand(8, generator=g) < 0.9 * qs).float())
    est = cal.predict(ones[:2], 0 * ones[:2], q[2:])
    assert torch.allclose(est, 0.9 * q[2:], atol=0.02)
    assert float(est[1] / est[0]) == pytest.approx(float(q[3] / q[2]))  # one factor for the bin, q kept
    deeper = cal.predict(torch.tensor([2]), torch.tensor([0]), q[3:])  # depth 2 inherits the factor
    assert float(deeper) == pytest.approx(float(est[1]), abs=0.02)


def test_undrafted_depths_inherit_the_rate_one_level_up():
    """Only depth 1 is ever observed (the budget never drafted deeper): deeper depths read as good as
    depth 1, not as a fixed pessimistic prior, so a chooser that would pay for depth 2 at that rate
    drafts it (and measures it) instead of being stuck at depth 1 for good."""
    cal = OnlineCalibrator(max_depth=3)
    ones = torch.ones(200, dtype=torch.long)
    cal.update(ones, 0 * ones, torch.full((200,), 0.9), (torch.arange(200) % 10 != 0).float())  # 90% accepted
    rates = cal.rates()
    assert rates[0, 0] == pytest.approx(0.9, abs=0.02)
    assert torch.allclose(rates[1:, 0], rates[0, 0].expand(2))
    # depth 2 turns out bad: its estimate follows the data, and depth 3 (still unseen) follows depth 2
    cal.update(2 * ones, 0 * ones, torch.full((200,), 0.9), (torch.arange(200) % 10 == 0).float())
    rates = cal.rates()
    assert rates[1, 0] < 0.2 and rates[2, 0] == pytest.approx(float(rates[1, 0]))
    # a level costs half a verification: deeper pays at a 0.9 rate, not at the old fixed prior 0.6
    cost = CostModel(CostCurve((1.0, 1000.0), (1.0, 1.0)), CostCurve((1.0, 1000.0), (0.5, 0.5)))
    chooser = BudgetChooser(TreeTopology((1, 1, 1)), cost, 1, 3)
    fresh = OnlineCalibrator(max_depth=3)
    fresh.update(ones, 0 * ones, torch.full((200,), 0.9), (torch.arange(200) % 10 != 0).float())
    assert chooser.choose([(1, fresh.rates())], plain=0) == (1, 1, 1)
    stale = fresh.rates().clone()
    stale[1:] = 0.6  # the old prior for depths never drafted
    assert chooser.choose([(1, stale)], plain=0) == (1,)

def test_budget_prices_the_next_catch_up_of_an_accepted_deepest_node():
    """The deepest level is never run through the draft, so when one of its nodes is accepted the next
    step's catch-up reads two tokens (it and the root): a chain of depth 1 at acceptance 0.4 costs the
    verification (1 s), plus a draft forward over 1.4 rows on average (0.3 s a row), for 1.4 tokens:
    more than plain decoding's 1 s a token.  Priced at one row, it looked like a saving."""
    cost = CostModel(CostCurve((1.0, 1000.0), (1.0, 1.0)), CostCurve((1.0, 1000.0), (0.3, 300.0)))
    chain = BudgetChooser(TreeTopology((1,)), cost, 1, 1)
    assert chain.choose([(1, torch.full((1, 1), 0.4))], plain=0) == ()  # (1 + 0.3 * 1.4) / 1.4 > 1
    assert chain.choose([(1, torch.full((1, 1), 0.5))], plain=0) == (1,)
    assert chain.per_token == pytest.approx((1.0 + 0.3 * 1.5) / 1.5)
    assert chain.saving == pytest.approx(1.0 - (1.0 + 0.3 * 1.5) / 1.5)
    # two levels at 0.1 s a draft row: the first level runs (its one node a sequence), and the catch-up
    # reads the depth-2 node when both are accepted (0.8 * 0.8); two sequences share each forward
    cheap = CostModel(cost.target, CostCurve((1.0, 1000.0), (0.1, 100.0)))
    deep = BudgetChooser(TreeTopology((1, 1)), cheap, 2, 2)
    assert deep.choose([(2, torch.full((2, 1), 0.8))], plain=0) == (1, 1)
    assert deep.per_token == pytest.approx((1.0 + 0.1 * (2 + 2 * 0.64) + 0.1 * 2) / (2 * (1 + 0.8 + 0.64)))


def test_cost_curve_fit_and_interpolation():
    c = CostCurve.fit([(1, 1.0), (10, 2.0), (10, 4.2), (10, 1.9), (20, 1.5), (30, 3.0)])
    assert c.tokens == (1.0, 10.0, 20.0, 30.0)
    # fastest at each count (1.9 at 10), then the lower convex hull: 10 lies above the line 1 -> 20
    assert c.seconds == pytest.approx((1.0, 1.0 + 0.5 * 9 / 19, 1.5, 3.0))
    assert c(5.5) == pytest.approx(1.0 + 0.5 * 4.5 / 19) and c(0.5) == 1.0 and c(40) == pytest.approx(4.5)


def test_cost_curve_fit_prices_every_added_row_after_a_stalled_point():
    """A stall at 5 rows (measured today: 4 rows 207 ms, 5 rows 303 ms, then 318 up to 8 and one price
    from 17 to 28 rows) must not leave stretches where added rows cost nothing."""
    c = CostCurve.fit([(1, .108), (4, .207), (5, .303), (7, .318), (8, .318), (17, .721), (20, .721),
                       (28, .721), (40, 1.549), (56, 1.989)])
    slopes = [(c(n + 1) - c(n)) for n in range(1, 55)]
    assert min(slopes) > 0.02  # every row costs something: 20 ms or more
    assert all(b >= a - 1e-12 for a, b in zip(slopes, slopes[1:]))  # convex: never cheaper further on
    flat = CostCurve.fit([(1, 1.0), (4, 0.8), (8, 2.0)])  # a first point slower than the next
    assert flat.seconds == pytest.approx((1.0, 1.0, 2.0))  # still never decreasing


RATES = torch.tensor([[0.7, 0.2, 0.1, 0.05]]).expand(3, 4)


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_budget_is_empty_when_verification_is_prohibitive_and_full_when_free(batch):
    topo = TreeTopology((4, 2, 2))
    prohibitive = BudgetChooser(topo, CostModel(CostCurve((1.0, 1000.0), (1.0, 1000.0)), ZERO), 1, 3)
    free = BudgetChooser(topo, CostModel(CostCurve((1.0, 1000.0), (1.0, 1.0)), ZERO), 1, 3)
    assert prohibitive.choose([(batch, RATES)], plain=0) == ()
    assert free.choose([(batch, RATES)], plain=0) == (4, 2, 2)


def test_budget_shrinks_as_the_batch_grows():
    topo = TreeTopology((4, 2, 2))
    cost = CostModel(CostCurve((1.0, 1000.0), (1.0, 1.0 + 999 * 0.03)), CostCurve((1.0, 1000.0), (0.1, 3.1)))
    chooser = BudgetChooser(topo, cost, 1, 3)
    sizes = [topo.subtree(chooser.choose([(b, RATES)], plain=0)).num_nodes for b in (1, 2, 4, 8, 16)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1] > 0


def test_measured_cost_curve_is_monotone_and_frees_its_slots():
    model = tiny_loaded("llama").model
    cache = model.new_cache(4, 64)
    curve = measure_curve(model, cache, [(1, 1), (2, 8), (4, 8)], reps=2)
    assert curve.tokens == (1.0, 16.0, 32.0)
    assert all(s > 0 for s in curve.seconds) and list(curve.seconds) == sorted(curve.seconds)
    assert cache.free_slots == 4 and int(cache.pending.sum()) == 0


def test_a_catch_up_is_priced_by_its_own_curve():
    """A catch-up needs the logits of its last row only, so it has a curve of its own (measured with
    the last row's logits, at lengths the draft cache holds); the level curve, logits at every row,
    priced it 2.5x too high.  Without one (curves built by hand), the level curve prices it."""
    levels = CostCurve((1.0, 1000.0), (0.01, 10.0))
    assert not CostModel(levels, levels).catch_up_pays(500, 100, 0.01)  # 5 s against 1 s saved
    cheap = CostModel(levels, levels, CostCurve((1.0, 1000.0), (0.001, 1.0)))
    assert cheap.catch_up_pays(500, 100, 0.01) and not cheap.catch_up_pays(500, 40, 0.01)
    target = tiny_loaded("llama", seed=0).model
    draft = tiny_loaded("llama", seed=1, layers=1).model
    measured = CostModel.measure(target, target.new_cache(2, 64), draft, draft.new_cache(2, 48), 2,
                                 TreeTopology((2, 1)))
    assert measured.catch_up is not None and measured.catch_up.tokens[-1] == 48.0  # capped at the cache's length
    assert measured.catch_up_curve is measured.catch_up


def test_a_start_that_measures_the_cost_curves_says_so_and_one_that_reads_them_does_not(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "cache"))
    files = {name: tmp_path / f"{name}.gguf" for name in ("target", "draft")}
    for f in files.values():
        f.write_bytes(b"weights")
    target = dataclasses.replace(tiny_loaded("llama", seed=0), path=files["target"])
    draft = dataclasses.replace(tiny_loaded("llama", seed=1, layers=1), path=files["draft"])
    config = EngineConfig(adaptive=True, tree=(2, 1), max_batch=2)

    def start() -> list[str]:
        caplog.clear()
        with caplog.at_level("INFO", logger="engine.speculative.cost_model"):
            AdaptiveSpeculation.from_config(config, TreeTopology((2, 1)), target, draft,
                                            target.model.new_cache(2, 64), draft.model.new_cache(2, 64))
        return [r.getMessage() for r in caplog.records if r.name == "engine.speculative.cost_model"]

    first = start()
    assert any(m.startswith("cost model: timing forwards") for m in first)
    assert any(m.startswith("cost model: measured in") and "cost-model" in m for m in first)
    second = start()
    assert not any("timing forwards" in m or "measured in" in m for m in second)
    assert any(m.startswith("cost model: the curves measured at") for m in second)


def test_cost_curves_are_stored_and_reused_only_for_the_same_models_and_settings(tmp_path, monkeypatch):
    """A second start with the same model files and settings reads the curves the first one measured;
    other settings, changed files, ``cost_model_cache = false`` or a damaged file measure again;
    models with no files are never stored."""
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "cache"))
    measured = []
    real = CostModel.measure.__func__
    monkeypatch.setattr(CostModel, "measure", classmethod(lambda cls, *a, **k: measured.append(1) or real(cls, *a, **k)))
    files = {name: tmp_path / f"{name}.gguf" for name in ("target", "draft")}
    for f in files.values():
        f.write_bytes(b"weights")
    target = dataclasses.replace(tiny_loaded("llama", seed=0), path=files["target"])
    draft = dataclasses.replace(tiny_loaded("llama", seed=1, layers=1), path=files["draft"])
    topo = TreeTopology((2, 1))

    def start(t=target, d=draft, **kw) -> CostModel:
        config = EngineConfig(**{"adaptive": True, "tree": (2, 1), "max_batch": 2, **kw})
        policy = AdaptiveSpeculation.from_config(config, topo, t, d, t.model.new_cache(2, 64), d.model.new_cache(2, 64))
        return policy.chooser.cost

    first = start()
    stored = list((tmp_path / "cache" / "cost-model").glob("*.json"))
    assert len(measured) == 1 and len(stored) == 1
    assert start() == first and len(measured) == 1  # read back, exactly
    start(cost_model_cache=False)
    assert len(measured) == 2
    start(max_batch=1)
    assert len(measured) == 3
    files["draft"].write_bytes(b"other weights")
    start()
    assert len(measured) == 4
    start()
    assert len(measured) == 4
    for f in (tmp_path / "cache" / "cost-model").glob("*.json"):
        f.write_text("{not json")
    start()
    assert len(measured) == 5
    start()
    assert len(measured) == 5  # the damaged file was replaced
    in_memory = tiny_loaded("llama", seed=0)
    before = set((tmp_path / "cache" / "cost-model").glob("*.json"))
    start(t=in_memory)
    start(t=in_memory)
    assert len(measured) == 7 and set((tmp_path / "cache" / "cost-model").glob("*.json")) == before


@pytest.fixture(scope="module")
def models():
    return tiny_loaded("llama", seed=0), tiny_loaded("llama", seed=0), tiny_loaded("llama", seed=1, layers=1)


def plain(target, prompts, **kw):
    outs, _ = run_engine(target, None, prompts, tree=(), ignore_eos=True, **kw)
    return [o.tokens for o in outs]


@pytest.mark.parametrize("tree", [(4, 2, 2), (1, 1, 1, 1)])
@pytest.mark.parametrize("threshold", [0.2, 0.8])
def test_greedy_with_adaptive_depth_equals_plain_decoding(models, tree, threshold):
    target, self_draft, other_draft = models
    expected = plain(target, PROMPTS)
    config = dict(adaptive=True, adaptive_threshold=threshold, load_aware=False)
    for draft in (self_draft, other_draft):
        outs, core = run_engine(target, draft, PROMPTS, tree=tree, ignore_eos=True, config=config)
        assert [o.tokens for o in outs] == expected
        steps = [s for s in core.drain_step_stats() if s.num_seqs]
        assert sum(s.drafted_tokens for s in steps) > 0
    assert core.policy.calibrators[True].seen.sum() > 0  # it learned from verification


def test_adaptive_stops_early_and_verifies_only_drafted_nodes(models):
    """y = .9 everywhere, h = .3: every speculating step drafts exactly 4 levels of the 5-chain (the first
    step decodes plainly: the first token never waits for the draft to read the prompt)."""
    target, self_draft, _ = models
    policy = ScriptedY(TreeTopology(CHAIN), [0.9] * 5, threshold=0.3)
    outs, core = run_engine(target, self_draft, PROMPTS[:1], tree=CHAIN, max_batch=1, ignore_eos=True,
                            max_tokens=30, policy=policy)
    assert outs[0].tokens == plain(target, PROMPTS[:1], max_tokens=30)[0]
    steps = [s for s in core.drain_step_stats() if s.num_seqs]
    assert all(s.drafted_tokens == min(4, s.budget) for s in steps)
    assert steps[0].drafted_tokens == 0
    assert steps[1].drafted_by_depth == [1, 1, 1, 1] and steps[1].accepted_by_depth == [1, 1, 1, 1]
    assert outs[0].spec.steps == len(steps) - 1
    assert all(sub == drafted == rows - 1 for sub, drafted, rows in policy.verified)  # the cut tree is verified


def test_max_and_min_depth_are_honoured(models):
    target, _, other_draft = models
    expected = plain(target, PROMPTS)
    for h, depth in ((0.0, 2), (1.0, 3)):  # h = 0 stops at min_depth; h = 1 never stops before max_depth
        config = dict(adaptive=True, adaptive_threshold=h, adaptive_min_depth=2, adaptive_max_depth=3,
                      load_aware=False)
        outs, core = run_engine(target, other_draft, PROMPTS, tree=(2, 1, 1, 1), ignore_eos=True, config=config)
        depths = [len(s.drafted_by_depth) for s in core.drain_step_stats() if s.drafted_tokens]
        assert max(depths) == depth and depths.count(depth) > len(depths) // 2
        assert [o.tokens for o in outs] == expected
    # a request's speculative.max_depth still caps, below the adaptive min_depth too
    outs, core = run_engine(target, other_draft, PROMPTS, tree=(2, 1, 1, 1), ignore_eos=True, config=config,
                            spec=SpecOptions(max_depth=1))
    assert {len(s.drafted_by_depth) for s in core.drain_step_stats() if s.drafted_tokens} == {1}
    assert [o.tokens for o in outs] == expected


def test_cost_model_drives_the_engine_budget(models):
    target, self_draft, _ = models
    topo = TreeTopology((4, 2, 2))
    prohibitive = CostModel(CostCurve((1.0, 1000.0), (1.0, 1000.0)), ZERO)
    free = CostModel(CostCurve((1.0, 1000.0), (1.0, 1.0)), ZERO)
    expected = plain(target, PROMPTS)
    outs, core = run_engine(target, self_draft, PROMPTS, ignore_eos=True,
                            policy=AdaptiveSpeculation(topo, cost=prohibitive, probe_every=1000))
    assert [o.tokens for o in outs] == expected
    assert all(s.budget == 0 and s.drafted_tokens == 0 for s in core.drain_step_stats() if s.num_seqs)
    outs, core = run_engine(target, self_draft, PROMPTS, ignore_eos=True, policy=AdaptiveSpeculation(topo, cost=free))
    assert [o.tokens for o in outs] == expected
    assert core.drain_step_stats()[0].budget == 28


def test_a_request_can_opt_out_of_adaptive_speculation(models):
    """``speculative.adaptive = false``: the whole tree every step, whatever the budget and stopping rule
    say; still exact.  On an engine without an adaptive policy the request is told so."""
    target, self_draft, _ = models
    topo = TreeTopology((2, 1))
    prohibitive = CostModel(CostCurve((1.0, 1000.0), (1.0, 1000.0)), ZERO)
    outs, core = run_engine(target, self_draft, PROMPTS, tree=(2, 1), ignore_eos=True,
                            spec=SpecOptions(adaptive=False),
                            policy=ScriptedY(topo, [0.0, 0.0], cost=prohibitive, probe_every=1000))
    assert [o.tokens for o in outs] == plain(target, PROMPTS)
    verified = core.policy.verified
    assert verified and all(nodes == topo.num_nodes for nodes, _, _ in verified)  # never cut, never budgeted
    outs, _ = run_engine(target, self_draft, PROMPTS[:1], tree=(2, 1), spec=SpecOptions(adaptive=True))
    assert "adaptive speculation is off" in outs[0].spec.note


def test_probe_when_speculation_has_not_paid_for_a_while():
    topo = TreeTopology((4, 2, 2))
    policy = AdaptiveSpeculation(topo, min_depth=2, cost=CostModel(CostCurve((1.0, 1000.0), (1.0, 1000.0)), ZERO),
                                 probe_every=3)

    class Seq:  # the fields budget() reads
        draft_slot = 0
        request = type("R", (), {"spec": type("S", (), {"enabled": True}), "sampling": type("P", (), {"greedy": True})})

    assert [policy.budget([Seq()]).widths for _ in range(6)] == [(), (), (1, 1), (), (), (1, 1)]


def test_a_probe_never_catches_a_prompt_up():
    """A probe grants the smallest tree although speculation did not pay; it drafts with the sequences
    whose draft is (nearly) caught up, and never runs a prompt's catch-up through the draft model, even
    while the acceptance is still the prior (when an ordinary budget would catch up to learn it)."""
    topo = TreeTopology((2, 1))
    prohibitive = CostModel(CostCurve((1.0, 1000.0), (1.0, 1000.0)), CostCurve((1.0, 1000.0), (0.01, 10.0)))
    policy = AdaptiveSpeculation(topo, cost=prohibitive, probe_every=2)
    near, far = LaggingSeq(2, 100), LaggingSeq(300, 100)
    steps = [policy.budget([near, far]) for _ in range(2)]
    assert [s.widths for s in steps] == [(), (1,)] and steps[1].probe
    assert policy.catch_up_pays(near, steps[1]) and not policy.catch_up_pays(far, steps[1])
    assert policy.catch_up_pays(far)  # outside a probe, the prior's acceptance is still measured


def test_a_lagging_draft_catches_up_only_when_the_remaining_tokens_pay_for_it():
    topo = TreeTopology((2, 1, 1))
    # verification rows nearly free, a draft forward of T tokens costs T/100 s: speculation saves time
    cost = CostModel(CostCurve((1.0, 1000.0), (0.1, 0.2)), CostCurve((1.0, 1000.0), (0.01, 10.0)))
    policy = AdaptiveSpeculation(topo, cost=cost)

    def measured(p):  # verified first-level nodes at the prior's rate: estimates unchanged, no longer a prior
        n = 2 * p.EXPLORE_NODES
        p.calibrators[True].update(torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                                   torch.full((n,), 0.5), (torch.arange(n) % 5 < 3).float())
        return p

    assert policy.budget([LaggingSeq(0, 100)]).widths != () and policy.chooser.saving > 0
    saving = policy.chooser.saving
    assert policy.catch_up_pays(LaggingSeq(3, 1))  # a short lag always catches up (inside the first level forward)
    lag = 500  # costs about 5 s
    needed = cost.draft(lag) / saving  # tokens left for which catching up breaks even
    assert 10 < needed < policy.HORIZON / 1.2
    assert policy.catch_up_pays(LaggingSeq(lag, int(needed * 0.8)))  # nothing measured yet: catch up and learn
    measured(policy)
    assert policy.budget([LaggingSeq(0, 100)]).widths != () and policy.chooser.saving == pytest.approx(saving, rel=0.05)
    assert not policy.catch_up_pays(LaggingSeq(lag, int(needed * 0.8)))
    assert policy.catch_up_pays(LaggingSeq(lag, int(needed * 1.2)))
    huge = int(2 * policy.HORIZON * saving * 100)  # costs twice what HORIZON tokens save
    assert not policy.catch_up_pays(LaggingSeq(huge, 10**6))  # max_tokens is only a bound: HORIZON caps it
    busy = measured(AdaptiveSpeculation(topo, cost=CostModel(CostCurve((1.0, 1000.0), (1.0, 1000.0)), cost.draft)))
    assert busy.budget([LaggingSeq(lag, 10**6)]).widths == () and busy.chooser.saving == 0.0
    assert not busy.catch_up_pays(LaggingSeq(lag, 10**6))  # plain decoding pays best: nothing worth catching up for


def test_while_the_prior_is_unmeasured_one_sequence_at_a_time_catches_up_to_measure_it():
    """Nothing measured yet: a step lets one sequence per sampling mode catch up to learn the pair's
    acceptance (the shortest lag), or none when one already drafts with a warm cache; the others wait
    for the measurement instead of all paying their prompts' catch-ups (at four streams that cost more
    than the drafts won back).  Outside a planned step the prior is still measured."""
    topo = TreeTopology((2, 1, 1))
    cost = CostModel(CostCurve((1.0, 1000.0), (0.1, 0.2)), CostCurve((1.0, 1000.0), (0.01, 10.0)))
    policy = AdaptiveSpeculation(topo, cost=cost)

    class SampledLag(LaggingSeq):
        request = type("R", (), {"spec": GreedySeq.request.spec, "sampling": type("P", (), {"greedy": False})})

    far, farther, sampled = LaggingSeq(300, 100), LaggingSeq(200, 100), SampledLag(400, 100)
    step = policy.budget([far, farther, sampled])
    assert step.widths != ()
    assert [policy.catch_up_pays(s, step) for s in (far, farther, sampled)] == [False, True, True]
    warm = LaggingSeq(2, 100)
    step = policy.budget([far, warm, farther])
    assert [policy.catch_up_pays(s, step) for s in (far, warm, farther)] == [False, True, False]
    assert policy.catch_up_pays(far)  # outside a planned step


def test_exploring_catch_ups_stop_after_a_few_requests():
    """Where the draft model runs too rarely for its acceptance to be measured soon (Max-Gram drafts most
    steps), exploring catch-ups stop after ``EXPLORE_REQUESTS`` requests of a mode; a request that
    explored keeps exploring, and then the (still prior) estimates judge."""
    topo = TreeTopology((2, 1, 1))
    prohibitive = CostModel(CostCurve((1.0, 1000.0), (0.1, 0.2)), CostCurve((1.0, 1000.0), (0.01, 10.0)),
                            CostCurve((1.0, 1000.0), (1.0, 1000.0)))  # catch-ups never pay by the estimates
    policy = AdaptiveSpeculation(topo, cost=prohibitive)

    first = [LaggingSeq(300, 100) for _ in range(policy.EXPLORE_REQUESTS)]
    assert all(policy.catch_up_pays(s, policy.budget([s])) for s in first)
    late = LaggingSeq(300, 100)
    step = policy.budget([late])
    assert not policy.catch_up_pays(late, step) and step.widths == ()  # it decodes plainly
    assert policy.catch_up_pays(first[0], policy.budget([first[0]]))


def test_catch_ups_pay_back_only_over_the_tokens_the_draft_model_can_draft():
    """Tokens of steps where a long Max-Gram match drafts alone cannot repay a catch-up: the remaining
    tokens count at the measured share of tokens from the other steps (1 until measured)."""
    topo = TreeTopology((2, 1, 1))
    cost = CostModel(CostCurve((1.0, 1000.0), (0.1, 0.2)), CostCurve((1.0, 1000.0), (0.01, 10.0)))
    policy = AdaptiveSpeculation(topo, cost=cost)
    n = 2 * policy.EXPLORE_NODES  # measured at the prior's rate: no longer exploring
    policy.calibrators[True].update(torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                                    torch.full((n,), 0.5), (torch.arange(n) % 5 < 3).float())
    assert policy.draft_share(True) == 1.0
    policy.budget([LaggingSeq(0, 100)])
    lag = 50
    needed = cost.catch_up_curve(lag) / policy.chooser.saving  # tokens left for which catching up breaks even
    assert 15 * needed < policy.HORIZON
    assert policy.catch_up_pays(LaggingSeq(lag, int(needed * 1.5)))
    other = GreedySeq()
    for _ in range(200):  # Max-Gram drafted 9 tokens of 10 alone
        policy.observe_trust(other, 9, trusted=True, drafted=False)
        policy.observe_trust(other, 1, trusted=False, drafted=True)
    assert policy.draft_share(True) == pytest.approx(0.1, abs=0.02) and policy.draft_share(False) == 1.0
    assert not policy.catch_up_pays(LaggingSeq(lag, int(needed * 1.5)))
    assert policy.catch_up_pays(LaggingSeq(lag, int(needed * 15)))
    assert policy.catch_up_pays(LaggingSeq(3, 1))  # a short lag still always catches up


def test_a_prompts_catch_up_waits_until_steps_without_the_draft_have_lost_what_it_costs():
    """Ski rental: a sequence of a method that trusts long Max-Gram matches catches its prompt up only
    once its steps without the draft model are estimated to have lost the catch-up's cost (each such
    step the budget's saving, less the tokens past the first at the draft's price per token); steps
    where Max-Gram alone did better lose nothing, trusted steps count nothing, and once the draft has
    drafted for the sequence its later catch-ups are judged by the payback test alone."""
    topo = TreeTopology((2, 1, 1))
    cost = CostModel(CostCurve((1.0, 1000.0), (0.1, 0.2)), CostCurve((1.0, 1000.0), (0.01, 10.0)))
    policy = AdaptiveSpeculation(topo, cost=cost)
    n = 2 * policy.EXPLORE_NODES  # measured: no longer exploring
    policy.calibrators[True].update(torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                                    torch.full((n,), 0.5), (torch.arange(n) % 5 < 3).float())
    seq = LaggingSeq(50, 10_000)  # pays back many times over: only the rent decides
    step = policy.budget([seq])
    saving, per_token = step.saving, step.per_token  # the draft's price this step
    price = cost.catch_up_curve(50)
    assert 0 < saving < price and saving < per_token
    assert policy.catch_up_pays(seq)  # never observed: a method without trust is not held back
    policy.observe_trust(seq, 1, trusted=False, drafted=False)  # no step's price: nothing lost
    assert policy._rent[seq] == 0.0

    policy.observe_trust(seq, 1, trusted=False, drafted=False, step=step)
    assert not policy.catch_up_pays(seq)
    policy.observe_trust(seq, 40, trusted=True, drafted=False, step=step)  # Max-Gram alone: nothing either way
    policy.observe_trust(seq, 5, trusted=False, drafted=False, step=step)  # Max-Gram did better than the draft would
    assert 4 * per_token > 2 * saving and policy._rent[seq] == 0.0
    steps = 0
    while not policy.catch_up_pays(seq):
        policy.observe_trust(seq, 1, trusted=False, drafted=False, step=step)
        steps += 1
    assert steps == math.ceil(price / saving - 1e-9)
    policy.observe_trust(seq, 3, trusted=False, drafted=True, step=step)  # caught up and drafted: the draft is kept
    seq.draft_cached = 10 - 30  # a later lag of 80 tokens
    assert policy.catch_up_pays(seq) == cost.catch_up_pays(80, 10_000, policy.chooser.saving)
    assert policy.catch_up_pays(seq)


def test_the_budget_is_planned_for_the_sequences_that_draft():
    """A sequence whose catch-up does not pay decodes plainly, so the step's budget is the one for the
    others plus one plain row (a draft level no longer looks shared by it), and its decision holds for
    the step."""
    topo = TreeTopology((2, 1, 1))
    # a draft forward of T tokens costs 0.04 + T/200 s, verification 0.1 s + 1 ms a row
    cost = CostModel(CostCurve((1.0, 1000.0), (0.1, 1.1)), CostCurve((1.0, 1000.0), (0.045, 5.04)))
    policy = AdaptiveSpeculation(topo, cost=cost)
    n = 2 * policy.EXPLORE_NODES
    policy.calibrators[True].update(torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                                    torch.full((n,), 0.9), (torch.arange(n) % 10 < 9).float())

    ready, lagging = [LaggingSeq(0, 100) for _ in range(3)], LaggingSeq(800, 20)
    step = policy.budget(ready + [lagging])
    budget = step.widths
    assert not policy.catch_up_pays(lagging, step) and all(policy.catch_up_pays(s, step) for s in ready)
    alone = AdaptiveSpeculation(topo, cost=cost)
    alone.calibrators = policy.calibrators
    alone.budget(ready).widths  # the rates of the same calibrator
    expected = alone.chooser.choose([(3, alone.calibrators[True].rates())], plain=1)
    assert budget[: len(expected)] == expected and policy._chosen_depth == len(expected)
    four = alone.chooser.choose([(4, alone.calibrators[True].rates())], plain=0)
    assert four != expected  # the plan for four drafting sequences would have been another one


def test_engine_skips_the_draft_for_requests_whose_catch_up_does_not_pay(models):
    """A draft forward made very expensive per token: short requests never run the draft model (no
    draft tokens, draft cache never filled) and output stays exact."""
    target, self_draft, _ = models
    topo = TreeTopology((2, 1))
    cost = CostModel(CostCurve((1.0, 1000.0), (0.1, 0.2)), CostCurve((1.0, 1000.0), (0.01, 1000.0)))
    prompts = [list(range(3, 40)), list(range(50, 90))]
    outs, core = run_engine(target, self_draft, prompts, ignore_eos=True, max_tokens=6,
                            policy=AdaptiveSpeculation(topo, cost=cost, probe_every=1000))
    assert [o.tokens for o in outs] == plain(target, prompts, max_tokens=6)
    stats = [s for s in core.drain_step_stats() if s.num_seqs]
    assert stats and all(s.drafted_tokens == 0 for s in stats)
    cheap = CostModel(cost.target, CostCurve((1.0, 1000.0), (1e-6, 1e-3)))
    outs, core = run_engine(target, self_draft, prompts, ignore_eos=True, max_tokens=6,
                            policy=AdaptiveSpeculation(topo, cost=cheap, probe_every=1000))
    assert [o.tokens for o in outs] == plain(target, prompts, max_tokens=6)
    assert sum(s.drafted_tokens for s in core.drain_step_stats()) > 0


def test_the_engine_measures_how_much_max_gram_drafts_alone(models):
    """With ``mcsd+maxgram``, every verified step tells the policy how many tokens it emitted and
    whether a long Max-Gram match drafted it alone: on prompts that repeat themselves the share of
    tokens the draft model could draft falls below 1 (nothing for greedy-only runs in the other mode),
    and the output stays exact."""
    target, self_draft, _ = models
    prompts = [list(range(3, 15)) * 4, [7, 8, 9, 10] * 8]
    outs, core = run_engine(target, self_draft, prompts, tree=(2, 1), ignore_eos=True, max_tokens=16,
                            spec=SpecOptions(method="mcsd+maxgram"), config=dict(adaptive=True))
    assert [o.tokens for o in outs] == plain(target, prompts, max_tokens=16)
    used, total = core.policy._trust_tokens[True]
    assert total > 0 and used < total and core.policy.draft_share(True) < 1.0
    assert core.policy.draft_share(False) == 1.0


def test_load_aware_engine_measures_at_start_and_stays_exact(models):
    target, _, other_draft = models
    outs, core = run_engine(target, other_draft, PROMPTS, ignore_eos=True, config=dict(adaptive=True))
    assert core.policy.chooser is not None and core.policy.chooser.cost.target(8) > 0
    assert [o.tokens for o in outs] == plain(target, PROMPTS)
    assert core.cache.free_slots == core.cache.num_slots
    # every decoding step's verification time reached the one price both choosers read
    live = core.planner.verify
    assert live is core.policy.chooser.verify is core.planner.lengths.curve
    decoding = [s for s in core.drain_step_stats() if s.num_seqs]
    assert decoding and sum(live._count.values()) > 0.5 * len(decoding) * live.decay ** len(decoding)
    assert live.overall() != 1.0


# ---------------------------------------------------------------------------- the measured price of rows
LINEAR = CostCurve((1.0, 64.0), (1.0, 1.0 + 63 * 0.1))  # 1 s a step, 0.1 s an added row


def test_live_curve_is_the_prior_until_steps_are_measured():
    live = LiveCurve(LINEAR)
    assert live.overall() == 1.0 and all(live(n) == LINEAR(n) for n in (0.5, 1, 3.5, 8, 100))


def test_live_curve_learns_what_rows_really_cost():
    """Steps measured 1.2x the prior at 4 rows and 1.5x at 8 (each added row costs more than it was
    priced): the curve follows, interpolates the ratio between, holds it beyond, and stays monotone."""
    live = LiveCurve(LINEAR)
    for _ in range(200):
        live.observe(4, 1.2 * LINEAR(4))
        live.observe(8, 1.5 * LINEAR(8))
    # (a size's ratio is shrunk a little towards the ratio over all sizes: 3 pseudo-steps against ~50)
    assert live(4) == pytest.approx(1.2 * LINEAR(4), rel=0.02)
    assert live(8) == pytest.approx(1.5 * LINEAR(8), rel=0.02)
    assert live(6) == pytest.approx(1.35 * LINEAR(6), rel=0.02)
    assert live(20) == pytest.approx(1.5 * LINEAR(20), rel=0.02) and live(1) == pytest.approx(1.2, rel=0.02)
    slope = (live(8) - live(4)) / 4
    assert slope > 1.5 * 0.1  # the marginal row is dearer than the prior's 0.1 s
    xs = [0.5 * i for i in range(1, 100)]
    assert all(live(a) <= live(b) for a, b in zip(xs, xs[1:]))


def test_live_curve_forgets_and_clips_stalls():
    live = LiveCurve(LINEAR)
    for _ in range(100):
        live.observe(4, 2.0 * LINEAR(4))
    for _ in range(300):  # the machine got faster again (decay ~ 50 steps)
        live.observe(4, LINEAR(4))
    assert live(4) == pytest.approx(LINEAR(4), rel=0.02)
    live.observe(4, 1000 * LINEAR(4))  # one stall moves the price by at most CLIP / (steps remembered)
    assert live(4) < 1.1 * LINEAR(4)
    live.observe(0, 1.0)
    live.observe(4, 0.0)  # nothing to learn from
    assert live(4) < 1.1 * LINEAR(4)


def test_maxgram_caps_shrink_when_measured_rows_cost_more_than_priced():
    from engine.speculative.maxgram import LengthChooser
    prior = CostCurve((1.0, 16.0, 100.0), (1.0, 1.2, 20.0))  # rows nearly free up to 16
    live = LiveCurve(prior)
    chooser = LengthChooser(live, 8)
    for _ in range(200):
        chooser.observe(3, 8, 4)  # half of the time half a long match's proposal is accepted,
        chooser.observe(3, 8, 0)  # else none of it
    counts = [0, 0, 0, 8]
    assert chooser.choose(counts, 0)[3] == 1  # priced by the prior: 8 x 2 rows fit the cheap part
    for _ in range(200):  # measured: every row costs what a whole plain step does
        for n in (8, 16, 24):
            live.observe(n, n * 1.0)
    assert chooser.choose(counts, 0)[3] == 0


def head_file(tmp_path, temperature=0.0, hidden_size=64):
    torch.manual_seed(0)
    head = AcceptanceHead(HeadMeta("tiny-llama-0", "tiny-llama-1", temperature, hidden_size=hidden_size, units=16))
    path = tmp_path / f"head-{temperature}.safetensors"
    head.save(path)
    return head, path


def test_head_round_trips_with_metadata(tmp_path):
    head, path = head_file(tmp_path)
    loaded = AcceptanceHead.load(path)
    assert loaded.meta == head.meta and loaded.meta.features == list(CHEAP_FEATURES)
    n = 5
    feats = NodeFeatures(torch.arange(1, n + 1), torch.zeros(n, dtype=torch.long), torch.rand(n),
                         torch.ones(n, dtype=torch.bool), torch.rand(n), torch.rand(n, 10), torch.randn(n, 64))
    y = loaded.predict(feats)
    assert y.shape == (n,) and torch.equal(y, head.predict(feats)) and ((y > 0) & (y < 1)).all()
    with pytest.raises(ValueError, match="hidden states"):
        loaded.predict(NodeFeatures(*(t for t in (feats.depth, feats.rank, feats.q_token, feats.live,
                                                  feats.entropy, feats.top_probs)), hidden=None))



def test_head_reads_depths_beyond_its_training_tree_as_its_deepest_level():
    """A head trained on a depth-2 tree, asked about depth 5 (a deeper adaptive chain): the depth-5
    one-hot column never varied in training, so the node reads as depth 2, rank as the last rank."""
    torch.manual_seed(0)
    head = AcceptanceHead(HeadMeta("a", "b", 0.0, units=8, tree=[3, 1]))
    head.feat_std.fill_(1e-3)  # what training stores for a constant column
    n = 4
    common = (torch.rand(n), torch.ones(n, dtype=torch.bool), torch.rand(n), torch.rand(n, 10))
    deep = NodeFeatures(torch.full((n,), 5), torch.tensor([0, 1, 2, 7]), *common)
    seen = NodeFeatures(torch.full((n,), 2), torch.tensor([0, 1, 2, 2]), *common)
    assert torch.equal(head.predict(deep), head.predict(seen))
    unclamped = AcceptanceHead(HeadMeta("a", "b", 0.0, units=8))  # no training tree recorded: as given
    unclamped.load_state_dict(head.state_dict())
    assert not torch.equal(unclamped.predict(deep), head.predict(deep))

def test_head_file_errors(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(ValueError, match="does not exist"):
        AcceptanceHead.load(tmp_path / "none.safetensors")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="not an acceptance head"):
        AcceptanceHead.load(tmp_path / "plain.safetensors")


def test_greedy_with_a_head_equals_plain_decoding(models, tmp_path):
    target, _, other_draft = models
    _, path = head_file(tmp_path)
    config = dict(adaptive=True, acceptance_heads=(str(path),), load_aware=False, adaptive_threshold=0.9)
    outs, core = run_engine(target, other_draft, PROMPTS, ignore_eos=True, config=config)
    assert core.policy.wants_full_features and core.policy.heads[0].uses_hidden
    assert [o.tokens for o in outs] == plain(target, PROMPTS)


def test_sampled_requests_with_adaptive_depth_account_consistently(models):
    target, _, other_draft = models
    outs, core = run_engine(target, other_draft, PROMPTS, ignore_eos=True, temperature=0.8, seed=3,
                            config=dict(adaptive=True, load_aware=False))
    steps = [s for s in core.drain_step_stats() if s.num_seqs]
    assert all(len(o.tokens) == 24 for o in outs)
    assert sum(s.accepted_tokens for s in steps) <= sum(s.drafted_tokens for s in steps)
    assert core.policy.calibrators[False].seen.sum() > 0 and core.policy.calibrators[True].seen.sum() == 0


@pytest.mark.parametrize("kw,message", [
    (dict(tree=()), "needs a draft tree"),
    (dict(adaptive_threshold=1.5), "adaptive_threshold"),
    (dict(adaptive_min_depth=0), "adaptive_min_depth"),
    (dict(adaptive_min_depth=3, adaptive_max_depth=2), "adaptive_min_depth"),
    (dict(adaptive_max_depth=4), "deeper than the tree"),
    (dict(acceptance_heads=("/nonexistent/head.safetensors",)), "does not exist"),
])
def test_config_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{"adaptive": True, "tree": (4, 2, 2), **kw})
