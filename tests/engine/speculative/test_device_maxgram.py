"""Max-Gram on the device (``engine.speculative.device_maxgram``): the same proposals as the host's
``MaxGramDrafter.propose`` for contexts whose last tokens are on the device, and the tail it appends
to a held tree, without a read."""

from __future__ import annotations

import random

import pytest
import torch

from engine.device import sync_listeners
from engine.speculative.device_maxgram import DeviceMaxGram
from engine.speculative.draft_tree import DEAD, MAXGRAM, DraftTree, HeldTokens
from engine.speculative.maxgram import BigramTable, MaxGramDrafter
from engine.speculative.tree import TreeTopology

CPU = torch.device("cpu")


class Seq:
    """The two fields of a sequence Max-Gram reads."""

    def __init__(self, tokens: list[int], num_prompt: int) -> None:
        self.tokens, self.num_prompt = tokens, num_prompt


def host_proposal(mg: MaxGramDrafter, seq: Seq, path: list[int], cap: int, width: int) -> list[int]:
    props = mg.propose(seq, path, cap)
    toks = props[0].tokens if props else []
    return toks + [DEAD] * (width - len(toks))


def device_proposals(dmg: DeviceMaxGram, seqs: list[Seq], paths: list[list[int]], caps: list[int],
                     width: int) -> list[list[int]]:
    flat = torch.tensor([t for p in paths for t in p] + [0])
    at, positions = 0, []
    for p in paths:
        positions.append(list(range(at, at + len(p))))
        at += len(p)
    return dmg.propose(seqs, positions, flat, caps, width).tolist()


