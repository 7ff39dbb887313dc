"""Every drafter and combination vs plain decoding, the best MCSD tree, ``transformers`` assisted
generation and ``transformers`` prompt lookup (issue: more drafters, item 7).

One interleaved run: for every prompt, every configuration runs back to back, so ratios are
comparable on a noisy machine.  Batch 1, exactly N new tokens, same prompts file as bench_spec.

    .venv/bin/python benchmarks/bench_drafters.py --limit 8 --temperatures 0

Configurations (``--configs``, ';'-separated):

    plain                 our plain decoding
    tree:W                MCSD, draft model tree of widths W (e.g. tree:2,1)
    maxgram:L[:B]         Max-Gram alone, B proposals (default 1) of up to L tokens (no draft model)
    mcsd+maxgram:W:L:T    draft tree W merged with a Max-Gram branch of up to L tokens from the root and
                          a Max-Gram tail of T tokens below the draft's likeliest leaf
    cascade:D:T:L         vertical cascade writing D tokens (draft reviewing Max-Gram guesses of up to L),
                          then a Max-Gram tail of T tokens (horizontal)
    mjsd:B:D:TAU          LOSSY joint decoding: draft beam width B, D tokens per step, threshold TAU
    target-init:K:D       LOSSY target-initialised candidates: K candidate roots, D tokens per candidate chain
    hf-plain / hf-assisted / hf-prompt-lookup   transformers.generate: plain, assisted by the draft,
                          prompt lookup with prompt_lookup_num_tokens=10

``ppl`` (greedy runs of ``plain`` and lossy configs): perplexity of the generated tokens under the
target at temperature 1, over all prompts; lossless configs produce plain's tokens by construction.

Columns as in bench_spec; ``vs HF lookup`` is the speedup over ``hf-prompt-lookup`` (ratio of summed
times).  Per-drafter acceptance (accepted / drafted nodes by drafter) is in the JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_spec import summarise  # noqa: E402
from benchmarks.harness import hf_model, machine, print_table, prompt_ids, run_hf, run_ours, write_json  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from engine.request import SpecOptions  # noqa: E402
from engine.speculative.tree import parse_widths  # noqa: E402

DEFAULT_CONFIGS = ("plain;tree:2,1;maxgram:8;maxgram:12;mcsd+maxgram:2,1:8:4;cascade:4:4:8;"
                   "hf-plain;hf-prompt-lookup;hf-assisted")
CORPUS = "benchmarks/prompts/train.json"  # Max-Gram's bigram corpus (disjoint from the benchmark prompts)


def parse_config(item: str) -> dict:
    """-> dict(name, kind, tree, method, config)"""
    kind, *parts = item.split(":")
    c = dict(name=item, kind=kind, tree=(), method=None, config={})
    if kind in ("plain", "hf-plain", "hf-assisted", "hf-prompt-lookup"):
        return c
    common = dict(maxgram_corpus=CORPUS)
    if kind in ("tree", "chain"):
        c.update(tree=parse_widths(parts[0]), method="mcsd")
    elif kind == "maxgram":
        c.update(method="maxgram", config=dict(common, maxgram_len=int(parts[0]) if parts else 8,
                                               maxgram_branches=int(parts[1]) if len(parts) > 1 else 1))
    elif kind == "mcsd+maxgram":
        c.update(tree=parse_widths(parts[0]), method="mcsd+maxgram",
                 config=dict(common, maxgram_len=int(parts[1]), maxgram_tail=int(parts[2])))
    elif kind == "mjsd":
        c.update(tree=(1,), method="mjsd-lossy",
                 config=dict(mjsd_beam=int(parts[0]), mjsd_depth=int(parts[1]), mjsd_tau=float(parts[2])))
    elif kind == "target-init":
        c.update(tree=(1,), method="target-init-lossy",
                 config=dict(target_init_k=int(parts[0]), target_init_depth=int(parts[1])))
    elif kind == "cascade":
        c.update(tree=(1,), method="cascade",
                 config=dict(common, cascade_depth=int(parts[0]), maxgram_tail=int(parts[1]),
                             maxgram_len=int(parts[2]) if len(parts) > 2 else 8))
    else:
        raise SystemExit(f"unknown config {item!r}")
    return c


def run_config(c, target, draft, hf_t, hf_d, ids, max_new, temperature, seed):
    if c["kind"] == "plain":
        return run_ours(target, None, ids, max_new, temperature=temperature, seed=seed)
    if c["kind"].startswith("hf-"):
        kw = {"hf-assisted": dict(assistant_model=hf_d), "hf-prompt-lookup": dict(prompt_lookup_num_tokens=10),
              "hf-plain": {}}[c["kind"]]
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=0)
            torch.manual_seed(seed)
        return run_hf(hf_t, ids, max_new, measure_ttft=True, **kw)
    uses_draft = c["method"] != "maxgram"
    return run_ours(target, draft if uses_draft else None, ids, max_new, tree=c["tree"], temperature=temperature,
                    seed=seed, spec=SpecOptions(method=c["method"]), config=c["config"])


def perplexity(target, prompts, runs) -> float:
    """exp(mean NLL) of every run's tokens after its prompt, under the target at temperature 1."""
    from engine.batching import Block, run_blocks
    cache = target.model.new_cache(1, max(len(ids) + len(r["tokens"]) for (_, ids), r in zip(prompts, runs)) + 1)
    nll, count = 0.0, 0
    for (_, ids), r in zip(prompts, runs):
        slot = cache.allocate()
        seq = ids + r["tokens"]
        rows = list(range(len(ids) - 1, len(seq) - 1))
        _, lg = run_blocks(target.model, cache, [Block(slot, seq, list(range(len(seq))), rows)])
        lp = lg[0].float().log_softmax(-1)
        nll -= float(lp[torch.arange(len(rows)), torch.tensor(r["tokens"])].sum())
        count += len(rows)
        cache.free(slot)
    return float(torch.tensor(nll / count).exp())


