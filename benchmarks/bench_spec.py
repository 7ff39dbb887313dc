"""MCSD vs plain decoding vs ``transformers`` assisted generation (issue: MCSD engine, item 7).

One interleaved run: for every prompt, every configuration runs back to back (same prompt, same
machine state), so ratios are comparable even on a noisy machine.  Batch 1, exactly N new tokens.

    .venv/bin/python benchmarks/bench_spec.py --limit 4 --temperatures 0,0.7

Columns: tokens/s end to end and after the first token (decode: excludes the prefill, which on CPUs
without native bf16 dominates ``transformers``' time); speedup over our plain decoding (ratio of
summed times over the same prompts);
block efficiency = 1 + accepted/steps (tokens per target forward); acceptance = accepted/drafted;
agreement = fraction of prompts whose greedy output equals plain decoding token for token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    hf_model, machine, print_table, prompt_ids, run_hf, run_ours, write_json,
)
from engine.models.loader import load_model  # noqa: E402
from engine.request import SpecOptions  # noqa: E402
from engine.speculative.tree import parse_widths  # noqa: E402

DEFAULT_CONFIGS = "plain;chain:1,1;chain:1,1,1;chain:1,1,1,1;tree:2,1,1;tree:3,2,1;tree:4,2,2;tree:2,2,1,1;hf-assisted"


CORPUS = "benchmarks/prompts/train.json"  # Max-Gram's bigram corpus, as in the default preset
MAXGRAM = dict(maxgram_len=8, maxgram_tail=2, maxgram_corpus=CORPUS)  # the default preset's Max-Gram knobs
DRAFT_VOCAB_FILE = "configs/draft_vocab/qwen2.5.safetensors"  # token ranking for the :vN configs


def parse_configs(spec: str) -> list[dict]:
    """``;``-separated items -> dicts (name, kind, tree, method, adaptive, heads, config):

    plain, hf-assisted, hf-plain          as named
    chain:W / tree:W                      fixed MCSD tree of widths W
    tree+maxgram:W                        fixed draft tree W + Max-Gram branch and tail (method mcsd+maxgram)
    adaptive:W[:heads][:hX]               adaptive MCSD inside the largest tree W (online calibration, or the
                                          ``--heads`` acceptance heads; ``hX``: threshold h = X)
    ...:vN                                any drafting config with the draft's output layer cut to the N most
                                          frequent tokens (``configs/draft_vocab/qwen2.5.safetensors``)
    ...:q8                                any drafting config with the draft's weights in int8 (draft_int8)
    adaptive+maxgram:W[:heads]            the same with Max-Gram (the default preset's engine)
    ...+maxgram:W:tN                      Max-Gram's tail below the deepest drafted path at most N tokens
                                          (default 2; t0: its branches from the root only)
    ...+maxgram:W:u                       Max-Gram without reading the draft's tree (maxgram_read_tree =
                                          false, the GPU preset's): unmerged branches, its tail proposed
                                          on the device (``:u:t0``: no tail)
    adaptive...:W:ns                      no level-by-level stop inside the step (adaptive_level_stop =
                                          false, the GPU preset's): the budget's planned depth stands
    cascade[:D][:u]                       the vertical cascade: D draft-reviewed tokens (default 4), then
                                          Max-Gram's tail; ``:u``: its review rounds on the device, one
                                          read a step (maxgram_read_tree = false)
    """
    out = []
    for item in spec.split(";"):
        kind, *parts = item.split(":")
        c = dict(name=item.replace(":", " "), kind=kind, tree=(), method="mcsd", adaptive=False, heads=False,
                 config={})
        if kind in ("plain", "hf-assisted", "hf-plain"):
            c["method"] = None
        elif kind == "cascade":
            depth = [int(x) for x in parts if x.isdigit()]
            if len(parts) != len(depth) + parts.count("u") or len(depth) > 1 or parts.count("u") > 1:
                raise SystemExit(f"unknown config {item!r}")
            c.update(method="cascade", tree=(1,), config={**MAXGRAM, "cascade_depth": depth[0] if depth else 4,
                                                          "maxgram_read_tree": "u" not in parts, "load_aware": False})
        elif kind in ("chain", "tree", "tree+maxgram", "adaptive", "adaptive+maxgram") and parts:
            c["tree"] = parse_widths(parts[0])
            c["adaptive"] = kind.startswith("adaptive")
            extra = parts[1:]
            c["heads"] = "heads" in extra
            hs = [x for x in extra if x.startswith("h") and x != "heads"]
            if hs:
                c["config"]["adaptive_threshold"] = float(hs[0][1:])
            vs = [x for x in extra if x.startswith("v") and x[1:].isdigit()]
            if vs:
                c["config"].update(draft_vocab=int(vs[0][1:]), draft_vocab_file=DRAFT_VOCAB_FILE)
            q8 = extra.count("q8")
            if q8:
                c["config"]["draft_int8"] = True
            ts = [x for x in extra if x.startswith("t") and x[1:].isdigit()]
            unread = extra.count("u")
            no_stop = extra.count("ns")
            if (len(extra) != c["heads"] + len(hs) + len(vs) + q8 + len(ts) + unread + no_stop or len(hs) > 1
                    or len(vs) > 1 or q8 > 1 or len(ts) > 1 or unread > 1 or no_stop > 1
                    or ((c["heads"] or hs or no_stop) and not c["adaptive"])
                    or ((ts or unread) and not kind.endswith("+maxgram"))):
                raise SystemExit(f"unknown config {item!r}")
            if no_stop:
                c["config"]["adaptive_level_stop"] = False
            if kind.endswith("+maxgram"):
                c.update(method="mcsd+maxgram", config={**MAXGRAM, **c["config"]})
                if ts:
                    c["config"]["maxgram_tail"] = int(ts[0][1:])
                if unread:
                    c["config"]["maxgram_read_tree"] = False
            if not c["adaptive"]:
                c["config"]["load_aware"] = False  # fixed: no load-aware caps on Max-Gram either
        else:
            raise SystemExit(f"unknown config {item!r}")
        out.append(c)
    return out


def adaptive_core(target, draft, c: dict, heads=()):
    """One engine per adaptive config, reused over prompts: the online calibrator keeps what it learnt, as
    in a running server (the cost model is measured once, at creation)."""
    from engine.config import EngineConfig
    from engine.core import EngineCore
    config = EngineConfig.from_settings(max_batch=1, max_model_len=4096, tree=c["tree"], adaptive=True,
                                        acceptance_heads=tuple(heads) if c["heads"] else (),
                                        spec_method=c["method"], **c["config"])
    return EngineCore(target, draft, config)


def run_config(c, target, draft, hf_t, hf_d, ids, max_new, temperature, seed, cores=None):
    if c["kind"] == "plain":
        return run_ours(target, None, ids, max_new, temperature=temperature, seed=seed)
    if c["kind"].startswith("hf-"):
        kw = dict(assistant_model=hf_d) if c["kind"] == "hf-assisted" else {}
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=0)
            torch.manual_seed(seed)
        return run_hf(hf_t, ids, max_new, measure_ttft=True, **kw)
    core = (cores or {}).get(c["name"])
    return run_ours(target, draft, ids, max_new, tree=c["tree"], temperature=temperature, seed=seed, core=core,
                    spec=SpecOptions(method=c["method"]), config=c["config"])


def summarise(name, runs, plain_runs, temperature) -> dict:
    secs = sum(r["seconds"] for r in runs)
    toks = sum(len(r["tokens"]) for r in runs)
    decode_secs = sum(r["seconds"] - r["ttft"] for r in runs)
    plain_decode = sum(r["seconds"] - r["ttft"] for r in plain_runs)
    row = dict(config=name, temperature=temperature, tok_s=toks / secs,
               speedup=sum(r["seconds"] for r in plain_runs) / secs,
               decode_tok_s=(toks - len(runs)) / decode_secs, decode_speedup=plain_decode / decode_secs)
    steps = sum(r.get("steps", 0) for r in runs)
    if steps:
        acc, drafted = sum(r["accepted"] for r in runs), sum(r["drafted"] for r in runs)
        row.update(block_eff=1 + acc / steps, acceptance=acc / drafted if drafted else 0.0,
                   draft_frac=sum(r["draft_seconds"] for r in runs) / secs)
    if temperature == 0:
        row["agreement"] = sum(r["tokens"] == p["tokens"] for r, p in zip(runs, plain_runs)) / len(runs)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--prompts", default="benchmarks/prompts/bench.json")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--source", help="only the prompts whose id starts with this (HumanEval: code, sharegpt: chat)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--gguf-weights", default="native", choices=["native", "dequantize"],
                    help="GGUF models in their own blocks (the server's preset) or dequantized to --dtype")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="';'-separated, see parse_configs: plain, chain:W, tree:W, tree+maxgram:W, adaptive:W[:heads], "
                         "adaptive+maxgram:W[:heads], cascade[:D][:u], hf-assisted, hf-plain")
    ap.add_argument("--heads", default="", help="acceptance head files for adaptive configs, comma separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    target = load_model(args.model, dtype=args.dtype, gguf_weights=args.gguf_weights)
    draft = load_model(args.draft, dtype=args.dtype, gguf_weights=args.gguf_weights)
    configs = parse_configs(args.configs)
    hf_t = hf_d = None
    if any(c["kind"].startswith("hf-") for c in configs):
        hf_t, hf_d = hf_model(target.path, target.model.dtype), hf_model(draft.path, draft.model.dtype)
    prompts = prompt_ids(target.tokenizer, args.prompts, None if args.source else args.limit)
    if args.source:
        prompts = [p for p in prompts if p[0].startswith(args.source)][: args.limit]
    heads = [h for h in args.heads.split(",") if h]
    if any(c["heads"] for c in configs) and not heads:
        raise SystemExit("a ':heads' config needs --heads")
    cores = {c["name"]: adaptive_core(target, draft, c, heads) for c in configs if c["adaptive"]}
    warm = prompts[0][1][:32]
    for c in configs:
        run_config(c, target, draft, hf_t, hf_d, warm, 4, 0.0, 0, cores)

    rows = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        runs = {c["name"]: [] for c in configs}
        for i, (pid, ids) in enumerate(prompts):
            for c in configs:
                r = run_config(c, target, draft, hf_t, hf_d, ids, args.max_new_tokens, temperature,
                               args.seed + i, cores)
                runs[c["name"]].append(r)
                print(f"T={temperature} {pid} {c['name']}: {len(r['tokens']) / r['seconds']:.2f} tok/s", flush=True)
        rows += [summarise(c["name"], runs[c["name"]], runs["plain"], temperature) for c in configs]

    print()
    print_table(rows, [("config", "config", "<16"), ("temperature", "T", ">4.1f"), ("tok_s", "tok/s", ">7.2f"),
                       ("speedup", "vs plain", ">8.2f"), ("decode_tok_s", "decode tok/s", ">12.2f"),
                       ("decode_speedup", "decode vs plain", ">15.2f"), ("block_eff", "block eff", ">9.2f"),
                       ("acceptance", "accept", ">6.2f"), ("draft_frac", "draft time", ">10.2f"),
                       ("agreement", "greedy agree", ">12.2f")])
    write_json("spec.json", dict(args=vars(args), machine=machine(), rows=rows), args.out)


if __name__ == "__main__":
    main()
