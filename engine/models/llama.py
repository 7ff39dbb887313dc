"""Our forward pass for the Llama family: RMSNorm, RoPE, grouped-query attention, SwiGLU.

One call processes, for a batch of sequences, a *block* of new tokens per sequence with arbitrary
position ids and an arbitrary attention mask over the sequence's pending entries plus the block
(a draft or verification tree), against that sequence's slot in the :class:`KVCache`.

Weights use Hugging Face names so checkpoints load as they are; q/k/v and gate/up projections are
fused into one matrix each at load time (one GEMM instead of three / two).  Every matrix multiply
goes through ``cpu_kernels.linear``: on CPUs without native bf16 it takes our batch-invariant bf16
kernel (a verification block costs a few tokens' time, not one per row), elsewhere F.linear;
weights in GGUF blocks (``engine.models.qweight``: a GGUF model run natively, ``--quantize``, an
int8 draft) multiply themselves with our integer kernels.  Attention is ``cpu_kernels.attention``:
batch-invariant on the CPU, SDPA elsewhere.
"""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass, field, replace
from typing import Callable, ClassVar, Optional

import numpy as np
import torch
from torch import nn

from engine.device import to_device, to_device_many
from engine.kv_cache import Addresses, KVCache
from engine.models import cpu_kernels
from engine.models.config import ModelConfig
from engine.models.model import ForwardOutput
from engine.models.qweight import QuantWeight, StackedWeight
from engine.models.rope import RotaryTables
from engine.models.vocab import OutputVocab


