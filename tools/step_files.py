"""Which files of the engine run code during one default speculative step.

    .venv/bin/python -m tools.step_files

Builds an engine on two tiny random Qwen2 models (``tests/tiny.py``) with the default preset's
speculation (``mcsd+maxgram``, tree 2,1,1, adaptive, load-aware), runs two greedy requests past their
prefill and first steps, then traces one step with ``sys.setprofile`` and prints every ``engine/``
file whose functions ran (``docs/engine.md``, "The files one step needs").
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def step_files(warmup_steps: int = 6) -> list[str]:
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.request import GenerationRequest, SamplingParams
    from tests.tiny import tiny_loaded

    config = EngineConfig.from_settings(max_batch=4, max_model_len=256, tree=(2, 1, 1), adaptive=True,
                                        spec_method="mcsd+maxgram", load_aware=True, cost_model_cache=False)
    core = EngineCore(tiny_loaded("qwen2", 0), tiny_loaded("qwen2", 1, layers=1), config)
    for i in range(2):
        core.add_request(GenerationRequest(f"r{i}", [5, 6, 7, 8, 5, 6, 7],
                                           SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))
    for _ in range(warmup_steps):
        core.step()
    engine = str(ROOT / "engine") + "/"
    files: set[str] = set()

    def profile(frame, event, arg) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(engine):
            files.add(str(Path(name).relative_to(ROOT)))
    sys.setprofile(profile)
    try:
        core.step()
    finally:
        sys.setprofile(None)
    return sorted(files)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    found = step_files()
    print("\n".join(found))
    print(f"{len(found)} files")
