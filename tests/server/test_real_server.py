"""The server on the REAL engine core: tiny random target and draft models made here, a tiny
byte-level tokenizer, a real uvicorn, the official ``openai`` client."""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.models.config import ModelConfig
from engine.models.loader import LoadedModel
from server.app import create_app
from server.settings import Settings
from tests.fakes import ServerThread, greedy_one_by_one_and_streamed, make_tokenizer
from tests.tiny import ours_from_hf, tiny_hf

MODEL = "tiny"
PROMPTS = [f"request {i}: the quick brown fox" for i in range(16)]


def tiny_loaded(kind: str, seed: int, tokenizer, device: str = "cpu") -> LoadedModel:
    hf = tiny_hf(kind, seed=seed, vocab=len(tokenizer))
    hf.config.eos_token_id = tokenizer.eos_token_id
    return LoadedModel(model=ours_from_hf(hf, device=device), config=ModelConfig.from_hf(hf.config),
                       tokenizer=tokenizer, source=f"tiny-{kind}", path=Path("."))


@contextmanager
def tiny_server(tokenizer, max_model_len: int = 128, draft: bool = True, **config):
    """A real uvicorn serving the real engine on a tiny random target and draft (``draft``) over
    ``tokenizer``, with ``config``'s engine settings (``s.core`` is the engine core)."""
    core = EngineCore(tiny_loaded("qwen2", 0, tokenizer), tiny_loaded("qwen2", 1, tokenizer) if draft else None,
                      EngineConfig(**{"max_batch": 4, "max_model_len": max_model_len, "tree": (2, 2),
                                      "load_aware": False, **config}),
                      model_name=MODEL)
    with ServerThread(create_app(Settings(served_model_name=MODEL), AsyncEngine(core, max_queue=32))) as s:
        s.core = core
        yield s


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def srv():
    with tiny_server(make_tokenizer()) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv):
    return client(srv)


def errors(srv) -> float:
    """Requests finished with an error so far (``request_success_total{finished_reason="error"}``)."""
    text = httpx.get(srv.url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "mcsd:request_success_total" and s.labels.get("finished_reason") == "error")


def counters(srv) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_sixteen_concurrent_greedy_streams_equal_one_at_a_time(srv, oai):
    sequential, together = greedy_one_by_one_and_streamed(srv.url, MODEL, PROMPTS)
    assert together == sequential
    assert any(sequential)


def test_chat_stream_n2_logprobs_and_usage(oai):
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, n=2, seed=3, temperature=0.8,
        logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant", "assistant"]
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length"}
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(tokens) == 12 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)
    usage = chunks[-1].usage
    assert usage.completion_tokens == 12 and usage.model_extra["speculative"]["steps"] > 0


def test_stop_string_never_leaks(oai):
    free = oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    if len(free) < 4:
        pytest.skip("the random model produced too little text to pick a stop string")
    stop = free[2:4]
    cut = oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free[:free.index(stop)]


def test_metrics_match_usage_and_too_long_prompt(srv, oai):
    before = counters(srv)
    usage = oai.completions.create(model=MODEL, prompt="hello world", max_tokens=10, temperature=0,
                                   extra_body={"ignore_eos": True}).usage
    after = counters(srv)
    delta = lambda name: after[name] - before.get(name, 0.0)  # noqa: E731
    spec = usage.model_extra["speculative"]
    assert delta("mcsd:generation_tokens_total") == usage.completion_tokens == 10
    assert delta("mcsd:spec_decode_num_draft_tokens_total") == spec["drafted_tokens"] > 0
    assert delta("mcsd:spec_decode_num_accepted_tokens_total") == spec["accepted_tokens"]
    assert delta("mcsd:spec_decode_num_drafts_total") == spec["steps"]
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="fox " * 200)
    assert info.value.body["code"] == "context_length_exceeded"


