"""Load awareness: what a step costs, and which tree budget pays best for the current batch.

**Cost curves.**  At start-up the engine times forwards of ``B`` sequences x ``T`` block tokens for
a few ``(B, T)`` points, for the target (verification blocks) and the draft (tree levels), and fits
seconds as a monotone piecewise-linear function of the total tokens ``B * T``.

**Budget.**  A candidate budget is a width config ``k' <= k`` of the configured tree (any depth in
``[min_depth, max_depth]``) or the empty tree (plain decoding).  With ``r[d, rank]`` the estimated
``P(node accepted | parent reached)``, a node is reached with the product of ``r`` along its path,
and ``E[accepted](k') = sum of reach over k''s nodes``.  One step emits ``1 + accepted`` tokens per
speculating sequence and costs ``draft(k') + verify(total block tokens)``; the chooser returns the
candidate maximising ``sum(1 + E) / seconds`` over the batch.  When one more verified token costs
nearly as much as a token of plain decoding (large batches), that is the empty tree.

**Measured prices.**  The start-up curves time bare forwards; a real step also attends over long
contexts, applies the verification rule to every row and updates the caches.  :class:`LiveCurve`
scales the target's curve by what the engine's steps really take (per block size, decayed), and it is
the one price of verification rows that both the tree budget and Max-Gram's length chooser read.

**Catching up.**  The draft model's cache is filled lazily (``ModelRunner.prefill``): a sequence
drafting for the first time, or after many steps without the draft, first runs its missing tokens
through the draft, which costs ``catch_up(lag)`` seconds (a curve of its own: such a forward needs the
logits of its last row only, where a tree level's needs every row's, so the level curve prices a long
catch-up several times too high) and stalls the whole batch.  The chooser
also reports ``saving``: seconds per emitted token the chosen budget saves over plain decoding for
this batch.  A sequence that still has ``m`` tokens to write saves about ``m * saving`` seconds by
speculating, so it catches up only when that exceeds the catch-up's cost (``CostModel.catch_up_pays``);
otherwise it decodes without the draft model this step (and is asked again next step).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from engine.device import synchronize
from engine.kv_cache import KVCache
from engine.models.fetch import default_cache_dir
from engine.models.model import Model
from engine.models.vocab import OutputVocab
from engine.speculative.tree import TreeTopology, count_nodes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward as a function of the tokens in it (all sequences' blocks together)."""

    tokens: tuple[float, ...]  # ascending
    seconds: tuple[float, ...]  # non-decreasing

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds):
            raise ValueError("a cost curve needs one or more (tokens, seconds) points")

    @classmethod
    def fit(cls, points: list[tuple[float, float]]) -> "CostCurve":
        """The lower convex hull of the fastest time at each token count, made non-decreasing.

        The fastest, because interference (another process, a stall) only ever adds time: the minimum
        is the forward's own cost.  The convex hull, because a forward's cost is: flat while the
        weights' bytes bound it, then rising by a fixed cost per row once the multiplies do.  A curve
        through every point instead keeps a stall of one point as a step that the points after it
        flatten out, and a flat stretch prices added rows at nothing (which the length chooser then
        fills)."""
        by_n: dict[float, float] = {}
        for n, s in points:
            by_n[float(n)] = min(float(s), by_n.get(float(n), float("inf")))
        ns = sorted(by_n)
        hull: list[tuple[float, float]] = []  # Andrew's monotone chain, lower half
        for p in ((n, by_n[n]) for n in ns):
            while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
                hull.pop()
            hull.append(p)
        on_hull = cls(tuple(x for x, _ in hull), tuple(y for _, y in hull))  # the hull spans every n
        secs, best = [], 0.0
        for n in ns:
            best = max(best, on_hull(n))
            secs.append(best)
        return cls(tuple(ns), tuple(secs))

    def __call__(self, n: float) -> float:
        xs, ys = self.tokens, self.seconds
        if n <= 0:
            return 0.0
        if len(xs) == 1:
            return ys[0] * max(1.0, n / xs[0])
        if n <= xs[0]:
            return ys[0]
        i = min(max(j for j in range(len(xs) - 1) if xs[j] <= n), len(xs) - 2)
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return ys[i] + slope * (n - xs[i])  # beyond the last point: the last segment's slope


