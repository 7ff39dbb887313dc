"""Typed engine configuration, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from engine.speculative.methods import check_method
from engine.speculative.tree import parse_widths


@dataclass
class EngineConfig:
    max_batch: int = 8  # sequences decoding together
    max_model_len: int = 4096  # prompt + output tokens per sequence
    tree: tuple[int, ...] = (4, 2, 2)  # largest draft tree (width per depth); () = no speculation
    prefill_chunk: int = 512  # prompt tokens prefilled per step, so running streams keep flowing
    without_replacement: bool = True  # draw sibling candidates without replacement
    # adaptive speculation (engine.speculative.adaptive): stop drafting when 1 - prod(y_hat) > threshold on
    # every branch, within [adaptive_min_depth, adaptive_max_depth]; load-aware tree budget per step
    adaptive: bool = False
    adaptive_threshold: float = 0.5  # h of the SpecDec++ rule, in [0, 1]
    adaptive_min_depth: int = 1
    adaptive_max_depth: Optional[int] = None  # None = the tree's depth
    acceptance_heads: tuple[str, ...] = ()  # acceptance head files (one per temperature); none = online calibration
    load_aware: bool = True  # measure the cost curve at start-up and choose the budget per step
    # drafters (engine.speculative.methods): the method requests get when they do not name one, and its knobs
    spec_method: str = "mcsd"
    maxgram_len: int = 8  # most tokens a Max-Gram proposal from the root holds
    maxgram_branches: int = 1  # Max-Gram proposals (distinct first tokens) from the root
    maxgram_max_ngram: int = 4  # longest suffix tried
    maxgram_min_ngram: int = 1  # shortest suffix accepted as a match
    maxgram_corpus: Optional[str] = None  # text / prompts JSON for the bigram fallback; None = no bigrams
    maxgram_tail: int = 4  # horizontal cascade: Max-Gram tokens after the deepest drafted path
    cascade_depth: int = 4  # vertical cascade: tokens the draft model writes reviewing Max-Gram's guesses
    maxgram_trust: int = 3  # a suffix match this long skips the draft model for the step (0 = never)
    mjsd_beam: int = 4  # MJSD (lossy): draft beam width
    mjsd_depth: int = 4  # MJSD: tokens per step
    mjsd_tau: float = 0.5  # MJSD: accept while the cumulative log p/q stays above log tau
    target_init_k: int = 3  # target-initialised (lossy): candidate roots per step
    target_init_depth: int = 3  # target-initialised: tokens per candidate, itself included
    # the draft's output layer cut to its most frequent tokens (lossless; engine.models.vocab); 0 = whole vocabulary
    draft_vocab: int = 0
    draft_vocab_file: Optional[str] = None  # token ranking (most frequent first) the cut reads
    draft_int8: bool = False  # the draft's linears in Q8_0 blocks, int8 per 32 weights (lossless; CPU; engine.models.qweight)

    def __post_init__(self) -> None:
        self.tree = parse_widths(self.tree)
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        self._validate_adaptive()
        self._validate_drafters()

    def _validate_drafters(self) -> None:
        check_method(self.spec_method)
        for name in ("maxgram_len", "maxgram_branches", "maxgram_max_ngram", "maxgram_min_ngram"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.maxgram_min_ngram > self.maxgram_max_ngram:
            raise ValueError(f"maxgram_min_ngram {self.maxgram_min_ngram} > maxgram_max_ngram {self.maxgram_max_ngram}")
        if self.maxgram_tail < 0 or self.cascade_depth < 0 or self.maxgram_trust < 0:
            raise ValueError("maxgram_tail, cascade_depth and maxgram_trust must be >= 0")
        if self.mjsd_beam < 1 or self.mjsd_depth < 1 or not 0.0 < self.mjsd_tau <= 1.0:
            raise ValueError(f"MJSD needs mjsd_beam >= 1, mjsd_depth >= 1 and 0 < mjsd_tau <= 1, got "
                             f"{self.mjsd_beam}, {self.mjsd_depth}, {self.mjsd_tau}")
        if self.target_init_k < 1 or self.target_init_depth < 1:
            raise ValueError(f"target_init_k and target_init_depth must be >= 1, got {self.target_init_k}, "
                             f"{self.target_init_depth}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0 = the whole vocabulary), got {self.draft_vocab}")
        if self.draft_vocab and (self.draft_vocab_file is None or not Path(self.draft_vocab_file).is_file()):
            raise ValueError(f"draft_vocab {self.draft_vocab} needs a token ranking file (draft_vocab_file), "
                             f"got {self.draft_vocab_file!r}")
        if self.maxgram_corpus is not None and not Path(self.maxgram_corpus).is_file():
            raise ValueError(f"maxgram_corpus {self.maxgram_corpus} does not exist")

    def _validate_adaptive(self) -> None:
        if isinstance(self.acceptance_heads, (str, Path)):
            self.acceptance_heads = (str(self.acceptance_heads),)
        self.acceptance_heads = tuple(str(p) for p in self.acceptance_heads)
        if not self.adaptive:
            return
        if not self.tree:
            raise ValueError("adaptive speculation needs a draft tree (tree is empty)")
        if not 0.0 <= self.adaptive_threshold <= 1.0:
            raise ValueError(f"adaptive_threshold must be in [0, 1], got {self.adaptive_threshold}")
        if self.adaptive_max_depth is None:
            self.adaptive_max_depth = len(self.tree)
        if not 1 <= self.adaptive_min_depth <= self.adaptive_max_depth:
            raise ValueError(f"adaptive_min_depth must be in [1, adaptive_max_depth={self.adaptive_max_depth}], "
                             f"got {self.adaptive_min_depth}")
        if self.adaptive_max_depth > len(self.tree):
            raise ValueError(f"adaptive_max_depth {self.adaptive_max_depth} is deeper than the tree "
                             f"{list(self.tree)} ({len(self.tree)} levels)")
        for p in self.acceptance_heads:
            if not Path(p).is_file():
                raise ValueError(f"acceptance head file {p} does not exist")

    @property
    def max_depth(self) -> int:
        return len(self.tree)
