"""The CPU kernels: batch-invariant small-M GEMMs (bf16, fp32 and GGUF blocks), attention and the
row-wise layer operations, built as one library (``csrc/``).  x86-64 CPUs with AVX2 + FMA get vector
code (and 512-bit variants where they have AVX-512); other CPUs a portable build of the same kernels
(:func:`build_kind`).

On CPUs without native bf16 (no avx512_bf16 / AMX), ``torch.nn.functional.linear`` in bfloat16 is
a decent GEMV for one input row but falls back to a slow kernel for 2..64 rows (time linear in the
row count), which is exactly the regime of speculative verification (8-32 tokens per forward).
``bf16_linear`` streams the weight matrix once per call, keeps the few activation rows in cache and
accumulates in fp32; see ``csrc/bf16_gemm.cpp`` for the kernel and its numerics.

Batch invariance: the result for one input row is bitwise identical whatever the number of rows
(and whatever the other rows, or the thread count), so a verification forward over 16 tokens
produces exactly the logits that 16 single-token decoding steps would.  This holds only if *every*
forward uses this kernel, which is why :func:`should_use` decides once per process, not per shape.

API::

    available()             -> bool  the extension is built and loaded (never raises)
    build_kind()            -> str   "avx2" or "portable" (``MCSD_CPU_BUILD=portable`` forces the latter)
    bf16_linear(x, w, b)    -> Tensor  round_bf16(x @ w.T + b), x [..., K], w [N, K], b [N] (bf16)
    f32_linear(x, w, b)     -> Tensor  the same tiles in fp32 (torch's fp32 GEMM is not batch invariant)
    should_use(weight)      -> bool  use our kernel for this weight? (decided once per mode)
    linear(x, w, b)         -> Tensor  ours when should_use(w), else F.linear
    attention(q, k, v, m)   -> Tensor  batch-invariant attention on the CPU, else SDPA
    paged_attention(q, k_pool, v_pool, rows, lens, start, block_mask)
                            -> Tensor  the same, read straight from a paged cache's pool (CPU)
    rms_norm / add_rms_norm / rotary / silu_mul
                            -> the row-wise operations between a layer's linears, one pass each on
                               the CPU (``csrc/layer_ops.cpp``), torch operators elsewhere
    set_batch_invariant(on) / batch_invariant()  the process's mode (on by default; see below)

``MCSD_CPU_KERNELS=0`` / ``=1`` forces :func:`should_use` off / on (on: if available); like the
timing, it is read once per process.  The kernel has no autograd formula: inference only.

The extension is compiled with ``torch.utils.cpp_extension.load`` at first use, once per machine:
the build directory is ``$MCSD_CACHE/torch_extensions/<name>`` (``~/.cache/mcsd`` by default) and
``<name>`` carries a hash of the source, the flags and the torch version, so an edit or a torch
upgrade triggers a rebuild and a finished build is reused by later processes without invoking the
compiler (or ninja) again.  It has no Python binding code: it registers the operator
``torch.ops.mcsd_cpu.bf16_linear``, which keeps the compilation short.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from engine.models.fetch import default_cache_dir

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = (_CSRC / "bf16_gemm.cpp", _CSRC / "quant_gemm.cpp", _CSRC / "attention.cpp",
            _CSRC / "layer_ops.cpp", _CSRC / "decoder.cpp")  # one library
_HEADERS = (_CSRC / "lanes.h",)  # included by the sources: part of the build's hash
# -ffp-contract=off: no fused multiply-adds but the written ones (the kernels' numerics are spelled
# out; aarch64 compilers fuse by default).  No -ffast-math.
_BASE_CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno"]
_X86_VECTOR_CFLAGS = ["-mavx2", "-mfma", "-mf16c"]  # the "avx2" build (its 512-bit code is per function)
_ENV_SWITCH = "MCSD_CPU_KERNELS"
_BUILD_SWITCH = "MCSD_CPU_BUILD"  # "portable": the build without x86 vector extensions, on any CPU
_ATTENTION_SWITCH = "MCSD_INVARIANT_ATTENTION"
_STALE_LOCK_S = 600.0  # a build takes ~10-30 s
_batch_invariant = True  # set_batch_invariant()

# The decision benchmark: a weight of this shape (1.5 MiB, i.e. cache-resident, so that it
# compares the compute paths and not DRAM) at 1 and 16 rows.
_PROBE_SHAPE = (512, 1536)
_PROBE_ROWS = (1, 16)


def cpu_flags() -> Optional[set]:
    """The x86-64 CPU's feature flags from ``/proc/cpuinfo`` (``"avx2"``, ``"avx512f"``, ...); None
    elsewhere or where that file cannot be read."""
    if platform.machine().lower() not in ("x86_64", "amd64", "x64"):
        return None
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64", "x64"):
        return False
    flags = cpu_flags()
    if flags is not None:
        return {"avx2", "fma", "f16c"} <= flags
    # No /proc/cpuinfo: torch's own dispatch level (AVX2 implies FMA for torch's build as well).
    try:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    except Exception:  # pragma: no cover - very old torch
        return False


@functools.cache
def build_kind() -> str:
    """Which build of the library this process uses: ``"avx2"`` on x86-64 CPUs with AVX2 + FMA + F16C
    (with 512-bit variants chosen at run time where the CPU has AVX-512), else ``"portable"``: the same
    kernels in plain C++ (any CPU the compiler targets, e.g. aarch64, or an older x86), which compute
    the same integer sums and, for the linears, the same bits; only slower.  ``MCSD_CPU_BUILD=portable``
    picks the portable build on any CPU (read once per process)."""
    env = os.environ.get(_BUILD_SWITCH, "").strip().lower()
    if env and env not in ("portable", "auto"):
        log.warning("ignoring %s=%r (expected portable or auto)", _BUILD_SWITCH, env)
    if env == "portable":
        return "portable"
    return "avx2" if _cpu_has_avx2_fma() else "portable"


def _build_flags() -> tuple[list[str], list[str]]:
    """(compiler flags, linker flags) of this process's build.  OpenMP where the compiler has it
    (at::parallel_for runs on it in Linux builds of torch); Apple's clang does not take -fopenmp."""
    cflags = list(_BASE_CFLAGS)
    if build_kind() == "avx2":
        cflags += _X86_VECTOR_CFLAGS
    openmp = [] if sys.platform == "darwin" else ["-fopenmp"]
    return cflags + openmp, openmp


