"""What speculative code may know of a sequence: :class:`SeqView`.

The engine's ``Sequence`` (``engine.sequence``) carries everything about a request in flight: its
text stream, output queue, cache slots, status, preemptions, timings.  Drafters, the planner, the
acceptance statistics and the verification rules see it through this narrower view instead, and no
module of this package imports ``engine.sequence`` (``tests/test_layout.py`` checks both).  The one
field they write is ``draft_cached``: the draft model's proposer advances it as the draft reads the
sequence's tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from engine.grammar import GrammarState
    from engine.request import GenerationRequest
    from engine.sampler import SamplingTensors


@runtime_checkable
class SeqView(Protocol):
    """A sequence as speculative code sees it."""

    request: "GenerationRequest"  # its sampling parameters and speculation options (read only)
    tokens: list[int]  # prompt + accepted output (read only)
    num_prompt: int
    generator: torch.Generator  # the request's random numbers (seeded requests reproduce)
    draft_slot: Optional[int]  # its draft-cache slot (None: no draft model for it)
    draft_cached: int  # tokens the draft cache holds: the proposer advances it
    output_counts: Optional[torch.Tensor]  # [vocab] counts of output tokens (penalties), or None
    prompt_mask: Optional[torch.Tensor]  # [vocab] tokens of the prompt (repetition penalty), or None
    sampling_tensors: Optional["SamplingTensors"]  # the request's parameters packed as one row
    carry: dict[str, Any]  # what a rule handed this step (``SeqStepResult.carry``; e.g. target-init's candidates)
    grammar: Optional["GrammarState"]  # structured output: the grammar's state after the committed tokens, or None
    speculation_error: Optional[str]  # set when its speculation failed: it decodes plainly from then on

    @property
    def num_output(self) -> int: ...

    @property
    def root(self) -> int: ...

    @property
    def remaining(self) -> int: ...
