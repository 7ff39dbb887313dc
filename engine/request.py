"""Data contracts between the HTTP layer, the engine and its stages.

Everything a request asks for is validated here, once, with clear ``ValueError``s; the engine
trusts these objects afterwards.  The server translates OpenAI fields into these dataclasses and
turns :class:`RequestOutput` objects back into OpenAI responses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from engine.grammar import CompiledGrammar
from engine.registry import check_method

#: a temperature at or below this is treated as greedy (argmax) decoding
GREEDY_EPS = 1e-5


class RequestRejected(ValueError):
    """A request the engine cannot run as asked; ``param`` names the API field to blame, ``code`` the
    kind of refusal (OpenAI's ``context_length_exceeded``; ``token_id_out_of_range`` and
    ``speculation_does_not_fit`` for the served model's vocabulary and draft tree)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class SamplingParams:
    """How one request turns logits into tokens (OpenAI / vLLM semantics).

    Order of application (see ``engine.sampler``): logit_bias -> repetition penalty ->
    presence/frequency penalties -> temperature -> top-k -> top-p -> min-p.
    ``temperature == 0`` means greedy; the probability vector is then one-hot on the argmax.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: Optional[int] = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # number of top logprobs to return per token; None = off

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_EPS

    @property
    def needs_history(self) -> bool:
        """True when logits depend on tokens generated so far (penalties)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        def finite(name: str, v: float) -> None:
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            finite(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok!r}")
            finite("logit_bias value", bias)
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass
class SpecOptions:
    """Per-request speculation settings (the ``speculative`` extension field)."""

    enabled: bool = True
    max_depth: Optional[int] = None  # cap on drafted depth; None = engine default
    tree: Optional[tuple[int, ...]] = None  # width per depth; None = engine default
    method: Optional[str] = None  # engine.speculative.methods; None = the engine's default
    adaptive: Optional[bool] = None  # False: this request drafts its whole tree every step (no adaptive
    # depth, load-aware budget or length caps); None = the engine's setting

    def __post_init__(self) -> None:
        if self.method is not None:
            check_method(self.method)
        if self.max_depth is not None and self.max_depth < 0:
            raise ValueError(f"speculative.max_depth must be >= 0, got {self.max_depth}")
        if self.tree is not None:
            self.tree = tuple(int(k) for k in self.tree)
            if any(k < 1 for k in self.tree):
                raise ValueError(f"speculative.tree widths must be >= 1, got {list(self.tree)}")


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    spec: SpecOptions = field(default_factory=SpecOptions)
    grammar: Optional[CompiledGrammar] = None  # structured output: what the output must match (engine.grammar)


@dataclass
class SpecUsage:
    """Per-request speculation accounting, reported in ``usage`` of the response."""

    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    note: Optional[str] = None  # why speculation did not run for this request, when it did not

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """A delta for one request: the tokens (and text) produced since the previous delta."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    logprobs: Optional[list[TokenLogprob]] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    completion_tokens: int = 0
    spec: SpecUsage = field(default_factory=SpecUsage)
    error: Optional[str] = None
