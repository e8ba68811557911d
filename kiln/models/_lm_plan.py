"""The parallel plan of kiln's language models (:class:`~kiln.models.transformer.LanguageModel`:
GPT, BERT), applied by ``kiln.parallel``; gpt.py and bert.py add their heads' entries.

Shapes: B batch, T sequence, C width, F feed-forward width, V vocabulary, H heads, tp the
tensor-parallel degree. Megatron's layout, parameter names unchanged (checkpoints key on them)::

    embed.tok              vocab_embedding: (V/tp, C) rows; output all-reduced (or
                           reduce-scattered over T under sequence parallelism)
    blocks.i.attn.wq/wk/wv colwise: (C/tp, C), so a rank computes H/tp whole heads (the
                           attention reads its head count from the width it gets)
    blocks.i.attn.wo       rowwise: (C, C/tp), output all-reduced (reduce-scattered)
    blocks.i.mlp.fc1       colwise: (F/tp, C)
    blocks.i.mlp.fc2       rowwise: (C, F/tp)
    head.out               vocab_head: (V/tp, C); logits a DTensor sharded on V, or gathered

Everything else (position embedding, norms, BERT's ``head.dense``) is replicated. Under
sequence parallelism the residual stream between the sharded matmuls is split over T: norms,
dropout, the residual adds and the head's position-wise layers run on (B, T/tp, C) shards, the
attention and MLP gather their input to the whole sequence, and the position table is sliced
to the rank's rows. Tied embeddings (``head.out.weight is embed.tok.weight``) stay tied: both
are Shard(0) over V.

Pipeline stages cut ``head(blocks(embed(ids)))``: the first stage runs ``embed``, the last
``head``; tied embeddings would span the two, so ``model.tie_embeddings`` must be off with pp > 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiln.models._parallel_plan import ParallelPlan, PipelinePlan, TensorParallelPlan, check_tp_divides

__all__ = ["lm_plan", "check_lm_tp"]

_BODY = {
    "embed.tok": "vocab_embedding",
    "embed.pos": "positions",
    "embed.norm": "sequence_residual",  # BERT's embedding norm (GPT's is nn.Identity: skipped)
    "blocks.*.norm1": "sequence",
    "blocks.*.attn": "gather_sequence",
    "blocks.*.attn.wq": "colwise",
    "blocks.*.attn.wk": "colwise",
    "blocks.*.attn.wv": "colwise",
    "blocks.*.attn.wo": "rowwise",
    "blocks.*.norm2": "sequence",
    "blocks.*.mlp": "gather_sequence",
    "blocks.*.mlp.fc1": "colwise",
    "blocks.*.mlp.fc2": "rowwise",
    "head.out": "vocab_head",
}


def check_lm_tp(model_cfg: Any, tp: int, sequence_parallel: bool = False) -> None:
    """tp must divide the heads, the width, the feed-forward width ``round(mlp_ratio * dim)`` and
    the vocabulary (and, under sequence parallelism, ``seq_len``)."""
    sizes = {"model.heads": model_cfg.heads, "model.dim": model_cfg.dim,
             "the feed-forward width round(model.mlp_ratio*model.dim)": round(model_cfg.mlp_ratio * model_cfg.dim),
             "model.vocab_size": model_cfg.vocab_size}
    if sequence_parallel:
        sizes["model.seq_len"] = model_cfg.seq_len
    check_tp_divides(tp, sizes, {"model.seq_len": " (parallel.sequence_parallel splits the sequence)"})


def lm_plan(head: Mapping[str, str], output: str | None = None) -> ParallelPlan:
    """The plan of a :class:`~kiln.models.transformer.LanguageModel` whose head adds ``head``'s
    entries (its position-wise layers before ``head.out``, which run on sequence shards under
    sequence parallelism; their parameters' gradients are then summed over the tp ranks).
    ``output``: ``head.out`` where the model returns its output as the logits (GPT), for the
    chunked loss (:class:`~kiln.models.ParallelPlan`'s ``output``)."""
    return ParallelPlan(
        output=output,
        tp=TensorParallelPlan(styles={**_BODY, **head}, check=check_lm_tp),
        pp=PipelinePlan(first=("embed",), repeated="blocks", last=("head",), depth_option="depth",
                        tied_by="tie_embeddings"),
    )
