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
from kiln.models.transformer import Block, Embedding, check_positive, init_weights

__all__ = ["GPTConfig", "GPT", "LMHead"]


@dataclass
class GPTConfig:
    vocab_size: int = 256  # V; 256 = the byte-level tokens of kiln's bundled text corpus
    seq_len: int = 64  # positions the model knows (inputs may be shorter)
    dim: int = 64  # model width C
    depth: int = 4  # transformer blocks (len(model.blocks))
    heads: int = 4  # attention heads; must divide dim
    mlp_ratio: float = 4.0  # feed-forward width = round(mlp_ratio * dim)
    dropout: float = 0.0  # on embeddings, attention probabilities and block outputs
    tie_embeddings: bool = False  # True: the output projection is the token embedding (GPT-2)

    def __post_init__(self) -> None:
        check_positive(self, "vocab_size", "seq_len", "dim", "depth", "heads")
        if self.dim % self.heads:
            raise ValueError(f"GPTConfig.heads={self.heads} does not divide dim={self.dim}; "
                             f"choose heads that divide {self.dim}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"GPTConfig.mlp_ratio={self.mlp_ratio!r}: must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r}: must be in [0, 1)")

    @property
    def num_classes(self) -> int:
        """Logits per position (the vocabulary), the name the trainer and tests read."""
        return self.vocab_size

    def example_input(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Random token ids shaped ``(batch_size, seq_len)``."""
        return torch.randint(self.vocab_size, (batch_size, self.seq_len), generator=generator)


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
