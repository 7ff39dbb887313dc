"""The engine on a GPU: forward cost by rows, and engine steps with their host synchronizations.

Nothing is downloaded: the target and draft are random models with the shapes of Qwen2.5-Coder-1.5B
and -0.5B (``--target-shape``/``--draft-shape``), made on the device in ``--dtype``.  Random weights
make the draft's tokens almost never accepted, so this measures costs, not speedups:

* **forward**: one forward of R new rows after a ``--context``-token prompt (logits for every row,
  as verification asks), median of ``--reps``, milliseconds and the ratio to one row; for the first
  and last R, the kernels one forward launches and their summed device time (torch's profiler);
* **engine**: ``EngineCore`` steps of greedy requests at batch 1 and ``--batch``: plain decoding, the
  tree ``--tree`` with the draft, and the tree with the target as its own draft (every token accepted:
  the ceiling of tokens per step), after ``--warmup-s`` of back-to-back prefill forwards, median of
  ``--rounds`` interleaved rounds after ``--warmup-rounds`` untimed ones (the step time drifted
  2.8x within one run on an H200, and the first round ran 3-5x slower than the rest on an H100 after
  the warm-up forwards: docs/log/2026-11.md).  Per step: milliseconds, those until ``core.step()`` returns (the rest is device work
  still queued when it did), tokens, the reads the engine declares
  (``engine.device``) and the synchronizing CUDA calls torch's sync debug mode counts.

Prints tables and writes JSON::

    python benchmarks/bench_gpu.py [--device cuda] [--rows 1,2,4,8,16,32,64,128] [--batch 8]
"""

from __future__ import annotations

import argparse
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
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.llama import build_model  # noqa: E402
from engine.models.loader import LoadedModel, parse_device, parse_dtype  # noqa: E402
from engine.request import GenerationRequest, SamplingParams, SpecOptions  # noqa: E402

#: Qwen2.5 shapes (hidden, intermediate, layers, heads, kv heads); vocabulary 151936, tied embeddings
SHAPES = {
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2),
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2),
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


