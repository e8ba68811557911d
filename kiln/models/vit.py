"""A small Vision Transformer (pre-norm), sized by default for 8x8 single-channel digits.

Shapes: B batch, C channels, H/W image height/width, P patch size,
N tokens (patches, plus one if pool == "cls"), D model width, Hd heads, Dh head width.
Between the embedding and the head the tokens are (B, N, D) with ``batch_first=True`` (the
default) and (N, B, D) with ``batch_first=False`` ("batch-second", the layout of
``nn.MultiheadAttention`` without ``batch_first`` and of Meta's faster pycls ViT); both layouts
compute the same function on the same weights (tests/test_models.py), so a checkpoint of one
loads into the other.

    >>> model = ViT(ViTConfig(depth=2))
    >>> model(torch.randn(3, 1, 8, 8)).shape
    torch.Size([3, 10])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.models._registry import register_model

__all__ = ["ViTConfig", "ViT", "Block", "Attention", "MLP"]

_POOLS = ("mean", "cls")


@dataclass
class ViTConfig:
    image_size: int = 8  # height == width of the (square) input image, pixels
    patch_size: int = 2  # side of each square patch; must divide image_size
    in_channels: int = 1  # input channels (1 for grayscale digits)
    num_classes: int = 10  # size of the logits vector
    dim: int = 64  # model width D
    depth: int = 4  # number of transformer blocks (len(model.blocks))
    heads: int = 4  # attention heads; must divide dim
    mlp_ratio: float = 4.0  # MLP hidden width = round(mlp_ratio * dim)
    dropout: float = 0.0  # dropout on attention weights, block outputs and embeddings
    pool: str = "mean"  # "mean": average the patch tokens; "cls": read a learned class token
    batch_first: bool = True  # tokens (B, N, D) between embedding and head; False: (N, B, D), same function

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "in_channels", "num_classes", "dim", "depth", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ViTConfig.{name}={value!r}: must be a positive integer")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"ViTConfig.patch_size={self.patch_size} does not divide image_size={self.image_size}; "
                f"choose a patch_size that divides {self.image_size}"
            )
        if self.dim % self.heads:
            raise ValueError(
                f"ViTConfig.heads={self.heads} does not divide dim={self.dim}; "
                f"choose heads that divide {self.dim} or a dim that is a multiple of {self.heads}"
            )
        if self.pool not in _POOLS:
            raise ValueError(f"ViTConfig.pool={self.pool!r} is not allowed; use one of {', '.join(map(repr, _POOLS))}")
        if not isinstance(self.batch_first, bool):
            raise ValueError(f"ViTConfig.batch_first={self.batch_first!r}: must be true or false")
        if not self.mlp_ratio > 0:
            raise ValueError(f"ViTConfig.mlp_ratio={self.mlp_ratio!r}: must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ViTConfig.dropout={self.dropout!r}: must be in [0, 1)")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def example_input(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Random images shaped ``(batch_size, C, H, W)``."""
        return torch.randn(batch_size, self.in_channels, self.image_size, self.image_size, generator=generator)


class Attention(nn.Module):
    """Multi-head self-attention with one fused qkv projection, over tokens (B, N, D), or
    (N, B, D) with ``batch_first=False`` (the same parameters and the same function)."""

    def __init__(self, dim: int, heads: int, dropout: float, batch_first: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.batch_first = batch_first
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_dropout = dropout
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.scaled_dot_product_attention applies dropout whenever dropout_p > 0, even in eval.
        p = self.attn_dropout if self.training else 0.0
        if self.batch_first:
            B, N, D = x.shape
            qkv = self.qkv(x).view(B, N, 3, self.heads, D // self.heads)  # (B, N, 3, Hd, Dh)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, Hd, N, Dh), views
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # (B, Hd, N, Dh)
            y = y.transpose(1, 2).reshape(B, N, D)  # (B, N, D)
        else:
            N, B, D = x.shape
            qkv = self.qkv(x).view(N, B, 3, self.heads, D // self.heads)  # (N, B, 3, Hd, Dh)
            q, k, v = qkv.permute(2, 1, 3, 0, 4).unbind(0)  # each (B, Hd, N, Dh), views
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # (B, Hd, N, Dh)
            y = y.permute(2, 0, 1, 3).reshape(N, B, D)  # (N, B, D)
        return self.proj_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(F.gelu(self.fc1(x))))  # same layout as x


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``. Maps (B, N, D) -> (B, N, D)
    ((N, B, D) -> (N, B, D) with ``cfg.batch_first=False``)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.heads, cfg.dropout, batch_first=cfg.batch_first)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg.dim, round(cfg.mlp_ratio * cfg.dim), cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


@register_model("vit", ViTConfig)
class ViT(nn.Module):
    """Vision Transformer: patch embedding -> ``blocks`` -> final norm -> pooled linear head.

    ``forward`` is ``forward_head(blocks(forward_embed(x)))``; activation checkpointing wraps
    each entry of ``self.blocks`` and pipeline splitting cuts the list, so the blocks take and
    return one (B, N, D) tensor each ((N, B, D) with ``cfg.batch_first=False``). The parameters
    are the same in both layouts (``pos_embed`` and ``cls_token`` are stored (1, N, D) and
    (1, 1, D) either way).
    """

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # A conv with stride == kernel == patch is a per-patch linear map of the flattened patch.
        self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim)) if cfg.pool == "cls" else None
        num_tokens = cfg.num_patches + (1 if cfg.pool == "cls" else 0)
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, cfg.dim))  # (1, N, D)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward_embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> tokens (B, N, D), or (N, B, D) with ``cfg.batch_first=False``."""
        x = self.patch_embed(x)  # (B, D, H/P, W/P)
        x = x.flatten(2)  # (B, D, H*W/P^2), patches in row-major order
        if self.cfg.batch_first:
            x = x.transpose(1, 2)  # (B, H*W/P^2, D)
            if self.cls_token is not None:
                x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, N, D)
            return self.embed_dropout(x + self.pos_embed)
        x = x.permute(2, 0, 1)  # (H*W/P^2, B, D)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(-1, x.shape[1], -1), x], dim=0)  # (N, B, D)
        return self.embed_dropout(x + self.pos_embed.transpose(0, 1))  # + (N, 1, D)

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, N, D) (or (N, B, D), ``cfg.batch_first=False``) -> logits (B, num_classes)."""
        x = self.norm(x)
        tokens = 1 if self.cfg.batch_first else 0  # the token dimension
        x = x.select(tokens, 0) if self.cls_token is not None else x.mean(dim=tokens)  # (B, D)
        return self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_embed(x)  # (B, N, D)
        for block in self.blocks:
            x = block(x)
        return self.forward_head(x)  # (B, num_classes)
