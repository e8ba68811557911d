"""Tensor parallelism (Megatron-style) from a model family's plan: :func:`apply_tp`.

Shapes: B batch, T sequence, C model width, V vocabulary, tp the tensor-parallel degree.
Local shapes are written ``C/tp`` etc.

:func:`apply_tp` shards a model in place with DTensor's ``parallelize_module`` over a 1-D
tensor-parallel mesh, as the :class:`~kiln.models.TensorParallelPlan` its family registered
says (module-path patterns -> styles; kiln's GPT and BERT: ``kiln/models/_lm_plan.py``).
This module knows the named styles (``kiln.models.STYLE_NAMES``), not any model's modules;
parameter names do not change (checkpoints key on them). Modules the plan does not name are
replicated. With ``sequence_parallel=True`` the residual stream between the sharded matmuls
is split over T (each rank holds (B, T/tp, C)); position-wise modules run on those sequence
shards, their parameters becoming Replicate DTensors whose gradients are all-reduced over the
tp group as they arrive (a gradient hook, see ``_to_layout_of``). Activations outside the
sharded matmuls are then 1/tp the size, and each all-reduce becomes a reduce-scatter plus an
all-gather (same traffic).

Per step, on every rank of the tp group (all of them get the same batch)::

    check_tp(model.cfg, tp)                        # at config time, before building anything
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = apply_tp(model, mesh["tp"], sequence_parallel=sp)   # then apply_fsdp(model, mesh=mesh["dp"]) for 2-D
    opt = kiln.optim.AdamW(model.parameters(), contiguous=False)
    for step in ...:
        with tp_loss_context(True):                # forward + loss + backward inside it
            logits = model(ids)                    # DTensor (B, T, V) sharded on V
            loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
            loss.backward()
        all_reduce_gradients(opt, mesh["dp"].get_group())  # only for replicated dp (no FSDP), dp > 1
        kiln.optim.clip_grad_norm_(opt, 1.0)       # optional: global norm over every mesh
        opt.step(); opt.zero_grad()

For evaluation (accuracy), ``gather_logits(model(ids))`` turns the sharded logits into the
plain (B, T, V) tensor; the loss can be computed under ``tp_loss_context`` as in training.

Initial values: :func:`apply_tp` makes a tp group agree with its rank 0 (sharded parameters
are scattered from it, replicated ones broadcast), whatever each rank built; replicas over dp
must still start equal (the same seed, as for FSDP2).

Dropout always runs on plain local tensors, drawing from each process's own torch RNG: without
sequence parallelism, dropout on *replicated* (B, T, C) activations (the embeddings', each
block's) must draw the same mask on every rank of a tp group: seed the torch RNG by the dp
index (``seed + dp_rank``), not by the global rank, or the tp ranks' copies of the residual
stream silently diverge. Attention dropout acts on each rank's own heads, and under sequence
parallelism every dropout acts on the rank's own shard, so there distinct per-rank seeds are
also right (same seeds give correlated, still valid, masks).
"""

from __future__ import annotations

import contextlib
from fnmatch import fnmatchcase
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from kiln.models import STYLE_NAMES, ParallelPlan, TensorParallelPlan, TPContext, families_with, find_plan

__all__ = ["apply_tp", "check_tp", "gather_logits",
           "tp_loss_context", "tp_sharded_names"]

_SEQ = Shard(1)  # the T dim of (B, T, C)

# The named styles (kiln.models.STYLE_NAMES says what each does): ctx -> ParallelStyle, or None
# for "leave this module replicated" (the sequence styles without sequence parallelism).
_STYLES: dict[str, Callable[[TPContext], Any]] = {
    "colwise": lambda ctx: ColwiseParallel(),
    # output summed over the ranks: all-reduce to replicated (B, T, C), or reduce-scatter to (B, T/tp, C)
    "rowwise": lambda ctx: RowwiseParallel(output_layouts=_SEQ if ctx.sequence_parallel else Replicate()),
    "vocab_embedding": lambda ctx: RowwiseParallel(input_layouts=Replicate(),
                                                   output_layouts=_SEQ if ctx.sequence_parallel else Replicate()),
    "vocab_head": lambda ctx: _VocabRows() if ctx.chunked_head else ColwiseParallel(
        input_layouts=_SEQ if ctx.sequence_parallel else Replicate(),
        output_layouts=Shard(-1) if ctx.loss_parallel else Replicate(), use_local_output=not ctx.loss_parallel),
    # position-wise maps run on T shards with replicated weights (whose gradients must then be
    # summed over the ranks: a plain parameter here would silently get only its shard's part)
    "sequence": lambda ctx: SequenceParallel() if ctx.sequence_parallel else None,
    "sequence_residual": lambda ctx: SequenceParallel(use_local_output=True) if ctx.sequence_parallel else None,
    "vocab_embedding_replicated": lambda ctx: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    # T shards -> DTensor all-gathered to (B, T, C) at the module's input
    "gather_sequence": lambda ctx: _SequenceInput(gather=True) if ctx.sequence_parallel else None,
    # the whole (B, T, C) -> this rank's (B, T/tp, C) rows, at the module's input
    "scatter_sequence": lambda ctx: _SequenceInput(gather=False) if ctx.sequence_parallel else None,
    # the vocab embedding gives this rank's (B, T/tp, C) slice, so the (T, C) position table must
    # too: slice its output (no communication forward; all-gather of its gradient backward)
    "positions": lambda ctx: (PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
                              if ctx.sequence_parallel else None),
}
assert _STYLES.keys() == STYLE_NAMES.keys(), "kiln.parallel implements exactly the named styles kiln.models lists"


