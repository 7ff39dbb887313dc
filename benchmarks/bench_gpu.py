"""The engine on a GPU, measured against a captured floor of the same shapes, in one run.

Nothing is downloaded: the target and draft are random models with the shapes of Qwen2.5-Coder-1.5B
and -0.5B (``--target-shape``/``--draft-shape``; ``--big-shape`` a 7B target), made on the device in
``--dtype``.  Random weights make the draft's tokens almost never accepted, so this measures costs,
not speedups:

* **the floor**: :class:`FloorDecoder`, the least a decode step of the shape needs (fused qkv and
  gate_up, SDPA over a static KV cache), captured in one CUDA graph, at every batch measured.  Every
  engine figure is also given as a ratio to it (``x floor step``, ``tok/s / floor's``);
* **forward**: one forward without graphs of R new rows after a ``--context``-token prompt, the
  kernels it launches and their summed device time (torch's profiler); with ``--compile`` (the
  default) also through the fixed-shape path with every layer compiled (``graph_compile``: Inductor
  fuses a layer's elementwise work), the kernels a captured graph of it replays;
* **engine**: ``EngineCore`` steps of greedy requests, each configuration on its own core (its CUDA
  graphs captured once, at its start), in ``--rounds`` interleaved rounds after ``--warmup-rounds``
  untimed ones: plain decoding at ``--batches`` with graphs and without, and with graphs but reading
  each step before the next forward (``decode_ahead`` off: what queuing it ahead saves), and at
  ``--spec-batches``
  the draft-model trees ``--trees``, Max-Gram, mcsd+maxgram, the cascade, the target as its own draft
  (every token accepted: the ceiling of tokens per step), the GPU preset's adaptive speculation (which
  should fall back to about plain decoding's step where, as with random weights, drafting cannot
  pay), the first tree read after every level as the level-by-level SpecDec++ stop reads it (but
  never stopping: the price of those reads) and the first tree without graphs; with ``--compile``,
  plain decoding, the first tree, mcsd+maxgram and the GPU preset again with every layer compiled
  before capture (column "compiled"), in interleaved rounds of their own after the others (compiling
  takes a while: a run cut short still has the others).  Per step: milliseconds, against the floor
  and against
  plain decoding's step, the host reads the engine declares, its device-wide waits, and the
  synchronizing CUDA calls torch's sync debug mode counts; the graphs captured, the seconds and
  graph-pool memory capturing took;
* **projection** (labelled so, not a measurement): tokens per step of each tree measured on the CPU
  with the real pair by ``bench_spec.py`` (``--acceptance``: code and chat prompts, greedy and
  T=0.7) times plain decoding's step over the tree's step here.

Prints tables and writes JSON::

    python benchmarks/bench_gpu.py [--device cuda] [--batches 1,8,32] [--trees "4,2,2;2,1,1"]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import machine, print_table, write_json  # noqa: E402
import engine.device as engine_device  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.graphs import BucketGrid, CapturedForwards  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.llama import build_model  # noqa: E402
from engine.models.loader import LoadedModel, parse_device, parse_dtype  # noqa: E402
from engine.request import GenerationRequest, SamplingParams, SpecOptions  # noqa: E402

#: Qwen2.5 shapes (hidden, intermediate, layers, heads, kv heads); vocabulary 151936, tied embeddings
SHAPES = {
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2),
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4),
    "tiny": (64, 96, 2, 4, 2),
}


def random_model(shape: str, vocab: int, dtype: torch.dtype, device: torch.device, seed: int) -> LoadedModel:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny import tiny_tokenizer

    hidden, inter, layers, heads, kv = SHAPES[shape]
    hf_cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                         rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen2ForCausalLM(hf_cfg).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for k, s in shapes.items():
        if k.endswith("norm.weight"):
            sd[k] = torch.ones(s, dtype=dtype, device=device)
        else:
            sd[k] = (torch.randn(s, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)
    cfg = ModelConfig.from_hf(hf_cfg)
    model = build_model(cfg, sd, dtype, device)
    return LoadedModel(model, cfg, tiny_tokenizer(vocab), f"random-{shape}", path=None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class FloorDecoder(torch.nn.Module):
    """The least a decode step of a shape needs: per layer one fused qkv, one gate_up, SDPA over a
    static KV cache, the down and output projections, RMSNorm and SiLU in plain torch, tied
    embeddings.  No paging, no trees, no sampling: captured in one CUDA graph it is the floor the
    engine's step is measured against (the same random-weight shapes as the engine's models)."""

    def __init__(self, shape: str, vocab: int, batch: int, context: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        hidden, inter, layers, heads, kv = SHAPES[shape]
        self.heads, self.kv, self.hd = heads, kv, hidden // heads
        gen = torch.Generator(device=device).manual_seed(0)

        def w(*size):
            return (torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

        self.embed = w(vocab, hidden)
        self.layers = [dict(qkv=w((heads + 2 * kv) * self.hd, hidden), o=w(hidden, heads * self.hd),
                            gate_up=w(2 * inter, hidden), down=w(hidden, inter),
                            n1=torch.ones(hidden, dtype=dtype, device=device),
                            n2=torch.ones(hidden, dtype=dtype, device=device)) for _ in range(layers)]
        self.norm = torch.ones(hidden, dtype=dtype, device=device)
        self.k = torch.zeros(layers, batch, kv, context, self.hd, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)

    @staticmethod
    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

    def forward(self) -> torch.Tensor:
        b = self.ids.shape[0]
        x = self.embed[self.ids]  # [b, 1, hidden]
        keys = torch.arange(self.k.shape[3], device=x.device)
        mask = (keys <= self.pos)[None, None, None, :]
        for i, L in enumerate(self.layers):
            h = self.rms(x, L["n1"])
            q, k, v = (h @ L["qkv"].T).split([self.heads * self.hd, self.kv * self.hd, self.kv * self.hd], -1)
            self.k[i].index_copy_(2, self.pos, k.view(b, 1, self.kv, self.hd).transpose(1, 2))
            self.v[i].index_copy_(2, self.pos, v.view(b, 1, self.kv, self.hd).transpose(1, 2))
            a = torch.nn.functional.scaled_dot_product_attention(
                q.view(b, 1, self.heads, self.hd).transpose(1, 2), self.k[i], self.v[i], attn_mask=mask,
                enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(b, 1, -1) @ L["o"].T
            g, u = (self.rms(x, L["n2"]) @ L["gate_up"].T).chunk(2, -1)
            x = x + (torch.nn.functional.silu(g) * u) @ L["down"].T
        return self.rms(x, self.norm) @ self.embed.T


def floor_ms(shape: str, vocab: int, batch: int, context: int, dtype: torch.dtype, device: torch.device,
             reps: int) -> float:
    """Milliseconds of one step of :class:`FloorDecoder` at ``batch`` rows after ``context - 16`` cached
    positions: a CUDA graph replay on CUDA (median of ``reps`` timed replays), the eager forward
    elsewhere."""
    with torch.inference_mode():
        model = FloorDecoder(shape, vocab, batch, context, dtype, device)
        model.pos.fill_(context - 16)
        run = model.forward
        if device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    model()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model()
            run = graph.replay
        for _ in range(3):
            run()
        times = []
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(10):
                run()
            sync(device)
            times.append((time.perf_counter() - t0) / 10 * 1e3)
        del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times)


def forward_curve(lm: LoadedModel, rows: list[int], context: int, reps: int, device: torch.device,
                  compiled: bool = False) -> list[dict]:
    """One forward of each of ``rows`` new rows after ``context`` cached tokens, without graphs:
    milliseconds, and on CUDA the kernels launched.  ``compiled``: through the fixed-shape path with
    each layer compiled (``graph_compile``, run eagerly here: the kernels a captured graph replays)."""
    model = lm.model
    cache = model.new_cache(1, context + max(rows) + 8)
    if compiled:
        kv = cache.max_blocks * cache.block_size
        cache.captured = CapturedForwards(model, cache, BucketGrid((1,), tuple(rows), (kv,), width=max(rows)),
                                          compile=True)
    slot = cache.allocate()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.config.vocab_size, (1, context + max(rows)), generator=gen).to(device)
    pos = torch.arange(context + max(rows))[None]  # positions are the host's (the fixed-shape path packs them there)
    with torch.inference_mode():
        model(ids[:, :context], pos[:, :context], cache, [slot], logits_rows=torch.tensor([[context - 1]], device=device))
        cache.commit(slot)

        def once(r: int) -> float:
            sync(device)
            t0 = time.perf_counter()
            model(ids[:, context:context + r], pos[:, context:context + r], cache, [slot])
            sync(device)
            dt = time.perf_counter() - t0
            cache.discard(slot)  # the rows stay uncommitted: the next cell starts at the same context
            return dt * 1e3

        for r in rows:  # warm-up (kernel selection, allocator)
            once(r)
            once(r)
        times = {r: [] for r in rows}
        for _ in range(reps):
            for r in rows:
                times[r].append(once(r))
        kernels = {r: kernel_time(once, r) if device.type == "cuda" else (None, None) for r in (rows[0], rows[-1])}
    one = statistics.median(times[rows[0]])
    if compiled:
        assert cache.captured.layer_step is not None, "compiling the layers failed (logged above)"
    return [dict(model=lm.source, layers="compiled" if compiled else "eager", rows=r, ms=statistics.median(times[r]), ratio=statistics.median(times[r]) / one,
                 kernels=kernels.get(r, (None, None))[0], kernel_ms=kernels.get(r, (None, None))[1]) for r in rows]


def kernel_time(once, r: int) -> tuple[int | None, float | None]:
    """(kernels launched, their summed device time in ms) of one forward, from torch's profiler: what
    the GPU is busy with, against the wall time the host takes to launch it."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            once(r)
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        busy = sum(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) for e in kernels)
        return len(kernels), busy / 1e3
    except Exception as exc:  # noqa: BLE001 - the profile is extra information
        print(f"profiler failed: {exc!r}")
        return None, None


