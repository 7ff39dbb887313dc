"""The engine core in a process of its own, behind :class:`AsyncEngine`'s interface.

In one process, the engine thread and the HTTP layer share one interpreter lock: every operator the
engine launches gives the lock up, and while the event loop detokenises, encodes and writes chunks
for many streams the engine waits up to the switch interval to get it back, after each operator.
With :class:`ProcessEngine` the core runs in a child process (``spawn``), stepped by the same
engine-thread loop as in-process (an :class:`AsyncEngine` there), and the server's process keeps
only the event loop: the two no longer take turns.  This is vLLM v1's engine-core process.

The pipe between them carries, one message each:

* server -> engine: ``("submit", requests, arrival)``, ``("abort", ids)``, ``("shutdown", grace)``;
* engine -> server: ``("ready", view)`` once the core is built (or ``("failed", reason)``), then one
  ``("step", outputs, finished records, step stats, gauges)`` per engine iteration that produced
  anything, and ``("stopped",)`` last.

A request's grammar crosses as its spec and is compiled again (cached) in the engine process;
compiled grammars do not pickle.  The server keeps what it reads from the core without stepping it
(the tokenizer, the context length, grammar compilation and request checks) in a :class:`CoreView`
sent with ``ready``.  If the engine process dies, every unfinished request ends with a server error
and ``/health`` answers 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import signal
import threading
import time
import types
from typing import Any, Callable, Optional

from engine.async_engine import (
    AsyncEngine, EngineErrorOutput, EngineFront, EngineGauges, EngineListener, EngineOverloaded, EngineState,
    EngineUnavailable, RequestGroup, RequestRecord, _put_all,
)
from engine.request import GenerationRequest, RequestOutput
from engine.stats import StepStats

log = logging.getLogger(__name__)

#: what the server reads from a core without stepping it (when the core has it)
VIEW_ATTRIBUTES = ("tokenizer", "max_model_len", "vocab_size", "model_name", "topology", "capture_reports",
                   "grammars", "max_batch")


class CoreView:
    """The server's copy of a core's read-only side: attributes listed in :data:`VIEW_ATTRIBUTES` and
    ``check_request``, the core class's own, reading the same attributes."""

    def __init__(self, core_class: type, attributes: dict[str, Any]) -> None:
        self.core_class = core_class
        self.__dict__.update(attributes)
        check = getattr(core_class, "check_request", None)
        if check is not None:
            self.check_request = types.MethodType(check, self)

    @classmethod
    def of(cls, core) -> "CoreView":
        return cls(type(core), {name: getattr(core, name) for name in VIEW_ATTRIBUTES if hasattr(core, name)})

    def __reduce__(self):
        attributes = {k: v for k, v in self.__dict__.items() if k not in ("core_class", "check_request")}
        return CoreView, (self.core_class, attributes)