class LiveCurve:
    """What a verification step of ``n`` rows costs as the engine's own steps measure it: the start-up
    curve (``prior``), scaled per block size by the ratio of measured to priced seconds.

    The start-up curve times bare forwards over an empty cache.  A real step also attends over its
    sequences' contexts, applies the verification rule to every row (a softmax over the vocabulary when
    sampling) and updates the caches, and it runs on a machine that is busy for longer: a real row
    costs more than the curve says, by a ratio nearly flat over block sizes that grows with the
    contexts.

    Each step's ``(rows, seconds)`` is one observation.  Per block size ``n`` the ratio
    ``measured / prior(n)`` is a decayed mean, shrunk by ``weight`` pseudo-observations to the ratio over
    all sizes (itself shrunk to 1); between and beyond the sizes seen, the ratio is interpolated and held
    at the ends.  The curve read is ``prior * ratio``, made non-decreasing.  An observation more than
    ``CLIP`` times its price is clipped (a stall of the machine, not the step's cost)."""

    CLIP = 3.0

    def __init__(self, prior: CostCurve, decay: float = 0.98, weight: float = 3.0) -> None:
        self.prior = prior
        self.decay = decay
        self.weight = weight
        self._ratio_sum: dict[int, float] = {}  # decayed sums of measured / prior, by rows
        self._count: dict[int, float] = {}
        self._curve: Optional[CostCurve] = prior

    def observe(self, rows: int, seconds: float) -> None:
        """One verification step: its block's rows (every sequence's together) and its seconds."""
        if rows <= 0 or not seconds > 0:
            return
        price = self.prior(rows)
        if price <= 0:
            return
        for n in list(self._count):
            self._count[n] *= self.decay
            self._ratio_sum[n] *= self.decay
            if self._count[n] < 1e-3:
                del self._count[n], self._ratio_sum[n]
        ratio = min(seconds / price, self.CLIP * max(self.overall(), 1.0))
        self._count[rows] = self._count.get(rows, 0.0) + 1.0
        self._ratio_sum[rows] = self._ratio_sum.get(rows, 0.0) + ratio
        self._curve = None

    def overall(self) -> float:
        """Measured over priced seconds, all block sizes together (1 before any step)."""
        return (sum(self._ratio_sum.values()) + self.weight) / (sum(self._count.values()) + self.weight)

    def ratios(self) -> dict[int, float]:
        """Measured over priced seconds per block size seen, shrunk to :meth:`overall`."""
        g, w = self.overall(), self.weight
        return {n: (self._ratio_sum[n] + w * g) / (self._count[n] + w) for n in sorted(self._count)}

    def curve(self) -> CostCurve:
        """The prior scaled by the measured ratios, as one non-decreasing curve."""
        if self._curve is None:
            ratios = self.ratios()
            seen = list(ratios)
            xs = sorted(set(self.prior.tokens) | {float(n) for n in seen})
            ratio = np.interp(xs, seen, [ratios[n] for n in seen])  # linear between, held beyond the ends
            ys, best = [], 0.0
            for x, r in zip(xs, ratio.tolist()):
                best = max(best, self.prior(x) * r)
                ys.append(best)
            self._curve = CostCurve(tuple(xs), tuple(ys))
        return self._curve

    def __call__(self, n: float) -> float:
        return self.curve()(n)


