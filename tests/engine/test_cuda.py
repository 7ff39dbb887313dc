"""The engine on a real GPU (CUDA), with the tiny models of the CPU suite placed on the device.

* every method's greedy output equals plain decoding's, in fp32 with TF32 off, one request at a time
  and in a continuously joined batch (on a GPU torch's kernels are not batch-invariant, so a last-bit
  difference could flip a near-tie: the tiny random models have none at these prompts);
* a batch mixing every sampling feature completes under every method, in bf16 and fp32;
* a step synchronizes with the host only where the engine says it does: torch's sync debug mode
  reports the synchronizing CUDA calls, and each must be the one inside ``engine.device.to_host``,
  no more of them than the engine's reads (one per draft level plus one for verification,
  ``test_device.py``).  Before the copies to the device were made non-blocking, a plain decoding
  step at batch 8 had 17 of them against 3 declared;
* the forwards captured as CUDA graphs give the eager engine's tokens, greedy and seeded, and so do
  they with every layer compiled first (``graph_compile``);
* Max-Gram's tail on the device (eager and compiled) proposes what the host's Max-Gram proposes, and
  the GPU preset's mcsd+maxgram gives plain decoding's tokens;
* the server, on the device, answers concurrent streams with the official ``openai`` client;
* the start-up warm-up runs there by default and leaves no trace.

On a machine without CUDA these tests are skipped with that reason (``-ra`` lists them); the CPU
suite checks the same code paths with the device-check mode (``tests/engine/test_device.py``).
"""

from __future__ import annotations


import pytest
import torch

import engine.device as engine_device
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import GenerationRequest, SamplingParams, SpecOptions
from engine.registry import method, method_names
from tests.engine.test_device import FEATURES
from tests.engine_utils import run_engine
from tests.tiny import tiny_loaded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LOSSLESS = [m for m in method_names() if not method(m).lossy_note]
PROMPTS = [[3, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28], [5, 5, 5, 5]]


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def cuda_pair(dtype: torch.dtype):
    return (tiny_loaded("llama", seed=0, dtype=dtype, device="cuda"),
            tiny_loaded("llama", seed=1, layers=1, dtype=dtype, device="cuda"))


@pytest.fixture(scope="module")
def pair32():
    return cuda_pair(torch.float32)


@pytest.fixture(scope="module")
def pair16():
    return cuda_pair(torch.bfloat16)


def test_a_read_brings_mixed_tensors_back_in_one_pinned_copy():
    """``to_host`` packs the device's tensors into one buffer, copies it once into pinned memory and
    unpacks views: every dtype, shape and layout comes back equal, host tensors pass through."""
    dev = torch.device("cuda")
    tensors = [torch.tensor(3, device=dev), torch.tensor([True, False, True], device=dev),
               torch.randn(3, 4, device=dev).t(), torch.arange(5, dtype=torch.int32, device=dev),
               torch.zeros(0, dtype=torch.long, device=dev), torch.randn(3, device=dev).bfloat16(),
               torch.tensor([7, 8])]
    with engine_device.sync_report() as report:
        host = engine_device.to_host(*tensors)
    assert report.declared["to_host"] == 1
    for t, h in zip(tensors, host):
        assert h.device.type == "cpu" and h.dtype == t.dtype and torch.equal(h, t.cpu())
    assert all(h.is_pinned() for h in host[:-1] if h.numel())


def test_host_tensors_reach_the_device_in_one_copy():
    """``to_device_many``: host tensors of several dtypes and layouts (a transposed one, an expanded
    view, a 0-dim one, an empty one) arrive equal, as views of one device buffer (one copy); a tensor
    already on the device is returned as it is."""
    on_device = torch.ones(3, device="cuda")
    host = [torch.arange(6, dtype=torch.long).view(2, 3).t(), torch.tensor([True, False, True]),
            torch.tensor(2.5, dtype=torch.float32), torch.zeros(0, dtype=torch.int32),
            torch.tensor([1.0, 2.0], dtype=torch.bfloat16).expand(3, 2)]
    out = engine_device.to_device_many([on_device] + host, torch.device("cuda"))
    assert out[0] is on_device
    for h, d in zip(host, out[1:]):
        assert d.device.type == "cuda" and d.dtype == h.dtype and torch.equal(d.cpu(), h)
    assert len({d.untyped_storage().data_ptr() for d in out[1:] if d.numel()}) == 1


