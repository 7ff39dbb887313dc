"""Structured outputs through the real server: tiny random models on a byte-level tokenizer, a real
uvicorn, the official ``openai`` client.  A random model writes whatever the grammar lets it, so
every output that finishes must parse and validate, with speculation on and off."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tests.fakes import make_tokenizer
from tests.server.test_real_server import client, errors, tiny_server

MODEL = "tiny"
MSG = [{"role": "user", "content": "Describe the fox as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "brown", "grey"]},
        "fast": {"type": "boolean"},
        "legs": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["fox", "quick"]}, "maxItems": 2},
        "name": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    },
    "required": ["colour", "fast", "legs", "tags", "name"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "fox", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def srv():
    with tiny_server(make_tokenizer(), max_model_len=512) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv):
    return client(srv)


def chat(oai, spec: bool = True, **kw):
    kw.setdefault("max_tokens", 300)  # a random model spends the whitespace the grammar allows
    return oai.chat.completions.create(model=MODEL, messages=MSG, extra_body={"speculative": {"enabled": spec}}, **kw)


@pytest.mark.parametrize("method", ["mcsd", "mcsd+maxgram", "maxgram", "cascade"])
def test_json_schema_outputs_validate_and_speculation_changes_nothing_greedy(oai, method):
    plain = chat(oai, spec=False, response_format=FORMAT, temperature=0)
    fast = oai.chat.completions.create(model=MODEL, messages=MSG, response_format=FORMAT, temperature=0, max_tokens=300,
                                       extra_body={"speculative": {"method": method}})
    assert fast.choices[0].message.content == plain.choices[0].message.content
    assert fast.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(fast.choices[0].message.content), SCHEMA)
    assert fast.usage.model_extra["speculative"]["drafted_tokens"] > 0  # at least the forced keys


def test_sampled_outputs_validate(oai):
    r = chat(oai, response_format=FORMAT, temperature=1.0, seed=7, n=4)
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_json_object_and_streamed_json_schema(oai):
    r = chat(oai, response_format={"type": "json_object"}, temperature=0.8, seed=1, max_tokens=200)
    if r.choices[0].finish_reason == "stop":  # a free object may run to max_tokens on a random model
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")
    chunks = list(chat(oai, response_format=FORMAT, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat(oai, response_format=FORMAT, temperature=0).choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_take_regex_choice_grammar_and_response_format(oai):
    def complete(max_tokens=40, **extra):
        return oai.completions.create(model=MODEL, prompt="the quick brown", max_tokens=max_tokens, temperature=0.7,
                                      seed=3, extra_body=extra).choices[0]

    c = complete(structured_outputs={"regex": "[0-9]{3}-[a-c]{2}"})
    assert c.finish_reason == "stop" and len(c.text) == 6 and c.text[3] == "-", c.text
    c = complete(structured_outputs={"choice": ["yes", "no", "maybe"]})
    assert c.text in ("yes", "no", "maybe")
    c = complete(structured_outputs={"grammar": 'root ::= "(" [a-z]+ ("," [a-z]+)* ")"'})
    assert c.text.startswith("(") and (c.finish_reason == "length" or c.text.endswith(")")), c.text
    c = complete(300, response_format=FORMAT)
    jsonschema.validate(json.loads(c.text), SCHEMA)
    c = complete(300, structured_outputs={"json": SCHEMA})
    jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "speculative": {"method": "mjsd-lossy"}}, "speculative.method"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_grammars_are_400s_naming_the_field(oai, body, param, stream):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, stream=stream, extra_body=body)
    assert info.value.body["param"] == param, info.value.body


def test_a_bad_schema_fails_alone_while_other_requests_go_on(srv):
    before = errors(srv)

    async def main():
        ac = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        good = [ac.chat.completions.create(model=MODEL, messages=MSG, response_format=FORMAT, temperature=0.9,
                                           seed=i, max_tokens=300) for i in range(4)]
        bad = [ac.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "required": 5}}})
            for _ in range(4)]
        return await asyncio.gather(*good, *bad, return_exceptions=True)

    results = asyncio.run(main())
    for r in results[:4]:
        assert not isinstance(r, Exception), r
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert all(isinstance(r, openai.BadRequestError) for r in results[4:])
    assert errors(srv) == before
