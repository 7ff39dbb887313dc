"""Plain decoding: our runtime vs ``transformers.generate`` (issue: model runtime, item 8).

Interleaved per prompt (ours, then transformers, same prompt), greedy, exactly N new tokens, batch 1.
Also measures the machine's read bandwidth in the same run and reports our decode speed as a
fraction of the bandwidth limit (bf16 weights read once per token).

    .venv/bin/python benchmarks/bench_runtime.py --limit 6
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    hf_model, machine, median, print_table, prompt_ids, read_bandwidth_gbs, run_hf, run_ours,
    weight_bytes_per_token, write_json,
)
from engine.models.loader import load_model  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompts", default="benchmarks/prompts/bench.json")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    bw_before = read_bandwidth_gbs(args.threads)  # measured before and after; the better one counts
    ours = load_model(args.model, dtype=args.dtype)
    ref = hf_model(ours.path, ours.model.dtype)
    prompts = prompt_ids(ours.tokenizer, args.prompts, args.limit)
    run_ours(ours, None, prompts[0][1][:16], 8)  # warm-up both (first-call allocations, kernels)
    run_hf(ref, prompts[0][1][:16], 8)

    rows = []
    for pid, ids in prompts:
        a = run_ours(ours, None, ids, args.max_new_tokens)
        b = run_hf(ref, ids, args.max_new_tokens, measure_ttft=True)
        same = sum(1 for x, y in zip(a["tokens"], b["tokens"]) if x == y) if a["tokens"] == b["tokens"] \
            else next(i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
        n = len(a["tokens"])
        rows.append(dict(prompt=pid, prompt_tokens=len(ids), ours_tps=n / a["seconds"],
                         hf_tps=n / b["seconds"], ratio=b["seconds"] / a["seconds"],
                         ours_decode_tps=(n - 1) / (a["seconds"] - a["ttft"]),
                         hf_decode_tps=(n - 1) / max(b["seconds"] - b["ttft"], 1e-9),
                         ours_ttft=a["ttft"], hf_ttft=b["ttft"], agree_prefix=same))
        print(f"{pid}: ours {rows[-1]['ours_tps']:.2f} tok/s, transformers {rows[-1]['hf_tps']:.2f} tok/s",
              flush=True)

    bw = max(bw_before, read_bandwidth_gbs(args.threads))
    nbytes = weight_bytes_per_token(ours.model)
    limit = bw * 1e9 / nbytes
    summary = dict(ours_tps_median=median([r["ours_tps"] for r in rows]),
                   hf_tps_median=median([r["hf_tps"] for r in rows]),
                   ours_decode_tps_median=median([r["ours_decode_tps"] for r in rows]),
                   hf_decode_tps_median=median([r["hf_decode_tps"] for r in rows]),
                   speed_ratio_median=median([r["ratio"] for r in rows]),
                   read_bandwidth_gbs=bw, weight_bytes_per_token=nbytes, bandwidth_limit_tps=limit)
    summary["fraction_of_bandwidth_limit"] = summary["ours_decode_tps_median"] / limit
    print()
    print_table(rows, [("prompt", "prompt", "<16"), ("prompt_tokens", "len", ">4"), ("ours_tps", "ours tok/s", ">10.2f"),
                       ("hf_tps", "generate tok/s", ">14.2f"), ("ratio", "ours/generate", ">13.2f"),
                       ("ours_decode_tps", "ours decode", ">11.2f"), ("hf_decode_tps", "generate decode", ">15.2f"),
                       ("ours_ttft", "ours TTFT s", ">11.2f"), ("hf_ttft", "generate TTFT s", ">15.2f"),
                       ("agree_prefix", "greedy agree (tokens)", ">21")])
    print(f"\nmedian end-to-end: ours {summary['ours_tps_median']:.2f} tok/s, transformers.generate "
          f"{summary['hf_tps_median']:.2f} tok/s, ratio {summary['speed_ratio_median']:.2f}x; decode only: ours "
          f"{summary['ours_decode_tps_median']:.2f}, generate {summary['hf_decode_tps_median']:.2f} tok/s")
    print(f"read bandwidth {bw:.1f} GB/s, {nbytes / 1e9:.2f} GB of weights per token -> limit {limit:.2f} tok/s; "
          f"ours (decode) at {100 * summary['fraction_of_bandwidth_limit']:.0f}% of it")
    write_json("runtime.json", dict(args=vars(args), machine=machine(), rows=rows, summary=summary), args.out)


if __name__ == "__main__":
    main()