class _VocabRows(ParallelStyle):
    """An output projection's weight and bias split over the vocabulary (Shard(0): V/tp rows a
    rank) and nothing else: its input and output keep their layouts. Under the chunked loss
    (``kiln/train/_chunked_loss.py``) the model returns the projection's input, and the loss
    computes each rank's share of the logits from the local rows, chunk by chunk."""

    sharded = ("weight", "bias")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            split = distribute_tensor(p.detach(), device_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(split, requires_grad=p.requires_grad))
        return module


class _SequenceInput(ParallelStyle):
    """A module's input (its first positional argument, or the keyword ``hidden_states``, as
    Hugging Face layers are called) moved between the sequence layout and the whole sequence:
    ``gather=True``: T shards (a plain local (B, T/tp, C) or a Shard(1) DTensor) all-gathered
    to a Replicate DTensor (B, T, C), whose gradient is reduce-scattered back; ``gather=False``:
    the whole sequence, the same on every rank, cut to this rank's plain (B, T/tp, C) rows
    (its gradient all-gathered back). Other arguments pass unchanged."""

    def __init__(self, gather: bool) -> None:
        super().__init__()
        self.gather = gather

    def _move(self, x: Any, mesh: DeviceMesh) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if self.gather:
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (_SEQ,), run_check=False)
            return x.redistribute(mesh, (Replicate(),))
        if isinstance(x, DTensor):
            x = x.full_tensor()
        _refuse_uneven_sequence(x.shape[1], mesh.size())
        return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).redistribute(mesh, (_SEQ,)).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (self._move(args[0], device_mesh), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": self._move(kwargs["hidden_states"], device_mesh)}
            raise TypeError(f"sequence parallelism: {type(mod).__name__} was called without a positional input or "
                            "hidden_states=; its plan's gather_sequence/scatter_sequence cannot find the sequence")

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _tp_plan(obj: Any, plan: ParallelPlan | None = None) -> TensorParallelPlan | None:
    plan = plan if plan is not None else find_plan(obj)
    return plan.tp if plan is not None else None


def _families() -> str:
    return ", ".join(families_with("tp")) or "none"


def check_tp(model_cfg: Any, tp: int, *, sequence_parallel: bool = False) -> None:
    """Raise ``ValueError`` unless the model's family has a tensor-parallel plan and ``tp``
    divides what the plan splits (its ``check``: for kiln's language models the heads, width,
    feed-forward width and vocabulary, and with ``sequence_parallel`` the ``seq_len``, since
    inputs must then have a multiple of tp tokens). A pure config check, no process group."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"parallel.tp={tp!r}: must be a positive integer")
    tp_plan = _tp_plan(model_cfg)
    if tp_plan is None:
        raise ValueError(f"parallel.tp={tp}: tensor parallelism supports the transformer language models and other "
                         f"families that register a tensor-parallel plan ({_families()}); "
                         f"{type(model_cfg).__name__}'s family has none")
    if tp_plan.check is not None:
        tp_plan.check(model_cfg, tp, sequence_parallel)


def model_options(model: nn.Module) -> Any:
    """What a plan's checks read: a kiln model's ``cfg``, a Hugging Face model's ``config``."""
    return getattr(model, "cfg", None) or getattr(model, "config", None)


def _matches(pattern: str, path: str) -> bool:
    """Dotted ``pattern`` against a module path, component by component (``*`` is one component)."""
    want, have = pattern.split("."), path.split(".")
    return len(want) == len(have) and all(fnmatchcase(h, w) for w, h in zip(want, have))


def _resolve(model: nn.Module, tp_plan: TensorParallelPlan, ctx: TPContext) -> dict[str, tuple[Any, Any]]:
    """``{module path: (the plan's style entry, ParallelStyle)}`` for every module of ``model``
    the plan splits; modules that are ``nn.Identity`` (parts a pipeline stage does not own) or
    whose style is None in this context are left out."""
    out: dict[str, tuple[Any, Any]] = {}
    for path, module in model.named_modules():
        if not path or isinstance(module, nn.Identity):
            continue
        hits = [p for p in tp_plan.styles if _matches(p, path)]
        if len(hits) > 1:
            raise ValueError(f"tensor-parallel plan of {type(model).__name__}: module {path} matches the patterns "
                             f"{hits}; make them name one module each")
        if hits:
            entry = tp_plan.styles[hits[0]]
            style = _STYLES[entry](ctx) if isinstance(entry, str) else entry(ctx)
            if style is not None:
                out[path] = (entry, style)
    return out


def _split_parameters(style: Any, module: nn.Module) -> tuple[str, ...]:
    """The names of ``module``'s own parameters ``style`` splits over the tp ranks."""
    named = getattr(style, "sharded", None)  # a family's own ParallelStyle names them
    if named is not None:
        return tuple(named)
    if isinstance(style, ColwiseParallel):  # Linear: weight and bias rows; Embedding: columns
        return tuple(n for n, _ in module.named_parameters(recurse=False))
    if isinstance(style, RowwiseParallel):  # Linear: weight columns (the bias is replicated); Embedding: rows
        return ("weight",)
    return ()


def tp_sharded_names(model: nn.Module, tp: int = 2, *, sequence_parallel: bool = False,
                     plan: ParallelPlan | None = None) -> set[str]:
    """The names of the parameters :func:`apply_tp` splits over ``tp`` ranks (everything else is
    replicated), from the family's plan alone: for planning memory on a ``meta`` model
    (``kiln plan``) without building anything. Empty for a model without a plan."""
    tp_plan = _tp_plan(model, plan)
    if tp_plan is None:
        return set()
    ctx = TPContext(tp=tp, sequence_parallel=sequence_parallel)
    out: set[str] = set()
    for path, (_, style) in _resolve(model, tp_plan, ctx).items():
        out.update(f"{path}.{n}" for n in _split_parameters(style, model.get_submodule(path)))
    return out


def _aliases(model: nn.Module) -> list[list[str]]:
    """Groups of names under which one parameter is reachable (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(fqn)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(model: nn.Module, aliases: list[list[str]]) -> None:
    """Make each group of tied names one parameter again: ``parallelize_module`` replaced each
    module's parameters by its own DTensor. Both sides must have been split alike."""
    for names in aliases:
        now = {fqn: model.get_parameter(fqn) for fqn in names}
        split = {fqn: t for fqn, t in now.items() if isinstance(t, DTensor)}
        if not split:
            continue  # neither side split: still one tensor
        first, keep = next(iter(split.items()))
        for fqn, t in split.items():  # a side the plan does not name keeps the original: it follows
            if tuple(t.placements) != tuple(keep.placements):
                raise ValueError(f"apply_tp: {first} and {fqn} are one tied tensor, but the tensor-parallel plan lays "
                                 f"them out as {tuple(keep.placements)} and {tuple(t.placements)}; give both modules "
                                 "styles that split it alike (vocab_embedding and vocab_head), or untie them")
        for fqn in names:
            owner_path, _, attr = fqn.rpartition(".")
            setattr(model.get_submodule(owner_path) if owner_path else model, attr, keep)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
             loss_parallel: bool = True, plan: ParallelPlan | None = None, chunked_head: bool = False) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` as its family's tensor-parallel plan
    says (Megatron-style, see the module docstring) and return it.

    ``plan``: the :class:`~kiln.models.ParallelPlan` to apply (default: the one registered for
    the model's class, :func:`kiln.models.find_plan`). Modules that are ``nn.Identity`` (the
    parts of a whole model a pipeline stage does not own) are skipped. ``sequence_parallel``:
    position-wise modules and residual adds run on (B, T/tp, C) sequence shards, and a block's
    or stage's input and output are such shards (T must be a multiple of tp).
    ``loss_parallel``: the logits are a DTensor sharded on the vocabulary, to be consumed under
    :func:`tp_loss_context` (cross-entropy without gathering them); False: plain replicated
    (B, T, V) logits. ``chunked_head``: the loss computes the logits from the output
    projection's input (``train.chunked_lm_loss``), so ``vocab_head`` only splits its weight.
    Tied weights stay tied when the plan splits both sides alike.

    Call after the process group is initialised, before FSDP (``apply_fsdp(model,
    mesh=mesh["dp"])``) and before the optimizer is built.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs a 1-D tensor-parallel mesh (e.g. mesh['tp']), got {tp_mesh.ndim}-D {tp_mesh}")
    tp_plan = _tp_plan(model, plan)
    if tp_plan is None:
        raise TypeError(f"apply_tp: {type(model).__name__} has no tensor-parallel plan (families with one: "
                        f"{_families()}); declare one with kiln.models.register_model(..., plan=...) or "
                        "kiln.models.register_plan(cls, plan)")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("apply_tp: the model already has DTensor parameters; apply it once, before apply_fsdp")
    tp = tp_mesh.size()
    model_cfg = model_options(model)
    if tp_plan.check is not None and model_cfg is not None:
        tp_plan.check(model_cfg, tp, False)  # inputs may be shorter than seq_len: T is checked per batch
    ctx = TPContext(tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, mesh=tp_mesh,
                    chunked_head=chunked_head)
    resolved = _resolve(model, tp_plan, ctx)
    aliases = _aliases(model)
    parallelize_module(model, tp_mesh, {path: style for path, (_, style) in resolved.items()})
    _retie(model, aliases)
    if sequence_parallel:
        for path, (entry, _) in resolved.items():
            if entry == "vocab_embedding":  # its output is reduce-scattered over T: check T first
                model.get_submodule(path).register_forward_pre_hook(_check_seq_divisible(tp), prepend=True)
    if tp_plan.hook is not None:
        tp_plan.hook(model, ctx)
    for p in model.parameters():
        if isinstance(p, DTensor):
            p.register_hook(_to_layout_of(p))
    _broadcast_replicated(model, tp_mesh)
    return model


def _to_layout_of(p: DTensor):
    """A gradient hook giving ``p``'s gradient ``p``'s placements. In torch 2.13 DTensor leaves
    two gradients in another layout: a Replicate parameter used on sequence shards
    (the ``sequence`` styles' norms and dense layers) gets a Partial(sum) gradient, each rank holding
    its shard's contribution (torch.optim only works because its DTensor arithmetic reduces it
    lazily; kiln.optim steps local tensors), and the vocab-parallel embedding gets its full
    (V, C) gradient as Replicate instead of Shard(0). Here the first is all-reduced and the
    second sliced (no communication), as each gradient arrives. FSDP2 does the same in its
    reduce-scatter and replaces these parameters, so the hooks only act without it."""
    placements = tuple(p.placements)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and tuple(grad.placements) != placements:
            grad = grad.redistribute(placements=placements)
        return grad

    return hook


def _refuse_uneven_sequence(tokens: int, tp: int) -> None:
    if tokens % tp:
        raise ValueError(f"sequence parallelism splits the {tokens} tokens of the input over parallel.tp={tp} "
                         f"ranks; use inputs whose length is a multiple of {tp}")


def _check_seq_divisible(tp: int):
    def hook(module: nn.Module, args: tuple) -> None:
        _refuse_uneven_sequence(args[0].shape[-1], tp)
    return hook


@torch.no_grad()
def _broadcast_replicated(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make the replicated parameters and buffers equal to tp rank 0's (the sharded ones were
    scattered from it): plain tensors and Replicate DTensors, whose values are not checked
    by DTensor (SequenceParallel wraps each rank's own values)."""
    group = tp_mesh.get_group()
    for t in list(model.parameters()) + list(model.buffers()):
        if isinstance(t, DTensor):
            if any(not p.is_replicate() for p in t.placements):
                continue
            t = t.to_local()
        if t.device.type != "meta":
            dist.broadcast(t.data, group=group, group_src=0)


def tp_loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap forward, loss and backward: ``loss_parallel()`` when the model was parallelized
    with ``loss_parallel=True`` (cross-entropy on vocabulary-sharded DTensor logits, never
    gathered; the backward must run inside it too), else a ``nullcontext``.

    Inside it compute the loss as in one process, ``F.cross_entropy(logits.flatten(0, -2),
    targets.flatten())`` with plain targets (ignore_index=-100 works); the loss is a
    replicated scalar DTensor (``.item()``, ``.backward()`` and ``/ accumulate`` as usual).
    """
    return loss_parallel() if enabled else contextlib.nullcontext()


def gather_logits(logits: torch.Tensor) -> torch.Tensor:
    """The full plain (B, T, V) tensor of tensor-parallel logits (all-gathered over V when they
    are a sharded DTensor; returned as is otherwise): for accuracy, argmax, sampling."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits
