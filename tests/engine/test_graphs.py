"""The fixed-shape forward a CUDA graph replays (``engine.graphs``), run eagerly on the CPU:

* bucket arithmetic: context buckets, row buckets, the smallest bucket holding a forward, and none
  for a forward outside every bucket;
* the static forward equals the dynamic one bitwise (fp32 and bf16), for prefill chunks of different
  lengths, tree blocks under a mask, and draft levels over pending entries, and its padding writes
  nothing a sequence holds;
* the whole engine with every forward that fits a bucket on the static path gives the tokens of
  today's engine for every method, greedy and seeded, with the draft's forwards there too;
* the static forward compiles as one graph (``fullgraph=True``) and computes what it computes eagerly;
* under the device-check mode the static path mixes no host tensor into device math and adds no read.
"""

from __future__ import annotations

import pytest
import torch

from engine.batching import Block, run_blocks
from engine.config import EngineConfig
from engine.graphs import Bucket, BucketGrid, CapturedForwards, StaticInputs, default_kv_buckets, row_buckets
from engine.graphs import block_mask_rows, host_inputs, place_block_mask, static_hidden
from engine.registry import method_names
from engine.request import SpecOptions
from tests.engine.test_device import run_checked
from tests.engine_utils import run_engine
from tests.tiny import tiny_loaded

PROMPTS = [[3, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28], [5, 5, 5, 5]]
READS = [("mcsd", 1), ("mcsd+maxgram", 2), ("maxgram", 1), ("cascade", 5), ("mjsd-lossy", 1),
         ("target-init-lossy", 1)]
TREE_MASK = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


# ------------------------------------------------------------------ buckets
def test_context_buckets_double_up_to_the_cache_and_are_whole_blocks():
    assert default_kv_buckets(4100, 4) == (256, 512, 1024, 2048, 4096, 4100)
    assert default_kv_buckets(100, 16, smallest=32) == (32, 64, 112)
    assert all(k % 6 == 0 for k in default_kv_buckets(1000, 6))


def test_row_buckets_grow_by_four_and_end_at_the_largest_block():
    assert row_buckets(1) == (1,)
    assert row_buckets(29) == (1, 4, 16, 29)
    assert row_buckets(16) == (1, 4, 16)


def test_the_smallest_bucket_that_holds_a_forward_is_picked():
    grid = BucketGrid((1, 2, 4, 8), (1, 4, 16), (64, 128, 256), width=20)
    assert grid.pick(1, 1, 10, 1) == Bucket(1, 1, 64)
    assert grid.pick(3, 5, 70, 5) == Bucket(4, 16, 128)  # padded rows need 70 - 5 + 16 = 81 keys
    assert grid.pick(3, 5, 60, 5) == Bucket(4, 16, 128)  # 60 - 5 + 16 = 71 > 64
    assert grid.pick(2, 4, 60, 4) == Bucket(2, 4, 64)


@pytest.mark.parametrize("batch,rows,kv,width", [(9, 1, 10, 1), (1, 17, 20, 17), (1, 1, 300, 1), (1, 4, 10, 21),
                                                 (8, 16, 300, 16)])
def test_a_forward_outside_every_bucket_gets_none(batch, rows, kv, width):
    assert BucketGrid((1, 2, 4, 8), (1, 4, 16), (64, 128, 256), width=20, max_tokens=64).pick(
        batch, rows, kv, width) is None


def test_the_grid_lists_its_buckets_largest_first_within_the_token_cap():
    grid = BucketGrid((1, 8), (1, 16), (64,), width=16, max_tokens=64)
    assert grid.buckets() == [Bucket(8, 1, 64), Bucket(1, 16, 64), Bucket(1, 1, 64)]
    with pytest.raises(ValueError, match="increasing"):
        BucketGrid((2, 1), (1,), (64,), width=1)
    with pytest.raises(ValueError, match="narrower"):
        BucketGrid((1,), (1, 8), (64,), width=4)


