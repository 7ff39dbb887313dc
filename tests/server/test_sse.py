"""Stream events: the directly written text events are the pydantic chunks' bytes, and a stream's
chunks share one ``id`` and ``created``."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.async_engine import AsyncEngine
from server.app import create_app
from server.protocol import ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionChunk, DeltaMessage
from server.settings import Settings
from server.sse import TextEvents, sse_event
from tests.fakes import FakeCore, ServerThread

TEXTS = ["", " hello", 'a "quoted" \\ back\\slash', "line\nbreak\ttab\r", "\x00\x1f\x7f control", "é ü 日本語 🦊",
         "</script>", "\u2028\u2029", "{\"json\": [1, 2]}"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("index", [0, 7])
def test_text_events_are_the_chunks_own_events(text, index):
    ids, model = 'cmpl-"x"', "the \"model\" é"
    completion = CompletionChunk(id=ids, model=model, created=1795000000, choices=[
        CompletionChoice(index=index, text=text, logprobs=None, finish_reason=None)])
    assert TextEvents(ids, "text_completion", model, 1795000000).completion(index, text) == sse_event(completion)
    chat = ChatCompletionChunk(id=ids, model=model, created=1795000000, choices=[
        ChatChunkChoice(index=index, delta=DeltaMessage(content=text), logprobs=None, finish_reason=None)])
    assert TextEvents(ids, "chat.completion.chunk", model, 1795000000).chat(index, text) == sse_event(chat)


def events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_streams_parse_and_share_one_id_and_created():
    with ServerThread(create_app(Settings(served_model_name="m"), AsyncEngine(FakeCore(step_delay=0.01)))) as s:
        common = dict(model="m", max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
        completion = events(s.url, "/v1/completions", dict(prompt="the quick brown fox", n=2, echo=True, **common))
        chat = events(s.url, "/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], **common))
        plain = httpx.post(s.url + "/v1/completions", json=dict(model="m", max_tokens=12, temperature=0,
                                                                prompt="the quick brown fox"))
    for stream, obj in ((completion, "text_completion"), (chat, "chat.completion.chunk")):
        assert len({(e["id"], e["created"], e["object"], e["model"]) for e in stream}) == 1
        assert stream[0]["object"] == obj
        assert stream[-1]["choices"] == []
        assert stream[-1]["usage"]["completion_tokens"] == (24 if obj == "text_completion" else 12)
        assert all(set(c) >= {"index", "logprobs", "finish_reason"} for e in stream for c in e["choices"])
    text = "".join(c["text"] for e in completion for c in e["choices"] if c["index"] == 0)
    assert text == "the quick brown fox" + plain.json()["choices"][0]["text"]
    finishes = [c["finish_reason"] for e in completion for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length", "length"]
