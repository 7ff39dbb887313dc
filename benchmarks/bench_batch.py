"""Where a batched step's time goes: the server's engine under closed-loop load, without HTTP.

The serving benchmark (``bench_serving.py``) measures what clients see; this one drives the same
engine core (built from the same preset and flags as ``python -m server``) directly, so a level
runs faster and every step's :class:`~engine.stats.StepStats` can be summed: prefill, draft and
verify seconds, the tree budget the load-aware chooser picked, and drafted / accepted tokens by
drafter.  Use it to see why speculation wins or loses at a concurrency before a serving run.

    .venv/bin/python benchmarks/bench_batch.py --concurrency 1,4,8 --requests-per-level 16
    .venv/bin/python benchmarks/bench_batch.py --concurrency 8 -- --tree 4,2,2 --spec-method mcsd

Load: for each concurrency C, a closed loop keeps C requests in the engine (a finished one is
replaced at once by the next) until ``--requests-per-level`` have finished; request i uses prompt
``i mod len(prompts)`` (sources interleaved), greedy unless ``--temperature``, exactly
``--max-tokens`` tokens (EOS ignored).  Modes ``spec`` / ``nospec`` are interleaved ABBA by level.
Everything after a bare ``--`` goes to the server's settings parser.  The prefix cache is off unless
``--prefix-cache``: every level sends the same prompts, so with it the second mode of a level found
them cached and the first prefilled them (measured at concurrency 4 and T=0.7: 20% of the first
mode's time went to prefill, 1% of the second's).

Columns: output tok/s over the level's wall time; mean TTFT; steps; mean sequences per decode step;
seconds in prefill, draft (incl. the draft's lazy catch-up) and verify, as fractions of the level's
time; mean tree budget (nodes per sequence) over decode steps and the share of steps with budget 0;
drafted rows per decode step; acceptance by drafter (accepted / drafted).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import machine, print_table, prompt_ids, write_json  # noqa: E402
from engine.request import GenerationRequest, SamplingParams, SpecOptions  # noqa: E402
from server.build import build_core  # noqa: E402
from server.settings import load_settings  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_level(core, prompts, concurrency: int, n_requests: int, spec: bool, max_tokens: int,
              temperature: float, tag: str) -> dict:
    core.drain_step_stats()
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    done = 0
    issued = 0
    tokens = 0

    def issue() -> None:
        nonlocal issued
        _, ids = prompts[issued % len(prompts)]
        rid = f"{tag}-{issued}"
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, seed=issued)
        core.add_request(GenerationRequest(rid, ids, params, SpecOptions(enabled=spec)))
        started[rid] = time.perf_counter()
        issued += 1

    t0 = time.perf_counter()
    for _ in range(min(concurrency, n_requests)):
        issue()
    while done < n_requests:
        for out in core.step():
            tokens += len(out.new_token_ids)
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter()
            if out.finished:
                done += 1
                if issued < n_requests:
                    issue()
    wall = time.perf_counter() - t0
    stats = core.drain_step_stats()
    decode = [s for s in stats if s.num_seqs]
    by_method: dict[str, list[int]] = {}
    for s in stats:
        for m, n in s.drafted_by_method.items():
            by_method.setdefault(m, [0, 0])[0] += n
        for m, n in s.accepted_by_method.items():
            by_method.setdefault(m, [0, 0])[1] += n
    prefill_s = sum(s.step_seconds - s.draft_seconds - s.verify_seconds for s in stats)
    ttfts = [first[r] - started[r] for r in first]
    return {
        "mode": "spec" if spec else "nospec", "concurrency": concurrency, "requests": n_requests,
        "tokens": tokens, "seconds": wall, "tok_s": tokens / wall, "ttft_mean_s": sum(ttfts) / len(ttfts),
        "steps": len(decode), "seqs_per_step": sum(s.num_seqs for s in decode) / max(len(decode), 1),
        "prefill_s": prefill_s, "draft_s": sum(s.draft_seconds for s in stats),
        "verify_s": sum(s.verify_seconds for s in stats),
        "budget_mean": sum(s.budget for s in decode) / max(len(decode), 1),
        "budget_zero": sum(1 for s in decode if s.budget == 0) / max(len(decode), 1),
        "drafted_per_step": sum(s.drafted_tokens for s in decode) / max(len(decode), 1),
        "accepted_per_step": sum(s.accepted_tokens for s in decode) / max(len(decode), 1),
        "by_method": by_method,
    }


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="default", help="server preset (configs/NAME.toml)")
    ap.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts" / "bench.json"))
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--requests-per-level", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--modes", default="spec,nospec")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="keep the server's prefix cache on; by default it is off, because the levels reuse "
                         "the same prompts and a mode run after another would find them cached")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not args.prefix_cache:
        server_args = ["--no-prefix-cache", *server_args]
    settings = load_settings(["--config", args.config, *server_args])
    core = build_core(settings)
    prompts = prompt_ids(core.tokenizer, args.prompts, None)
    modes = args.modes.split(",")
    rows = []
    run_level(core, prompts[:1], 1, 1, True, 8, args.temperature, "warmup")  # first-call costs
    for i, c in enumerate(int(x) for x in args.concurrency.split(",")):
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            row = run_level(core, prompts, c, args.requests_per_level, mode == "spec", args.max_tokens,
                            args.temperature, f"{mode}{c}")
            rows.append(row)
            print(f"  {mode} c={c}: {row['tok_s']:.2f} tok/s", flush=True)
    for r in rows:
        r["prefill_frac"], r["draft_frac"], r["verify_frac"] = (r[k] / r["seconds"] for k in
                                                                ("prefill_s", "draft_s", "verify_s"))
        r["accept_by_method"] = " ".join(f"{m} {a}/{d}" for m, (d, a) in sorted(r["by_method"].items()))
    rows.sort(key=lambda r: (r["concurrency"], r["mode"]))
    print_table(rows, [("mode", "mode", "s"), ("concurrency", "conc", "d"), ("tok_s", "tok/s", ".2f"),
                       ("ttft_mean_s", "TTFT s", ".2f"), ("steps", "steps", "d"),
                       ("seqs_per_step", "seqs/step", ".1f"), ("prefill_frac", "prefill", ".2f"),
                       ("draft_frac", "draft", ".2f"), ("verify_frac", "verify", ".2f"),
                       ("budget_mean", "budget", ".2f"), ("budget_zero", "budget 0", ".2f"),
                       ("drafted_per_step", "drafted/step", ".1f"), ("accepted_per_step", "acc/step", ".2f"),
                       ("accept_by_method", "accepted/drafted by drafter", "s")])
    write_json("batch.json", {"machine": machine(), "args": vars(args), "server_args": server_args, "rows": rows},
               args.out)


if __name__ == "__main__":
    main()
