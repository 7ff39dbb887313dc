"""The small endpoints: ``/tokenize`` and ``/detokenize`` (vLLM's shapes), ``/version`` and
``/v1/models/{id}``, on a real uvicorn with the fake core (tests/fakes.py)."""

from __future__ import annotations

import importlib.metadata
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from server import app as app_module
from server.app import create_app
from server.protocol import ChatCompletionRequest
from server.serving import OpenAIServing
from server.settings import Settings
from tests import ROOT
from tests.fakes import TOOL_TEMPLATE, FakeCore, ServerThread, make_tokenizer, make_tool_tokenizer
from tests.server.test_app import CHAT_ECHO, MODEL, MSG, client, error_of, serve

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]



def CALL(arguments) -> dict:  # noqa: N802 - reads as the message it builds
    """An assistant message of the history that called a tool with ``arguments``."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


@pytest.fixture(scope="module")
def srv():
    with serve(FakeCore(max_batch=4)) as s:
        yield s


def post(srv, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, **kw)
    return httpx.post(srv.url + path, json=body, **kw)


def tokenize(srv, **body) -> dict:
    r = post(srv, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()


def served_ids(core: FakeCore, **chat) -> list[int]:
    """The prompt ids the chat completions path builds (the function serving uses) for a chat request."""
    serving = OpenAIServing(SimpleNamespace(core=core), Settings(served_model_name=MODEL))
    return serving.chat_prompt(ChatCompletionRequest.model_validate({"model": MODEL, **chat})).token_ids


# ---------------------------------------------------------------------------- /tokenize, /detokenize
def test_tokenize_a_prompt(srv):
    tok = make_tokenizer()
    out = tokenize(srv, model=MODEL, prompt="hello world, the quick brown fox")
    assert out["tokens"] == tok.encode("hello world, the quick brown fox")
    assert out == {"count": len(out["tokens"]), "max_model_len": 256, "tokens": out["tokens"], "token_strs": None}
    strs = tokenize(srv, prompt="hello world", return_token_strs=True)  # model is optional
    assert strs["token_strs"] == tok.convert_ids_to_tokens(strs["tokens"]) == ["hell", "o", "Ġwor", "ld"]


def test_tokenize_counts_what_completions_count(srv):
    usage = client(srv).completions.create(model=MODEL, prompt="once upon a time", max_tokens=1).usage
    assert tokenize(srv, prompt="once upon a time")["count"] == usage.prompt_tokens


def test_tokenize_counts_any_length_and_empty_prompts(srv):
    long = "the lazy dog " * 200  # far past the 256-token context: counted, not refused
    out = tokenize(srv, prompt=long)
    assert out["count"] == len(make_tokenizer().encode(long)) > out["max_model_len"] == 256
    assert tokenize(srv, prompt="") == {"count": 0, "max_model_len": 256, "tokens": [], "token_strs": None}
    # this tokenizer adds no special tokens; the flag is passed on all the same
    assert tokenize(srv, prompt="hi", add_special_tokens=False)["tokens"] == make_tokenizer().encode("hi")


def test_tokenize_a_chat_gives_the_chat_completion_prompt(srv):
    core = FakeCore()
    out = tokenize(srv, model=MODEL, messages=MSG)
    assert out["tokens"] == served_ids(core, messages=MSG)
    assert make_tokenizer().decode(out["tokens"]) == CHAT_ECHO
    usage = client(srv).chat.completions.create(model=MODEL, messages=MSG, max_tokens=1).usage
    assert out["count"] == usage.prompt_tokens
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
               {"role": "assistant", "content": "hello"}, {"role": "user", "content": "once upon a time"}]
    assert tokenize(srv, messages=history)["tokens"] == served_ids(core, messages=history)


def test_tokenize_chat_options(srv):
    tok = make_tokenizer()
    bare = tokenize(srv, messages=MSG, add_generation_prompt=False, return_token_strs=True)
    assert tok.decode(bare["tokens"]) == "<|user|>hello world\n"
    assert bare["token_strs"] == tok.convert_ids_to_tokens(bare["tokens"])
    prefill = MSG + [{"role": "assistant", "content": "once upon"}]
    cont = tokenize(srv, messages=prefill, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(cont["tokens"]) == "<|user|>hello world\n<|assistant|>once upon"
    assert tokenize(srv, messages=MSG, add_special_tokens=True)["tokens"] == served_ids(FakeCore(), messages=MSG)


def test_detokenize_inverts_tokenize(srv):
    texts = ["hello world", "the quick brown fox jumps", "héllo wörld 🙂 — ünïcode", "  spaces\tand\nlines ", ""]
    for text in texts:
        ids = tokenize(srv, prompt=text)["tokens"]
        r = post(srv, "/detokenize", {"model": MODEL, "tokens": ids})
        assert r.status_code == 200 and r.json() == {"prompt": text}
    eos = make_tokenizer().eos_token_id  # special tokens are decoded too
    assert post(srv, "/detokenize", {"tokens": [eos]}).json() == {"prompt": "<|eos|>"}


def test_template_kwargs_and_tools_reach_the_template_as_in_chat_completions():
    tok = make_tool_tokenizer()
    tok.chat_template = "{% if terse %}<|system|>be terse\n{% endif %}" + TOOL_TEMPLATE
    core = FakeCore(tokenizer=tok)
    with serve(core) as s:
        for extra in ({}, {"chat_template_kwargs": {"terse": True}}, {"tools": TOOLS},
                      {"tools": TOOLS, "chat_template_kwargs": {"terse": True, "unused": [1, 2]}}):
            out = tokenize(s, messages=MSG, **extra)
            assert out["tokens"] == served_ids(core, messages=MSG, **extra)
            usage = client(s).chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, extra_body=extra).usage
            assert out["count"] == usage.prompt_tokens
            text = tok.decode(out["tokens"])
            assert ("be terse" in text) == ("chat_template_kwargs" in extra)
            assert ("You may call: get_weather" in text) == ("tools" in extra)
        # a history call's arguments: a JSON string (as OpenAI clients send them) renders as the object
        as_string = tokenize(s, messages=MSG + [CALL('{"city": "Paris"}')], add_generation_prompt=False)
        as_object = tokenize(s, messages=MSG + [CALL({"city": "Paris"})], add_generation_prompt=False)
        assert as_string == as_object
        assert '"arguments": {"city": "Paris"}}' in tok.decode(as_string["tokens"])


def test_a_model_without_a_chat_template_tokenizes_prompts_only():
    bare = make_tool_tokenizer()
    bare.chat_template = None
    with serve(FakeCore(tokenizer=bare)) as s:
        r = post(s, "/tokenize", {"messages": MSG})
        assert r.status_code == 400 and error_of(r)["param"] == "messages"
        assert tokenize(s, prompt="hi")["tokens"] == bare.encode("hi")


@pytest.mark.parametrize("path, body, param, code", [
    ("/tokenize", b"{not json", None, "invalid_json"),
    ("/tokenize", b"[1, 2]", None, "invalid_body"),
    ("/tokenize", b"", None, "invalid_body"),
    ("/tokenize", {}, "prompt", "missing_required_parameter"),
    ("/tokenize", {"prompt": 5}, "prompt", "invalid_type"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens", "invalid_type"),
    ("/tokenize", {"messages": []}, "messages", "invalid_value"),
    ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_value"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ("/tokenize", {"messages": MSG, "prompt": "x"}, "prompt", "invalid_value"),
    ("/tokenize", {"messages": MSG, "continue_final_message": True}, "continue_final_message", "invalid_value"),
    ("/tokenize", {"messages": MSG, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "invalid_value"),
    ("/tokenize", {"messages": MSG, "chat_template_kwargs": [1]}, "chat_template_kwargs", "invalid_type"),
    ("/tokenize", b'{"prompt": "bad \\ud800 text"}', "prompt", "invalid_value"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content", "invalid_value"),
    ("/detokenize", b'{"model": "\\ud800", "tokens": [1]}', "model", "invalid_value"),
    ("/detokenize", {}, "tokens", "missing_required_parameter"),
    ("/detokenize", {"tokens": "hello"}, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]", "invalid_value"),
    ("/detokenize", {"tokens": [1, 2.5]}, "tokens[1]", "invalid_type"),
    ("/detokenize", {"tokens": [1, 300]}, "tokens", "token_id_out_of_range"),  # the fake vocabulary has 300
    ("/detokenize", {"tokens": [10 ** 12]}, "tokens", "token_id_out_of_range"),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs", "invalid_value"),
    # a history call's arguments string that is not JSON (was a 500 on both routes)
    ("/tokenize", {"messages": MSG + [CALL("{not json")]}, "messages[1].tool_calls[0].function.arguments",
     "invalid_tool_arguments"),
    ("/v1/chat/completions", {"messages": MSG + [CALL("{not json")]}, "messages[1].tool_calls[0].function.arguments",
     "invalid_tool_arguments"),
    ("/tokenize", {"messages": MSG + [CALL('"\\ud800"')]}, "messages[1].tool_calls[0].function.arguments",
     "invalid_tool_arguments"),
])
def test_bad_input_is_an_openai_400(srv, path, body, param, code):
    r = post(srv, path, body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")


def test_detokenize_takes_integral_floats_and_the_empty_list(srv):
    assert post(srv, "/detokenize", {"tokens": [72.0, 73]}).json() == {"prompt": make_tokenizer().decode([72, 73])}
    assert post(srv, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_unknown_model_is_the_completions_404(srv):
    expected = post(srv, "/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert expected.status_code == 404
    for path, body in [("/tokenize", {"model": "gpt-9", "prompt": "x"}),
                       ("/tokenize", {"model": "gpt-9", "messages": MSG}),
                       ("/detokenize", {"model": "gpt-9", "tokens": [1]})]:
        r = post(srv, path, body)
        assert r.status_code == 404 and error_of(r) == error_of(expected)
        assert error_of(r)["code"] == "model_not_found" and error_of(r)["param"] == "model"


def test_request_size_limit_applies():
    with serve(FakeCore(), max_request_bytes=2048) as s:
        for path, body in [("/tokenize", {"prompt": "x" * 5000}), ("/detokenize", {"tokens": [1] * 2000})]:
            r = post(s, path, body)
            assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"


# ---------------------------------------------------------------------------- /version, /v1/models/{id}
def test_version(srv):
    r = httpx.get(srv.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("mcsd-server")}


def test_version_without_an_installed_package(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with open(ROOT / "pyproject.toml", "rb") as f:
        expected = tomllib.load(f)["project"]["version"]
    assert app_module.server_version.__wrapped__() == expected


def test_retrieve_the_served_model(srv):
    listed = httpx.get(srv.url + "/v1/models").json()["data"][0]
    r = httpx.get(srv.url + f"/v1/models/{MODEL}")
    assert r.status_code == 200
    card = r.json()
    assert abs(card.pop("created") - listed.pop("created")) <= 2 and card == listed
    assert card == {"id": MODEL, "object": "model", "owned_by": "mcsd", "max_model_len": 256}
    model = client(srv).models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"


@pytest.mark.parametrize("missing", ["gpt-9", "fake-model-2", "fake-model/x", "x" * 100])
def test_retrieve_an_unknown_model_is_a_404(srv, missing):
    r = httpx.get(srv.url + f"/v1/models/{missing}")
    assert r.status_code == 404
    err = error_of(r)
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "model", "model_not_found")
    with pytest.raises(openai.NotFoundError) as info:
        client(srv).models.retrieve(missing)
    assert info.value.body["code"] == "model_not_found"


def test_model_ids_with_slashes():
    with serve(FakeCore(), served_model_name="org/fake-model") as s:
        assert httpx.get(s.url + "/v1/models/org/fake-model").json()["id"] == "org/fake-model"
        assert httpx.get(s.url + "/v1/models/org%2Ffake-model").json()["id"] == "org/fake-model"
        assert client(s).models.retrieve("org/fake-model").id == "org/fake-model"
        assert httpx.get(s.url + "/v1/models/org").status_code == 404
        assert tokenize(s, model="org/fake-model", prompt="hi")["count"] == 2


def test_the_model_path_is_an_alias_as_in_the_generation_endpoints():
    with serve(FakeCore(), served_model_name="short", model="Org/Checkpoint-1B") as s:
        card = httpx.get(s.url + "/v1/models/Org/Checkpoint-1B").json()
        assert card["id"] == "short"  # the served id, as /v1/models lists it
        assert tokenize(s, model="Org/Checkpoint-1B", prompt="hi")["count"] == 2


# ---------------------------------------------------------------------------- auth, loading, schema
def test_api_key_protects_tokenizer_routes_not_version():
    with serve(FakeCore(), api_key="sekrit") as s:
        key = {"Authorization": "Bearer sekrit"}
        for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
            r = post(s, path, body)
            assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
            assert post(s, path, b"{bad json").status_code == 401  # auth before validation
            assert post(s, path, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert post(s, path, body, headers=key).status_code == 200
        assert httpx.get(s.url + f"/v1/models/{MODEL}").status_code == 401
        assert httpx.get(s.url + f"/v1/models/{MODEL}", headers=key).status_code == 200
        assert httpx.get(s.url + "/version").status_code == 200  # open, like /health
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/tokenizex").status_code == 404  # the prefix match is by path segment


def test_while_loading_tokenizer_routes_are_503_and_version_and_models_answer():
    gate = threading.Event()

    def factory():
        gate.wait(10)
        return FakeCore()

    with ServerThread(create_app(Settings(served_model_name=MODEL), AsyncEngine(factory))) as s:
        for path, body in [("/tokenize", {"prompt": "hi"}), ("/tokenize", {"messages": MSG}),
                           ("/detokenize", {"tokens": [1]})]:
            r = post(s, path, body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert error_of(r)["code"] == "engine_unavailable" and "loading" in error_of(r)["message"]
        assert httpx.get(s.url + "/version").status_code == 200
        card = httpx.get(s.url + f"/v1/models/{MODEL}").json()
        assert card["id"] == MODEL and card["max_model_len"] is None
        gate.set()
        deadline = time.monotonic() + 10
        while post(s, "/tokenize", {"prompt": "hi"}).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert httpx.get(s.url + f"/v1/models/{MODEL}").json()["max_model_len"] == 256


def test_the_openapi_schema_has_the_new_routes(srv):
    spec = httpx.get(srv.url + "/openapi.json").json()
    paths, schemas = spec["paths"], spec["components"]["schemas"]
    body = paths["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {s["$ref"].rsplit("/", 1)[1] for s in body["oneOf"]} == {"TokenizeCompletionRequest", "TokenizeChatRequest"}
    assert set(schemas["TokenizeChatRequest"]["properties"]) >= {
        "model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
        "return_token_strs", "chat_template_kwargs"}
    assert schemas["TokenizeCompletionRequest"]["required"] == ["prompt"]
    assert schemas["DetokenizeRequest"]["required"] == ["tokens"]
    assert set(schemas["TokenizeResponse"]["required"]) == {"count", "max_model_len", "tokens"}

    def ok(path: str, method: str) -> str:
        return paths[path][method]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].rsplit("/")[-1]

    assert ok("/tokenize", "post") == "TokenizeResponse" and ok("/detokenize", "post") == "DetokenizeResponse"
    assert ok("/version", "get") == "VersionResponse" and ok("/v1/models/{model_id}", "get") == "ModelCard"
    assert ok("/v1/models", "get") == "ModelList"
    for path, method in [("/tokenize", "post"), ("/detokenize", "post"), ("/v1/models/{model_id}", "get")]:
        responses = paths[path][method]["responses"]
        assert "422" not in responses and {"401", "404"} <= set(responses)
        assert responses["404"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
