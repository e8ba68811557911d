"""Parallel plans of Hugging Face transformers families, declared here beside kiln's own
(``_lm_plan.py``), so that ``kiln.parallel`` splits a user's HF model by config with its
parameter names unchanged (checkpoints in and out key on them).

Shapes: B batch, T sequence, C width, F feed-forward width, V vocabulary, H query heads,
Hkv key/value heads, tp the tensor-parallel degree.

- **Llama and the families transformers builds like it** (``*ForCausalLM`` of model types
  :data:`LLAMA_LIKE`: rotary attention over ``q/k/v/o_proj``, a gated MLP over
  ``gate/up/down_proj``, RMS norms): Megatron's layout, the one transformers itself declares
  in ``config.base_model_tp_plan``::

      model.embed_tokens          vocab_embedding_replicated: (V/tp, C)
      model.layers.i.self_attn    q/k/v_proj colwise: H/tp query and Hkv/tp key/value heads per
                                  rank (grouped-query attention keeps H/Hkv queries per key);
                                  o_proj rowwise
      model.layers.i.mlp          gate/up_proj colwise (F/tp, C); down_proj rowwise
      lm_head                     vocab_head: logits sharded over V (loss on sharded logits)

  Under sequence parallelism the norms run on (B, T/tp, C) shards: the embeddings stay whole
  (the model derives positions and the causal mask from their length), the first decoder layer
  cuts the sequence (``scatter_sequence``), attention and MLP all-gather it.
- **GPT-2** (``GPT2LMHeadModel``): its projections are ``Conv1D`` (``y = x @ W + b`` with W
  (in, out)), and ``c_attn`` is one fused (C, 3C) weight holding q, k and v side by side. A
  plain column split would give rank 0 all of q and part of k; :class:`_ColwiseConv1D` with
  ``parts=3`` holds it as (C, 3, C) split over the last dim, so each rank holds its own heads'
  q, k and v. That (C, 3, C) is also how every layout checkpoints it (:func:`gpt2_held_shape`),
  so checkpoints move between layouts; ``RUN_DIR/hf`` and ``kiln export`` write (C, 3C).
- **BERT** (``BertForMaskedLM``): query/key/value colwise, the output denses rowwise, the
  post-norms on sequence shards under sequence parallelism, the tied MLM decoder vocab-parallel.

Pipelines cut at the decoder (encoder) layers. A stage is the whole HF model with the parts it
does not own skipped, run with ``inputs_embeds`` after the first stage; its output is the
ModelOutput's ``logits``, which before the last stage are the hidden states (norm and head
skipped). Tied input and output embeddings must be untied for pp > 1
(``tie_word_embeddings=False`` in the model's config).

This module never imports transformers: a family is recognised by its class's name and module.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from kiln.models._parallel_plan import ParallelPlan, PipelinePlan, TensorParallelPlan, TPContext, check_tp_divides

__all__ = ["LLAMA_LIKE", "hf_plan", "hf_families", "gpt2_held_shape"]

# model_type -> verified to run the Llama plan (same module names and forward glue)
LLAMA_LIKE = ("llama", "mistral", "qwen2")


def _is_hf(obj: Any) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(obj).__mro__)


def _vocab_note(vocab: int, tp: int) -> str:
    padded = -(-vocab // tp) * tp
    return f" (pad the vocabulary to {padded}, a multiple of tp, e.g. resize_token_embeddings({padded}))"


def _check(sizes: dict[str, int], cfg: Any, tp: int, sequence_parallel: bool) -> None:
    vocab = cfg.vocab_size
    notes = {"config.vocab_size": _vocab_note(vocab, tp)}
    check_tp_divides(tp, sizes, notes)


def _check_llama(cfg: Any, tp: int, sequence_parallel: bool = False) -> None:
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if kv % tp:
        raise ValueError(f"parallel.tp={tp} does not divide config.num_key_value_heads={kv} (grouped-query attention: "
                         f"each rank needs whole key/value heads, and config.num_attention_heads="
                         f"{cfg.num_attention_heads} query heads); choose tp dividing {kv}")
    _check({"config.num_attention_heads": cfg.num_attention_heads, "config.num_key_value_heads": kv,
            "config.intermediate_size": cfg.intermediate_size, "config.vocab_size": cfg.vocab_size},
           cfg, tp, sequence_parallel)


def _check_gpt2(cfg: Any, tp: int, sequence_parallel: bool = False) -> None:
    inner = cfg.n_inner or 4 * cfg.n_embd
    _check({"config.n_head": cfg.n_head, "config.n_embd": cfg.n_embd, "the MLP width config.n_inner": inner,
            "config.vocab_size": cfg.vocab_size}, cfg, tp, sequence_parallel)


def _check_bert(cfg: Any, tp: int, sequence_parallel: bool = False) -> None:
    _check({"config.num_attention_heads": cfg.num_attention_heads, "config.hidden_size": cfg.hidden_size,
            "config.intermediate_size": cfg.intermediate_size, "config.vocab_size": cfg.vocab_size},
           cfg, tp, sequence_parallel)


def _hf_call(stage: nn.Module, x: torch.Tensor, first: bool) -> torch.Tensor:
    """A pipeline stage of an HF model: token ids on the first stage, hidden states after it."""
    out = stage(input_ids=x) if first else stage(inputs_embeds=x)
    return out.logits


# -- Conv1D (GPT-2) styles ------------------------------------------------------------------------
def _conv1d_styles() -> tuple[type, type]:
    """GPT-2's Conv1D split by output (colwise, optionally per part of a fused weight) and by
    input (rowwise), as ``ParallelStyle`` subclasses (torch's own take only nn.Linear)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel.style import ParallelStyle

    def local_input(x: torch.Tensor, mesh: Any) -> torch.Tensor:
        # the whole input, the same on every rank; its gradient from this rank is a partial sum
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        return x.to_local(grad_placements=(Partial(),))

    class ColwiseConv1D(ParallelStyle):
        """Output features split over the ranks; with ``parts`` > 1 the weight (in, parts * n) is
        held as (in, parts, n) split over n, so each rank computes its slice of every part
        (q, k and v of its own heads). Output: the plain local (..., parts * n / tp)."""

        def __init__(self, parts: int = 1) -> None:
            super().__init__()
            self.parts = parts
            self.sharded = ("weight", "bias")

        def _apply(self, module: nn.Module, mesh: Any) -> nn.Module:
            w, b, k = module.weight.detach(), module.bias.detach(), self.parts
            if k > 1:
                w, b = w.view(w.shape[0], k, -1), b.view(k, -1)
            module.register_parameter("weight", nn.Parameter(distribute_tensor(w, mesh, (Shard(w.dim() - 1),))))
            module.register_parameter("bias", nn.Parameter(distribute_tensor(b, mesh, (Shard(b.dim() - 1),))))

            def forward(self_: nn.Module, x: torch.Tensor) -> torch.Tensor:
                x = local_input(x, mesh)
                weight = self_.weight.to_local().reshape(x.shape[-1], -1)
                out = torch.addmm(self_.bias.to_local().reshape(-1), x.reshape(-1, x.shape[-1]), weight)
                return out.view(*x.shape[:-1], -1)

            module.forward = types.MethodType(forward, module)
            return module

    class RowwiseConv1D(ParallelStyle):
        """Input features split over the ranks (the weight's rows); the partial products are
        summed: all-reduced to a replicated output, or reduce-scattered over T under sequence
        parallelism; the bias (replicated) is added after. Output: plain local tensor."""

        def __init__(self, sequence_parallel: bool) -> None:
            super().__init__()
            self.out = Shard(1) if sequence_parallel else Replicate()
            self.sharded = ("weight",)

        def _apply(self, module: nn.Module, mesh: Any) -> nn.Module:
            module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight.detach(), mesh, (Shard(0),))))
            module.register_parameter("bias", nn.Parameter(distribute_tensor(module.bias.detach(), mesh, (Replicate(),))))
            out_layout = self.out

            def forward(self_: nn.Module, x: torch.Tensor) -> torch.Tensor:
                part = x.reshape(-1, x.shape[-1]) @ self_.weight.to_local()
                part = part.view(*x.shape[:-1], -1)
                y = DTensor.from_local(part, mesh, (Partial(),), run_check=False).redistribute(mesh, (out_layout,))
                return (y + self_.bias).to_local()

            module.forward = types.MethodType(forward, module)
            return module

    return ColwiseConv1D, RowwiseConv1D