linear = cpu_kernels.linear  # dense weights, or packed ones (int8, GGUF blocks) that multiply themselves


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation, then scale in the model dtype.
        return cpu_kernels.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before this norm, fused with it: (x + residual, norm(x + residual))."""
        return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, delta: Optional[torch.Tensor], layer: int,
                ctx: "ForwardContext") -> tuple[torch.Tensor, torch.Tensor]:
        """x: [batch, block, hidden], the residual stream before the previous layer's last add, and
        delta that add (None before the first layer) -> the same pair after this layer.  Each residual
        add is fused with the norm that follows it (``RMSNorm.add``)."""
        b, t, _ = x.shape
        cfg = self.cfg
        x, h = (x, self.input_layernorm(x)) if delta is None else self.input_layernorm.add(x, delta)
        qkv = linear(h, self.qkv_proj.weight, self.qkv_proj.bias)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads rotate together: one rotary pass instead of two
        qk = self.norm_heads(qk.reshape(b, t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim))
        qk = cpu_kernels.rotary(qk, ctx.cos, ctx.sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=2)
        v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim)
        attn = ctx.attend(layer, q.transpose(1, 2), k, v)  # [batch, heads, block, head_dim]
        x, h = self.post_attention_layernorm.add(x, linear(attn.transpose(1, 2).reshape(b, t, self.q_size),
                                                           self.o_proj.weight))
        return x, linear(cpu_kernels.silu_mul(linear(h, self.gate_up_proj.weight)), self.down_proj.weight)

    def norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """[batch, block, q heads + kv heads, head_dim] before the rotary: as they are (an architecture
        with per-head norms overrides this, ``engine.models.qwen3``)."""
        return qk


@dataclass
class Packing:
    """A forward over blocks of different lengths, run without padding.

    The batch is ``[batch, block]`` with ``counts[b]`` real tokens in row ``b``; the layers' linears,
    norms and rotary run on the ``n = sum(counts)`` real rows only (``[1, n, hidden]``), and so does
    the CPU's paged attention (it takes ``counts``); the gathering attention elsewhere runs them
    padded.  A verification step where one sequence carries a five-token tree among three plain ones
    computes 8 rows, not 20."""

    lengths: list[int]  # real tokens per row; row b's are packed rows sum(lengths[:b]) onwards
    block: int
    rows: torch.Tensor  # [n] index of each real token in the flattened [batch * block], on the device
    counts: torch.Tensor  # ``lengths`` as int64 on the device (the CPU attention reads it)

    @staticmethod
    def of(counts: list[int], block: int, device: torch.device) -> Optional["Packing"]:
        """The packing of ``counts`` tokens per row, or None when nothing is padded."""
        if sum(counts) == len(counts) * block:
            return None
        rows = torch.cat([torch.arange(n) + b * block for b, n in enumerate(counts)])
        return Packing(list(counts), block, *to_device_many([rows, torch.tensor(counts, dtype=torch.long)], device))

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, block, ...] -> [1, n, ...]"""
        return x.reshape(self.batch * self.block, *x.shape[2:])[self.rows].unsqueeze(0)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[1, n, ...] -> [batch, block, ...], zeros at the padding."""
        out = x.new_zeros(self.batch * self.block, *x.shape[2:])
        out[self.rows] = x[0]
        return out.view(self.batch, self.block, *x.shape[2:])


@dataclass
class ForwardContext:
    """What every layer of one forward shares: cache addressing, rotary values and the mask inputs.

    The mask is given over the new block only: committed entries (``< lens``) are visible to every
    query, ``block_mask`` says what each query sees of the pending entries and the block (None:
    causal).  On the CPU the attention reads the pool in place with that description
    (``cpu_kernels.paged_attention``); elsewhere the rows are gathered and the full mask is built
    once per forward on the device (SDPA over gathered pages)."""

    cache: KVCache
    at: Addresses  # pool rows written and read (engine.kv_cache)
    kv_len: int  # keys read per sequence: max over the batch of (lens + pending + block)
    cos: torch.Tensor  # [batch, block, 1, head_dim]
    sin: torch.Tensor
    lens: torch.Tensor  # [batch] committed entries, on the device
    start: torch.Tensor  # [batch] cache position of the block's first token, on the device
    block_mask: Optional[torch.Tensor]  # [batch, block, width] bool on the device, or None (causal)
    paged: bool = False  # the attention reads the pool in place (cpu_kernels.paged_attention_applies)
    packing: Optional[Packing] = None  # the layers see only the real rows [1, n] (at.write, cos, sin too)
    pools: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # one layer's (keys, values) pools, else the cache's
    _mask: list = field(default_factory=list, repr=False)  # the mask once built (a list: compiles, unlike a lock)

    def for_layer(self, layer: int) -> "ForwardContext":
        """This context with layer ``layer``'s pools in it: a compiled layer then takes the pools as
        inputs and no layer index, so one compiled graph serves every layer (``engine.graphs``)."""
        return replace(self, pools=(self.cache.k[layer], self.cache.v[layer]))

    def _pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pools if self.pools is not None else (self.cache.k[layer], self.cache.v[layer])

    @property
    def mask(self) -> Optional[torch.Tensor]:
        """The full mask [batch, 1, block, kv_len] (True = attend; None = attend all), built once."""
        if not self._mask:
            block = self.cos.shape[1] if self.packing is None else self.packing.block
            self._mask.append(build_mask(self.lens, self.start, block, self.kv_len, self.block_mask))
        return self._mask[0]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Stores the block's keys and values and attends: q [batch, heads, block, head_dim], k, v
        [batch, block, kv_heads, head_dim] -> [batch, heads, block, head_dim] (packed: batch 1 and
        the real rows for block; only the gathering attention, off the CPU, runs them padded)."""
        pk = self.packing
        if self.paged:  # packed queries go in as they are: the kernel skips the padding
            self._store(layer, k, v)
            return cpu_kernels.paged_attention(q, *self._pools(layer), self.at.read,
                                               self.lens, self.start, self.block_mask,
                                               None if pk is None else pk.counts)
        if pk is not None:
            q = pk.unpack(q.transpose(1, 2)).transpose(1, 2)
        keys, values = self.store_and_read(layer, k, v)
        out = cpu_kernels.attention(q, keys, values, self.mask)
        return out if pk is None else pk.pack(out.transpose(1, 2)).transpose(1, 2)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        (ck, cv), at = self._pools(layer), self.at
        if at.view_start is not None:
            start = at.view_start + at.write_start
            ck[start:start + k.shape[1]] = k[0]
            cv[start:start + v.shape[1]] = v[0]
        else:
            ck[at.write] = k
            cv[at.write] = v

    def store_and_read(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [batch, block, kv_heads, head_dim] -> cached + new: [batch, kv_heads, kv_len, head_dim]"""
        self._store(layer, k, v)
        (ck, cv), at = self._pools(layer), self.at
        if at.view_start is not None:  # one sequence over consecutive blocks: a slice, no gather
            keys = ck[at.view_start:at.view_start + self.kv_len].unsqueeze(0)
            values = cv[at.view_start:at.view_start + self.kv_len].unsqueeze(0)
        else:
            keys, values = ck[at.read], cv[at.read]  # [batch, kv_len, kv_heads, head_dim]
        return keys.transpose(1, 2), values.transpose(1, 2)


@functools.cache
def fused_layers_enabled() -> bool:
    """``MCSD_FUSED_LAYERS=0`` runs the decoder layers one Python call each (for comparison and tests);
    otherwise :class:`FusedStack` where it applies."""
    return os.environ.get("MCSD_FUSED_LAYERS", "").strip().lower() not in ("0", "false", "off", "no")


class FusedStack:
    """Every decoder layer of a forward in one call of ``csrc/decoder.cpp``'s operator.

    It runs the operators of :meth:`DecoderLayer.forward` in the same order with the same arguments,
    so its result is bitwise the layer loop's; what it saves is the interpreter between them (about a
    fifth of a one-token forward of a 1.5B model on a 2-core CPU).  It applies on the CPU to a model
    whose linears are all in GGUF blocks (:class:`~engine.models.qweight.QuantWeight`, or several side
    by side), with the CPU's layer operations and paged attention; elsewhere the layer loop runs."""

    def __init__(self, model: "LlamaModel", tensors: list[torch.Tensor], meta: list[int]) -> None:
        self.tensors, self.meta = tensors, meta
        self.eps = model.cfg.rms_norm_eps
        self.scale = model.cfg.head_dim ** -0.5

    @staticmethod
    def key(model: "LlamaModel") -> tuple:
        """What the stack was built from: every layer's modules (identities; checked every forward, so
        kept cheap).  Code that replaces a weight inside a module after a forward replaces the module."""
        return tuple(map(id, itertools.chain.from_iterable(layer._modules.values() for layer in model.layers)))

    @staticmethod
    def build(model: "LlamaModel") -> Optional["FusedStack"]:
        """The stack of ``model``'s layers, or None where it does not apply."""
        dtype = model.dtype
        if model.device.type != "cpu" or not cpu_kernels.row_ops_apply(dtype):  # (the operator is in their library)
            return None
        if type(model).layer_class is not DecoderLayer:  # the operator runs the Llama layer only
            return None
        cfg = model.cfg
        meta = [cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim]
        tensors: list[torch.Tensor] = []
        for layer in model.layers:
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype != dtype or not w.is_contiguous() for w in norms):
                return None
            tensors += norms
            bias = layer.qkv_proj.bias
            if bias is not None and bias.dtype != dtype:
                return None
            meta.append(int(bias is not None))
            tensors += [] if bias is None else [bias]
            for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                w = lin.weight
                parts = w.parts if isinstance(w, StackedWeight) else [w]
                if not all(isinstance(p, QuantWeight) for p in parts):
                    return None
                meta.append(len(parts))
                for p in parts:
                    data, kind = p.kernel_args()
                    meta += [kind, p.k, p.shape[0]]
                    tensors.append(data)
        return FusedStack(model, tensors, meta)

    def applies(self, ctx: ForwardContext) -> bool:
        """Whether the layer loop would take the rotary operator too (cpu_kernels.rotary's condition)."""
        return ctx.cos.stride(-1) == 1 and ctx.sin.stride(-1) == 1

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        pk, at = ctx.packing, ctx.at
        return torch.ops.mcsd_cpu.decoder_stack(
            x, self.tensors, self.meta, self.eps, ctx.cos, ctx.sin, ctx.cache.k, ctx.cache.v, at.write, at.read,
            ctx.lens, ctx.start, ctx.block_mask, self.scale, None if pk is None else pk.counts)


