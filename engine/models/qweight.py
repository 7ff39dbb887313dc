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
        if not self.packed:
            return torch.ops.mcsd_cpu.quant_linear(x, self.data, self.type_id, self.k, bias)
        kernel_type = self.type_id | _PACKED_FLAG
        pad = -self.n % _PACK_ROWS
        if pad == 0:
            return torch.ops.mcsd_cpu.quant_linear(x, self.data, kernel_type, self.k, bias)
        if bias is not None:  # added in fp32 by the kernel, as for whole groups
            bias = torch.cat([bias, bias.new_zeros(pad)])
        return torch.ops.mcsd_cpu.quant_linear(x, self.data, kernel_type, self.k, bias)[..., :self.n].contiguous()

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


class QuantLinear(nn.Module):
    """Stands in for ``nn.Linear`` in a :class:`~engine.models.llama.LlamaModel`: ``.weight`` is a
    :class:`QuantWeight` (or any weight with a ``linear`` method), which ``engine.models.cpu_kernels.linear``
    dispatches on."""

    def __init__(self, weight, bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias


QUANTIZERS = {"q8_0": quantize_q8_0}
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _quantized(lin: nn.Module, quantize) -> nn.Module:
    """``lin`` as a :class:`QuantLinear`, or ``lin`` itself when its K is not a whole number of blocks
    (logged; the product stays exact, just dense)."""
    if isinstance(lin, QuantLinear):
        return lin
    k = lin.weight.shape[1]
    if k % 32:
        log.warning("linear of K=%d is not a multiple of 32; it stays %s", k, lin.weight.dtype)
        return lin
    return QuantLinear(quantize(lin.weight), lin.bias)


def _quantizer(fmt: str):
    try:
        return QUANTIZERS[fmt]
    except KeyError:
        raise ValueError(f"unknown quantization {fmt!r}; choose one of {', '.join(QUANTIZERS)} or none") from None


def quantize_linears(model: nn.Module, fmt: str) -> nn.Module:
    """Replaces the decoder linears and the output layer of a dense :class:`LlamaModel` by ``fmt``
    blocks, in place (``--quantize``); embeddings and norms stay as they are.  Returns the model."""
    quantize = _quantizer(fmt)
    for layer in model.layers:
        for name in LINEARS:
            setattr(layer, name, _quantized(getattr(layer, name), quantize))
    model.lm_head = _quantized(model.lm_head, quantize)
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
