"""What the engine needs of a model: the :class:`Model` protocol.

The runner, the batcher, the proposer, the cost model and the loader talk to a model only through
this interface: a forward over a block batch against a paged KV cache, the cache's layout, the
vocabulary, the device and the dtype.  An architecture is one module with a class that implements
it (``engine.models.llama.LlamaModel`` for the Llama family, ``engine.models.qwen3.Qwen3Model``)
and one entry in ``engine.models.config.ARCHITECTURES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterator, Optional, Protocol, runtime_checkable

import torch

from engine.kv_cache import KVCache
from engine.models.config import ModelConfig
from engine.models.vocab import OutputVocab


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [batch, rows, vocab] float32, rows = selected block positions
    hidden: torch.Tensor  # [batch, block, hidden] final-norm hidden states of every block token


@runtime_checkable
class Model(Protocol):
    """A decoder the engine can run (an ``nn.Module``: it is called, moved and inspected as one)."""

    cfg: ModelConfig  # vocabulary size, layers, heads, head size, context length, special tokens
    #: parameters a layer has beyond the Llama layer's, by their name in the layer: (the Hugging Face
    #: name under ``model.layers.N.``, the GGUF name under ``blk.N.``); the loaders read them by these
    layer_extras: ClassVar[dict[str, tuple[str, str]]]

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (weights may be packed in other formats)."""

    @property
    def device(self) -> torch.device: ...

    def new_cache(self, num_slots: int, max_len: int, block_size: int = 4,
                  num_blocks: Optional[int] = None) -> KVCache:
        """A paged KV cache laid out for this model: ``num_slots`` sequences of at most ``max_len``
        positions over ``num_blocks`` blocks of ``block_size`` positions (default: room for all)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: list[int],
                 block_mask: Optional[torch.Tensor] = None, num_new: Optional[list[int]] = None,
                 logits_rows: Optional[torch.Tensor] = None, num_logits: Optional[list[int]] = None,
                 vocab: Optional[OutputVocab] = None,
                 position_shift: Optional[torch.Tensor] = None) -> ForwardOutput:
        """One forward over a block batch: ``input_ids`` and ``positions`` [batch, block] (row ``b``
        has ``num_new[b]`` real tokens) written to ``slots``' pending cache entries, under
        ``block_mask`` [batch, block, width] over the pending entries and the block (None: causal);
        logits for ``logits_rows`` [batch, rows] (None: every row), through ``vocab`` if given;
        ``position_shift`` [batch] (on the device) added to each row's positions there."""

    def modules(self) -> Iterator[torch.nn.Module]: ...
