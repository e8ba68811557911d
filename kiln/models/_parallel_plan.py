"""Parallel plans: what a model family declares so that ``kiln.parallel`` can split it.

A family registers its plan beside its model (``register_model(name, Config, plan=...)``), as
torchtitan keeps ``parallelize_llama.py`` beside Llama. ``kiln.parallel`` applies plans and
knows no model's module names; a family without a plan still gets everything that needs none
(precision, accumulation, the arena, compile, activation checkpointing, DP/ZeRO/FSDP2).

Plans are data plus small functions; they never import ``kiln.parallel``::

    PLAN = ParallelPlan(
        tp=TensorParallelPlan(
            styles={                               # module-path pattern -> style
                "stem.lookup": "vocab_embedding",  # '*' matches one path component
                "layers.*.up": "colwise",
                "layers.*.down": "rowwise",
                "final.proj": "vocab_head",
            },
            check=my_check,                        # check(model_cfg, tp, sequence_parallel)
        ),
        pp=PipelinePlan(first=("stem",), repeated="layers", last=("final",)),
    )

A style is one of :data:`STYLE_NAMES` (resolved by ``kiln.parallel``) or a factory
``style(ctx: TPContext) -> ParallelStyle | None``: any ``torch.distributed.tensor.parallel``
style, or a family's own ``ParallelStyle`` subclass (a fused q/k/v projection split per head,
say) that names the parameters it splits in a ``sharded`` attribute (a tuple of its module's
parameter names); None leaves the module replicated. ``TensorParallelPlan.hook(model, ctx)``
runs after the sharding, for what styles cannot say (a module's own head count, for example).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import did_you_mean

__all__ = ["STYLE_NAMES", "TPContext", "TensorParallelPlan", "PipelinePlan", "ParallelPlan", "check_tp_divides"]

# The named styles a plan may use; kiln.parallel implements each. Shapes: B batch, T sequence,
# C width, V vocabulary; "sp": parallel.sequence_parallel, where the residual stream between
# the sharded matmuls is split over T (each rank holds (B, T/tp, C)).
STYLE_NAMES = {
    "colwise": "nn.Linear split by output features (weight and bias rows); output sharded on its "
               "last dim, so a rank computes its own heads or hidden units",
    "rowwise": "nn.Linear split by input features (weight columns); output summed over the ranks: "
               "replicated (B, T, C), or reduce-scattered to (B, T/tp, C) under sp",
    "vocab_embedding": "nn.Embedding split over the vocabulary (V/tp rows); output all-reduced, or "
                       "reduce-scattered over T under sp (which then checks that tp divides T)",
    "vocab_head": "the output projection split over the vocabulary (V/tp rows); input replicated "
                  "(T shards under sp); logits a DTensor sharded on V (loss_parallel) or gathered; "
                  "under the chunked loss only the weight is split (the loss makes each rank's logits)",
    "sequence": "under sp, a position-wise module (norm, dense) runs on T shards with replicated "
                "weights, its output a DTensor; nothing without sp",
    "sequence_residual": "as 'sequence', with a plain local (B, T/tp, C) output, for a module whose "
                         "output starts the residual stream",
    "vocab_embedding_replicated": "as vocab_embedding, but the output is always all-reduced to the "
                                  "whole (B, T, C), also under sp: for a model that reads the sequence "
                                  "length from its embeddings (Hugging Face's), whose first block then "
                                  "cuts the sequence (scatter_sequence)",
    "gather_sequence": "under sp, the module's input (T shards: its first positional argument, or the "
                       "keyword hidden_states) is all-gathered to the whole sequence before it runs; "
                       "nothing without sp",
    "scatter_sequence": "under sp, the module's input (the whole sequence, the same on every rank) is cut "
                        "to this rank's T/tp rows before it runs (no communication forward; its gradient "
                        "is all-gathered); nothing without sp",
    "positions": "under sp, a position table's (T, C) output is sliced to this rank's T/tp rows; "
                 "nothing without sp",
}


@dataclass(frozen=True)
class TPContext:
    """What a style factory or a plan's hook may depend on."""

    tp: int  # tensor-parallel degree
    sequence_parallel: bool = False
    loss_parallel: bool = True  # logits stay sharded over the vocabulary (vocab_head)
    mesh: Any = None  # the 1-D tensor-parallel DeviceMesh (None when only planning)
    # the loss computes the logits from the output projection's input, in chunks
    # (train.chunked_lm_loss): vocab_head only splits the weight, its input and output untouched
    chunked_head: bool = False