def labelled(srv, name: str) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics").text
    return {s.labels["method"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name and "method" in s.labels}


@pytest.mark.parametrize("method", ["maxgram", "mcsd+maxgram", "cascade"])
def test_per_request_method_equals_plain_greedy_and_is_counted_by_method(srv, oai, method):
    prompt = "abcabcabcabc abcabc"  # repetitive: Max-Gram has matches to copy
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    plain = oai.completions.create(**kw, extra_body={"ignore_eos": True, "speculative": {"enabled": False}})
    before = labelled(srv, "mcsd:spec_decode_draft_tokens_by_method_total")
    spec = oai.completions.create(**kw, extra_body={"ignore_eos": True, "speculative": {"method": method}})
    after = labelled(srv, "mcsd:spec_decode_draft_tokens_by_method_total")
    assert spec.choices[0].text == plain.choices[0].text
    used = spec.usage.model_extra["speculative"]
    grown = {m: after[m] - before.get(m, 0.0) for m in after if after[m] > before.get(m, 0.0)}
    expected = {"maxgram": {"maxgram", "bigram"}, "mcsd+maxgram": {"draft"}, "cascade": {"cascade"}}[method]
    assert used["drafted_tokens"] > 0 and set(grown) & expected, grown


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"100000": 5}}, "logit_bias"),  # a token id past the vocabulary
    ({"speculative": {"tree": [3, 3, 3]}}, "speculative.tree"),  # wider than the engine's (2, 2)
    ({"speculative": {"method": "mjsd-lossy"}, "presence_penalty": 0.5}, "speculative.method"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_what_the_engine_refuses_is_a_400_before_the_stream_starts(srv, body, param, stream):
    r = httpx.post(srv.url + "/v1/completions",
                   json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": stream, **body})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == param


def test_best_of_returns_the_n_most_likely_of_its_candidates(oai):
    """``best_of=4, n=2`` generates the same 4 candidates as ``n=4`` (seed + choice) and returns the 2
    with the highest total log probability, most likely first; usage counts all 4; streaming sends
    the same choices once all are done."""
    common = dict(model=MODEL, prompt="the quick brown fox", max_tokens=6, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    all4 = oai.completions.create(n=4, logprobs=0, **common)
    totals = [sum(c.logprobs.token_logprobs) for c in all4.choices]
    assert len(set(c.text for c in all4.choices)) > 1  # the ranking has something to choose between
    ranked = sorted(range(4), key=lambda i: -totals[i])[:2]

    best = oai.completions.create(n=2, best_of=4, **common)
    assert [c.text for c in best.choices] == [all4.choices[i].text for i in ranked]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == all4.usage.completion_tokens == 24

    chunks = list(oai.completions.create(n=2, best_of=4, stream=True, stream_options={"include_usage": True},
                                         **common))
    assert [(c.choices[0].index, c.choices[0].text) for c in chunks if c.choices] == \
        [(0, best.choices[0].text), (1, best.choices[1].text)]
    assert chunks[-1].usage.completion_tokens == 24


def test_a_chat_turn_reports_the_prefix_it_found_cached(srv, oai):
    """The second turn resends the first with its answer: the prefix cache holds all of it, the
    usage says so (``prompt_tokens_details.cached_tokens``, as OpenAI) and so do the counters."""
    messages = [{"role": "user", "content": "tell me about foxes"}]
    first = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    # only the chat template's opening (a block of 4 that earlier requests also started with) can be cached
    assert first.usage.prompt_tokens_details.cached_tokens <= 4
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and dogs?"}]
    before = counters(srv)
    second = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    after = counters(srv)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    assert after["mcsd:prefix_cache_hits_total"] - before.get("mcsd:prefix_cache_hits_total", 0) == cached
    assert after["mcsd:prefix_cache_queries_total"] - before.get("mcsd:prefix_cache_queries_total", 0) == \
        second.usage.prompt_tokens
    assert "mcsd:num_preemptions_total" in after


def test_the_pool_blocks_are_exported_by_state(srv, oai):
    """``mcsd:kv_cache_blocks{state}``: used + cached + free is the pool; after a request ends nothing
    is used and what it committed stays cached."""
    oai.completions.create(model=MODEL, prompt="a fox " * 12, max_tokens=8, temperature=0,
                           extra_body={"ignore_eos": True})
    text = httpx.get(srv.url + "/metrics").text
    blocks = {s.labels["state"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "mcsd:kv_cache_blocks"}
    assert sum(blocks.values()) == srv.core.cache.num_blocks
    assert blocks["used"] == 0 and blocks["cached"] >= 8  # 30-odd prompt tokens + 7 answer ones, in blocks of 4


def test_a_request_whose_drafting_fails_is_served_plainly_and_its_batch_is_untouched(srv, oai, monkeypatch):
    """Four concurrent streams; the drafting of one of them raises from its second step on.  Every
    stream still gets exactly its greedy text, the failing one without speculation from then on (its
    usage says why), and /metrics counts one speculation failure and no failed request."""
    from engine.speculative.proposer import DraftModelProposer

    prompts = PROMPTS[:4]
    expected = [oai.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    poisoned = srv.core.tokenizer.encode(prompts[2])
    real = DraftModelProposer._run_level
    raised = []

    def run_level(self, seqs, trees, to_run, d, *kept):
        for i in to_run:
            s = seqs[i]
            if s.tokens[:len(poisoned)] == poisoned and s.num_output >= 1:
                raised.append(s.request.request_id)
                raise RuntimeError("planted drafting failure")
        return real(self, seqs, trees, to_run, d, *kept)

    monkeypatch.setattr(DraftModelProposer, "_run_level", run_level)
    before, failed_requests = counters(srv), errors(srv)

    async def one(ac: openai.AsyncOpenAI, p: str):
        stream = await ac.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage

    async def main():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    results = asyncio.run(main())
    after = counters(srv)
    assert raised  # the planted failure happened
    assert [text for text, _ in results] == expected
    notes = [usage.model_extra["speculative"].get("note") for _, usage in results]
    assert "speculation stopped" in notes[2] and "planted drafting failure" in notes[2]
    assert notes[:2] + notes[3:] == [None, None, None]
    assert after["mcsd:spec_decode_failures_total"] - before["mcsd:spec_decode_failures_total"] == 1
    assert failed_requests == errors(srv)


def test_decoding_ahead_serves_streams_as_one_at_a_time(monkeypatch):
    """The engine decoding ahead of its reads (``decode_ahead``, CUDA's default) behind the real server:
    sixteen concurrent greedy streams give the text of the same requests one at a time, a client that
    walks away mid-stream costs nobody else, and nothing is left queued or held afterwards."""
    from tests.engine.test_decode_ahead import count_forwards_ahead

    used = count_forwards_ahead(monkeypatch)
    with tiny_server(make_tokenizer(), draft=False, decode_ahead="on") as s:
        sequential, together = greedy_one_by_one_and_streamed(s.url, MODEL, PROMPTS)
        assert together == sequential and any(sequential)
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json=dict(model=MODEL, prompt=PROMPTS[0], max_tokens=60, stream=True, ignore_eos=True)) as r:
            next(r.iter_lines())  # the first event, then the client leaves
        again = client(s).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
        assert again == sequential[1]
        core = s.core
        deadline = time.monotonic() + 30
        while (core.has_unfinished() or core.runner.ahead is not None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not core.has_unfinished() and core.runner.ahead is None and core.cache.used_blocks == 0
    assert used[0] > 0

