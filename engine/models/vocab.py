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

from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

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
            self.weight = lm_head.select(kept)
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
