"""The HTTP server end to end: a real uvicorn on localhost, the official ``openai`` client, the
fake core (see tests/fakes.py: it echoes the prompt, so expected outputs are known)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import AsyncEngine
from server.app import create_app
from server.settings import Settings
from tests.fakes import FakeCore, ServerThread, echo_text

MODEL = "fake-model"
MSG = [{"role": "user", "content": "hello world"}]
CHAT_ECHO = "<|user|>hello world\n<|assistant|>"  # the rendered prompt the fake core echoes


def serve(core: FakeCore, **settings):
    settings.setdefault("served_model_name", MODEL)
    engine = AsyncEngine(core, max_queue=settings.get("max_queue", 64))
    return ServerThread(create_app(Settings(**settings), engine))


def client(srv, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=30)


def scrape(srv) -> dict[str, float]:
    """``{sample name + sorted labels: value}`` parsed with prometheus-client's own parser."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            key = s.name + (f"{{{labels}}}" if labels else "")
            if "le" in s.labels:
                continue
            out[key] = s.value
    return out


@pytest.fixture(scope="module")
def srv():
    with serve(FakeCore(max_batch=4, step_delay=0.002)) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv):
    return client(srv)


# ---------------------------------------------------------------------------- happy paths
def test_models_and_health(srv, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_with_usage_extension(oai):
    r = oai.completions.create(model=MODEL, prompt="hello world", max_tokens=5, temperature=0)
    assert r.choices[0].text == echo_text("hello world", 5) and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5
    spec = r.usage.model_extra["speculative"]
    assert spec["steps"] > 0 and 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["drafted_tokens"])


def test_speculation_can_be_turned_off_per_request(oai):
    r = oai.completions.create(model=MODEL, prompt="hello", max_tokens=6, extra_body={"speculative": {"enabled": False}})
    assert r.usage.model_extra["speculative"] == {"steps": 0, "drafted_tokens": 0, "accepted_tokens": 0,
                                                  "acceptance_rate": 0.0, "note": None}
    capped = oai.completions.create(model=MODEL, prompt="hello", max_tokens=6, extra_body={"speculative": {"max_depth": 1}})
    spec = capped.usage.model_extra["speculative"]
    assert spec["drafted_tokens"] == spec["steps"]  # one drafted token per step


def test_chat_with_stop_string(oai):
    r = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=40, stop=["world"])
    assert r.choices[0].message.content == "<|user|>hello " and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.role == "assistant"
    r2 = oai.chat.completions.create(model=MODEL, messages=MSG, max_completion_tokens=4)
    assert r2.usage.completion_tokens == 4 and r2.choices[0].finish_reason == "length"


def test_completion_multiple_prompts_and_n(oai):
    r = oai.completions.create(model=MODEL, prompt=["abc", "hello"], n=2, max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [echo_text("abc", 3)] * 2 + [echo_text("hello", 3)] * 2
    assert r.usage.completion_tokens == 12


def test_n_with_seed_gives_reproducible_distinct_choices(oai):
    kw = dict(model=MODEL, messages=MSG, max_tokens=6, n=3, temperature=1.0, seed=5)
    a, b = oai.chat.completions.create(**kw), oai.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) == 3  # the fake shifts its echo by seed + index


def test_echo_and_token_id_prompts(oai):
    r = oai.completions.create(model=MODEL, prompt="hello", max_tokens=3, echo=True)
    assert r.choices[0].text == "hello" + echo_text("hello", 3)
    ids = oai.completions.create(model=MODEL, prompt=[70, 71], max_tokens=3, echo=True)
    tok = FakeCore().tokenizer
    assert ids.choices[0].text == tok.decode([70, 71]) + tok.decode([70, 71, 70])
    assert ids.usage.prompt_tokens == 2 and ids.usage.completion_tokens == 3


def test_logprobs(oai):
    chat = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)
    comp = oai.completions.create(model=MODEL, prompt="hello world", max_tokens=4, logprobs=3)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == 4
    assert lp.text_offset[0] == 0 and all(len(t) <= 3 for t in lp.top_logprobs)