@dataclass(frozen=True)
class TensorParallelPlan:
    """Which modules split, and how. ``styles`` maps module-path patterns (dotted, ``*`` for one
    component, e.g. ``blocks.*.attn.wq``) to a style; a path that matches nothing, or an
    ``nn.Identity`` (a part a pipeline stage does not own), is skipped. Everything not named is
    replicated. ``check(model_cfg, tp, sequence_parallel)`` raises ValueError naming the numbers
    and the fix when tp does not divide what the plan splits (see :func:`check_tp_divides`).
    ``hook(model, ctx)`` runs after the sharding (family-specific fix-ups)."""

    styles: Mapping[str, Any]
    check: Callable[[Any, int, bool], None] | None = None
    hook: Callable[[Any, TPContext], None] | None = None

    def __post_init__(self) -> None:
        for pattern, style in self.styles.items():
            if isinstance(style, str):
                if style not in STYLE_NAMES:
                    hint = did_you_mean(style, STYLE_NAMES)
                    raise ValueError(f"tensor-parallel plan: {pattern!r} -> {style!r} is not a named style{hint} "
                                     f"Named styles: {', '.join(STYLE_NAMES)} (or give a factory ctx -> ParallelStyle)")
            elif not callable(style):
                raise TypeError(f"tensor-parallel plan: {pattern!r} -> {style!r}: a style is a name or a "
                                "callable ctx -> ParallelStyle")


@dataclass(frozen=True)
class PipelinePlan:
    """Where the stages cut: the model's forward must be ``last(repeated(first(x)))`` with every
    parameter and buffer under these modules. A stage replaces what it does not own by
    ``nn.Identity()``, so parameter names stay the whole model's.

    first: module paths run by the first stage only, before the blocks (e.g. ``("embed",)``).
    repeated: path of the ``nn.ModuleList`` of repeated blocks, split among the stages (FSDP
        also shards block by block along it).
    last: module paths run by the last stage only, after the blocks (e.g. ``("head",)``).
    depth_option: the config field holding the number of blocks (checked before building).
    tied_by: the config option that ties a first-stage weight to a last-stage one (tied input
        and output embeddings), which stages on different ranks cannot share; None if none.
    shared: modules every stage keeps, holding buffers only (a rotary-embedding table the
        model computes once per forward for all its blocks).
    zero_when_skipped: ``first`` modules whose output the forward *adds* to the stream (a
        position table): on later stages they return 0 instead of passing their input on.
    call: how a stage runs, ``call(stage, x, first) -> tensor``: ``x`` is the batch's inputs on
        the first stage (``first=True``) and the previous stage's output after it (a Hugging
        Face model takes the latter as ``inputs_embeds`` and returns a ModelOutput). Default:
        ``stage(x)``.
    sequence_shards: whether stages may pass sequence-parallel shards (B, T/tp, C) to each
        other; False for a model that reads the sequence length from a stage's input.
    """

    first: tuple[str, ...]
    repeated: str
    last: tuple[str, ...]
    depth_option: str = "depth"
    tied_by: str | None = None
    shared: tuple[str, ...] = ()
    zero_when_skipped: tuple[str, ...] = ()
    call: Callable[[Any, Any, bool], Any] | None = None
    sequence_shards: bool = True

    def depth(self, model_cfg: Any) -> int:
        return getattr(model_cfg, self.depth_option)

    def ties(self, model_cfg: Any) -> bool:
        return bool(self.tied_by and getattr(model_cfg, self.tied_by, False))

    def shape(self) -> str:
        """The forward this plan cuts, as ``last(repeated(first(x)))`` with this family's names."""
        return f"{'/'.join(self.last)}({self.repeated}({'/'.join(self.first)}(x)))"


@dataclass(frozen=True)
class ParallelPlan:
    """A family's tensor-parallel and pipeline plans (either may be None: not supported).

    ``held_shape(name, shape) -> shape``: for a family whose tensor-parallel plan holds a
    parameter in another shape than the model's (same elements; GPT-2's fused q/k/v weight as
    (C, 3, C) so that a rank's heads are one box), the shape under which every layout holds it
    in checkpoints, so that they move between layouts; None: every shape unchanged.

    ``output``: the path of a language model's output projection, an ``nn.Linear`` (V, C) whose
    output the model returns unchanged as its logits (nothing scales or caps them after it), so
    that a loss may skip it and compute the logits itself, in chunks (``train.chunked_lm_loss``,
    ``kiln/train/_chunked_loss.py``); None: not declared."""

    tp: TensorParallelPlan | None = None
    pp: PipelinePlan | None = None
    held_shape: Callable[[str, tuple[int, ...]], tuple[int, ...]] | None = None
    output: str | None = None
    capabilities: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        caps = {name for name, part in (("tp", self.tp), ("pp", self.pp)) if part is not None}
        object.__setattr__(self, "capabilities", frozenset(caps))


def check_tp_divides(tp: int, sizes: Mapping[str, int], notes: Mapping[str, str] | None = None) -> None:
    """Raise ValueError unless ``tp`` divides every size (``{"model.heads": 4, ...}``), naming the
    first one it does not divide and the tp values that would work. ``notes``: why a size is
    split, appended after its number."""
    notes = notes or {}
    g = math.gcd(*sizes.values())
    choices = ", ".join(str(d) for d in range(1, g + 1) if g % d == 0)
    for name, n in sizes.items():
        if n % tp:
            raise ValueError(f"parallel.tp={tp} does not divide {name}={n}{notes.get(name, '')}; "
                             f"choose tp in {{{choices}}}")