#: the GPU preset's speculation (configs/gpu.toml): mcsd+maxgram, adaptive depth planned per step from
#: the calibrated acceptance and the cost curve measured at start, no level-by-level stop
ADAPTIVE = "adaptive mcsd+maxgram"
#: the fixed tree drafted as the CPU default's level-by-level SpecDec++ stop drafts it, a host read after
#: every level, but never stopping (threshold 1): against the same tree read once, the price of those reads
LEVEL_READS = "mcsd, a read per level"
#: plain decoding that reads each step's tokens before it launches the next forward (decode_ahead off):
#: against "plain" (ahead, the default on CUDA), what queuing the next forward before the read saves
READ_FIRST = "plain, read before the next forward"


def engine_core(target, draft, batch: int, prompt_len: int, new_tokens: int, tree, method: str,
                graphs: bool, compiled: bool = False, warm_up: str = "off") -> EngineCore:
    """A core for one configuration, made once and reused by every round (capturing its graphs is a
    start-up cost, not a step's): greedy, the graphs captured at this batch only, fixed trees (no
    adaptive depth, no load-aware budget) unless ``method`` is :data:`ADAPTIVE`, which measures its cost
    curve at start and may choose plain decoding or Max-Gram where the draft cannot pay (with random
    weights it cannot).  ``compiled``: each layer compiled before capture (``graph_compile``);
    ``warm_up``: the core's start-up warm-up setting (:meth:`EngineCore.warm_up`, run by the caller)."""
    adaptive, level_reads, read_first = method == ADAPTIVE, method == LEVEL_READS, method == READ_FIRST
    # Max-Gram as the GPU preset runs it: the draft's tokens stay on the device (one read a step), its tail
    # proposed there, 2 tokens at most
    extra = dict(adaptive_threshold=1.0) if level_reads else {}
    config = EngineConfig.from_settings(max_batch=batch, max_model_len=prompt_len + new_tokens + 64, tree=tree,
                                        spec_method="mcsd+maxgram" if adaptive else "mcsd" if level_reads or read_first
                                        else method, decode_ahead="off" if read_first else "auto",
                                        adaptive=adaptive or level_reads, load_aware=adaptive,
                                        adaptive_level_stop=level_reads, cuda_graphs=graphs, graph_batches=(batch,),
                                        graph_compile=compiled, maxgram_read_tree=False, maxgram_tail=2,
                                        warm_up=warm_up, **extra)
    return EngineCore(target, draft, config)


