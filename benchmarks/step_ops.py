"""What a step asks of a GPU's host, counted on the CPU: device operations, copies and reads.

Once the forwards are captured as CUDA graphs, what is left of a step on the host is the work around
them: building the draft tree, sampling, verification, the copies of host data to the device and
the read of the results. Each device operation there is a kernel the host launches from Python
(a few microseconds each). This script counts them without a GPU. It runs the engine with tiny random
models on the CPU, in the torch formulation a GPU runs (``MCSD_CPU_KERNELS=0``,
``MCSD_INVARIANT_ATTENTION=0``), on the fixed-shape path a graph replays (``static_shapes``), under
the test suite's device-check mode (``tests/device_check.py``), which marks what would live on the
device. Per decoding step (the prefill step left out):

* **device ops**: torch calls outside the forwards that produce a device tensor, and indexing that
  gathers or writes on the device; views and calls that return their input (a ``.to`` that changes
  nothing) left out (a call may be more than one kernel);
* **h2d copies**: copies of host data to the device: ``engine.device.to_device_many`` makes one a
  call on CUDA (on the CPU it copies tensor by tensor; the count here is its calls with host data),
  and ``copy_packed`` one (a forward's inputs into its bucket's buffers);
* **forwards**: the captured forwards the step replays (target and draft);
* **reads**: the host reads the engine declares (``engine.device.to_host``);
* **vocab rows**: rows of the vocabulary's width that those device operations write (a softmax, a
  residual law, a copy of logits: ``[rows, vocab]`` outputs). Times the vocabulary's bytes (151,936
  float32 logits, 0.6 MB, for Qwen2.5) it is what they move through the device's memory at a real
  vocabulary size, which the tiny models' (101) hides: the device time of sampling and verification
  at large batches;
* **torch calls**: every torch call outside the forwards, views and host tensors' too (each costs the
  host a dispatch, a few microseconds, whether or not it makes a kernel);
* **py calls**: every Python function and builtin called outside the forwards (``sys.setprofile``).
  With torch calls, a count of the host's work that does not vary with the machine's load, as the
  clocks below do;
* **host ms**: the step's wall time less the time inside the forwards (median of ``--time-steps``
  steps, timed apart from the counting).  With compute this small it is what the host spends on a
  step outside its graphs, at the CPU's dispatch cost (a GPU's launches cost more): a floor under
  the step time on any device;
* **serial ms**: the part of it from a read of the device to the next forward's launch (summed over
  the step's forwards; the gap after a step's read ends in the next step). A GPU has nothing queued
  then, so that time adds to the step's; the rest runs while the device works through what the
  host queued, and costs time only where it outlasts the device's work.  A read with the next
  forward already queued behind it (``decode_ahead``, on here as on CUDA; ``--no-decode-ahead``:
  off) starts no serial time.

With ``--forward`` it also counts one forward's operators eagerly (every torch call in the layers)
and, compiled (``graph_compile``), the launches of Inductor's code for one layer. Prints tables and
writes JSON::

    python benchmarks/step_ops.py [--configs "plain;mcsd:4,2,2"] [--batches 1,8] [--temperatures 0,0.7]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine.device as engine_device  # noqa: E402
import engine.graphs as engine_graphs  # noqa: E402
from benchmarks.harness import machine, print_table, write_json  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.models.cpu_kernels import torch_formulation  # noqa: E402
from engine.request import GenerationRequest, SamplingParams, SpecOptions  # noqa: E402
from tests import device_check  # noqa: E402
from tests.device_check import DeviceCheck, _tensors, is_marked, mark_engine  # noqa: E402
from tests.tiny import tiny_loaded  # noqa: E402

#: files whose frames are the counting's own, not the step's (``StepCounter.profile``)
_OWN_FILES = {__file__, str(Path(__file__).resolve()), device_check.__file__}

#: what ``--clock`` times host and serial ms with
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}

#: torch calls that make no kernel: views, metadata
VIEWS = {"view", "view_as", "reshape", "transpose", "unsqueeze", "squeeze", "expand", "expand_as", "permute", "t",
         "split", "chunk", "unbind", "narrow", "select", "flatten", "unflatten", "as_strided", "detach", "__getitem__",
         "movedim", "diagonal", "T", "mT", "__get__", "dim", "size", "shape", "stride", "numel"}

#: the same for aten operators (one forward's count, under a dispatch mode): parts of their names
ATEN_VIEWS = ("view", "split", "transpose", "unsqueeze", "reshape", "slice", "select", "expand", "alias", "detach",
              "permute", "squeeze", "unbind", "as_strided", "aten.t.")


class StepCounter(DeviceCheck):
    """The device-check mode, also counting device operations outside the forwards and the copies."""

    def __init__(self, vocab: int = 0) -> None:
        super().__init__(strict=True)
        self.ops: Counter[str] = Counter()
        self.vocab = vocab  # the model's vocabulary size: outputs that wide are counted in vocab rows
        self.vocab_rows = 0
        self.copies = 0
        self.forwards = 0
        self.calls = 0  # every torch call, views and host tensors' included
        self.py_calls = 0  # every Python and builtin function call (:meth:`profile`)
        self.quiet = 0  # inside a forward or a copy: not counted as the step's own operations

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.quiet:
            self.calls += 1
        out = super().__torch_function__(func, types, args, kwargs)
        name = getattr(func, "__name__", str(func))
        if name in ("to", "type_as", "contiguous", "float") and args and out is args[0]:
            return out  # nothing to do: no kernel
        if self.quiet:
            return out
        if name in ("__getitem__", "__setitem__") and is_marked(args[0]):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if name == "__setitem__" or any(isinstance(i, (torch.Tensor, list)) for i in index):
                self.ops[name] += 1  # a gather, or a write: a kernel (plain slicing is a view)
                self._count_rows(args[2] if name == "__setitem__" and len(args) > 2 else out)
        elif name not in VIEWS and any(is_marked(t) for t in _tensors(out)):
            self.ops[name] += 1
            self._count_rows(out)
        return out

    def _count_rows(self, written) -> None:
        for t in _tensors(written):
            if self.vocab and t.dim() and t.shape[-1] == self.vocab:
                self.vocab_rows += t.numel() // self.vocab

    def clear(self) -> None:
        self.ops.clear()
        self.copies = self.forwards = self.calls = self.py_calls = self.vocab_rows = 0
        self.reset()

    def profile(self, frame, event: str, arg) -> None:
        """A ``sys.setprofile`` hook counting the step's own function calls outside the forwards (this
        counter's and the device check's frames left out): a measure of the host's Python work that,
        unlike a clock, does not vary with what else the machine runs."""
        if event in ("call", "c_call") and not self.quiet and frame.f_code.co_filename not in _OWN_FILES:
            self.py_calls += 1


def _counting(counter_of, fn, on_call):
    def wrapped(*args, **kwargs):
        counter = counter_of()
        if counter is None:
            return fn(*args, **kwargs)
        on_call(counter, args)
        counter.quiet += 1
        try:
            return fn(*args, **kwargs)
        finally:
            counter.quiet -= 1
    return wrapped


def _engine(config: dict, batch: int, temperature: float, spec: bool, steps: int) -> EngineCore:
    """The tiny pair on the fixed-shape path, ``batch`` requests added (long enough for ``steps``), set
    as on CUDA: Max-Gram not reading the draft's tree, plain decoding ahead of its reads, deferred host
    work before the next read.  What it built is frozen out of the garbage collector's scans, as the
    server does after loading (a full collection over the process's objects otherwise lands in some
    steps)."""
    gc.unfreeze()  # (the last engine's objects: collectable again)
    gc.collect()
    target, draft = tiny_loaded("qwen2", seed=0), tiny_loaded("qwen2", seed=1, layers=1)
    core = EngineCore(target, draft, EngineConfig.from_settings(
        max_batch=batch, max_model_len=512, static_shapes=True, graph_batches=(batch,), load_aware=False,
        **{"maxgram_read_tree": False, "decode_ahead": "on", "defer_host_work": "on", **config}))
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(1, 100, (40,), generator=gen).tolist()
        params = SamplingParams(max_tokens=min(steps * 8 + 8, 400), temperature=temperature, ignore_eos=True,
                                seed=i if temperature else None)
        core.add_request(GenerationRequest(f"r{i}", ids, params, SpecOptions(enabled=spec)))
    gc.collect()
    gc.freeze()
    return core


def count_steps(config: dict, batch: int, temperature: float, spec: bool, steps: int) -> list[dict]:
    """``steps`` decoding steps of ``batch`` requests under :class:`StepCounter`, one dict per step."""
    core = _engine(config, batch, temperature, spec, steps)
    mark_engine(core)
    counter = StepCounter(core.target.config.vocab_size)
    current = [None]
    forwards = _counting(lambda: current[0], engine_graphs.static_hidden,
                         lambda c, a: setattr(c, "forwards", c.forwards + 1))
    copies = _counting(lambda: current[0], engine_device.to_device_many,
                       lambda c, a: setattr(c, "copies", c.copies + any(not is_marked(t) for t in a[0])))
    wrappers = {engine_graphs.static_hidden: forwards, engine_device.to_device_many: copies}
    copy_packed = getattr(engine_device, "copy_packed", None)  # (an engine older than it: measured by bench_ab)
    if copy_packed is not None:  # a forward's inputs: one copy
        wrappers[copy_packed] = _counting(lambda: current[0], copy_packed,
                                          lambda c, a: setattr(c, "copies", c.copies + 1))
    with contextlib.ExitStack() as stack:
        # every module that imported the functions holds its own name for them
        for module in [m for name, m in list(sys.modules.items()) if name.startswith("engine")]:
            for attr in ("static_hidden", "to_device_many", "copy_packed"):
                wrapper = wrappers.get(getattr(module, attr, None))
                if wrapper is not None:
                    stack.enter_context(mock.patch.object(module, attr, wrapper))
        return _count(core, counter, current, steps)


def time_steps(config: dict, batch: int, temperature: float, spec: bool, steps: int,
               clock=time.perf_counter) -> list[tuple[float, float]]:
    """``(host ms, serial ms)`` of ``steps`` decoding steps, timed without the counting mode's own cost.
    Host ms: the step's wall time less the time in the forwards (which a GPU replays from graphs).
    Serial ms: the host's time from a read of the device to the next forward's launch (summed over the
    step's forwards), when a GPU would have nothing queued: it adds to the step's time there.
    ``clock``: wall time, or the thread's CPU time (``time.thread_time``: what the host's own work took,
    without the time a shared machine gave its core to others)."""
    core = _engine(config, batch, temperature, spec, steps)
    inside, serial, read_at = [0.0], [0.0], [None]

    def timed(*args, **kwargs):
        t0 = clock()
        if read_at[0] is not None:
            serial[0] += t0 - read_at[0]
            read_at[0] = None
        try:
            return forward(*args, **kwargs)
        finally:
            inside[0] += clock() - t0

    def on_sync(label: str) -> None:
        if label == "to_host":  # (the next forward queued behind the read keeps the device busy)
            read_at[0] = clock() if core.runner.ahead is None else None
    forward = engine_graphs.static_hidden
    out = []
    with contextlib.ExitStack() as stack:
        for module in [m for name, m in list(sys.modules.items()) if name.startswith("engine")]:
            if getattr(module, "static_hidden", None) is forward:
                stack.enter_context(mock.patch.object(module, "static_hidden", timed))
        listeners = [*engine_device.sync_listeners, on_sync]
        stack.enter_context(mock.patch.object(engine_device, "sync_listeners", listeners))
        _past_prefill(core)
        for _ in range(steps):
            if not core.has_unfinished():
                break
            inside[0] = serial[0] = 0.0
            t0 = clock()
            core.step()
            out.append(((clock() - t0 - inside[0]) * 1e3, serial[0] * 1e3))
    return out


def _past_prefill(core: EngineCore) -> None:
    """Steps until every request has its first token, and one more: the prefill steps are left out, and
    so is the first decoding step, which runs its own forward and the next one's (``decode_ahead``)."""
    started: set[str] = set()
    waiting = len(core.scheduler.waiting) + len(core.scheduler.running)
    while len(started) < waiting and core.has_unfinished():
        started |= {out.request_id for out in core.step() if out.new_token_ids}
    if core.has_unfinished():
        core.step()


