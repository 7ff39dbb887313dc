"""Rank a tokenizer's tokens by frequency in ShareGPT answers and a prompts file: the ranking file the
draft's restricted output layer reads (``EngineConfig.draft_vocab`` / ``--draft-vocab``, see
``engine.models.vocab``).  Offline: ``python -m tools.rank_vocab --tokenizer NAME --out FILE``.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Optional

from tqdm import tqdm

from tools.prompts import iter_json_array, load_prompts_file
from engine.models.vocab import save_token_ranking


def rank_tokens(tokenizer, texts: Iterable[str]) -> list[int]:
    """Token ids of ``texts`` by count, most frequent first (ties: lower id first)."""
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def sharegpt_responses(path: str | Path, records: int, exclude: set[str]) -> Iterator[str]:
    """The assistant turns of the first ``records`` ShareGPT conversations whose id is not in ``exclude``."""
    for index, record in enumerate(iter_json_array(path)):
        if index >= records:
            return
        if not isinstance(record, dict) or str(record.get("id", index)) in exclude:
            continue
        for turn in record.get("conversations") or ():
            if isinstance(turn, dict) and turn.get("from") == "gpt" and isinstance(turn.get("value"), str):
                yield turn["value"]


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.rank_vocab",
        description="Rank a tokenizer's tokens by frequency in ShareGPT answers and a prompts file, for "
                    "the draft's restricted output layer (EngineConfig.draft_vocab / --draft-vocab).")
    parser.add_argument("--tokenizer", required=True, help="model whose tokenizer to use (pack name, HF dir)")
    parser.add_argument("--out", required=True, help="ranking file to write (.safetensors)")
    parser.add_argument("--records", type=int, default=20000, help="ShareGPT conversations read")
    parser.add_argument("--prompts", default="benchmarks/prompts/train.json",
                        help="a prompts file whose texts are counted too (HumanEval-style code)")
    parser.add_argument("--exclude", default="benchmarks/prompts/bench.json",
                        help="prompts file whose ShareGPT conversations are left out (the benchmark's)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from engine.models.fetch import default_cache_dir, fetch_dataset
    from engine.models.loader import resolve_source
    tokenizer = AutoTokenizer.from_pretrained(resolve_source(args.tokenizer, default_cache_dir()))
    exclude = {p.id.split("/", 1)[1] for p in load_prompts_file(args.exclude)
               if p.id.startswith("sharegpt/")}
    texts = list(sharegpt_responses(fetch_dataset("sharegpt"), args.records, exclude))
    texts += [m["content"] for p in load_prompts_file(args.prompts) for m in p.messages]
    ranked = rank_tokens(tokenizer, tqdm(texts, desc="counting tokens", unit="text"))
    save_token_ranking(args.out, ranked, {
        "tokenizer": args.tokenizer, "vocab_size": str(len(tokenizer)),
        "corpus": f"ShareGPT assistant turns of the first {args.records} conversations (benchmark's excluded) "
                  f"+ {args.prompts}",
        "texts": str(len(texts)),
        "command": "python -m tools.rank_vocab " + " ".join(argv if argv is not None else sys.argv[1:]),
    })
    print(f"wrote {args.out}: {len(ranked)} distinct tokens ranked from {len(texts)} texts")


if __name__ == "__main__":
    main()