def forward_curve(lm: LoadedModel, rows: list[int], context: int, reps: int, device: torch.device) -> list[dict]:
    model = lm.model
    cache = model.new_cache(1, context + max(rows) + 8)
    slot = cache.allocate()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.config.vocab_size, (1, context + max(rows)), generator=gen).to(device)
    pos = torch.arange(context + max(rows), device=device)[None]
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
    return [dict(model=lm.source, rows=r, ms=statistics.median(times[r]), ratio=statistics.median(times[r]) / one,
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


def engine_run(target, draft, batch: int, prompt_len: int, new_tokens: int, tree, method: str,
               spec_on: bool, count_syncs: bool) -> dict:
    device = target.model.device
    config = EngineConfig.from_settings(max_batch=batch, max_model_len=prompt_len + new_tokens + 64, tree=tree,
                                        spec_method=method, adaptive=False, load_aware=False)
    core = EngineCore(target, draft, config)
    gen = torch.Generator().manual_seed(1)
    for i in range(batch):
        ids = torch.randint(1, target.config.vocab_size, (prompt_len,), generator=gen).tolist()
        core.add_request(GenerationRequest(f"r{i}", ids, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                                        ignore_eos=True),
                                           SpecOptions(enabled=spec_on)))
    steps, tokens, decode_s, host_s, cuda_syncs, declared_syncs, errors = 0, 0, 0.0, 0.0, 0, 0, []
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
        declared_syncs += sum(report.declared.values())
    steps = max(steps, 1)
    decode_s = max(decode_s, 1e-9)
    return dict(batch=batch, steps=steps, tokens=tokens, tok_s=tokens / decode_s, ms_step=decode_s / steps * 1e3,
                host_ms_step=host_s / steps * 1e3,
                tok_step=tokens / steps / batch, declared=declared_syncs / steps,
                cuda_syncs=(cuda_syncs / steps) if count_syncs and device.type == "cuda" else None,
                errors=len(errors), step_ms=step_ms)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--target-shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--draft-shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--tree", default="4,2,2,1")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the engine configurations")
    ap.add_argument("--warmup-s", type=float, default=10.0,
                    help="seconds of back-to-back forwards before the engine runs (GPU clocks up)")
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="untimed rounds of every engine configuration before the timed ones")
    ap.add_argument("--host-profile", metavar="FILE", help="also write a cProfile of the engine's steps to FILE")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    target = random_model(args.target_shape, args.vocab, dtype, device, seed=0)
    draft = random_model(args.draft_shape, args.vocab, dtype, device, seed=1)
    rows = [int(r) for r in args.rows.split(",")]
    tree = tuple(int(x) for x in args.tree.split(","))
    info = dict(machine(), device=str(device), dtype=args.dtype,
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    print(info)

    curve = forward_curve(target, rows, args.context, args.reps, device)
    curve += forward_curve(draft, rows, args.context, args.reps, device)
    print(f"\nforward, {args.context}-token context, logits for every row (median of {args.reps})")
    print_table(curve, [("model", "model", "s"), ("rows", "rows", "d"), ("ms", "ms", ".2f"), ("ratio", "x 1 row", ".2f"),
                        ("kernels", "kernels", "d"), ("kernel_ms", "kernel ms", ".2f")])

    if args.warmup_s > 0:
        warm_up(target, args.warmup_s, device)
    configs = [(batch, name, d, spec_on, t) for batch in sorted({1, args.batch})
               for name, d, spec_on, t in (("plain", draft, False, ()), ("mcsd, draft", draft, True, tree),
                                           ("mcsd, target as draft", target, True, tree))]
    samples: dict[int, list[dict]] = {i: [] for i in range(len(configs))}
    warm: dict[int, list[dict]] = {i: [] for i in range(len(configs))}
    for rnd in range(args.warmup_rounds + args.rounds):  # interleaved, each round in another order
        order = list(range(len(configs)))
        order = order[rnd % len(order):] + order[:rnd % len(order)]
        order = order if rnd % 2 == 0 else order[::-1]
        for i in order:
            batch, name, d, spec_on, t = configs[i]
            run = engine_run(target, d, batch, args.prompt_len, args.new_tokens, t, "mcsd", spec_on, False)
            (warm if rnd < args.warmup_rounds else samples)[i].append(run)
        kind = "warm-up round" if rnd < args.warmup_rounds else "round"
        print(f"{kind} {rnd + 1}/{args.warmup_rounds + args.rounds} done", flush=True)
    runs = []
    for i, (batch, name, d, spec_on, t) in enumerate(configs):
        s = engine_run(target, d, batch, args.prompt_len, 8, t, "mcsd", spec_on, True)
        med = {k: statistics.median(x[k] for x in samples[i]) for k in ("tok_s", "ms_step", "host_ms_step", "tok_step")}
        runs.append(dict(samples[i][0], **med, config=name, tree=",".join(map(str, t)) or "-",
                         declared=s["declared"], cuda_syncs=s["cuda_syncs"],
                         tok_s_rounds=[x["tok_s"] for x in samples[i]], errors=sum(x["errors"] for x in samples[i]),
                         tok_s_warmup=[x["tok_s"] for x in warm[i]],
                         step_ms_rounds=[x["step_ms"] for x in warm[i] + samples[i]]))
    print(f"\nengine steps, greedy, {args.prompt_len}-token prompts, {args.new_tokens} new tokens (decode only), "
          f"median of {args.rounds} interleaved rounds")
    print_table(runs, [("config", "config", "s"), ("batch", "batch", "d"), ("tree", "tree", "s"),
                       ("tok_s", "tok/s", ".1f"), ("ms_step", "ms/step", ".2f"), ("host_ms_step", "ms until return", ".2f"),
                       ("tok_step", "tok/step/seq", ".2f"),
                       ("declared", "declared syncs/step", ".2f"), ("cuda_syncs", "CUDA syncs/step", ".2f"),
                       ("errors", "errors", "d")])
    for r in runs:
        print(f"{r['config']}, batch {r['batch']}: tok/s by round {[round(x, 1) for x in r['tok_s_rounds']]}"
              f" (untimed warm-up: {[round(x, 1) for x in r['tok_s_warmup']]})")
        for k, ms in enumerate(r["step_ms_rounds"]):  # where in a run the time goes: its first steps, or all
            print(f"    run {k + 1}: ms a step, first 4 {[round(x, 1) for x in ms[:4]]}, "
                  f"median {statistics.median(ms):.1f}, last 4 {[round(x, 1) for x in ms[-4:]]}")
    if args.host_profile:
        host_profile(target, draft, args.prompt_len, tree, args.host_profile)
    write_json("gpu.json", dict(machine=info, args=vars(args), forward=curve, engine=runs), args.out)


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
        prof = cProfile.Profile()
        prof.enable()
        engine_run(target, draft, 1, prompt_len, 24, t, "mcsd", spec_on, False)
        prof.disable()
        out.write(f"==== {name}\n")
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
    Path(path).write_text(out.getvalue())
    print(f"host profile written to {path}")


if __name__ == "__main__":
    main()