class ProcessEngine(EngineFront):
    """:class:`AsyncEngine`'s interface over a core built by ``factory`` in a child process.

    ``factory`` is called in the child, so it must pickle: a module-level function, or a
    ``functools.partial`` of one.  ``max_queue`` bounds the requests waiting beyond the core's batch,
    as in :class:`AsyncEngine`.
    """

    def __init__(self, factory: Callable, max_queue: int = 64, listener: Optional[EngineListener] = None,
                 log_level: str = "INFO") -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self._factory = factory
        self.max_queue = max_queue
        self.listener = listener
        self.log_level = log_level
        self.core: Optional[CoreView] = None
        self.state = EngineState.LOADING
        self.load_error: Optional[str] = None
        self.gauges = EngineGauges()
        self._lock = threading.Lock()  # guards _entries and the pipe's sending end
        self._entries: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._max_batch = 0
        self._accepting = True
        self._ready = threading.Event()
        self._process: Optional[multiprocessing.process.BaseProcess] = None
        self._conn = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._closed = threading.Event()  # the engine's last message was read (or the pipe broke)

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        if self._process is not None:
            return
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_child_main, args=(self._factory, child, self.log_level),
                                    name="mcsd-engine-core", daemon=True)
        self._process.start()
        child.close()
        try:  # the engine's messages are read by the event loop that started it: no thread in between
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._conn.fileno(), self._on_readable)
        except RuntimeError:  # no running loop: a thread of its own
            threading.Thread(target=self._read, name="mcsd-engine-pipe", daemon=True).start()

    def submit(self, reqs: list[GenerationRequest]) -> RequestGroup:
        """Queues all of ``reqs`` or none of them (raises EngineOverloaded / EngineUnavailable)."""
        if not self.accepting:
            raise EngineUnavailable(self.unavailable_reason())
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        wire = [dataclasses.replace(r, grammar=r.grammar.spec) if r.grammar is not None else r for r in reqs]
        with self._lock:
            waiting = max(len(self._entries) - self._max_batch, 0)
            if max(len(self._entries) + len(reqs) - self._max_batch, 0) > self.max_queue:
                raise EngineOverloaded(f"The server is overloaded: {waiting} requests are already waiting "
                                       f"(max_queue={self.max_queue}). Retry later.")
            for r in reqs:
                if r.request_id in self._entries:
                    raise ValueError(f"duplicate request id {r.request_id!r}")
            for r in reqs:
                self._entries[r.request_id] = (loop, queue)
            try:
                self._conn.send(("submit", wire, time.perf_counter()))
            except (OSError, ValueError) as exc:
                for r in reqs:
                    self._entries.pop(r.request_id, None)
                raise EngineUnavailable(f"The engine process is gone: {exc}") from None
        return RequestGroup(self, [r.request_id for r in reqs], queue)

    def abort(self, request_ids: list[str]) -> None:
        self._send(("abort", list(request_ids)))

    async def shutdown(self, grace_seconds: float = 5.0) -> None:
        """As :meth:`AsyncEngine.shutdown`: stop admitting, let running requests finish for up to
        ``grace_seconds``, end the rest with a shutdown error; then the engine process exits."""
        self._accepting = False
        if self._process is None:
            self.state = EngineState.STOPPED
            return
        self._send(("shutdown", grace_seconds))
        await asyncio.to_thread(self._closed.wait, grace_seconds + 60.0)
        await asyncio.to_thread(self._process.join, 10.0)
        if self._process.is_alive():
            log.warning("the engine process did not exit; terminating it")
            self._process.terminate()
            await asyncio.to_thread(self._process.join, 5.0)
        self.state = EngineState.STOPPED

    def _send(self, message: tuple) -> None:
        with self._lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError, AttributeError):
                pass  # the engine process is gone; the reader ends every request

    # ------------------------------------------------------------------ the engine's messages
    def _read(self) -> None:
        """The reader thread (when started outside an event loop)."""
        try:
            while self._handle(self._conn.recv()):
                pass
        except (EOFError, OSError) as exc:
            self._lost(exc)
        finally:
            self._close()

    def _on_readable(self) -> None:
        """On the event loop: every message waiting in the pipe."""
        try:
            while self._conn.poll():
                if not self._handle(self._conn.recv()):
                    break
            else:
                return
        except (EOFError, OSError) as exc:
            self._lost(exc)
        self._loop.remove_reader(self._conn.fileno())
        self._close()

    def _handle(self, message: tuple) -> bool:
        """Applies one message; False after the last one."""
        kind = message[0]
        if kind == "step":
            self._on_step(*message[1:])
        elif kind == "ready":
            self.core = message[1]
            self._max_batch = message[2]
            self.state = EngineState.READY
            self._ready.set()
        elif kind == "failed":  # the core could not be built; the process exits
            self.load_error = message[1]
            self.state = EngineState.FAILED
            self._ready.set()
        elif kind == "crashed":  # the engine loop died; what it knew of has ended, end what was on its way
            self.load_error = message[1]
            self.state = EngineState.FAILED
            self._fail_all()
        return kind not in ("stopped", "failed")

    def _lost(self, exc: BaseException) -> None:
        code = self._process.exitcode if self._process is not None else None
        if self.state is EngineState.FAILED:
            return  # already said why
        if self.state is EngineState.LOADING:
            self.load_error = f"the engine process exited while loading (exit code {code})"
        elif self._accepting:
            self.load_error = f"the engine process exited unexpectedly (exit code {code}): {exc or 'EOF'}"
            log.error("%s", self.load_error)
        self.state = EngineState.FAILED if self._accepting else EngineState.STOPPED
        self._ready.set()

    def _close(self) -> None:
        self._fail_all()
        if self.state is EngineState.READY:
            self.state = EngineState.STOPPED
        self._closed.set()

    def _on_step(self, outputs: list[RequestOutput], records: list[RequestRecord], stats: list[StepStats],
                 gauges: EngineGauges) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outputs:
                target = self._entries.pop(out.request_id, None) if out.finished else self._entries.get(out.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        self.gauges = gauges
        self._hand_out(by_loop)
        if self.listener is None:
            return
        try:
            if stats:
                self.listener.on_step_stats(stats)
            for record in records:
                self.listener.on_request_finished(record)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            log.exception("metrics listener failed")

    def _fail_all(self) -> None:
        """Ends every request still open: the engine process is gone."""
        with self._lock:
            entries, self._entries = self._entries, {}
        reason = self.load_error or "the engine stopped"
        kind = "server_error" if self.state is EngineState.FAILED else "shutdown"
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, (loop, queue) in entries.items():
            by_loop.setdefault(loop, []).append((queue, EngineErrorOutput(
                rid, [], "", finished=True, finish_reason="error", error=reason, kind=kind)))
        self._hand_out(by_loop)

    def _hand_out(self, by_loop: dict[asyncio.AbstractEventLoop, list]) -> None:
        """Outputs into their requests' queues: directly on the loop that reads the pipe, in one
        wake-up on any other."""
        for loop, items in by_loop.items():
            if loop is self._loop:
                _put_all(items)
                continue
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # the clients' event loop is closed (server shutting down)


# ---------------------------------------------------------------------- the engine process
class _PipeEngine(AsyncEngine):
    """The engine process's :class:`AsyncEngine`: outputs, finished records and step stats of one
    iteration are collected and sent as one message at its end (the engine thread is the only sender
    while it runs)."""

    def __init__(self, factory: Callable, conn) -> None:
        super().__init__(factory, max_queue=1 << 30)  # the server's process bounds the queue
        self.conn = conn
        self.listener = self
        self._send_lock = threading.Lock()
        self._outputs: list[RequestOutput] = []
        self._records: list[RequestRecord] = []
        self._stats: list[StepStats] = []

    # EngineListener, on the engine thread
    def on_step_stats(self, stats: list[StepStats]) -> None:
        with self._send_lock:
            self._stats.extend(stats)

    def on_request_finished(self, record: RequestRecord) -> None:
        with self._send_lock:
            self._records.append(record)

    def _post(self, loop, items: list) -> None:
        with self._send_lock:
            self._outputs.extend(out for _, out in items)

    def _publish_gauges(self) -> None:
        super()._publish_gauges()
        self.flush()

    def flush(self) -> None:
        with self._send_lock:
            if not (self._outputs or self._records or self._stats):
                return
            message = ("step", self._outputs, self._records, self._stats, self.gauges)
            self._outputs, self._records, self._stats = [], [], []
            try:
                self.conn.send(message)
            except (OSError, ValueError):
                pass  # the server's process is gone; the command loop sees it and stops

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self.conn.send(message)

    def _run(self) -> None:
        super()._run()
        if self.core is not None and self.state is EngineState.FAILED:  # the loop crashed
            self.flush()
            self.send(("crashed", self.load_error))

    def enqueue(self, reqs: list[GenerationRequest], arrival: float) -> None:
        """Requests from the server's process: grammars compiled here (cached), then queued."""
        ready = []
        for r in reqs:
            if r.grammar is None:
                ready.append(r)
                continue
            try:
                ready.append(dataclasses.replace(r, grammar=self.core.grammars.compile(r.grammar)))
            except Exception as exc:  # noqa: BLE001 - the server compiled it already; never expected
                self.reject([r], str(exc), kind="invalid_request")
        if ready:
            self._enqueue(ready, None, None, arrival)

    def reject(self, reqs: list[GenerationRequest], error: str, kind: str = "server_error") -> None:
        """Ends ``reqs`` with an error before they reach the core."""
        with self._send_lock:
            self._outputs.extend(EngineErrorOutput(r.request_id, [], "", finished=True, finish_reason="error",
                                                   error=error, kind=kind) for r in reqs)
        self.flush()


def _child_main(factory: Callable, conn, log_level: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server drains us
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    engine = _PipeEngine(factory, conn)
    engine.start()
    if not engine.wait_ready():
        engine.send(("failed", engine.load_error))
        return
    core = engine.core
    engine.send(("ready", CoreView.of(core), core.free_batch_slots))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server's process is gone: stop at once
            engine._stop_accepting()
            engine._stop_thread()
            return
        kind = message[0]
        if kind == "submit":
            try:
                engine.enqueue(message[1], message[2])
            except Exception as exc:  # noqa: BLE001 - a bad batch fails alone; the engine goes on
                log.exception("queueing requests failed")
                engine.reject(message[1], f"{type(exc).__name__}: {exc}")
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "shutdown":
            engine._stop_accepting()
            deadline = time.monotonic() + message[1]
            while engine.num_unfinished and engine.state is EngineState.READY and time.monotonic() < deadline:
                time.sleep(0.02)
            engine._stop_thread()
            engine.flush()
            engine.send(("stopped",))
            return
