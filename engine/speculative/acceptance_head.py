"""Acceptance head: predicts, for a drafted node, ``P(accepted | parent reached)`` from draft-side
features (2409.10644 decision models; SpecDec++ acceptance prediction head).

Input: the cheap features of ``engine.speculative.features`` (standardised with statistics stored in the
head), optionally concatenated with a learned projection of the draft's hidden state at the
parent.  Body: logistic regression (``units == 0``) or a one-hidden-layer MLP.  The head is trained
with class-weighted BCE (rejections weighted up), which ranks well but biases probabilities low, so
a Platt recalibration (``scale * logit + shift``, fitted unweighted) is part of the head.

One file per model pair and temperature: safetensors weights plus JSON metadata (``HeadMeta``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from engine.speculative.features import CHEAP_FEATURES, NodeFeatures

HEAD_VERSION = 1
_META_KEY = "mcsd_acceptance_head"


@dataclass
class HeadMeta:
    target: str  # model ids of the pair the head was trained on
    draft: str
    temperature: float  # 0 = greedy
    hidden_size: int = 0  # the draft's hidden size when hidden features are used, else 0
    proj_dim: int = 32  # hidden projection width (unused when hidden_size == 0)
    units: int = 64  # MLP width; 0 = logistic regression
    features: list[str] = field(default_factory=lambda: list(CHEAP_FEATURES))
    tree: list[int] = field(default_factory=list)  # the tree the training data was drafted with
    metrics: dict = field(default_factory=dict)  # held-out evaluation (AUC, calibration by depth)
    version: int = HEAD_VERSION


class AcceptanceHead(nn.Module):
    def __init__(self, meta: HeadMeta) -> None:
        super().__init__()
        self.meta = meta
        n = len(CHEAP_FEATURES)
        self.register_buffer("feat_mean", torch.zeros(n))
        self.register_buffer("feat_std", torch.ones(n))
        self.register_buffer("platt", torch.tensor([1.0, 0.0]))  # scale, shift of the logit
        width = n
        if meta.hidden_size:
            self.proj = nn.Sequential(nn.LayerNorm(meta.hidden_size), nn.Linear(meta.hidden_size, meta.proj_dim))
            width += meta.proj_dim
        else:
            self.proj = None
        if meta.units:
            self.body = nn.Sequential(nn.Linear(width, meta.units), nn.SiLU(), nn.Linear(meta.units, 1))
        else:
            self.body = nn.Linear(width, 1)

    @property
    def uses_hidden(self) -> bool:
        return self.proj is not None

    def raw_logits(self, cheap: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """cheap: [n, F] unnormalised cheap features; hidden: [n, H] or None -> [n] logits
        (before recalibration)."""
        x = (cheap - self.feat_mean) / self.feat_std
        if self.proj is not None:
            if hidden is None:
                raise ValueError("this acceptance head needs the draft's hidden states")
            x = torch.cat([x, self.proj(hidden.to(x.dtype))], dim=1)
        return self.body(x).squeeze(-1)

    def forward(self, cheap: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Recalibrated acceptance logits, [n]."""
        return self.platt[0] * self.raw_logits(cheap, hidden) + self.platt[1]

    @torch.inference_mode()
    def predict(self, feats: NodeFeatures) -> torch.Tensor:
        """[n] predicted ``P(accepted | parent reached)``.  Depths and ranks beyond the training tree
        read as its deepest level and last rank: their one-hot columns were constant in training (their
        standardised values would be huge, and the prediction meaningless)."""
        if self.meta.tree:
            feats = replace(feats, depth=feats.depth.clamp(max=len(self.meta.tree)),
                            rank=feats.rank.clamp(max=max(self.meta.tree) - 1))
        return torch.sigmoid(self(feats.cheap_matrix(), feats.hidden if self.uses_hidden else None))

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path), metadata={_META_KEY: json.dumps(asdict(self.meta))})

    @classmethod
    def load(cls, path: str | Path) -> "AcceptanceHead":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"acceptance head {path} does not exist")
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(_META_KEY)
            if raw is None:
                raise ValueError(f"{path} is not an acceptance head (no {_META_KEY} metadata)")
            state = {k: f.get_tensor(k) for k in f.keys()}
        meta = HeadMeta(**json.loads(raw))
        if meta.version != HEAD_VERSION:
            raise ValueError(f"{path}: acceptance head version {meta.version}, this engine reads {HEAD_VERSION}")
        if meta.features != list(CHEAP_FEATURES):
            raise ValueError(f"{path}: the head was trained on features {meta.features}, this engine computes "
                             f"{list(CHEAP_FEATURES)}; retrain it with tools.train_head")
        head = cls(meta)
        head.load_state_dict(state)
        return head.eval()
