"""The prefix benchmark's replay against a real server on the real engine's tiny models: every turn
resends the conversation with the server's own answers, the rows carry per-turn TTFT, prompt
length and the cached tokens the server reported."""

from __future__ import annotations

import asyncio
from argparse import Namespace

import openai

from benchmarks.bench_prefix import by_phase, chat_workload, rotated, system_workload
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from server.app import create_app
from server.settings import Settings
from tests.fakes import ServerThread, make_tokenizer
from tests.server.test_real_server import tiny_loaded


def test_rotated_and_by_phase():
    assert [rotated(["a", "b", "c"], k) for k in (0, 1, 4)] == [["a", "b", "c"], ["b", "c", "a"], ["b", "c", "a"]]
    rows = by_phase({"x": [dict(ttft=1.0, e2e=2.0, tokens=4, prompt_tokens=10, cached_tokens=0, turn=1),
                           dict(ttft=3.0, e2e=4.0, tokens=4, prompt_tokens=30, cached_tokens=9, turn=2)]}, "turn", 2)
    assert rows[0]["ttft_turn1_s"] == 1.0 and rows[0]["prompt_turn2"] == 30 and rows[0]["cached_tokens"] == 9
    assert rows[0]["ttft_mean_s"] == 2.0 and rows[0]["tok_s"] == 8 / 6


def test_replayed_chats_grow_and_find_their_history_cached():
    tok = make_tokenizer()
    core = EngineCore(tiny_loaded("qwen2", 0, tok), tiny_loaded("qwen2", 1, tok),
                      EngineConfig(max_batch=4, max_model_len=512, tree=(2, 2), load_aware=False), model_name="tiny")
    args = Namespace(turns=3, concurrency=2, max_tokens=6, model_name="tiny", agents=2, rounds=2, system_rules=2)
    convs = [["hello there, how are you?", "tell me more", "and then?"], ["what is a fox?", "why", "ok thanks"]]
    with ServerThread(create_app(Settings(served_model_name="tiny"), AsyncEngine(core, max_queue=16))) as srv:
        async def run():
            async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
                return (await chat_workload({"ours": srv}, {"ours": client}, args, convs),
                        await system_workload({"ours": srv}, {"ours": client}, args))
        chat, system = asyncio.run(run())
    row = chat[0]
    assert row["requests"] == 6 and row["prompt_turn1"] < row["prompt_turn2"] < row["prompt_turn3"]
    assert row["cached_tokens"] >= row["prompt_turn1"] + row["prompt_turn2"]  # turns 2 and 3 found their history
    assert system[0]["requests"] == 4 and system[0]["cached_tokens"] > 0
