"""Qwen3: the Llama layer with an RMSNorm over each query and key head before the rotary.

Everything else (no q/k/v biases, tied embeddings in the small models, a head size of its own:
128 where hidden / heads is 64 in Qwen3-0.6B) is read from the config by ``ModelConfig``.  The CPU's
fused layer operator runs the Llama layer only, so Qwen3 runs layer by layer there.
"""

from __future__ import annotations

import torch

from engine.models.config import ModelConfig
from engine.models.llama import DecoderLayer, LlamaModel, RMSNorm


class Qwen3Layer(DecoderLayer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        q, k = qk.split([self.cfg.num_heads, self.cfg.num_kv_heads], dim=2)
        return torch.cat([self.q_norm(q.contiguous()), self.k_norm(k.contiguous())], dim=2)


class Qwen3Model(LlamaModel):
    layer_class = Qwen3Layer
    layer_extras = {
        "q_norm.weight": ("self_attn.q_norm.weight", "attn_q_norm.weight"),
        "k_norm.weight": ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    }
