"""Moving data between the host and the model's device, with the synchronizations made explicit.

A step builds small host-side tensors (token ids, tree shapes, uniforms) and moves them to the
device; at the end it brings a few results back.  On a GPU every read of device data by the host
waits for the device to finish what it was given (a *sync point*).  The engine's rule is to pay
that once where it must, so these helpers are the only places a step moves data:

* :func:`to_device` copies host tensors to the device without waiting for it (through pinned
  memory on CUDA), :func:`to_device_many` several of them in one copy;
* :func:`to_host` brings any number of device tensors back behind one synchronization, in one copy;
* :func:`synchronize` waits for the device, before a clock is read for a timing (start-up
  measurements); a step times its parts with :class:`DeviceTimer`, which never waits.

The test suite's device-check mode (``tests/device_check.py``) counts the sync points of a step
through :data:`sync_listeners`.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

#: called with a label at every deliberate sync point (the device-check mode counts them)
sync_listeners: list[Callable[[str], None]] = []
#: True while :func:`to_host` copies: the device-check mode lets those reads through uncounted
transferring = False


@contextmanager
def _transfer() -> Iterator[None]:
    global transferring
    transferring = True
    try:
        yield
    finally:
        transferring = False


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``; on CUDA the copy does not make the host wait."""
    return to_device_many([t], device)[0]


def to_device_many(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host ``tensors`` on ``device`` (those already there as they are).  On CUDA without making the host
    wait, in one copy: their bytes packed into one pinned staging buffer of this call's own
    (:func:`pack_bytes`; ``pin_memory`` of an already pinned tensor would be that tensor, which the host
    could change before the copy ran, and an expanded view cannot be pinned at all), copied once, and
    unpacked as views of the device's copy."""
    if device.type != "cuda":
        return [t.to(device, non_blocking=True) for t in tensors]  # the device-check mode counts plain copies
    out: list[torch.Tensor | None] = [t if t.device.type != "cpu" else None for t in tensors]
    idx = [i for i, t in enumerate(tensors) if out[i] is None]
    if idx:
        host = [tensors[i] for i in idx]
        staging = torch.empty(sum(t.numel() * t.element_size() for t in host), dtype=torch.uint8, pin_memory=True)
        _, layout = pack_bytes(host, out=staging)  # one host copy, straight into pinned memory
        flat = staging.to(device, non_blocking=True)
        for i, part in zip(idx, unpack_bytes(flat, layout)):
            out[i] = part
    return out  # type: ignore[return-value]


def staged_layout(shapes: list[tuple[torch.Size, torch.dtype]]) -> tuple[int, Layout]:
    """Bytes and :data:`Layout` of tensors of ``shapes`` as :func:`pack_bytes` packs them: ``(byte
    offset, bytes, dtype, shape)`` each, in their order, the widest items first so that every tensor
    starts at a multiple of its item size and unpacks as a view.  A device buffer of that size, viewed
    with :func:`unpack_bytes`, takes such tensors in one copy (:func:`copy_packed`)."""
    layout: Layout = [(0, 0, dtype, torch.Size(shape)) for shape, dtype in shapes]
    at = 0
    for i in sorted(range(len(shapes)), key=lambda i: -shapes[i][1].itemsize):
        shape, dtype = shapes[i]
        size = torch.Size(shape).numel() * dtype.itemsize
        layout[i] = (at, size, dtype, torch.Size(shape))
        at += size
    return at, layout


def copy_packed(buffer: torch.Tensor, tensors: list[torch.Tensor], layout: Layout) -> None:
    """Host ``tensors`` into ``buffer`` (a uint8 device buffer laid out as ``layout``, from
    :func:`staged_layout`) in one copy: on CUDA from a pinned buffer of this call's own, without
    making the host wait."""
    if [(t.dtype, t.shape) for t in tensors] != [(dtype, shape) for _, _, dtype, shape in layout]:
        raise ValueError("the tensors do not match the buffer's layout")
    if buffer.device.type != "cuda":
        packed, _ = pack_bytes(tensors)
        buffer.copy_(packed.to(buffer.device, non_blocking=True))  # the device-check mode sees a transfer
        return
    staging = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=True)
    pack_bytes(tensors, out=staging)
    buffer.copy_(staging, non_blocking=True)


def tensor(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``torch.tensor(data)`` built on the host and copied to ``device`` (see :func:`to_device`)."""
    return to_device(torch.tensor(data, dtype=dtype), device)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host copies of ``tensors`` behind a single synchronization with their device.  On CUDA the
    device's tensors travel in one non-blocking copy into pinned memory: their bytes packed into one
    buffer there (:func:`pack_bytes`), unpacked here as views of the pinned copy."""
    return start_read(*tensors).wait()


class Read:
    """A read of device tensors whose copy is queued (:func:`start_read`): :meth:`wait` waits for that
    copy alone, so work queued on the device after it (the next forward) does not delay it."""

    def __init__(self, out: list[torch.Tensor], done: Optional["torch.cuda.Event"]) -> None:
        self._out, self._done = out, done

    def wait(self) -> list[torch.Tensor]:
        """The host copies, behind the read's one synchronization (a declared read)."""
        for listener in sync_listeners:
            listener("to_host")
        with _transfer():
            if self._done is not None:
                self._done.synchronize()
            return [t.detach().cpu() for t in self._out]


def start_read(*tensors: torch.Tensor) -> Read:
    """Queues the copy of ``tensors`` to the host and returns at once; :meth:`Read.wait` gives them.
    On CUDA the device's tensors are packed into one buffer (:func:`pack_bytes`) and copied in one
    non-blocking copy into pinned memory, after which an event is recorded; elsewhere the copy is made
    when waited for."""
    cuda = [i for i, t in enumerate(tensors) if t.device.type == "cuda"]
    if not cuda:
        return Read(list(tensors), None)
    with _transfer():
        out = list(tensors)
        if len(cuda) == 1:
            out[cuda[0]] = tensors[cuda[0]].detach().to("cpu", non_blocking=True)
        else:
            packed, layout = pack_bytes([tensors[i] for i in cuda])
            host = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            for i, t in zip(cuda, unpack_bytes(host, layout)):
                out[i] = t
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(tensors[cuda[0]].device))
    return Read(out, done)