# ---------------------------------------------------------------------------- streaming
def test_chat_stream_order_and_usage(oai):
    chunks = list(oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.model_extra["speculative"]["steps"] > 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == CHAT_ECHO[:len(text)] and len(text) >= 10
    assert chunks.index(finish[0]) == len(chunks) - 2  # finish chunk, then usage


def test_completion_stream_n2_interleaved_with_stop(oai):
    chunks = list(oai.completions.create(model=MODEL, prompt="hello world", max_tokens=30, n=2, stop="wor",
                                         stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == {0: "hello ", 1: "hello "}
    assert sorted(ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason) == ["stop", "stop"]
    assert all(c.usage is None for c in chunks)  # no include_usage


def test_raw_stream_ends_with_done(srv):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_sixteen_concurrent_streams_match_sequential(srv, oai):
    prompts = [f"prompt number {i} says hello" for i in range(16)]
    sequential = [oai.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
                  for p in prompts]

    async def one(ac: openai.AsyncOpenAI, p: str) -> str:
        stream = await ac.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    assert asyncio.run(main()) == sequential


# ---------------------------------------------------------------------------- errors
def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b'["a list"]', None),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 9}', "temperature"),
    ("/v1/completions", b'{"prompt": "x", "n": 0}', "n"),
    ("/v1/completions", b'{"max_tokens": 3}', "prompt"),
    ("/v1/completions", b'{"prompt": [999999]}', "prompt"),
    ("/v1/completions", b'{"prompt": ""}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "echo": true, "logprobs": 1}', "echo"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 1000}', "n"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "speculative": {"max_depth": -1}}',
     "speculative.max_depth"),
])
def test_bad_requests_get_openai_400(srv, path, body, param):
    r = httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = error_of(r)
    assert err["param"] == param and err["type"] == "invalid_request_error" and "Traceback" not in err["message"]


def test_too_long_prompt(oai):
    long = "z " * 300  # the fake core's context is 256 tokens
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}])
    assert info.value.body["param"] == "messages" and info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="hello", max_tokens=300)
    assert info.value.body["param"] == "max_tokens"


def test_engine_rejection_is_a_400(oai):
    with pytest.raises(openai.BadRequestError, match="does not run speculative.method"):
        oai.completions.create(model=MODEL, prompt="hi", extra_body={"speculative": {"method": "cascade"}})


def test_unknown_speculation_method_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="hi", extra_body={"speculative": {"method": "magic"}})
    assert "maxgram" in info.value.body["message"] and "speculative" in info.value.body["param"]


def test_unknown_model_route_and_method(srv, oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="gpt-9", prompt="x")
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
    assert error_of(httpx.get(srv.url + "/v2/nothing"))["code"] == "not_found"
    r = httpx.get(srv.url + "/v1/completions")
    assert r.status_code == 405 and error_of(r)["code"] == "method_not_allowed"


def test_request_too_large():
    with serve(FakeCore(), max_request_bytes=2048) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x" * 5000})
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"


def test_api_key_and_cors():
    with serve(FakeCore(), api_key="sekrit", cors_origins=["http://ui.example"], metrics_auth=True) as s:
        with pytest.raises(openai.AuthenticationError):
            client(s, "wrong").models.list()
        r = httpx.post(s.url + "/v1/completions", content=b"{bad json")  # auth comes before validation
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        assert client(s, "sekrit").completions.create(model=MODEL, prompt="hi", max_tokens=1).choices[0].text == echo_text("hi", 1)
        assert httpx.get(s.url + "/health").status_code == 200  # open by default
        assert httpx.get(s.url + "/metrics").status_code == 401  # metrics_auth=True
        assert httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        pre = httpx.options(s.url + "/v1/completions", headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.example"


def test_health_is_503_while_loading():
    import threading
    gate = threading.Event()

    def factory():
        gate.wait(10)
        return FakeCore()

    with ServerThread(create_app(Settings(served_model_name=MODEL), AsyncEngine(factory))) as s:
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and "loading" in error_of(r)["message"]
        with pytest.raises(openai.InternalServerError) as info:  # 503
            client(s).completions.create(model=MODEL, prompt="x")
        assert info.value.status_code == 503
        gate.set()
        deadline = time.monotonic() + 10
        while httpx.get(s.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)


# ---------------------------------------------------------------------------- load, disconnects, metrics
def wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def running(s) -> float:
    return scrape(s)["mcsd:num_requests_running"]


def fill_the_queue(s):
    """One stream running and one queued on a server with ``max_batch=1, max_queue=1``: the next
    request finds the queue full.  Returns both streams."""
    oai = client(s)
    first = oai.completions.create(model=MODEL, prompt="hello", max_tokens=40, stream=True)
    next(iter(first))
    wait_until(lambda: running(s) == 1)
    second = oai.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True)
    return first, second


def test_queue_full_is_429_and_spares_admitted_requests():
    core = FakeCore(max_batch=1, step_delay=0.02)
    with serve(core, max_queue=1) as s:
        oai = client(s)
        first, second = fill_the_queue(s)
        with pytest.raises(openai.RateLimitError) as info:
            oai.completions.create(model=MODEL, prompt="hello", max_tokens=3)
        assert info.value.body["code"] == "queue_full" and "overloaded" in info.value.body["message"]
        assert sum(len(c.choices[0].text) for c in first if c.choices) > 0
        assert [c.choices[0].finish_reason for c in second if c.choices][-1] == "length"


