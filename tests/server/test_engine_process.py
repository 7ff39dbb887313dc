"""The engine core in a process of its own (``--engine-process``, :class:`ProcessEngine`).

The same answers as the in-process engine (greedy and seeded, streamed, with a grammar that crosses
the pipe as its spec), metrics that still arrive, and the boundary's failures handled: a client that
goes away frees its slot in the engine process, a dying engine process ends every open request with
an error and turns ``/health`` to 503, a core that cannot be built is reported, shutdown drains and the
process exits.  Each server here starts a Python process (a few seconds)."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import contextmanager

import httpx
import jsonschema
import pytest

from engine.async_engine import EngineOverloaded, EngineState
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.engine_process import CoreView, ProcessEngine
from engine.request import GenerationRequest, SamplingParams
from server.app import create_app
from server.settings import Settings
from tests.fakes import FakeCore, ServerThread, make_tokenizer
from tests.server.test_real_server import client, tiny_loaded, tiny_server

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "brown"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["colour", "legs"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "fox", "schema": SCHEMA, "strict": True}}


# factories: module-level, so the engine process can import them
def tiny_core() -> EngineCore:
    """The core ``tiny_server`` serves in-process, built the same way (same seeds) in the engine process."""
    tok = make_tokenizer()
    return EngineCore(tiny_loaded("qwen2", 0, tok), tiny_loaded("qwen2", 1, tok),
                      EngineConfig(max_batch=4, max_model_len=512, tree=(2, 2), load_aware=False), model_name=MODEL)


def slow_fake_core() -> FakeCore:
    return FakeCore(max_batch=2, step_delay=0.05)


def broken_core():
    raise OSError("no weights at /nowhere")


@contextmanager
def process_server(factory, max_queue: int = 32):
    engine = ProcessEngine(factory, max_queue=max_queue)
    with ServerThread(create_app(Settings(served_model_name=MODEL), engine)) as s:
        engine.wait_ready(120)
        s.engine = engine
        yield s


@pytest.fixture(scope="module")
def srv():
    with process_server(tiny_core) as s:
        assert s.engine.state is EngineState.READY, s.engine.load_error
        yield s


@pytest.fixture(scope="module")
def ref():
    with tiny_server(make_tokenizer(), max_model_len=512) as s:
        yield s


def answers(srv) -> list:
    oai = client(srv)
    greedy = oai.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=24, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    seeded = oai.completions.create(model=MODEL, prompt="over the lazy dog", max_tokens=16, temperature=0.9, seed=5,
                                    n=2, extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="jumps over", max_tokens=20, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    schema = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A fox as JSON."}],
                                         response_format=FORMAT, temperature=0, max_tokens=200)
    return [greedy.choices[0].text, greedy.choices[0].logprobs.token_logprobs, [c.text for c in seeded.choices],
            streamed, schema.choices[0].message.content, greedy.usage.model_extra["speculative"]]


def test_answers_equal_the_in_process_engines(srv, ref):
    got, want = answers(srv), answers(ref)
    assert got == want
    jsonschema.validate(json.loads(got[4]), SCHEMA)
    assert got[5]["drafted_tokens"] > 0  # speculation ran in the engine process


def test_metrics_and_gauges_come_from_the_engine_process(srv):
    client(srv).completions.create(model=MODEL, prompt="the fox", max_tokens=8, temperature=0)
    text = httpx.get(srv.url + "/metrics").text
    done = [line for line in text.splitlines() if line.startswith("mcsd:request_success_total{")]
    assert any(float(line.rsplit(" ", 1)[1]) > 0 for line in done), done
    steps = [line for line in text.splitlines() if line.startswith("mcsd:spec_decode_num_drafts_total ")]
    assert steps and float(steps[0].rsplit(" ", 1)[1]) > 0
    health = httpx.get(srv.url + "/health").json()
    assert health["status"] == "ok" and health["running"] == 0


def test_a_client_going_away_frees_its_slot_in_the_engine_process(srv):
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json=dict(
            model=MODEL, prompt="the fox", max_tokens=400, temperature=0, stream=True, ignore_eos=True)) as r:
        next(r.iter_lines())  # the stream has started; leave mid-way
    deadline = time.monotonic() + 20
    while srv.engine.num_unfinished or srv.engine.gauges.num_running:
        assert time.monotonic() < deadline, (srv.engine.num_unfinished, srv.engine.gauges)
        time.sleep(0.05)


def test_a_dead_engine_process_ends_open_requests_with_an_error_and_health_says_so():
    with process_server(slow_fake_core) as s:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json=dict(
                model=MODEL, prompt="hello world", max_tokens=200, temperature=0, stream=True)) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            s.engine._process.kill()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        errors = [json.loads(line[6:]) for line in rest if line.startswith("data: {\"error\"")]
        assert len(errors) == 1 and "engine process exited" in errors[0]["error"]["message"], rest[-3:]
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and "engine process exited" in health.text
        again = httpx.post(s.url + "/v1/completions", json=dict(model=MODEL, prompt="hi", max_tokens=4))
        assert again.status_code == 503
        assert s.engine.num_unfinished == 0


def test_a_core_that_cannot_be_built_is_reported():
    with process_server(broken_core) as s:
        assert s.engine.state is EngineState.FAILED
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and "no weights at /nowhere" in health.text


def test_overload_shutdown_drain_and_the_process_exits():
    tok = make_tokenizer()

    def req(rid: str, max_tokens: int) -> GenerationRequest:
        return GenerationRequest(rid, tok.encode("hello world"), SamplingParams(temperature=0, max_tokens=max_tokens))

    async def main():
        engine = ProcessEngine(slow_fake_core, max_queue=1)
        engine.start()
        assert await asyncio.to_thread(engine.wait_ready, 120), engine.load_error
        assert isinstance(engine.core, CoreView) and engine.core.max_model_len == 256
        short = [engine.submit([req(f"s{i}", 3)]) for i in range(3)]  # 2 running + 1 waiting
        with pytest.raises(EngineOverloaded):
            engine.submit([req("over", 3)])
        outs = [[o async for o in g] for g in short]
        assert all(o[-1].finish_reason == "length" and o[-1].completion_tokens == 3 for o in outs)
        long = engine.submit([req("long", 240)])  # 12 s of 50 ms steps
        first = await long.__anext__()
        assert not first.finished
        await engine.shutdown(grace_seconds=0.3)  # "long" cannot finish in time
        last = [o async for o in long][-1]
        assert last.finish_reason == "error" and last.kind == "shutdown"
        assert engine.state is EngineState.STOPPED and not engine._process.is_alive()

    asyncio.run(main())
