"""Captured forwards: the decoder stack at fixed shapes, replayed as CUDA graphs.

On a GPU a forward launched from Python costs the host far more than the device (hundreds of
kernels, each a few microseconds of interpreter and launch).  A CUDA graph records one forward's
kernels once and replays them with a single launch, so every input must live at a fixed address
with a fixed shape.  This module gives the model's forward that form:

* a :class:`Bucket` is one shape: ``batch`` sequences x ``rows`` new tokens each, reading ``kv``
  cache positions per sequence; a :class:`BucketGrid` is the shapes captured, and a forward runs in
  the smallest bucket that holds it (:meth:`BucketGrid.pick`), padded;
* :class:`StaticInputs` are the persistent buffers of one bucket: token ids, positions, the block
  tables, each sequence's committed length, where its block is written, how many of its rows are
  real, and the mask over its pending entries and block.  A forward copies its inputs into them;
* :func:`static_hidden` is the forward of a bucket: device work only, from the buffers to the
  final-norm hidden states, writing the block's keys and values into the paged pool.  Pool rows
  are computed from the block tables on the device; padded rows write into the pool's scratch block
  and attend to themselves, so their values stay finite and no real row sees them;
* :class:`CapturedForwards` holds one model's buckets over one cache: captured as CUDA graphs on a
  GPU (sharing one memory pool), run eagerly elsewhere, which is the same code a graph replays.
  ``LlamaModel.forward`` takes this path for every forward that fits a bucket; the logits are
  computed after it, on the rows asked for only, so a bucket keeps no vocabulary-sized buffer.

Shapes outside every bucket (a long prefill chunk, a sequence near the end of its context) run the
dynamic forward as before.  On the CPU the engine keeps its own paged kernels and fused C++
decoder; the static path runs there only when asked (``EngineConfig.static_shapes``: the tests of
this path, and a compiled forward).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from engine.device import Layout, copy_packed, staged_layout, to_device_many, unpack_bytes
from engine.kv_cache import Addresses, KVCache
from engine.models.llama import ForwardContext

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class Bucket:
    """One captured shape: ``batch`` sequences of ``rows`` new tokens each, reading ``kv`` cache
    positions per sequence (a multiple of the cache's block size)."""

    batch: int
    rows: int
    kv: int

    def __str__(self) -> str:
        return f"{self.batch}x{self.rows}@{self.kv}"


def default_kv_buckets(max_len: int, block_size: int, smallest: int = 256) -> tuple[int, ...]:
    """Context buckets doubling from ``smallest`` to ``max_len`` (the last one ``max_len`` itself),
    each a multiple of ``block_size``: attention reads the bucket's positions, so a step pays for at
    most twice its context."""
    out, k = [], smallest
    while k < max_len:
        out.append(k)
        k *= 2
    out.append(max_len)
    return tuple(sorted({-(-k // block_size) * block_size for k in out}))


@dataclass(frozen=True)
class BucketGrid:
    """The shapes captured: every ``batches`` x ``rows`` pair with at most ``max_tokens`` rows in all,
    at every context bucket ``kv``; ``width``: the columns of the mask over pending entries and the
    block (a forward with more pending entries plus rows runs dynamically)."""

    batches: tuple[int, ...]
    rows: tuple[int, ...]
    kv: tuple[int, ...]
    width: int
    max_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("batches", "rows", "kv"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
                raise ValueError(f"bucket {name} must be positive and increasing, got {values}")
        if self.width < max(self.rows):
            raise ValueError(f"the mask width {self.width} is narrower than the largest row bucket {max(self.rows)}")

    def buckets(self) -> list[Bucket]:
        """Every bucket, largest first (the first capture sizes the shared memory pool)."""
        out = [Bucket(b, r, k) for b in self.batches for r in self.rows for k in self.kv
               if b * r <= self.max_tokens]
        return sorted(out, reverse=True)

    def pick(self, batch: int, rows: int, kv_len: int, width: int) -> Optional[Bucket]:
        """The smallest bucket holding ``batch`` sequences of ``rows`` tokens reading ``kv_len``
        positions with a mask ``width`` wide, or None.  Padded rows attend to their own position, so
        the context bucket must hold the last sequence's block padded to the bucket's rows: the
        caller passes ``kv_len`` as the furthest block start plus the *bucket's* rows (see
        :meth:`CapturedForwards.bucket_for`)."""
        if width > self.width:
            return None
        b = _ceil_in(self.batches, batch)
        r = _ceil_in(self.rows, rows)
        if b is None or r is None or b * r > self.max_tokens:
            return None
        k = _ceil_in(self.kv, kv_len - rows + r)
        return None if k is None else Bucket(b, r, k)


def _ceil_in(values: Iterable[int], x: int) -> Optional[int]:
    return next((v for v in values if v >= x), None)


@dataclass
class StaticInputs:
    """The persistent inputs of one bucket, on the device (a graph reads them at fixed addresses)."""

    ids: torch.Tensor  # [batch, rows] token ids (padding: 0)
    positions: torch.Tensor  # [batch, rows] position ids (padding: the row's last real one)
    tables: torch.Tensor  # [batch, kv / block_size] pool blocks of each sequence (padding: 0, the scratch block)
    lens: torch.Tensor  # [batch] committed entries (padding: 0)
    start: torch.Tensor  # [batch] cache position of the block's first token (padding: 0)
    counts: torch.Tensor  # [batch] real rows (padding: 0): rows past them write into the scratch block
    block_mask: torch.Tensor  # [batch, rows, width] what each row sees of the pending entries and the block
    # the buffer that ``positions`` ... ``block_mask`` are views of, and where each lies: the host's
    # inputs of a forward (:func:`host_inputs`) reach all of them in one copy (``copy_packed``)
    staged: Optional[torch.Tensor] = None
    layout: Optional[Layout] = None

    @staticmethod
    def empty(bucket: Bucket, block_size: int, width: int, device: torch.device) -> "StaticInputs":
        b, r = bucket.batch, bucket.rows
        long, flag = torch.long, torch.bool
        nbytes, layout = staged_layout([((b, r), long), ((b, bucket.kv // block_size), long), ((b,), long),
                                        ((b,), long), ((b,), long), ((b, r, width), flag)])
        staged = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return StaticInputs(torch.zeros(b, r, dtype=long, device=device), *unpack_bytes(staged, layout),
                            staged=staged, layout=layout)

    def tensors(self) -> list[torch.Tensor]:
        return [self.ids, self.positions, self.tables, self.lens, self.start, self.counts, self.block_mask]


def host_inputs(cache: KVCache, bucket: Bucket, width: int, positions: torch.Tensor, slots: list[int],
                counts: list[int]) -> list[torch.Tensor]:
    """One forward's inputs but its token ids, padded to ``bucket``, on the host, in
    :meth:`StaticInputs.tensors` order after ``ids``, the mask causal over the pending entries and the
    block (a block's own mask replaces it on the device: :func:`place_block_mask`).  Padded rows need
    no mask column: every row sees its own position (``build_mask``)."""
    # numpy on the cache's host views: thirty small operations, each a torch dispatch otherwise
    b, t = positions.shape
    B, R, bs = bucket.batch, bucket.rows, cache.block_size
    slot_a = np.asarray(slots, dtype=np.int64)
    lens = np.zeros(B, dtype=np.int64)
    lens[:b] = cache.lens_np[slot_a]
    start = np.zeros(B, dtype=np.int64)
    start[:b] = lens[:b] + cache.pending_np[slot_a]
    given = positions.numpy()
    pos = np.zeros((B, R), dtype=np.int64)
    pos[:b, :t] = given
    pos[:b, t:] = given[:, t - 1:t]  # padded rows repeat the last (the caller padded up to t likewise)
    cnt = np.zeros(B, dtype=np.int64)
    cnt[:b] = counts
    tables = np.zeros((B, bucket.kv // bs), dtype=np.int64)
    width_blocks = min(tables.shape[1], cache.max_blocks)
    tables[:b, :width_blocks] = cache.table_np[slot_a, :width_blocks]
    mask = np.zeros((B, R, width), dtype=bool)
    real = np.arange(t)[None, :, None] < cnt[:b, None, None]  # [b, t, 1]: the sequences' real rows
    row, col = np.arange(t)[None, :, None], np.arange(width)[None, None, :]
    rel = col - (start[:b] - lens[:b])[:, None, None]  # column within the block
    mask[:b, :t] = real & ((rel < 0) | (rel <= row))  # causal: every pending entry, and the block up to the row
    pos, tables, lens, start, cnt, mask = (torch.from_numpy(x) for x in (pos, tables, lens, start, cnt, mask))
    return [pos, tables, lens, start, cnt, mask]


def block_mask_rows(block_mask: torch.Tensor, counts: list[int], width: int) -> list[torch.Tensor]:
    """What :func:`place_block_mask` writes for a forward's own mask ``block_mask`` [batch, t, w] (on
    the device or the host): the mask cut to ``width`` columns and which of its rows are real
    ([batch, t, 1], host), to move to the device with the other inputs."""
    t = block_mask.shape[1]
    return [block_mask[:, :, :width], torch.arange(t)[None, :, None] < torch.tensor(counts)[:, None, None]]


def place_block_mask(buffer: torch.Tensor, mask: torch.Tensor, real: torch.Tensor) -> None:
    """Writes a forward's own mask into the bucket's ``buffer`` [B, R, width] in place of the causal
    rows :func:`host_inputs` made (:func:`block_mask_rows`' tensors, on the buffer's device): each
    sequence's real rows see what its mask says, its padded rows only themselves."""
    b, t, w = mask.shape
    buffer[:b, :t].zero_()
    buffer[:b, :t, :w] = mask & real


def static_hidden(model, cache: KVCache, inp: StaticInputs, layer_step: Optional[Callable] = None,
                  rope=None) -> torch.Tensor:
    """The decoder stack over one bucket's buffers: final-norm hidden states [batch, rows, hidden].
    Device work only, the same kernels at the same shapes every call (what a CUDA graph records):
    pool rows come from the block tables, padded rows write into the scratch block.  ``layer_step``:
    what runs each layer (:func:`compiled_layer`), else the layers themselves; ``rope``: the rotary
    tables (default: the model's), those its captured forwards read (:class:`CapturedForwards`)."""
    bs = cache.block_size
    b, r = inp.ids.shape
    kv = inp.tables.shape[1] * bs
    dev = inp.ids.device
    pos = torch.arange(kv, device=dev)
    read = inp.tables[:, pos // bs] * bs + pos % bs  # [batch, kv] pool rows
    i = torch.arange(r, device=dev)
    wpos = inp.start[:, None] + i  # [batch, rows] cache positions written
    wblock = torch.gather(inp.tables, 1, (wpos // bs).clamp(max=inp.tables.shape[1] - 1))
    write = torch.where(i[None, :] < inp.counts[:, None], wblock * bs + wpos % bs, i[None, :] % bs)
    cos, sin = (rope or model.rope).lookup(inp.positions)
    ctx = ForwardContext(cache=cache, at=Addresses(write, read), kv_len=kv, cos=cos, sin=sin, lens=inp.lens,
                         start=inp.start, block_mask=inp.block_mask)
    ctx.mask  # built here, once: every layer takes it as an input
    return model.hidden_states(inp.ids, ctx, layer_step)


def run_layer(layer, x: torch.Tensor, delta: Optional[torch.Tensor], ctx: ForwardContext):
    """One decoder layer, its pools in ``ctx`` (``ForwardContext.for_layer``): the function
    :func:`compiled_layer` compiles.  Its inputs are tensors and the layer's module, no index, so one
    graph serves every layer of a model."""
    return layer(x, delta, -1, ctx)


def compiled_layer() -> Callable:
    """:func:`run_layer` through ``torch.compile`` (Inductor: a layer's elementwise work fused between
    its matrix multiplies and attention), with dynamic shapes, so that a few graphs serve every bucket
    of every layer.  Dynamo still specializes on sizes 0 and 1: at most 4 graphs a model (batch 1 or
    more, one row or more; the first layer adds a zero residual, so it runs the same graph).  A
    model's weights keep static shapes (parameters), so the target and the draft compile apart.
    Inductor keeps what it compiled in ``$MCSD_CACHE/inductor`` (unless ``TORCHINDUCTOR_CACHE_DIR``
    says otherwise), beside the model packs: a restart, or a container with that volume, reuses it."""
    import torch._dynamo.config as dynamo_config

    from engine.models.fetch import default_cache_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache_dir() / "inductor"))

    for limit in ("recompile_limit", "cache_size_limit"):  # target + draft, 4 each, and slack
        if hasattr(dynamo_config, limit):
            setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 32))
    return compile_dynamic(run_layer)


def compile_dynamic(fn: Callable) -> Callable:
    """``fn`` through ``torch.compile`` as one graph with dynamic sizes, never "duck" sizes: two sizes
    that happen to be equal in one call (a context of 64 positions and a head of 64; a batch as large
    as a proposal's width) would otherwise be assumed equal, and the next call would compile again."""
    import torch.fx.experimental._config as shape_config

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)

    def call(*args):
        with shape_config.patch(use_duck_shape=False):
            return compiled(*args)
    return call


@dataclass
class _Captured:
    inputs: StaticInputs
    hidden: torch.Tensor  # the graph's output buffer (CUDA), or None (eager)
    graph: Optional["torch.cuda.CUDAGraph"] = None


@dataclass
class CaptureReport:
    """What :meth:`CapturedForwards.capture` did: buckets, seconds and the graph pool's device memory."""

    buckets: int = 0
    seconds: float = 0.0
    pool_bytes: int = 0
    failed: list[str] = field(default_factory=list)
    compiled: bool = False  # the layers ran compiled (graph_compile, and compiling worked)


class CapturedForwards:
    """One model's forwards over one cache at the buckets of ``grid``: CUDA graphs when ``graphs``
    (CUDA only), else the static code run eagerly.  ``compile``: each layer runs compiled
    (:func:`compiled_layer`), captured or not; if compiling fails, the buckets are captured without
    it (logged).  Installed as ``cache.captured``; ``LlamaModel.forward`` asks :meth:`bucket_for` and
    runs :meth:`hidden`."""

    def __init__(self, model, cache: KVCache, grid: BucketGrid, graphs: bool = False,
                 compile: bool = False) -> None:  # noqa: A002 - torch's word
        if graphs and cache.k.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and its cache on a CUDA device")
        for k in grid.kv:
            if k % cache.block_size:
                raise ValueError(f"context bucket {k} is not a multiple of the block size {cache.block_size}")
        self.model, self.cache, self.grid = model, cache, grid
        self.graphs = graphs
        self.layer_step: Optional[Callable] = compiled_layer() if compile else None
        self._by_bucket: dict[Bucket, _Captured] = {}
        self._failed: set[Bucket] = set()  # buckets whose capture failed: their forwards run dynamically
        # the rotary tables the graphs read, kept alive: a longer cache on the same model (a second engine)
        # rebuilds the model's, and the graphs captured before go on reading these, which cover this cache
        self._rope = model.rope
        self._pool = None
        self.replays = 0  # forwards run through a bucket (tests and the benchmark read it)
        self.fallbacks = 0  # forwards that fit no bucket

    def bucket_for(self, slots: list[int], rows: int) -> Optional[Bucket]:
        """The bucket a forward of ``rows`` new tokens per slot fits (its mask spans the slots' pending
        entries and the block), or None (it runs dynamically)."""
        cache = self.cache
        slot_a = np.asarray(slots, dtype=np.int64)
        pending = cache.pending_np[slot_a]
        start = cache.lens_np[slot_a] + pending
        bucket = self.grid.pick(len(slots), rows, int(start.max()) + rows, int(pending.max()) + rows)
        if bucket is not None and (bucket.kv > cache.max_blocks * cache.block_size or bucket in self._failed):
            bucket = None
        if bucket is None:
            self.fallbacks += 1
        return bucket

    @torch.inference_mode()
    def hidden(self, bucket: Bucket, ids: torch.Tensor, positions: torch.Tensor, slots: list[int],
               block_mask: Optional[torch.Tensor], counts: list[int],
               shift: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hidden states [len(slots), rows, hidden] of one forward run in ``bucket`` (rows past a
        sequence's count are padding).  The caller reserved the slots' blocks; it advances them.
        ``shift`` ([len(slots)], on the device): added to each sequence's positions there."""
        entry = self._by_bucket.get(bucket)
        if entry is None:
            entry = self._prepare(bucket)
        host = host_inputs(self.cache, bucket, self.grid.width, positions, slots, counts)
        b, t = positions.shape
        inp = entry.inputs
        if (b, t) != tuple(inp.ids.shape):
            inp.ids.zero_()  # padding (the ids are on the device already)
        inp.ids[:b, :t].copy_(ids)
        copy_packed(inp.staged, host, inp.layout)  # every other input in one copy
        if shift is not None:
            inp.positions[:b] += shift[:, None]
        if block_mask is not None:  # a block's own mask may be on the device already (not read): it joins there
            place_block_mask(inp.block_mask, *to_device_many(block_mask_rows(block_mask, counts, self.grid.width),
                                                             self.cache.k.device))
        self.replays += 1
        if entry.graph is not None:
            entry.graph.replay()
            out = entry.hidden
        else:
            out = static_hidden(self.model, self.cache, entry.inputs, self.layer_step, self._rope)
        return out[:b, :t].clone()

    def _prepare(self, bucket: Bucket) -> _Captured:
        inputs = StaticInputs.empty(bucket, self.cache.block_size, self.grid.width, self.cache.k.device)
        entry = _Captured(inputs, None)
        if self.graphs:
            entry = self._capture_one(inputs)
        elif self.layer_step is not None:  # compiles now rather than in a request's forward (scratch block only)
            static_hidden(self.model, self.cache, inputs, self.layer_step, self._rope)
        self._by_bucket[bucket] = entry
        return entry

    def _capture_one(self, inputs: StaticInputs) -> _Captured:
        """Records one bucket's forward (after two warm-up runs on a side stream, as CUDA asks) into
        the pool every bucket of this model shares.  Its inputs point at the scratch block: capturing
        writes nothing a sequence holds."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                static_hidden(self.model, self.cache, inputs, self.layer_step, self._rope)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = static_hidden(self.model, self.cache, inputs, self.layer_step, self._rope)
        self._pool = graph.pool()
        return _Captured(inputs, hidden, graph)

    @torch.inference_mode()
    def capture(self, progress: Optional[Callable[[int, int, Bucket], None]] = None) -> CaptureReport:
        """Prepares every bucket now (at start-up: the first requests then pay nothing), largest first;
        ``progress(done, total, bucket)`` after each.  A bucket whose capture fails is logged and left
        to the dynamic forward."""
        report = CaptureReport()
        buckets = self.grid.buckets()
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved(self.cache.k.device) if self.graphs else 0
        for n, bucket in enumerate(buckets, 1):
            try:
                self._prepare_or_uncompiled(bucket)
                report.buckets += 1
            except Exception as exc:  # noqa: BLE001 - that shape runs dynamically
                log.warning("capturing bucket %s failed (%s: %s); it runs without a graph", bucket,
                            type(exc).__name__, exc)
                report.failed.append(str(bucket))
                self._by_bucket.pop(bucket, None)
                self._failed.add(bucket)
            if progress is not None:
                progress(n, len(buckets), bucket)
        if self.graphs:
            torch.cuda.synchronize(self.cache.k.device)
            report.pool_bytes = torch.cuda.memory_reserved(self.cache.k.device) - before
        report.seconds = time.perf_counter() - t0
        report.compiled = self.layer_step is not None
        return report

    def _prepare_or_uncompiled(self, bucket: Bucket) -> None:
        """:meth:`_prepare`; if the compiled layer fails there, compiling is dropped for this model
        (logged once) and the bucket is prepared again without it."""
        try:
            self._prepare(bucket)
        except Exception as exc:  # noqa: BLE001 - Inductor or dynamo: the eager layers still run
            if self.layer_step is None:
                raise
            log.warning("compiling the decoder layer failed at bucket %s (%s: %s); capturing without "
                        "torch.compile", bucket, type(exc).__name__, exc)
            self.layer_step = None
            self._by_bucket.pop(bucket, None)
            self._prepare(bucket)

    def buffers(self) -> list[torch.Tensor]:
        """Every persistent device tensor of the buckets prepared so far (inputs, and graph outputs)."""
        out = []
        for entry in self._by_bucket.values():
            inp = entry.inputs
            out += inp.tensors() + ([inp.staged] if inp.staged is not None else [])
            out += [entry.hidden] if entry.hidden is not None else []
        return out


def row_buckets(largest: int) -> tuple[int, ...]:
    """1, 4, 16, ... below ``largest``, then ``largest``: on a GPU a forward of a few dozen rows costs
    about what one row costs, so few row buckets waste little and keep the graphs few."""
    out, r = [], 1
    while r < largest:
        out.append(r)
        r *= 4
    return tuple(out) + (largest,)


def install(model, cache: KVCache, config, rows: int, width: int) -> Optional[CapturedForwards]:
    """The fixed-shape forwards ``config`` asks for over ``cache`` (an ``EngineConfig``; ``rows``: the
    largest block a step runs through this cache, ``width``: its widest mask), installed as
    ``cache.captured``; None when it asks for none on this device.  Nothing is captured yet
    (:meth:`CapturedForwards.capture`)."""
    cuda = cache.k.device.type == "cuda"
    graphs = cuda and config.cuda_graphs
    if not (graphs or config.static_shapes):
        return None
    batches = tuple(b for b in config.graph_batches if b < config.max_batch) + (config.max_batch,)
    row_set = tuple(r for r in (config.graph_rows or row_buckets(rows)) if r < rows) + (rows,)
    kv = default_kv_buckets(cache.max_blocks * cache.block_size, cache.block_size, config.graph_context)
    grid = BucketGrid(batches, row_set, kv, width=max(width, rows), max_tokens=max(2048, rows))
    captured = CapturedForwards(model, cache, grid, graphs=graphs, compile=config.graph_compile)
    cache.captured = captured
    return captured
