"""What a grammar costs per token on Qwen2.5's 151,936-token vocabulary: xgrammar (the engine's) beside
llguidance, and the engine's own per-step work under a grammar.

For each JSON document (the valid outputs ``bench_structured.py`` wrote, or a built-in sample) and its
schema, each engine compiles the schema, then walks the document's tokens filling the allowed-token
bitmask before each one.  Reported: tokenizer setup, compile time, and the mask fill's median, p99 and
worst time per token.  Then the engine's step: ``GrammarState.tree_masks`` for a draft tree of the
default preset's size (seven nodes: a chain of four and a second branch), the bitmask unpacked and
the logits masked, at each position of the documents.

    .venv/bin/pip install llguidance          # optional: the comparison (the engine does not need it)
    .venv/bin/python benchmarks/bench_grammar.py [--results benchmarks/results/structured.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.harness import machine, print_table, write_json  # noqa: E402

VOCAB = 151936
STOPS = [151645, 151643]
SAMPLE = [({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                             "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
            "required": ["name", "age", "tags"], "additionalProperties": False},
           '{"name": "Alice Smith", "age": 31, "tags": ["a", "bb", "ccc"]}')]


def tokenizer(pack: str):
    from transformers import AutoTokenizer

    from engine.models.fetch import fetch_pack
    from engine.models.loader import gguf_meta

    gguf = Path(fetch_pack(pack, progress=False))
    return AutoTokenizer.from_pretrained(gguf_meta(gguf, gguf.parents[2]))


def documents(results: Path) -> list[tuple[dict, str]]:
    """(schema, document) pairs: the valid outputs of a ``bench_structured.py`` run, else the sample."""
    if not results.is_file():
        return SAMPLE
    from benchmarks.bench_structured import schemas

    data = json.loads(results.read_text())
    outs = data["outputs"].get("ours spec on", [])
    pairs = []
    for item, out in zip(schemas(), outs):
        try:
            json.loads(out["text"])
        except ValueError:
            continue
        if out["finish"] == "stop":
            pairs.append((item["schema"], out["text"]))
    return pairs or SAMPLE


def stats(times: list[float]) -> dict:
    times = sorted(times)
    return dict(median_us=1e6 * statistics.median(times), p99_us=1e6 * times[int(0.99 * (len(times) - 1))],
                max_us=1e6 * times[-1], tokens=len(times))


def xgrammar_run(tok, docs) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=STOPS)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t0
    fills, compiles = [], []
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    for schema, text in docs:
        t0 = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=True,
                                                                  max_whitespace_cnt=8))
        compiles.append(time.perf_counter() - t0)
        for t in tok.encode(text, add_special_tokens=False):
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            fills.append(time.perf_counter() - t0)
            if not matcher.accept_token(t):
                break
    return dict(engine="xgrammar", setup_s=setup, compile_ms=1e3 * statistics.median(compiles), **stats(fills))


def llguidance_run(tok, docs) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    t0 = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
    setup = time.perf_counter() - t0
    fills, compiles = [], []
    bitmask = llt.allocate_token_bitmask(1, VOCAB)
    for schema, text in docs:
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                defaults={"whitespace_flexible": True})
        matcher = llguidance.LLMatcher(ltok, grammar)
        compiles.append(time.perf_counter() - t0)
        for t in tok.encode(text, add_special_tokens=False):
            t0 = time.perf_counter()
            llt.fill_next_token_bitmask(matcher, bitmask, 0)
            fills.append(time.perf_counter() - t0)
            if not matcher.consume_token(t):
                break
    return dict(engine="llguidance", setup_s=setup, compile_ms=1e3 * statistics.median(compiles), **stats(fills))


def engine_step_run(tok, docs) -> dict:
    """The engine's host and mask work for one constrained step: a tree of seven nodes (8 rows), its masks
    filled, then unpacked and applied to [8, vocab] logits."""
    from engine.grammar import Grammars, GrammarSpec, GrammarState, apply_mask, unpack

    grammars = Grammars(tok, VOCAB, STOPS)
    masks_t, apply_t = [], []
    logits = torch.randn(8, VOCAB)
    for schema, text in docs:
        state = GrammarState(grammars.compile(GrammarSpec.json_schema(schema)))
        ids = tok.encode(text, add_special_tokens=False)
        for i in range(len(ids) - 5):
            a, b, c, d, e = ids[i: i + 5]
            # the document's next four tokens as a chain, and a second root child (e) with two nodes below
            tokens, parents = [a, e, b, c, d, b, c], [-1, -1, 0, 2, 3, 1, 5]
            t0 = time.perf_counter()
            m = state.tree_masks(tokens, parents)
            t1 = time.perf_counter()
            apply_mask(logits, unpack(m.bitmask, VOCAB))
            t2 = time.perf_counter()
            masks_t.append(t1 - t0)
            apply_t.append(t2 - t1)
            state.commit([a])
    return dict(engine="engine step (8 rows)", masks_ms=1e3 * statistics.median(masks_t),
                apply_ms=1e3 * statistics.median(apply_t), steps=len(masks_t))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", default="qwen2.5-coder-0.5b-instruct", help="the tokenizer's pack (Qwen2.5's)")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/structured.json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tok = tokenizer(args.pack)
    docs = documents(args.results)
    print(f"{len(docs)} documents, {sum(len(tok.encode(t)) for _, t in docs)} tokens", flush=True)
    rows = [xgrammar_run(tok, docs)]
    try:
        rows.append(llguidance_run(tok, docs))
    except ImportError:
        print("llguidance is not installed: no comparison (pip install llguidance)")
    print_table(rows, [("engine", "engine", "s"), ("setup_s", "tokenizer setup s", ".2f"),
                       ("compile_ms", "compile ms (median)", ".1f"), ("median_us", "mask median us", ".0f"),
                       ("p99_us", "p99 us", ".0f"), ("max_us", "max us", ".0f"), ("tokens", "tokens", "d")])
    step = engine_step_run(tok, docs)
    print(f"\nengine step under a grammar, 8 tree rows: masks {step['masks_ms']:.2f} ms, move+unpack+apply "
          f"{step['apply_ms']:.2f} ms (median of {step['steps']} steps)")
    write_json("grammar.json", dict(machine=machine(), documents=len(docs), engines=rows, step=step), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
