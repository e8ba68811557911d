"""BERT: a bidirectional encoder trained as a masked language model.

Shapes: B batch, T sequence, C model width, V vocabulary.

Pre-norm blocks (as GPT, without the causal mask) rather than the original post-norm: they
train stably without the original's warm-up tuning, and a final LayerNorm in the head plays
the role of the last block's. The MLM head is BERT's: dense, GELU, LayerNorm, projection to
the vocabulary. The defaults are a tiny model; ``configs/bert_large.py`` has the published
size (24 layers, width 1024, 16 heads, vocabulary 30522, 512 positions, about 335 M
parameters with tied embeddings).

    >>> model = BERT(BERTConfig(depth=2))
    >>> model(torch.zeros(3, 16, dtype=torch.long)).shape
    torch.Size([3, 16, 256])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.models._registry import register_model
from kiln.models.transformer import Block, Embedding, check_positive, init_weights

__all__ = ["BERTConfig", "BERT", "MLMHead"]


@dataclass
class BERTConfig:
    vocab_size: int = 256  # V; 256 = kiln's byte-level text corpus, whose id 255 is [MASK]
    seq_len: int = 64  # positions the model knows (inputs may be shorter)
    dim: int = 64  # model width C
    depth: int = 4  # transformer blocks (len(model.blocks))
    heads: int = 4  # attention heads; must divide dim
    mlp_ratio: float = 4.0  # feed-forward width = round(mlp_ratio * dim)
    dropout: float = 0.0  # on embeddings, attention probabilities and block outputs
    tie_embeddings: bool = False  # True: the MLM output projection is the token embedding (BERT)

    def __post_init__(self) -> None:
        check_positive(self, "vocab_size", "seq_len", "dim", "depth", "heads")
        if self.dim % self.heads:
            raise ValueError(f"BERTConfig.heads={self.heads} does not divide dim={self.dim}; "
                             f"choose heads that divide {self.dim}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"BERTConfig.mlp_ratio={self.mlp_ratio!r}: must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"BERTConfig.dropout={self.dropout!r}: must be in [0, 1)")

    @property
    def num_classes(self) -> int:
        """Logits per position (the vocabulary), the name the trainer and tests read."""
        return self.vocab_size

    def example_input(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Random token ids shaped ``(batch_size, seq_len)``."""
        return torch.randint(self.vocab_size, (batch_size, self.seq_len), generator=generator)


class MLMHead(nn.Module):
    """Final LayerNorm, dense + GELU + LayerNorm (BERT's transform), projection to the vocabulary."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.dense = nn.Linear(dim, dim)
        self.transform_norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, V)
        return self.out(self.transform_norm(F.gelu(self.dense(self.norm(x)))))


@register_model("bert", BERTConfig)
class BERT(nn.Module):
    """Masked LM: ``head(blocks(embed(ids)))``, ids (B, T) -> logits (B, T, V) at every position
    (the ``mlm`` task scores only the masked ones)."""

    def __init__(self, cfg: BERTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.seq_len, cfg.dim, cfg.dropout, norm=True)
        ffn = round(cfg.mlp_ratio * cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads, ffn, cfg.dropout, causal=False) for _ in range(cfg.depth))
        self.head = MLMHead(cfg.dim, cfg.vocab_size)
        init_weights(self, cfg.depth)
        if cfg.tie_embeddings:
            self.head.out.weight = self.embed.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # (B, T, V)
