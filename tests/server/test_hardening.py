"""Regression tests for the hostile-input findings (a real uvicorn on localhost, the fake core): lone
surrogates, bodies over the limit whatever their transfer encoding, long stop strings, odd logit_bias
keys, echoed model names, and the headers 405 and 429 owe their clients."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from server.app import create_app
from tests.fakes import FakeCore
from tests.server.test_app import MODEL, client, error_of, fill_the_queue, serve, wait_until


@pytest.fixture(scope="module")
def srv():
    with serve(FakeCore(max_batch=4, step_delay=0.002), max_request_bytes=64_000) as s:
        yield s


def post(http: httpx.Client, srv, path: str, raw: bytes) -> httpx.Response:
    return http.post(srv.url + path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "x\\udfffy"]}', "prompt[1]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"model": "a\\ud800b", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud83d"]}', "stop[0]"),
])
def test_a_lone_surrogate_is_a_400_and_the_connection_keeps_serving(srv, path, raw, param):
    with httpx.Client() as http:  # one keep-alive connection for both requests
        r = post(http, srv, path, raw)
        assert r.status_code == 400, r.text
        err = error_of(r)
        assert err["param"] == param and "surrogate" in err["message"]
        ok = post(http, srv, "/v1/completions", b'{"prompt": "hello", "max_tokens": 2}')
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_a_paired_surrogate_is_just_an_emoji(srv):
    r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": "hi \\ud83d\\ude00", "max_tokens": 2}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 200


def test_a_chunked_body_over_the_limit_is_a_413(srv):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1000  # 100 kB, over the 64 kB limit, with no Content-Length
        yield b'"}'

    r = httpx.post(srv.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    small = httpx.post(srv.url + "/v1/completions", content=iter([b'{"prompt": "hi", ', b'"max_tokens": 2}']),
                       headers={"content-type": "application/json"})
    assert small.status_code == 200  # chunked bodies under the limit still work


def test_stop_strings_are_bounded(srv):
    oai = client(srv)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=2, stop=["x" * 1025])
    assert info.value.body["param"] == "stop" and "at most 1024 characters" in info.value.body["message"]
    r = oai.completions.create(model=MODEL, prompt="hi", max_tokens=2, stop=["y" * 1024] * 16)
    assert r.choices[0].text


@pytest.mark.parametrize("key", ["²", "1" * 5000, "-3", "1e3", "99999999999"])
def test_odd_logit_bias_keys_get_a_clear_400(srv, key):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "logit_bias": {key: 1}})
    assert r.status_code == 400
    err = error_of(r)
    assert err["param"] == "logit_bias" and "token ids" in err["message"] and len(err["message"]) < 300


def test_an_unknown_model_name_is_not_echoed_in_full(srv):
    r = httpx.post(srv.url + "/v1/completions", json={"model": "m" * 50_000, "prompt": "hi"})  # under the body limit
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    assert len(r.content) < 1000


def test_405_names_the_allowed_methods(srv):
    r = httpx.get(srv.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert error_of(r)["code"] == "method_not_allowed"


def test_429_says_when_to_retry():
    core = FakeCore(max_batch=1, step_delay=0.02)
    with serve(core, max_queue=1) as s:
        first, second = fill_the_queue(s)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        for _ in first:
            pass
        for _ in second:
            pass


class SlowTokenizer:
    """The fake core's tokenizer, with an ``encode`` that takes ``delay`` seconds (a huge prompt)."""

    def __init__(self, inner, delay: float) -> None:
        self.inner, self.delay, self.calls = inner, delay, 0

    def encode(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay)
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)


def test_health_answers_while_a_prompt_is_tokenized():
    core = FakeCore()
    slow = SlowTokenizer(core.tokenizer, delay=1.5)
    with serve(core) as s:
        core.tokenizer = slow
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, s.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                                  timeout=30)
            while slow.calls == 0:
                time.sleep(0.01)
            t0 = time.perf_counter()
            assert httpx.get(s.url + "/health").status_code == 200
            assert time.perf_counter() - t0 < 0.5  # not stuck behind the 1.5 s tokenization
            assert pending.result().status_code == 200


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing():
    core = FakeCore(max_model_len=256)
    slow = SlowTokenizer(core.tokenizer, delay=0.0)
    with serve(core) as s:
        core.tokenizer = slow
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x" * 10_000})  # > 256 tokens * 32 chars
        assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 10_000}]})
        assert r.status_code == 400 and error_of(r)["param"] == "messages"
        assert slow.calls == 0


