"""Architecture description of a Llama-family model, read from a Hugging Face config.

One dataclass covers Llama 2/3 (incl. Llama-3 RoPE scaling), Qwen2 (qkv biases, tied embeddings),
Mistral, SmolLM (a Llama) and Qwen3 (per-head q/k norms).  Anything else is rejected with a message
naming what is supported.

:data:`ARCHITECTURES` is the registry of model classes (``engine.models.model.Model``) by the
checkpoint's ``model_type``; the loaders build what it names.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Mapping

#: model_type -> "module:class" implementing it (imported by name when a checkpoint asks for it)
ARCHITECTURES = {
    "llama": "engine.models.llama:LlamaModel",
    "qwen2": "engine.models.llama:LlamaModel",
    "mistral": "engine.models.llama:LlamaModel",
    "qwen3": "engine.models.qwen3:Qwen3Model",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented by our runtime."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2: always)
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    # Sliding-window attention (Mistral) equals full attention for contexts inside the window;
    # the engine caps its context length at the window instead of implementing the band mask.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def model_class(self) -> type:
        """The class that implements this architecture (:data:`ARCHITECTURES`)."""
        module, name = ARCHITECTURES[self.model_type].split(":")
        return getattr(importlib.import_module(module), name)

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """Builds from a ``transformers`` config object or its ``to_dict()``."""
        d: Mapping[str, Any] = hf if isinstance(hf, Mapping) else hf.to_dict()
        model_type = d.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported RoPE scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            rope_scaling=rope,
            sliding_window=(d.get("sliding_window") or None) if d.get("use_sliding_window", True) else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )
