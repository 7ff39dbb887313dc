"""Statistics the engine fills as plain data; the server's Prometheus exporter reads them.

One :class:`StepStats` per engine step describes what speculation did in that step, summed over
the sequences of the batch.  Depth ``d`` (1-based) is a drafted node's distance from the step's
root; a node's sibling rank is its 0-based order among its parent's children (sampling order).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    num_seqs: int = 0  # sequences that ran in this step
    num_spec_seqs: int = 0  # of those, sequences that drafted at least one node
    drafted_tokens: int = 0  # tree nodes drafted (and verified) over the batch
    accepted_tokens: int = 0  # drafted tokens the target accepted
    emitted_tokens: int = 0  # tokens appended to outputs (accepted + bonus/correction), before stops
    bonus_tokens: int = 0  # sequences whose whole drafted path was accepted
    prefill_tokens: int = 0  # prompt tokens run in this step
    prefix_queried_tokens: int = 0  # prompt tokens of the sequences admitted in this step
    prefix_hit_tokens: int = 0  # of those, tokens found in the prefix cache (not prefilled)
    preemptions: int = 0  # sequences whose blocks were taken back to fit this step (recomputed later)
    speculation_failures: int = 0  # sequences whose speculation failed in this step (they go on plainly)
    accepted_per_position: list[int] = field(default_factory=list)  # [depth-1] sequences accepting >= depth
    drafted_by_depth: list[int] = field(default_factory=list)  # [depth-1] nodes drafted at that depth
    accepted_by_depth: list[int] = field(default_factory=list)  # [depth-1] accepted nodes at that depth
    drafted_by_rank: list[int] = field(default_factory=list)  # [rank] drafted nodes with that sibling rank
    accepted_by_rank: list[int] = field(default_factory=list)  # [rank] accepted nodes with that rank
    drafted_by_method: dict[str, int] = field(default_factory=dict)  # drafter -> nodes it proposed
    accepted_by_method: dict[str, int] = field(default_factory=dict)  # drafter -> accepted nodes it proposed
    budget: int = 0  # the draft model's tree budget (nodes per sequence) chosen for this step (plan.sub)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    step_seconds: float = 0.0


def add_at(counts: list[int], index: int, amount: int = 1) -> None:
    """``counts[index] += amount``, growing the list with zeros as needed."""
    if index >= len(counts):
        counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += amount
