"""Small-M bf16 GEMM on the CPU: our AVX2 kernel vs torch's F.linear (bf16 and fp32).

For the linear layers of Qwen2.5-Coder-1.5B and M = 1..32 rows (speculative verification runs
8-32 tokens per forward), prints a table and writes ``benchmarks/results/kernels.json`` with, per
shape, M and method: milliseconds per call (median and best) and the effective bandwidth of the
weight reads (weight bytes / time; the weights dominate the traffic at these M).

Numbers are bandwidth-real: each method cycles through enough copies of the weight (at least
``--pool-mib``, default 256 MiB, i.e. several times the last-level cache) that every call reads its
weights from DRAM, as a model forward does.

On a machine shared with other jobs, ``--sweeps 3`` repeats the whole measurement and keeps, per
cell, the least disturbed median (an OpenMP region whose second thread is descheduled costs a
whole scheduler time slice, several milliseconds).

Usage: ``python benchmarks/bench_kernels.py [--rows 1,2,4,8,16,32] [--shapes qkv,o,gate_up,down,lm_head]
[--threads N] [--min-time 0.25] [--sweeps 1] [--no-fp32] [--out benchmarks/results/kernels.json]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.models import cpu_kernels  # noqa: E402

# Qwen2.5-Coder-1.5B: hidden 1536, 12 heads + 2 kv heads of 128, intermediate 8960, vocab 151936.
SHAPES = {  # name: (N, K) of the [N, K] weight
    "qkv": (2048, 1536),
    "o": (1536, 1536),
    "gate_up": (17920, 1536),
    "down": (1536, 8960),
    "lm_head": (151936, 1536),
}
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32)
METHODS = ("torch_bf16", "ours", "torch_fp32")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_pool(n: int, k: int, dtype: torch.dtype, pool_bytes: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Copies of one random [n, k] weight, enough to exceed pool_bytes (at least one)."""
    first = torch.randn(n, k, generator=gen).to(dtype)
    copies = max(1, math.ceil(pool_bytes / first.nbytes))
    return [first] + [first.clone() for _ in range(copies - 1)]


