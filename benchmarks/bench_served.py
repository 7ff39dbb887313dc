"""Does the HTTP layer keep up with the engine?  Served against engine-alone throughput, in one run.

At GPU speeds a step takes a few milliseconds, and detokenising and SSE-encoding many streams in the
server's Python competes with the engine thread for the interpreter.  For each ``--concurrency`` C this
runs the same C greedy requests (``--max-tokens`` each, EOS ignored, random token-id prompts of
``--prompt-len``) two ways, ABBA-interleaved over ``--rounds``:

* **engine**: an ``EngineCore`` stepped in a loop by this process, nothing else: the tokens/s the
  engine alone produces;
* **served**: another core of the same models behind the real server (``server.app`` on uvicorn, in a
  thread of this process, as ``python -m server`` runs it), C concurrent streamed completions through
  the official ``openai`` client in a process of its own, tokens counted from each stream's final
  ``usage``.

It reports both rates and ``served / engine`` (the issue's goal: at least 0.8 at 8 and 32 streams).
The models: ``--model tiny`` (default), random tiny Llama models made here, whose steps take about as
long on a CPU as a 1.5B model's captured steps on a GPU, so the HTTP layer meets GPU-like rates; or
any model the loader takes (a pack name, a path, a GGUF file), or ``--shape``: random weights of a
real model's shapes (``bench_gpu.py``'s, e.g. ``qwen2.5-1.5b`` on a GPU), on ``--device``.  ``--draft`` adds a
draft model and speculation (default: plain decoding).

    python benchmarks/bench_served.py --concurrency 8,32 --max-tokens 128 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import machine, print_table, write_json  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.request import GenerationRequest, SamplingParams, SpecOptions  # noqa: E402


def load_models(args) -> tuple:
    if args.shape:  # random weights of a real model's shapes (benchmarks/bench_gpu.py), a word-level tokenizer
        from benchmarks.bench_gpu import random_model
        from engine.models.loader import parse_device, parse_dtype

        device, dtype = parse_device(args.device), parse_dtype(args.dtype)
        target = random_model(args.shape, args.vocab, dtype, device, seed=0)
        draft = random_model(args.draft, args.vocab, dtype, device, seed=1) if args.draft else None
        return target, draft
    if args.model == "fake":  # built per core in make_core
        return None, None
    if args.model == "tiny":
        from tests.tiny import tiny_loaded

        target = tiny_loaded("llama", seed=0, layers=args.tiny_layers, device=args.device)
        draft = tiny_loaded("llama", seed=1, layers=1, device=args.device) if args.draft == "tiny" else None
        return target, draft
    from engine.models.loader import load_model

    target = load_model(args.model, args.dtype, args.device)
    draft = load_model(args.draft, args.dtype, args.device, tokenizer_of=target) if args.draft else None
    return target, draft


def make_core(target, draft, args, concurrency: int) -> EngineCore:
    if args.model == "fake":
        from tests.fakes import FakeCore

        return FakeCore(max_batch=concurrency, max_model_len=args.prompt_len + args.max_tokens + 16, depth=0,
                        step_delay=args.fake_step_ms / 1000)
    config = EngineConfig.from_settings(max_batch=concurrency, max_model_len=args.prompt_len + args.max_tokens + 16,
                                        tree=tuple(int(x) for x in args.tree.split(",")) if draft else (),
                                        load_aware=False)
    return EngineCore(target, draft, config, model_name="bench")


def process_core(args, concurrency: int, cpus: Optional[set[int]]) -> EngineCore:
    """The served core of ``--engine-process``, built in the engine process (the same seeds, so the same
    models), pinned to ``cpus`` with one torch thread per CPU as the engine-alone runs are."""
    if cpus:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
    target, draft = load_models(args)
    return make_core(target, draft, args, concurrency)


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def engine_alone(core: EngineCore, ids: list[list[int]], max_tokens: int, spec: bool, tag: str) -> dict:
    """The requests decoded together by stepping ``core`` here: tokens/s from the first request added
    to the last token (prefill included, as the served run's wall time includes it)."""
    t0 = time.perf_counter()
    for i, p in enumerate(ids):
        core.add_request(GenerationRequest(f"{tag}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                             ignore_eos=True), SpecOptions(enabled=spec)))
    tokens = 0
    while core.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in core.step())
    wall = time.perf_counter() - t0
    return dict(tokens=tokens, seconds=wall, tok_s=tokens / wall)


async def served(url: str, ids: list[list[int]], max_tokens: int, spec: bool) -> dict:
    """The requests as concurrent streamed completions through the ``openai`` client: tokens from each
    stream's final usage, over the wall time from the first request sent to the last stream's end
    (after one warm-up request of the client's)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)

    async def one(prompt: list[int]) -> int:
        stream = await client.completions.create(
            model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "speculative": {"enabled": spec}})
        used = 0
        async for chunk in stream:
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return used

    # the client's own first-use costs (its connection pool, building its response types) are not the
    # server's: one short request before the clock starts, as load generators warm up
    warm = await client.completions.create(model="bench", prompt=ids[0], max_tokens=1, stream=True)
    async for _ in warm:
        pass
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in ids))
    wall = time.perf_counter() - t0
    await client.close()
    return dict(tokens=sum(counts), seconds=wall, tok_s=sum(counts) / wall)


#: the CPUs the client process runs on (``--cpus``; empty: wherever the system puts it)
CLIENT_CPUS: set[int] = set()


def served_from_another_process(url: str, vocab: int, count: int, prompt_len: int, seed: int, max_tokens: int,
                                spec: bool) -> dict:
    """:func:`served` run by a client process of its own, as real clients are: the ``openai`` client's
    parsing of every chunk does not compete with the server for this interpreter."""
    cmd = [sys.executable, __file__, "--client", url, "--vocab", str(vocab), "--client-count", str(count),
           "--prompt-len", str(prompt_len), "--client-seed", str(seed), "--max-tokens", str(max_tokens)]
    cpus = CLIENT_CPUS
    out = subprocess.run(cmd + (["--client-spec"] if spec else []), capture_output=True, text=True, timeout=1800,
                         preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    if out.returncode:
        raise RuntimeError(f"the client process failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' (random, made here) or anything the loader takes")
    ap.add_argument("--draft", default=None, help="a draft model ('tiny' with --model tiny, a shape with --shape): "
                    "speculation on")
    ap.add_argument("--shape", help="random models of bench_gpu.py's shapes instead (e.g. qwen2.5-1.5b)")
    ap.add_argument("--vocab", type=int, default=151936, help="with --shape")
    ap.add_argument("--tree", default="2,1,1")
    ap.add_argument("--tiny-layers", type=int, default=2)
    ap.add_argument("--fake-step-ms", type=float, default=3.0, help="--model fake: the test suite's fake engine, "
                    "whose step sleeps this long (no CPU, as a GPU's step leaves the host's core idle) and then "
                    "detokenises every sequence's token")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA pairs of (engine, served) per concurrency")
    ap.add_argument("--cpus", help="SERVER:CLIENT[:API] CPU lists, e.g. 0:1 (Linux): the engine, alone or served, "
                    "runs on the first with one torch thread, the client process on the second, so they do "
                    "not take each other's cores; with --serve process the server's HTTP side runs on the "
                    "third (default: the client's)")
    ap.add_argument("--serve", default="thread", help="how the server runs its engine, a list: 'thread' (in the "
                    "server's process, the default) and 'process' (a process of its own, the server's "
                    "--engine-process); each is measured against the same engine-alone runs")
    ap.add_argument("--out")
    ap.add_argument("--client", help=argparse.SUPPRESS)  # the client process: a server's URL
    ap.add_argument("--client-count", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--client-seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--client-spec", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        ids = prompts(args.vocab, args.client_count, args.prompt_len, args.client_seed)
        print(json.dumps(asyncio.run(served(args.client, ids, args.max_tokens, args.client_spec))))
        return
    server_cpus: set[int] = set()
    api_cpus: set[int] = set()
    if args.cpus:
        parts = [{int(c) for c in part.split(",")} for part in args.cpus.split(":")]
        server_cpus, client_cpus = parts[0], parts[1]
        api_cpus = parts[2] if len(parts) > 2 else client_cpus
        os.sched_setaffinity(0, server_cpus)
        torch.set_num_threads(len(server_cpus))
        CLIENT_CPUS.update(client_cpus)
    from engine.async_engine import AsyncEngine
    from engine.engine_process import ProcessEngine
    from server.app import create_app
    from server.settings import Settings
    from tests.fakes import ServerThread

    # as ``python -m server`` does: the engine thread gets the interpreter back soon after the event loop took it
    sys.setswitchinterval(Settings.model_fields["gil_switch_interval"].default)
    target, draft = load_models(args)
    spec = draft is not None
    vocab = target.config.vocab_size if target is not None else len(make_core(None, None, args, 1).tokenizer)
    modes = args.serve.split(",")
    info = dict(machine(), device=args.device, model=args.model, draft=args.draft, serve=modes, cpus=args.cpus)
    print(info)
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        alone_core = make_core(target, draft, args, c)
        engine_alone(alone_core, prompts(vocab, c, args.prompt_len, 99), 8, spec, "warm")
        settings = Settings(served_model_name="bench", device=args.device, max_queue=4 * c)
        samples: dict[str, list[dict]] = {kind: [] for kind in ["engine"] + modes}
        with contextlib.ExitStack() as stack:
            urls = {}
            for mode in modes:
                if mode == "process":
                    engine = ProcessEngine(functools.partial(process_core, args, c, server_cpus), max_queue=4 * c)
                    if api_cpus:  # the server's threads (and the engine process they start) inherit this
                        os.sched_setaffinity(0, api_cpus)
                else:
                    engine = AsyncEngine(make_core(target, draft, args, c), max_queue=4 * c)
                urls[mode] = stack.enter_context(ServerThread(create_app(settings, engine))).url
                if server_cpus:
                    os.sched_setaffinity(0, server_cpus)
                if not engine.wait_ready(600):
                    raise RuntimeError(f"the {mode} engine failed to load: {engine.load_error}")
                served_from_another_process(urls[mode], vocab, c, args.prompt_len, 98, 8, spec)
            kinds = list(samples)
            for rnd in range(args.rounds):
                for kind in kinds if rnd % 2 == 0 else kinds[::-1]:
                    if kind == "engine":
                        ids = prompts(vocab, c, args.prompt_len, rnd)
                        samples[kind].append(engine_alone(alone_core, ids, args.max_tokens, spec, f"r{rnd}"))
                    else:
                        samples[kind].append(served_from_another_process(urls[kind], vocab, c, args.prompt_len, rnd,
                                                                         args.max_tokens, spec))
                print(f"concurrency {c}: round {rnd + 1}/{args.rounds} done", flush=True)
        eng = statistics.median(s["tok_s"] for s in samples["engine"])
        for mode in modes:
            srv_rate = statistics.median(s["tok_s"] for s in samples[mode])
            rows.append(dict(concurrency=c, serve=mode, engine_tok_s=eng, served_tok_s=srv_rate, ratio=srv_rate / eng,
                             engine_rounds=[s["tok_s"] for s in samples["engine"]],
                             served_rounds=[s["tok_s"] for s in samples[mode]],
                             tokens=samples[mode][0]["tokens"]))
        write_json("served.json", dict(machine=info, args=vars(args), rows=rows), args.out, quiet=True)  # so far
    print(f"\nserved / engine throughput, {args.max_tokens} tokens a request, median of {args.rounds} rounds")
    print_table(rows, [("concurrency", "streams", "d"), ("serve", "engine runs in", "s"),
                       ("engine_tok_s", "engine alone tok/s", ".1f"), ("served_tok_s", "served tok/s", ".1f"),
                       ("ratio", "served / engine", ".2f"), ("tokens", "tokens a round", "d")])
    write_json("served.json", dict(machine=info, args=vars(args), rows=rows), args.out)


if __name__ == "__main__":
    main()
