"""Shared pieces of the offline benchmarks: prompts, our engine runs, transformers baselines,
the machine's read bandwidth, and table/JSON output."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from tools.prompts import interleave_sources, load_prompts_file
from engine.request import GenerationRequest, SamplingParams, SpecOptions

RESULTS = Path(__file__).resolve().parent / "results"


def prompt_ids(tokenizer, path: str, limit: Optional[int]) -> list[tuple[str, list[int]]]:
    """(id, token ids) of each prompt, rendered with the model's chat template.  With ``limit``,
    prompts are taken in turn from each source (the id's prefix: HumanEval, sharegpt, ...), so a
    short run still mixes code and chat."""
    out = []
    for p in interleave_sources(load_prompts_file(path), limit):
        text = tokenizer.apply_chat_template([dict(m) for m in p.messages], add_generation_prompt=True,
                                             tokenize=False)
        out.append((p.id, tokenizer.encode(text, add_special_tokens=False)))
    return out


def run_ours(target, draft, ids: list[int], max_new: int, tree=(), temperature=0.0, seed=0,
             spec: Optional[SpecOptions] = None, core: Optional[EngineCore] = None,
             config: Optional[dict] = None) -> dict:
    """One request through our engine (batch 1); returns tokens, seconds and speculation counts.
    ``config``: extra EngineConfig fields (drafter knobs)."""
    core = core or EngineCore(target, draft, EngineConfig.from_settings(
        max_batch=1, max_model_len=len(ids) + max_new + 8, tree=tree, **(config or {})))
    params = SamplingParams(temperature=temperature, max_tokens=max_new, ignore_eos=True, seed=seed)
    t0 = time.perf_counter()
    core.add_request(GenerationRequest("bench", ids, params, spec or SpecOptions(enabled=bool(tree))))
    tokens, usage, first = [], None, None
    while core.has_unfinished():
        for o in core.step():
            tokens += o.new_token_ids
            if first is None and o.new_token_ids:
                first = time.perf_counter() - t0
            usage = o.spec
    secs = time.perf_counter() - t0
    stats = core.drain_step_stats()
    by_method: dict[str, list[int]] = {}
    for s in stats:
        for m, n in s.drafted_by_method.items():
            by_method.setdefault(m, [0, 0])[0] += n
        for m, n in s.accepted_by_method.items():
            by_method.setdefault(m, [0, 0])[1] += n
    return dict(tokens=tokens, seconds=secs, ttft=first, steps=sum(1 for s in stats if s.num_seqs),
                drafted=usage.drafted_tokens, accepted=usage.accepted_tokens, by_method=by_method,
                draft_seconds=sum(s.draft_seconds for s in stats),
                verify_seconds=sum(s.verify_seconds for s in stats))


def hf_model(path, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def run_hf(model, ids: list[int], max_new: int, measure_ttft: bool = False, **gen_kwargs) -> dict:
    """``transformers.generate``, greedy unless told otherwise, exactly ``max_new`` new tokens.
    ``measure_ttft`` times a separate one-token generate first (the prefill)."""
    x = torch.tensor([ids])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False)
    kw.update(gen_kwargs)
    ttft = None
    with torch.inference_mode():
        if measure_ttft:
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
            ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=max_new, min_new_tokens=max_new, **kw)
    secs = time.perf_counter() - t0
    return dict(tokens=out[0, len(ids):].tolist(), seconds=secs, ttft=ttft)


def read_bandwidth_gbs(threads: int, size_mb: int = 1024, repeats: int = 5) -> float:
    """Best-of read bandwidth of a sum over a buffer far larger than the caches."""
    torch.set_num_threads(threads)
    buf = torch.ones(size_mb * (1 << 20) // 4, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decoding step reads: every matrix once (the embedding lookup reads one
    row; a tied lm_head reads the embedding matrix once)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if name == "embed_tokens.weight" and not model.cfg.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size()
    return total


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(cpu=cpu, python=platform.python_version(), torch=torch.__version__, threads=torch.get_num_threads())


def print_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    """cols: (key, header, format)."""
    head = " | ".join(h for _, h, _ in cols)
    print(head)
    print("-" * len(head))
    for r in rows:
        print(" | ".join(format(r.get(k, float("nan")), f) if r.get(k) is not None else "-" for k, _, f in cols))


def write_json(name: str, payload: dict, out: Optional[str] = None, quiet: bool = False) -> Path:
    """Writes ``payload`` to ``out`` (default ``benchmarks/results/NAME``); ``quiet``: without saying so
    (a result saved as it grows)."""
    path = Path(out) if out else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    if not quiet:
        print(f"\nwrote {path}")
    return path