def _conv1d_colwise(parts: int):
    return lambda ctx: _conv1d_styles()[0](parts)


def _conv1d_rowwise(ctx: TPContext) -> Any:
    return _conv1d_styles()[1](ctx.sequence_parallel)


def _gpt2_hook(model: nn.Module, ctx: TPContext) -> None:
    """Each attention splits its fused projection's local output into its own q, k and v."""
    for module in model.modules():
        if type(module).__name__ == "GPT2Attention" and hasattr(module, "split_size"):
            module.split_size = module.embed_dim // ctx.tp


def gpt2_held_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape under which kiln holds and checkpoints GPT-2's parameter ``name`` of HF shape
    ``shape``: the fused (C, 3C) ``c_attn`` weight as (C, 3, C) and its bias as (3, C), so that a
    tensor-parallel shard is a box (each rank's q, k and v heads); everything else unchanged."""
    if name.endswith("attn.c_attn.weight") and len(shape) == 2:
        return (shape[0], 3, shape[1] // 3)
    if name.endswith("attn.c_attn.bias") and len(shape) == 1:
        return (3, shape[0] // 3)
    return tuple(shape)


# -- the plans ------------------------------------------------------------------------------------
def _llama_plan(prefix: str) -> ParallelPlan:
    m = prefix
    styles = {
        f"{m}embed_tokens": "vocab_embedding_replicated",
        f"{m}layers.0": "scatter_sequence",
        f"{m}layers.*.input_layernorm": "sequence",
        f"{m}layers.*.self_attn": "gather_sequence",
        f"{m}layers.*.self_attn.q_proj": "colwise",
        f"{m}layers.*.self_attn.k_proj": "colwise",
        f"{m}layers.*.self_attn.v_proj": "colwise",
        f"{m}layers.*.self_attn.o_proj": "rowwise",
        f"{m}layers.*.post_attention_layernorm": "sequence",
        f"{m}layers.*.mlp": "gather_sequence",
        f"{m}layers.*.mlp.gate_proj": "colwise",
        f"{m}layers.*.mlp.up_proj": "colwise",
        f"{m}layers.*.mlp.down_proj": "rowwise",
        f"{m}norm": "sequence",
    }
    last: tuple[str, ...] = (f"{m}norm",)
    if prefix:
        styles["lm_head"] = "vocab_head"
        last = (f"{m}norm", "lm_head")
    return ParallelPlan(
        output="lm_head" if prefix else None,  # returned as the logits, unchanged (chunked loss)
        tp=TensorParallelPlan(styles=styles, check=_check_llama),
        pp=PipelinePlan(first=(f"{m}embed_tokens",), repeated=f"{m}layers", last=last, shared=(f"{m}rotary_emb",),
                        depth_option="num_hidden_layers", tied_by="tie_word_embeddings", call=_hf_call,
                        sequence_shards=False),
    )


def _gpt2_plan() -> ParallelPlan:
    t = "transformer."
    styles = {
        f"{t}wte": "vocab_embedding_replicated",
        f"{t}h.0": "scatter_sequence",
        f"{t}h.*.ln_1": "sequence",
        f"{t}h.*.attn": "gather_sequence",
        f"{t}h.*.attn.c_attn": _conv1d_colwise(3),
        f"{t}h.*.attn.c_proj": _conv1d_rowwise,
        f"{t}h.*.ln_2": "sequence",
        f"{t}h.*.mlp": "gather_sequence",
        f"{t}h.*.mlp.c_fc": _conv1d_colwise(1),
        f"{t}h.*.mlp.c_proj": _conv1d_rowwise,
        f"{t}ln_f": "sequence",
        "lm_head": "vocab_head",
    }
    return ParallelPlan(
        output="lm_head",  # returned as the logits, unchanged (chunked loss)
        tp=TensorParallelPlan(styles=styles, check=_check_gpt2, hook=_gpt2_hook),
        pp=PipelinePlan(first=(f"{t}wte", f"{t}wpe", f"{t}drop"), repeated=f"{t}h", last=(f"{t}ln_f", "lm_head"),
                        zero_when_skipped=(f"{t}wpe",), depth_option="n_layer", tied_by="tie_word_embeddings",
                        call=_hf_call, sequence_shards=False),
        held_shape=gpt2_held_shape,
    )


def _bert_plan() -> ParallelPlan:
    e, lay = "bert.embeddings.", "bert.encoder.layer."
    styles = {
        f"{e}word_embeddings": "vocab_embedding_replicated",
        f"{lay}0": "scatter_sequence",
        f"{lay}*.attention.self": "gather_sequence",
        f"{lay}*.attention.self.query": "colwise",
        f"{lay}*.attention.self.key": "colwise",
        f"{lay}*.attention.self.value": "colwise",
        f"{lay}*.attention.output.dense": "rowwise",
        f"{lay}*.attention.output.LayerNorm": "sequence_residual",
        f"{lay}*.intermediate": "gather_sequence",
        f"{lay}*.intermediate.dense": "colwise",
        f"{lay}*.output.dense": "rowwise",
        f"{lay}*.output.LayerNorm": "sequence_residual",
        "cls.predictions.transform.dense": "sequence",
        "cls.predictions.transform.LayerNorm": "sequence",
        "cls.predictions.decoder": "vocab_head",
    }
    return ParallelPlan(
        tp=TensorParallelPlan(styles=styles, check=_check_bert),
        pp=PipelinePlan(first=("bert.embeddings",), repeated="bert.encoder.layer", last=("cls",),
                        depth_option="num_hidden_layers", tied_by="tie_word_embeddings", call=_hf_call,
                        sequence_shards=False),
    )


# (model_type, class-name suffix) -> plan; built once
_FAMILIES: dict[str, tuple[str, str]] = {
    **{t: ("ForCausalLM", f"{t}: {t.capitalize()}ForCausalLM") for t in LLAMA_LIKE},
    "gpt2": ("GPT2LMHeadModel", "gpt2: GPT2LMHeadModel"),
    "bert": ("BertForMaskedLM", "bert: BertForMaskedLM"),
}
_BUILT: dict[str, ParallelPlan] = {}


def _plan_of_type(model_type: str) -> ParallelPlan | None:
    if model_type not in _FAMILIES:
        return None
    if model_type not in _BUILT:
        _BUILT[model_type] = (_llama_plan("model.") if model_type in LLAMA_LIKE else
                              _gpt2_plan() if model_type == "gpt2" else _bert_plan())
    return _BUILT[model_type]


def hf_plan(obj: Any) -> ParallelPlan | None:
    """The plan of a transformers model (by its class) or config (by its ``model_type``, for the
    family's usual head: ``*ForCausalLM``, ``GPT2LMHeadModel``, ``BertForMaskedLM``); None for
    anything else. A model of a planned family with another head (``LlamaModel``,
    ``BertForSequenceClassification``) has none."""
    if not _is_hf(obj):
        return None
    config = obj if hasattr(obj, "model_type") and not isinstance(obj, nn.Module) else getattr(obj, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        return None
    if isinstance(obj, nn.Module) and not type(obj).__name__.endswith(_FAMILIES[model_type][0]):
        return None
    return _plan_of_type(model_type)


def hf_families(capability: str) -> list[str]:
    """Descriptions of the HF families with ``capability`` (``tp`` or ``pp``), for messages."""
    return [f"hf {desc}" for t, (_, desc) in _FAMILIES.items() if capability in _plan_of_type(t).capabilities]
