"""Replicas on Ray Serve against one replica on the same share of the machine (``deploy/ray_serve.py``).

    .venv/bin/python benchmarks/bench_replicas.py                      # 1 then 2 replicas, one core each

For each replica count (``--replicas``, default ``1,2``) it starts Ray Serve with that many engine
replicas of ``--config`` (default: the default pair), each holding ``--cpus-per-replica`` Ray CPUs
and ``--threads`` torch threads, and pinned to one core each (replica i on core i, ``--no-pin`` to let them roam), and measures
through the proxy with the ``openai`` client:

* **chat**: ``--conversations`` multi-turn conversations (first turns from the prompts file, then
  ``--turns`` - 1 follow-ups), ``--chat-concurrency`` conversations at once, streamed; per turn the
  time to first token and the prompt tokens the replica found cached.  With prefix routing a
  conversation's turns stay on one replica and find their history cached.
* **load**: ``--requests`` single-turn requests at ``--concurrency`` streams; aggregate output
  tokens per second.

Greedy, ``--max-tokens`` per answer.  Prints a table and writes JSON
(``benchmarks/results/replicas.json`` unless ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import free_port  # noqa: E402
from benchmarks.harness import machine, print_table, write_json  # noqa: E402
from tools.prompts import load_prompts_file  # noqa: E402

FOLLOW_UPS = ["Go on, in more detail.", "Now summarise that in two sentences.", "What would you change?",
              "Give one example."]


async def stream_chat(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return dict(ttft=first or time.perf_counter() - t0, seconds=time.perf_counter() - t0, text=text,
                prompt_tokens=usage.prompt_tokens, cached=cached or 0, output_tokens=usage.completion_tokens)


async def chat_workload(client, model: str, firsts: list[list[dict]], turns: int, concurrency: int,
                        max_tokens: int) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)

    async def conversation(i: int, messages: list[dict]) -> list[dict]:
        out = []
        async with gate:
            for t in range(turns):
                r = await stream_chat(client, model, messages, max_tokens)
                out.append(dict(conversation=i, turn=t, **{k: v for k, v in r.items() if k != "text"}))
                messages = messages + [{"role": "assistant", "content": r["text"]},
                                       {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
        return out
    results = await asyncio.gather(*(conversation(i, m) for i, m in enumerate(firsts)))
    return [r for conv in results for r in conv]


async def load_workload(client, model: str, prompts: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def one(messages):
        async with gate:
            return await stream_chat(client, model, messages, max_tokens)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(m) for m in prompts))
    wall = time.perf_counter() - t0
    return dict(output_tok_s=sum(r["output_tokens"] for r in results) / wall, wall_s=wall,
                ttft_p50_ms=1000 * statistics.median(r["ttft"] for r in results))


def run(replicas: int, args, server_args: list[str]) -> dict:
    import openai
    import ray
    from ray import serve

    from deploy.ray_serve import build_app

    prompts = [[dict(m) for m in p.messages] for p in load_prompts_file(args.prompts)]
    port = free_port()
    ray.init(num_cpus=replicas * args.cpus_per_replica, include_dashboard=False, log_to_driver=False)
    try:
        t0 = time.perf_counter()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(server_args, replicas=replicas, cpus_per_replica=args.cpus_per_replica,
                            pin=args.pin_cores),
                  name="mcsd", route_prefix="/")
        ready = time.perf_counter() - t0
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                                    timeout=1800)

        async def main():
            model = (await client.models.list()).data[0].id
            await stream_chat(client, model, prompts[-1], 8)  # warm-up
            chat = await chat_workload(client, model, prompts[:args.conversations], args.turns,
                                       args.chat_concurrency, args.max_tokens)
            load = await load_workload(client, model, [prompts[i % len(prompts)] for i in range(args.requests)],
                                       args.concurrency, args.max_tokens)
            return chat, load
        chat, load = asyncio.run(main())
    finally:
        serve.shutdown()
        ray.shutdown()
    later = [r for r in chat if r["turn"] > 0]
    return dict(replicas=replicas, ready_s=ready, chat=chat,
                chat_ttft_ms=1000 * statistics.mean(r["ttft"] for r in chat),
                later_turn_ttft_ms=1000 * statistics.mean(r["ttft"] for r in later) if later else None,
                later_turn_cached=sum(r["cached"] for r in later) / max(sum(r["prompt_tokens"] for r in later), 1),
                **load)


def main() -> None:
    argv = sys.argv[1:]
    server_args = shlex.split(" ".join(argv[argv.index("--") + 1:])) if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="1,2", help="replica counts to run, in order")
    ap.add_argument("--cpus-per-replica", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--no-pin", dest="pin_cores", action="store_false",
                    help="let replicas use any core (default: replica i on core i)")
    ap.add_argument("--config", default="default", help="server preset every replica runs")
    ap.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts" / "bench.json"))
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--chat-concurrency", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(own)
    server_args = ["--config", args.config, "--threads", str(args.threads)] + server_args
    rows = []
    for n in [int(x) for x in args.replicas.split(",")]:
        print(f"{n} replica(s): {' '.join(server_args)}", flush=True)
        rows.append(run(n, args, server_args))
        r = rows[-1]
        print(f"  ready {r['ready_s']:.1f} s; chat TTFT {r['chat_ttft_ms']:.0f} ms (later turns "
              f"{r['later_turn_ttft_ms']:.0f} ms, {r['later_turn_cached']:.0%} of their prompt cached); "
              f"{args.concurrency} streams {r['output_tok_s']:.2f} tok/s", flush=True)
    print()
    print_table(rows, [("replicas", "replicas", "d"), ("ready_s", "ready s", ".1f"),
                       ("chat_ttft_ms", "chat TTFT ms", ".0f"), ("later_turn_ttft_ms", "later turns TTFT ms", ".0f"),
                       ("later_turn_cached", "later turns cached", ".2f"),
                       ("output_tok_s", f"tok/s at {args.concurrency} streams", ".2f"),
                       ("ttft_p50_ms", "load TTFT p50 ms", ".0f")])
    if len(rows) > 1:
        base = rows[0]
        for r in rows[1:]:
            print(f"\n{r['replicas']} vs {base['replicas']} replica(s): throughput "
                  f"{r['output_tok_s'] / base['output_tok_s']:.2f}x, chat TTFT "
                  f"{r['chat_ttft_ms'] / base['chat_ttft_ms']:.2f}x")
    write_json("replicas.json", dict(machine=machine(), args=vars(args), server_args=server_args, rows=rows),
               args.out)


if __name__ == "__main__":
    main()
