"""A GGUF model run natively (its quantized blocks, ``--gguf-weights native``) against the same file
dequantized to bf16 (the default): plain greedy decoding at batch 1, and a tree verification forward.

Interleaved per prompt (dense, then native), exactly N new tokens each.  Reports end-to-end tok/s,
decode tok/s (after the first token), time to first token, the weight bytes each holds, and the
process's resident memory after each load.  Prints a table and writes JSON.

    .venv/bin/python benchmarks/bench_gguf_weights.py --model qwen2.5-coder-1.5b-instruct --limit 3
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import machine, median, print_table, prompt_ids, run_ours, write_json  # noqa: E402
from engine.models.gguf_native import weight_bytes  # noqa: E402
from engine.models.loader import load_model  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def verify_ms(lm, ctx: list[int], rows: int, reps: int = 5) -> float:
    """Median milliseconds of one forward of ``rows`` new tokens after ``ctx`` (a verification block)."""
    model = lm.model
    times = []
    for _ in range(reps):
        cache = model.new_cache(1, len(ctx) + rows + 1)
        model(torch.tensor([ctx]), torch.arange(len(ctx))[None], cache, [0])
        cache.commit(0)
        t0 = time.perf_counter()
        model(torch.tensor([ctx[-rows:]]), torch.arange(len(ctx), len(ctx) + rows)[None], cache, [0])
        times.append(time.perf_counter() - t0)
    return median(times) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompts", default="benchmarks/prompts/bench.json")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rss0 = rss_mb()
    dense = load_model(args.model, dtype="bf16")
    rss_dense = rss_mb() - rss0
    native = load_model(args.model, dtype="bf16", gguf_weights="native")
    rss_native = rss_mb() - rss0 - rss_dense
    models = {"dense bf16": dense, "native blocks": native}
    prompts = prompt_ids(dense.tokenizer, args.prompts, args.limit)
    runs = {name: [] for name in models}
    for _, ids in prompts:
        for name, lm in models.items():
            runs[name].append(run_ours(lm, None, ids, args.max_new))
    rows = []
    ctx = prompts[0][1]
    for name, lm in models.items():
        rs = runs[name]
        rows.append(dict(
            weights=name, weight_mb=weight_bytes(lm.model) / 2**20,
            rss_mb=rss_dense if name.startswith("dense") else rss_native,
            tok_s=median([len(r["tokens"]) / r["seconds"] for r in rs]),
            decode_tok_s=median([(len(r["tokens"]) - 1) / (r["seconds"] - r["ttft"]) for r in rs]),
            ttft_s=median([r["ttft"] for r in rs]),
            verify1_ms=verify_ms(lm, ctx, 1), verify8_ms=verify_ms(lm, ctx, 8)))
    print_table(rows, [("weights", "weights", "s"), ("weight_mb", "weight MiB", ".0f"), ("rss_mb", "RSS MiB", ".0f"),
                       ("tok_s", "tok/s", ".2f"), ("decode_tok_s", "decode tok/s", ".2f"), ("ttft_s", "TTFT s", ".2f"),
                       ("verify1_ms", "1-row fwd ms", ".1f"), ("verify8_ms", "8-row fwd ms", ".1f")])
    write_json("gguf_weights.json", dict(machine=machine(), args=vars(args), rows=rows), args.out)


if __name__ == "__main__":
    main()
