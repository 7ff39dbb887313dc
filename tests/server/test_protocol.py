"""Request validation of every field, translation into engine contracts, and error objects."""

from __future__ import annotations

import re

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from server.errors import from_validation_error
from server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse

MSG = [{"role": "user", "content": "hi"}]


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **kw})


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSG, **kw})


def api_error(model, body: dict):
    """The OpenAI error FastAPI's handler would return for ``body``."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return from_validation_error(RequestValidationError(errors))


@pytest.mark.parametrize("prompt, expected", [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", [5, None, [], [1, "a"], [[1], []], [-1], [True], {"text": "x"}, [[1], "a"]])
def test_bad_prompts_name_the_field(prompt):
    err = api_error(CompletionRequest, {"prompt": prompt})
    assert (err.status, err.param) == (400, "prompt")


def test_defaults_translate_to_engine_params():
    req = completion()
    sp = req.to_sampling_params(max_tokens=16, choice=0)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed, sp.logprobs, sp.stop) == (1.0, 1.0, 0, 0.0, None, None, [])
    spec = req.to_spec_options()
    assert spec.enabled and spec.max_depth is None and spec.tree is None
    assert req.to_spec_options(default_enabled=False).enabled is False


def test_every_sampling_field_is_carried():
    req = chat(temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=7, stop="x", presence_penalty=0.5,
               frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={"3": -100, "4": 2.5}, ignore_eos=True,
               stop_token_ids=[9], logprobs=True, top_logprobs=3, user="u1", n=3,
               speculative={"enabled": False, "max_depth": 2, "tree": [3, 1], "method": "mcsd", "adaptive": False})
    sp = req.to_sampling_params(max_tokens=10, choice=2)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.5, 0.9, 5, 0.1)
    assert sp.seed == 9  # seed + choice
    assert sp.stop == ["x"] and sp.stop_token_ids == [9] and sp.ignore_eos
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.2)
    assert sp.logit_bias == {3: -100.0, 4: 2.5}
    assert sp.logprobs == 3 and sp.max_tokens == 10
    spec = req.to_spec_options()
    assert (spec.enabled, spec.max_depth, spec.tree, spec.method, spec.adaptive) == (False, 2, (3, 1), "mcsd", False)
    assert chat().to_spec_options().adaptive is None
    assert api_error(ChatCompletionRequest, {"messages": MSG, "speculative": {"adaptive": "sometimes"}}).status == 400


def test_logprobs_forms():
    assert chat(logprobs=True).top_logprobs_count() == 0
    assert chat().top_logprobs_count() is None
    assert completion(logprobs=2).top_logprobs_count() == 2
    assert api_error(ChatCompletionRequest, {"messages": MSG, "top_logprobs": 2}).param == "top_logprobs"
    assert api_error(CompletionRequest, {"prompt": "x", "logprobs": True}).param == "logprobs"  # int for completions
    assert api_error(CompletionRequest, {"prompt": "x", "logprobs": 21}).param == "logprobs"


def test_max_completion_tokens_alias():
    assert chat(max_tokens=5).requested_max_tokens() == 5
    assert chat(max_completion_tokens=7, max_tokens=5).requested_max_tokens() == 7
    assert chat().requested_max_tokens() is None


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", "5"), ("max_tokens", 1.5), ("temperature", -0.1), ("temperature", 2.5),
    ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5), ("n", 0), ("n", 129),
    ("seed", "1"), ("seed", 1.5), ("stream", "yes"), ("stream", 1), ("presence_penalty", 3),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0), ("logit_bias", {"x": 1}), ("logit_bias", {"1": 200}),
    ("user", 5), ("echo", "no"), ("stop_token_ids", [-1]), ("ignore_eos", "true"),
])
def test_out_of_range_and_wrong_types(field, value):
    err = api_error(CompletionRequest, {"prompt": "x", field: value})
    assert err.status == 400
    assert err.param is not None and re.split(r"[.\[]", err.param)[0] == field
    assert err.code in ("invalid_value", "invalid_type")


@pytest.mark.parametrize("stop", [["a"] * 17, [""], "", [1], 3])
def test_bad_stop(stop):
    assert api_error(CompletionRequest, {"prompt": "x", "stop": stop}).param == "stop"


def test_stop_forms():
    assert completion(stop="a").stop == ["a"]
    assert completion(stop=["a", "b"] * 8).stop == ["a", "b"] * 8
    assert completion(stop=None).stop is None


@pytest.mark.parametrize("spec, param", [
    ({"enabled": "no"}, "speculative.enabled"), ({"max_depth": -1}, "speculative.max_depth"),
    ({"max_depth": 65}, "speculative.max_depth"), ({"tree": [0]}, "speculative.tree[0]"),
    ({"tree": "4,2"}, "speculative.tree"), ({"method": ""}, "speculative.method"), ("on", "speculative"),
])
def test_speculative_extension_validated(spec, param):
    assert api_error(ChatCompletionRequest, {"messages": MSG, "speculative": spec}).param == param


def test_stream_options_require_stream():
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True).include_usage
    err = api_error(CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}})
    assert err.param == "stream_options" and "stream" in err.message
    assert api_error(CompletionRequest, {"prompt": "x", "stream": True,
                                         "stream_options": {"include_usage": 1}}).param == "stream_options.include_usage"


def test_unknown_fields_ignored_unsupported_ones_rejected():
    assert completion(frobnicate=True, metadata={"a": 1}).prompt == "hi"
    assert api_error(CompletionRequest, {"prompt": "x", "suffix": "y"}).param == "suffix"
    assert completion(best_of=1).n == 1 and completion(best_of=1).candidates == 1
    assert completion(best_of=3, n=2).candidates == 3 and completion(best_of=1, n=2).candidates == 2
    assert completion(best_of=3).top_logprobs_count() == 0  # ranking needs the sampled tokens' logprobs
    assert completion(best_of=3, logprobs=2).top_logprobs_count() == 2 and completion().top_logprobs_count() is None


def test_integral_floats_are_integers_as_in_json_schema():
    body = completion(n=2.0, max_tokens=5.0, prompt=[1.0, 2])
    assert (body.n, body.max_tokens, body.prompt) == (2, 5, [1, 2])
    assert type(body.n) is int
    assert api_error(CompletionRequest, {"prompt": "x", "n": 1.5}).param == "n"
    assert api_error(CompletionRequest, {"prompt": "x", "n": "1"}).param == "n"
    assert api_error(CompletionRequest, {"prompt": [1.5]}).param == "prompt"
    assert api_error(ChatCompletionRequest, {"messages": MSG, "tools": [{"type": "function"}]}).param \
        == "tools[0].function"  # a function tool needs its function
    assert chat(response_format={"type": "text"}).grammar_spec() is None
    assert chat(response_format={"type": "json_object"}).grammar_spec().kind == "json"
    assert api_error(ChatCompletionRequest, {"messages": MSG, "response_format": {"type": "xml"}}).param \
        == "response_format.type"


def test_messages():
    parts = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert parts.template_messages() == [{"role": "user", "content": "ab"}]
    named = chat(messages=[{"role": "system", "content": "s", "name": "x"}, {"role": "assistant", "content": None}])
    assert named.template_messages() == [{"role": "system", "content": "s", "name": "x"},
                                         {"role": "assistant", "content": ""}]
    assert api_error(ChatCompletionRequest, {"messages": []}).param == "messages"
    assert api_error(ChatCompletionRequest, {"messages": [{"role": "bot", "content": "x"}]}).param == "messages[0].role"
    img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert api_error(ChatCompletionRequest, {"messages": img}).param == "messages[0].content"
    assert api_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}).param == "messages[0].content"
    missing = api_error(ChatCompletionRequest, {"messages": [{"content": "x"}]})
    assert (missing.param, missing.code) == ("messages[0].role", "missing_required_parameter")
    assert api_error(ChatCompletionRequest, {}).param == "messages"


def test_error_object_shape():
    err = api_error(CompletionRequest, {"prompt": "x", "temperature": "hot", "n": 0})
    body = err.to_response().model_dump()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert "1 more error" in body["error"]["message"]
    ErrorResponse.model_validate(body)


def test_json_and_body_errors():
    bad_json = from_validation_error(RequestValidationError([{"type": "json_invalid", "loc": ("body", 1),
                                                              "msg": "JSON decode error", "ctx": {"error": "x"}}]))
    assert (bad_json.status, bad_json.code, bad_json.param) == (400, "invalid_json", None)
    no_body = from_validation_error(RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}]))
    assert no_body.status == 400 and "required" in no_body.message
