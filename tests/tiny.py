"""Tiny random Llama-family models made inside the tests (no downloads)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from engine.models.config import ModelConfig
from engine.models.llama import build_model
from engine.models.model import Model

VOCAB = 101


def tiny_hf(kind: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 2, hidden: int = 64,
            intermediate: int = 96):
    """A random HF reference model: ``llama`` (Llama-3 RoPE scaling, untied), ``qwen2`` (qkv biases,
    tied embeddings) or ``qwen3`` (per-head q/k norms, a head size other than hidden / heads)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
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
    elif kind == "qwen3":
        cfg = Qwen3Config(**common, head_dim=hidden // 2, tie_word_embeddings=True, rope_theta=10000.0,
                          attention_bias=False, use_sliding_window=False)
        model = Qwen3ForCausalLM(cfg)
        with torch.no_grad():  # random init leaves the norms at one: make them matter
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.5)
                layer.self_attn.k_norm.weight.normal_(1, 0.5)
    else:
        raise ValueError(kind)
    return model.eval()


def ours_from_hf(hf, dtype=torch.float32, device: str = "cpu") -> Model:
    return build_model(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype, device)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """Reference logits for a whole sequence, [len, vocab]."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def tiny_tokenizer(vocab: int = VOCAB):
    """A word-level tokenizer over ``vocab`` tokens: id 0 is ``</s>`` (EOS), id i is ``w{i}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"</s>": 0, **{f"w{i}": i for i in range(1, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="w1")


def tiny_loaded(kind: str = "llama", seed: int = 0, layers: int = 2, dtype: torch.dtype = torch.float32,
                device: str = "cpu", **dims):
    """A tiny model wrapped as the loader returns it (our runtime + config + tokenizer), in ``dtype``
    on ``device``; ``dims``: ``hidden`` and ``intermediate`` sizes other than 64 and 96."""
    from engine.models.loader import LoadedModel

    hf = tiny_hf(kind, seed=seed, layers=layers, **dims)
    cfg = ModelConfig.from_hf(hf.config)
    return LoadedModel(ours_from_hf(hf, dtype, device), cfg, tiny_tokenizer(cfg.vocab_size), f"tiny-{kind}-{seed}",
                       path=None)


def save_tiny_pair(root, tokenizer) -> None:
    """Writes ``root/target`` and ``root/draft``: tiny Qwen2 HF directories (seeds 0 and 1) sharing
    ``tokenizer`` (its vocabulary size and EOS)."""
    for name, seed in (("target", 0), ("draft", 1)):
        hf = tiny_hf("qwen2", seed=seed, vocab=len(tokenizer))
        hf.config.eos_token_id = tokenizer.eos_token_id
        hf.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