def test_the_models_are_on_the_device(pair32):
    for lm in pair32:
        assert lm.model.device.type == "cuda"
        assert all(p.device.type == "cuda" for p in lm.model.parameters())


@pytest.mark.parametrize("method_name", LOSSLESS)
@pytest.mark.parametrize("join_every", [0, 1], ids=["together", "joining"])
@pytest.mark.parametrize("drafter", ["other", "self"])
def test_greedy_speculation_equals_plain_decoding(pair32, method_name, join_every, drafter):
    """``other``: a draft with other weights (mostly rejected); ``self``: the target drafting for
    itself (mostly accepted), so both the rejection and the acceptance paths run on the device."""
    target, draft = pair32
    draft = target if drafter == "self" else draft
    plain, _ = run_engine(target, draft, PROMPTS, spec=SpecOptions(enabled=False), max_tokens=20, ignore_eos=True)
    spec, core = run_engine(target, draft, PROMPTS, tree=(3, 2, 2), join_every=join_every, max_tokens=20,
                            ignore_eos=True, config=dict(spec_method=method_name))
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    assert all(len(c.tokens) == 20 for c in spec)
    if drafter == "self" and method_name != "maxgram":  # Max-Gram drafts only what the context repeats
        assert sum(c.spec.accepted_tokens for c in spec) > 20  # speculation really ran


@pytest.mark.parametrize("method_name", LOSSLESS)
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_graph_replay_equals_eager(pair32, method_name, sampling):
    """The forwards captured as CUDA graphs (``engine.graphs``) give the tokens of the eager engine,
    greedy and seeded, in fp32 with TF32 off; the graphs were captured at start and replayed, by the
    target and by the draft.  The load-aware budget is off: its plans follow timings."""
    target, draft = pair32
    params = dict(temperature=0.0) if sampling == "greedy" else dict(temperature=0.9, top_p=0.9, seed=5)
    runs = []
    for graphs in (False, True):
        out, core = run_engine(target, draft, PROMPTS, tree=(3, 2, 2), join_every=1, max_tokens=20, ignore_eos=True,
                               config=dict(spec_method=method_name, cuda_graphs=graphs, load_aware=False), **params)
        runs.append([c.tokens for c in out])
    assert runs[1] == runs[0]
    assert core.capture_reports["target"].buckets > 0 and not core.capture_reports["target"].failed
    assert core.cache.captured.replays > 0 and core.cache.captured.graphs
    if method_name != "maxgram":
        assert core.runner.proposer.cache.captured.replays > 0


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_decoding_ahead_gives_the_same_tokens(pair32, sampling):
    """``decode_ahead`` (on by default on CUDA): plain decoding with the next step's forward replayed
    before the host reads the step's tokens, requests joining: the tokens of the engine without it, and
    one declared read a step with no device-wide wait."""
    target, _ = pair32
    params = dict(temperature=0.0) if sampling == "greedy" else dict(temperature=0.9, top_p=0.9, seed=5)
    runs = []
    for ahead in ("off", "on"):
        out, core = run_engine(target, None, PROMPTS * 2, max_batch=8, join_every=1, max_tokens=20, ignore_eos=True,
                               config=dict(decode_ahead=ahead, cuda_graphs=True), **params)
        runs.append([c.tokens for c in out])
    assert core.decode_ahead and core.cache.captured.replays > 0
    assert runs[1] == runs[0]
    core = EngineCore(target, None, EngineConfig.from_settings(max_batch=8, max_model_len=128))
    assert core.decode_ahead  # "auto"
    for i, prompt in enumerate(PROMPTS * 2):
        core.add_request(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True, **params),
                                           SpecOptions()))
    while core.has_unfinished():
        with engine_device.sync_report() as report:
            core.step()
        assert report.declared["to_host"] <= 1 and not report.declared["synchronize"]
        assert all(w.filename.endswith("torch/cuda/streams.py") for w in report.reported)


def test_the_warm_up_runs_on_cuda_and_leaves_no_trace(pair32):
    """``warm_up`` (``auto``: on with CUDA) with graphs captured: it runs, the engine ends idle with both
    pools empty, and the requests after it get a cold engine's tokens (a fixed tree, so seeded ones too)."""
    from tests.engine.test_warm_up import core_of, generate

    config = dict(adaptive=False, load_aware=False, cuda_graphs=True)
    cold = generate(core_of(pair32, **config))
    warm = core_of(pair32, **config)
    assert warm.warm_up() > 3
    for pool in (warm.cache, warm.runner.proposer.cache):
        assert pool.used_blocks == 0 and pool.cached_blocks == 0
    assert generate(warm) == cold
    assert warm.cache.captured.replays > 0