class LlamaModel(nn.Module):
    """The Llama family (Llama 2/3, Qwen2, Mistral, SmolLM): an ``engine.models.model.Model``."""

    layer_class: ClassVar[type] = DecoderLayer
    layer_extras: ClassVar[dict[str, tuple[str, str]]] = {}  # (Model.layer_extras: none here)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope: Optional[RotaryTables] = None
        self._fused: Optional[tuple[tuple, Optional[FusedStack]]] = None  # (FusedStack.key, the stack)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the final norm's: embeddings and linears may be quantized)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_cache(self, num_slots: int, max_len: int, block_size: int = 4,
                  num_blocks: Optional[int] = None) -> KVCache:
        """A paged cache for this model: ``num_slots`` sequences of at most ``max_len`` positions over a
        pool of ``num_blocks`` blocks (default: room for all of them at full length).  Also (re)builds
        the rotary tables for ``max_len`` positions."""
        if self.rope is None or self.rope.max_pos < max_len:
            self.rope = RotaryTables(self.cfg, max_len, self.dtype, self.device)
        c = self.cfg
        return KVCache(c.num_layers, num_slots, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device,
                       block_size, num_blocks)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, block]
        positions: torch.Tensor,  # [batch, block]
        cache: KVCache,
        slots: list[int],
        block_mask: Optional[torch.Tensor] = None,  # [batch, block, width] bool, see build_mask
        num_new: Optional[list[int]] = None,  # valid tokens per row (rest is padding); default all
        logits_rows: Optional[torch.Tensor] = None,  # [batch, rows] block indices; None = all
        num_logits: Optional[list[int]] = None,  # wanted rows of each row of logits_rows; None = all
        vocab: Optional[OutputVocab] = None,  # restricted output layer (drafts); None = the whole lm_head
        position_shift: Optional[torch.Tensor] = None,  # [batch] on the device, added to each row's positions
    ) -> ForwardOutput:
        """Appends the block to each slot's pending entries and returns logits for it.

        ``block_mask`` column ``c`` of row ``b`` is the cache position ``lens[b] + c``: the
        sequence's pending entries come first, then its block.  Committed context (``< lens``)
        is always visible.  ``None`` means plain causal attention over everything.

        Rows of different lengths (``num_new``) run packed (:class:`Packing`): padding costs no
        linear rows.  ``num_logits[b]``: how many of ``logits_rows[b]`` are wanted (the rest is
        padding, whose logits are not computed: they repeat the row's first).
        ``position_shift``: a device tensor added to each row's positions there, for a block whose
        place in its sequence only the device knows (``cascade.DeviceCascade``); the host's
        ``positions`` plus the largest shift must stay within the cache's length.
        """
        b, t = input_ids.shape
        counts = num_new if num_new is not None else [t] * b
        cache.reserve(slots, counts)
        bucket = None
        if cache.captured is not None:  # a captured shape (engine.graphs): replayed, padded to its bucket
            bucket = cache.captured.bucket_for(slots, t)
        if bucket is not None:
            self._check_positions(cache, positions)
            packing = None
            hidden = cache.captured.hidden(bucket, input_ids, positions, slots, block_mask, counts, position_shift)
        else:
            packing = Packing.of(counts, t, self.device)
            ctx = self._context(cache, slots, positions, block_mask, packing, position_shift)
            hidden = self.hidden_states(input_ids if packing is None else packing.pack(input_ids), ctx)
        cache.advance(slots, counts)
        if logits_rows is None:
            rows, logits_at = hidden, None
        else:
            rows, logits_at = self._logit_rows(hidden, logits_rows, num_logits, packing, t)
        logits = linear(rows, self.lm_head.weight).float() if vocab is None else vocab.logits(rows)
        if logits_at is not None:  # [1, m, vocab] -> [batch, rows, vocab]
            logits = logits[0, logits_at]
        elif packing is not None:  # every row's logits, packed like the hidden states
            logits = packing.unpack(logits)
        if packing is not None:
            hidden = packing.unpack(hidden)
        return ForwardOutput(logits=logits, hidden=hidden)

    def _logit_rows(self, hidden: torch.Tensor, logits_rows: torch.Tensor, num_logits: Optional[list[int]],
                    packing: Optional[Packing], block: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The hidden states the output layer runs on, and where each output row takes its logits
        (None: they are already [batch, rows]).  Only the wanted rows run: ``num_logits`` of each row
        of ``logits_rows`` ([batch, rows] block indices, on the host when rows are packed or counted:
        the index is built there)."""
        b, k = logits_rows.shape
        if packing is None and (num_logits is None or all(n == k for n in num_logits)):  # a decoding step
            idx = to_device(logits_rows, hidden.device)
            return torch.gather(hidden, 1, idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])), None
        # numpy index tables: a few calls a forward, not a few tensor ops a row (hundreds a step)
        counts = np.maximum(np.asarray(num_logits if num_logits is not None else [k] * b, dtype=np.int64), 1)
        lengths = np.asarray(packing.lengths if packing is not None else [block] * b, dtype=np.int64)
        starts = np.cumsum(lengths) - lengths  # each row's first hidden row, flattened (or packed)
        cols = np.arange(k, dtype=np.int64)[None, :]
        wanted = (starts[:, None] + logits_rows.numpy())[cols < counts[:, None]]  # row by row
        at = (np.cumsum(counts) - counts)[:, None] + np.minimum(cols, counts[:, None] - 1)
        source = hidden.reshape(-1, hidden.shape[-1])
        wanted, at = to_device_many([torch.from_numpy(wanted), torch.from_numpy(at)], hidden.device)
        return source[wanted].unsqueeze(0), at

    def hidden_states(self, input_ids: torch.Tensor, ctx: ForwardContext,
                      layer_step: Optional[Callable] = None) -> torch.Tensor:
        """The decoder stack: [batch, block] token ids -> final-norm hidden states [batch, block, hidden],
        writing the block's keys and values into the cache.  Device work only (no host reads), so it
        compiles as one graph (``torch.compile(fullgraph=True)``: tests/engine/models/test_compile.py).
        Eager on the CPU with weights in GGUF blocks, the layers run as one operator call
        (:class:`FusedStack`), bitwise the same.  ``layer_step(layer, x, delta, ctx)``, if given, runs
        each layer instead, with that layer's pools in ``ctx`` (:meth:`ForwardContext.for_layer`): a
        compiled layer (``engine.graphs.compiled_layer``)."""
        x, delta = self.embed_tokens(input_ids), None
        stack = self._fused_stack(ctx) if layer_step is None else None
        if stack is not None:
            x, delta = stack(x, ctx)
        elif layer_step is not None:
            # the first layer adds a zero residual (x + 0 is x, bitwise): it then runs the same graph as the rest
            delta = torch.zeros_like(x)
            for i, layer in enumerate(self.layers):
                x, delta = layer_step(layer, x, delta, ctx.for_layer(i))
        else:
            for i, layer in enumerate(self.layers):
                x, delta = layer(x, delta, i, ctx)
        return self.norm(x) if delta is None else self.norm.add(x, delta)[1]

    def _fused_stack(self, ctx: ForwardContext) -> Optional["FusedStack"]:
        """The layers as one operator call, where it applies to this model and this forward; built at
        the first forward and again whenever a layer's modules or weights were replaced since."""
        if not ctx.paged or torch.compiler.is_compiling() or not fused_layers_enabled():
            return None
        key = FusedStack.key(self)
        if self._fused is None or self._fused[0] != key:
            self._fused = (key, FusedStack.build(self))
        stack = self._fused[1]
        return stack if stack is not None and stack.applies(ctx) else None

    def _check_positions(self, cache: KVCache, positions: torch.Tensor) -> None:
        """Builds the rotary tables for the cache's length if needed; position ids (host) must be in them."""
        if self.rope is None or cache.max_len > self.rope.max_pos:
            self.rope = RotaryTables(self.cfg, cache.max_len, self.dtype, self.device)
        if int(positions.max()) >= self.rope.max_pos or int(positions.min()) < 0:
            raise ValueError(f"position ids must be in [0, {self.rope.max_pos})")

    def _context(self, cache: KVCache, slots: list[int], positions: torch.Tensor,
                 block_mask: Optional[torch.Tensor], packing: Optional[Packing] = None,
                 shift: Optional[torch.Tensor] = None) -> ForwardContext:
        self._check_positions(cache, positions)
        b, t = positions.shape
        slot_t = torch.tensor(slots, dtype=torch.long)
        lens = cache.lens[slot_t]
        start = lens + cache.pending[slot_t]  # [batch] where each block is written
        kv_len = int(start.max()) + t  # host tensors: no device sync
        dev = self.device
        # only the small per-block mask [batch, block, width] and two [batch] vectors cross to the device
        host = [positions, lens, start] + ([] if block_mask is None else [block_mask])
        positions, lens_d, start_d, *mask_d = to_device_many(host, dev)
        if shift is not None:
            positions = positions + shift[:, None]
        at = cache.addresses(slots, start, t, kv_len, dev, start_on_device=start_d)
        if packing is not None:  # the layers write and rotate the real rows only
            positions = packing.pack(positions)
            at = Addresses(packing.pack(at.write), at.read, at.view_start, at.write_start)
        cos, sin = self.rope.lookup(positions)
        return ForwardContext(cache=cache, at=at, kv_len=kv_len,
                              cos=cos, sin=sin, lens=lens_d, start=start_d,
                              block_mask=mask_d[0] if mask_d else None,
                              paged=cpu_kernels.paged_attention_applies(cache.k), packing=packing)


def build_mask(lens: torch.Tensor, start: torch.Tensor, block: int, kv_len: int,
               block_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Attention mask over ``kv_len`` cache positions for a block written at ``start``.

    lens, start: [batch]; block_mask: [batch, block, width] -> [batch, 1, block, kv_len] or None, on
    the device of ``lens`` (every input on one device).
    Committed context is always visible; without ``block_mask`` a query at ``start + i`` sees every
    position ``<= start + i`` (causal).  Each query always sees itself, so padded rows stay finite.
    """
    b, dev = lens.shape[0], lens.device
    pos = torch.arange(kv_len, device=dev)  # [kv_len]
    qpos = start[:, None] + torch.arange(block, device=dev)  # [batch, block]
    if block_mask is None:
        if b == 1 and block == 1:
            return None  # one query that sees the whole (exactly sized) key range
        return (pos[None, None, :] <= qpos[:, :, None]).unsqueeze(1)
    width = block_mask.shape[-1]
    rel = pos[None, :] - lens[:, None]  # [batch, kv_len] column of block_mask
    inside = (rel >= 0) & (rel < width)
    cols = rel.clamp(0, width - 1)[:, None, :].expand(b, block, kv_len)
    visible = torch.gather(block_mask.to(torch.bool), 2, cols) & inside[:, None, :]
    visible |= pos[None, None, :] < lens[:, None, None]
    visible |= pos[None, None, :] == qpos[:, :, None]
    return visible.unsqueeze(1)


def _take(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in sd:
        raise KeyError(f"checkpoint has no tensor {name!r}")
    return sd.pop(name)


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str = "cpu") -> LlamaModel:
    """Builds the model of ``cfg``'s architecture (a :class:`LlamaModel` or a subclass: ``cfg.model_class``)
    from a Hugging Face state dict, fusing q/k/v and gate/up.

    Consumes ``state_dict`` (tensors are popped as they are placed) to keep peak memory low.
    """
    sd = dict(state_dict)
    with torch.device("meta"):
        model = cfg.model_class()(cfg)
    own: dict[str, torch.Tensor] = {}
    own["embed_tokens.weight"] = _take(sd, "model.embed_tokens.weight")
    own["norm.weight"] = _take(sd, "model.norm.weight")
    if not cfg.tie_word_embeddings:
        own["lm_head.weight"] = _take(sd, "lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        own[f"layers.{i}.qkv_proj.weight"] = torch.cat(
            [_take(sd, a + f"{n}_proj.weight") for n in "qkv"])
        if cfg.attention_bias:
            own[f"layers.{i}.qkv_proj.bias"] = torch.cat([_take(sd, a + f"{n}_proj.bias") for n in "qkv"])
        own[f"layers.{i}.o_proj.weight"] = _take(sd, a + "o_proj.weight")
        own[f"layers.{i}.gate_up_proj.weight"] = torch.cat(
            [_take(sd, m + "gate_proj.weight"), _take(sd, m + "up_proj.weight")])
        own[f"layers.{i}.down_proj.weight"] = _take(sd, m + "down_proj.weight")
        own[f"layers.{i}.input_layernorm.weight"] = _take(sd, p + "input_layernorm.weight")
        own[f"layers.{i}.post_attention_layernorm.weight"] = _take(sd, p + "post_attention_layernorm.weight")
        for ours, (hf_name, _) in model.layer_extras.items():
            own[f"layers.{i}.{ours}"] = _take(sd, p + hf_name)
    sd.pop("lm_head.weight", None)  # tied checkpoints may still carry a copy
    leftovers = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
    if leftovers:
        raise ValueError(f"checkpoint has tensors our runtime does not use: {leftovers[:5]}")
    own = {k: v.to(device=device, dtype=dtype) for k, v in own.items()}
    model.load_state_dict(own, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:5]}")
    return model.eval()
