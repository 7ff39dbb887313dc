"""bench_structured.py's own logic, without models: its 52 schemas compile and are varied, BFCL's
parameter types become JSON Schema, and the rows count what they say."""

from __future__ import annotations

import json

from benchmarks.bench_structured import bfcl_row, calls_of, json_row, json_schema, schemas, tools_of
from engine.grammar import Grammars, GrammarSpec
from server.tools import tool_grammar
from tests.fakes import make_tokenizer


def test_the_schemas_are_many_varied_and_compile():
    items = schemas()
    assert len(items) >= 50 and len({it["name"] for it in items}) == len(items)
    assert sum(it["key_heavy"] for it in items) >= 10
    text = json.dumps([it["schema"] for it in items])
    for feature in ('"anyOf"', '"$ref"', '"enum"', '"pattern"', '"maxItems"', '"minimum"', '"const"'):
        assert feature in text, feature
    tok = make_tokenizer()
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])
    for it in items:
        grammars.compile(GrammarSpec.json_schema(it["schema"]))


def test_bfcl_parameters_become_json_schema_and_compile():
    case = {"function": [{"name": "spotify.play", "description": "Play", "parameters": {
        "type": "dict", "properties": {"type": {"type": "string"}, "minutes": {"type": "float"},
                                       "pair": {"type": "tuple", "items": {"type": "any"}},
                                       "opts": {"type": "dict", "properties": {"x": {"type": "integer"}}}},
        "required": ["type"]}}]}
    tools = tools_of(case)
    params = tools[0]["function"]["parameters"]
    assert params["type"] == "object" and params["properties"]["type"] == {"type": "string"}
    assert params["properties"]["minutes"]["type"] == "number" and params["properties"]["pair"]["type"] == "array"
    assert "type" not in params["properties"]["pair"]["items"] and params["properties"]["opts"]["type"] == "object"
    assert json_schema({"type": "dict"}) == {"type": "object"}
    tok = make_tokenizer()
    Grammars(tok, len(tok), [tok.eos_token_id]).compile(tool_grammar(tools, "required", True))


def test_rows_count_valid_outputs_and_correct_calls():
    items = [{"schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}] * 3
    result = dict(tokens=5, ttft=0.1, e2e=0.5, drafted=4, accepted=2, calls=[])
    outs = [dict(result, text='{"a": 1}', finish="stop"), dict(result, text='{"a": "x"}', finish="stop"),
            dict(result, text='{"a": 1', finish="length")]
    row = json_row("m", items, outs)
    assert (row["finished"], row["valid"], row["acceptance"]) == (2, 1, 0.5)
    assert row["decode_tok_s"] == 4 * 3 / (0.4 * 3)
    cases = [{"function": [], "answer": [], "category": "simple_python"}] * 2
    calls = [dict(result, text="", finish="tool_calls", calls=[{"name": "f", "arguments": '{"x": 1}'}]),
             dict(result, text="", finish="tool_calls", calls=[{"name": "f", "arguments": "{bad"}])]
    assert calls_of(calls[0]) == [{"f": {"x": 1}}] and calls_of(calls[1]) is None
    row = bfcl_row("m", cases, calls, lambda f, out, answer, cat: {"valid": out == [{"f": {"x": 1}}]})
    assert (row["parse_rate"], row["accuracy"], row["acc_simple_python"]) == (0.5, 0.5, 0.5)