def _extension_name() -> str:
    h = hashlib.sha256()
    for src in (*_SOURCES, *_HEADERS):
        h.update(src.read_bytes())
    h.update(repr((*_build_flags(), torch.__version__, platform.machine())).encode())
    return f"mcsd_cpu_kernels_{h.hexdigest()[:12]}"


def _load_library() -> None:
    """Build (if needed) and load the operator library; raises on failure."""
    name = _extension_name()
    build_dir = default_cache_dir() / "torch_extensions" / name
    built = build_dir / f"{name}.so"
    lock = build_dir / "lock"
    # A "lock" file means another process is building right now: go through cpp_extension.load,
    # which waits for it, rather than loading a half-written library.  A lock older than any build
    # takes was left by a killed build; cpp_extension would wait for it forever.
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            log.warning("removing stale build lock %s", lock)
            lock.unlink()
    except FileNotFoundError:
        pass
    if built.is_file() and not lock.exists():
        torch.ops.load_library(str(built))
        return
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    cflags, ldflags = _build_flags()
    print("compiling the CPU kernels (once, about a minute)", file=sys.stderr, flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compiler-version / ABI chatter; real errors raise
        cpp_extension.load(
            name=name,
            sources=[str(src) for src in _SOURCES],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )


@functools.cache
def _status() -> tuple[bool, str]:
    """(available, reason when not).  Cached: the CPU check and the build happen once per process."""
    try:
        _load_library()
        torch.ops.mcsd_cpu.bf16_linear  # resolves the operator, raises if registration failed
        _register_fakes()
        return True, ""
    except Exception as exc:  # noqa: BLE001 - anything here means "use torch instead"
        text = " ".join(str(exc).split())
        if len(text) > 600:
            text = text[:200] + " ... " + text[-400:]
        reason = f"building/loading the CPU kernels ({build_kind()} build) failed ({type(exc).__name__}: {text})"
        log.warning("%s; falling back to torch.nn.functional.linear", reason)
        return False, reason


def _register_fakes() -> None:
    """Shape-only versions of the operators, so that ``torch.compile`` traces through them (the
    forward compiles as one graph: ``tests/engine/models/test_compile.py``)."""
    def linear_out(x, weight, bias=None):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    def attention_out(q, *args):
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    def quant_linear_out(x, weight, type_id, k, bias=None):
        return x.new_empty(*x.shape[:-1], weight.shape[0] * (8 if type_id & 256 else 1))  # packed: 8 rows a group

    def quant_dequantize_out(weight, type_id, k):
        return weight.new_empty(weight.shape[0], k, dtype=torch.float32)

    def same_out(x, *args):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    def add_rms_norm_out(x, *args):
        return same_out(x), same_out(x)

    def silu_mul_out(gate_up):
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    for name, fn in (("bf16_linear", linear_out), ("f32_linear", linear_out), ("attention", attention_out),
                     ("paged_attention", attention_out), ("quant_linear", quant_linear_out),
                     ("quant_dequantize", quant_dequantize_out), ("rms_norm", same_out),
                     ("add_rms_norm", add_rms_norm_out), ("rotary", same_out), ("silu_mul", silu_mul_out),
                     ("decoder_stack", add_rms_norm_out)):
        try:
            torch.library.register_fake(f"mcsd_cpu::{name}", fn)
        except RuntimeError as exc:  # already registered in this process (a reloaded module)
            if "already" not in str(exc):
                raise


def available() -> bool:
    """True when the library is built and loaded (:func:`build_kind` says which build).  Never raises."""
    return _status()[0]


def build_name() -> str:
    """The loaded library's build (a hash of its sources and flags), or "unavailable": what timings
    measured with these kernels depend on."""
    return _extension_name() if available() else "unavailable"


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False (None when it is True)."""
    ok, reason = _status()
    return None if ok else reason


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``round_bf16(fp32 accumulation of x @ weight.T + bias)``.

    x: [..., K] bf16 (any leading dims, any strides); weight: [N, K] bf16 contiguous; bias: [N] bf16
    or None.  Returns [..., N] bf16.  Batch invariant: each output row depends only on its own input
    row, bitwise.  No autograd (inference only).  Raises RuntimeError if the kernels are unavailable.
    """
    return _op()(x, weight, bias)


@functools.cache
def _op(dtype: torch.dtype = torch.bfloat16):
    """The linear operator overload for ``dtype`` (bf16 or fp32), resolved once (saves the namespace
    lookups on every call)."""
    if not available():
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    return (torch.ops.mcsd_cpu.bf16_linear if dtype == torch.bfloat16 else torch.ops.mcsd_cpu.f32_linear).default


def _best_ms(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


@functools.cache
def _ours_is_faster() -> bool:
    """Time ours vs F.linear (bf16) at 1 and 16 rows on a probe weight; ours wins if faster at 16.

    Timed on one thread: the question is which kernel is better, and on a shared machine a
    multi-threaded timing mostly measures how long the OS takes to wake the second thread.
    """
    threads = torch.get_num_threads()
    try:
        n, k = _PROBE_SHAPE
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        op = _op()
        ms = {}
        torch.set_num_threads(1)
        with torch.inference_mode():
            for rows in _PROBE_ROWS:
                x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
                op(x, w, None), F.linear(x, w)  # warm up (first touch, lazy init)
                ms["ours", rows] = _best_ms(lambda: op(x, w, None), 3)
                ms["torch", rows] = _best_ms(lambda: F.linear(x, w), 2)
        faster = ms["ours", 16] < ms["torch", 16]
        log.info(
            "bf16 linear %dx%d: ours %.3f / %.3f ms, torch %.3f / %.3f ms at 1 / 16 rows -> using %s",
            n, k, ms["ours", 1], ms["ours", 16], ms["torch", 1], ms["torch", 16],
            "ours" if faster else "torch",
        )
        return faster
    except Exception as exc:  # noqa: BLE001
        log.warning("bf16 kernel timing failed (%s); using torch.nn.functional.linear", exc)
        return False
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _enabled() -> bool:
    """The once-per-process decision: env override, then availability, then timing."""
    env = os.environ.get(_ENV_SWITCH, "").strip().lower()
    if env in ("0", "false", "off", "no"):
        return False
    forced = env in ("1", "true", "on", "yes")
    if env and not forced:
        log.warning("ignoring %s=%r (expected 0 or 1)", _ENV_SWITCH, env)
    if not available():
        if forced:
            log.warning("%s=1 but the bf16 CPU kernels are unavailable: %s", _ENV_SWITCH, unavailable_reason())
        return False
    return True if forced or _batch_invariant else _ours_is_faster()


@torch.compiler.assume_constant_result  # decided once per mode: a compiled forward bakes the answer in
def should_use(weight: torch.Tensor) -> bool:
    """Whether our kernel should replace ``F.linear`` for this weight.

    False unless the weight is a contiguous 2-D bf16 or fp32 CPU tensor.  bf16: the process-wide
    decision (``MCSD_CPU_KERNELS`` if set; else yes in batch-invariant mode; else a one-off timing of a
    few milliseconds: ours is used when it beats torch at 16 rows).  fp32: yes in batch-invariant
    mode (torch's fp32 GEMM is not batch invariant), unless ``MCSD_CPU_KERNELS=0``.  Use it for every
    linear of a model or for none, or the batch invariance between 1-row and many-row forwards is lost.
    """
    if weight.device.type != "cpu" or weight.dim() != 2 or not weight.is_contiguous():
        return False
    if weight.dtype == torch.bfloat16:
        return _enabled()
    return weight.dtype == torch.float32 and _f32_enabled()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` drop-in that takes our kernel when :func:`should_use` says so.  A packed weight
    (GGUF blocks, ``engine.models.qweight``) multiplies itself."""
    if not isinstance(weight, torch.Tensor):
        return weight.linear(x, bias)
    if x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype) and should_use(weight):
        if torch.compiler.is_compiling():  # traced: name the operator (_op's cache is host-side state)
            return (torch.ops.mcsd_cpu.bf16_linear if x.dtype == torch.bfloat16 else torch.ops.mcsd_cpu.f32_linear)(
                x, weight, bias)
        return _op(x.dtype)(x, weight, bias)
    return F.linear(x, weight, bias)


def f32_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in fp32, batch invariant (the bf16 kernel's tiles over fp32 weights).
    x: [..., K] fp32; weight: [N, K] fp32 contiguous; bias: [N] fp32 or None."""
    return _op(torch.float32)(x, weight, bias)


@functools.cache
def _f32_enabled() -> bool:
    if os.environ.get(_ENV_SWITCH, "").strip().lower() in ("0", "false", "off", "no"):
        return False
    return _batch_invariant and available()


def set_batch_invariant(on: bool) -> None:
    """Batch-invariant mode for this process (the engine sets it from ``EngineConfig.batch_invariant``;
    on by default): every CPU linear (bf16 and fp32) and the CPU attention take our kernels, which
    compute each row alone, so a request's logits do not depend on what else is in the batch or on
    the step's block size.  Off: torch's kernels where they are faster.  The environment switches
    (``MCSD_CPU_KERNELS``, ``MCSD_INVARIANT_ATTENTION``) still override.  Set it before the first
    forward: a model must run one kind of kernel throughout."""
    global _batch_invariant
    if bool(on) != _batch_invariant:
        _batch_invariant = bool(on)
        _enabled.cache_clear(), _f32_enabled.cache_clear(), _invariant_attention_decision.cache_clear()


def batch_invariant() -> bool:
    """Whether this process's CPU forwards are batch invariant: every linear (bf16 and fp32) and the
    attention take our kernels."""
    return _enabled() and _f32_enabled() and _invariant_attention()


@torch.compiler.assume_constant_result  # decided once per mode: a compiled forward bakes it in
def _invariant_attention() -> bool:
    return _invariant_attention_decision()


@functools.cache
def _invariant_attention_decision() -> bool:
    """Whether CPU attention takes our batch-invariant kernel (in batch-invariant mode, when the
    kernels are built); ``MCSD_INVARIANT_ATTENTION=0`` / ``=1`` overrides.  Decided once per mode."""
    env = os.environ.get(_ATTENTION_SWITCH, "").strip().lower()
    if env in ("0", "false", "off", "no"):
        return False
    if env in ("1", "true", "on", "yes"):
        return available()
    if env:
        log.warning("ignoring %s=%r (expected 0 or 1)", _ATTENTION_SWITCH, env)
    return _batch_invariant and available()


@contextlib.contextmanager
def torch_formulation() -> Iterator[None]:
    """Within it, this process runs the torch formulation a GPU runs: none of our CPU kernels
    (``MCSD_CPU_KERNELS=0``, ``MCSD_INVARIANT_ATTENTION=0``, every decision made again), for the tools
    and tests that count or compile what a GPU would run.  After it the switches and decisions are
    as they were.  Compiled graphs bake the decisions in, so torch.compile's caches are reset on the
    way in and out."""
    saved = {k: os.environ.get(k) for k in (_ENV_SWITCH, _ATTENTION_SWITCH)}
    decisions = (_enabled, _f32_enabled, _invariant_attention_decision, _row_ops_decision)
    os.environ.update({_ENV_SWITCH: "0", _ATTENTION_SWITCH: "0"})
    for decision in decisions:
        decision.cache_clear()
    torch._dynamo.reset()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for decision in decisions:
            decision.cache_clear()
        torch._dynamo.reset()


def paged_attention_applies(pool: torch.Tensor) -> bool:
    """Whether :func:`paged_attention` runs over this cache pool (else gather + attention); the queries
    are in the pool's dtype (the model's)."""
    return pool.device.type == "cpu" and pool.dtype in (torch.float32, torch.bfloat16) and _invariant_attention()


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                    lens: torch.Tensor, start: torch.Tensor, block_mask: Optional[torch.Tensor],
                    counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`attention` read straight from a paged cache (``csrc/attention.cpp``, CPU only: see
    :func:`paged_attention_applies`), bitwise equal to it over the gathered rows and the full mask.

    q [B, Hq, T, D]; k_pool, v_pool [R, Hkv, D]; rows [B, L] pool row of each position; lens, start [B]
    committed entries and where the block sits; block_mask [B, T, W] bool over the pending entries and
    the block (None: causal).  Committed entries are always visible, and each query sees itself.
    ``counts`` ([B] int64): the blocks' real queries, packed in q as [1, Hq, sum(counts), D]
    (sequence after sequence); the output is packed the same way, and padding costs nothing."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    return torch.ops.mcsd_cpu.paged_attention(q, k_pool, v_pool, rows, lens, start, block_mask, q.shape[-1] ** -0.5,
                                              counts)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Grouped-query attention, ``F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)``.

    q [B, Hq, T, D], k and v [B, Hkv, L, D], mask bool [B, 1, T, L] (True = attend) or None.  On the
    CPU (fp32 / bf16) it takes ``csrc/attention.cpp``: each query's output is bitwise the same whatever
    the other queries, the batch, the padding of L or where a tree's tokens sit in the cache, so a
    verification forward sees exactly the attention of single-token decoding steps.  A query that may
    attend to nothing gets zeros.  Elsewhere (GPU, other dtypes, ``MCSD_INVARIANT_ATTENTION=0``) SDPA.
    """
    if (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and q.dtype == k.dtype == v.dtype
            and _invariant_attention()):
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return torch.ops.mcsd_cpu.attention(q, k, v, mask, q.shape[-1] ** -0.5)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


# The row-wise operations between a decoder layer's linears (csrc/layer_ops.cpp).  On the CPU each is
# one operator and one pass over its rows instead of two to eight torch operators; the results are
# the torch formulation's up to the order of the norm's sum of squares.  Elsewhere (GPU, other
# dtypes, ``MCSD_CPU_KERNELS=0``) the torch formulation itself.

@torch.compiler.assume_constant_result  # decided once per process: a compiled forward bakes it in
def _row_ops_enabled() -> bool:
    return _row_ops_decision()


@functools.cache
def _row_ops_decision() -> bool:
    return os.environ.get(_ENV_SWITCH, "").strip().lower() not in ("0", "false", "off", "no") and available()


_ROW_DTYPES = (torch.float32, torch.bfloat16)


def _row_ops(x: torch.Tensor) -> bool:  # called about 170 times a forward: kept cheap
    return x.dtype in _ROW_DTYPES and x.device.type == "cpu" and _row_ops_enabled()


def row_ops_apply(dtype: torch.dtype) -> bool:
    """Whether CPU tensors of ``dtype`` take the layer operations below (else torch's formulation)."""
    return dtype in _ROW_DTYPES and _row_ops_enabled()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(x)``: normalised in fp32, rounded to x's dtype, then scaled in x's dtype.
    x [..., H], weight [H]."""
    if _row_ops(x) and _row_ops(weight) and weight.is_contiguous():
        return torch.ops.mcsd_cpu.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (in x's dtype) and ``rms_norm(s, weight, eps)``: a residual add and the
    next layer's norm in one pass.  Returns (s, normed)."""
    if _row_ops(x) and _row_ops(weight) and weight.is_contiguous() and residual.dtype == x.dtype:
        return torch.ops.mcsd_cpu.add_rms_norm(x, residual, weight, eps)
    s = x + residual
    return s, rms_norm(s, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the "rotate half" layout: ``x * cos + rotate_half(x) * sin``.  x [B, T, H, D], cos and
    sin [B, T, 1, D] in x's dtype.  Returns a new contiguous tensor."""
    if _row_ops(x) and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1:
        return torch.ops.mcsd_cpu.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
    if _row_ops(gate_up):
        return torch.ops.mcsd_cpu.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