@pytest.mark.parametrize("method_name", ["mcsd+maxgram", "cascade"])
def test_the_gpu_presets_maxgram_equals_plain_decoding(pair32, method_name):
    """mcsd+maxgram and the cascade as ``configs/gpu.toml`` runs them (``maxgram_read_tree = false``):
    the draft's tree held on the device, Max-Gram's branches unmerged and its tail proposed there, the
    cascade's review rounds there (positions shifted on the device), graphs captured: the tokens of
    plain decoding, greedy, the target drafting for itself.  (Layers and tail uncompiled, to keep the
    run short: the compiled layers and the compiled tail have tests of their own.)"""
    target, _ = pair32
    prompts = PROMPTS + [[7, 8, 9, 7, 8, 9, 7, 8]]  # a repeat for Max-Gram to continue
    plain, _ = run_engine(target, None, prompts, max_tokens=24, ignore_eos=True)
    spec, core = run_engine(target, target, prompts, tree=(3, 2), join_every=1, max_tokens=24, ignore_eos=True,
                            config=dict(spec_method=method_name, maxgram_read_tree=False, maxgram_tail=2,
                                        cuda_graphs=True, load_aware=False))
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    if method_name == "cascade":
        cascade = [d for d in core.runner.drafters if d.name == "cascade"][0].on_device
        assert cascade.maxgram.history.table.is_cuda
        assert core.runner.proposer.cache.captured.replays > 0
    else:
        tails = [d for d in core.runner.drafters if d.name == "maxgram"][0]._on_device
        assert tails and all(dmg.history.table.is_cuda for dmg in tails.values())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_maxgram_on_the_device_proposes_what_the_host_proposes(compiled):
    """``device_maxgram`` on CUDA, eager and through ``torch.compile`` (``graph_compile``), against
    the host's ``MaxGramDrafter.propose``: random histories, paths and caps, as histories grow."""
    import random

    from engine.speculative.device_maxgram import DeviceMaxGram
    from engine.speculative.maxgram import BigramTable, MaxGramDrafter
    from tests.engine.speculative.test_device_maxgram import host_proposal, random_case

    rng = random.Random(3)
    mg = MaxGramDrafter(max_len=8, max_ngram=4, bigram=BigramTable({a: (a + 2) % 6 for a in range(6)}))
    dmg = DeviceMaxGram(mg, torch.device("cuda"), compiled=compiled)
    for _ in range(4):
        cases = [random_case(rng, 6) for _ in range(rng.randrange(1, 9))]
        seqs, paths, caps = [c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases]
        width = max(max(caps), 1)
        flat = torch.tensor([t for p in paths for t in p] + [0], device="cuda")
        at, positions = 0, []
        for p in paths:
            positions.append(list(range(at, at + len(p))))
            at += len(p)
        got = dmg.propose(seqs, positions, flat, caps, width).tolist()
        assert got == [host_proposal(mg, s, p, c, width) for s, p, c in cases]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method_name", [*method_names(), "mcsd+maxgram-unread", "cascade-unread"])
def test_a_mixed_batch_has_no_hidden_host_syncs(pair32, pair16, method_name, dtype):
    """Each step: no synchronizing CUDA call but the reads the engine declares.  ``-unread``: with
    ``maxgram_read_tree = false`` (the GPU preset's), one read a step."""
    target, draft = pair32 if dtype == torch.float32 else pair16
    unread = method_name.endswith("-unread")
    core = EngineCore(target, draft, EngineConfig.from_settings(max_batch=8, max_model_len=128, tree=(2, 1, 1),
                                                                spec_method=method_name.removesuffix("-unread"),
                                                                maxgram_read_tree=not unread))
    for i, name in enumerate(FEATURES):
        params = dict(FEATURES[name])
        if method_name == "mjsd-lossy" and name == "penalties":
            params = dict(temperature=0.8)  # refused for this method
        core.add_request(GenerationRequest(f"r{i}", [3 + i, 6, 7, 8, 9, 10],
                                           SamplingParams(max_tokens=10, **params), SpecOptions()))
    hidden, waits, outs = [], [], []
    while core.has_unfinished():
        with engine_device.sync_report() as report:
            step = core.step()
        syncs, counts = report.reported, report.declared
        if counts["synchronize"]:
            waits.append(counts["synchronize"])
        # every reported one must be the stream synchronization inside ``to_host`` (torch attributes it to
        # torch/cuda/streams.py), at most one per declared read; a step makes no device-wide wait (its
        # timings are CUDA events read after its read: engine.device.DeviceTimer)
        elsewhere = [f"{w.filename}:{w.lineno}" for w in syncs if not w.filename.endswith("torch/cuda/streams.py")]
        if elsewhere or len(syncs) > counts["to_host"] or (unread and counts["to_host"] > 1):
            hidden.append((len(syncs), counts["to_host"], elsewhere))
        outs += step
    assert not [o.error for o in outs if o.error]
    finished = [o for o in outs if o.finished]
    assert len(finished) == len(FEATURES)
    assert not hidden, f"steps with synchronizing CUDA calls the engine does not declare: {hidden[:3]}"
    assert not waits, f"steps that waited for the whole device: {waits[:3]}"


