"""A GGUF file's weights, used as they are: quantized tensors stay in their blocks (``QuantWeight``).

The file is memory-mapped (``gguf.GGUFReader``) and every quantized tensor of a supported block type
becomes a :class:`~engine.models.qweight.QuantWeight` over its own bytes (one copy into process
memory, no dequantized copy anywhere); float tensors (norms, biases) are read in the model dtype;
a quantized type without a kernel (say Q2_K) is dequantized by the ``gguf`` package, with a warning.
The token embedding stays quantized too: a forward dequantizes only the rows of its token ids.

Names follow llama.cpp's converter (``blk.N.attn_q.weight`` ...).  For the ``llama`` architecture
that converter permutes the rows of ``attn_q`` / ``attn_k`` for its rotary layout; the permutation is
undone here on the block rows (a row permutation moves whole rows of blocks, so it is exact).

Config and tokenizer come from the file's metadata through ``transformers`` and are cached (a few
kilobytes) so that a restart does not rebuild the tokenizer.
"""

from __future__ import annotations

import logging
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.qweight import BLOCK_TYPES, QuantLinear, QuantWeight, StackedWeight

log = logging.getLogger(__name__)

_FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # GGML F32, F16, BF16


class QuantEmbedding(nn.Module):
    """A quantized token embedding: looks up by dequantizing the rows of the given ids."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.dequantize(ids).to(self.dtype)


def _nbytes(w) -> int:
    return w.nbytes if isinstance(w, (QuantWeight, StackedWeight)) else w.numel() * w.element_size()


def _unpermute_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of q / k rows (``n_head`` heads of ``rows.shape[0] / n_head``)."""
    dim = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape).contiguous()


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY = 8, 9
_FLOAT_SIZES = {0: 4, 1: 2, 30: 2}


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True)
class GGUFArray:
    """An array value of a GGUF file's metadata, not decoded: its element type and length."""

    item_type: int
    count: int


def _read_header(path: Path) -> tuple[dict[str, Any], list[tuple[str, int, tuple[int, ...], int]], int]:
    """A GGUF file's metadata (scalars and strings decoded, arrays as :class:`GGUFArray`, never read),
    its tensors (name, type, shape, offset in the data) and where the data starts."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        pos = 24

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            return bytes(buf[at + 8:at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

        def skip(vtype: int, at: int) -> int:
            if vtype == _STRING:
                (n,) = struct.unpack_from("<Q", buf, at)
                return at + 8 + n
            if vtype == _ARRAY:
                item, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if item in _SCALAR_SIZES:
                    return at + count * _SCALAR_SIZES[item]
                for _ in range(count):
                    at = skip(item, at)
                return at
            return at + _SCALAR_SIZES[vtype]

        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if vtype == _STRING:
                meta[key], pos = string(pos)
            elif vtype == _ARRAY:
                item, count = struct.unpack_from("<IQ", buf, pos)
                meta[key] = GGUFArray(int(item), int(count))
                pos = skip(vtype, pos)
            elif vtype in _SCALAR_FORMATS:
                (meta[key],) = struct.unpack_from(_SCALAR_FORMATS[vtype], buf, pos)
                pos += _SCALAR_SIZES[vtype]
            else:
                raise ValueError(f"{path}: metadata {key!r} has unknown GGUF value type {vtype}")
        infos = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (ndim,) = struct.unpack_from("<I", buf, pos)
            shape = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
            type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
            pos += 4 + 8 * ndim + 12
            infos.append((name, int(type_id), tuple(int(d) for d in shape), int(offset)))
    finally:
        buf.close()
    alignment = meta.get("general.alignment", 32)
    return meta, infos, -(-pos // alignment) * alignment


def read_metadata(path: Path) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A GGUF file's metadata (scalars and strings decoded, arrays as :class:`GGUFArray`) and its
    tensor names, without decoding the tokenizer's arrays (``gguf.GGUFReader`` decodes them all, which
    takes seconds for a large vocabulary)."""
    meta, infos, _ = _read_header(path)
    return meta, tuple(name for name, *_ in infos)


@dataclass
class TensorInfo:
    name: str
    type_id: int
    shape: tuple[int, ...]  # GGUF order: shape[0] is the row length
    offset: int  # from the start of the file
    nbytes: int


def read_tensor_index(path: Path) -> dict[str, TensorInfo]:
    """The tensors of a GGUF file (name, type, shape, where their bytes are), reading past the metadata
    without decoding its arrays (``gguf.GGUFReader`` decodes every tokenizer string)."""
    _, infos, start = _read_header(path)
    out = {}
    for name, type_id, shape, offset in infos:
        rows = math.prod(shape[1:])
        if type_id in _FLOAT_SIZES:
            nbytes = shape[0] * rows * _FLOAT_SIZES[type_id]
        else:
            import gguf

            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
            nbytes = shape[0] // block * block_bytes * rows
        out[name] = TensorInfo(name, type_id, shape, start + offset, nbytes)
    return out


