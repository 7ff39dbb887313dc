"""A CPU stand-in for a GPU: catches host/device mixing and counts host syncs, without a GPU.

:class:`DeviceCheck` is a ``TorchFunctionMode``.  Tensors that would live on the accelerator are
*marked*: the models' weights and buffers, the KV caches and rotary tables (:func:`mark_engine`),
tensors created with an explicit ``device=`` (the model's device), tensors moved there with
``.to(device)``, and every result of an op that reads a marked tensor.  Everything else is a host
tensor.  Then:

* an op that mixes a marked tensor with an unmarked one of more than one element is a
  **violation** (on CUDA it would fail, or silently copy and synchronize): recorded with its stack,
  and raised;
* reading a marked tensor on the host (``item``, ``tolist``, ``bool``/``int``/``float``,
  ``cpu``, ``numpy``, ``nonzero``, ``equal``) is a **sync point**, counted by label; so is copying a
  host tensor to the device without ``non_blocking`` (``h2d``: on CUDA a copy from pageable memory
  waits for the device's queue to drain, as torch's sync debug mode reports), and indexing with a
  0-dim integer or bool device tensor (``tensor-index``: torch reads it on the host first);
  ``engine.device.to_host`` counts once for all the tensors it brings back.

On the CPU ``x.to(model.device)`` is a no-op returning ``x`` itself; the mode returns a marked copy
instead, as a real transfer would, so the host tensor stays a host tensor.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

import engine.device as engine_device

_ATTR = "_mcsd_on_device"
SYNCS = {
    torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.__index__: "index",
    torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy", torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero", torch.equal: "equal", torch.Tensor.__array__: "numpy",
}
_CREATE = {torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.rand, torch.randn,
           torch.randint, torch.tensor, torch.as_tensor, torch.eye, torch.linspace}
_FREE = {torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel,
         torch.Tensor.__len__, torch.Tensor.is_contiguous, torch.Tensor.stride, torch.Tensor.element_size,
         torch.Tensor.data_ptr, torch.Tensor.__hash__, torch.Tensor.untyped_storage, torch.Tensor.get_device}


def mark(t: torch.Tensor) -> torch.Tensor:
    setattr(t, _ATTR, True)
    return t


def is_marked(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _ATTR, False)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _is_device(d: Any, device: torch.device) -> bool:
    if d is None:
        return False
    d = torch.device(d) if isinstance(d, (str, int)) else d
    return isinstance(d, torch.device) and d.type == device.type


class DeviceViolation(RuntimeError):
    pass


class DeviceCheck(TorchFunctionMode):
    def __init__(self, device: torch.device = torch.device("cpu"), strict: bool = True) -> None:
        """``strict=False`` records violations without raising (to survey code that has them)."""
        super().__init__()
        self.device = device
        self.strict = strict
        self.syncs: Counter[str] = Counter()
        self.violations: list[str] = []
        self.counting = True
        self.sync_stacks: list[str] = []  # where each counted read happened (for a failing test's message)

    # ------------------------------------------------------------------ use
    def __enter__(self) -> "DeviceCheck":
        engine_device.sync_listeners.append(self._on_sync)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        engine_device.sync_listeners.remove(self._on_sync)
        return super().__exit__(*exc)

    def _on_sync(self, label: str) -> None:
        if self.counting:
            self.syncs[label] += 1
            self.sync_stacks.append(label + ":\n" + "".join(traceback.format_stack(limit=6)[:-2]))

    def reset(self) -> None:
        self.syncs.clear()
        self.sync_stacks.clear()

    # ------------------------------------------------------------------ the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: C901 - one dispatch table
        kwargs = kwargs or {}
        if func in _FREE or getattr(func, "__name__", "") in ("__get__", "__set__"):
            return func(*args, **kwargs)
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        marked = [t for t in inputs if is_marked(t)]
        if func in SYNCS:
            if marked and not engine_device.transferring and self.counting:
                self.syncs[SYNCS[func]] += 1
                self.sync_stacks.append(SYNCS[func] + ":\n" + "".join(traceback.format_stack(limit=8)[:-1]))
            out = func(*args, **kwargs)
            if func is torch.Tensor.cpu and out is args[0]:
                out = out.clone()  # a real host copy: not marked
            return out
        if func is torch.Tensor.to or func is torch.Tensor.cuda:
            return self._to(func, args, kwargs, marked)
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and self.counting:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(is_marked(i) and i.dim() == 0 and not i.is_floating_point() for i in index):
                # a 0-dim integer or bool device tensor as an index is read on the host first: a sync on CUDA
                self.syncs["tensor-index"] += 1
                self.sync_stacks.append("tensor-index:\n" + "".join(traceback.format_stack(limit=8)[:-1]))
        if marked:
            loose = [t for t in inputs if not is_marked(t) and t.numel() > 1]
            if loose:
                self._violation(func, marked, loose)
        if func in (torch.tensor, torch.as_tensor) and _is_device(kwargs.get("device"), self.device) and self.counting:
            self.syncs["h2d"] += 1  # host data copied to the device the plain way, as above
            self.sync_stacks.append("h2d:\n" + "".join(traceback.format_stack(limit=8)[:-1]))
        out = func(*args, **kwargs)
        explicit = func in _CREATE or getattr(func, "__name__", "").endswith("_like")
        if marked or (explicit and _is_device(kwargs.get("device"), self.device)):
            for t in _tensors(out):
                mark(t)
        return out

    def _to(self, func, args, kwargs, marked):
        src = args[0]
        on_device = is_marked(src)  # the source's place, whatever else the call names (``x.to(other)``)
        target = kwargs.get("device")
        non_blocking = bool(kwargs.get("non_blocking"))
        for a in args[1:]:
            if isinstance(a, (torch.device, str)):
                target = a
            elif isinstance(a, torch.Tensor):
                target = a.device if is_marked(a) else None
            elif isinstance(a, bool):  # ``to(device, dtype, non_blocking)``: the first positional bool
                non_blocking = non_blocking or a
        to_device = _is_device(target, self.device) or func is torch.Tensor.cuda
        if to_device and not on_device and not non_blocking and self.counting:
            # a host tensor copied to the device the plain way: on CUDA, a copy from pageable memory
            # that makes the host wait for the device's queue (``engine.device.to_device`` does not)
            self.syncs["h2d"] += 1
            self.sync_stacks.append("h2d:\n" + "".join(traceback.format_stack(limit=8)[:-2]))
        out = func(*args, **kwargs)
        if on_device or to_device:
            if out is src and not on_device:
                out = out.clone()  # a real transfer makes a new tensor; the host one stays a host tensor
            mark(out)
        return out

    def _violation(self, func, marked, loose) -> None:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
        where = "".join(traceback.format_stack(limit=12)[:-3])
        msg = (f"{name} mixes device tensors {[tuple(t.shape) for t in marked][:3]} with host tensors "
               f"{[tuple(t.shape) for t in loose][:3]}\n{where}")
        self.violations.append(msg)
        if self.strict:
            raise DeviceViolation(msg)


def mark_engine(core) -> None:
    """Marks what an engine keeps on its device: weights, buffers, caches, rotary tables."""
    models = [core.target.model]
    proposer = core.runner.proposer
    if proposer is not None:
        models.append(proposer.model)
    caches = [core.cache] + ([proposer.cache] if proposer is not None else [])
    for m in models:
        for t in list(m.parameters()) + list(m.buffers()):
            mark(t)
        for sub in m.modules():  # quantized blocks and other tensors kept as plain attributes
            for value in vars(sub).values():
                for t in _tensors(value):
                    mark(t)
                if hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.Tensor)):
                    for t in _tensors(vars(value)):  # e.g. a QuantWeight's blocks
                        mark(t)
        rope = getattr(m, "rope", None)
        if rope is not None:
            for t in _tensors(vars(rope)):
                mark(t)
    for c in caches:
        mark(c.k)
        mark(c.v)
        if c.captured is not None:  # the fixed-shape forwards' persistent inputs (engine.graphs)
            for t in c.captured.buffers():
                mark(t)
    vocab = getattr(core, "draft_vocab", None)
    if vocab is not None:
        for t in _tensors(vars(vocab)):
            mark(t)
