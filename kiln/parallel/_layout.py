"""One call that lays a model out over ``dp x tp x pp`` ranks: :func:`parallelize`.

The order is torchtitan's: cut pipeline stages (``pp``), shard each stage's matmuls over the
tensor-parallel ranks (``tp``), then, with ``zero=3``, shard what is left over the
data-parallel ranks with FSDP2 (HSDP, ``layout.replicate > 1``: over the ranks of each replica
group, gradients all-reduced across the groups). What comes back, :class:`Parallel`, is what the trainer needs
whatever the layout:

- ``model``: this rank's part of the model under the whole model's parameter names (all of it
  when ``pp=1``; with a pipeline, a view holding the local stages' modules), for the optimizer,
  ``train()/eval()`` and checkpoints (DCP keys on those names, so checkpoints reshard between
  layouts);
- ``pipeline``: the :class:`~kiln.parallel._pp.Pipeline` when ``pp > 1`` (its ``step`` runs
  forward and backward of every micro-batch);
- :meth:`Parallel.data_parallel`: the optimizer's data-parallel side (ZeRO-1/2, or the reducer);
- :meth:`Parallel.loss_context`, :meth:`Parallel.sync_gradients`, :meth:`Parallel.reduce_gradients`,
  :meth:`Parallel.clip`, :meth:`Parallel.logits`: the layout-dependent pieces of a step.

    >>> from kiln.parallel._mesh import Layout
    >>> par = parallelize(nn.Linear(2, 2), Layout(), zero=0)   # one process: nothing changes
    >>> par.pipeline is None and par.mesh is None
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

import kiln.optim
from kiln.models import find_plan, repeated_blocks
from kiln.optim import NO_ARENA
from kiln.parallel._dist import reducer
from kiln.parallel._mesh import Layout, build_mesh, dp_mesh, fsdp_mesh
from kiln.parallel._reducer import Backend, GradReducer
from kiln.parallel._zero import ZeroOptimizer


__all__ = ["Parallel", "parallelize", "stage_elements"]


class Parallel:
    """This rank's share of a parallelized model; built by :func:`parallelize`."""

    def __init__(self, model: nn.Module, layout: Layout, *, zero: int, mesh: Any = None, pipeline: Any = None,
                 loss_parallel: bool = False) -> None:
        self.model, self.layout, self.mesh, self.pipeline = model, layout, mesh, pipeline
        self.loss_parallel = loss_parallel
        self.zero = zero
        self.fsdp = zero == 3 and layout.dp > 1
        self.reduce: Callable[[], None] | None = None  # averages the gradients over dp (data_parallel)
        self.reducer: Any = None
        self.tp = layout.tp > 1
        self.dp_group = dp_mesh(mesh, layout).get_group() if mesh is not None and layout.dp > 1 else None
        self.pp_group = mesh["pp"].get_group() if mesh is not None and layout.pp > 1 else None

    @property
    def arena(self) -> bool:
        """Whether the optimizer can keep the parameters in kiln's flat arena: no setting of
        :data:`kiln.optim.NO_ARENA` that this layout applies leaves it out (zero=3 applies FSDP2
        only over several data-parallel ranks)."""
        applied = {"parallel.tp": self.layout.tp, **({"parallel.zero": 3} if self.fsdp else {})}
        return not any(no.leaves_out(applied[no.key]) for no in NO_ARENA if no.key in applied)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Wrap forward, loss and backward (tensor parallelism computes the cross-entropy on
        vocabulary-sharded logits inside it)."""
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from kiln.parallel._tp import tp_loss_context

        return tp_loss_context(True)

    def logits(self, outputs: Any) -> Any:
        """What the model returned with plain, whole logits (gathered over tp if sharded): the
        logits tensor itself, or a mapping (transformers' ModelOutput) holding ``logits``."""
        if not self.loss_parallel:
            return outputs
        from kiln.parallel._tp import gather_logits

        if isinstance(outputs, Mapping) and "logits" in outputs:
            outputs["logits"] = gather_logits(outputs["logits"])
            return outputs
        return gather_logits(outputs)

    def value(self, loss: torch.Tensor) -> torch.Tensor:
        """A detached plain tensor of a loss (tensor parallelism returns a replicated DTensor)."""
        loss = loss.detach()
        if type(loss) is torch.Tensor:
            return loss
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss

    def sum_over_dp(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the data-parallel ranks (itself with one)."""
        if self.dp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.dp_group)
        return x

    def eval_forward(self, model: nn.Module) -> Callable[..., Any]:
        """A stand-in for ``model(...)`` in evaluation, called as the model is (a mapping batch
        as keyword arguments): through the pipeline (None on ranks without the last stage), or
        the model with tensor-parallel logits gathered and its own loss a plain tensor."""
        if self.pipeline is not None:
            def through_pipeline(*args: Any, **kwargs: Any) -> Any:
                if kwargs:
                    raise TypeError("a pipeline (parallel.pp > 1) takes batches (inputs, targets); this data gives "
                                    f"mappings ({', '.join(kwargs)}): use a dataset of tuples, or parallel.pp=1")
                return self.pipeline.forward(args[0])

            return through_pipeline

        def through_model(*args: Any, **kwargs: Any) -> Any:
            # a model that computes its own loss (labels in a mapping) does it on the
            # vocabulary-sharded logits: inside the loss context, as in training
            with self.loss_context():
                outputs = model(*args, **kwargs)
            if isinstance(outputs, Mapping) and outputs.get("loss") is not None:
                outputs["loss"] = self.value(outputs["loss"])
            return self.logits(outputs)

        return through_model

    def share_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The metrics of the rank that computed them (the last pipeline stage) on every rank."""
        return self.pipeline.share_from_last(metrics) if self.pipeline is not None else metrics

    def data_parallel(self, optimizer: torch.optim.Optimizer, *, overlap: bool = False,
                      bucket_mb: float = 25.0) -> torch.optim.Optimizer:
        """The optimizer a step uses, and how its gradients are averaged over the data-parallel
        ranks (torchtitan's ``parallelize`` makes this choice for the model; here for its
        optimizer, built over :attr:`model` after :func:`parallelize`): ZeRO-1/2 wrap it in a
        :class:`~kiln.parallel.ZeroOptimizer` (returned: step that from now on), which reduces
        into each rank's shard; otherwise one :class:`~kiln.parallel._reducer.GradReducer` of
        stage 0 averages the gradients in place; FSDP2 reduced them in backward already.
        ``overlap``: buckets reduced during the step's last backward (kiln's arena only)."""
        if self.layout.dp == 1 or self.fsdp:
            return optimizer

        if self.zero in (1, 2):
            optimizer = ZeroOptimizer(optimizer, self.zero, group=self.dp_group, overlap=overlap, bucket_mb=bucket_mb)
            self.reducer, self.reduce = optimizer.reducer, optimizer.reduce_gradients
        else:
            self.reducer = GradReducer(optimizer, 0, Backend(self.dp_group), overlap=overlap,
                                       bucket_bytes=int(bucket_mb * 2**20))
            self.reduce = self.reducer.reduce
        return optimizer

    def sync_gradients(self, last: bool) -> contextlib.AbstractContextManager:
        """Around each micro-batch's backward: the step's last one (``last``) reduces gradient
        buckets as backward completes them, when :meth:`data_parallel` asked for overlap."""
        return self.reducer.sync(last) if self.reducer is not None else contextlib.nullcontext()

    def reduce_gradients(self) -> None:
        """Average the gradients over the data-parallel ranks, once per optimizer step (see
        :meth:`data_parallel`); nothing with one replica or under FSDP2."""
        if self.reduce is not None:
            self.reduce()

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip the norm of the whole model's gradient (every shard, stage and tensor-parallel
        piece counted once); returns the norm before clipping, the same on every rank."""

        extra = reducer(self.pp_group) if self.pp_group is not None else None
        return kiln.optim.clip_grad_norm_(optimizer, max_norm, extra_reduce=extra)


class _RankView(nn.Module):
    """This rank's pipeline stages as one module under the whole model's names: the pipeline
    plan's ``first`` modules, every block and its ``last`` modules, each taken from whichever
    local stage owns it (the same module objects, no copies; ``nn.Identity`` for what other
    ranks own), in nested containers where the plan's paths are dotted. For the optimizer,
    ``train()/eval()`` and checkpoints; the forward pass goes through the pipeline."""

    def __init__(self, stages: list[nn.Module], pp_plan: Any) -> None:
        super().__init__()
        self.cfg = getattr(stages[0], "cfg", None)

        def owned(path: str) -> nn.Module:
            found = [m for m in (s.get_submodule(path) for s in stages) if not isinstance(m, nn.Identity)]
            return found[0] if found else nn.Identity()

        n_blocks = len(stages[0].get_submodule(pp_plan.repeated))
        for path in pp_plan.first:
            self._put(path, owned(path))
        self._put(pp_plan.repeated, nn.ModuleList(owned(f"{pp_plan.repeated}.{i}") for i in range(n_blocks)))
        for path in pp_plan.last:
            self._put(path, owned(path))

    def _put(self, path: str, module: nn.Module) -> None:
        *parents, name = path.split(".")
        holder: nn.Module = self
        for part in parents:
            if not hasattr(holder, part):
                holder.add_module(part, nn.Module())
            holder = getattr(holder, part)
        holder.add_module(name, module)

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("this rank holds only some pipeline stages: run batches through Parallel.pipeline")


def parallelize(model: nn.Module, layout: Layout, *, zero: int = 0, sequence_parallel: bool = False,
                pp_schedule: str = "1f1b", microbatches: int | None = None, pp_stages: list[int] | None = None,
                loss_fn: Callable[..., torch.Tensor] | None = None, device: torch.device | str = "cpu",
                timing: bool = False, plan: Any = None, chunked_head: bool = False) -> Parallel:
    """Lay ``model`` (built identically, same seed, on every rank) out as ``layout`` says.

    tp > 1 and pp > 1 apply the :class:`~kiln.models.ParallelPlan` of the model's family
    (``plan``, default: the one registered for its class); dp, ZeRO and FSDP2 need none.

    Needs an initialised process group of ``layout.world`` ranks (none for 1 x 1 x 1).
    ``loss_fn(logits, targets)``: the mean loss of a micro-batch, for the pipeline schedule
    (pp > 1). ``zero=3`` shards what is left over the dp ranks with FSDP2; ZeRO-1/2 wrap the
    optimizer afterwards (:class:`~kiln.parallel.ZeroOptimizer` over ``Parallel.dp_group``).
    Build the optimizer over ``Parallel.model`` after this. ``chunked_head``: the loss computes
    the logits itself from the output projection's input (``train.chunked_lm_loss``; tp splits
    only the projection's weight).
    """
    device = torch.device(device)
    if layout.world == 1:
        return Parallel(model, layout, zero=zero)
    mesh = build_mesh(layout, device.type)
    pipeline = None
    modules = [model]
    if layout.pp > 1:
        from kiln.parallel._pp import SPLIT_BACKWARD, build_pipeline

        if loss_fn is None:
            raise ValueError("parallelize: pp > 1 needs loss_fn(logits, targets), which the schedule calls")
        if zero == 3 and layout.dp > 1 and pp_schedule in SPLIT_BACKWARD:
            raise ValueError(f"parallelize: pp_schedule={pp_schedule!r} computes the weight gradients in a pass of "
                             "their own, which FSDP2 (zero=3) does not reduce; use zero=1 or 2, or schedule "
                             "1f1b, interleaved-1f1b or gpipe")
        pipeline = build_pipeline(model, mesh["pp"].get_group(), schedule=pp_schedule,
                                  microbatches=microbatches or 2 * layout.pp, loss_fn=loss_fn, sizes=pp_stages,
                                  device=device, timing=timing, plan=plan)
        modules = pipeline.stages
    # Logits stay sharded over the vocabulary (never gathered) unless a pipeline schedule,
    # which passes plain tensors between stages, computes the loss.
    loss_parallel = layout.tp > 1 and pipeline is None
    if layout.tp > 1:
        from kiln.parallel._tp import apply_tp

        for m in modules:
            apply_tp(m, mesh["tp"], sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, plan=plan,
                     chunked_head=chunked_head)
    if zero == 3 and layout.dp > 1:
        from kiln.parallel._fsdp import apply_fsdp

        for m in modules:
            # the chunked loss reads the output projection's weight after the forward: the root's
            # parameters (the head's among them) stay gathered until its backward
            apply_fsdp(m, mesh=fsdp_mesh(mesh, layout), root_reshard_after_forward=False if chunked_head else None)
    if pipeline is None:
        view = model
    else:
        from kiln.parallel._pp import _pp_plan

        view = _RankView(pipeline.stages, _pp_plan(model, plan))
        view.parallel_plan = plan if plan is not None else find_plan(model)  # checkpoints read its held shapes
    return Parallel(view, layout, zero=zero, mesh=mesh, pipeline=pipeline, loss_parallel=loss_parallel)


def stage_elements(model: nn.Module, layout: Layout, *, sequence_parallel: bool = False, pp_schedule: str = "1f1b",
                   pp_stages: list[int] | None = None) -> list[int]:
    """Parameter elements each pipeline rank of ``layout`` holds of ``model`` (which may be on
    the ``meta`` device), after tensor-parallel splitting and before any sharding over dp, from
    the family's registered plan alone: for planning memory without building anything."""
    params = list(model.named_parameters())
    if layout.tp == 1 and layout.pp == 1:
        return [sum(p.numel() for _, p in params)]
    from kiln.parallel._pp import stage_of_parameters, stage_ranges, stage_ranks
    from kiln.parallel._tp import tp_sharded_names

    sharded = tp_sharded_names(model, layout.tp, sequence_parallel=sequence_parallel) if layout.tp > 1 else set()
    owner: dict[str, int] = {}
    rank_of = [0]
    if layout.pp > 1:
        rank_of = stage_ranks(layout.pp, pp_schedule)
        owner = stage_of_parameters(model, stage_ranges(len(repeated_blocks(model)), len(rank_of), pp_stages))
    ranks = [0] * layout.pp
    for fqn, p in params:
        ranks[rank_of[owner.get(fqn, 0)]] += p.numel() // layout.tp if fqn in sharded else p.numel()
    return ranks
