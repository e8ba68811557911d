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

from kiln.models._lm_plan import lm_plan
from kiln.models._registry import register_model
from kiln.models.transformer import LanguageModel, LMConfig

__all__ = ["BERTConfig", "BERT", "MLMHead"]


@dataclass
class BERTConfig(LMConfig):
    """BERT's options (see :class:`~kiln.models.transformer.LMConfig`)."""


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


# How BERT splits over tensor- and pipeline-parallel ranks (kiln/models/_lm_plan.py); under
# sequence parallelism the head's position-wise layers run on sequence shards.
PLAN = lm_plan(head={"head.norm": "sequence", "head.dense": "sequence", "head.transform_norm": "sequence"})


@register_model("bert", BERTConfig, plan=PLAN)
class BERT(LanguageModel):
    """Masked LM: ``head(blocks(embed(ids)))``, ids (B, T) -> logits (B, T, V) at every position
    (the ``mlm`` task scores only the masked ones)."""

    def __init__(self, cfg: BERTConfig) -> None:
        super().__init__(cfg, causal=False, embed_norm=True, head=MLMHead(cfg.dim, cfg.vocab_size))
