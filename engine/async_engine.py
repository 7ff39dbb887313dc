"""Asyncio facade over the synchronous :class:`EngineCore`.

The core is not thread-safe and its ``step()`` runs model code for seconds at a time, so it lives in
ONE dedicated thread and nothing else ever touches it (except read-only attributes such as the
tokenizer).  The event loop and the engine thread talk through three things guarded by one
condition variable:

* ``_pending``: submitted requests not yet handed to the core (bounded: ``max_queue``);
* ``_aborts``: request ids to abort (client disconnects), applied between steps;
* per-request ``asyncio.Queue`` objects, filled with ``loop.call_soon_threadsafe``.

Each engine-thread iteration is: apply aborts -> admit pending requests -> one ``core.step()`` for
the whole running batch -> hand out the deltas.  The step's stats and the finished requests' records
reach the listener while the device runs the next step (``EngineCore.defer``), or at once when
there is none.  When there is no work the thread sleeps on the condition variable.

The engine also keeps per-request timestamps (:class:`RequestRecord`); a listener (the server's
metrics exporter) gets them when a request finishes, plus every step's :class:`StepStats`.  The
engine only fills data; exporting it is the server's business.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional, Protocol

from engine.request import GenerationRequest, RequestOutput, SpecUsage
from engine.stats import StepStats

log = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The request queue is full; the server answers 429."""


class EngineUnavailable(RuntimeError):
    """The engine is loading, failed to load, or shutting down; the server answers 503."""


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


SHUTDOWN_MESSAGE = "The server is shutting down and could not finish this request in its grace period; retry."


@dataclass
class EngineErrorOutput(RequestOutput):
    """The final output of a request that failed.  ``kind`` is ``"invalid_request"`` when the core
    rejected it in ``add_request`` (a user error, 400), ``"shutdown"`` when the engine stopped before it
    finished (503) and ``"server_error"`` when a step failed."""

    kind: str = "server_error"


