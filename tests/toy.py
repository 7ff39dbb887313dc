"""Table-driven toy models that run through the engine's real code path.

``p(next | context)`` depends on the current token and the one before it:
``logits[t] = log table[x_t, x_{t-1}]``.  The toy finds ``x_{t-1}`` the way a transformer would:
its key cache stores a one-hot of each entry's *position id* and its values a one-hot of the
token; the query at position ``t`` looks for position ``t-1`` through the attention mask.  So a
wrong mask, a wrong position id or a wrong cache gather changes the distribution.  It also checks
that it sees exactly ``t + 1`` context entries (as a real model's attention would notice an extra
cached token) and otherwise predicts from a scrambled table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.llama import LlamaModel, RMSNorm
from engine.models.model import ForwardOutput

SCALE = 60.0


def random_table(vocab: int, seed: int, concentration: float = 0.6) -> torch.Tensor:
    """[vocab(cur), vocab+1(prev; index vocab = none), vocab(next)] probabilities."""
    g = torch.Generator().manual_seed(seed)
    gamma = torch.distributions.Gamma(torch.full((vocab,), concentration), torch.ones(vocab))
    torch.manual_seed(seed)
    t = gamma.sample((vocab, vocab + 1))
    del g
    return t / t.sum(-1, keepdim=True)


class ToyModel(LlamaModel):
    def __init__(self, table: torch.Tensor, max_len: int = 64) -> None:
        vocab = table.shape[0]
        cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=4, intermediate_size=4, num_layers=1,
                          num_heads=1, num_kv_heads=1, head_dim=max(max_len, vocab + 1), rms_norm_eps=1e-6,
                          rope_theta=10000.0, max_position_embeddings=max_len, tie_word_embeddings=False,
                          attention_bias=False)
        nn.Module.__init__(self)
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(1, 1)
        self.norm = RMSNorm(1, 1e-6)  # only carries dtype/device for the base class
        self.log_table = table.clamp_min(1e-30).log()  # [cur, prev, next]
        self.scrambled = self.log_table.flip(-1)
        self.rope = None

    @torch.inference_mode()
    def forward(self, input_ids, positions, cache, slots, block_mask=None, num_new=None, logits_rows=None,
                num_logits=None, vocab=None, position_shift=None):  # noqa: ARG002 - num_logits: every row computed
        b, t = input_ids.shape
        if position_shift is not None:
            positions = positions + position_shift.to(positions.device)[:, None]
        counts = num_new if num_new is not None else [t] * b
        cache.reserve(slots, counts)
        ctx = self._context(cache, slots, positions, block_mask)
        hd = self.cfg.head_dim
        k = F.one_hot(positions, hd).float()[:, :, None, :]  # [batch, block, 1, hd]
        v = F.one_hot(input_ids, hd).float()[:, :, None, :]
        keys, values = ctx.store_and_read(0, k, v)  # [batch, 1, kv_len, hd]
        q = SCALE * F.one_hot((positions - 1).clamp(min=0), hd).float()[:, None]  # [batch, 1, block, hd]
        read = F.scaled_dot_product_attention(q, keys, values, attn_mask=ctx.mask)[:, 0]  # [b, block, hd]
        prev = torch.where(positions > 0, read.argmax(-1), self.cfg.vocab_size)
        visible = ctx.mask[:, 0].sum(-1) if ctx.mask is not None else torch.full((b, t), ctx.kv_len)
        consistent = visible == positions + 1  # [batch, block]
        logits = torch.where(consistent[..., None], self.log_table[input_ids, prev], self.scrambled[input_ids, prev])
        cache.advance(slots, counts)
        if logits_rows is not None:
            logits = torch.gather(logits, 1, logits_rows.to(logits.device)[..., None].expand(-1, -1, logits.shape[-1]))
        logits = logits.float() if vocab is None else vocab.restrict(logits)  # a draft's cut output layer
        return ForwardOutput(logits=logits, hidden=torch.zeros(b, t, 1))