def test_the_server_serves_concurrent_streams_on_the_device():
    openai = pytest.importorskip("openai")
    from engine.async_engine import AsyncEngine
    from server.app import create_app
    from server.settings import Settings
    from tests.fakes import ServerThread, greedy_one_by_one_and_streamed, make_tokenizer
    from tests.server.test_real_server import tiny_loaded as served

    tok = make_tokenizer()
    core = EngineCore(served("qwen2", 0, tok, "cuda"), served("qwen2", 1, tok, "cuda"),
                      EngineConfig(max_batch=4, max_model_len=128, tree=(2, 2)), model_name="tiny")
    prompts = [f"request {i}: the quick brown fox" for i in range(8)]
    with ServerThread(create_app(Settings(served_model_name="tiny", device="cuda"),
                                 AsyncEngine(core, max_queue=32))) as srv:
        one_by_one, together = greedy_one_by_one_and_streamed(srv.url, "tiny", prompts)
        assert together == one_by_one and any(one_by_one)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=0.8, seed=3, n=2, logprobs=True)
        assert len(chat.choices) == 2 and all(c.logprobs.content for c in chat.choices)


def test_graphs_survive_a_second_engine_on_the_same_model(pair32):
    """A second engine with a longer cache on the same model rebuilds its rotary tables; the first
    engine's graphs go on reading theirs (benchmarks build many engines over one model)."""
    target, _ = pair32
    first, _ = run_engine(target, None, PROMPTS, max_tokens=12, ignore_eos=True, config=dict(cuda_graphs=True))
    core = EngineCore(target, None, EngineConfig.from_settings(max_batch=4, max_model_len=64))
    EngineCore(target, None, EngineConfig.from_settings(max_batch=4, max_model_len=512))  # longer tables
    for i, prompt in enumerate(PROMPTS):
        core.add_request(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True,
                                                                            temperature=0.0), SpecOptions()))
    out: dict[str, list[int]] = {}
    while core.has_unfinished():
        for o in core.step():
            assert o.error is None, o.error
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == [c.tokens for c in first]
    assert core.cache.captured.replays > 0


# the tests that compile with Inductor come last: a first run compiles for a minute or more, and a run
# cut at its time limit (scripts/gpu_check.sh) still has the others
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_compiled_graph_replay_equals_eager(pair32, sampling):
    """``graph_compile``: every layer compiled (Inductor's fused kernels) before capture gives the
    eager engine's tokens, plain and speculating, in fp32 with TF32 off; compiling worked for both
    models (no fallback to the eager layers)."""
    target, draft = pair32
    params = dict(temperature=0.0) if sampling == "greedy" else dict(temperature=0.9, top_p=0.9, seed=5)
    for spec in (False, True):
        runs = []
        for graphs, compiled in ((False, False), (True, True)):
            out, core = run_engine(target, draft, PROMPTS, tree=(3, 2, 2), join_every=1, max_tokens=20,
                                   ignore_eos=True, spec=SpecOptions(enabled=spec),
                                   config=dict(spec_method="mcsd", cuda_graphs=graphs, graph_compile=compiled,
                                               load_aware=False), **params)
            runs.append([c.tokens for c in out])
        assert runs[1] == runs[0], f"speculating={spec}"
        assert all(r.compiled and not r.failed for r in core.capture_reports.values())
        assert core.cache.captured.replays > 0
