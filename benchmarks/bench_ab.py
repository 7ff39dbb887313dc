"""A/B two revisions of the engine with one benchmark, interleaved.

    .venv/bin/python benchmarks/bench_ab.py --base REV [--head HEAD] [--rounds 2] -- benchmarks/bench_serving.py --concurrency 1,4

Both revisions are checked out into temporary git worktrees (so edits in the working tree during a
long run change nothing).  Each round runs the benchmark once in each tree, the order alternating between
rounds (base, head, then head, base, ...), so slow drift of a noisy machine hits both sides alike.
Both sides use this interpreter and its packages.  Understood outputs: ``bench_serving.py`` (rows
per mode and concurrency), ``bench_spec.py`` (rows per config and temperature) and
``bench_forward.py`` (milliseconds per block size) and ``step_ops.py`` (a step's host ms, device ops
and copies).  ``--current-script``: both sides run this tree's copy of the benchmark (a benchmark
newer than the base, measuring the base's engine).  Prints a
Markdown table of the means over rounds with head / base ratios and writes JSON
(``--out``, default ``benchmarks/results/ab.json``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import machine  # noqa: E402

SERVING = ("output_throughput_tok_s", "ttft_ms.p50", "e2e_ms.mean", "mean_accepted_length")
SPEC = ("tok_s", "decode_tok_s", "block_eff")
STEP_OPS = ("host_ms", "serial_ms", "device_ops", "h2d", "torch_calls", "py_calls")


def rows_of(result: dict) -> dict[str, dict[str, float]]:
    """``{row key: {metric: value}}`` for the benchmarks this script understands."""
    out = {}
    if "results" in result:  # bench_serving.py
        for r in result["results"]:
            key = f"{r['mode']} c={r['concurrency']}"
            out[key] = {m: _get(r, m) for m in SERVING}
    elif "rows" in result:  # bench_spec.py
        for r in result["rows"]:
            key = f"{r['config']} T={r['temperature']}"
            out[key] = {m: _get(r, m) for m in SPEC}
    elif "steps" in result:  # step_ops.py: one row per config, batch and temperature
        for r in result["steps"]:
            key = f"{r['config']} b={r['batch']} T={r['temperature']}"
            out[key] = {m: float(r[m]) for m in STEP_OPS if m in r}
    elif "forward" in result:  # bench_forward.py: one row per block size, milliseconds
        for r in result["forward"]:
            for metric, value in r.items():
                if metric.endswith("_ms"):
                    out[f"{r['variant']} {metric[:-3].replace('_', ' ')}"] = {"ms": float(value)}
    else:
        raise ValueError("unknown result format (expected bench_serving.py, bench_spec.py, bench_forward.py or "
                         "step_ops.py JSON)")
    return out


def _get(row: dict, path: str) -> float:
    for part in path.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return float(row) if isinstance(row, (int, float)) else float("nan")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare against (e.g. HEAD~3)")
    ap.add_argument("--head", default="HEAD", help="git revision under test (default: HEAD, committed)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/ab.json")
    ap.add_argument("--current-script", action="store_true",
                    help="run this tree's copy of the benchmark script on both sides")
    args = ap.parse_args(argv[:split])
    bench = argv[split + 1:]
    if not bench:
        ap.error("give the benchmark after --, e.g. -- benchmarks/bench_serving.py --concurrency 1,4")
    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    head_rev = subprocess.run(["git", "rev-parse", "--short", args.head], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="mcsd-ab-") as tmp:
        trees = {"base": Path(tmp) / "base", "head": Path(tmp) / "head"}
        for side, rev in (("base", base_rev), ("head", head_rev)):
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[side]), rev], cwd=ROOT, check=True,
                           capture_output=True)
            script = Path(bench[0])
            missing = not (trees[side] / script).exists()
            if not script.is_absolute() and (missing or args.current_script) and (ROOT / script).exists():
                # a benchmark newer than the revision: run this tree's copy against that revision's engine
                shutil.copy(ROOT / script, trees[side] / script)
                print(f"{side} ({rev}): running the current {script}", flush=True)
        try:
            runs: dict[str, list[dict]] = {"base": [], "head": []}
            for r in range(args.rounds):
                order = ("base", "head") if r % 2 == 0 else ("head", "base")
                for side in order:
                    out = Path(tmp) / f"{side}-{r}.json"
                    cwd = trees[side]
                    cmd = [sys.executable, *bench, "--out", str(out)]
                    print(f"round {r + 1}/{args.rounds}: {side} ({base_rev if side == 'base' else head_rev})",
                          flush=True)
                    subprocess.run(cmd, cwd=cwd, check=True)
                    runs[side].append(rows_of(json.loads(out.read_text())))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    table = []
    for key in runs["base"][0]:
        for metric in runs["base"][0][key]:
            b = statistics.fmean(run[key][metric] for run in runs["base"])
            h = statistics.fmean(run[key][metric] for run in runs["head"] if key in run)
            table.append({"row": key, "metric": metric, "base": b, "head": h, "ratio": h / b if b else float("nan"),
                          "base_runs": [run[key][metric] for run in runs["base"]],
                          "head_runs": [run[key][metric] for run in runs["head"] if key in run]})
    head_label = head_rev
    print(f"\n| row | metric | base {base_rev} | head {head_label} | head / base |\n|---|---|---|---|---|")
    for t in table:
        print(f"| {t['row']} | {t['metric']} | {t['base']:.2f} | {t['head']:.2f} | {t['ratio']:.3f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "ab", "base": base_rev, "head": head_label, "rounds": args.rounds,
                                    "command": bench, "machine": machine(), "table": table}, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
