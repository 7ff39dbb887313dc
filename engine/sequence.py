"""One request's state inside the engine: tokens, cache slots, generator, text stream, stats."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from engine.grammar import GrammarState
from engine.request import GenerationRequest, SpecUsage, TokenLogprob
from engine.sampler import SamplingTensors, make_generator, token_count_matrix
from engine.stop import TextStream


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: two requests are never 'equal'
class Sequence:
    """Token bookkeeping follows one invariant: the target cache holds every token but the last
    one (the *root* of the next step, not yet cached).  The draft cache may lag further behind
    (its deepest accepted node was never run); ``draft_cached`` says how far it got."""

    request: GenerationRequest
    stream: TextStream
    generator: torch.Generator
    tokens: list[int]  # prompt + accepted output tokens
    num_prompt: int
    slot: Optional[int] = None  # target cache slot
    draft_slot: Optional[int] = None
    target_cached: int = 0  # tokens in the target cache (committed)
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache supplied at (first) admission
    preemptions: int = 0  # times its blocks were taken back and its tokens recomputed
    draft_cached: int = 0  # tokens in the draft cache (committed)
    status: SeqStatus = SeqStatus.WAITING
    arrival: float = field(default_factory=time.monotonic)
    spec: SpecUsage = field(default_factory=SpecUsage)
    pending_ids: list[int] = field(default_factory=list)  # output tokens not yet handed out
    pending_text: str = ""
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_counts: Optional[torch.Tensor] = None  # [vocab] int32, only when penalties are on
    prompt_mask: Optional[torch.Tensor] = None  # [vocab] bool, only with a repetition penalty
    sampling_tensors: Optional[SamplingTensors] = None  # one-row packing of the request's params
    carry: dict[str, Any] = field(default_factory=dict)  # what the last step's rule handed the next, by key
    grammar: Optional[GrammarState] = None  # structured output: the grammar's state after the committed tokens
    speculation_error: Optional[str] = None  # its speculation failed (the error): it decodes plainly from then on

    @classmethod
    def create(cls, request: GenerationRequest, stream: Optional[TextStream], vocab_size: int = 0,
               device: torch.device | str = "cpu") -> "Sequence":
        """A request's state as it enters the engine: its tokens, its seeded generator, its grammar's
        state, its sampling parameters packed as one row on ``device`` and the token counts its
        penalties read (``vocab_size`` 0: neither, for tests that drive drafters alone)."""
        ids, sampling = list(request.prompt_token_ids), request.sampling
        seq = cls(request=request, stream=stream, generator=make_generator(sampling.seed), tokens=ids,
                  num_prompt=len(ids), grammar=GrammarState(request.grammar) if request.grammar is not None else None)
        if vocab_size:
            seq.sampling_tensors = SamplingTensors.from_params([sampling], vocab_size, device=device)
            if sampling.needs_history:
                seq.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
                if sampling.repetition_penalty != 1.0:
                    seq.prompt_mask = token_count_matrix([ids], vocab_size, device)[0] > 0
        return seq

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def root(self) -> int:
        return self.tokens[-1]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def remaining(self) -> int:
        """Tokens this request may still produce."""
        return self.request.sampling.max_tokens - self.num_output