@dataclass
class RequestRecord:
    """Wall-clock history of one request (``time.perf_counter`` seconds), for latency metrics.

    ``token_gaps`` holds ``(interval, tokens)`` for every delta after the first one that carried
    tokens: a delta of k tokens arriving ``interval`` after the previous one stands for k tokens
    paced at ``interval / k`` each (per-token inter-token latency, not per step).
    """

    request_id: str
    arrival: float
    admitted: Optional[float] = None
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    finished: Optional[float] = None
    token_gaps: list[tuple[float, int]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec: SpecUsage = field(default_factory=SpecUsage)

    def on_tokens(self, now: float, count: int) -> None:
        if count <= 0:
            return
        if self.first_token is None:
            self.first_token = now
        else:
            self.token_gaps.append((now - self.last_token, count))
        self.last_token = now


@dataclass(frozen=True)
class EngineGauges:
    """A snapshot the engine thread publishes after every iteration (read lock-free)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_blocks: tuple[int, int, int] = (0, 0, 0)  # target pool: (used, cached for prefixes, total)


class EngineListener(Protocol):
    """Receives engine data on the engine thread; must be quick and thread-safe."""

    def on_step_stats(self, stats: list[StepStats]) -> None: ...

    def on_request_finished(self, record: RequestRecord) -> None: ...


@dataclass
class _Entry:
    req: GenerationRequest
    record: RequestRecord
    loop: Optional[asyncio.AbstractEventLoop]  # None in an engine process: outputs go down its pipe
    queue: Optional[asyncio.Queue]
    admitted: bool = False


class RequestGroup:
    """Outputs of one or more engine requests (the n choices of one API call), in arrival order.

    Use as ``async with engine.submit(reqs) as group: async for out in group: ...``; leaving the
    block early (an exception, a cancelled task after a client disconnect) aborts every request of
    the group that has not finished, so its slot is freed at once.
    """

    def __init__(self, engine: "AsyncEngine", ids: list[str], queue: asyncio.Queue) -> None:
        self._engine = engine
        self._unfinished = set(ids)
        self._queue = queue

    def __aiter__(self) -> "RequestGroup":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        out: RequestOutput = await self._queue.get()
        if out.finished:
            self._unfinished.discard(out.request_id)
        return out

    def abort(self) -> None:
        if self._unfinished:
            self._engine.abort(list(self._unfinished))
            self._unfinished.clear()

    async def __aenter__(self) -> "RequestGroup":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()


def _put_all(items: list) -> None:
    """On the event loop: one step's outputs into their requests' queues, in order."""
    for queue, out in items:
        queue.put_nowait(out)


class EngineFront:
    """What the server sees of an engine, wherever its core runs (:class:`AsyncEngine` here, or
    ``engine_process.ProcessEngine``): its state, readiness, why it is unavailable, and ``generate``
    over ``submit``.  Subclasses set ``state``, ``load_error``, ``_accepting``, ``_ready`` and
    ``_entries`` (the unfinished requests) and implement ``submit``."""

    state: "EngineState"
    load_error: Optional[str]
    _accepting: bool
    _ready: threading.Event
    _entries: dict

    def submit(self, reqs: list[GenerationRequest]) -> "RequestGroup":
        raise NotImplementedError

    def wait_ready(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the core is built (or failed); True when ready."""
        self._ready.wait(timeout)
        return self.state is EngineState.READY

    @property
    def num_unfinished(self) -> int:
        return len(self._entries)

    @property
    def accepting(self) -> bool:
        """Ready and taking new requests (False from the start of a shutdown)."""
        return self.state is EngineState.READY and self._accepting

    def unavailable_reason(self) -> str:
        if self.state is EngineState.LOADING:
            return "The model is still loading; retry in a moment."
        if self.state is EngineState.FAILED:
            return f"The engine is not available: {self.load_error}"
        return "The server is shutting down."

    async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """The deltas of one request; closing the iterator early aborts the request."""
        async with self.submit([req]) as group:
            async for out in group:
                yield out


class AsyncEngine(EngineFront):
    """Runs one :class:`EngineCore` on a background thread; see the module docstring.

    ``core_or_factory`` is either a ready core or a zero-argument callable that builds one; a
    factory runs on the engine thread, so the HTTP server can answer ``/health`` (503) while the
    models load.
    """

    def __init__(self, core_or_factory, max_queue: int = 64, listener: Optional[EngineListener] = None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self._factory: Callable = core_or_factory if callable(core_or_factory) else (lambda: core_or_factory)
        self.max_queue = max_queue
        self.listener = listener
        self._outbox: Optional[dict] = None  # during a step: event loop -> [(queue, output)] to hand over at once
        self.core = None
        self.state = EngineState.LOADING
        self.load_error: Optional[str] = None
        self.gauges = EngineGauges()
        self._cond = threading.Condition()
        self._pending: list[_Entry] = []
        self._aborts: list[str] = []
        self._entries: dict[str, _Entry] = {}  # every submitted, unfinished request
        self._core_waiting = 0  # core.num_waiting after the last admission / step
        self._core_free = 0  # core.free_batch_slots then: waiting requests that will still run at once
        self._accepting = True
        self._stop_now = False
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mcsd-engine", daemon=True)
            self._thread.start()

    def submit(self, reqs: list[GenerationRequest]) -> RequestGroup:
        """Queues all of ``reqs`` or none of them (raises EngineOverloaded / EngineUnavailable)."""
        if self.state is not EngineState.READY or not self._accepting:
            raise EngineUnavailable(self.unavailable_reason())
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        self._enqueue(reqs, loop, queue, time.perf_counter())
        return RequestGroup(self, [r.request_id for r in reqs], queue)

    def _enqueue(self, reqs: list[GenerationRequest], loop: Optional[asyncio.AbstractEventLoop],
                 queue: Optional[asyncio.Queue], now: float) -> None:
        with self._cond:
            # what will wait: everything queued that the running batch cannot take at the next step
            # (so up to max_batch + max_queue requests are in flight)
            waiting = max(len(self._pending) + self._core_waiting - self._core_free, 0)
            if max(len(self._pending) + self._core_waiting + len(reqs) - self._core_free, 0) > self.max_queue:
                raise EngineOverloaded(
                    f"The server is overloaded: {waiting} requests are already waiting "
                    f"(max_queue={self.max_queue}). Retry later.")
            for r in reqs:
                if r.request_id in self._entries:
                    raise ValueError(f"duplicate request id {r.request_id!r}")
            for r in reqs:
                entry = _Entry(r, RequestRecord(r.request_id, arrival=now), loop, queue)
                self._entries[r.request_id] = entry
                self._pending.append(entry)
            self._cond.notify()

    def abort(self, request_ids: list[str]) -> None:
        """Thread-safe; the engine thread applies aborts between steps."""
        with self._cond:
            self._aborts.extend(request_ids)
            self._cond.notify()

    async def shutdown(self, grace_seconds: float = 5.0) -> None:
        """Stops accepting requests, cancels queued ones, lets running ones finish for up to
        ``grace_seconds``, aborts the rest (finish_reason "abort") and joins the thread."""
        self._stop_accepting()
        deadline = time.monotonic() + grace_seconds
        while self._entries and self.state is EngineState.READY and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.to_thread(self._stop_thread)

    def _stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False
            self._aborts.extend(e.req.request_id for e in self._pending)
            self._cond.notify()

    def _stop_thread(self) -> None:
        """Ends the engine thread after its current step; what is still running ends with a shutdown error."""
        with self._cond:
            self._stop_now = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(30.0)
        self.state = EngineState.STOPPED

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self.core = self._factory()
        except Exception as exc:  # noqa: BLE001 - reported through /health and the log
            log.exception("building the engine core failed")
            self.load_error = f"{type(exc).__name__}: {exc}"
            self.state = EngineState.FAILED
            self._ready.set()
            return
        self._core_free = self.core.free_batch_slots
        self.state = EngineState.READY
        self._ready.set()
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - a bug here must not hang the clients
            log.exception("engine loop crashed")
            self.load_error = f"engine loop crashed: {exc}"
            self.state = EngineState.FAILED
            self._fail(self._snapshot(), f"engine loop crashed: {exc}")
        finally:
            if self.state is EngineState.READY and self._stop_now:
                self._fail(self._snapshot(), SHUTDOWN_MESSAGE, kind="shutdown")
            self.core.run_deferred()  # the metrics of the last steps

    def _loop(self) -> None:
        busy = False
        while True:
            with self._cond:
                while not (self._pending or self._aborts or self._stop_now or busy):
                    self._cond.wait()
                if self._stop_now:
                    return
                pending, self._pending = self._pending, []
                aborts, self._aborts = self._aborts, []
            self._apply_aborts(aborts)
            self._admit(pending)
            with self._cond:
                self._core_waiting, self._core_free = self.core.num_waiting, self.core.free_batch_slots
            busy = self.core.has_unfinished()
            if busy:
                self._step()
                busy = self.core.has_unfinished()
            if not busy:
                self.core.run_deferred()  # the metrics deferred to the next step: there is none for now
            self._publish_gauges()

    def _apply_aborts(self, ids: list[str]) -> None:
        for rid in ids:
            entry = self._entries.get(rid)
            if entry is None:
                continue  # finished already
            if entry.admitted:
                self.core.abort_request(rid)
            self._finish(entry, RequestOutput(rid, [], "", finished=True, finish_reason="abort",
                                              prompt_tokens=entry.record.prompt_tokens,
                                              completion_tokens=entry.record.completion_tokens,
                                              spec=entry.record.spec))

    def _admit(self, pending: list[_Entry]) -> None:
        for entry in pending:
            if entry.req.request_id not in self._entries:
                continue  # aborted while queued
            try:
                self.core.add_request(entry.req)
            except ValueError as exc:
                self._finish(entry, EngineErrorOutput(entry.req.request_id, [], "", finished=True,
                                                      finish_reason="error", error=str(exc),
                                                      kind="invalid_request"))
                continue
            entry.admitted = True
            entry.record.admitted = time.perf_counter()
            entry.record.prompt_tokens = len(entry.req.prompt_token_ids)

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as exc:  # noqa: BLE001 - fail this batch, keep serving
            log.exception("engine step failed")
            self._fail([e for e in self._snapshot() if e.admitted], f"engine step failed: {exc}")
            outputs = []
        now = time.perf_counter()
        self._outbox = {}  # the step's outputs go to each event loop in one wake-up, not one per request
        try:
            for out in outputs:
                entry = self._entries.get(out.request_id)
                if entry is None:
                    continue  # aborted during the step
                entry.record.on_tokens(now, len(out.new_token_ids))
                if out.finished:
                    self._finish(entry, out)
                else:
                    self._deliver(entry, out)
        finally:
            outbox, self._outbox = self._outbox, None
            for loop, items in outbox.items():
                self._post(loop, items)
        self._off_the_step(self._drain_stats)

    def _snapshot(self) -> list[_Entry]:
        """The unfinished requests (the event loop inserts into ``_entries`` under the lock)."""
        with self._cond:
            return list(self._entries.values())

    def _fail(self, entries: list[_Entry], message: Optional[str], kind: str = "server_error") -> None:
        """Ends ``entries`` with an error output of ``kind`` (or an abort when ``message`` is None)."""
        for entry in entries:
            rid = entry.req.request_id
            if entry.admitted:
                try:
                    self.core.abort_request(rid)
                except Exception:  # noqa: BLE001 - the core may be broken; still end the request
                    log.exception("abort_request(%s) failed", rid)
            if message is None:
                out = RequestOutput(rid, [], "", finished=True, finish_reason="abort")
            else:
                out = EngineErrorOutput(rid, [], "", finished=True, finish_reason="error", error=message, kind=kind)
            self._finish(entry, out)

    def _finish(self, entry: _Entry, out: RequestOutput) -> None:
        rec = entry.record
        rec.finished = time.perf_counter()
        rec.finish_reason = out.finish_reason
        if out.finish_reason not in ("abort", "error"):
            rec.prompt_tokens = out.prompt_tokens or rec.prompt_tokens
            rec.completion_tokens = out.completion_tokens
            rec.spec = out.spec
        self._entries.pop(entry.req.request_id, None)
        self._deliver(entry, out)
        if self.listener is not None:
            self._off_the_step(lambda: self._record_finished(rec))

    def _record_finished(self, rec: RequestRecord) -> None:
        try:
            self.listener.on_request_finished(rec)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            log.exception("metrics listener failed")

    def _off_the_step(self, work: Callable[[], None]) -> None:
        """Runs metrics ``work`` while the device runs the next step (``EngineCore.defer``) when called
        on the engine thread; now otherwise."""
        if self.core is not None and threading.current_thread() is self._thread:
            self.core.defer(work)
        else:
            work()

    def _deliver(self, entry: _Entry, out: RequestOutput) -> None:
        if not out.finished:
            entry.record.completion_tokens = out.completion_tokens
            entry.record.spec = out.spec
        if self._outbox is not None:  # inside a step: sent with the step's other outputs
            self._outbox.setdefault(entry.loop, []).append((entry.queue, out))
            return
        self._post(entry.loop, [(entry.queue, out)])

    def _post(self, loop: Optional[asyncio.AbstractEventLoop], items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
        """Hands outputs to the event loop their requests came from, in one wake-up."""
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:
            pass  # the clients' event loop is closed (server shutting down)

    def _drain_stats(self) -> None:
        stats = self.core.drain_step_stats()
        if stats and self.listener is not None:
            try:
                self.listener.on_step_stats(stats)
            except Exception:  # noqa: BLE001
                log.exception("metrics listener failed")

    def _publish_gauges(self) -> None:
        core = self.core
        with self._cond:
            self._core_waiting, self._core_free = core.num_waiting, core.free_batch_slots
            queued = len(self._pending)
        self.gauges = EngineGauges(core.num_running, core.num_waiting + queued, float(core.kv_cache_usage),
                                   core.kv_blocks)
