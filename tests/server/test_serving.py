"""AsyncEngine against the fake core: threading, queue bound, aborts, failures, shutdown, timestamps."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.async_engine import AsyncEngine, EngineErrorOutput, EngineOverloaded, EngineState, EngineUnavailable
from engine.request import GenerationRequest, SamplingParams
from tests.fakes import FakeCore, make_tokenizer


async def _drain(stream) -> list:
    return [o async for o in stream]


class Recorder:
    def __init__(self) -> None:
        self.records, self.stats = [], []

    def on_step_stats(self, stats) -> None:
        self.stats.extend(stats)

    def on_request_finished(self, record) -> None:
        self.records.append(record)


def req(rid: str, text: str = "hello world", max_tokens: int = 8, **kw) -> GenerationRequest:
    ids = make_tokenizer().encode(text)
    return GenerationRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))


async def started(engine: AsyncEngine) -> AsyncEngine:
    engine.start()
    assert await asyncio.to_thread(engine.wait_ready, 10)
    return engine


async def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_generate_runs_on_engine_thread_and_records_latencies():
    async def main():
        rec, core = Recorder(), FakeCore()
        engine = await started(AsyncEngine(core, listener=rec))
        outs = [o async for o in engine.generate(req("a", max_tokens=12))]
        await engine.shutdown()
        return rec, core, outs

    rec, core, outs = asyncio.run(main())
    assert core._thread not in (None, threading.get_ident())  # never on the event loop's thread
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == outs[-1].completion_tokens == 12
    (r,) = rec.records
    assert r.arrival <= r.admitted <= r.first_token <= r.last_token <= r.finished
    # per-token inter-token latency: every token after the first delta is one observation
    assert sum(k for _, k in r.token_gaps) == 12 - len(outs[0].new_token_ids)
    assert r.completion_tokens == 12 and r.spec.steps == outs[-1].spec.steps > 0
    assert sum(s.drafted_tokens for s in rec.stats) == r.spec.drafted_tokens


def test_queue_bound_is_all_or_nothing_and_spares_admitted_requests():
    async def main():
        core = FakeCore(max_batch=1, step_delay=0.02)
        engine = await started(AsyncEngine(core, max_queue=2))
        running = engine.submit([req("run", max_tokens=30)])
        await wait_for(lambda: core.num_running == 1)
        waiting = engine.submit([req("w1", max_tokens=2)])
        with pytest.raises(EngineOverloaded, match="max_queue=2"):
            engine.submit([req("x1"), req("x2")])  # room for one only: none is queued
        assert engine.num_unfinished == 2
        third = engine.submit([req("w2", max_tokens=2)])
        with pytest.raises(EngineOverloaded):
            engine.submit([req("x3")])
        results = [await _drain(g) for g in (running, waiting, third)]
        await engine.shutdown()
        return results

    for outs in asyncio.run(main()):
        assert outs[-1].finish_reason == "length"


def test_in_flight_capacity_is_max_batch_plus_max_queue():
    """An idle engine takes ``max_batch + max_queue`` requests at once: the ones that will run at the
    next step are not counted as waiting (they were, and the capacity was ``max_queue``)."""
    async def main():
        core = FakeCore(max_batch=2, step_delay=0.05)
        engine = await started(AsyncEngine(core, max_queue=3))
        group = engine.submit([req(f"r{i}", max_tokens=20) for i in range(5)])  # 2 to run + 3 to wait
        with pytest.raises(EngineOverloaded, match="max_queue=3"):
            engine.submit([req("one-too-many")])
        await wait_for(lambda: core.num_running == 2)
        with pytest.raises(EngineOverloaded):
            engine.submit([req("still-too-many")])
        outs = await _drain(group)
        await engine.shutdown()
        return outs

    outs = asyncio.run(main())
    assert sum(1 for o in outs if o.finished and o.finish_reason == "length") == 5


def test_abort_frees_the_slot_between_steps():
    async def main():
        core, rec = FakeCore(max_batch=1, step_delay=0.01), Recorder()
        engine = await started(AsyncEngine(core, listener=rec))
        gen = engine.generate(req("long", max_tokens=200))
        first = await gen.__anext__()
        await gen.aclose()  # what a client disconnect does
        await wait_for(lambda: engine.gauges.num_running == 0 and engine.num_unfinished == 0)
        after = [o async for o in engine.generate(req("next", max_tokens=3))]
        await engine.shutdown()
        return core, rec, first, after

    core, rec, first, after = asyncio.run(main())
    assert not first.finished and core.aborted == ["long"]
    assert after[-1].finish_reason == "length"
    assert [r.finish_reason for r in rec.records] == ["abort", "length"]


def test_add_request_error_fails_only_that_request():
    async def main():
        engine = await started(AsyncEngine(FakeCore(max_model_len=64)))
        bad, good = engine.submit([req("bad", max_tokens=100)]), engine.submit([req("good", max_tokens=4)])
        results = [o async for o in bad], [o async for o in good]
        await engine.shutdown()
        return results

    bad, good = asyncio.run(main())
    assert isinstance(bad[-1], EngineErrorOutput) and bad[-1].kind == "invalid_request"
    assert "context length" in bad[-1].error
    assert good[-1].finish_reason == "length"


def test_step_failure_fails_running_requests_and_keeps_serving():
    async def main():
        core = FakeCore(step_delay=0.005)
        engine = await started(AsyncEngine(core))
        gen = engine.generate(req("victim", max_tokens=50))
        await gen.__anext__()
        core.fail_next_step = True
        rest = [o async for o in gen]
        later = [o async for o in engine.generate(req("later", max_tokens=3))]
        await engine.shutdown()
        return rest, later, engine

    rest, later, engine = asyncio.run(main())
    assert rest[-1].finish_reason == "error" and rest[-1].kind == "server_error" and "injected" in rest[-1].error
    assert later[-1].finish_reason == "length"


def test_shutdown_aborts_in_flight_and_refuses_new_requests():
    async def main():
        core = FakeCore(max_batch=1, step_delay=0.01)
        engine = await started(AsyncEngine(core))
        running = engine.submit([req("r", max_tokens=200)])
        queued = engine.submit([req("q", max_tokens=200)])
        await wait_for(lambda: core.num_running == 1)
        await engine.shutdown(grace_seconds=0.05)
        with pytest.raises(EngineUnavailable, match="shutting down"):
            engine.submit([req("late")])
        return [o async for o in running], [o async for o in queued], engine

    running, queued, engine = asyncio.run(main())
    # both were in flight (the second waiting in the core): the shutdown ends them with an error their
    # handlers turn into a 503 or an error event
    assert all(o[-1].finish_reason == "error" and o[-1].kind == "shutdown" for o in (running, queued))
    assert engine.state is EngineState.STOPPED and not engine._thread.is_alive()


def test_factory_loads_on_engine_thread_and_reports_failures():
    gate = threading.Event()

    def slow_factory():
        gate.wait(10)
        return FakeCore()

    async def main():
        engine = AsyncEngine(slow_factory)
        engine.start()
        await asyncio.sleep(0.05)
        with pytest.raises(EngineUnavailable, match="loading"):
            engine.submit([req("early")])
        gate.set()
        assert await asyncio.to_thread(engine.wait_ready, 10)
        outs = [o async for o in engine.generate(req("a", max_tokens=2))]
        await engine.shutdown()

        broken = AsyncEngine(lambda: (_ for _ in ()).throw(OSError("no weights")))
        broken.start()
        assert not await asyncio.to_thread(broken.wait_ready, 10)
        with pytest.raises(EngineUnavailable, match="no weights"):
            broken.submit([req("b")])
        return outs, broken

    outs, broken = asyncio.run(main())
    assert outs[-1].finished and broken.state is EngineState.FAILED


def test_max_queue_validated():
    with pytest.raises(ValueError, match="max_queue"):
        AsyncEngine(FakeCore(), max_queue=0)


def test_metrics_reach_the_listener_during_the_next_step_or_once_idle():
    """Step stats and finished requests' records are handed to the listener off the step's path (while
    the next step runs, ``EngineCore.defer``), on the engine thread, and without waiting for another
    step once the engine is idle."""
    class ThreadRecorder(Recorder):
        def on_request_finished(self, record) -> None:
            super().on_request_finished(record)
            self.threads.add(threading.get_ident())

    async def main():
        rec, core = ThreadRecorder(), FakeCore(step_delay=0.005)
        rec.threads = set()
        engine = await started(AsyncEngine(core, listener=rec))
        short, long = engine.generate(req("short", max_tokens=2)), engine.generate(req("long", max_tokens=40))
        outs = await asyncio.gather(_drain(short), _drain(long))
        await wait_for(lambda: len(rec.records) == 2)  # the engine is idle: no step is coming
        drafted = sum(s.drafted_tokens for s in rec.stats)
        await engine.shutdown()
        return rec, core, outs, drafted

    rec, core, outs, drafted = asyncio.run(main())
    assert rec.threads == {core._thread}
    assert sorted(r.completion_tokens for r in rec.records) == [2, 40]
    assert drafted == sum(o[-1].spec.drafted_tokens for o in outs) > 0
    assert len(rec.stats) == core.steps_run
