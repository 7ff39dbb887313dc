"""Drives an EngineCore to completion and collects each request's tokens, text and usage."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import GenerationRequest, SamplingParams, SpecOptions


@dataclass
class Collected:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    spec: object = None
    deltas: int = 0


def run_engine(target, draft, prompts, tree=(4, 2, 2), max_batch=4, spec=None, join_every=0, config=None,
               policy=None, grammar=None, **sampling):
    """Runs ``prompts`` (lists of ids) to completion; ``join_every=k`` adds one request every k steps
    instead of all at once (continuous batching).  ``spec``: one SpecOptions for every request, or a list
    of one per prompt.  ``config``: extra EngineConfig fields; ``policy``: a speculation policy
    overriding the config's; ``grammar``: a ``GrammarSpec`` every request's output must match (compiled by
    the engine's ``Grammars``), or a list of one (or None) per prompt."""
    config = EngineConfig.from_settings(max_batch=max_batch, max_model_len=256, tree=tree, **(config or {}))
    core = EngineCore(target, draft, config, policy=policy)
    sampling.setdefault("max_tokens", 24)
    sampling.setdefault("temperature", 0.0)
    specs = spec if isinstance(spec, list) else [spec or SpecOptions()] * len(prompts)
    grammars = grammar if isinstance(grammar, list) else [grammar] * len(prompts)
    reqs = [GenerationRequest(f"r{i}", list(p), SamplingParams(**sampling), specs[i],
                              core.grammars.compile(grammars[i]) if grammars[i] is not None else None)
            for i, p in enumerate(prompts)]
    out = {r.request_id: Collected() for r in reqs}
    pending = list(reqs)
    steps = 0
    while pending or core.has_unfinished():
        if pending and (join_every == 0 or steps % join_every == 0):
            batch = pending if join_every == 0 else pending[:1]
            for r in batch:
                core.add_request(r)
            pending = pending[len(batch):]
        for o in core.step():
            c = out[o.request_id]
            c.tokens += o.new_token_ids
            c.text += o.new_text
            c.deltas += 1
            c.logprobs += o.logprobs or []
            if o.finished:
                c.finish_reason, c.spec = o.finish_reason, o.spec
        steps += 1
    return [out[r.request_id] for r in reqs], core
