"""Weight-only int8 for the draft model (``EngineConfig.draft_int8``, ``--draft-int8``).

Why.  A draft forward at batch 1 reads every weight once, so on a CPU it costs about its weight
bytes over the memory bandwidth: the 0.5B Qwen draft moves ~1 GB of bf16 per token (~75 ms on the
project's 2-core machine, more than a third of a 1.5B target verification).  Per-output-channel int8
halves the bytes.  Only the draft is quantized: the draft proposes, the target decides, so a
different draft changes how many tokens are accepted but never which tokens come out (the
verification rule is lossless for any draft distribution).  The target is never touched.

How.  Every linear weight ``W [N, K]`` of the decoder layers and the output layer becomes
``q = round(W / s)`` in int8 with ``s = max|W[n, :]| / 127`` per output row, and ``x @ W.T`` becomes
``(x @ q.T) * s`` through torch's weight-only int8 kernel (``aten._weight_int8pack_mm``, the one
gpt-fast uses).  Embeddings and norms stay as they are.  :func:`int8_copy` builds a new model that
shares those with the original, so the bf16 model a caller holds keeps working unchanged.

That kernel is private to torch and only handles ``K % 16 == 0`` (other shapes return garbage or
crash), so each weight is checked once, at quantization, against the dequantized matmul; a weight
whose shape or check fails stays in its original dtype (logged).  It is also a GEMV: past a few rows
it is slower than bf16 (see ``MAX_ROWS``), so each int8 weight keeps its original beside it and
products of more rows (prompt catch-ups, wide tree levels) use the original.  The draft thus holds
1.5x its bf16 bytes; what it reads per drafted token is halved.  CPU only.
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

import torch
import torch.nn as nn

from engine.models import cpu_kernels

log = logging.getLogger(__name__)

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_K_MULTIPLE = 16
_ROWS = 4096  # rows converted at a time
# torch's int8 kernel is a GEMV: a whole 0.5B draft forward of 1 / 4 / 8 / 16 / 64 tokens took 51 / 54 /
# 113 / 214 / 668 ms against bf16's 98 / 90 / 100 / 132 / 305 ms on the project's 2-core machine.
# Tree levels of a few nodes take int8; prompt catch-ups and wide levels take the original weight.
MAX_ROWS = 6


class Int8Weight:
    """``W ~= q * scale[:, None]``: q [N, K] int8, scale [N] in the activations' dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dense: Optional[torch.Tensor] = None) -> None:
        self.q = q
        self.scale = scale
        self.dense = dense  # the original weight, for products of more than MAX_ROWS rows (None: always int8)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Weight":
        n = weight.shape[0]
        q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        scale = torch.empty(n, dtype=torch.float32, device=weight.device)
        for i in range(0, n, _ROWS):  # in row blocks: no fp32 copy of a whole output layer
            w = weight[i:i + _ROWS].detach().to(torch.float32, copy=True)  # never the weight itself (fp32)
            # the scale as the kernel will read it (rounded to the weight's dtype), so q fits that one
            s = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(weight.dtype).float()
            q[i:i + _ROWS] = w.div_(s[:, None]).round_().clamp_(-127, 127)
            scale[i:i + _ROWS] = s
        return cls(q, scale.to(weight.dtype), weight)

    def dequantize(self) -> torch.Tensor:
        return (self.q.float() * self.scale.float()[:, None]).to(self.scale.dtype)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x @ W.T + bias`` for x [..., K] in the scale's dtype -> [..., N]: int8 for up to
        ``MAX_ROWS`` rows, else the original weight."""
        if self.dense is not None and x.numel() > MAX_ROWS * x.shape[-1]:
            return cpu_kernels.linear(x, self.dense, bias)
        return self._int8(x, bias)

    def _int8(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), self.q, self.scale)
        if bias is not None:
            y = y + bias
        return y.view(*lead, self.q.shape[0])

    def works(self) -> bool:
        """Whether torch's kernel computes this weight's product correctly (checked on random rows)."""
        if self.q.shape[1] % _K_MULTIPLE:
            return False
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, self.q.shape[1], generator=gen).to(self.scale.dtype)
        try:
            got = self._int8(x).float()
        except RuntimeError:
            return False
        want = torch.cat([(x.float() @ self.q[i:i + _ROWS].float().T) * self.scale[i:i + _ROWS].float()
                          for i in range(0, self.q.shape[0], _ROWS)], dim=1)
        tol = 2e-2 * float(want.abs().max()) + 1e-3  # the kernel's bf16 rounding, not a quantization error
        return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= tol


class Int8Linear(nn.Module):
    """Stands in for ``nn.Linear`` in :class:`~engine.models.llama.LlamaModel`: ``.weight`` is an
    :class:`Int8Weight`, which ``engine.models.cpu_kernels.linear`` dispatches on."""

    def __init__(self, weight: Int8Weight, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias


def _quantized(module: nn.Linear, name: str, skipped: list[str]) -> nn.Module:
    w = Int8Weight.quantize(module.weight)
    if not w.works():
        skipped.append(f"{name} {tuple(module.weight.shape)}")
        return module
    return Int8Linear(w, module.bias)


def int8_copy(model: nn.Module) -> nn.Module:
    """A copy of a :class:`~engine.models.llama.LlamaModel` whose linear weights are int8 (see the
    module docstring).  It shares embeddings and norms with ``model``, which is left unchanged."""
    if model.embed_tokens.weight.device.type != "cpu":
        raise ValueError("int8 draft weights are implemented for CPU only; leave draft_int8 off on "
                         f"{model.embed_tokens.weight.device.type}")
    skipped: list[str] = []
    new = copy.copy(model)
    new._modules = dict(model._modules)
    layers = []
    for i, layer in enumerate(model.layers):
        lay = copy.copy(layer)
        lay._modules = dict(layer._modules)
        for name in LINEARS:
            setattr(lay, name, _quantized(getattr(layer, name), f"layers.{i}.{name}", skipped))
        layers.append(lay)
    new.layers = nn.ModuleList(layers)
    new.lm_head = _quantized(model.lm_head, "lm_head", skipped)
    if skipped:
        log.warning("int8: %d weights kept in %s (shape or kernel check): %s", len(skipped),
                    model.embed_tokens.weight.dtype, ", ".join(skipped[:4]) + (" ..." if len(skipped) > 4 else ""))
    return new


def is_int8(model: nn.Module) -> bool:
    """Whether any linear of ``model`` runs in int8."""
    return any(isinstance(m, Int8Linear) for m in model.modules())
