"""One target forward, by rows: decoding (1 row), tree verification (2-16 rows), prefill chunks.

The model runs in its own GGUF blocks (``gguf_weights="native"``).  Each cell is R new tokens after a
``--context``-token prompt (logits for the last row only, as the engine asks for a prefill chunk, and
for every row of a verification block), median of ``--reps`` interleaved rounds, milliseconds; "prefill"
is the prompt itself.  ``--ablate-layer-ops`` also times every cell with the row-wise layer operations
in torch's formulation instead of ``csrc/layer_ops.cpp``, interleaved with ours, so that their share
is measured in one run.  Prints a table and writes JSON; ``bench_ab.py`` compares two revisions.

    .venv/bin/python benchmarks/bench_forward.py [--rows 1,2,4,8,16,64] [--context 300] [--ablate-layer-ops]
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
from engine.models import cpu_kernels  # noqa: E402
from engine.models.loader import load_model  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ablate-layer-ops", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, gguf_weights="native")
    model, ctx = lm.model, args.context
    rows = [int(r) for r in args.rows.split(",")]
    cache = model.new_cache(1, ctx + max(rows) + 8)
    slot = cache.allocate()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, lm.config.vocab_size, (1, ctx), generator=gen)
    fused_ops = getattr(cpu_kernels, "_row_ops", None)  # absent before the layer operations (bench_ab's base)
    if args.ablate_layer_ops and fused_ops is None:
        ap.error("this revision has no layer operations to ablate")

    def timed(ids: torch.Tensor, start: int, last_only: bool) -> float:
        n = ids.shape[1]
        pick = torch.tensor([[n - 1]]) if last_only else None
        t0 = time.perf_counter()
        model(ids, torch.arange(start, start + n)[None], cache, [slot], logits_rows=pick)
        dt = time.perf_counter() - t0
        cache.discard(slot)
        return dt * 1e3

    variants = ["ours", "torch ops"] if args.ablate_layer_ops else ["ours"]
    cells = {(v, r): [] for v in variants for r in ["prefill", *rows]}
    timed(prompt[:, :32], 0, True)  # warm-up: first-call allocations
    for rep in range(args.reps):
        for v in variants if rep % 2 == 0 else variants[::-1]:
            if fused_ops is not None:
                cpu_kernels._row_ops = fused_ops if v == "ours" else (lambda x: False)
            try:
                cells[v, "prefill"].append(timed(prompt, 0, True))
                model(prompt, torch.arange(ctx)[None], cache, [slot], logits_rows=torch.tensor([[ctx - 1]]))
                cache.commit(slot)
                for r in rows:
                    block = torch.randint(0, lm.config.vocab_size, (1, r), generator=gen)
                    cells[v, r].append(timed(block, ctx, False))
                cache.free(slot)
                slot = cache.allocate()
            finally:
                if fused_ops is not None:
                    cpu_kernels._row_ops = fused_ops
        print(f"round {rep + 1}/{args.reps} done", flush=True)

    table = []
    for v in variants:
        med = {r: statistics.median(cells[v, r]) for r in ["prefill", *rows]}
        table.append({"variant": v, **{f"rows_{r}_ms": med[r] for r in rows}, "prefill_ms": med["prefill"],
                      "prefill_tok_s": ctx / med["prefill"] * 1e3, "top_over_one": med[max(rows)] / med[rows[0]]})
    print_table(table, [("variant", "variant", "s"), *((f"rows_{r}_ms", f"{r} rows ms", ".1f") for r in rows),
                        ("prefill_ms", f"prefill {ctx} ms", ".0f"), ("prefill_tok_s", "prefill tok/s", ".1f"),
                        ("top_over_one", f"{max(rows)}/{rows[0]}", ".2f")])
    write_json("forward.json", {"benchmark": "forward", "model": args.model, "context": ctx, "reps": args.reps,
                                "machine": machine(), "forward": table,
                                "samples_ms": {f"{v} {r}": cells[v, r] for v, r in cells}}, args.out)

if __name__ == "__main__":
    main()
