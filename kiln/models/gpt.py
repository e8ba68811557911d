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

from kiln.models._lm_plan import lm_plan
from kiln.models._registry import register_model
from kiln.models.transformer import LanguageModel, LMConfig

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


# How GPT splits over tensor- and pipeline-parallel ranks (kiln/models/_lm_plan.py); under
# sequence parallelism the head's norm runs on sequence shards. The logits are head.out's output
# as it is: a chunked loss may compute them itself (train.chunked_lm_loss).
PLAN = lm_plan(head={"head.norm": "sequence"}, output="head.out")


@register_model("gpt", GPTConfig, plan=PLAN)
class GPT(LanguageModel):
    """Causal LM: ``head(blocks(embed(ids)))``, ids (B, T) -> logits (B, T, V).

    Position t's logits predict token t + 1 (the ``lm`` task's targets are the inputs shifted
    by one).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg, causal=True, embed_norm=False, head=LMHead(cfg.dim, cfg.vocab_size))
