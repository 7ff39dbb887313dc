"""A model's output layer restricted to a subset of the vocabulary (for drafts; FR-Spec's idea).

A small draft model over a large vocabulary spends a good part of each forward in its output
projection: Qwen2.5-0.5B's lm_head is 136M of its 494M weights.  Most of those rows are tokens the
target almost never writes.  :class:`OutputVocab` keeps the rows of the ``size`` most frequent tokens
(plus every special token), projects onto those only and scatters the result into full-vocabulary
logits with ``-inf`` elsewhere.

This is lossless for speculative decoding: the draft's distribution ``q`` simply has zeros outside
the subset, and verification uses exactly that ``q`` (greedy verification only compares tokens).  What
it costs is acceptance: a position whose target token is outside the subset cannot be drafted.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engine.data import iter_json_array, load_prompts_file
from engine.models.cpu_kernels import linear
from engine.models.qweight import QuantWeight


class OutputVocab:
    def __init__(self, ids: Iterable[int], vocab_size: int, lm_head: Optional[torch.Tensor] = None) -> None:
        """ids: the tokens kept (any order); lm_head: [vocab, hidden] the model's output weight (a model
        without one, e.g. the tests' table-driven toys, applies :meth:`restrict` to its own logits)."""
        kept = torch.tensor(sorted({int(i) for i in ids}), dtype=torch.long)
        if kept.numel() == 0 or int(kept[0]) < 0 or int(kept[-1]) >= vocab_size:
            raise ValueError(f"output vocabulary ids must be a non-empty subset of [0, {vocab_size})")
        if lm_head is not None and lm_head.shape[0] != vocab_size:
            raise ValueError(f"lm_head has {lm_head.shape[0]} rows, the vocabulary {vocab_size}")
        self.vocab_size = vocab_size
        if isinstance(lm_head, QuantWeight):  # an output layer in GGUF blocks: keep the rows' blocks
            self.ids = kept
            self.weight = QuantWeight(lm_head.data.index_select(0, kept), lm_head.type_id, lm_head.k)
            return
        self.ids = kept if lm_head is None else kept.to(lm_head.device)
        self.weight = None if lm_head is None else lm_head.index_select(0, self.ids).contiguous()  # [kept, hidden]

    @property
    def size(self) -> int:
        return self.ids.numel()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., vocab] float32 logits, ``-inf`` outside the kept tokens."""
        return self._scatter(linear(hidden, self.weight).float())

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits with ``-inf`` outside the kept tokens (float32)."""
        return self._scatter(logits.index_select(-1, self.ids.to(logits.device)).float())

    def _scatter(self, part: torch.Tensor) -> torch.Tensor:
        out = part.new_full((*part.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids.to(part.device), part)


# --------------------------------------------------------------------------- frequency files
def save_token_ranking(path: str | Path, ranked_ids: list[int], metadata: dict[str, str]) -> None:
    """Writes token ids, most frequent first (int32), with string metadata (corpus, tokenizer, ...)."""
    save_file({"ranked_ids": torch.tensor(ranked_ids, dtype=torch.int32)}, str(path), metadata=metadata)


def load_token_ranking(path: str | Path) -> tuple[list[int], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("ranked_ids").tolist(), dict(f.metadata() or {})


def frequent_vocab(path: str | Path, size: int, vocab_size: int, always: Iterable[int] = ()) -> list[int]:
    """The ``size`` most frequent tokens of a ranking file that exist in a ``vocab_size`` vocabulary,
    plus ``always`` (special tokens: end of turn, end of text, ...)."""
    ranked, meta = load_token_ranking(path)
    if meta.get("vocab_size") and int(meta["vocab_size"]) > vocab_size:
        raise ValueError(f"token ranking {path} is for a vocabulary of {meta['vocab_size']} tokens, "
                         f"the draft has {vocab_size}")
    kept = [i for i in ranked if 0 <= i < vocab_size][:size]
    if len(kept) < size:  # the corpus did not see enough distinct tokens: fill with the lowest unseen ids
        seen = set(kept)
        kept += [i for i in range(vocab_size) if i not in seen][: size - len(kept)]
    return sorted(set(kept) | {int(i) for i in always if 0 <= int(i) < vocab_size})


# --------------------------------------------------------------------------- building a ranking
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
        prog="python -m engine.models.vocab",
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
        "command": "python -m engine.models.vocab " + " ".join(argv if argv is not None else sys.argv[1:]),
    })
    print(f"wrote {args.out}: {len(ranked)} distinct tokens ranked from {len(texts)} texts")


if __name__ == "__main__":
    main()
