"""Typed engine configuration, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from engine.speculative.methods import check_method, method_names
from engine.speculative.tree import parse_widths


def setting(default, help: str, *, server: bool = True, **bounds):  # noqa: A002 - the field's help text
    """An :class:`EngineConfig` field with its help text and bounds (``ge``, ``gt``, ``le``, ``lt``,
    ``choices``: a collection, or a function returning one): the one declaration the server's settings,
    flags and environment variables are generated from (``server.settings``).  ``server=False`` keeps a
    field out of the server's settings."""
    return field(default=default, metadata={"help": help, "server": server, **bounds})


@dataclass
class EngineConfig:
    """Everything the engine is configured with; each field also is a server setting (``--flag``,
    ``MCSD_FLAG``, a preset key) unless marked otherwise."""

    max_batch: int = setting(8, "sequences decoding together", ge=1)
    max_model_len: int = setting(4096, "context length, prompt + output (capped by the model's)", ge=2)
    tree: tuple[int, ...] = setting((4, 2, 2), "largest draft tree, widths per depth, e.g. 4,2,2 (empty: no "
                                    "speculation)")
    prefill_chunk: int = setting(512, "prompt tokens prefilled per step, so running streams keep flowing", ge=1)
    kv_cache_tokens: int = setting(0, "KV cache pool per model, in tokens (0: room for max_batch sequences of "
                                   "max_model_len each); sequences take blocks as they grow, and when the pool "
                                   "runs out the newest are preempted and recomputed later", ge=0)
    kv_block_size: int = setting(4, "positions per KV cache block: the unit of paging and of prefix sharing "
                                 "(small blocks reuse more of a prompt; the attention reads rows, so their "
                                 "size costs it nothing)", ge=1, le=1024)
    prefix_cache: bool = setting(True, "a new request reuses the cached keys and values of the longest prefix of "
                                 "its prompt that a finished or running sequence holds (chat turns, shared "
                                 "system prompts)")
    batch_invariant: bool = setting(True, "CPU: every linear and the attention compute each row alone, so a "
                                    "request's output does not depend on the rest of the batch (off: torch's "
                                    "kernels where they are faster)")
    without_replacement: bool = setting(True, "draw sibling candidates without replacement", server=False)
    # adaptive speculation (engine.speculative.adaptive)
    adaptive: bool = setting(False, "adapt tree depth per step (SpecDec++ threshold) and the budget to load")
    adaptive_threshold: float = setting(0.5, "stop drafting when 1 - prod(p_accept) > h", ge=0.0, le=1.0)
    adaptive_min_depth: int = setting(1, "adaptive: always draft at least this deep", ge=1)
    adaptive_max_depth: Optional[int] = setting(None, "adaptive: never deeper than this (default: the tree's)", ge=1)
    acceptance_heads: tuple[str, ...] = setting((), "trained acceptance head files, comma separated (one per "
                                                "temperature); none = online calibration")
    load_aware: bool = setting(True, "measure the cost curve at start-up and choose the budget per step")
    cost_model_cache: bool = setting(True, "load_aware: reuse the cost curves an earlier start measured on this "
                                     "machine for the same models, kernels and settings ($MCSD_CACHE/cost-model); "
                                     "off: measure at every start (and store the new curves)")
    # drafters (engine.speculative.methods): the method requests get when they do not name one, and its knobs
    spec_method: str = setting("mcsd", "drafter for requests that do not say", choices=method_names)
    maxgram_len: int = setting(8, "most tokens per Max-Gram proposal from the root", ge=1, le=64)
    maxgram_branches: int = setting(1, "Max-Gram proposals (distinct first tokens) per step", ge=1, le=8)
    maxgram_max_ngram: int = setting(4, "longest suffix Max-Gram tries", ge=1, le=16)
    maxgram_min_ngram: int = setting(1, "shortest suffix Max-Gram accepts as a match", ge=1, le=16)
    maxgram_corpus: Optional[str] = setting(None, "text or prompts JSON for Max-Gram's bigram fallback")
    maxgram_tail: int = setting(4, "Max-Gram tokens after the deepest drafted path (horizontal cascade)", ge=0, le=64)
    cascade_depth: int = setting(4, "tokens the draft writes reviewing Max-Gram (cascade)", ge=0, le=64)
    maxgram_trust: int = setting(3, "a suffix match this long skips the draft model for the step (0 = never)",
                                 ge=0, le=64)
    mjsd_beam: int = setting(4, "MJSD (lossy, opt-in): draft beam width", ge=1, le=16)
    mjsd_depth: int = setting(4, "MJSD: tokens drafted per step", ge=1, le=32)
    mjsd_tau: float = setting(0.5, "MJSD: joint likelihood-ratio threshold", gt=0.0, le=1.0)
    target_init_k: int = setting(3, "target-initialised (lossy, opt-in): candidate roots", ge=1, le=16)
    target_init_depth: int = setting(3, "target-initialised: tokens per candidate chain", ge=1, le=32)
    draft_vocab: int = setting(0, "draft output layer cut to this many most frequent tokens (lossless; 0 = whole "
                               "vocabulary)", ge=0)
    draft_vocab_file: Optional[str] = setting(None, "token ranking the cut reads (python -m tools.rank_vocab)")
    draft_int8: bool = setting(False, "draft model's linears in Q8_0 blocks, int8 per 32 weights (lossless: only "
                               "the draft changes; CPU only)")

    def __post_init__(self) -> None:
        self.tree = parse_widths(self.tree)
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_tokens < 0 or self.kv_block_size < 1:
            raise ValueError(f"kv_cache_tokens must be >= 0 and kv_block_size >= 1, got {self.kv_cache_tokens}, "
                             f"{self.kv_block_size}")
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