Layout = list[tuple[int, int, torch.dtype, torch.Size]]


def pack_bytes(tensors: list[torch.Tensor], out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Layout]:
    """One uint8 tensor on the tensors' device holding the bytes of all of them (one kernel; into
    ``out`` if given, of exactly their size), and where each one lies (:func:`staged_layout`)."""
    _, layout = staged_layout([(t.shape, t.dtype) for t in tensors])
    parts = [tensors[i].detach().reshape(-1).view(torch.uint8) for i in sorted(range(len(tensors)),
                                                                                key=lambda i: layout[i][0])]
    if out is None:
        return torch.cat(parts), layout
    return torch.cat(parts, out=out), layout


def unpack_bytes(buffer: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The tensors :func:`pack_bytes` packed, as views of ``buffer`` (its packed bytes, anywhere)."""
    return [buffer[at: at + size].view(dtype).view(shape) for at, size, dtype, shape in layout]


class Pending:
    """Results still on the device: ``tensors`` to bring back, and ``finish`` to turn their host
    copies into the answer.  Several pendings are read back together by :func:`finish_all`."""

    def __init__(self, tensors: list[torch.Tensor], finish: Callable[[list[torch.Tensor]], object],
                 next_roots: Optional[torch.Tensor] = None) -> None:
        self.tensors = tensors
        self.finish = finish
        #: [sequences] each sequence's next root token on the device, when the step is plain decoding: the
        #: next forward's input, which the engine may run before the host reads it (``decode_ahead``)
        self.next_roots = next_roots

    def result(self):
        return self.finish(to_host(*self.tensors))

    def then(self, fn: Callable[[object], object]) -> "Pending":
        """The same device results, with ``fn`` applied to this pending's answer."""
        finish = self.finish
        return Pending(self.tensors, lambda host: fn(finish(host)), self.next_roots)


def finish_all(pendings: list[Pending], before_wait: Optional[Callable[[], None]] = None) -> list:
    """Every pending's answer, behind one synchronization for all of them.  ``before_wait``: called
    once the read is queued and before the host waits for it (work queued on the device then does
    not delay the read)."""
    read = start_read(*[t for p in pendings for t in p.tensors]) if any(p.tensors for p in pendings) else None
    if before_wait is not None:
        before_wait()
    host = read.wait() if read is not None else []
    out, at = [], 0
    for p in pendings:
        out.append(p.finish(host[at: at + len(p.tensors)]))
        at += len(p.tensors)
    return out


def synchronize(device: torch.device) -> None:
    """Waits for ``device`` to finish its queued work (before reading a clock)."""
    if device.type == "cuda":
        for listener in sync_listeners:
            listener("synchronize")
        torch.cuda.synchronize(device)


class DeviceTimer:
    """Seconds of device work between :meth:`start` and :meth:`stop`, without making the host wait for
    the device: on CUDA two events recorded in the stream, whose interval is read (:meth:`seconds`) once
    the host knows the work is done, after a later read of results; elsewhere the host's clock, which
    is the device's."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._t: list[float] = []
        self._events: list = []

    def start(self) -> "DeviceTimer":
        self._mark()
        return self

    def stop(self) -> None:
        self._mark()

    def _mark(self) -> None:
        self._t.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)

    def host_seconds(self) -> float:
        """The host's seconds between the two points (on a device it runs ahead of the work)."""
        return self._t[1] - self._t[0]

    def seconds(self) -> float:
        """Call after a host read of results computed after :meth:`stop` (both events are done then)."""
        if self.cuda:
            start, end = self._events
            if not end.query():  # no read came after it (a step whose every verification failed): wait
                end.synchronize()
            return start.elapsed_time(end) / 1e3
        return self._t[1] - self._t[0]


@dataclass
class SyncReport:
    """What :func:`sync_report` saw: the synchronizations the engine declared, by label (``to_host``,
    ``synchronize``), and those torch's sync debug mode reported on CUDA (warnings, each with the
    file and line that made it)."""

    declared: Counter = field(default_factory=Counter)
    reported: list = field(default_factory=list)


@contextmanager
def sync_report(cuda: bool = True) -> Iterator[SyncReport]:
    """While open, counts the declared synchronizations (:data:`sync_listeners`) and, with ``cuda`` on a
    machine that has it, collects every synchronizing CUDA call torch's sync debug mode reports.  For
    tests and benchmarks: the debug mode is process-wide."""
    report = SyncReport()

    def declared(label: str) -> None:
        report.declared[label] += 1

    debug = cuda and torch.cuda.is_available()
    sync_listeners.append(declared)
    if debug:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield report
            report.reported = [w for w in caught if "synchronizing" in str(w.message)]
    finally:
        if debug:
            torch.cuda.set_sync_debug_mode("default")
        sync_listeners.remove(declared)
