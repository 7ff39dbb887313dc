"""Pydantic v2 models of the OpenAI API subset we serve, plus our extensions.

Requests are validated strictly (``"max_tokens": "5"`` is a type error, as with OpenAI) but
unknown fields are ignored, like OpenAI does.  Fields that would *change the meaning* of a request
but that we cannot honour (``suffix``) are rejected with a
clear message instead of being silently dropped; the JSON schema says so, and says which fields
depend on which (``stream_options`` needs ``stream``, ``top_logprobs`` needs ``logprobs``).

Structured outputs: ``response_format`` (``json_object``, ``json_schema``) on both endpoints, and the
``structured_outputs`` extension (``json``, ``regex``, ``grammar``, ``choice``, as vLLM's).

Extensions: the request field ``speculative`` (per-request speculation settings) and
``usage.speculative`` (per-request speculation statistics); ``repetition_penalty``, ``top_k``,
``min_p``, ``ignore_eos``, ``stop_token_ids`` and (chat) ``chat_template_kwargs`` as in vLLM.  vLLM's
``/tokenize`` and ``/detokenize`` bodies and responses are here too.

The ``to_sampling_params`` / ``to_spec_options`` methods translate into the engine's contracts
(:mod:`engine.request`); the routes never touch OpenAI field semantics themselves.
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, field_validator,
                      model_validator)

from engine.grammar import EBNF, JSON, JSON_OBJECT_SCHEMA, REGEX, GrammarSpec
from engine.request import SamplingParams, SpecOptions
from engine.registry import method_names, methods
from server.tools import decode_arguments, tool_grammar

MAX_STOP = 16  # OpenAI allows 4; be lenient
MAX_STOP_CHARS = 1024  # per stop string (matching holds back at most this much text)
TOKEN_ID_KEY = r"^[0-9]{1,9}$"  # a logit_bias key: a token id (any vocabulary is far smaller than 10**9)
MAX_LOGPROBS = 20


def _integral(v: Any) -> Any:
    """JSON has one number type: ``1.0`` is an integer to JSON Schema (and to JavaScript clients), so an
    integral float is taken as that integer; ``1.5`` and ``"1"`` still fail strict validation."""
    return int(v) if type(v) is float and v.is_integer() else v


INTEGRAL = BeforeValidator(_integral)  # on every integer field of a request, after its bounds (so the
# JSON schema keeps them as minimum/maximum)
NonNegInt = Annotated[int, Field(ge=0), INTEGRAL]


class FieldError(ValueError):
    """A cross-field check that failed; ``param`` names the field to blame in the error object
    (pydantic reports model-level errors without a location), ``code`` the kind of refusal when it
    is one no JSON schema can state (a value that must name another field's value)."""

    def __init__(self, param: str, message: str, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class CodedValueError(ValueError):
    """A field's value refused for a reason no JSON schema can state (whether a string holds JSON);
    ``code`` names the kind, the error's location the field."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------------- request parts
class SpeculativeOptions(_Request):
    """Extension: ``{"speculative": {"enabled": false}}`` turns speculation off for one request;
    ``max_depth`` caps the drafted depth, ``tree`` gives widths per depth (e.g. ``[4, 2, 2]``);
    ``method`` picks the speculation method (the registered ones, ``engine.registry``; those named
    ``*-lossy`` are lossy), default: the server's ``--spec-method``; ``adaptive: false`` drafts the whole tree every step on an adaptive server
    (fixed speculation length for this request)."""

    enabled: bool = True
    max_depth: Optional[Annotated[int, Field(ge=0, le=64), INTEGRAL]] = None
    tree: Optional[Annotated[list[Annotated[int, Field(ge=1, le=64), INTEGRAL]], Field(max_length=32)]] = None
    method: Optional[Literal[method_names()]] = None
    adaptive: Optional[bool] = None

    def to_spec_options(self) -> SpecOptions:
        tree = tuple(self.tree) if self.tree is not None else None
        return SpecOptions(enabled=self.enabled, max_depth=self.max_depth, tree=tree, method=self.method,
                           adaptive=self.adaptive)


class StreamOptions(_Request):
    include_usage: bool = False


def _check_stop(v: Any) -> Optional[list[str]]:
    if v is None:
        return None
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError("stop must be a string or a list of strings")
    if len(items) > MAX_STOP:
        raise ValueError(f"stop accepts at most {MAX_STOP} strings, got {len(items)}")
    if any(not s for s in items):
        raise ValueError("stop strings must be non-empty")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise ValueError(f"stop strings may be at most {MAX_STOP_CHARS} characters long, got "
                         f"{max(len(s) for s in items)}")
    return items


def _surrogate_path(v: Any, path: str) -> Optional[str]:
    """The path of the first string in ``v`` holding a lone UTF-16 surrogate (JSON ``"\\ud800"``), which
    no UTF-8 text can carry; None if there is none."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")  # C speed; fails exactly on surrogates
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(v, dict):
        items = v.items()
    elif isinstance(v, list):
        items = enumerate(v)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and _surrogate_path(key, path) is not None:
            return path or "body"
        sub = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
        found = _surrogate_path(item, sub)
        if found is not None:
            return found
    return None


def _only_when(field: str, condition: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema for "``field`` must be null or absent unless ``condition`` holds" (a cross-field rule
    the server enforces with a 400; said in the schema so that clients and fuzzers know it)."""
    return {"if": {"properties": condition, "required": list(condition)},
            "else": {"properties": {field: {"type": "null"}}}}


def _never_with(field: str, condition: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema for "``field`` must be null or absent when ``condition`` holds"."""
    return {"if": {"properties": condition, "required": list(condition)},
            "then": {"properties": {field: {"type": "null"}}}}


_STREAM_OPTIONS_RULE = _only_when("stream_options", {"stream": {"const": True}})
_NO_PENALTIES = {  # the methods whose rule keeps no token history refuse penalties (engine.registry.Method)
    "if": {"properties": {"speculative": {"type": "object", "required": ["method"], "properties": {
        "method": {"enum": [m.name for m in methods() if not m.penalties]}}}}, "required": ["speculative"]},
    "then": {"properties": {"presence_penalty": {"const": 0}, "frequency_penalty": {"const": 0},
                            "repetition_penalty": {"const": 1}}}}


class _TextRequest(_Request):
    """A request body carrying text: a lone surrogate anywhere in it is a 400 naming the field (no tokenizer
    or JSON response could carry it)."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        where = _surrogate_path(data, "")
        if where is not None:
            raise FieldError(where, "the text contains a lone UTF-16 surrogate (e.g. \\ud800), which is not "
                                    "valid Unicode; send well-formed UTF-8 text")
        return data


class _SamplingFields(_TextRequest):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS_RULE, _NO_PENALTIES]})

    model: Optional[str] = None
    max_tokens: Optional[Annotated[int, Field(ge=1), INTEGRAL]] = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1), INTEGRAL] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    n: Annotated[int, Field(ge=1, le=128), INTEGRAL] = 1
    stop: Optional[Any] = None
    seed: Optional[Annotated[int, INTEGRAL]] = Field(None, description="any integer; the sampler uses it modulo 2**64")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]]] = Field(
        None, json_schema_extra={"anyOf": [{"type": "object", "propertyNames": {"pattern": TOKEN_ID_KEY},
                                            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
                                           {"type": "null"}]})
    user: Optional[str] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[NonNegInt]] = None
    speculative: Optional[SpeculativeOptions] = None

    @field_validator("stop", mode="before")
    @classmethod
    def _validate_stop(cls, v: Any) -> Optional[list[str]]:
        return _check_stop(v)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for key in v or {}:
            if not re.fullmatch(TOKEN_ID_KEY, key):
                shown = key if len(key) <= 24 else key[:24] + "..."
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {shown!r}")
        return v

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def candidates(self) -> int:
        """Completions generated per prompt (``n``; completions' ``best_of`` may ask for more)."""
        return self.n

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def top_logprobs_count(self) -> Optional[int]:
        raise NotImplementedError

    def to_sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        """Engine parameters for choice ``choice`` of this request (seed + choice when seeded,
        so the n choices differ but the request is reproducible)."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            seed=None if self.seed is None else self.seed + choice,
            max_tokens=max_tokens, stop=list(self.stop or []), stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, logprobs=self.top_logprobs_count())

    def to_spec_options(self, default_enabled: bool = True) -> SpecOptions:
        """The request's ``speculative`` field, or the server's default when it has none."""
        return (self.speculative or SpeculativeOptions(enabled=default_enabled)).to_spec_options()


# ---------------------------------------------------------------------------- structured outputs
class JsonSchemaFormat(_Request):
    """OpenAI's ``response_format.json_schema``."""

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(json_schema_extra={"if": {"properties": {"type": {"const": "json_schema"}}},
                                                 "then": {"required": ["json_schema"],
                                                          "properties": {"json_schema": {"type": "object"}}}})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("response_format.json_schema", 'response_format of type "json_schema" needs a '
                                                            '"json_schema" object with a "name" and a "schema"')
        return self

    def grammar(self) -> Optional[GrammarSpec]:
        if self.type == "json_object":
            return GrammarSpec(JSON, JSON_OBJECT_SCHEMA, "response_format")
        if self.type == "json_schema":
            schema = self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
            return GrammarSpec.json_schema(schema, "response_format.json_schema.schema")
        return None


def _exactly_one(schema: dict[str, Any]) -> None:
    """The JSON schema of an object that takes exactly one of its (non-null) fields."""
    for prop in schema["properties"].values():
        alternatives = [a for a in prop.pop("anyOf", []) if a.get("type") != "null"]
        if alternatives:
            prop["anyOf"] = alternatives
        prop.pop("default", None)
    schema.update(minProperties=1, maxProperties=1)


class StructuredOutputs(_Request):
    """The ``structured_outputs`` extension (as vLLM's): exactly one of a JSON schema, a regular
    expression, an EBNF grammar (xgrammar's dialect, GBNF-like) or a list of choices."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_exactly_one)

    json_: Optional[Any] = Field(None, alias="json", json_schema_extra={"anyOf": [
        {"type": "object"}, {"type": "string"}, {"type": "null"}]})
    regex: Optional[Annotated[str, Field(min_length=1)]] = None
    grammar: Optional[Annotated[str, Field(min_length=1)]] = None
    choice: Optional[Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]] = None

    def spec(self) -> GrammarSpec:
        given = self.model_fields_set  # a field sent as null counts: the object holds one constraint
        if len(given) != 1 or getattr(self, next(iter(given))) is None:
            raise FieldError("structured_outputs", "structured_outputs takes exactly one of json, regex, grammar "
                                                   "and choice")
        if self.json_ is not None:
            if not isinstance(self.json_, (dict, str)):
                raise FieldError("structured_outputs.json", "structured_outputs.json must be a JSON schema (an "
                                                            "object, or a string holding one)")
            return GrammarSpec.json_schema(self.json_, "structured_outputs.json")
        if self.regex is not None:
            return GrammarSpec(REGEX, self.regex, "structured_outputs.regex")
        if self.grammar is not None:
            return GrammarSpec(EBNF, self.grammar, "structured_outputs.grammar")
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        return GrammarSpec(EBNF, f"root ::= {alternatives}", "structured_outputs.choice")


_JSON_FORMAT = {"type": "object", "properties": {"type": {"enum": ["json_object", "json_schema"]}}, "required": ["type"]}
_ONE_CONSTRAINT = _never_with("structured_outputs", {"response_format": _JSON_FORMAT})
_LOSSY_HAS_NO_GRAMMAR = {  # the engine verifies a grammar's masked law with the lossless rule only
    "if": {"properties": {"speculative": {"type": "object", "required": ["method"], "properties": {
        "method": {"enum": [m.name for m in methods() if not m.grammar]}, "enabled": {"const": True}}}},
        "required": ["speculative"]},
    "then": {"properties": {"structured_outputs": {"type": "null"},
                            "response_format": {"not": _JSON_FORMAT}}}}


_FORCED_TOOL = {"anyOf": [{"const": "required"}, {"type": "object"}]}  # tool_choice required or named
_TOOL_RULES = [
    {"if": {"properties": {"tool_choice": _FORCED_TOOL}, "required": ["tool_choice"]},
     "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1},
                                                   "structured_outputs": {"type": "null"},
                                                   "response_format": {"not": _JSON_FORMAT}}}},
    {**_LOSSY_HAS_NO_GRAMMAR, "then": {"properties": {"tool_choice": {"not": _FORCED_TOOL}}}},
]


class _ConstrainedFields(_Request):
    """``response_format`` and the ``structured_outputs`` extension, on both endpoints."""

    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None

    def grammar_spec(self) -> Optional[GrammarSpec]:
        """What the output must match (None: free text)."""
        fmt = self.response_format.grammar() if self.response_format is not None else None
        extra = self.structured_outputs.spec() if self.structured_outputs is not None else None
        if fmt is not None and extra is not None:
            raise FieldError("structured_outputs", "give either response_format or structured_outputs, not both")
        return fmt or extra


# ---------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields, _ConstrainedFields):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        _STREAM_OPTIONS_RULE, _NO_PENALTIES, _never_with("logprobs", {"echo": {"const": True}}),
        _ONE_CONSTRAINT, _LOSSY_HAS_NO_GRAMMAR]})

    # validated by _check_prompt (clear messages); the schema says what that accepts
    prompt: Any = Field(..., json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
         "minItems": 1}]})
    echo: bool = False
    logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL]] = None
    suffix: Optional[str] = Field(None, description="Not supported: only null or an empty string.",
                                  json_schema_extra={"anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}]})
    best_of: Optional[Annotated[int, Field(ge=1, le=128), INTEGRAL]] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v: Any) -> str | list[str] | list[int] | list[list[int]]:
        """One of: a string, a list of strings, a list of token ids, a list of token-id lists."""
        msg = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
        is_ids = lambda x: isinstance(x, list) and all(type(t) is int and t >= 0 for t in x)  # noqa: E731
        if isinstance(v, list):  # token ids may come as integral floats too
            v = [[_integral(t) for t in p] if isinstance(p, list) else _integral(p) for p in v]
        if isinstance(v, str):
            return v
        if not isinstance(v, list) or not v:
            raise ValueError(msg if not isinstance(v, list) else "prompt must not be empty")
        if all(isinstance(p, str) for p in v) or is_ids(v):
            return v
        if all(is_ids(p) and p for p in v):
            return v
        raise ValueError(msg)

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.suffix:
            raise FieldError("suffix", "suffix is not supported by this server")
        return self

    @property
    def candidates(self) -> int:
        """Completions generated per prompt: ``best_of`` (the ``n`` with the highest total log
        probability are returned), never fewer than ``n``."""
        return max(self.n, self.best_of or 0)

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        return list(p) if isinstance(p[0], (str, list)) else [p]

    def top_logprobs_count(self) -> Optional[int]:
        if self.candidates > self.n:
            return self.logprobs or 0  # ranking the candidates needs each sampled token's log probability
        return self.logprobs


# ---------------------------------------------------------------------------- tools
TOOL_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments (an object)
    strict: Optional[bool] = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: Annotated[str, Field(pattern=TOOL_NAME)]


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Request):
    name: str
    arguments: Any = None  # a JSON string (as OpenAI sends it) or an object

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, v: Any) -> Any:
        """A string must hold JSON (the chat template gets it decoded): a 400 here, not a failure later."""
        try:
            decoded = decode_arguments(v)
        except ValueError:
            raise CodedValueError("a call's arguments must be an object or a string holding JSON",
                                  "invalid_tool_arguments") from None
        if _surrogate_path(decoded, "") is not None:
            raise CodedValueError("a call's arguments contain a lone UTF-16 surrogate, which is not valid Unicode",
                                  "invalid_tool_arguments")
        return v


class ToolCallInput(_Request):
    """A call in an assistant message of the history."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


# ---------------------------------------------------------------------------- chat
class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Any] = Field(None, json_schema_extra={"anyOf": [  # what _check_content accepts
        {"type": "string"},
        {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}},
        {"type": "null"}]})
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallInput]] = None  # an assistant's calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates read it (a call's arguments decoded from their JSON string)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": decode_arguments(c.function.arguments)}}
                for c in self.tool_calls]
        return out

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, v: Any) -> Optional[str]:
        """A string, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) for p in v):
            if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in v):
                raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
            return "".join(p["text"] for p in v)
        raise ValueError("content must be a string or a list of text content parts")


# what ``apply_chat_template`` takes itself, or passes the template under these names: not template variables
TEMPLATE_RESERVED = ("conversation", "conversations", "messages", "tools", "documents", "chat_template",
                     "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
                     "padding", "truncation", "max_length", "return_tensors", "return_dict",
                     "return_assistant_tokens_mask", "tokenizer_kwargs")


class _TemplateKwargs(_Request):
    """vLLM's ``chat_template_kwargs``: more variables for the model's chat template (e.g. Qwen3's
    ``{"enable_thinking": false}``); a variable the template does not read changes nothing."""

    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description="more variables for the chat template, e.g. {\"enable_thinking\": false}; not the "
                          "names apply_chat_template takes itself (messages, tools, add_generation_prompt, ...)",
        json_schema_extra={"anyOf": [{"type": "object", "propertyNames": {"not": {"enum": list(TEMPLATE_RESERVED)}}},
                                     {"type": "null"}]})

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, v: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        taken = sorted(set(v or {}) & set(TEMPLATE_RESERVED))
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)} (a parameter of its own, not a "
                             "template variable)")
        return v


class ChatCompletionRequest(_SamplingFields, _ConstrainedFields, _TemplateKwargs):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        _STREAM_OPTIONS_RULE, _NO_PENALTIES, _only_when("top_logprobs", {"logprobs": {"const": True}}),
        _ONE_CONSTRAINT, _LOSSY_HAS_NO_GRAMMAR, *_TOOL_RULES]})

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=1), INTEGRAL]] = None
    logprobs: bool = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL]] = None
    tools: Optional[Annotated[list[ToolDefinition], Field(max_length=128)]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldError("tools", "tool names must be unique", "duplicate_tool_name")
        if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            if not names:
                raise FieldError("tool_choice", "tool_choice names a tool but tools is empty")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise FieldError("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not "
                                                "one of the tools", "unknown_tool")
        return self

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_count(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    @property
    def tool_mode(self) -> Optional[str]:
        """How the tools are used: None (no tools, or ``tool_choice`` none: not rendered, nothing
        parsed), ``auto``, ``required`` or ``named``."""
        if not self.tools or self.tool_choice == "none":
            return None
        return "named" if isinstance(self.tool_choice, NamedToolChoice) else (self.tool_choice or "auto")

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        """The tools for the chat template (None when they are not rendered)."""
        if self.tool_mode is None:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def grammar_spec(self) -> Optional[GrammarSpec]:
        spec = super().grammar_spec()
        if self.tool_mode not in ("required", "named"):
            return spec
        if spec is not None:
            raise FieldError("tool_choice", "a required or named tool_choice cannot be combined with "
                                            "response_format or structured_outputs")
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return tool_grammar(self.template_tools(), choice, self.parallel_tool_calls)


# ---------------------------------------------------------------------------- tokenizer endpoints
class TokenizeCompletionRequest(_TextRequest):
    """``POST /tokenize``, completion form (vLLM's): the token ids ``/v1/completions`` makes of ``prompt``."""

    model_config = ConfigDict(json_schema_extra={"not": {"required": ["messages"]}})

    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_TemplateKwargs, _TextRequest):
    """``POST /tokenize``, chat form (vLLM's): the token ids ``/v1/chat/completions`` makes of ``messages``
    (and ``tools``) with the defaults; ``continue_final_message`` (with ``add_generation_prompt`` false)
    leaves the last message open for the model to continue."""

    model_config = ConfigDict(json_schema_extra={"not": {"required": ["prompt"]}, "allOf": [{
        "if": {"properties": {"continue_final_message": {"const": True}}, "required": ["continue_final_message"]},
        "then": {"properties": {"add_generation_prompt": {"const": False}}, "required": ["add_generation_prompt"]}}]})

    model: Optional[str] = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Optional[Annotated[list[ToolDefinition], Field(max_length=128)]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _one_form(cls, data: Any) -> Any:
        if isinstance(data, dict) and "prompt" in data:
            raise FieldError("prompt", "give either prompt (completion form) or messages (chat form), not both")
        return data

    @model_validator(mode="after")
    def _check_continue(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "continue_final_message needs add_generation_prompt false: "
                                                       "the final message is continued, no new one is started")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        """The tools as a chat completion with ``tool_choice`` auto renders them."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


def _tokenize_form(data: Any) -> str:
    return "TokenizeChatRequest" if isinstance(data, dict) and "messages" in data else "TokenizeCompletionRequest"


# the body of POST /tokenize: the chat form when it has ``messages``, else the completion form; pydantic names
# the form in a validation error's location, which is not a field (see ``REQUEST_FORMS``)
TokenizeRequest = Annotated[Union[Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")],
                                  Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")]],
                            Discriminator(_tokenize_form)]
REQUEST_FORMS = frozenset({"TokenizeCompletionRequest", "TokenizeChatRequest"})


class DetokenizeRequest(_TextRequest):
    """``POST /detokenize`` (vLLM's): the text of ``tokens`` (ids below the vocabulary size)."""

    model: Optional[str] = None
    tokens: list[NonNegInt]


# ---------------------------------------------------------------------------- responses
class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


class SpecUsageInfo(_Response):
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    note: Optional[str] = None  # why speculation did not run, when it did not


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    speculative: Optional[SpecUsageInfo] = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatLogprobToken] = Field(default_factory=list)


class FunctionCall(_Response):
    name: Optional[str] = None
    arguments: str = ""


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(_Response):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = ""
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None


class DeltaMessage(_Response):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[UsageInfo] = None


class CompletionChunk(CompletionResponse):
    """Streamed completions reuse the response shape (``object`` stays ``text_completion``)."""


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mcsd"
    max_model_len: Optional[int] = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(_Response):
    error: ErrorInfo
