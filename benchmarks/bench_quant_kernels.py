"""GGUF block kernels (``engine/models/csrc/quant_gemm.cpp``) against the bf16 linear: the cost curve.

For Qwen2.5-Coder-1.5B's largest linears and M = 1..64 rows (decode, tree verification, prefill
chunks), every block type and bf16: milliseconds per call (median), the weight bytes read and the
effective bandwidth (bytes / time) and its share of the machine's read bandwidth (measured in the same
run: the limit a one-row call can reach), and the ratio to one row.  Every call reads its weights from
memory: each method cycles through copies of the weight totalling at least ``--pool-mib`` (a model
forward reads each weight once; make it larger than the last-level cache).  Prints a table and writes
JSON.

Usage: ``python benchmarks/bench_quant_kernels.py [--types Q4_K,Q6_K,...] [--rows 1,2,4,8,16,32,64]
[--shapes gate_up,down] [--isas avx2,avx512] [--min-time 0.3] [--out benchmarks/results/quant_kernels.json]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import read_bandwidth_gbs  # noqa: E402
from engine.models import cpu_kernels  # noqa: E402
from engine.models.qweight import BLOCK_TYPES, TYPE_IDS, QuantWeight, kernel_isa  # noqa: E402


SHAPES = {"gate_up": (17920, 1536), "down": (1536, 8960), "qkv": (2048, 1536)}  # (N, K)


def random_weight(type_id: int, n: int, k: int, seed: int) -> QuantWeight:
    """Random blocks with small fp16 scales (the kernel's cost does not depend on the values)."""
    _, block, nbytes = BLOCK_TYPES[type_id]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // block, nbytes), generator=g, dtype=torch.uint8)
    scale = torch.full((n, k // block), 0.01, dtype=torch.float16).view(torch.uint8).reshape(n, k // block, 2)
    offsets = {"Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q4_1": (0, 2)}.get(BLOCK_TYPES[type_id][0], (0,))
    for off in offsets:
        raw[..., off:off + 2] = scale
    return QuantWeight(raw.reshape(n, -1), type_id, k)


def time_calls(fn, weights: list, x: torch.Tensor, min_time: float) -> float:
    """Median milliseconds per call, cycling through ``weights`` (all calls read from DRAM)."""
    for w in weights[:2]:
        fn(x, w)
    times, i, start = [], 0, time.perf_counter()
    while time.perf_counter() - start < min_time or len(times) < 5:
        t0 = time.perf_counter()
        fn(x, weights[i % len(weights)])
        times.append(time.perf_counter() - t0)
        i += 1
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--pool-mib", type=float, default=256.0)
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--isas", default="", help="quantized kernels to time, e.g. 'avx2,avxvnni,avx512' (one row each, the "
                    "same weights, interleaved per row count); default: the one the CPU uses")
    ap.add_argument("--out", default="benchmarks/results/quant_kernels.json")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    default_isa = kernel_isa()
    threads = torch.get_num_threads()
    bandwidth = read_bandwidth_gbs(threads)
    print(f"quantized kernels in use: {default_isa}; read bandwidth {bandwidth:.1f} GB/s ({threads} threads)")
    print(f"{'shape':8s} {'type':13s} {'MiB':>6s} " + " ".join(f"{f'M={m} ms':>9s}" for m in rows)
          + f" {'GB/s@1':>7s} {'of bw':>6s} {'8/1':>5s}")
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        for name in ["bf16"] + args.types.split(","):
            if name == "bf16":
                w0 = torch.randn(n, k).bfloat16()
                nbytes = w0.numel() * 2
                copies = max(2, int(args.pool_mib * 2**20 / nbytes) + 1)
                weights = [w0.clone() for _ in range(copies)]
                fn = lambda x, w: cpu_kernels.linear(x, w)  # noqa: E731
                dtype = torch.bfloat16
            else:
                w0 = random_weight(TYPE_IDS[name], n, k, 0)
                nbytes = w0.nbytes
                copies = max(2, int(args.pool_mib * 2**20 / nbytes) + 1)
                weights = [QuantWeight(w0.rows().clone(), w0.type_id, k) for _ in range(copies)]
                fn = lambda x, w: w.linear(x)  # noqa: E731
                dtype = torch.bfloat16
            isas = args.isas.split(",") if args.isas and name != "bf16" else [default_isa]
            ms = {isa: {} for isa in isas}
            with torch.inference_mode():
                for m in rows:
                    x = torch.randn(m, k).to(dtype)
                    for isa in isas:
                        kernel_isa(isa)
                        ms[isa][m] = time_calls(fn, weights, x, args.min_time)
            for isa in isas:
                label = f"{name}/{isa}" if len(isas) > 1 else name
                t = ms[isa]
                gbs = nbytes / (t[rows[0]] / 1e3) / 1e9
                ratio = t.get(8, float("nan")) / t[rows[0]]
                print(f"{shape:8s} {label:13s} {nbytes / 2**20:6.1f} " + " ".join(f"{t[m]:9.2f}" for m in rows)
                      + f" {gbs:7.1f} {gbs / bandwidth:6.0%} {ratio:5.2f}")
                results.append({"shape": shape, "N": n, "K": k, "type": name, "kernels": isa, "weight_bytes": nbytes,
                                "ms": {str(m): t[m] for m in rows}, "gb_per_s_at_1": gbs})
            kernel_isa(default_isa)
            del weights
    meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_kernel": cpu_kernels.should_use(torch.zeros(2, 2, dtype=torch.bfloat16)),
            "quantized_kernels": default_isa, "read_bandwidth_gb_per_s": bandwidth}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
