"""GPT: a decoder-only causal language model (GPT-2 layout, pre-norm, learned positions).

Shapes: B batch, T sequence, C model width, V vocabulary.

The defaults are a tiny model for tests and CPU examples; the published sizes are configs
(``configs/gpt2_medium.py``: 24 layers, width 1024, 16 heads, vocabulary 50257, 1024 positions,
355 M parameters with tied embeddings).

    >>> model = GPT(GPTConfig(depth=2))
    >>> model(torch.zeros(3, 16, dtype=torch.long)).shape
    torch.Size([3, 16, 256])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kiln.models._registry import register_model
from kiln.models.transformer import Block, Embedding, LMConfig, init_weights

__all__ = ["GPTConfig", "GPT", "LMHead"]


@dataclass
class GPTConfig(LMConfig):
    """GPT's options (see :class:`~kiln.models.transformer.LMConfig`)."""


class LMHead(nn.Module):
    """Final LayerNorm, then the projection to the vocabulary: (B, T, C) -> (B, T, V)."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


@register_model("gpt", GPTConfig)
class GPT(nn.Module):
    """Causal LM: ``head(blocks(embed(ids)))``, ids (B, T) -> logits (B, T, V).

    Position t's logits predict token t + 1 (the ``lm`` task's targets are the inputs shifted
    by one).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.seq_len, cfg.dim, cfg.dropout)
        ffn = round(cfg.mlp_ratio * cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads, ffn, cfg.dropout, causal=True) for _ in range(cfg.depth))
        self.head = LMHead(cfg.dim, cfg.vocab_size)
        init_weights(self, cfg.depth)
        if cfg.tie_embeddings:
            self.head.out.weight = self.embed.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # (B, T, V)
