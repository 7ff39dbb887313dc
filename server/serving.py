"""OpenAI completions / chat completions on top of :class:`AsyncEngine`: translate, await, format.

One API call becomes ``len(prompts) * n`` engine requests (``{call_id}-{index}``, choice index =
prompt * n + i, OpenAI's order) submitted all-or-nothing (``len(prompts) * best_of`` for a completions
``best_of``, of which the ``n`` most likely per prompt are returned).  Non-streaming calls collect every
choice; streaming calls turn each engine delta into a chunk as it arrives, so the n choices'
chunks interleave, distinguished by ``index``.  Either way the request group is aborted when the
client goes away: streaming responses are cancelled by Starlette on disconnect, non-streaming ones
race the collection against a disconnect watcher.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import Response

from engine.async_engine import AsyncEngine, EngineErrorOutput, RequestGroup
from engine.grammar import CompiledGrammar, GrammarError
from engine.request import GenerationRequest, RequestOutput, RequestRejected, SpecUsage, TokenLogprob
from server.errors import APIError, bad_request
from server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatLogprobs, ChatLogprobToken, ChatResponseMessage, CompletionChoice, CompletionChunk,
    CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage, DetokenizeRequest,
    DetokenizeResponse, FieldError, FunctionCall, PromptTokensDetails, SpecUsageInfo, TokenizeChatRequest,
    TokenizeCompletionRequest, TokenizeResponse, ToolCall, ToolCallDelta, TopLogprob, UsageInfo,
)
from server.settings import Settings
from server.tools import Event as ToolEvent
from server.tools import ToolCallParser, template_supports_tools
from server.tools import parse as parse_tool_calls
from server.sse import TextEvents, sse_response

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
PROMPT_WORKERS = 2  # threads that tokenize and render chat templates
GRAMMAR_WORKERS = 2  # threads that compile structured-output grammars (cached per schema)
MAX_CHARS_PER_TOKEN = 32  # no tokenizer makes longer tokens in practice; a cheap bound before tokenizing


@dataclass
class Prompt:
    token_ids: list[int]
    text: str  # for echo


@dataclass
class Choice:
    """Everything received so far for one choice."""

    index: int
    prompt_tokens: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: Optional[str] = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec: SpecUsage = field(default_factory=SpecUsage)

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.logprobs.extend(out.logprobs or [])
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        self.spec = out.spec
        if out.finished:
            self.finish_reason = out.finish_reason


def raise_if_error(out: RequestOutput) -> None:
    if isinstance(out, EngineErrorOutput) and out.kind == "invalid_request":
        raise bad_request(out.error or "invalid request", code="invalid_request")
    if isinstance(out, EngineErrorOutput) and out.kind == "shutdown":
        raise APIError(503, out.error or "The server is shutting down.", code="server_shutting_down")
    if out.finish_reason == "error":
        raise APIError(500, out.error or "engine error", code="engine_error")


def best_of(choices: list[Choice], candidates: int, n: int) -> list[Choice]:
    """The ``n`` choices per prompt with the highest total log probability among its ``candidates``
    (earlier first among equals), renumbered ``prompt * n + rank`` (OpenAI's order); ``choices``
    unchanged when ``candidates == n``."""
    if candidates == n:
        return choices
    kept = []
    for p in range(len(choices) // candidates):
        group = choices[p * candidates:(p + 1) * candidates]
        ranked = sorted(group, key=lambda c: -sum(t.logprob for t in c.logprobs))[:n]  # stable
        kept += [replace(c, index=p * n + rank) for rank, c in enumerate(ranked)]
    return kept


def make_usage(prompts: list[Prompt], choices: list[Choice]) -> UsageInfo:
    """Prompt tokens once per prompt (OpenAI), completion tokens and speculation over all choices.
    ``cached_tokens``: per prompt, those its first choice found in the prefix cache (the other
    choices of a prompt find it there anyway: they run beside the first)."""
    prompt = sum(len(p.token_ids) for p in prompts)
    per_prompt = len(choices) // max(len(prompts), 1)
    cached = sum(choices[i].cached_tokens for i in range(0, len(choices), per_prompt)) if choices else 0
    completion = sum(c.completion_tokens for c in choices)
    steps = sum(c.spec.steps for c in choices)
    drafted = sum(c.spec.drafted_tokens for c in choices)
    accepted = sum(c.spec.accepted_tokens for c in choices)
    notes = sorted({c.spec.note for c in choices if c.spec.note})
    spec = SpecUsageInfo(steps=steps, drafted_tokens=drafted, accepted_tokens=accepted,
                         acceptance_rate=accepted / drafted if drafted else 0.0,
                         note="; ".join(notes) or None)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached), speculative=spec)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so receive() only reports that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    """The two generation endpoints and the tokenizer endpoints; routes in :mod:`server.app` only call
    these methods."""

    def __init__(self, engine: AsyncEngine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        # tokenization and chat-template rendering run here, never on the event loop (a megabyte
        # prompt would freeze every stream and /health); bounded, so a burst queues instead of
        # spawning threads
        self._prompt_pool = ThreadPoolExecutor(max_workers=PROMPT_WORKERS, thread_name_prefix="tokenize")
        # grammars compile apart from tokenization, so a slow schema does not hold up other prompts
        self._grammar_pool = ThreadPoolExecutor(max_workers=GRAMMAR_WORKERS, thread_name_prefix="grammar")

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._prompt_pool, fn, *args)

    def check_size(self, chars: int, what: str) -> None:
        """A cheap bound before tokenizing: text longer than ``MAX_CHARS_PER_TOKEN`` characters per token
        of the context cannot fit, whatever the tokenizer makes of it."""
        limit = self.max_model_len
        if chars > limit * MAX_CHARS_PER_TOKEN:
            raise bad_request(f"This model's maximum context length is {limit} tokens, but the {what} has "
                              f"{chars} characters, more than any {limit}-token text. Please shorten the {what}.",
                              param=what, code="context_length_exceeded")

    @property
    def tokenizer(self):
        return self.engine.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.core.max_model_len

    # ------------------------------------------------------------------ translation
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in (self.settings.model_id, self.settings.model):
            shown = model if len(model) <= 64 else model[:64] + "..."
            raise APIError(404, f"The model `{shown}` does not exist. Available: `{self.settings.model_id}`.",
                           param="model", code="model_not_found")

    def completion_prompts(self, body: CompletionRequest) -> list[Prompt]:
        vocab = len(self.tokenizer)
        prompts = []
        for p in body.prompts():
            if isinstance(p, str):
                self.check_size(len(p), "prompt")
                prompts.append(Prompt(self.tokenizer.encode(p), p))
                continue
            if any(t >= vocab for t in p):
                raise bad_request(f"prompt token ids must be < the vocabulary size {vocab}", param="prompt",
                                  code="token_id_out_of_range")
            prompts.append(Prompt(list(p), self.tokenizer.decode(p) if body.echo else ""))
        return prompts

    def chat_prompt(self, body: ChatCompletionRequest) -> Prompt:
        messages = body.template_messages()
        tools = body.template_tools()
        kwargs = body.chat_template_kwargs
        self.check_size(sum(len(m["content"]) for m in messages) + len(json.dumps(tools or []))
                        + len(json.dumps(kwargs or {})), "messages")
        return self.render_chat(messages, tools, template_kwargs=kwargs)

    def render_chat(self, messages: list[dict], tools: Optional[list[dict]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, add_special_tokens: bool = False,
                    template_kwargs: Optional[dict] = None) -> Prompt:
        """Chat messages (and tools) as the prompt the engine gets: the model's chat template, then its
        tokenizer.  The one place this happens, for chat completions (the defaults) and ``/tokenize``."""
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise bad_request("This model has no chat template; use /v1/completions.", param="messages")
        if tools and not template_supports_tools(tok):
            raise bad_request("This model's chat template does not render tools.", param="tools",
                              code="tools_not_supported")
        try:
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, tokenize=False,
                                           **(template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - jinja errors (e.g. roles must alternate) are user errors
            raise bad_request(f"The messages cannot be rendered with the model's chat template: {exc}",
                              param="messages") from None
        return Prompt(tok.encode(text, add_special_tokens=add_special_tokens), text)

    def max_tokens_for(self, prompt: Prompt, requested: Optional[int], default: Optional[int],
                       what: str, max_param: str) -> int:
        """The completion budget; prompts that cannot fit the context are a 400 (OpenAI's
        ``context_length_exceeded``) before anything is queued."""
        limit, n = self.max_model_len, len(prompt.token_ids)
        if n == 0:
            raise bad_request(f"The {what} is empty.", param=what)
        if n >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens, but the {what} has "
                              f"{n} tokens. Please shorten the {what}.", param=what,
                              code="context_length_exceeded")
        if requested is None:
            return min(default or limit - n, limit - n)
        if n + requested > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens, but you requested "
                              f"{n + requested} tokens ({n} in the {what}, {requested} for the completion). "
                              f"Please reduce the {what} or {max_param}.", param=max_param,
                              code="context_length_exceeded")
        return requested

    async def compile_grammar(self, body) -> Optional[CompiledGrammar]:
        """The request's structured-output grammar, compiled (and cached) in a worker thread; a 400
        naming the field when it cannot be compiled."""
        try:
            spec = body.grammar_spec()
        except FieldError as exc:
            raise bad_request(str(exc), param=exc.param, code=exc.code) from None
        if spec is None:
            return None
        grammars = getattr(self.engine.core, "grammars", None)
        if grammars is None:
            raise bad_request("This engine does not support structured outputs.", param=spec.param)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._grammar_pool, grammars.compile, spec)
        except GrammarError as exc:
            raise bad_request(str(exc), param=exc.param, code="invalid_grammar") from None

    def build_requests(self, call_id: str, body, prompts: list[Prompt], budgets: list[int],
                       grammar: Optional[CompiledGrammar] = None) -> list[GenerationRequest]:
        per_prompt = body.candidates
        total = len(prompts) * per_prompt
        if total > self.engine.max_queue:
            raise bad_request(f"The request asks for {total} completions; this server queues at most "
                              f"{self.engine.max_queue} at once.", param="n" if per_prompt == body.n else "best_of",
                              code="too_many_completions")
        try:
            reqs = [GenerationRequest(f"{call_id}-{p * per_prompt + i}", prompt.token_ids,
                                      body.to_sampling_params(budgets[p], i),
                                      body.to_spec_options(self.settings.spec_enabled), grammar)
                    for p, prompt in enumerate(prompts) for i in range(per_prompt)]
        except ValueError as exc:  # the engine contract's own checks
            raise bad_request(str(exc), param=str(exc).split(" ")[0]) from None
        check = getattr(self.engine.core, "check_request", None)
        for req in reqs if check is not None else ():
            try:  # what the engine would refuse is a 400 now, before a stream's first byte
                check(req)
            except RequestRejected as exc:
                raise bad_request(str(exc), param=exc.param, code=exc.code) from None
        return reqs

    # ------------------------------------------------------------------ tokenizer endpoints
    async def tokenize(self, body: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> TokenizeResponse:
        """``/tokenize``: the token ids the generation endpoints would give the engine.  Any length (the
        request body limit bounds it): a text longer than the context is counted, not refused; an empty
        prompt is 0 tokens (or the special tokens the tokenizer adds)."""
        self.check_model(body.model)
        return await self._off_loop(self._tokenize, body)

    def _tokenize(self, body: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> TokenizeResponse:
        tok = self.tokenizer
        if isinstance(body, TokenizeChatRequest):
            ids = self.render_chat(body.template_messages(), body.template_tools(),
                                   add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=body.continue_final_message,
                                   add_special_tokens=body.add_special_tokens,
                                   template_kwargs=body.chat_template_kwargs).token_ids
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """``/detokenize``: the text of token ids (special tokens included), as the tokenizer decodes them."""
        self.check_model(body.model)
        return await self._off_loop(self._detokenize, body.tokens)

    def _detokenize(self, tokens: list[int]) -> DetokenizeResponse:
        vocab = len(self.tokenizer)
        if any(t >= vocab for t in tokens):
            raise bad_request(f"token ids must be < the vocabulary size {vocab}", param="tokens",
                              code="token_id_out_of_range")
        return DetokenizeResponse(prompt=self.tokenizer.decode(tokens))

    # ------------------------------------------------------------------ running
    async def collect(self, group: RequestGroup, choices: list[Choice], request: Request) -> bool:
        """Fills ``choices`` from the group; False when the client disconnected first."""
        async def consume() -> None:
            async with group:
                async for out in group:
                    raise_if_error(out)
                    choices[int(out.request_id.rsplit("-", 1)[1])].add(out)

        work = asyncio.ensure_future(consume())
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler itself is cancelled
            watch.cancel()
            if not work.done():
                work.cancel()  # leaving `async with group` aborts the requests
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            return False
        work.result()  # re-raises an APIError
        return True

    @staticmethod
    async def outputs(group: RequestGroup) -> AsyncIterator[tuple[int, RequestOutput]]:
        async with group:
            async for out in group:
                raise_if_error(out)
                yield int(out.request_id.rsplit("-", 1)[1]), out

    # ------------------------------------------------------------------ completions
    async def completions(self, body: CompletionRequest, request: Request) -> Union[Response, CompletionResponse]:
        self.check_model(body.model)
        if body.echo and body.logprobs is not None:
            raise bad_request("echo together with logprobs needs prompt logprobs, which this engine does not "
                              "compute.", param="echo")
        prompts = await self._off_loop(self.completion_prompts, body)
        default = self.settings.default_max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        budgets = [self.max_tokens_for(p, body.max_tokens, default, "prompt", "max_tokens")
                   for p in prompts]
        grammar = await self.compile_grammar(body)
        call_id = f"cmpl-{uuid.uuid4().hex}"
        reqs = self.build_requests(call_id, body, prompts, budgets, grammar)
        choices = [Choice(i, len(prompts[i // body.candidates].token_ids)) for i in range(len(reqs))]
        group = self.engine.submit(reqs)
        fmt = LogprobFormatter(self.tokenizer)
        if body.stream:  # a best_of call can send nothing before every candidate is done
            chunks = self._best_of_chunks if body.candidates > body.n else self._completion_chunks
            return sse_response(chunks(call_id, body, prompts, choices, group, fmt))
        if not await self.collect(group, choices, request):
            return Response(status_code=499)
        return self._completion_response(call_id, body, prompts, choices, fmt)

    def _completion_response(self, call_id, body, prompts, choices, fmt) -> CompletionResponse:
        returned = best_of(choices, body.candidates, body.n)
        return CompletionResponse(
            id=call_id, model=self.settings.model_id, usage=make_usage(prompts, choices),
            choices=[CompletionChoice(
                index=c.index, finish_reason=c.finish_reason,
                text=(prompts[c.index // body.n].text if body.echo else "") + c.text,
                logprobs=fmt.completion(c.logprobs, 0) if body.logprobs is not None else None)
                for c in returned])

    async def _best_of_chunks(self, call_id, body, prompts, choices, group, fmt):
        """A streamed ``best_of`` call: each returned choice as one chunk once all candidates are done."""
        async for index, out in self.outputs(group):
            choices[index].add(out)
        response = self._completion_response(call_id, body, prompts, choices, fmt)
        for choice in response.choices:
            yield CompletionChunk(id=call_id, model=self.settings.model_id, created=response.created, choices=[choice])
        if body.include_usage:
            yield CompletionChunk(id=call_id, model=self.settings.model_id, created=response.created, choices=[],
                                  usage=response.usage)

    async def _completion_chunks(self, call_id, body, prompts, choices, group, fmt):
        created, model = int(time.time()), self.settings.model_id  # one ``created`` for the stream, as OpenAI
        text_events = TextEvents(call_id, "text_completion", model, created)
        offsets = [0] * len(choices)
        if body.echo:
            for c in choices:
                text = prompts[c.index // body.n].text
                offsets[c.index] = len(text)
                yield text_events.completion(c.index, text)
        async for index, out in self.outputs(group):
            choices[index].add(out)
            lp = fmt.completion(out.logprobs or [], offsets[index]) if body.logprobs is not None else None
            offsets[index] += len(out.new_text)
            if lp is None and out.new_text and not out.finished:
                yield text_events.completion(index, out.new_text)
            elif out.new_text or out.finished or out.logprobs:
                yield CompletionChunk(id=call_id, model=model, created=created, choices=[CompletionChoice(
                    index=index, text=out.new_text, logprobs=lp, finish_reason=out.finish_reason)])
        if body.include_usage:
            yield CompletionChunk(id=call_id, model=model, created=created, choices=[],
                                  usage=make_usage(prompts, choices))

    # ------------------------------------------------------------------ chat
    async def chat(self, body: ChatCompletionRequest, request: Request) -> Union[Response, ChatCompletionResponse]:
        self.check_model(body.model)
        prompt = await self._off_loop(self.chat_prompt, body)
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        budget = self.max_tokens_for(prompt, body.requested_max_tokens(), self.settings.default_max_tokens,
                                     "messages", max_param)
        grammar = await self.compile_grammar(body)
        call_id = f"chatcmpl-{uuid.uuid4().hex}"
        reqs = self.build_requests(call_id, body, [prompt], [budget], grammar)
        choices = [Choice(i, len(prompt.token_ids)) for i in range(len(reqs))]
        group = self.engine.submit(reqs)
        fmt = LogprobFormatter(self.tokenizer)
        if body.stream:
            return sse_response(self._chat_chunks(call_id, body, [prompt], choices, group, fmt))
        if not await self.collect(group, choices, request):
            return Response(status_code=499)
        return ChatCompletionResponse(
            id=call_id, model=self.settings.model_id, usage=make_usage([prompt], choices),
            choices=[ChatChoice(index=c.index, message=message, finish_reason=finish,
                                logprobs=fmt.chat(c.logprobs) if body.logprobs else None)
                     for c in choices for message, finish in [self._chat_message(body, c)]])

    @staticmethod
    def _chat_message(body: ChatCompletionRequest, c: Choice) -> tuple[ChatResponseMessage, Optional[str]]:
        """A choice's message, its tool calls parsed out when the request has tools, and its finish reason
        (``tool_calls`` when it called a tool, but for a named tool_choice: ``stop``, as OpenAI)."""
        if body.tool_mode is None:
            return ChatResponseMessage(content=c.text), c.finish_reason
        content, calls = parse_tool_calls(c.text)
        if not calls:
            return ChatResponseMessage(content=content), c.finish_reason
        message = ChatResponseMessage(content=content.strip() or None, tool_calls=[
            ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments)) for call in calls])
        return message, tool_finish(body, c.finish_reason)

    async def _chat_chunks(self, call_id, body, prompts, choices, group, fmt):
        created, model = int(time.time()), self.settings.model_id  # one ``created`` for the stream, as OpenAI
        text_events = TextEvents(call_id, "chat.completion.chunk", model, created)

        def chunk(index: int, delta: DeltaMessage, finish: Optional[str] = None, lp=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=call_id, model=model, created=created, choices=[
                ChatChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish)])

        for c in choices:
            yield chunk(c.index, DeltaMessage(role="assistant", content=""))
        parsers = [ToolCallParser() for _ in choices] if body.tool_mode is not None else None
        async for index, out in self.outputs(group):
            choices[index].add(out)
            lp = fmt.chat(out.logprobs or []) if body.logprobs and out.logprobs else None
            if parsers is None:
                if lp is None and out.new_text:
                    yield text_events.chat(index, out.new_text)
                elif out.new_text or out.logprobs:
                    yield chunk(index, DeltaMessage(content=out.new_text), lp=lp)
            else:  # content and tool-call deltas, as the parser finds them (a partial tag is held back)
                events = parsers[index].feed(out.new_text) if out.new_text else []
                deltas = tool_deltas(events + (parsers[index].finish() if out.finished else []))
                if out.logprobs and not deltas:
                    deltas = [DeltaMessage(content="")]
                for n, delta in enumerate(deltas):
                    yield chunk(index, delta, lp=lp if n == 0 else None)
            if out.finished:
                finish = out.finish_reason
                if parsers is not None and parsers[index].calls:
                    finish = tool_finish(body, finish)
                yield chunk(index, DeltaMessage(), finish=finish)
        if body.include_usage:
            yield ChatCompletionChunk(id=call_id, model=model, created=created, choices=[],
                                      usage=make_usage(prompts, choices))


def tool_finish(body: ChatCompletionRequest, reason: Optional[str]) -> Optional[str]:
    """The finish reason of a choice that called a tool: ``tool_calls``, but ``stop`` for a named
    tool_choice (as OpenAI); a length cut stays ``length``."""
    if reason != "stop":
        return reason
    return "stop" if body.tool_mode == "named" else "tool_calls"


def tool_deltas(events: list[ToolEvent]) -> list[DeltaMessage]:
    """Stream deltas of parsed text: content, a call's start (its id, type and name, empty arguments),
    then its argument fragments."""
    out = []
    for e in events:
        if e.kind == "content":
            out.append(DeltaMessage(content=e.text))
        elif e.kind == "call":
            out.append(DeltaMessage(tool_calls=[ToolCallDelta(index=e.index, id=e.call.id, type="function",
                                                              function=FunctionCall(name=e.call.name))]))
        else:
            out.append(DeltaMessage(tool_calls=[ToolCallDelta(index=e.index, function=FunctionCall(arguments=e.text))]))
    return out


class LogprobFormatter:
    """Engine :class:`TokenLogprob` lists -> the two OpenAI logprob formats (token ids decoded)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat(self, lps: list[TokenLogprob]) -> ChatLogprobs:
        def entry(tid: int, lp: float) -> TopLogprob:
            s = self.token(tid)
            return TopLogprob(token=s, logprob=lp, bytes=list(s.encode("utf-8")))

        return ChatLogprobs(content=[
            ChatLogprobToken(**entry(t.token_id, t.logprob).model_dump(),
                             top_logprobs=[entry(tid, lp) for tid, lp in t.top]) for t in lps])

    def completion(self, lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for t in lps:
            s = self.token(t.token_id)
            out.tokens.append(s)
            out.token_logprobs.append(t.logprob)
            out.top_logprobs.append({self.token(tid): lp for tid, lp in t.top})
            out.text_offset.append(offset)
            offset += len(s)
        return out
