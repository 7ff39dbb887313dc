"""Tool calls: the native-format parser (whole and streamed), and the server end to end with the
``openai`` client: the real engine on tiny random models for ``required`` and named calls (a
grammar makes a random model call tools correctly), the fake echo core for ``auto`` (it echoes a
call written into the prompt)."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest

from engine.async_engine import AsyncEngine
from server.app import create_app
from server.protocol import ChatCompletionRequest
from server.settings import Settings
from server.tools import ToolCallParser, parse
from tests.fakes import FakeCore, ServerThread, make_tokenizer, make_tool_tokenizer
from tests.server.test_real_server import client, tiny_server

MODEL = "tiny"
MSG = [{"role": "user", "content": "What is 2 + 3, and the weather in Paris?"}]
ADD = {"type": "function", "function": {"name": "add", "description": "Adds two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TOOLS = [ADD, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TEXT = ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": {"c": "x}y\\"z"}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


# ------------------------------------------------------------------------------ the parser
def test_the_parser_reads_content_and_calls():
    content, calls = parse(TEXT)
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments), c.done) for c in calls] == [
        ("add", {"a": 2, "b": {"c": 'x}y"z'}}, True), ("get_weather", {"city": "Paris"}, True)]
    assert parse("no call <tool_c") == ("no call <tool_c", [])  # a partial tag held back, then given back
    assert parse("<tool_call>not json</tool_call> after")[0] == "<tool_call>not json</tool_call> after"
    cut = parse('<tool_call>\n{"name": "f", "arguments": {"a": 1')[1]  # max_tokens in the middle of a call
    assert cut[0].arguments == '{"a": 1' and not cut[0].done


@pytest.mark.parametrize("seed", range(6))
def test_streamed_pieces_give_what_the_whole_text_gives(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), 12))
    parser, events = ToolCallParser(), []
    for a, b in zip([0] + cuts, cuts + [len(TEXT)]):
        events += parser.feed(TEXT[a:b])
    events += parser.finish()
    content, calls = parse(TEXT)
    assert "".join(e.text for e in events if e.kind == "content") == content
    assert [e.call.name for e in events if e.kind == "call"] == [c.name for c in calls]
    for i, call in enumerate(calls):
        assert "".join(e.text for e in events if e.kind == "arguments" and e.index == i) == call.arguments


def test_history_arguments_are_decoded_for_the_template():
    body = ChatCompletionRequest.model_validate({"messages": MSG + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}], "tools": TOOLS})
    history = body.template_messages()
    assert history[1]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}
    assert history[2] == {"role": "tool", "content": "5", "tool_call_id": "call_1"}


# ------------------------------------------------------------------------------ the real engine
@pytest.fixture(scope="module")
def srv():
    with tiny_server(make_tool_tokenizer(), max_model_len=512) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv):
    return client(srv)


def call(oai, **kw):
    kw.setdefault("max_tokens", 300)  # a random model spends the whitespace the grammar allows
    return oai.chat.completions.create(model=MODEL, messages=kw.pop("messages", MSG), tools=TOOLS, **kw)


def check_calls(message, complete: bool = True) -> list[tuple[str, dict]]:
    """Each call's name and arguments, validated against its tool's schema (only the calls a length cut
    left whole when ``complete`` is False)."""
    out = []
    calls = message.tool_calls if complete else message.tool_calls[:-1]
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


@pytest.mark.parametrize("spec", [False, True])
def test_required_calls_parse_and_match_their_schemas(oai, spec):
    r = call(oai, tool_choice="required", parallel_tool_calls=False, temperature=0.9, seed=3, n=3,
             extra_body={"speculative": {"enabled": spec}})
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert len(check_calls(choice.message)) == 1 and choice.message.content is None
    # parallel calls: a random model may go on calling until max_tokens; every whole call is valid
    r = call(oai, tool_choice="required", temperature=0.9, seed=4, n=3, extra_body={"speculative": {"enabled": spec}})
    for choice in r.choices:
        assert choice.finish_reason in ("tool_calls", "length")
        assert len(check_calls(choice.message, complete=choice.finish_reason != "length")) >= 1 or \
            choice.finish_reason == "length"


def test_a_named_call(oai):
    r = call(oai, tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0.9, seed=1)
    assert r.choices[0].finish_reason == "stop"  # OpenAI's finish reason for a named tool_choice
    assert [name for name, _ in check_calls(r.choices[0].message)] == ["get_weather"]
    assert not r.choices[0].message.content


def test_greedy_calls_are_the_same_with_speculation_and_streamed(oai):
    plain = call(oai, tool_choice="required", parallel_tool_calls=False, temperature=0, extra_body={"speculative": {"enabled": False}})
    fast = call(oai, tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert [(c.function.name, c.function.arguments) for c in fast.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls]
    chunks = list(call(oai, tool_choice="required", parallel_tool_calls=False, temperature=0, stream=True))
    calls: dict[int, dict] = {}
    finish = None
    for ch in chunks:
        for choice in ch.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                assert d.index in calls and (d.id is None or d.id == entry["id"])
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in fast.choices[0].message.tool_calls]
    assert all(c["id"] for c in calls.values())


def test_a_tool_result_turn_is_served(oai):
    first = call(oai, tool_choice="required", temperature=0)
    message = first.choices[0].message
    history = MSG + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in message.tool_calls]}]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "5"} for c in message.tool_calls]
    r = call(oai, messages=history, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body, param, code", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 5}}}],
      "tool_choice": "required"}, "tools", "invalid_grammar"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "unknown_tool"),
    ({"tools": [ADD, ADD]}, "tools", "duplicate_tool_name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", None),
])
def test_bad_tool_definitions_are_400s_and_others_go_on(oai, body, param, code):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, extra_body=body)
    assert info.value.body["param"] == param, info.value.body
    if code:
        assert info.value.body["code"] == code
    assert call(oai, tool_choice="required", temperature=0).choices[0].message.tool_calls


# ------------------------------------------------------------------------------ auto, on the echo core
@pytest.fixture(scope="module")
def echo():
    tok = make_tool_tokenizer()
    with ServerThread(create_app(Settings(served_model_name=MODEL),
                                 AsyncEngine(FakeCore(max_batch=4, tokenizer=tok), max_queue=16))) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_auto_parses_what_the_model_writes_and_none_leaves_it_alone(echo):
    # the echo core writes the rendered prompt back: the call written into the user's message comes out
    written = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    msgs = [{"role": "user", "content": written}]
    n = len(make_tool_tokenizer().encode("<|user|>" + written))
    r = echo.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=n)
    assert r.choices[0].message.tool_calls is None and written in r.choices[0].message.content
    auto = echo.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=n + 60)
    calls = auto.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls[:1]] == [("add", {"a": 2, "b": 3})]
    streamed = list(echo.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=n + 60,
                                                 stream=True))
    names = [d.function.name for ch in streamed for c in ch.choices for d in c.delta.tool_calls or [] if d.id]
    assert names[:1] == ["add"]


def test_a_template_without_tools_is_a_400():
    with ServerThread(create_app(Settings(served_model_name=MODEL),
                                 AsyncEngine(FakeCore(max_batch=2, tokenizer=make_tokenizer()), max_queue=4))) as s:
        oai = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=4)
        assert info.value.body["code"] == "tools_not_supported"
        assert oai.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="none", max_tokens=4)
