"""Pieces shared by the language models (GPT, BERT): embeddings, attention, MLP, block.

Shapes: B batch, T sequence, C model width, F feed-forward width, V vocabulary, H heads,
Dh head width.

Every model built from these pieces is ``head(blocks(embed(ids)))``, three attributes:

- ``embed``: token ids (B, T) -> hidden states (B, T, C);
- ``blocks``: an ``nn.ModuleList`` of :class:`Block`, each (B, T, C) -> (B, T, C);
- ``head``: hidden states (B, T, C) -> logits (B, T, V).

That composition is what lets parallelism be applied from outside without the model knowing:
a pipeline stage replaces the parts it does not own with ``nn.Identity()`` (parameter names
stay those of the whole model, so checkpoints reshard between layouts), and tensor
parallelism shards ``wq/wk/wv/wo`` and ``fc1/fc2``, as the family's plan beside these modules
says (``_lm_plan.py``). The attention reads the number of
heads from the width of its input (``unflatten(-1, (-1, Dh))``), so when tensor parallelism
gives a rank C/tp columns of ``wq``, it computes its H/tp heads without being told.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LMConfig", "LanguageModel", "Embedding", "Attention", "MLP", "Block", "init_weights", "check_positive"]


def check_positive(cfg: object, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(cfg).__name__}.{name}={value!r}: must be a positive integer")


@dataclass
class LMConfig:
    """The options of a transformer language model (GPT, BERT subclass it)."""

    vocab_size: int = 256  # V; 256 = kiln's byte-level text corpus (id 255 is its [MASK])
    seq_len: int = 64  # positions the model knows (inputs may be shorter)
    dim: int = 64  # model width C
    depth: int = 4  # transformer blocks (len(model.blocks))
    heads: int = 4  # attention heads; must divide dim
    mlp_ratio: float = 4.0  # feed-forward width = round(mlp_ratio * dim)
    dropout: float = 0.0  # on embeddings, attention probabilities and block outputs
    tie_embeddings: bool = False  # True: the output projection is the token embedding (GPT-2, BERT)

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_positive(self, "vocab_size", "seq_len", "dim", "depth", "heads")
        if self.dim % self.heads:
            raise ValueError(f"{name}.heads={self.heads} does not divide dim={self.dim}; "
                             f"choose heads that divide {self.dim}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"{name}.mlp_ratio={self.mlp_ratio!r}: must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{name}.dropout={self.dropout!r}: must be in [0, 1)")

    @property
    def num_classes(self) -> int:
        """Logits per position (the vocabulary), the name the trainer and tests read."""
        return self.vocab_size

    def example_input(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Random token ids shaped ``(batch_size, seq_len)``."""
        return torch.randint(self.vocab_size, (batch_size, self.seq_len), generator=generator)


class Embedding(nn.Module):
    """Token plus learned position embeddings, an optional LayerNorm (BERT), then dropout."""

    def __init__(self, vocab_size: int, seq_len: int, dim: int, dropout: float, norm: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.norm = nn.LayerNorm(dim) if norm else nn.Identity()
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C)
        T = ids.shape[-1]
        if T > self.pos.num_embeddings:
            raise ValueError(f"input has {T} tokens but the model was built with seq_len={self.pos.num_embeddings}")
        positions = torch.arange(T, device=ids.device)
        return self.dropout(self.norm(self.tok(ids) + self.pos(positions)))


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k, v and output projections.

    Separate projections (not one fused qkv) so that a column split of each gives every
    tensor-parallel rank whole heads.
    """

    def __init__(self, dim: int, heads: int, dropout: float, causal: bool) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.causal = causal
        self.attn_dropout = dropout
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        # -1, not H: under tensor parallelism this rank's projections hold only H/tp heads.
        q, k, v = (w(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        # F.scaled_dot_product_attention applies dropout whenever dropout_p > 0, even in eval.
        p = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)  # (B, H, T, Dh)
        return self.wo(y.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + drop(attn(norm1(x)))``, then ``x + drop(mlp(norm2(x)))``."""

    def __init__(self, dim: int, heads: int, ffn: int, dropout: float, causal: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout, causal)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, ffn)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        x = x + self.dropout(self.attn(self.norm1(x)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class LanguageModel(nn.Module):
    """``head(blocks(embed(ids)))``, ids (B, T) -> logits (B, T, V): the body GPT and BERT share;
    they choose the attention mask, the embedding norm and the head."""

    def __init__(self, cfg: LMConfig, *, causal: bool, embed_norm: bool, head: nn.Module) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.seq_len, cfg.dim, cfg.dropout, norm=embed_norm)
        ffn = round(cfg.mlp_ratio * cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads, ffn, cfg.dropout, causal) for _ in range(cfg.depth))
        self.head = head
        init_weights(self, cfg.depth)
        if cfg.tie_embeddings:
            self.head.out.weight = self.embed.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # (B, T, V)


@torch.no_grad()
def init_weights(model: nn.Module, depth: int, std: float = 0.02) -> None:
    """GPT-2 initialisation: normal(0, std) weights, zero biases, unit norms, and the projections
    that write into the residual stream (``wo``, ``fc2``) scaled by 1/sqrt(2 * depth)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            scale = (2 * depth) ** -0.5 if name.endswith(("attn.wo", "mlp.fc2")) else 1.0
            nn.init.normal_(m.weight, std=std * scale)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