def test_sigterm_finishes_what_it_can_and_ends_the_rest_cleanly():
    """On SIGTERM: a short request in flight completes; a long stream gets an OpenAI-style error event
    then [DONE]; a long plain request gets a 503 with Retry-After; nothing is cut mid-air."""
    import json
    import signal
    import threading

    import uvicorn

    from engine.async_engine import AsyncEngine
    from server.app import GracefulServer, create_app
    from server.settings import Settings

    core = FakeCore(max_batch=4, step_delay=0.05)
    engine = AsyncEngine(core, max_queue=8)
    app = create_app(Settings(served_model_name=MODEL, shutdown_grace=1.0), engine)
    server = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=6), engine, 1.0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=20)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    results = {}

    def stream(name: str, max_tokens: int) -> None:
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"prompt": "hello", "max_tokens": max_tokens, "stream": True}) as r:
            results[name] = (r.status_code, [line[6:] for line in r.iter_lines() if line.startswith("data: ")])

    def plain(name: str) -> None:
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 240}, timeout=30)
        results[name] = (r.status_code, r.headers.get("retry-after"), r.json())

    workers = [threading.Thread(target=stream, args=("long", 240)), threading.Thread(target=plain, args=("plain",))]
    for w in workers:
        w.start()
    wait_until(lambda: len(core._running) == 2, timeout=10)
    short = threading.Thread(target=stream, args=("short", 6))
    short.start()
    wait_until(lambda: len(core._running) == 3, timeout=10)
    server.handle_exit(signal.SIGTERM, None)
    for w in workers + [short]:
        w.join(timeout=20)
    thread.join(timeout=20)
    assert not thread.is_alive()

    status, events = results["short"]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    status, events = results["long"]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    status, retry_after, body = results["plain"]
    assert status == 503 and retry_after == "1" and body["error"]["code"] == "server_shutting_down"


def test_the_openapi_schema_describes_what_the_server_does(srv):
    spec = httpx.get(srv.url + "/openapi.json").json()
    assert all("422" not in op.get("responses", {}) for ops in spec["paths"].values() for op in ops.values())
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert {"200", "400", "404", "413", "429", "503"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert "text/event-stream" in responses["200"]["content"]
    prompt = spec["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    assert {"type": "null"} not in prompt["anyOf"] and {"type": "string", "minLength": 1} in prompt["anyOf"]
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": None})  # what the schema now forbids
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"


def test_a_client_stalling_mid_body_gets_a_408_and_long_streams_are_not_cut():
    import socket

    with serve(FakeCore(step_delay=0.05), body_read_timeout=0.5) as s:
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')  # then nothing
            t0 = time.perf_counter()
            reply = b""
            while chunk := sock.recv(65536):  # the head and the body may come in separate reads
                reply += chunk
            reply = reply.decode()
            assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply
            assert time.perf_counter() - t0 < 5
        # the timeout covers the body only: a stream that runs for longer is served to the end
        with httpx.stream("POST", s.url + "/v1/completions", timeout=30,
                          json={"prompt": "hello", "max_tokens": 40, "stream": True}) as r:
            t0 = time.perf_counter()
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert time.perf_counter() - t0 > 0.5 and lines[-1] == "data: [DONE]"


def test_a_client_stalling_in_its_request_head_is_disconnected_and_others_are_served():
    """Slowloris: a connection that sends nothing, or half a request line and stops, is closed after
    the head timeout; a request whose head arrived streams on past it; keep-alive requests after it
    get the timeout again."""
    import socket

    from server.head_timeout import http_protocol
    from server.settings import Settings
    from tests.fakes import ServerThread

    engine = AsyncEngine(FakeCore(max_batch=2, step_delay=0.05), max_queue=8)
    app = create_app(Settings(served_model_name=MODEL), engine)
    with ServerThread(app, http=http_protocol(0.5)) as s:
        host, port = s.url.removeprefix("http://").split(":")

        def closed_after(payload: bytes) -> float:
            sock = socket.create_connection((host, int(port)))
            sock.settimeout(5)
            t0 = time.monotonic()
            if payload:
                sock.sendall(payload)
            assert sock.recv(1024) == b""  # the server closed it without answering
            sock.close()
            return time.monotonic() - t0

        assert 0.4 < closed_after(b"") < 3
        assert 0.4 < closed_after(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ") < 3
        # a stream that outlives the head timeout by far is not cut
        chunks = list(client(s).completions.create(model=MODEL, prompt="hello", max_tokens=30, stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason == "length"
        with httpx.Client(base_url=s.url) as http:  # keep-alive: two requests on one connection
            assert http.get("/health").status_code == 200
            assert http.get("/health").status_code == 200