def test_padding_inputs_point_at_the_scratch_block_and_see_only_themselves():
    model = tiny_loaded("llama", seed=0).model
    cache = model.new_cache(4, 64, block_size=4)
    slot = cache.allocate()
    cache.reserve([slot], [3])
    pos, tables, lens, start, counts, mask = host_inputs(cache, Bucket(2, 4, 16), 8, torch.tensor([[0, 1, 2]]),
                                                         [slot], [3])
    assert pos.tolist() == [[0, 1, 2, 2], [0, 0, 0, 0]]  # a padded row repeats its row's last position
    assert tables[1].tolist() == [0, 0, 0, 0] and tables[0, 0] == cache.tables[slot][0]
    assert counts.tolist() == [3, 0] and lens.tolist() == [0, 0] and start.tolist() == [0, 0]
    assert mask[0, :3, :3].equal(torch.ones(3, 3, dtype=torch.bool).tril())
    assert not mask[0, 3].any() and not mask[1].any()  # build_mask lets every row see its own position


def test_a_blocks_own_mask_replaces_the_causal_rows_of_its_real_rows_only():
    """``place_block_mask``: a tree's mask (or MJSD's, built on the device) over the first ``w``
    columns of the real rows; a row past the sequence's count and the other sequences' rows see
    nothing (``build_mask`` lets them see their own position)."""
    buffer = torch.ones(2, 4, 8, dtype=torch.bool)
    own = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    place_block_mask(buffer, *block_mask_rows(own, [2], 8))
    assert buffer[0, :2, :3].equal(own[0, :2]) and not buffer[0, :2, 3:].any()
    assert not buffer[0, 2].any()  # past the count: padding
    assert buffer[0, 3].all() and buffer[1].all()  # outside the block's rows: left as host_inputs made them


# ------------------------------------------------------------------ one forward
def _forwards(model, static: bool, dtype=torch.float32):
    """Logits of prefill chunks, a tree block, a kept path and draft-like levels over pending entries."""
    cache = model.new_cache(4, 64, block_size=4)
    if static:
        cache.captured = CapturedForwards(model, cache, BucketGrid((1, 2, 4), (1, 2, 4, 8), (16, 32, 64), width=16))
    slots = [cache.allocate() for _ in range(3)]
    outs = []
    blocks = [Block(s, list(range(3 + 2 * i, 8 + 3 * i)), list(range(5 + i)), [4 + i]) for i, s in enumerate(slots)]
    outs += run_blocks(model, cache, blocks)[1]
    for s in slots:
        cache.commit(s)
    blocks = [Block(s, [7, 8, 9, 10], [5 + i, 6 + i, 6 + i, 7 + i], [0, 1, 2, 3], TREE_MASK)
              for i, s in enumerate(slots)]
    outs += run_blocks(model, cache, blocks)[1]
    cache.keep(slots[0], [0, 1])
    cache.keep(slots[1], [0, 2])
    cache.discard(slots[2])
    level1 = [Block(s, [11, 12], [7 + i, 7 + i], [0, 1], torch.tensor([[1, 0], [0, 1]], dtype=torch.bool))
              for i, s in enumerate(slots[:2])]
    outs += run_blocks(model, cache, level1)[1]
    level2 = [Block(s, [13, 14], [8 + i, 8 + i], [0, 1], torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool))
              for i, s in enumerate(slots[:2])]
    outs += run_blocks(model, cache, level2)[1]
    for s in slots[:2]:
        cache.keep(s, [0, 2])
    outs += run_blocks(model, cache, [Block(s, [15], [9 + i], [0]) for i, s in enumerate(slots)])[1]
    rows = [cache._rows(s, torch.arange(int(cache.lens[s]) + int(cache.pending[s]))) for s in slots]
    kept = [torch.stack([cache.k[:, r], cache.v[:, r]]) for r in rows]
    return outs, kept, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_static_forward_equals_the_dynamic_one_bitwise(dtype):
    model = tiny_loaded("llama", seed=0).model.to(dtype)
    dynamic, kv_dynamic, _ = _forwards(model, static=False)
    static, kv_static, cache = _forwards(model, static=True)
    assert cache.captured.replays == 5 and cache.captured.fallbacks == 0
    assert all(torch.equal(a, b) for a, b in zip(dynamic, static))
    assert all(torch.equal(a, b) for a, b in zip(kv_dynamic, kv_static))  # what every sequence holds


