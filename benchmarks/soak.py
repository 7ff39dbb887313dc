"""Soak test: a real server under concurrent streaming clients, random disconnects and bad requests.

Starts ``python -m server`` on a free port (the model and flags are this script's options), then for
``--duration`` seconds runs ``--clients`` concurrent clients.  Each loops over: a streaming completion
(dropped after a random number of chunks with probability ``--disconnect``), a plain chat completion,
or a bad request (broken JSON, a lone surrogate, an out-of-range logit_bias key, an over-long stop
string, a wrong method), in proportions set by ``--bad``.  Before and after: a greedy canary request
(its text must not change) and the server's resident memory; after: ``/health`` must show nothing
running or waiting, and the KV-cache usage must be back to zero (no leaked slot).

Goal (issue 22): zero 5xx, zero leaks, RSS drift < 2%, identical canary.  Prints a table, writes JSON.

    .venv/bin/python benchmarks/soak.py --model smollm2-135m-instruct --duration 600 --clients 24
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine, write_json  # noqa: E402

CANARY = {"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}
BAD = [
    (b"{not json", 400),
    (b'{"prompt": "a\\ud800b", "max_tokens": 4}', 400),
    (b'{"prompt": "hi", "logit_bias": {"99999999999": 1}}', 400),
    (b'{"prompt": "hi", "stop": ["' + b"x" * 2000 + b'"]}', 400),
    (b'{"prompt": "hi", "max_tokens": 0}', 400),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def canary(http: httpx.AsyncClient) -> str:
    r = await http.post("/v1/completions", json=CANARY)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


async def client(http: httpx.AsyncClient, rng: random.Random, deadline: float, args, counts: Counter) -> None:
    while time.monotonic() < deadline:
        roll = rng.random()
        try:
            if roll < args.bad:
                body, want = rng.choice(BAD)
                r = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                counts[f"bad -> {r.status_code}" + ("" if r.status_code == want else " (unexpected)")] += 1
            elif roll < args.bad + 0.1:
                r = await http.get("/v1/completions")
                counts[f"wrong method -> {r.status_code}"] += 1
            elif roll < 0.6:
                drop = rng.random() < args.disconnect
                limit = rng.randint(1, 6)
                async with http.stream("POST", "/v1/completions", json={
                        "prompt": rng.choice(["Once upon a time", "import os\n", "The best way to"]),
                        "max_tokens": rng.randint(8, 48), "stream": True,
                        "temperature": rng.choice([0, 0.7])}) as r:
                    chunks, done = 0, False
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            chunks += 1
                            done = line == "data: [DONE]"
                            if drop and chunks >= limit:
                                break
                    counts[f"stream -> {r.status_code}" + (" dropped" if drop and not done else "")] += 1
            else:
                r = await http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": rng.choice(["Hi!", "Name a color.", "2+2?"])}],
                    "max_tokens": rng.randint(4, 24)})
                counts[f"chat -> {r.status_code}"] += 1
        except httpx.HTTPError as exc:
            counts[f"transport error {type(exc).__name__}"] += 1


async def soak(base: str, pid: int, args) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        before = await canary(http)
        rss0 = rss_mb(pid)
        counts: Counter = Counter()
        deadline = time.monotonic() + args.duration
        rngs = [random.Random(args.seed + i) for i in range(args.clients)]
        async with httpx.AsyncClient(base_url=base, timeout=120,
                                     limits=httpx.Limits(max_connections=args.clients * 2)) as pool:
            await asyncio.gather(*(client(pool, rng, deadline, args, counts) for rng in rngs))
        await asyncio.sleep(1.0)  # let aborted requests finish
        health = (await http.get("/health")).json()
        metrics = (await http.get("/metrics")).text
        after = await canary(http)
        rss1 = rss_mb(pid)
    kv = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("mcsd:kv_cache_usage")]
    blocks = {line.split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("mcsd:kv_cache_blocks{")}
    preempted = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("mcsd:num_preemptions_total")]
    five_xx = sum(n for k, n in counts.items() if "-> 5" in k)
    return dict(counts=dict(counts), requests=sum(counts.values()), five_xx=five_xx,
                unexpected=sum(n for k, n in counts.items() if "unexpected" in k or "transport" in k),
                running_after=health.get("running"), waiting_after=health.get("waiting"),
                unfinished_after=health.get("unfinished"), kv_usage_after=kv[0] if kv else None,
                kv_blocks_after=blocks, preemptions=preempted[0] if preempted else None,
                rss_before_mb=rss0, rss_after_mb=rss1, rss_drift=(rss1 - rss0) / rss0,
                canary_identical=before == after)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--server-args", default="--max-batch 8 --max-queue 64", help="extra flags for python -m server")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--disconnect", type=float, default=0.3, help="probability that a stream is dropped")
    ap.add_argument("--bad", type=float, default=0.2, help="share of bad requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "server", "--model", args.model, "--port", str(port), *args.server_args.split()]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
            time.sleep(0.5)
        result = asyncio.run(soak(base, proc.pid, args))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    for key, n in sorted(result["counts"].items()):
        print(f"{key:40s} {n:6d}")
    print(f"\nrequests {result['requests']}, 5xx {result['five_xx']}, unexpected {result['unexpected']}, "
          f"after: running {result['running_after']} waiting {result['waiting_after']} "
          f"unfinished {result['unfinished_after']} kv usage {result['kv_usage_after']} "
          f"(blocks {result['kv_blocks_after']}), preemptions {result['preemptions']}, "
          f"RSS {result['rss_before_mb']:.0f} -> {result['rss_after_mb']:.0f} MiB ({100 * result['rss_drift']:+.2f}%), "
          f"canary identical: {result['canary_identical']}")
    write_json("soak.json", dict(machine=machine(), args=vars(args), **result), args.out)


if __name__ == "__main__":
    main()