def time_calls(fn, weights: list[torch.Tensor], min_time: float, min_reps: int) -> list[float]:
    """Seconds per call, cycling through the weight copies (one warm-up call first)."""
    fn(weights[-1])
    times: list[float] = []
    start = time.perf_counter()
    i = 0
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        w = weights[i % len(weights)]
        t0 = time.perf_counter()
        fn(w)
        times.append(time.perf_counter() - t0)
        i += 1
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help="M values, comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="subset of " + ",".join(SHAPES))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--min-time", type=float, default=0.25, help="seconds per cell (at least 3 calls)")
    parser.add_argument("--pool-mib", type=int, default=256, help="weight copies cycled per method (MiB)")
    parser.add_argument("--no-fp32", action="store_true", help="skip the F.linear fp32 column")
    parser.add_argument(
        "--sweeps", type=int, default=1, help="repeat the whole sweep, keep each cell's least disturbed median"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "kernels.json")
    args = parser.parse_args()

    rows = [int(r) for r in args.rows.split(",") if r]
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}; choose from {list(SHAPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = [m for m in METHODS if not (args.no_fp32 and m == "torch_fp32")]

    t0 = time.perf_counter()
    have_ours = cpu_kernels.available()
    load_s = time.perf_counter() - t0
    if not have_ours:
        print(f"our kernel unavailable: {cpu_kernels.unavailable_reason()}", file=sys.stderr)
        methods.remove("ours")

    meta = {
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ours_available": have_ours,
        "ours_build_or_load_s": round(load_s, 3),
        "pool_mib": args.pool_mib,
        "min_time_s": args.min_time,
        "sweeps": args.sweeps,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "gbps_definition": "weight bytes (N*K*element size) / median seconds per call",
        "ms_definition": "median per call; with --sweeps > 1, the lowest median over the sweeps",
    }
    print(
        f"{meta['cpu']} | {meta['cpu_capability']} | {meta['threads']} threads | torch {meta['torch']}"
        f" | ours {'built/loaded in %.2fs' % load_s if have_ours else 'unavailable'}"
    )
    gen = torch.Generator().manual_seed(0)
    pool_bytes = args.pool_mib << 20
    # cell (shape, M, method) -> per sweep: (median s, best s, calls)
    cells: dict[tuple[str, int, str], list[tuple[float, float, int]]] = {}
    with torch.inference_mode():
        for sweep in range(args.sweeps):
            for name in shapes:
                n, k = SHAPES[name]
                pools = {}
                for method in methods:
                    dtype = torch.float32 if method == "torch_fp32" else torch.bfloat16
                    if dtype not in pools:
                        pools[dtype] = make_pool(n, k, dtype, pool_bytes, gen)
                for m in rows:
                    x = torch.randn(m, k, generator=gen)
                    for method in methods:
                        dtype = torch.float32 if method == "torch_fp32" else torch.bfloat16
                        xm = x.to(dtype)
                        if method == "ours":
                            fn = lambda w, xm=xm: cpu_kernels.bf16_linear(xm, w)  # noqa: E731
                        else:
                            fn = lambda w, xm=xm: F.linear(xm, w)  # noqa: E731
                        times = time_calls(fn, pools[dtype], args.min_time, 3)
                        cells.setdefault((name, m, method), []).append(
                            (statistics.median(times), min(times), len(times))
                        )
                del pools
            if args.sweeps > 1:
                print(f"sweep {sweep + 1}/{args.sweeps} done", file=sys.stderr, flush=True)

    hdr = (
        f"{'shape':8} {'N':>6} {'K':>5} {'M':>3} | {'bf16 ms':>8} {'ours ms':>8} {'fp32 ms':>8} |"
        f" {'bf16 GB/s':>9} {'ours GB/s':>9} {'fp32 GB/s':>9} | {'ours/bf16':>9} {'ours M/1':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    results = []
    for name in shapes:
        n, k = SHAPES[name]
        ours_m1 = None
        for m in rows:
            row = {"shape": name, "N": n, "K": k, "M": m}
            for method in methods:
                sweeps = cells[name, m, method]
                med, best, calls = min(sweeps)  # the least disturbed sweep
                nbytes = n * k * (4 if method == "torch_fp32" else 2)
                row[f"{method}_ms"] = round(med * 1e3, 4)
                row[f"{method}_best_ms"] = round(best * 1e3, 4)
                row[f"{method}_gbps"] = round(nbytes / med / 1e9, 2)
                row[f"{method}_calls"] = calls
                if len(sweeps) > 1:
                    row[f"{method}_sweep_ms"] = [round(sw[0] * 1e3, 4) for sw in sweeps]
            if have_ours:
                if m == 1:
                    ours_m1 = row["ours_ms"]
                if "torch_bf16_ms" in row:
                    row["speedup_vs_torch_bf16"] = round(row["torch_bf16_ms"] / row["ours_ms"], 2)
                if ours_m1:
                    row["ours_ms_over_m1"] = round(row["ours_ms"] / ours_m1, 2)
            results.append(row)

            def cell(key: str, fmt: str) -> str:
                return format(row[key], fmt) if key in row else "-"

            print(
                f"{name:8} {n:>6} {k:>5} {m:>3} | {cell('torch_bf16_ms', '8.3f'):>8}"
                f" {cell('ours_ms', '8.3f'):>8} {cell('torch_fp32_ms', '8.3f'):>8} |"
                f" {cell('torch_bf16_gbps', '9.1f'):>9} {cell('ours_gbps', '9.1f'):>9}"
                f" {cell('torch_fp32_gbps', '9.1f'):>9} | {cell('speedup_vs_torch_bf16', '8.2f'):>8}x"
                f" {cell('ours_ms_over_m1', '7.2f'):>7}x"
            )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
