"""Batch invariance through the real server (issue 22): the same greedy request yields the same text
whatever else is in the batch (sampled neighbours of other lengths, joining and leaving mid-way) and
whatever the step's block size (speculation on or off), in bf16 as in fp32.  On the CPU this holds
because the linears and the attention kernel compute each row alone (``engine/models/csrc``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.models.config import ModelConfig
from engine.models.loader import LoadedModel
from server.app import create_app
from server.settings import Settings
from tests.fakes import ServerThread, make_tokenizer
from tests.tiny import ours_from_hf

MODEL = "tiny"
GREEDY = [f"prompt {i}: " + "the quick brown fox jumps " * (1 + 3 * i) for i in range(6)]
NOISE = [f"noise {i}: " + "over the lazy dog " * (2 + 5 * i) for i in range(8)]


def loaded(seed: int, tokenizer, dtype: torch.dtype, hidden: int = 256) -> LoadedModel:
    """A random qwen2 wider than the usual tiny one (head size 64, as real models): rounding
    differences between kernels show up in its greedy text."""
    torch.manual_seed(seed)
    hf = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), max_position_embeddings=1024,
        tie_word_embeddings=True)).eval()
    hf.config.eos_token_id = tokenizer.eos_token_id
    return LoadedModel(model=ours_from_hf(hf, dtype), config=ModelConfig.from_hf(hf.config), tokenizer=tokenizer,
                       source="tiny-qwen2", path=Path("."))


def seen(response) -> tuple[str, list]:
    """The text and every token's log probabilities: equal floats mean bitwise-equal logits, a far
    finer check than equal text (a last-bit difference rarely flips a greedy choice)."""
    choice = response.choices[0]
    if choice.logprobs is None:
        return choice.text, []
    return choice.text, list(zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_greedy_text_is_the_same_alone_and_in_a_mixed_concurrent_batch(dtype):
    tok = make_tokenizer()
    core = EngineCore(loaded(0, tok, dtype), loaded(1, tok, dtype),
                      EngineConfig(max_batch=8, max_model_len=512, tree=(2, 2), prefill_chunk=32, load_aware=False),
                      model_name=MODEL)
    greedy = dict(model=MODEL, max_tokens=32, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    with ServerThread(create_app(Settings(served_model_name=MODEL), AsyncEngine(core, max_queue=64))) as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300) as client:
            alone = [seen(client.completions.create(prompt=p, **greedy)) for p in GREEDY]

        async def one(ac, prompt: str, delay: float, **kw) -> str:
            await asyncio.sleep(delay)  # requests join while others are mid-way
            return seen(await ac.completions.create(prompt=prompt, **kw))

        async def mixed():
            async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300) as ac:
                noise = [one(ac, p, 0.05 * i, model=MODEL, max_tokens=8 + 7 * i, temperature=1.0, seed=i,
                             extra_body={"ignore_eos": True}) for i, p in enumerate(NOISE)]
                spec = [one(ac, p, 0.1 * i, **greedy) for i, p in enumerate(GREEDY)]
                plain = [one(ac, p, 0.1 * i + 0.05, **{**greedy, "extra_body": {
                    "ignore_eos": True, "speculative": {"enabled": False}}}) for i, p in enumerate(GREEDY)]
                out = await asyncio.gather(*spec, *plain, *noise)
                return out[:len(GREEDY)], out[len(GREEDY):2 * len(GREEDY)]

        with_spec, without_spec = asyncio.run(mixed())
    assert all(text for text, _ in alone)
    assert with_spec == alone
    assert without_spec == alone