def random_case(rng: random.Random, vocab: int) -> tuple[Seq, list[int], int]:
    n = rng.randrange(1, 40)
    motif = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]  # repeats make long matches
    tokens = [rng.choice(motif) if rng.random() < 0.6 else rng.randrange(vocab) for _ in range(n)]
    path = [rng.choice(motif) if rng.random() < 0.6 else rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
    return Seq(tokens, rng.randrange(1, n + 1)), path, rng.randrange(0, 10)


@pytest.mark.parametrize("seed", range(24))
def test_the_device_proposes_what_the_host_proposes(seed: int) -> None:
    """Random histories over a few tokens (so matches of every length occur), prompt splits, paths
    of 0-5 tokens, caps 0-9, and every Max-Gram setting that changes a proposal: longest and
    shortest n-gram, proposal length, with and without a bigram table."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])
    bigram = BigramTable({a: rng.randrange(vocab) for a in range(vocab) if rng.random() < 0.7}) \
        if seed % 3 else None
    max_ngram = rng.choice([1, 2, 3, 4])
    mg = MaxGramDrafter(max_len=rng.choice([2, 4, 8]), max_ngram=max_ngram, min_ngram=rng.randint(1, max_ngram),
                        bigram=bigram, bigram_len=rng.choice([1, 2, 3]))
    dmg = DeviceMaxGram(mg, CPU)
    for _ in range(3):  # the same table serves every call: rows are reused, histories synced
        cases = [random_case(rng, vocab) for _ in range(rng.randrange(1, 9))]
        seqs, paths, caps = [c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases]
        width = max(max(caps), 1)
        want = [host_proposal(mg, s, p, c, width) for s, p, c in cases]
        assert device_proposals(dmg, seqs, paths, caps, width) == want
        for s in seqs:  # they grow, and are proposed for again
            s.tokens.extend(rng.randrange(vocab) for _ in range(rng.randrange(0, 30)))
        assert device_proposals(dmg, seqs, paths, caps, width) == \
            [host_proposal(mg, s, p, c, width) for s, p, c in cases]


def test_a_dead_path_proposes_nothing_and_nothing_is_read() -> None:
    mg = MaxGramDrafter(max_len=4, bigram=BigramTable({1: 2, 2: 1}))
    dmg = DeviceMaxGram(mg, CPU)
    seqs = [Seq([1, 2, 1, 2, 1], 2), Seq([1, 2, 1, 2, 1], 2)]
    reads = []
    sync_listeners.append(reads.append)
    try:
        flat = torch.tensor([2, DEAD, 0])
        got = dmg.propose(seqs, [[0], [1]], flat, [4, 4], 4)
    finally:
        sync_listeners.remove(reads.append)
    assert reads == []
    assert got.tolist() == [host_proposal(mg, seqs[0], [2], 4, 4), [DEAD] * 4]
    assert got[0, 0] == 1


def test_rows_of_finished_sequences_are_reused() -> None:
    import gc

    dmg = DeviceMaxGram(MaxGramDrafter(max_len=4), CPU)
    first = [Seq([1, 2, 3] * 5, 3) for _ in range(8)]
    dmg.propose(first, [[]] * 8, torch.tensor([0]), [4] * 8, 4)
    rows = dmg.history.table.shape[0]
    del first
    gc.collect()
    second = [Seq([4, 5] * 4, 2) for _ in range(8)]
    flat = torch.tensor([5, 3, 0])
    paths = [[0], [1]] * 4  # 3 is only in the rows' earlier owners' tokens
    got = dmg.propose(second, paths, flat, [4] * 8, 4)
    assert dmg.history.table.shape[0] == rows  # the freed rows were taken again
    assert got.tolist() == [[4, 5, DEAD, DEAD], [DEAD] * 4] * 4  # and hold the new sequences' tokens only
    assert got.tolist() == [host_proposal(dmg.maxgram, s, [[5], [3]][i % 2], 4, 4) for i, s in enumerate(second)]


class _Held(HeldTokens):
    def __init__(self, trees: list[DraftTree]) -> None:
        super().__init__(trees)
        self.flat = torch.tensor([t for tree in trees for t in tree.tokens] + [0])
        for tree in trees:
            tree.tokens = [DEAD] * tree.num_nodes


@pytest.mark.parametrize("seed", range(8))
def test_a_held_trees_tail_is_the_hosts_without_a_read(seed: int) -> None:
    """Max-Gram's tail of held trees (the draft's tokens on the device) is appended without a read;
    once read, each tree is the one the host's ``extend_tree`` makes from the same tokens (every
    node live), its tail's unused nodes DEAD; branches appended after it stay the host's."""
    rng = random.Random(seed)
    vocab = 4
    mg = MaxGramDrafter(max_len=4, max_ngram=3, bigram=BigramTable({a: (a + 1) % vocab for a in range(vocab)}))
    dmg = DeviceMaxGram(mg, CPU)
    widths = [(2, 1), (3, 2, 1), (1, 1, 1), (2,)]
    seqs, trees, hosts, tails = [], [], [], []
    for i in range(5):
        sub = TreeTopology(widths[i % 4]).subtree(widths[i % 4])
        tokens = [rng.randrange(vocab) for _ in range(sub.num_nodes)]
        seqs.append(Seq([rng.randrange(vocab) for _ in range(rng.randrange(2, 30))], 2))
        trees.append(DraftTree(sub, list(tokens)))
        hosts.append(DraftTree(sub, list(tokens)))
        tails.append(rng.randrange(1, 5))
    holder = _Held(trees)
    holder.hold()
    dmg.width = 5  # the settings' longest tail: wider than any asked for here
    reads = []
    sync_listeners.append(reads.append)
    try:
        dmg.tails(seqs, trees, tails)
        for tree in trees:
            tree.add_path(-1, [1, 2], MAXGRAM, merge=False)
    finally:
        sync_listeners.remove(reads.append)
    assert reads == [] and all(t.unread is holder for t in trees)
    for seq, tree, host, n in zip(seqs, trees, hosts, tails):
        mg.extend_tree(seq, host, tail=n)
        host.add_path(-1, [1, 2], MAXGRAM, merge=False)
        got = tree.tokens  # the read
        size = tree.num_sub
        tail = got[size: size + n]
        assert tail[: len(tail) - tail.count(DEAD)] == host.tokens[size: len(host.tokens) - 2]
        assert set(tail[len(tail) - tail.count(DEAD):]) <= {DEAD}
        assert got[size + n:] == [1, 2]
        leaf = tree.sub.level(tree.sub.max_depth).start
        assert tree.parents()[size: size + n] == [leaf] + list(range(size, size + n - 1))


def test_the_compiled_proposal_is_the_eager_one() -> None:
    """``compiled`` (CUDA with ``graph_compile``): ``torch.compile`` of the tensor operations, one
    graph with dynamic sizes, gives the eager proposals, as histories grow."""
    rng = random.Random(7)
    mg = MaxGramDrafter(max_len=8, max_ngram=3, bigram=BigramTable({a: (a * 2) % 5 for a in range(5)}))
    eager, compiled = DeviceMaxGram(mg, CPU), DeviceMaxGram(mg, CPU, compiled=True, width=9)
    compiled.warm_up()  # what the engine does at start-up on CUDA
    for n in (3, 5):
        cases = [random_case(rng, 5) for _ in range(n)]
        seqs, paths, caps = [c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases]
        want = device_proposals(eager, seqs, paths, caps, 9)
        assert device_proposals(compiled, seqs, paths, caps, 9) == want
        assert want == [host_proposal(mg, s, p, c, 9) for s, p, c in cases]


def test_after_the_warm_up_no_batch_compiles_again() -> None:
    """Compiled at start-up for one sequence and for two (``warm_up``), the proposal serves every batch
    size without compiling again, also a batch as large as the proposals' width (2, the GPU preset's
    tail) or the n-gram length: sizes are never assumed equal ("duck" sizes)."""
    from torch._dynamo.utils import counters

    rng = random.Random(5)
    mg = MaxGramDrafter(max_len=8, max_ngram=4, bigram=BigramTable({a: (a * 2) % 5 for a in range(5)}))
    compiled = DeviceMaxGram(mg, CPU, compiled=True, width=2)
    compiled.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    for n in (3, 4, 5, 8):
        cases = [random_case(rng, 5) for _ in range(n)]
        seqs, paths, caps = [c[0] for c in cases], [c[1] for c in cases], [min(c[2], 2) for c in cases]
        assert device_proposals(compiled, seqs, paths, caps, 2) == [host_proposal(mg, s, p, c, 2)
                                                                     for s, p, c in zip(seqs, paths, caps)]
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("settings,compiles", [
    (dict(graph_compile=True, maxgram_read_tree=False), True),
    (dict(graph_compile=False, maxgram_read_tree=False), False),
    (dict(graph_compile=True, maxgram_read_tree=True), False),
    (dict(graph_compile=True, maxgram_read_tree=False, maxgram_tail=0), False)])
def test_the_engine_compiles_the_tails_at_start_up_on_cuda(monkeypatch, settings, compiles):
    """``MaxGramTreeDrafter.build``: with the draft's KV pool on CUDA, ``graph_compile`` and held
    trees with tails, the tails' proposer is made (and compiled) while the engine starts, not in a
    request's first step; its width is the settings' tail."""
    from types import SimpleNamespace

    from engine.config import EngineConfig
    from engine.speculative.drafter import DrafterContext
    from engine.speculative.maxgram import MaxGramTreeDrafter
    from engine.speculative.tree import TreeTopology

    made = []
    monkeypatch.setattr(MaxGramTreeDrafter, "on_device", lambda self, device: made.append((device, self.tail)))
    config = EngineConfig.from_settings(**settings)
    proposer = SimpleNamespace(cache=SimpleNamespace(k=SimpleNamespace(device=torch.device("cuda"))))
    MaxGramTreeDrafter.build(DrafterContext(config, TreeTopology((2,)), MaxGramDrafter(), proposer))
    from engine.speculative.maxgram import MaxGramSettings

    assert made == ([(torch.device("cuda"), MaxGramSettings.of(config).tail)] if compiles else [])