def test_a_forward_outside_the_buckets_runs_dynamically():
    model = tiny_loaded("llama", seed=0).model
    cache = model.new_cache(2, 64, block_size=4)
    cache.captured = CapturedForwards(model, cache, BucketGrid((1,), (1, 4), (16,), width=4))
    slot = cache.allocate()
    run_blocks(model, cache, [Block(slot, list(range(1, 11)), list(range(10)), [9])])  # 10 rows: no bucket
    assert (cache.captured.replays, cache.captured.fallbacks) == (0, 1)
    cache.commit(slot)
    run_blocks(model, cache, [Block(slot, [3], [10], [0])])
    assert cache.captured.replays == 1


def test_the_static_forward_compiles_as_one_graph():
    torch._dynamo.reset()
    model = tiny_loaded("llama", seed=0).model
    outs = []
    for compiled in (False, True):
        cache = model.new_cache(2, 64, block_size=4)
        slot = cache.allocate()
        cache.reserve([slot], [4])
        bucket = Bucket(2, 4, 16)
        inp = StaticInputs.empty(bucket, 4, 8, model.device)
        host = host_inputs(cache, bucket, 8, torch.tensor([[0, 1, 1, 2]]), [slot], [4])
        for buf, src in zip(inp.tensors()[1:], host):
            buf.copy_(src)
        place_block_mask(inp.block_mask, *block_mask_rows(TREE_MASK[None], [4], 8))
        inp.ids[0] = torch.tensor([5, 6, 7, 8])
        fn = torch.compile(static_hidden, fullgraph=True, backend="eager") if compiled else static_hidden
        with torch.inference_mode():
            outs.append((fn(model, cache, inp), cache.k.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    explain = torch._dynamo.explain(static_hidden)(model, cache, inp)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons


# ------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def pair():
    return tiny_loaded("llama", seed=0), tiny_loaded("llama", seed=1, layers=1)


@pytest.mark.parametrize("method_name", method_names())
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_the_static_step_gives_todays_tokens_for_every_method(pair, method_name, sampling):
    target, draft = pair
    """The load-aware budget is off: it plans from cost curves timed at start, so a seeded request's
    draws (which follow its plans) would differ between any two runs, static or not."""
    params = dict(temperature=0.0) if sampling == "greedy" else dict(temperature=0.9, top_p=0.9, seed=11)
    runs = []
    for static in (False, True):
        out, core = run_engine(target, draft, PROMPTS, tree=(3, 2, 2), join_every=1, max_tokens=16, ignore_eos=True,
                               config=dict(spec_method=method_name, static_shapes=static, load_aware=False),
                               **params)
        runs.append([c.tokens for c in out])
        if static:
            assert core.cache.captured.replays > 0
            if method_name != "maxgram":
                assert core.runner.proposer.cache.captured.replays > 0  # the draft's forwards too
    assert runs[1] == runs[0]
    assert all(len(t) == 16 for t in runs[0])


@pytest.mark.parametrize("method_name", ["mcsd+maxgram", "cascade"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_the_static_step_gives_todays_tokens_with_the_tree_unread(pair, method_name, sampling):
    """``maxgram_read_tree=False`` (the GPU preset's one read a step): Max-Gram's tail and the cascade's
    rounds on the device, their draft forwards (the cascade's at positions shifted there) in buckets."""
    target, draft = pair
    params = dict(temperature=0.0) if sampling == "greedy" else dict(temperature=0.9, top_p=0.9, seed=11)
    runs = []
    for static in (False, True):
        out, core = run_engine(target, draft, PROMPTS, tree=(3, 2, 2), join_every=1, max_tokens=16, ignore_eos=True,
                               config=dict(spec_method=method_name, static_shapes=static, load_aware=False,
                                           maxgram_read_tree=False), **params)
        runs.append([c.tokens for c in out])
        if static:
            assert core.runner.proposer.cache.captured.replays > 0
    assert runs[1] == runs[0]
    assert all(len(t) == 16 for t in runs[0])


@pytest.mark.slow
@pytest.mark.parametrize("method_name", ["mcsd", "mcsd+maxgram", "cascade"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_the_static_step_with_compiled_layers_gives_todays_tokens(pair, method_name, sampling):
    """``graph_compile`` in the engine: the target's and the draft's layers compiled
    (``compiled_layer``; on the CPU our operators stay operators, so the logits are bitwise today's)
    give today's tokens, plain and speculating."""
    target, draft = pair
    params = dict(temperature=0.0) if sampling == "greedy" else dict(temperature=0.9, top_p=0.9, seed=11)
    for spec in (False, True):
        runs = []
        for static in (False, True):
            out, core = run_engine(target, draft, PROMPTS, tree=(3, 2, 2), join_every=1, max_tokens=16,
                                   ignore_eos=True, spec=SpecOptions(enabled=spec),
                                   config=dict(spec_method=method_name, static_shapes=static, graph_compile=static,
                                               load_aware=False), **params)
            runs.append([c.tokens for c in out])
        assert core.cache.captured.layer_step is not None and core.cache.captured.replays > 0
        if spec and method_name != "maxgram":
            assert core.runner.proposer.cache.captured.layer_step is not None
        assert runs[1] == runs[0], f"speculating={spec}"


def test_plain_decoding_runs_every_step_in_a_bucket(pair):
    target, draft = pair
    _, core = run_engine(target, draft, PROMPTS, spec=SpecOptions(enabled=False), max_tokens=12, ignore_eos=True,
                         config=dict(static_shapes=True))
    captured = core.cache.captured
    assert captured.replays >= 11 and captured.fallbacks == 0


def test_the_engine_installs_no_static_path_on_the_cpu_by_default(pair):
    _, core = run_engine(*pair, PROMPTS[:1], max_tokens=2)
    assert core.cache.captured is None and not core.capture_reports


@pytest.mark.parametrize("method_name,bound", READS)
def test_the_static_path_mixes_no_host_tensor_and_adds_no_read(tiny_pair, method_name, bound):
    """The bounds of ``test_device.py``: one read a step, two for mcsd+maxgram reading the tree, the
    cascade's one per round; the static path adds no read of its own (sampled requests draw unseeded,
    so the two runs' plans differ: each run is held to the bound)."""
    _, steps = run_checked(tiny_pair, method_name, ["greedy", "sampled", "logit-bias"], static_shapes=True)
    for count, kinds, stacks in steps:
        assert set(kinds) <= {"to_host"} and count <= bound, (kinds, "\n".join(stacks[:2]))


@pytest.mark.parametrize("method_name", ["mcsd+maxgram", "cascade"])
def test_the_static_path_reads_once_with_the_tree_unread(tiny_pair, method_name):
    _, steps = run_checked(tiny_pair, method_name, ["greedy", "sampled", "penalties"], static_shapes=True,
                           maxgram_read_tree=False)
    for count, kinds, stacks in steps:
        assert set(kinds) <= {"to_host"} and count <= 1, (kinds, "\n".join(stacks[:2]))


def test_graph_settings_parse_like_the_tree():
    cfg = EngineConfig.from_settings(graph_batches="1,4,8", graph_rows=[1, 8])
    assert cfg.graph_batches == (1, 4, 8) and cfg.graph_rows == (1, 8)


def test_the_read_bounds_cover_every_method():
    assert {m for m, _ in READS} == set(method_names())


def test_a_bucket_whose_capture_failed_runs_dynamically(monkeypatch):
    """A failed capture is logged, reported and left to the dynamic forward; the others still run."""
    model = tiny_loaded("llama", seed=0).model
    cache = model.new_cache(2, 64, block_size=4)
    captured = CapturedForwards(model, cache, BucketGrid((1,), (1, 4), (16,), width=4))
    real = CapturedForwards._prepare

    def prepare(self, bucket):
        if bucket.rows == 4:
            raise RuntimeError("planted capture failure")
        return real(self, bucket)

    monkeypatch.setattr(CapturedForwards, "_prepare", prepare)
    report = captured.capture()
    assert report.buckets == 1 and report.failed == ["1x4@16"]
    cache.captured = captured
    slot = cache.allocate()
    run_blocks(model, cache, [Block(slot, [1, 2, 3], [0, 1, 2], [2])])  # rows bucket 4: failed, dynamic
    assert (captured.replays, captured.fallbacks) == (0, 1)
    cache.commit(slot)
    run_blocks(model, cache, [Block(slot, [4], [3], [0])])  # rows bucket 1: captured
    assert captured.replays == 1


def _compiled_run(model, compiled: bool) -> tuple[list[torch.Tensor], CapturedForwards]:
    """Two sequences through every kind of bucket of a small grid: prefill chunks alone and beside a
    decode (rows 4), decodes alone and together (rows 1), at both context buckets; each forward's
    logits."""
    cache = model.new_cache(2, 64, block_size=4)
    captured = cache.captured = CapturedForwards(model, cache, BucketGrid((1, 2), (1, 4), (16, 32), width=8),
                                                 compile=compiled)
    a, b = cache.allocate(), cache.allocate()
    logits, n = [], {a: 0, b: 0}

    def step(*blocks: tuple[int, list[int]]) -> None:
        out = run_blocks(model, cache, [Block(s, toks, list(range(n[s], n[s] + len(toks))), [len(toks) - 1])
                                        for s, toks in blocks])[1]
        logits.extend(out)
        for s, toks in blocks:
            cache.commit(s)
            n[s] += len(toks)

    step((a, [1, 2, 3]))  # 1 x 4
    step((a, [4]))  # 1 x 1
    step((b, [5, 6]), (a, [7]))  # 2 x 4
    for i in range(14):  # 2 x 1, at 16 and then 32 positions
        step((a, [8 + i]), (b, [30 + i]))
    assert (captured.replays, captured.fallbacks) == (17, 0)
    return logits, captured


@pytest.mark.slow
@pytest.mark.parametrize("ours", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_the_compiled_layers_serve_every_bucket_with_the_eager_logits(ours):
    """``graph_compile``: each decoder layer through torch.compile (``compiled_layer``) gives the eager
    forward's logits, and a few graphs serve every bucket and every layer: at most 4 (batch 1 or
    more, one row or more), not one per bucket shape and layer.  ``cpu-kernels``: our
    CPU operators stay operators in the graph, so the logits are bitwise the eager ones.
    ``torch-ops``: the torch formulation a GPU runs (``MCSD_CPU_KERNELS=0``), whose elementwise work
    Inductor fuses, as it would on a GPU: equal to fp32 rounding."""
    import contextlib

    from torch._dynamo.utils import counters

    from engine.models.cpu_kernels import torch_formulation

    torch._dynamo.reset()
    with contextlib.nullcontext() if ours else torch_formulation():
        model = tiny_loaded("qwen2", seed=0).model  # qkv biases: the layer's every input kind
        eager, _ = _compiled_run(model, False)
        before = counters["stats"]["unique_graphs"]
        compiled, captured = _compiled_run(model, True)
        graphs = counters["stats"]["unique_graphs"] - before  # (before torch_formulation resets the counters)
    assert captured.layer_step is not None  # compiling worked: no fallback to the eager layers
    assert 2 <= graphs <= 4, graphs  # 4 bucket kinds x 2 context buckets x 2 layers: 16 without dynamic shapes
    for e, c in zip(eager, compiled, strict=True):
        if ours:
            assert torch.equal(e, c)
        else:
            torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)


def test_a_layer_that_fails_to_compile_is_captured_without_compiling(caplog):
    """If the compiled layer raises while a bucket is prepared, compiling is dropped for the model
    (logged once) and the bucket is prepared again with the eager layers."""
    model = tiny_loaded("llama", seed=0).model
    cache = model.new_cache(2, 64, block_size=4)
    captured = CapturedForwards(model, cache, BucketGrid((1,), (1, 4), (16,), width=4))
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("the compiler gave up")

    captured.layer_step = broken
    with caplog.at_level("WARNING", logger="engine.graphs"):
        captured._prepare_or_uncompiled(Bucket(1, 4, 16))
    assert captured.layer_step is None and len(calls) == 1 and "capturing without torch.compile" in caplog.text
    captured.layer_step = broken
    report = captured.capture()
    assert report.buckets == 2 and not report.failed and not report.compiled