class _Tensors:
    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        self.by_name = read_tensor_index(path)
        self.file = np.memmap(path, dtype=np.uint8, mode="r")
        self.dtype = dtype
        self.dequantized: list[str] = []

    def has(self, name: str) -> bool:
        return name in self.by_name

    def get(self, name: str, permute_heads: int = 0):
        """A float tensor in the model dtype, or a QuantWeight for a supported block type."""
        t = self.by_name.pop(name, None)
        if t is None:
            raise KeyError(f"GGUF file has no tensor {name!r}")
        rows = math.prod(t.shape[1:])
        data = torch.from_numpy(np.array(self.file[t.offset:t.offset + t.nbytes]))  # one copy out of the map
        if t.type_id in _FLOAT_TYPES:
            out = data.view(_FLOAT_TYPES[t.type_id]).reshape([int(d) for d in reversed(t.shape)])
            if permute_heads:
                out = _unpermute_rows(out, permute_heads)
            return out.to(self.dtype)
        data = data.view(rows, -1)
        if t.type_id in BLOCK_TYPES:
            if permute_heads:
                data = _unpermute_rows(data, permute_heads)
            return QuantWeight(data, t.type_id, t.shape[0])
        import gguf

        qtype = gguf.GGMLQuantizationType(t.type_id)
        self.dequantized.append(f"{name} ({qtype.name})")
        out = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data.numpy(), qtype)))
        if permute_heads:
            out = _unpermute_rows(out, permute_heads)
        return out.to(self.dtype)


def _stack(parts: list):
    """One weight for row-stacked parts: concatenated blocks when they share a type, else a StackedWeight
    of runs (neighbours of one type are concatenated: q and k in Q4_K then v in Q6_K is two products)."""
    runs: list = []
    for p in parts:
        prev = runs[-1] if runs else None
        if isinstance(p, torch.Tensor) and isinstance(prev, torch.Tensor) and p.dtype == prev.dtype:
            runs[-1] = torch.cat([prev, p])
        elif isinstance(p, QuantWeight) and isinstance(prev, QuantWeight) and p.type_id == prev.type_id:
            runs[-1] = QuantWeight.concat([prev, p])
        else:
            runs.append(p)
    return runs[0] if len(runs) == 1 else StackedWeight(runs)


def _as_linear(weight, bias: Optional[torch.Tensor] = None) -> nn.Module:
    if isinstance(weight, torch.Tensor):
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        lin.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias, requires_grad=False)
        return lin
    return QuantLinear(weight, bias)


def build_native(cfg: ModelConfig, path: Path, arch: str, dtype: torch.dtype):
    """The model of ``cfg``'s architecture (``cfg.model_class``) over ``path``'s tensors, quantized ones
    kept in their blocks."""
    tensors = _Tensors(path, dtype)
    with torch.device("meta"):
        model = cfg.model_class()(cfg)
    permute = arch == "llama"  # llama.cpp permutes q/k rows for this architecture only

    embed = tensors.get("token_embd.weight")
    model.embed_tokens = QuantEmbedding(embed, dtype) if isinstance(embed, QuantWeight) \
        else nn.Embedding.from_pretrained(embed, freeze=True)
    model.norm.weight = nn.Parameter(tensors.get("output_norm.weight"), requires_grad=False)
    head = tensors.get("output.weight") if tensors.has("output.weight") else embed
    if tensors.has("output.weight") or not cfg.tie_word_embeddings:
        model.lm_head = _as_linear(head)
    else:
        model.lm_head = _as_linear(embed)
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        q = tensors.get(p + "attn_q.weight", cfg.num_heads if permute else 0)
        k = tensors.get(p + "attn_k.weight", cfg.num_kv_heads if permute else 0)
        v = tensors.get(p + "attn_v.weight")
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([tensors.get(p + f"attn_{n}.bias") for n in "qkv"])
        layer.qkv_proj = _as_linear(_stack([q, k, v]), bias)
        layer.o_proj = _as_linear(tensors.get(p + "attn_output.weight"))
        layer.gate_up_proj = _as_linear(_stack([tensors.get(p + "ffn_gate.weight"), tensors.get(p + "ffn_up.weight")]))
        layer.down_proj = _as_linear(tensors.get(p + "ffn_down.weight"))
        layer.input_layernorm.weight = nn.Parameter(tensors.get(p + "attn_norm.weight"), requires_grad=False)
        layer.post_attention_layernorm.weight = nn.Parameter(tensors.get(p + "ffn_norm.weight"), requires_grad=False)
        for ours, (_, gguf_name) in model.layer_extras.items():
            module, _, param = ours.rpartition(".")
            setattr(layer.get_submodule(module), param, nn.Parameter(tensors.get(p + gguf_name), requires_grad=False))
    leftovers = [n for n in tensors.by_name if not n.startswith("rope_")]
    if leftovers:
        raise ValueError(f"GGUF file has tensors our runtime does not use: {leftovers[:5]}")
    if tensors.dequantized:
        log.warning("no kernel for %d tensors' block types; dequantized: %s", len(tensors.dequantized),
                    ", ".join(tensors.dequantized[:4]))
    missing = [n for n, prm in model.named_parameters() if prm.is_meta]
    if missing:
        raise ValueError(f"GGUF file is missing tensors: {missing[:5]}")
    return model.eval()


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's weights (quantized ones at their block size)."""
    seen, total = set(), 0
    for mod in model.modules():
        for w in (getattr(mod, "weight", None), getattr(mod, "bias", None)):
            if w is None or id(w) in seen or isinstance(w, nn.Module):
                continue
            seen.add(id(w))
            total += _nbytes(w)
    return total
