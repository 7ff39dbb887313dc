"""Writes the benchmark prompt files in benchmarks/prompts/ from HumanEval and ShareGPT (fetched into the cache).

* ``bench.json``: HumanEval/0..9 as "complete this function" requests, plus 10 English ShareGPT first turns of
  50-600 characters: the measured set, half code (where speculation shines) and half open chat.
* ``train.json``: 60 other HumanEval problems and 60 other ShareGPT turns, disjoint from bench (ids and texts),
  for training acceptance heads / thresholds without peeking at the measured set.
* ``smoke.json``: 3 short hand-written prompts for quick end-to-end checks.

The choice is deterministic (fixed seed over a fixed file), so re-running reproduces the committed files.
Usage: ``python benchmarks/make_prompts.py [--cache-dir DIR] [--out-dir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tools.prompts import Prompt, load_humaneval, load_prompts_file, load_sharegpt_first_turns
from engine.models.fetch import fetch_dataset

SEED = 20240601
N_BENCH, N_TRAIN = 10, 60
MIN_CHARS, MAX_CHARS = 50, 600
CODE_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"
SMOKE = (
    Prompt("smoke/code", ({"role": "user", "content": "Write a Python function `add(a, b)` that returns a + b."},)),
    Prompt("smoke/chat", ({"role": "user", "content": "What is the capital of France? Answer in one sentence."},)),
    Prompt(
        "smoke/system",
        (
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three primary colors."},
        ),
    ),
)


def humaneval_prompts(problems: list[dict]) -> tuple[list[Prompt], list[Prompt]]:
    """Bench: the first N_BENCH problems; train: a seeded sample of N_TRAIN of the rest, in task order."""
    prompts = [_user_prompt(p["task_id"], CODE_TEMPLATE.format(prompt=p["prompt"])) for p in problems]
    rest = prompts[N_BENCH:]
    picked = sorted(random.Random(SEED).sample(range(len(rest)), N_TRAIN))
    return prompts[:N_BENCH], [rest[i] for i in picked]


def sharegpt_prompts(turns: list[dict]) -> tuple[list[Prompt], list[Prompt]]:
    """Bench and train from a seeded shuffle of distinct conversation openings.

    Only records whose id ends in ``_0`` are used: ShareGPT splits long conversations into ``_1``, ``_2``...
    records whose first human turn continues an earlier exchange ("Sure, do that") and is no real opening.
    """
    seen: set[str] = set()
    openings = []
    for turn in turns:
        if turn["id"].endswith("_0") and turn["text"] not in seen:
            seen.add(turn["text"])
            openings.append(_user_prompt(f"sharegpt/{turn['id']}", turn["text"]))
    random.Random(SEED).shuffle(openings)
    if len(openings) < N_BENCH + N_TRAIN:
        raise ValueError(f"only {len(openings)} ShareGPT openings pass the filters, need {N_BENCH + N_TRAIN}")
    return openings[:N_BENCH], openings[N_BENCH : N_BENCH + N_TRAIN]


def _user_prompt(pid: str, text: str) -> Prompt:
    return Prompt(pid, ({"role": "user", "content": text},))


def write_prompts(path: Path, prompts: list[Prompt] | tuple[Prompt, ...]) -> None:
    """Writes a prompts file and reads it back through the validating loader."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([p.to_json() for p in prompts], indent=2, ensure_ascii=False) + "\n", "utf-8")
    load_prompts_file(path)


def check_disjoint(bench: list[Prompt], train: list[Prompt]) -> None:
    """Train must share neither an id nor a prompt text with bench."""
    texts = {m["content"] for p in bench for m in p.messages}
    overlap = {p.id for p in bench} & {p.id for p in train}
    overlap |= {p.id for p in train if any(m["content"] in texts for m in p.messages)}
    if overlap:
        raise ValueError(f"bench and train overlap: {sorted(overlap)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="fetch cache root (default: $MCSD_CACHE)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "prompts")
    args = parser.parse_args(argv)
    problems = load_humaneval(fetch_dataset("humaneval", args.cache_dir))
    turns = load_sharegpt_first_turns(
        fetch_dataset("sharegpt", args.cache_dir), min_chars=MIN_CHARS, max_chars=MAX_CHARS, english_only=True
    )
    he_bench, he_train = humaneval_prompts(problems)
    sg_bench, sg_train = sharegpt_prompts(turns)
    bench, train = he_bench + sg_bench, he_train + sg_train
    check_disjoint(bench, train)
    for name, prompts in (("bench.json", bench), ("train.json", train), ("smoke.json", SMOKE)):
        write_prompts(args.out_dir / name, prompts)
        print(f"{args.out_dir / name}: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
