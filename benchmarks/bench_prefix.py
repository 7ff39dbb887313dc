"""Prefix-cache benchmark (issue 21): multi-turn chats and a shared system prompt, cache on vs off, and
llama-server on the same GGUF files, all through the official ``openai`` client.

Workloads (``--workloads``):

* ``chat``: ``--conversations`` ShareGPT conversations with at least ``--turns`` human turns, replayed
  turn by turn, ``--concurrency`` conversations at once.  Each server keeps its own history: turn t
  sends every earlier user turn with the server's own earlier answers, then user turn t, as a
  streaming chat UI does.  TTFT per turn index tells whether the history is prefilled again.
* ``system``: ``--agents`` requests that share one long system prompt (a tool-using agent's
  instructions, ``--system-tokens`` long) and differ in the question, sent ``--concurrency`` at once,
  in ``--rounds`` rounds (a second round finds the prompt cached from the first).

Servers (``--configs``): ``ours cache`` (``--prefix-cache``), ``ours nocache`` (``--no-prefix-cache``),
``llama`` (llama-server with its default ``cache_prompt``).  Turns and rounds are interleaved over
the servers, rotating the order.  Greedy, ``--max-tokens`` per answer.

    .venv/bin/python benchmarks/bench_prefix.py                       # both workloads, all three servers
    .venv/bin/python benchmarks/bench_prefix.py --configs "ours cache,ours nocache" --workloads chat

Prints a table per workload and writes JSON (``benchmarks/results/prefix.json`` unless ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_peer import (  # noqa: E402
    DEFAULT_DRAFT, DEFAULT_TARGET, LLAMA_VERSION, Server, build_llama_server, free_port, gguf_path,
)
from benchmarks.harness import machine, median, print_table, write_json  # noqa: E402

SYSTEM_HEAD = ("You are a careful coding agent. You have these tools: read_file(path), write_file(path, text), "
               "run(cmd), search(query). Answer with a plan, then the tool calls. Rules follow.\n")


def sharegpt_conversations(count: int, turns: int, max_chars: int) -> list[list[str]]:
    """The human turns (``turns`` of them, each at most ``max_chars``) of the first ``count`` English
    ShareGPT conversations that have enough of them."""
    from tools.prompts import iter_json_array, looks_english
    from engine.models.fetch import fetch_dataset

    out = []
    for record in iter_json_array(fetch_dataset("sharegpt")):
        human = [m.get("value", "").strip() for m in record.get("conversations", []) if m.get("from") == "human"]
        human = [h for h in human if 8 <= len(h) <= max_chars]
        if len(human) >= turns and all(looks_english(h) for h in human[:turns]):
            out.append(human[:turns])
            if len(out) == count:
                break
    return out


def percentile(xs: list[float], q: float) -> Optional[float]:
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


async def ask(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"top_k": 1})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text += chunk.choices[0].delta.content
    e2e = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return dict(ttft=ttft if ttft is not None else e2e, e2e=e2e, text=text,
                tokens=usage.completion_tokens if usage is not None else 0,
                prompt_tokens=usage.prompt_tokens if usage is not None else None,
                cached_tokens=getattr(details, "cached_tokens", None) if details is not None else None)


async def chat_workload(servers, clients, args, convs: list[list[str]]) -> list[dict]:
    results: dict[str, list[dict]] = {name: [] for name in servers}
    histories = {name: [[] for _ in convs] for name in servers}
    groups = [list(range(i, min(i + args.concurrency, len(convs)))) for i in range(0, len(convs), args.concurrency)]
    k = 0
    for group in groups:
        for turn in range(args.turns):
            names = list(servers)
            for name in rotated(names, k):
                async def one(c: int, name=name) -> dict:
                    history = histories[name][c]
                    history.append({"role": "user", "content": convs[c][turn]})
                    r = await ask(clients[name], args.model_name, list(history), args.max_tokens)
                    history.append({"role": "assistant", "content": r["text"]})
                    return dict(r, turn=turn + 1, conversation=c)
                results[name] += await asyncio.gather(*(one(c) for c in group))
            k += 1
            print(f"  chat: conversations {group[0]}-{group[-1]}, turn {turn + 1}/{args.turns} done", flush=True)
    return by_phase(results, "turn", args.turns)


async def system_workload(servers, clients, args) -> list[dict]:
    rules = [f"Rule {i}: when a tool call fails, read its error, change one thing and try again; never repeat "
             f"a failed call unchanged (case {i})." for i in range(args.system_rules)]
    system = SYSTEM_HEAD + "\n".join(rules)
    questions = [f"Task {i}: the test tests/test_{i}.py fails with an ImportError. Fix it." for i in range(args.agents)]
    results: dict[str, list[dict]] = {name: [] for name in servers}
    k = 0
    for rnd in range(args.rounds):
        for i in range(0, args.agents, args.concurrency):
            batch = questions[i:i + args.concurrency]
            names = list(servers)
            for name in rotated(names, k):
                rs = await asyncio.gather(*(ask(clients[name], args.model_name,
                                                [{"role": "system", "content": system}, {"role": "user", "content": q}],
                                                args.max_tokens) for q in batch))
                results[name] += [dict(r, round=rnd + 1) for r in rs]
            k += 1
        print(f"  system: round {rnd + 1}/{args.rounds} done", flush=True)
    return by_phase(results, "round", args.rounds)


def rotated(names: list[str], k: int) -> list[str]:
    """The servers in the order they take turn (or round) ``k``: rotated, so none is always first."""
    return names[k % len(names):] + names[:k % len(names)]


def by_phase(results: dict[str, list[dict]], phase: str, count: int) -> list[dict]:
    """One row per server: the summary, then the median TTFT and prompt length of each turn / round."""
    rows = []
    for name, rs in results.items():
        row = summarize(name, rs)
        for i in range(1, count + 1):
            row[f"ttft_{phase}{i}_s"] = median([r["ttft"] for r in rs if r[phase] == i])
            row[f"prompt_{phase}{i}"] = median([r["prompt_tokens"] or 0 for r in rs if r[phase] == i])
        rows.append(row)
    return rows


def summarize(name: str, rs: list[dict]) -> dict:
    ttfts = [r["ttft"] for r in rs]
    tokens = sum(r["tokens"] for r in rs)
    cached = [r["cached_tokens"] for r in rs if r["cached_tokens"] is not None]
    return dict(config=name, requests=len(rs), ttft_mean_s=sum(ttfts) / len(ttfts), ttft_p50_s=percentile(ttfts, 0.5),
                ttft_p99_s=percentile(ttfts, 0.99), tok_s=tokens / sum(r["e2e"] for r in rs),
                prompt_tokens=sum(r["prompt_tokens"] or 0 for r in rs),
                cached_tokens=sum(cached) if cached else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--model-name", default=DEFAULT_TARGET)
    ap.add_argument("--configs", default="ours cache,ours nocache,llama")
    ap.add_argument("--workloads", default="chat,system")
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-user-chars", type=int, default=400)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--system-rules", type=int, default=30, help="rules in the system prompt (~25 tokens each)")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server-args", default="", help="extra flags for our servers")
    ap.add_argument("--llama-version", default=LLAMA_VERSION)
    ap.add_argument("--startup-timeout", type=float, default=1800)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import openai

    wanted = [c.strip() for c in args.configs.split(",")]
    convs = sharegpt_conversations(args.conversations, args.turns, args.max_user_chars) if "chat" in args.workloads \
        else []
    if "chat" in args.workloads and len(convs) < args.conversations:
        ap.error(f"found only {len(convs)} ShareGPT conversations with {args.turns} turns")
    target = Path(args.target) if args.target.endswith(".gguf") else gguf_path(args.target)
    servers: dict[str, Server] = {}
    for name in wanted:
        port = free_port()
        if name == "llama":
            binary = build_llama_server(args.llama_version)
            env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
            draft = Path(args.draft) if args.draft.endswith(".gguf") else gguf_path(args.draft)
            cmd = [str(binary), "-m", str(target), "-md", str(draft), "--spec-type", "draft-simple",
                   "-t", str(args.threads), "-c", "16384", "-np", str(args.concurrency), "--host", "127.0.0.1",
                   "--port", str(port)]
            servers[name] = Server(name, cmd, port, env)
        elif name in ("ours cache", "ours nocache"):
            flag = "--prefix-cache" if name == "ours cache" else "--no-prefix-cache"
            cmd = [sys.executable, "-m", "server", "--config", "default", "--threads", str(args.threads),
                   "--model", args.target, "--draft-model", args.draft, "--served-model-name", args.model_name,
                   *args.server_args.split(), flag, "--host", "127.0.0.1", "--port", str(port)]
            servers[name] = Server(name, cmd, port, dict(os.environ, PYTHONPATH=str(ROOT)))
        else:
            ap.error(f"unknown configuration {name!r}")
    tables = {}
    try:
        for s in servers.values():
            s.start()
            s.wait_healthy(args.startup_timeout)
            print(f"{s.name}: healthy after {s.startup_s:.1f} s", flush=True)
        clients = {name: openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", timeout=3600, max_retries=0)
                   for name, s in servers.items()}

        async def run() -> None:
            if "chat" in args.workloads:
                tables["chat"] = await chat_workload(servers, clients, args, convs)
            if "system" in args.workloads:
                tables["system"] = await system_workload(servers, clients, args)
            for c in clients.values():
                await c.close()

        asyncio.run(run())
    finally:
        for s in servers.values():
            s.stop()
    common = [("config", "config", "s"), ("requests", "n", "d"), ("ttft_mean_s", "TTFT mean s", ".2f"),
              ("ttft_p50_s", "p50", ".2f"), ("ttft_p99_s", "p99", ".2f"), ("tok_s", "tok/s", ".2f"),
              ("prompt_tokens", "prompt tok", "d")]
    if "chat" in tables:
        print("\nmulti-turn chat: TTFT (median over conversations) by turn")
        print_table(tables["chat"], common + [(f"ttft_turn{t}_s", f"turn {t}", ".2f")
                                              for t in range(1, args.turns + 1)])
    if "system" in tables:
        print("\nshared system prompt: TTFT by round")
        print_table(tables["system"], common + [(f"ttft_round{r}_s", f"round {r}", ".2f")
                                                for r in range(1, args.rounds + 1)])
    write_json("prefix.json", dict(machine=machine(), args={k: str(v) for k, v in vars(args).items()}, **tables),
               args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
