"""Tiny random Llama-family models made inside the tests (no downloads)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engine.models.config import ModelConfig
from engine.models.llama import LlamaModel, build_model

VOCAB = 101


def tiny_hf(kind: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 2):
    """A random HF reference model: ``llama`` (Llama-3 RoPE scaling, untied) or ``qwen2``
    (qkv biases, tied embeddings)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6)
    if kind == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=5000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=10000.0)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random init leaves biases at zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        raise ValueError(kind)
    return model.eval()


def ours_from_hf(hf, dtype=torch.float32) -> LlamaModel:
    return build_model(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """Reference logits for a whole sequence, [len, vocab]."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()