_runs = itertools.count()  # request ids stay unique across the runs of one core
_warmed = False  # the process's first engine core has had its start-up warm-up (--engine-warm-up)


def engine_run(core: EngineCore, batch: int, prompt_len: int, new_tokens: int, spec_on: bool,
               count_syncs: bool) -> dict:
    """``batch`` greedy requests of random ``prompt_len``-token prompts through ``core``, decoded together."""
    device = core.target.model.device
    gen = torch.Generator().manual_seed(1)
    run = next(_runs)
    for i in range(batch):
        ids = torch.randint(1, core.vocab_size, (prompt_len,), generator=gen).tolist()
        core.add_request(GenerationRequest(f"run{run}-{i}", ids, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                                               ignore_eos=True),
                                           SpecOptions(enabled=spec_on)))
    steps, tokens, decode_s, host_s, cuda_syncs, declared_syncs, waits, errors = 0, 0, 0.0, 0.0, 0, 0, 0, []
    step_ms = []
    prefilled = False
    while core.has_unfinished():
        sync(device)
        with engine_device.sync_report(cuda=count_syncs) as report:
            t0 = time.perf_counter()
            outs = core.step()
            host = time.perf_counter() - t0  # until the step returns (its own reads of results included)
        sync(device)
        dt = time.perf_counter() - t0
        new = sum(len(o.new_token_ids) for o in outs)
        errors += [o.error for o in outs if o.error]
        if not prefilled:  # the first step reads the prompts: left out of the decode figures
            prefilled = True
            continue
        steps += 1
        tokens += new
        decode_s += dt
        step_ms.append(dt * 1e3)
        host_s += host
        cuda_syncs += len(report.reported)
        declared_syncs += report.declared["to_host"]  # reads of results
        waits += report.declared["synchronize"]  # device-wide waits before the engine reads a clock
    steps = max(steps, 1)
    decode_s = max(decode_s, 1e-9)
    return dict(batch=batch, steps=steps, tokens=tokens, tok_s=tokens / decode_s, ms_step=decode_s / steps * 1e3,
                host_ms_step=host_s / steps * 1e3,
                tok_step=tokens / steps / batch, declared=declared_syncs / steps, waits=waits / steps,
                cuda_syncs=(cuda_syncs / steps) if count_syncs and device.type == "cuda" else None,
                errors=len(errors), step_ms=step_ms)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--target-shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--draft-shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--big-shape", default="qwen2.5-7b", help="a second target shape ('' to skip)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", default="1,8,32,128", help="rows of the forward-cost curve ('' to skip it)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batches", default="1,8,32", help="plain decoding's batch sizes")
    ap.add_argument("--spec-batches", default="1,8", help="the speculative configurations' batch sizes")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--trees", default="4,2,2;4,2,2,1;2,1,1;1,1,1", help="draft-model trees, ';'-separated (the first "
                    "also runs Max-Gram, the cascade and the target as its own draft)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the engine configurations")
    ap.add_argument("--warmup-s", type=float, default=5.0,
                    help="seconds of back-to-back forwards before the engine runs (GPU clocks up)")
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="untimed rounds of every engine configuration before the timed ones")
    ap.add_argument("--engine-warm-up", choices=("auto", "on", "off"), default="auto",
                    help="the first engine core made warms up as a server's does at its start "
                         "(EngineCore.warm_up; auto: on CUDA), so that the column 'warm-up x slower' shows "
                         "what is left of a process's first-round slowness after it ('off': the raw cost)")
    ap.add_argument("--acceptance", default="benchmarks/acceptance/code.json,benchmarks/acceptance/chat.json",
                    help="bench_spec.py results (tokens per step by tree, measured on the CPU with the real pair) "
                         "for the projection, comma separated ('' to skip)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure plain decoding, a tree and the GPU preset with every layer compiled before "
                         "capture (graph_compile), and the compiled forward's kernels")
    ap.add_argument("--host-profile", metavar="FILE", help="also write a cProfile of the engine's steps to FILE")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    info = dict(machine(), device=str(device), dtype=args.dtype,
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    print(info)
    batches = [int(b) for b in args.batches.split(",")]
    spec_batches = [int(b) for b in args.spec_batches.split(",")]
    trees = [tuple(int(x) for x in t.split(",")) for t in args.trees.split(";") if t]
    floor_batches = sorted(set(batches) | set(spec_batches))

    floors = [dict(shape=args.target_shape, batch=b, ms=floor_ms(args.target_shape, args.vocab, b, args.context, dtype,
                                                                 device, args.reps)) for b in floor_batches]
    floors.append(dict(shape=args.draft_shape, batch=1,
                       ms=floor_ms(args.draft_shape, args.vocab, 1, args.context, dtype, device, args.reps)))
    print(f"\nthe floor: a minimal decoder of the same shapes, one captured graph a step, {args.context}-token cache")
    print_table(floors, [("shape", "shape", "s"), ("batch", "batch", "d"), ("ms", "ms/step", ".2f")])
    floor_of = {(f["shape"], f["batch"]): f["ms"] for f in floors}
    result = dict(machine=info, args=vars(args), floor=floors, forward=[], engine=[], big=[], projection=[])

    def save() -> None:  # after every part: a run cut short (a device call's time limit) keeps what it measured
        write_json("gpu.json", result, args.out)

    save()

    target = random_model(args.target_shape, args.vocab, dtype, device, seed=0)
    draft = random_model(args.draft_shape, args.vocab, dtype, device, seed=1)
    curve = []
    if args.rows:
        rows = [int(r) for r in args.rows.split(",")]
        curve = forward_curve(target, rows, args.context, args.reps, device)
        if args.compile:
            curve += forward_curve(target, rows, args.context, args.reps, device, compiled=True)
        print(f"\nforward without graphs, {args.context}-token context, logits for every row (median of {args.reps})")
        print_table(curve, [("model", "model", "s"), ("layers", "layers", "s"), ("rows", "rows", "d"), ("ms", "ms", ".2f"),
                            ("ratio", "x 1 row", ".2f"), ("kernels", "kernels", "d"), ("kernel_ms", "kernel ms", ".2f")])
        result["forward"] = curve
        save()
    if args.warmup_s > 0:
        warm_up(target, args.warmup_s, device)

    # (name, batch, draft, speculating, tree, method, graphs, layers compiled)
    configs = [("plain", b, draft, False, (), "mcsd", g, False) for b in batches for g in (True, False)]
    configs += [(READ_FIRST, b, draft, False, (), READ_FIRST, True, False) for b in batches]
    configs += [("plain", b, draft, False, (), "mcsd", True, True) for b in batches if args.compile]
    for b in spec_batches:
        for t in trees:
            configs.append((f"mcsd {','.join(map(str, t))}", b, draft, True, t, "mcsd", True, False))
        t0 = trees[0]
        configs += [("maxgram", b, draft, True, t0, "maxgram", True, False),
                    ("cascade", b, draft, True, t0, "cascade", True, False),
                    (f"mcsd+maxgram {','.join(map(str, t0))}", b, draft, True, t0, "mcsd+maxgram", True, False),
                    ("adaptive (GPU preset)", b, draft, True, t0, ADAPTIVE, True, False),
                    (f"mcsd {','.join(map(str, t0))}, a read per level", b, draft, True, t0, LEVEL_READS, True, False),
                    ("mcsd, target as draft", b, target, True, t0, "mcsd", True, False),
                    (f"mcsd {','.join(map(str, t0))}", b, draft, True, t0, "mcsd", False, False)]
        if args.compile:  # the same steps with every layer compiled before capture (graph_compile)
            configs += [(f"mcsd {','.join(map(str, t0))}", b, draft, True, t0, "mcsd", True, True),
                        (f"mcsd+maxgram {','.join(map(str, t0))}", b, draft, True, t0, "mcsd+maxgram", True, True),
                        ("adaptive (GPU preset)", b, draft, True, t0, ADAPTIVE, True, True)]
    def saved_engine(rows: list[dict]) -> None:
        result["engine"], result["projection"] = rows, project(rows, [], args)
        save()

    runs = run_parts(configs, target, args, lambda batch: floor_of[(args.target_shape, batch)],
                     f"engine steps, greedy, {args.prompt_len}-token prompts, {args.new_tokens} new tokens (decode "
                     f"only), median of {args.rounds} interleaved rounds; {args.target_shape} target, "
                     f"{args.draft_shape} draft", saved_engine)

    if args.big_shape:
        del target
        if device.type == "cuda":
            torch.cuda.empty_cache()
        floors += [dict(shape=args.big_shape, batch=b, ms=floor_ms(args.big_shape, args.vocab, b, args.context,
                                                                   dtype, device, args.reps)) for b in (1, 8)]
        big_target = random_model(args.big_shape, args.vocab, dtype, device, seed=2)
        t0 = trees[0]
        big_configs = [("plain", 1, draft, False, (), "mcsd", True, False), ("plain", 8, draft, False, (), "mcsd", True, False)]
        big_configs += [(f"mcsd {','.join(map(str, t))}", 1, draft, True, t, "mcsd", True, False) for t in trees]
        big_configs += [("maxgram", 1, draft, True, t0, "maxgram", True, False),
                        ("adaptive (GPU preset)", 1, draft, True, t0, ADAPTIVE, True, False),
                        (f"mcsd+maxgram {','.join(map(str, t0))}", 1, draft, True, t0, "mcsd+maxgram", True, False)]
        if args.compile:
            big_configs += [("plain", 1, draft, False, (), "mcsd", True, True),
                            (f"mcsd {','.join(map(str, t0))}", 1, draft, True, t0, "mcsd", True, True),
                            ("adaptive (GPU preset)", 1, draft, True, t0, ADAPTIVE, True, True)]

        def saved_big(rows: list[dict]) -> None:
            result["big"], result["projection"] = rows, project(runs, rows, args)
            save()

        run_parts(big_configs, big_target, args,
                  lambda batch: [f["ms"] for f in floors if f["shape"] == args.big_shape and f["batch"] == batch][0],
                  f"the same with the {args.big_shape} target shape", saved_big)
        del big_target

    if args.host_profile:
        host_profile(random_model(args.target_shape, args.vocab, dtype, device, seed=0), draft, args.prompt_len,
                     trees[0], args.host_profile)


def run_parts(configs: list[tuple], target: LoadedModel, args, floor_ms_at, title: str, done) -> list[dict]:
    """:func:`run_configs` of the configurations without compiled layers, then of the compiled ones in
    interleaved rounds of their own (a first start compiles their layers, a minute or more: a device
    call cut at its time limit then still has the others), each part with its ratios
    (:func:`with_ratios`), printed under ``title``; ``done(rows so far)`` after each part."""
    out: list[dict] = []
    for part in ([c for c in configs if not c[7]], [c for c in configs if c[7]]):
        if not part:
            continue
        def partial(rows: list[dict]) -> None:  # after each timed round: a run cut short keeps these
            with_ratios(rows, floor_ms_at)
            done(out + rows)

        rows = run_configs(part, target, args, partial)
        with_ratios(rows, floor_ms_at)
        print(f"\n{title}" + ("; every layer compiled (graph_compile), in rounds of their own" if part[0][7] else ""))
        print_engine_table(rows)
        out += rows
        done(out)
    return out


def with_ratios(runs: list[dict], floor_ms_at) -> None:
    """Each run's step against the floor's step at its batch (``floor_ms_at(batch)``), its tokens/s
    against the floor's, and its step against plain decoding's captured step at the same batch in
    the same runs."""
    plain_ms = {r["batch"]: r["ms_step"] for r in runs if r["config"] == "plain" and r["graphs"]}
    for r in runs:
        floor = floor_ms_at(r["batch"])
        r["x_floor"] = r["ms_step"] / floor  # a step's time against the floor's step at this batch
        r["floor_tok_s_ratio"] = r["tok_s"] / (r["batch"] * 1e3 / floor)  # tokens/s against the floor's
        r["x_plain_step"] = r["ms_step"] / plain_ms[r["batch"]] if r["batch"] in plain_ms else None


def run_configs(configs: list[tuple], target: LoadedModel, args, partial=None) -> list[dict]:
    """Every configuration in interleaved rounds (each round in another order), each on its own core
    made once; then one short run per configuration under torch's sync debug mode for the counts.
    ``partial(rows)``: after each timed round, the rows so far (medians of the rounds run; no sync
    counts yet)."""
    global _warmed
    first, _warmed = not _warmed, True  # the process's first core warms up, as a server's start does
    cores = {}
    t0 = time.perf_counter()
    for i, (name, batch, d, spec_on, t, method, graphs, compiled) in enumerate(configs):
        warm_up = getattr(args, "engine_warm_up", "off") if first and i == 0 else "off"
        cores[i] = engine_core(target, d, batch, args.prompt_len, args.new_tokens, t, method, graphs, compiled,
                               warm_up)
    print(f"{len(cores)} engine cores made in {time.perf_counter() - t0:.1f} s (their graphs captured)", flush=True)
    if first and cores:
        t0 = time.perf_counter()
        steps = cores[0].warm_up()
        if steps:
            print(f"the first core warmed up as a server does: {steps} steps in {time.perf_counter() - t0:.1f} s",
                  flush=True)
    samples: dict[int, list[dict]] = {i: [] for i in range(len(configs))}
    warm: dict[int, list[dict]] = {i: [] for i in range(len(configs))}
    for rnd in range(args.warmup_rounds + args.rounds):
        order = list(range(len(configs)))
        order = order[rnd % len(order):] + order[:rnd % len(order)]
        order = order if rnd % 2 == 0 else order[::-1]
        for i in order:
            name, batch, d, spec_on, t, method, graphs, compiled = configs[i]
            run = engine_run(cores[i], batch, args.prompt_len, args.new_tokens, spec_on, False)
            (warm if rnd < args.warmup_rounds else samples)[i].append(run)
        kind = "warm-up round" if rnd < args.warmup_rounds else "round"
        print(f"{kind} {rnd + 1}/{args.warmup_rounds + args.rounds} done", flush=True)
        if partial is not None and rnd >= args.warmup_rounds:
            partial(_rows(configs, cores, samples, warm, [dict(declared=None, waits=None, cuda_syncs=None)] * len(configs)))
    syncs = [engine_run(cores[i], c[1], args.prompt_len, 8, c[3], True) for i, c in enumerate(configs)]
    runs = _rows(configs, cores, samples, warm, syncs)
    del cores
    return runs


def _rows(configs: list[tuple], cores: dict, samples: dict, warm: dict, syncs: list[dict]) -> list[dict]:
    """One result row a configuration: the medians of its timed rounds, its sync counts (``syncs[i]``)
    and what capturing its graphs took."""
    runs = []
    for i, (name, batch, d, spec_on, t, method, graphs, compiled) in enumerate(configs):
        s = syncs[i]
        med = {k: statistics.median(x[k] for x in samples[i]) for k in ("tok_s", "ms_step", "host_ms_step", "tok_step")}
        captured = cores[i].capture_reports
        runs.append(dict(samples[i][0], **med, config=name, method=method, graphs=graphs, compiled=compiled,
                         tree=",".join(map(str, t)) or "-", declared=s["declared"], waits=s["waits"],
                         cuda_syncs=s["cuda_syncs"], tok_s_rounds=[x["tok_s"] for x in samples[i]],
                         errors=sum(x["errors"] for x in samples[i]), tok_s_warmup=[x["tok_s"] for x in warm[i]],
                         # how much slower the first warm-up round ran than the timed ones (the first minute)
                         warmup_x=med["tok_s"] / warm[i][0]["tok_s"] if warm[i] and warm[i][0]["tok_s"] else None,
                         graphs_captured=sum(r.buckets for r in captured.values()),
                         layers_compiled=all(r.compiled for r in captured.values()) if captured else False,
                         capture_s=sum(r.seconds for r in captured.values()),
                         graph_pool_mib=sum(r.pool_bytes for r in captured.values()) / 2**20))
    return runs


def print_engine_table(runs: list[dict]) -> None:
    print_table(runs, [("config", "config", "s"), ("graphs", "graphs", ""), ("batch", "batch", "d"),
                       ("tok_s", "tok/s", ".1f"), ("ms_step", "ms/step", ".2f"), ("x_floor", "x floor step", ".2f"),
                       ("floor_tok_s_ratio", "tok/s / floor's", ".2f"), ("x_plain_step", "x plain step", ".2f"),
                       ("host_ms_step", "ms until return", ".2f"), ("tok_step", "tok/step/seq", ".2f"),
                       ("declared", "reads/step", ".2f"), ("waits", "waits/step", ".2f"),
                       ("cuda_syncs", "CUDA syncs/step", ".2f"), ("layers_compiled", "compiled", ""),
                       ("graphs_captured", "graphs", "d"),
                       ("capture_s", "capture s", ".1f"), ("graph_pool_mib", "pool MiB", ".0f"),
                       ("warmup_x", "warm-up x slower", ".2f"), ("errors", "errors", "d")])


def project(runs: list[dict], big: list[dict], args) -> list[dict]:
    """PROJECTION, not a measurement: tokens per step of each tree measured on the CPU with the real
    Qwen2.5-Coder pair (``bench_spec.py``), divided by this GPU's step time of that tree at batch 1,
    against plain decoding's step here.  For the big target the 1.5B pair's acceptance stands in."""
    out = []
    files = [f for f in args.acceptance.split(",") if f]
    for path in files:
        if not Path(path).exists():
            print(f"projection: {path} not found (run bench_spec.py, see docs/gpu.md); skipped")
            continue
        data = json.loads(Path(path).read_text())
        source = {"HumanEval": "code", "sharegpt": "chat"}.get(data["args"].get("source"), Path(path).stem)
        for (shape, table), compiled in itertools.product(((args.target_shape, runs), (args.big_shape, big)),
                                                          (False, True)):
            plain = [r for r in table if r["config"] == "plain" and r["batch"] == 1 and r["graphs"]
                     and r["compiled"] == compiled]
            if not plain:
                continue
            for row in data["rows"]:
                name = row["config"]
                kind, widths, *extra = name.split(" ") + [""] * (name.count(" ") < 1)
                # Max-Gram's rows here run as the GPU preset's (maxgram_read_tree = false): its "u" rows
                method = {"tree": "mcsd", "chain": "mcsd"}.get(kind) if not extra else None
                if kind == "tree+maxgram" and extra == ["u"]:
                    method = "mcsd+maxgram"
                if name == "cascade u":  # the cascade as here: its review rounds on the device (one read)
                    method = "cascade"
                step = [r for r in table if r["batch"] == 1 and r["graphs"] and (r["tree"] == widths or method == "cascade")
                        and r["method"] == method and r["config"] != "mcsd, target as draft"
                        and r["compiled"] == compiled]
                if not step or not row.get("block_eff"):
                    continue
                speedup = row["block_eff"] * plain[0]["ms_step"] / step[0]["ms_step"]
                out.append(dict(shape=shape, compiled=compiled, prompts=source, temperature=row["temperature"],
                                config=name,
                                tok_step=row["block_eff"], ms_step=step[0]["ms_step"], plain_ms=plain[0]["ms_step"],
                                projected=speedup))
    if out:
        print("\nPROJECTION (not measured): CPU tokens/step of the real pair x this device's step times, batch 1")
        print_table(out, [("shape", "target", "s"), ("compiled", "compiled", ""), ("prompts", "prompts", "s"),
                          ("temperature", "T", ".1f"),
                          ("config", "config", "s"), ("tok_step", "tok/step (CPU)", ".2f"),
                          ("ms_step", "step ms (here)", ".2f"), ("plain_ms", "plain ms (here)", ".2f"),
                          ("projected", "projected x plain", ".2f")])
    return out


def warm_up(lm: LoadedModel, seconds: float, device: torch.device) -> None:
    """Back-to-back forwards for ``seconds``: a GPU that idled between launches runs at its idle clock."""
    cache = lm.model.new_cache(1, 520)
    slot = cache.allocate()
    ids = torch.zeros(1, 512, dtype=torch.long, device=device)
    pos = torch.arange(512, device=device)[None]
    end = time.perf_counter() + seconds
    with torch.inference_mode():
        while time.perf_counter() < end:
            lm.model(ids, pos, cache, [slot], logits_rows=torch.tensor([[511]], device=device))
            cache.discard(slot)
            sync(device)


def host_profile(target, draft, prompt_len: int, tree, path: str) -> None:
    """cProfile of 24 decoding steps at batch 1, plain and with the tree: where the host's time goes
    (cumulative, the 40 largest), written to ``path``."""
    import cProfile
    import io
    import pstats

    out = io.StringIO()
    for name, spec_on, t in (("plain", False, ()), ("mcsd", True, tree)):
        core = engine_core(target, draft, 1, prompt_len, 24, t, "mcsd", True)  # its graphs captured before
        prof = cProfile.Profile()
        prof.enable()
        engine_run(core, 1, prompt_len, 24, spec_on, False)
        prof.disable()
        out.write(f"==== {name}\n")
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
    Path(path).write_text(out.getvalue())
    print(f"host profile written to {path}")


if __name__ == "__main__":
    main()
