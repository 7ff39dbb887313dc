"""Typed engine configuration, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from engine.spec.tree import parse_widths


@dataclass
class EngineConfig:
    max_batch: int = 8  # sequences decoding together
    max_model_len: int = 4096  # prompt + output tokens per sequence
    tree: tuple[int, ...] = (4, 2, 2)  # largest draft tree (width per depth); () = no speculation
    prefill_chunk: int = 512  # prompt tokens prefilled per step, so running streams keep flowing
    without_replacement: bool = True  # draw sibling candidates without replacement
    spec_enabled: bool = True  # default for requests that do not say

    def __post_init__(self) -> None:
        self.tree = parse_widths(self.tree)
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")

    @property
    def max_depth(self) -> int:
        return len(self.tree)