def by_method(runs) -> dict:
    out: dict[str, list[int]] = {}
    for r in runs:
        for m, (d, a) in r.get("by_method", {}).items():
            out.setdefault(m, [0, 0])
            out[m][0] += d
            out[m][1] += a
    return {m: dict(drafted=d, accepted=a, acceptance=a / d if d else 0.0) for m, (d, a) in out.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--prompts", default="benchmarks/prompts/bench.json")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    target, draft = load_model(args.model, dtype=args.dtype), load_model(args.draft, dtype=args.dtype)
    configs = [parse_config(item) for item in args.configs.split(";")]
    hf_t = hf_d = None
    if any(c["kind"].startswith("hf-") for c in configs):
        hf_t, hf_d = hf_model(target.path, target.model.dtype), hf_model(draft.path, draft.model.dtype)
    prompts = prompt_ids(target.tokenizer, args.prompts, args.limit)
    warm = prompts[0][1][:32]
    for c in configs:
        run_config(c, target, draft, hf_t, hf_d, warm, 4, 0.0, 0)

    rows = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        runs = {c["name"]: [] for c in configs}
        for i, (pid, ids) in enumerate(prompts):
            for c in configs:
                r = run_config(c, target, draft, hf_t, hf_d, ids, args.max_new_tokens, temperature, args.seed + i)
                runs[c["name"]].append(r)
                print(f"T={temperature} {pid} {c['name']}: {len(r['tokens']) / r['seconds']:.2f} tok/s", flush=True)
        lookup = runs.get("hf-prompt-lookup")
        for c in configs:
            row = summarise(c["name"], runs[c["name"]], runs["plain"], temperature)
            if lookup:
                row["vs_hf_lookup"] = sum(r["seconds"] for r in lookup) / sum(r["seconds"] for r in runs[c["name"]])
            row["by_method"] = by_method(runs[c["name"]])
            if temperature == 0 and (c["kind"] in ("plain", "mjsd", "target-init")):
                row["ppl"] = perplexity(target, prompts, runs[c["name"]])
            rows.append(row)

    print()
    print_table(rows, [("config", "config", "<22"), ("temperature", "T", ">4.1f"), ("tok_s", "tok/s", ">7.2f"),
                       ("speedup", "vs plain", ">8.2f"), ("vs_hf_lookup", "vs HF lookup", ">12.2f"),
                       ("decode_speedup", "decode vs plain", ">15.2f"), ("block_eff", "block eff", ">9.2f"),
                       ("acceptance", "accept", ">6.2f"), ("draft_frac", "draft time", ">10.2f"),
                       ("agreement", "greedy agree", ">12.2f"), ("ppl", "ppl", ">6.3f")])
    write_json("drafters.json", dict(args=vars(args), machine=machine(), rows=rows), args.out)


if __name__ == "__main__":
    main()
