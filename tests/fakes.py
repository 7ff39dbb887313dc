"""A fake :class:`EngineCore` for the server tests: the real interface, no model.

It "generates" by echoing the prompt's tokens in a loop, so outputs are predictable from the
prompt alone, and fakes speculation with a fixed acceptance pattern, so per-request usage and the
step statistics can be checked against each other.  Stop strings, stop tokens and ``max_tokens``
go through the engine's real :class:`TextStream`, like the real core.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from functools import lru_cache
from typing import Callable, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.request import GenerationRequest, RequestOutput, RequestRejected, SpecUsage, TokenLogprob
from engine.stats import StepStats, add_at
from engine.stop import TextStream

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "once upon a time"] * 10


# a Hermes-style template that renders tools, assistant tool calls and tool results (as Qwen2.5's does)
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>You may call: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tool_tokenizer() -> PreTrainedTokenizerFast:
    """:func:`make_tokenizer` with the tool template and ``<tool_call>`` / ``</tool_call>`` as added
    (not special) tokens, as Qwen2.5 has them."""
    tok = make_tokenizer().__class__(tokenizer_object=make_tokenizer().backend_tokenizer, eos_token="<|eos|>")
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = TOOL_TEMPLATE
    return tok


@lru_cache(maxsize=1)
def make_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with a chat template: any text encodes, a few common words are one token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|eos|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


@dataclasses.dataclass
class _Seq:
    req: GenerationRequest
    stream: TextStream
    offset: int  # where in the prompt the echo starts (seeded sampling shifts it)
    emitted: int = 0  # output tokens produced
    spec: SpecUsage = dataclasses.field(default_factory=SpecUsage)

    def next_tokens(self, count: int) -> list[int]:
        p = self.req.prompt_token_ids
        return [p[(self.offset + self.emitted + i) % len(p)] for i in range(count)]


class FakeCore:
    """Echo generator with the real core's interface (see engine/core.py's docstring).

    Step rules per running sequence: the first step (prefill) emits one token without speculation;
    later steps draft a chain of ``depth`` nodes (``speculative.max_depth`` / ``tree`` cap the
    engine's ``depth``; ``enabled=False`` means 0) and accept ``k = decode_step % (depth + 1)``
    of them, emitting ``k + 1`` tokens.  ``step_delay`` makes a step take wall time.
    """

    def __init__(self, max_batch: int = 4, max_model_len: int = 256, depth: int = 3,
                 step_delay: float = 0.0, model_name: str = "fake-model", tokenizer=None) -> None:
        self.tokenizer = tokenizer or make_tokenizer()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.depth = depth
        self.step_delay = step_delay
        self.fail_next_step = False  # set by a test: the next step() raises
        self.aborted: list[str] = []
        self.steps_run = 0
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}
        self._stats: list[StepStats] = []
        self._later: list[Callable[[], None]] = []  # defer()
        self._thread: Optional[int] = None  # the one thread allowed to call us

    # ----------------------------------------------------------------- interface
    def check_request(self, req: GenerationRequest) -> None:
        """Stateless checks, callable from any thread (the real core's contract)."""
        total = len(req.prompt_token_ids) + req.sampling.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens "
                                  f"({req.sampling.max_tokens}) exceeds the context length {self.max_model_len}",
                                  "max_tokens")
        if req.spec.method not in (None, "mcsd", "maxgram"):
            raise RequestRejected(f"the fake engine does not run speculative.method {req.spec.method!r}",
                                  "speculative.method")
        if max(req.sampling.logit_bias, default=-1) >= len(self.tokenizer):
            raise RequestRejected(f"logit_bias token ids must be < {len(self.tokenizer)}", "logit_bias")

    def add_request(self, req: GenerationRequest) -> None:
        self._check_thread()
        self.check_request(req)
        s = req.sampling
        offset = 0 if s.greedy or s.seed is None else s.seed % len(req.prompt_token_ids)
        stream = TextStream.create(self.tokenizer, req.prompt_token_ids, s, [self.tokenizer.eos_token_id])
        self._waiting.append(_Seq(req, stream, offset))

    def abort_request(self, request_id: str) -> None:
        self._check_thread()
        self.aborted.append(request_id)
        self._running.pop(request_id, None)
        self._waiting = deque(s for s in self._waiting if s.req.request_id != request_id)

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected failure")
        t0 = time.perf_counter()
        self.run_deferred()  # while the "device" works, as the real core runs it before its read
        if self.step_delay:
            time.sleep(max(0.0, self.step_delay - (time.perf_counter() - t0)))
        self.steps_run += 1
        stats = StepStats(budget=self.depth, draft_seconds=0.001, verify_seconds=0.002)
        while self._waiting and len(self._running) < self.max_batch:
            seq = self._waiting.popleft()
            self._running[seq.req.request_id] = seq
            stats.prefill_tokens += len(seq.req.prompt_token_ids)
        outputs = [self._advance(seq, stats) for seq in list(self._running.values())]
        stats.num_seqs = len(outputs)
        self._stats.append(stats)
        return outputs

    def drain_step_stats(self) -> list[StepStats]:
        self.run_deferred()
        out, self._stats = self._stats, []
        return out

    def defer(self, work: Callable[[], None]) -> None:
        self._check_thread()
        self._later.append(work)

    def run_deferred(self) -> None:
        while self._later:
            self._later.pop(0)()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def free_batch_slots(self) -> int:
        return max(self.max_batch - len(self._running), 0)

    @property
    def kv_cache_usage(self) -> float:
        return len(self._running) / self.max_batch

    @property
    def kv_blocks(self) -> tuple[int, int, int]:
        return len(self._running), 0, self.max_batch

    # ----------------------------------------------------------------- internals
    def _check_thread(self) -> None:
        """The real core is single-threaded: every mutating call must come from one thread."""
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        assert self._thread == me, "EngineCore called from two threads"

    def _seq_depth(self, seq: _Seq) -> int:
        spec = seq.req.spec
        if not spec.enabled or seq.emitted == 0:
            return 0
        depth = self.depth if spec.tree is None else min(self.depth, len(spec.tree))
        return depth if spec.max_depth is None else min(depth, spec.max_depth)

    def _advance(self, seq: _Seq, stats: StepStats) -> RequestOutput:
        depth = self._seq_depth(seq)
        accepted = seq.spec.steps % (depth + 1) if depth else 0
        tokens = seq.next_tokens(accepted + 1)
        if depth:
            seq.spec = SpecUsage(seq.spec.steps + 1, seq.spec.drafted_tokens + depth,
                                 seq.spec.accepted_tokens + accepted)
            self._count_spec(stats, depth, accepted)
        stats.emitted_tokens += len(tokens)
        upd = seq.stream.feed(tokens)
        new_ids = tokens[:upd.consumed]
        seq.emitted += len(tokens)
        if upd.finished:
            self._running.pop(seq.req.request_id, None)
        return RequestOutput(
            seq.req.request_id, new_ids, upd.text, finished=upd.finished, finish_reason=upd.finish_reason,
            logprobs=self._logprobs(seq, new_ids), prompt_tokens=len(seq.req.prompt_token_ids),
            completion_tokens=seq.stream.num_tokens, spec=dataclasses.replace(seq.spec))

    @staticmethod
    def _count_spec(stats: StepStats, depth: int, accepted: int) -> None:
        stats.num_spec_seqs += 1
        stats.drafted_tokens += depth
        stats.accepted_tokens += accepted
        stats.bonus_tokens += int(accepted == depth)
        for d in range(depth):
            add_at(stats.drafted_by_depth, d)
            add_at(stats.accepted_by_depth, d, int(d < accepted))
            add_at(stats.accepted_per_position, d, int(d < accepted))
        add_at(stats.drafted_by_rank, 0, depth)
        add_at(stats.accepted_by_rank, 0, accepted)

    @staticmethod
    def _logprobs(seq: _Seq, ids: list[int]) -> Optional[list[TokenLogprob]]:
        k = seq.req.sampling.logprobs
        if k is None:
            return None
        top = lambda t: ([(t, -0.25)] + [((t + j) % 256, -1.0 - j) for j in range(1, k)])[:k]  # noqa: E731
        return [TokenLogprob(t, -0.25, top(t)) for t in ids]


# ---------------------------------------------------------------------------- a real server
class ServerThread:
    """A real uvicorn server for ``app`` on a free localhost port, in a background thread.

    ``with ServerThread(app) as srv: openai.OpenAI(base_url=srv.url + "/v1", ...)``; leaving the
    block runs uvicorn's normal shutdown (lifespan exit -> engine shutdown).
    """

    def __init__(self, app, **config) -> None:
        """``config``: more ``uvicorn.Config`` arguments (e.g. ``http=`` a protocol class)."""
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=2, **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def echo_text(text: str, n: int) -> str:
    """What the fake core generates (greedy) for a completion prompt ``text`` in ``n`` tokens."""
    tok = make_tokenizer()
    ids = tok.encode(text)
    return tok.decode([ids[i % len(ids)] for i in range(n)])


def greedy_one_by_one_and_streamed(url: str, model: str, prompts: list[str], max_tokens: int = 8) -> tuple[list, list]:
    """The greedy completions of ``prompts`` through the official ``openai`` client: sent one at a time,
    then all at once as streams (``ignore_eos``): (one by one, streamed together), texts in order."""
    import asyncio

    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    one_by_one = [client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text for p in prompts]

    async def stream(ac: openai.AsyncOpenAI, p: str) -> str:
        chunks = await ac.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def together() -> list:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(stream(ac, p) for p in prompts))

    return one_by_one, asyncio.run(together())