def _count(core: EngineCore, counter: StepCounter, current: list, steps: int) -> list[dict]:
    out = []
    with counter:
        _past_prefill(core)
        current[0] = counter
        for _ in range(steps):
            if not core.has_unfinished():
                break
            counter.clear()
            sys.setprofile(counter.profile)
            try:
                core.step()
            finally:
                sys.setprofile(None)
            out.append(dict(device_ops=sum(counter.ops.values()), vocab_rows=counter.vocab_rows,
                            h2d=counter.copies, forwards=counter.forwards,
                            reads=counter.syncs.get("to_host", 0), torch_calls=counter.calls,
                            py_calls=counter.py_calls, top=counter.ops.most_common(8)))
        current[0] = None
    return out


def parse_configs(text: str) -> list[tuple[str, dict, bool]]:
    """``plain;mcsd:4,2,2;mcsd+maxgram:4,2,2``: (name, engine settings, speculating)."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        if item == "plain":
            out.append((item, {}, False))
            continue
        method, _, tree = item.partition(":")
        out.append((item, dict(spec_method=method, tree=tuple(int(x) for x in tree.split(",")) if tree else (4, 2, 2)),
                    True))
    return out


def forward_ops() -> list[dict]:
    """One decode forward (1 x 1) of the tiny 2-layer model: torch operators a layer eagerly, and the
    launches of Inductor's code for one layer compiled (``graph_compile``: its fused kernels and
    library calls)."""
    from torch._inductor.graph import GraphLowering
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not any(v in str(func) for v in ATEN_VIEWS):
                self.count += 1
            return func(*args, **(kwargs or {}))

    model = tiny_loaded("qwen2", seed=0).model
    cache = model.new_cache(1, 64, block_size=4)
    grid = engine_graphs.BucketGrid((1,), (1,), (16,), width=1)
    inputs = engine_graphs.StaticInputs.empty(grid.buckets()[0], 4, 1, model.device)
    layers = len(model.layers)
    with torch.inference_mode():
        ops = Ops()
        with ops:
            engine_graphs.static_hidden(model, cache, inputs)
        outside = Ops()
        with outside:
            engine_graphs.static_hidden(model, cache, inputs, lambda layer, x, delta, ctx: (x, delta))
        codes: list[str] = []
        with mock.patch.object(GraphLowering, "save_output_code", codes.append):
            engine_graphs.static_hidden(model, cache, inputs, engine_graphs.compiled_layer())
    call = codes[-1][codes[-1].find("def call("):] if codes else ""
    launches = re.findall(r"^\s+(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+|aten\.\w+|torch\.ops\.\w+\.\w+)",
                          call, re.M)
    return [dict(layers="eager", per_layer=(ops.count - outside.count) / layers, around=outside.count),
            dict(layers="compiled", per_layer=len(launches) or None, around=outside.count)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="plain;mcsd:4,2,2;mcsd:2,1,1;mcsd+maxgram:4,2,2;cascade:4,2,2",
                    help="';'-separated: plain, or METHOD:TREE")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--steps", type=int, default=4, help="decoding steps counted (the median is reported)")
    ap.add_argument("--time-steps", type=int, default=40,
                    help="also time this many steps: host ms outside the forwards (median; 0: no timing)")
    ap.add_argument("--forward", action=argparse.BooleanOptionalAction, default=True,
                    help="also count one forward's operators, eager and compiled")
    ap.add_argument("--decode-ahead", action=argparse.BooleanOptionalAction, default=True,
                    help="plain decoding queues its next forward before reading (decode_ahead, as on CUDA)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="host and serial ms in wall time, or in the engine thread's CPU time (steadier on a "
                         "shared machine, whose other tenants take the core away at times)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    try:
        with torch_formulation():  # what a GPU runs; this process's own kernels again afterwards
            run(args)
    finally:
        gc.unfreeze()  # (what _engine froze)


def run(args) -> None:
    rows = []
    for name, config, spec in parse_configs(args.configs):
        config = {"decode_ahead": "on" if args.decode_ahead else "off", **config}
        for batch in (int(b) for b in args.batches.split(",")):
            for temperature in (float(t) for t in args.temperatures.split(",")):
                per = count_steps(config, batch, temperature, spec, args.steps)
                med = {k: statistics.median(p[k] for p in per)
                       for k in ("device_ops", "vocab_rows", "h2d", "forwards", "reads", "torch_calls", "py_calls")}
                if args.time_steps:
                    timed = time_steps(config, batch, temperature, spec, args.time_steps, CLOCKS[args.clock])
                    med["host_ms"] = statistics.median(h for h, _ in timed)
                    med["serial_ms"] = statistics.median(s for _, s in timed)
                rows.append(dict(config=name, batch=batch, temperature=temperature, **med, steps=len(per),
                                 top=per[-1]["top"]))
                print(f"{name} batch {batch} T={temperature}: {med}", flush=True)
    print("\nper decoding step, outside the captured forwards (medians; tiny models, torch formulation, CPU)")
    print_table(rows, [("config", "config", "s"), ("batch", "batch", "d"), ("temperature", "T", ".1f"),
                       ("device_ops", "device ops", ".0f"), ("vocab_rows", "vocab rows", ".0f"),
                       ("h2d", "h2d copies", ".0f"),
                       ("forwards", "forwards", ".0f"), ("reads", "reads", ".0f"),
                       ("torch_calls", "torch calls", ".0f"), ("py_calls", "py calls", ".0f")]
                + ([("host_ms", "host ms", ".2f"), ("serial_ms", "serial ms", ".2f")] if args.time_steps else []))
    result = dict(machine=machine(), args=vars(args), steps=rows, forward=[])
    if args.forward:
        result["forward"] = forward_ops()
        print("\none decode forward: operators a layer, and around the layers (embedding, addresses, mask, norm)")
        print_table(result["forward"], [("layers", "layers", "s"), ("per_layer", "per layer", ".1f"),
                                        ("around", "around them", "d")])
    write_json("step_ops.json", result, args.out)


if __name__ == "__main__":
    main()
