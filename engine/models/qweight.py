"""Linear weights kept in GGUF's quantized blocks and multiplied in place (``csrc/quant_gemm.cpp``).

A :class:`QuantWeight` holds a GGUF tensor's blocks, packed for the kernels in groups of 8 rows (a
permutation of the GGUF bytes; :meth:`QuantWeight.rows` gives them back), and multiplies activations by
them without a dequantized copy: the kernel rounds the activations to int8 per block and takes integer
dot products with the blocks (as llama.cpp does), accumulating in fp32; on CPUs with AVX-512 and VNNI
it runs 512-bit kernels that give the same bits (:func:`kernel_isa`).  Supported block types: the
ones of the packs the project ships and the other common ones (``BLOCK_TYPES``).  Results are
batch-invariant (a row's output is bitwise the same whatever the number of rows in the call), see the
kernel's header.

CPU only: the kernels are built with the bf16 ones (``engine.models.cpu_kernels``).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from engine.models import cpu_kernels

log = logging.getLogger(__name__)

#: GGML type id -> (name, weights per block, bytes per block)
BLOCK_TYPES = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
TYPE_IDS = {name: tid for tid, (name, _, _) in BLOCK_TYPES.items()}


def row_bytes(type_id: int, k: int) -> int:
    name, block, nbytes = _info(type_id)
    if k % block:
        raise ValueError(f"{name} rows hold multiples of {block} weights, not {k}")
    return k // block * nbytes


def _info(type_id: int) -> tuple[str, int, int]:
    try:
        return BLOCK_TYPES[int(type_id)]
    except KeyError:
        names = ", ".join(n for n, _, _ in BLOCK_TYPES.values())
        raise ValueError(f"GGML block type {type_id} is not supported (supported: {names})") from None


_PACKED_FLAG = 256  # quant_linear's type for a packed weight: the GGML type | this
_PACK_ROWS = 8


@dataclass
class QuantWeight:
    """A ``[N, K]`` linear weight in GGUF blocks of type ``type_id``, built from the GGUF rows
    ``uint8 [N, row_bytes]``.  Where the kernels are available it is kept packed for them: groups of 8
    rows interleaved, ``uint8 [ceil(N / 8), ...]`` (the last group padded with zero rows), a permutation
    of the GGUF bytes (Q4_K / Q5_K 2-3% larger: their 6-bit scales as bytes); :meth:`rows` gives the
    GGUF bytes back exactly.  ``data`` is what is stored."""

    data: torch.Tensor  # uint8: GGUF rows [N, row_bytes], or packed groups when `packed`
    type_id: int
    k: int
    n: int = -1  # rows; given (only) with packed data
    packed: bool = False

    def __post_init__(self) -> None:
        name, _, _ = _info(self.type_id)
        if self.packed:
            if self.n <= 0 or self.data.dtype != torch.uint8 or self.data.dim() != 2 \
                    or self.data.shape[0] != -(-self.n // _PACK_ROWS):
                raise ValueError(f"packed {name} weight of {self.n} rows needs uint8 [{-(-self.n // _PACK_ROWS)}, ...], "
                                 f"got {self.data.dtype} {list(self.data.shape)}")
            return
        expected = row_bytes(self.type_id, self.k)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != expected:
            raise ValueError(f"{name} weight of K={self.k} needs uint8 [N, {expected}], got "
                             f"{self.data.dtype} {list(self.data.shape)}")
        self.n = self.data.shape[0]
        self.data = self.data.contiguous()
        if cpu_kernels.available():
            self.data = torch.ops.mcsd_cpu.quant_pack(self.data, self.type_id, self.k)
            self.packed = True

    @property
    def type_name(self) -> str:
        return BLOCK_TYPES[self.type_id][0]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x @ W.T + bias`` in fp32, returned in ``x``'s dtype; ``x`` [..., K].  One operator call (and
        a copy of the real columns where the last group of a packed weight is padded)."""
        data, kernel_type = self.kernel_args()
        if not self.packed:
            return torch.ops.mcsd_cpu.quant_linear(x, data, kernel_type, self.k, bias)
        pad = -self.n % _PACK_ROWS
        if pad == 0:
            return torch.ops.mcsd_cpu.quant_linear(x, data, kernel_type, self.k, bias)
        if bias is not None:  # added in fp32 by the kernel, as for whole groups
            bias = torch.cat([bias, bias.new_zeros(pad)])
        return torch.ops.mcsd_cpu.quant_linear(x, data, kernel_type, self.k, bias)[..., :self.n].contiguous()

    def kernel_args(self) -> tuple[torch.Tensor, int]:
        """What ``quant_linear`` takes for this weight: its data and type (the GGML type, flagged when
        packed; a packed weight's product has its padding rows too, up to a whole group)."""
        return self.data, self.type_id | _PACKED_FLAG if self.packed else self.type_id

    def rows(self, index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The GGUF bytes of all rows, or of the rows ``index`` (1-D), ``uint8 [len, row_bytes]``."""
        if not self.packed:
            return self.data if index is None else self.data.index_select(0, index)
        if index is None:
            index = torch.arange(self.n)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.n):
            raise IndexError(f"row index out of range for a weight of {self.n} rows")
        return torch.ops.mcsd_cpu.quant_unpack(self.data, self.type_id, self.k, index.long().contiguous())

    def select(self, index: torch.Tensor) -> "QuantWeight":
        """A weight of the rows ``index`` (1-D), in that order."""
        return QuantWeight(self.rows(index), self.type_id, self.k)

    @classmethod
    def concat(cls, parts: list["QuantWeight"]) -> "QuantWeight":
        """The parts' rows stacked (one type and K).  Packed parts of whole groups are stacked as they are."""
        first = parts[0]
        if any(p.type_id != first.type_id or p.k != first.k for p in parts):
            raise ValueError("QuantWeight.concat needs parts of one block type and K")
        if all(p.packed and p.n % _PACK_ROWS == 0 for p in parts):
            return cls(torch.cat([p.data for p in parts]), first.type_id, first.k,
                       n=sum(p.n for p in parts), packed=True)
        return cls(torch.cat([p.rows() for p in parts]), first.type_id, first.k)

    def dequantize(self, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 ``[N, K]`` (or only ``rows``, e.g. the embedding rows of some token ids)."""
        data = self.rows(None if rows is None else rows.flatten())
        out = torch.ops.mcsd_cpu.quant_dequantize(data, self.type_id, self.k)
        return out if rows is None else out.view(*rows.shape, self.k)


def available() -> bool:
    """Whether the kernels are built and loaded (never raises)."""
    return cpu_kernels.available()


def kernel_isa(switch: str = "") -> str:
    """The quantized kernels in use: ``"avx512"`` (512-bit, with VNNI: chosen where the CPU has them),
    ``"avxvnni"`` (256-bit with AVX-VNNI for Q4_K and the 32-weight types, AVX2 for Q5_K and Q6_K: chosen where
    the CPU has AVX-VNNI but no AVX-512, as Intel's client cores), ``"avx2"`` or ``"portable"``.
    ``switch`` (one of the first three) changes them for the process; all give bitwise the same
    results, so this is for timing and tests.  ``MCSD_CPU_ISA=avx2`` (or ``avxvnni``) starts a process
    on those."""
    if not cpu_kernels.available():
        raise RuntimeError("the CPU kernels are not available on this machine")
    return torch.ops.mcsd_cpu.quant_isa(switch)


def quantize_q8_0(weight: torch.Tensor) -> QuantWeight:
    """Q8_0 blocks of a ``[N, K]`` float weight (K a multiple of 32): per block of 32 weights an fp16
    scale ``d = max|w| / 127`` and ``round(w / d)`` in int8, the layout llama.cpp writes."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"Q8_0 needs K divisible by 32, got {k}")
    w = weight.detach().float().reshape(n, k // 32, 32)
    amax = w.abs().amax(-1, keepdim=True)
    d = (amax / 127.0).half()  # the scale as stored; quantize against it
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(amax))
    q = (w * inv).round().clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([d.view(torch.uint8).reshape(n, k // 32, 2), q.view(torch.uint8)], dim=-1)
    return QuantWeight(blocks.reshape(n, k // 32 * 34), TYPE_IDS["Q8_0"], k)


# Q4_K: how many rows are quantized at a time (bounds the temporaries), and the grid of step counts a
# sub-block's range is tried at (15: its min and max are quantization points; more: a finer step,
# the extremes clamped; fewer: a coarser one).
_Q4K_ROWS = 512
_Q4K_STEPS = (14.0, 14.5, 15.0, 15.5, 16.0, 17.0)


def quantize_q4_k(weight: torch.Tensor) -> QuantWeight:
    """Q4_K blocks of a ``[N, K]`` float weight (K a multiple of 256), llama.cpp's layout: per super-block
    of 256 weights an fp16 ``d`` and ``dmin``, eight sub-blocks of 32 with a 6-bit scale ``sc`` and min
    ``m`` each (12 bytes), and 4-bit ``q``; a weight is ``d sc q - dmin m``.

    Each sub-block's affine fit ``w ~ s q - mn`` (``mn >= 0``) is the best in squares of a few: its
    range cut into :data:`_Q4K_STEPS` steps, ``q`` rounded, then ``s`` and ``mn`` refitted to those
    ``q`` by least squares.  The super-block's ``d`` and ``dmin`` are the largest ``s`` and ``mn`` over 63;
    ``q`` is rounded again against the 6-bit scale and min as stored."""
    n, k = weight.shape
    if k % 256:
        raise ValueError(f"Q4_K needs K divisible by 256, got {k}")
    out = torch.empty(n, k // 256 * 144, dtype=torch.uint8)
    for r0 in range(0, n, _Q4K_ROWS):
        out[r0:r0 + _Q4K_ROWS] = _q4_k_rows(weight[r0:r0 + _Q4K_ROWS].detach().float())
    return QuantWeight(out, TYPE_IDS["Q4_K"], k)


def _fit_sub_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 32] -> (s, mn) [...], both >= 0: the best of the grid's fits ``x ~ s q - mn``, q in 0..15."""
    lo = x.amin(-1, keepdim=True).clamp(max=0.0)  # the min is subtracted, so it is never above 0
    span = x.amax(-1, keepdim=True) - lo
    inv_span = torch.where(span > 0, 1.0 / span, torch.zeros_like(span))
    n = x.shape[-1]
    sx = x.sum(-1)
    best_err = best_s = best_lo = None
    for steps in _Q4K_STEPS:
        q = ((x - lo) * (inv_span * steps)).round().clamp(0, 15)
        sq, sqq, sqx = q.sum(-1), (q * q).sum(-1), (q * x).sum(-1)
        det = n * sqq - sq * sq
        ok = det > 0
        safe = torch.where(ok, det, torch.ones_like(det))
        s = torch.where(ok, (n * sqx - sq * sx) / safe, torch.zeros_like(det))
        b = torch.where(ok, (sqq * sx - sq * sqx) / safe, sx / n)
        above = b > 0  # a positive offset is not representable: the fit through 0
        s = torch.where(above, torch.where(sqq > 0, sqx / sqq.clamp(min=1e-30), torch.zeros_like(sqq)), s)
        b = torch.where(above, torch.zeros_like(b), b)
        s = s.clamp(min=0.0)
        err = ((s[..., None] * q + b[..., None] - x) ** 2).sum(-1)
        if best_err is None:
            best_err, best_s, best_lo = err, s, b
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s, best_lo = torch.where(better, s, best_s), torch.where(better, b, best_lo)
    return best_s, -best_lo


def _q4_k_rows(w: torch.Tensor) -> torch.Tensor:
    """Q4_K bytes of fp32 rows ``w [n, K]``: uint8 [n, K / 256 * 144]."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 8, 32)
    s, mn = _fit_sub_blocks(x)  # [n, S, 8]
    d, dmin = (s.amax(-1) / 63).half(), (mn.amax(-1) / 63).half()  # [n, S], as stored
    df, dminf = d.float()[..., None], dmin.float()[..., None]
    sc = torch.where(df > 0, s / df.clamp(min=1e-30), torch.zeros_like(s)).round().clamp(0, 63)
    m = torch.where(dminf > 0, mn / dminf.clamp(min=1e-30), torch.zeros_like(mn)).round().clamp(0, 63)
    step, offset = (df * sc)[..., None], (dminf * m)[..., None]
    q = torch.where(step > 0, (x + offset) / step.clamp(min=1e-30), torch.zeros_like(x)).round().clamp(0, 15)
    q = q.to(torch.uint8)  # [n, S, 8, 32]
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    scales = torch.empty(n, k // 256, 12, dtype=torch.uint8)
    # sub-blocks 0-3: 6 bits in bytes 0-3 (scale) and 4-7 (min); 4-7: low 4 bits in bytes 8-11, the top
    # 2 bits in the top bits of bytes 0-3 (scale) and 4-7 (min)
    scales[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    scales[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    # 32-byte chunks: sub-block 2c in the low nibbles, 2c + 1 in the high ones
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(n, k // 256, 128)
    head = torch.stack([d, dmin], -1).view(torch.uint8).reshape(n, k // 256, 4)
    return torch.cat([head, scales, qs], -1).reshape(n, k // 256 * 144)


class StackedWeight:
    """Row-stacked weights (a fused q/k/v or gate/up whose parts have different block types): the
    product is the parts' products side by side."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes if isinstance(p, (QuantWeight, StackedWeight)) else p.numel() * p.element_size()
                   for p in self.parts)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = torch.cat([cpu_kernels.linear(x, p) for p in self.parts], dim=-1)
        return y if bias is None else y + bias


class QuantLinear(nn.Module):
    """Stands in for ``nn.Linear`` in a :class:`~engine.models.llama.LlamaModel`: ``.weight`` is a
    :class:`QuantWeight` (or any weight with a ``linear`` method), which ``engine.models.cpu_kernels.linear``
    dispatches on."""

    def __init__(self, weight, bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias


#: --quantize formats: (quantizer, weights per block); a linear whose K is not a whole number of the
#: format's blocks falls back to the next one here that fits (Q4_K -> Q8_0, as llama.cpp falls back to
#: a 32-weight type for such tensors)
QUANTIZERS = {"q8_0": (quantize_q8_0, 32), "q4_k": (quantize_q4_k, 256)}
FALLBACK = {"q4_k": "q8_0"}
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _quantized(lin: nn.Module, fmt: str, fell_back: Optional[list[str]] = None) -> nn.Module:
    """``lin`` as a :class:`QuantLinear` in ``fmt`` (or its fallback where K is not a whole number of
    ``fmt``'s blocks, noted in ``fell_back``), or ``lin`` itself when no format fits K (logged; the
    product stays exact, just dense)."""
    if isinstance(lin, QuantLinear):
        return lin
    k = lin.weight.shape[1]
    while fmt is not None and k % QUANTIZERS[fmt][1]:
        fmt = FALLBACK.get(fmt)
        if fell_back is not None and fmt is not None:
            fell_back.append(fmt)
    if fmt is None:
        log.warning("linear of K=%d is not a multiple of 32; it stays %s", k, lin.weight.dtype)
        return lin
    return QuantLinear(QUANTIZERS[fmt][0](lin.weight), lin.bias)


def quantize_linears(model: nn.Module, fmt: str) -> nn.Module:
    """Replaces the decoder linears and the output layer of a dense :class:`LlamaModel` by ``fmt``
    blocks, in place (``--quantize``); embeddings and norms stay as they are.  Returns the model."""
    if fmt not in QUANTIZERS:
        raise ValueError(f"unknown quantization {fmt!r}; choose one of {', '.join(QUANTIZERS)} or none")
    t0, fell_back = time.perf_counter(), []
    layers = len(model.layers)
    for i, layer in enumerate(model.layers):
        for name in LINEARS:
            setattr(layer, name, _quantized(getattr(layer, name), fmt, fell_back))
        if fmt == "q4_k" and (i + 1) % max(1, layers // 4) == 0 and i + 1 < layers:  # the slow one: progress
            log.info("quantizing to %s: %d of %d layers (%.0f s)", fmt, i + 1, layers, time.perf_counter() - t0)
    model.lm_head = _quantized(model.lm_head, fmt, fell_back)
    if fell_back:
        log.info("%d linears have no whole %s blocks in a row; they are %s", len(fell_back), fmt,
                 ", ".join(sorted(set(fell_back))))
    log.info("linears quantized to %s in %.1f s", fmt, time.perf_counter() - t0)
    return model


def quantized_copy(model: nn.Module, fmt: str = "q8_0") -> nn.Module:
    """A copy of ``model`` whose decoder linears and output layer are ``fmt`` blocks, sharing the
    embeddings, norms and rotary tables with ``model``, which is left as it is (the engine's
    ``draft_int8``: a draft reads half its bf16 bytes per token).  CPU only: raises ValueError
    elsewhere.  A tied output layer gets its own blocks; the embedding stays shared and dense."""
    if model.device.type != "cpu":
        raise ValueError(f"quantized weights run on the CPU only, not {model.device}")
    out = copy.copy(model)
    out._modules = dict(model._modules)
    out.layers = nn.ModuleList()
    for layer in model.layers:
        twin = copy.copy(layer)
        twin._modules = dict(layer._modules)
        out.layers.append(twin)
    return quantize_linears(out, fmt)
