"""Rotary position embeddings (RoPE) with the scalings Llama-family checkpoints use.

The cos/sin tables are built once for every position the cache can hold and indexed per step by
arbitrary position ids (tree nodes share the position of their depth).
"""

from __future__ import annotations

import math

import torch

from engine.models.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies ``theta^(-2i/d)``, rescaled as the checkpoint asks.  # [head_dim/2]"""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    kind, s = cfg.rope_type, cfg.rope_scaling
    if kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "llama3":
        inv = _llama3_scale(inv, s)
    return inv.float()


def _llama3_scale(inv: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by ``factor``, short ones kept, and the band in
    between interpolated smoothly between the two."""
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, mid, scaled)


class RotaryTables:
    """cos/sin for positions ``[0, max_pos)``, in the model dtype, duplicated over both halves
    (the "rotate half" layout Hugging Face checkpoints use)."""

    def __init__(self, cfg: ModelConfig, max_pos: int, dtype: torch.dtype, device: torch.device | str) -> None:
        inv = inv_frequencies(cfg)
        angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)  # [max_pos, head_dim/2]
        emb = torch.cat([angles, angles], dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)  # [max_pos, head_dim]
        self.sin = emb.sin().to(dtype=dtype, device=device)
        self.max_pos = max_pos

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [batch, block] -> cos, sin: [batch, block, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)