def test_disconnect_mid_stream_frees_the_slot():
    core = FakeCore(max_batch=1, step_delay=0.02)
    with serve(core) as s:
        body = {"model": MODEL, "prompt": "hello world", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert running(s) == 1
        wait_until(lambda: running(s) == 0 and httpx.get(s.url + "/health").json()["unfinished"] == 0)
        assert len(core.aborted) == 1
        assert scrape(s)['mcsd:request_success_total{finished_reason=abort}'] == 1


def test_disconnect_while_waiting_for_a_non_streaming_response():
    core = FakeCore(max_batch=1, step_delay=0.02)
    with serve(core) as s:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 200}, timeout=0.3)
        wait_until(lambda: len(core.aborted) == 1 and running(s) == 0)


def test_metrics_consistent_with_usage():
    with serve(FakeCore(max_batch=4)) as s:
        oai = client(s)
        usages = [oai.completions.create(model=MODEL, prompt=p, max_tokens=m, stop=stop).usage
                  for p, m, stop in [("hello world", 9, None), ("the quick brown fox", 14, "fox"), ("abc", 5, None)]]
        usages += [oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=7).usage]
        m = scrape(s)
    spec = [u.model_extra["speculative"] for u in usages]
    assert m["mcsd:spec_decode_num_draft_tokens_total"] == sum(x["drafted_tokens"] for x in spec)
    assert m["mcsd:spec_decode_num_accepted_tokens_total"] == sum(x["accepted_tokens"] for x in spec)
    assert m["mcsd:spec_decode_num_drafts_total"] == sum(x["steps"] for x in spec)
    assert m["mcsd:generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    assert m["mcsd:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert m["mcsd:request_success_total{finished_reason=length}"] == 3
    assert m["mcsd:request_success_total{finished_reason=stop}"] == 1
    assert m["mcsd:time_to_first_token_seconds_count"] == 4 == m["mcsd:e2e_request_latency_seconds_count"]
    # per-token ITL: every token but each request's first (the fake's first delta carries one)
    assert m["mcsd:inter_token_latency_seconds_count"] == sum(u.completion_tokens for u in usages) - 4
    per_pos = [v for k, v in m.items() if k.startswith("mcsd:spec_decode_num_accepted_tokens_per_pos_total")]
    assert sum(per_pos) == m["mcsd:spec_decode_num_accepted_tokens_total"]
    assert m["mcsd:spec_decode_accepted_length_count"] == m["mcsd:spec_decode_num_drafts_total"]
    assert m["mcsd:spec_decode_accepted_length_sum"] == (m["mcsd:spec_decode_num_drafts_total"]
                                                         + m["mcsd:spec_decode_num_accepted_tokens_total"])
    assert m["mcsd:spec_decode_draft_tokens_by_depth_total{depth=1}"] == m["mcsd:spec_decode_num_drafts_total"]
    assert m["mcsd:spec_decode_budget"] == 3 and m["mcsd:num_requests_waiting"] == 0
    assert m["mcsd:spec_decode_verify_seconds_total"] > 0


def test_metrics_report_the_cuda_graphs_captured_at_start():
    """Each model's capture report (engine.graphs, made at start-up on CUDA) as three gauges."""
    from engine.graphs import CaptureReport

    core = FakeCore(max_batch=2)
    core.capture_reports = {"target": CaptureReport(buckets=24, seconds=3.5, pool_bytes=1 << 20),
                            "draft": CaptureReport(buckets=20, seconds=2.0, pool_bytes=1 << 19)}
    with serve(core) as s:
        m = scrape(s)
    assert m["mcsd:cuda_graphs{model=target}"] == 24 and m["mcsd:cuda_graphs{model=draft}"] == 20
    assert m["mcsd:cuda_graph_pool_bytes{model=target}"] == 1 << 20
    assert m["mcsd:cuda_graph_capture_seconds{model=draft}"] == 2.0


def test_engine_step_failure_is_reported_and_serving_continues():
    core = FakeCore(max_batch=2, step_delay=0.02)
    with serve(core) as s:
        oai = client(s)
        stream = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=100, stream=True)
        with pytest.raises(openai.APIError, match="injected failure"):
            for i, _ in enumerate(stream):
                if i == 2:
                    core.fail_next_step = True
        core.fail_next_step = True  # the next step (this request's) fails: a 500 error object
        with pytest.raises(openai.InternalServerError) as info:
            oai.completions.create(model=MODEL, prompt="hello", max_tokens=50)
        assert info.value.body["code"] == "engine_error"
        assert oai.completions.create(model=MODEL, prompt="hello", max_tokens=3).choices[0].finish_reason == "length"
        assert scrape(s)["mcsd:request_success_total{finished_reason=error}"] == 2