def _cross(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    """> 0 when o -> a -> b turns left (a lies below the line o-b)."""
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


@dataclass(frozen=True)
class CostModel:
    target: CostCurve  # one verification forward
    draft: CostCurve  # one draft forward of a tree level (logits at every row)
    catch_up: Optional[CostCurve] = None  # one draft forward with the last row's logits (None: ``draft``)

    @classmethod
    def measure(cls, target: Model, target_cache: KVCache, draft: Model, draft_cache: KVCache,
                max_batch: int, topology: TreeTopology, reps: int = 2, max_block: int = 0,
                draft_vocab: Optional[OutputVocab] = None) -> "CostModel":
        """``max_block``: the longest verification block other drafters may add (Max-Gram), timed at batch 1
        so that their load-aware caps read the curve rather than extrapolate it.  ``draft_vocab``: the
        draft's restricted output layer, when it runs with one."""
        batches = sorted({1, max(1, max_batch // 2), max_batch})
        blocks = sorted({1, 2 + topology.num_nodes // 2, 1 + topology.num_nodes})
        longest = [(1, max_block)] if max_block > 1 + topology.num_nodes else []
        widest = max(topology.level_offsets[d + 1] - topology.level_offsets[d] for d in range(len(topology.widths)))
        levels = sorted({1, max(1, widest // 2), widest})
        # the middle block at batch 1 only: past a few rows the curve is a straight line (the larger
        # batches' middle points lie on the line between their neighbours), and timing them costs start-up
        shapes = [(b, t) for b, t in itertools.product(batches, blocks) if b == 1 or t in (blocks[0], blocks[-1])]
        return cls(measure_curve(target, target_cache, shapes + longest, reps),
                   measure_curve(draft, draft_cache, list(itertools.product(batches, levels)), reps, draft_vocab),
                   # a prompt's catch-up; the curve extrapolates linearly beyond its longest point (a token
                   # costs a little more the longer the context, so long catch-ups are priced somewhat low;
                   # timing longer ones would lengthen every first start)
                   measure_curve(draft, draft_cache, sorted({(1, min(t, draft_cache.max_len)) for t in (1, 64, 128)}),
                                 reps, draft_vocab, last_row=True))

    @classmethod
    def stored(cls, key: dict, measure: Callable[[], "CostModel"], reuse: bool = True,
               directory: Optional[Path] = None) -> "CostModel":
        """The curves stored under ``key`` (everything the timings depend on: see :func:`cost_key`) when
        ``reuse`` and an earlier start measured them, else ``measure()``, stored for the next start.
        ``directory``: default ``$MCSD_CACHE/cost-model``.  An unreadable file is measured over."""

        directory = Path(directory) if directory is not None else default_cache_dir() / "cost-model"
        name = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=12).hexdigest()
        path = directory / f"{name}.json"
        if reuse and path.is_file():
            try:
                data = json.loads(path.read_text())
                model = cls(CostCurve(**_floats(data["target"])), CostCurve(**_floats(data["draft"])),
                            CostCurve(**_floats(data["catch_up"])))
                log.info("cost model: the curves measured at %s (%s)", data.get("measured", "?"), path)
                return model
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("cost model: ignoring %s (%s); measuring again", path, e)
        log.info("cost model: timing forwards of both models (the first start with them here; about 10 s for "
                 "the default pair on 2 cores)")
        t0 = time.perf_counter()
        model = measure()
        seconds = time.perf_counter() - t0
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
                                       "target": _curve_json(model.target), "draft": _curve_json(model.draft),
                                       "catch_up": _curve_json(model.catch_up_curve)}))
            tmp.replace(path)
            log.info("cost model: measured in %.1f s, stored for the next start in %s", seconds, path)
        except OSError as e:
            log.warning("cost model: measured in %.1f s, but could not store the curves in %s (%s)", seconds,
                        directory, e)
        return model

    def catch_up_pays(self, lag: int, remaining: int, saving: float) -> bool:
        """Whether running ``lag`` missing tokens through the draft pays back over ``remaining``
        tokens at ``saving`` seconds per token (see the module docstring)."""
        return remaining * saving > self.catch_up_curve(lag)

    @property
    def catch_up_curve(self) -> CostCurve:
        return self.catch_up if self.catch_up is not None else self.draft

    def level_seconds(self, batch: int, widths: tuple[int, ...]) -> float:
        """The draft forwards of the non-final levels of ``batch`` trees of ``widths`` (the deepest level
        never runs); a step also runs the catch-up forward (:meth:`BudgetChooser.choose`)."""
        sizes = [count_nodes(widths[: d + 1]) - count_nodes(widths[:d]) for d in range(len(widths) - 1)]
        return sum(self.draft(batch * s) for s in sizes)


def _curve_json(curve: CostCurve) -> dict:
    return {"tokens": list(curve.tokens), "seconds": list(curve.seconds)}


def _floats(d: dict) -> dict:
    return {"tokens": tuple(float(v) for v in d["tokens"]), "seconds": tuple(float(v) for v in d["seconds"])}


def model_identity(loaded) -> Optional[dict]:
    """What a loaded model's timings depend on: its files (path, sizes, modification times) and how its
    weights are held (dtype, the weight kinds of its linears).  None for a model with no files (built
    in memory): its curves are never stored."""
    path = getattr(loaded, "path", None)
    if path is None or not Path(path).exists():
        return None
    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    model = loaded.model
    kinds = sorted({_weight_kind(m.weight) for m in model.modules() if hasattr(m, "weight") and m.weight is not None})
    return {"path": str(path), "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
            "dtype": str(model.dtype), "device": str(model.device), "weights": kinds}


def _weight_kind(w) -> str:
    name = getattr(w, "type_name", None)
    return name if name is not None else f"{type(w).__name__}:{getattr(w, 'dtype', '')}"


def machine_identity(device: torch.device) -> dict:
    """The machine side of the timings: CPU model and features, threads, torch and our kernels' build,
    the GPU's name."""
    from engine.models import cpu_kernels

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        lines = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        cpu = " ".join(lines.get(k, "").strip() for k in ("model name\t", "flags\t"))
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    switches = {k: os.environ.get(k) for k in ("MCSD_CPU_KERNELS", "MCSD_INVARIANT_ATTENTION", "MCSD_CPU_ISA",
                                               "MCSD_FUSED_LAYERS")}
    return {"cpu": hashlib.blake2b(cpu.encode(), digest_size=8).hexdigest(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "kernels": cpu_kernels.build_name(), "switches": switches, "gpu": gpu}


#: How curves are measured and fitted (:func:`measure_curve`, :meth:`CostCurve.fit`); part of the key, so
#: a start never reuses curves stored by an older method.  2: round-robin, fastest, lower convex hull.
FIT_METHOD = 2


def cost_key(target, draft, **settings) -> Optional[dict]:
    """The key :meth:`CostModel.stored` files curves under: both models, the machine, the measuring
    ``settings`` (batch, tree, blocks, ...) and :data:`FIT_METHOD`.  None when a model has no files."""
    t, d = model_identity(target), model_identity(draft)
    if t is None or d is None:
        return None
    return {"target": t, "draft": d, "machine": machine_identity(target.model.device), "settings": settings,
            "fit": FIT_METHOD}


def measure_curve(model: Model, cache: KVCache, points: list[tuple[int, int]], reps: int,
                  vocab: Optional[OutputVocab] = None, last_row: bool = False) -> CostCurve:
    """Times ``reps`` forwards of ``B`` slots x ``T`` tokens for each ``(B, T)``, on temporarily allocated
    cache slots that are freed afterwards, with logits at every row (``last_row``: at each slot's last
    row only).  One untimed forward first warms the model up (first touch of the weights, thread pools,
    lazy initialisation); later shapes need no warm-up of their own.  The
    points are timed round-robin, ``reps`` rounds, so that a stall of the machine (another tenant, a
    page-cache flush) lands on one sample of several points rather than on every sample of one."""
    need = max(b for b, _ in points)
    if cache.free_slots < need:
        raise ValueError(f"measuring the cost curve needs {need} free cache slots, {cache.free_slots} are free")
    slots = [cache.allocate() for _ in range(need)]
    samples = []

    def forward(b: int, t: int) -> float:
        ids = torch.zeros(b, t, dtype=torch.long, device=model.device)
        pos = torch.arange(t)[None].expand(b, t)
        rows = torch.full((b, 1), t - 1) if last_row else torch.arange(t)[None].expand(b, t)
        synchronize(model.device)
        t0 = time.perf_counter()
        model(ids, pos, cache, slots[:b], logits_rows=rows, vocab=vocab)
        synchronize(model.device)  # the device's time, not the launch's
        dt = time.perf_counter() - t0
        for s in slots[:b]:
            cache.discard(s)
        return dt

    try:
        forward(*points[0])  # warm-up, untimed
        for _ in range(reps):
            samples += [(b * t, forward(b, t)) for b, t in points]
    finally:
        for s in slots:
            cache.free(s)
    return CostCurve.fit(samples)


class BudgetChooser:
    """Picks the step's tree budget (see the module docstring).  Candidates and their node sets are
    precomputed once; each step is one ``[candidates, nodes] @ [nodes]`` product per mode."""

    def __init__(self, topology: TreeTopology, cost: CostModel, min_depth: int, max_depth: int) -> None:
        self.topology = topology
        self.cost = cost
        self.verify = LiveCurve(cost.target)  # verification priced as the engine's steps measure it
        self.candidates: list[tuple[int, ...]] = [()]
        for depth in range(min_depth, max_depth + 1):
            self.candidates += list(itertools.product(*(range(1, k + 1) for k in topology.widths[:depth])))
        member = torch.zeros(len(self.candidates), topology.num_nodes)
        deepest = torch.zeros(len(self.candidates), topology.num_nodes)
        for c, widths in enumerate(self.candidates):
            sub = topology.subtree(widths)
            member[c, sub.nodes] = 1.0
            if widths:
                deepest[c, sub.nodes[sub.level(len(widths))]] = 1.0
        self.member = member  # [candidates, nodes]
        self.deepest = deepest  # [candidates, nodes]: the nodes of each candidate's deepest level
        self.sizes = member.sum(dim=1)  # [candidates]
        self._level_seconds: dict[int, list[float]] = {}
        self.saving = 0.0  # seconds per emitted token the last choice saves over plain decoding
        self._per_token = math.inf  # seconds per emitted token of the last choice (inf: plain decoding)

    def reach(self, rates: torch.Tensor) -> torch.Tensor:
        """rates: [depths, ranks] -> [nodes] the probability that each node of the topology is accepted."""
        topo = self.topology
        d = (topo.depth - 1).clamp(max=rates.shape[0] - 1)
        r = topo.rank.clamp(max=rates.shape[1] - 1)
        node_rate = rates[d, r]  # [nodes]
        reach = torch.zeros(topo.num_nodes)
        offs = topo.level_offsets
        for lv in range(len(topo.widths)):  # level-major: parents are final before their children
            sl = slice(offs[lv], offs[lv + 1])
            par = topo.parent[sl]
            parent_reach = torch.where(par >= 0, reach[par.clamp(min=0)], 1.0)
            reach[sl] = parent_reach * node_rate[sl]
        return reach

    def choose(self, spec_counts: list[tuple[int, torch.Tensor]], plain: int) -> tuple[int, ...]:
        """spec_counts: ``(sequences, rates)`` per group of speculating sequences sharing a rates
        table; ``plain``: sequences of the batch that decode without speculation.

        Also sets the rate ``level_tokens`` prices levels at."""
        spec = sum(n for n, _ in spec_counts)
        self.saving, self._per_token = 0.0, math.inf
        if spec == 0:
            return ()
        tokens = float(plain)
        lag = 0.0
        for n, rates in spec_counts:
            reach = self.reach(rates)
            tokens = tokens + n * (1.0 + self.member @ reach)  # [candidates]: 1 + expected accepted
            # An accepted node of the deepest level was never run through the draft: the next step's
            # catch-up reads it besides the root (a step after such an acceptance drafts at the price
            # of two draft rows, not one).
            lag = lag + n * (self.deepest @ reach)  # [candidates]
        verify = [self.verify(spec * (1 + s) + plain) for s in self.sizes.tolist()]
        seconds = torch.tensor(verify) + torch.tensor(self._draft_costs(spec, lag.tolist()))
        per_token = seconds.clamp_min(1e-9) / tokens  # [candidates]; candidate 0 is plain decoding
        best = int(per_token.argmin())
        self.saving = float(per_token[0] - per_token[best])
        choice = self.candidates[best]
        if choice:
            self._per_token = float(per_token[best])
        return choice

    @property
    def per_token(self) -> float:
        """Seconds per emitted token of the last choice (inf: it was plain decoding)."""
        return self._per_token

    def level_tokens(self, block: float, draft_tokens: float, rows: float) -> float:
        """What one more draft level costs the step, in tokens at the chosen plan's seconds per token:
        a draft forward of ``draft_tokens`` nodes plus ``rows`` more verification rows on a block that
        already holds ``block`` rows (the measured curves are not linear: a block can cross a step where
        the kernels get slower).  The forward is paid once for every sequence that grows the level, so
        ``AdaptiveSpeculation.keep_drafting`` weighs it against their expected gain together; infinite
        after a choice of plain decoding."""
        if math.isinf(self._per_token):
            return math.inf
        verify = self.verify(block + rows) - self.verify(block)
        return (self.cost.draft(draft_tokens) + verify) / self._per_token

    def _draft_costs(self, batch: int, lag: list[float]) -> list[float]:
        """Per candidate, the draft forwards of a step where ``batch`` sequences draft it: the catch-up
        forward over their roots and ``lag`` more tokens (the accepted nodes of the deepest level, which
        the draft never ran), plus the level forwards."""
        if batch not in self._level_seconds:
            self._level_seconds[batch] = [self.cost.level_seconds(batch, w) for w in self.candidates]
        return [self.cost.draft(batch + x) + levels if w else 0.0
                for w, x, levels in zip(self.candidates, lag, self._level_seconds[batch])]
