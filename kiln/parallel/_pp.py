"""Pipeline parallelism from a model family's plan on ``torch.distributed.pipelining``.

Shapes: B batch per data-parallel rank, M micro-batches, T sequence, C width, V vocabulary.

A model qualifies when its family registers a :class:`~kiln.models.PipelinePlan`: its forward
is ``last(repeated(first(x)))`` with every parameter under the plan's ``first`` modules, its
``repeated`` blocks (an ``nn.ModuleList``) and its ``last`` modules (kiln's GPT and BERT:
``head(blocks(embed(ids)))``, ``kiln/models/_lm_plan.py``). A stage is a copy of the whole
model in which every part the stage does not own is ``nn.Identity()`` (the ``first`` modules
unless first, the ``last`` ones unless last, each block outside the stage's range), so the
unchanged forward runs the stage and parameter names (FQNs) stay those
of the whole model: a ``torch.distributed.checkpoint`` checkpoint reshards between pipeline
and non-pipeline layouts. Every rank builds the whole model with the same seed;
:func:`build_pipeline` copies only the parts the rank's stages own (the model passed in is
left untouched, drop it to free the rest).

Layout. Single-stage schedules (``gpipe``, ``1f1b``) put stage ``s`` on pp rank ``s``.
The looped ones (``interleaved-1f1b``, ``interleaved-zb``) split the model into
``pp * virtual_stages`` stages and put stage ``s`` on pp rank ``s % pp`` (torch's "loop" order),
so pp rank 0 holds the first stage and pp rank ``pp - 1`` the last. The V-shaped ones (``zbv``,
``dualpipev``) split it into ``2 * pp`` stages and give pp rank ``r`` stages ``r`` and
``2 * pp - 1 - r``: down the ranks and back up, so pp rank 0 holds both the first stage and the
last (the loss), and rank ``pp - 1`` hands stage ``pp - 1``'s output to stage ``pp`` without a
send. The zero-bubble schedules (``interleaved-zb``, ``zbv``, ``dualpipev``) split each
backward into the input gradient, which the previous stage waits for, and the weight gradient,
which waits for nothing and fills what would be idle time (Qi et al., "Zero Bubble Pipeline
Parallelism", 2024; DeepSeek-V3's DualPipe). With data parallelism the mesh is
``init_device_mesh(device, (pp, dp), mesh_dim_names=("pp", "dp"))``: pp outermost, so the
ranks of one dp group are neighbours (one node) and the light point-to-point activation
traffic is what crosses nodes, as in torchtitan.

What a trainer does per optimizer step, on every rank (all calls are collectives over the
pp group, and :func:`all_reduce_gradients` over the dp group)::

    model = create_model("gpt", ...)                  # same seed on every rank
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pipe = build_pipeline(model, mesh, schedule="1f1b", microbatches=4,
                          loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()),
                          device=device)
    del model
    opt = kiln.optim.AdamW(pipe.parameters())         # this rank's stages only
    for inputs, targets in loader:                    # this dp rank's batch (B, T)
        loss = pipe.step(inputs, targets)             # forward + backward of all M micro-batches
        all_reduce_gradients(opt, pipe.dp_group)      # average over dp (no-op when dp == 1)
        opt.step(); opt.zero_grad()                   # clipping: see below
    logits = pipe.forward(val_inputs)                 # (B, T, V) on the last stage, None elsewhere

``step`` returns, on every pp rank, this dp rank's mean loss over its batch (0-dim,
detached). The gradients it leaves equal those of that mean loss, so gradient accumulation
is ``step`` called ``k`` times with ``loss_fn`` divided by ``k`` (gradients add up in
``p.grad``). A global gradient norm for clipping is the sum of the per-rank squared norms
over the pp group (each parameter lives on exactly one pp rank). ``inputs`` are needed on
the rank with the first stage, ``targets`` on the rank with the last; other ranks may pass
them or None.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kiln.errors import did_you_mean
from kiln.models import ParallelPlan, PipelinePlan, families_with, find_plan, model_plan, models_with

__all__ = ["SCHEDULES", "PP_SCHEDULES", "SPLIT_BACKWARD", "stage_ranks", "unit_costs", "schedule_bubble",
           "stage_ranges", "check_pipeline", "cut_stage", "stage_of_parameters", "build_pipeline", "Pipeline"]


@dataclass(frozen=True)
class _Kind:
    """What a schedule needs of the layout; ``SCHEDULES`` is the one table of them."""

    torch_class: str  # in torch.distributed.pipelining, imported on first use (docs/lab/facts.md, 'What an import costs')
    placement: str  # "one": stage s on pp rank s; "loop": s on s % pp; "v": rank r holds r and 2 pp - 1 - r
    split_backward: bool  # input and weight gradients apart, the weight work filling the bubble
    min_microbatches: str  # "any" | "pp" (one per rank) | "stages" (one per stage)


# config name (parallel.pp_schedule) -> what it is
SCHEDULES = {
    "gpipe": _Kind("ScheduleGPipe", "one", False, "any"),
    "1f1b": _Kind("Schedule1F1B", "one", False, "pp"),
    "interleaved-1f1b": _Kind("ScheduleInterleaved1F1B", "loop", False, "pp"),
    "interleaved-zb": _Kind("ScheduleInterleavedZeroBubble", "loop", True, "pp"),
    # torch pads the ZB-V order to 2 pp - 1 micro-batches and drops the missing ones: any count runs
    "zbv": _Kind("ScheduleZBVZeroBubble", "v", True, "any"),
    "dualpipev": _Kind("ScheduleDualPipeV", "v", True, "stages"),
}
PP_SCHEDULES = tuple(SCHEDULES)  # the names, for benchmarks and the layout search
SPLIT_BACKWARD = tuple(name for name, kind in SCHEDULES.items() if kind.split_backward)  # the zero-bubble ones
_MAX_RUNNERS = 4  # distinct (mode, batch shape) pipelines kept built; see Pipeline._runner


# -- configuration checks (no processes) ----------------------------------------------------------
def _check_schedule(schedule: str) -> str:
    name = str(schedule).lower()
    if name not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={schedule!r} is not a pipeline schedule{did_you_mean(name, SCHEDULES)} "
                         f"Choose one of: {', '.join(SCHEDULES)}")
    return name


def _num_stages(pp: int, schedule: str, virtual_stages: int) -> int:
    placement = SCHEDULES[schedule].placement
    return pp if placement == "one" else 2 * pp if placement == "v" else pp * virtual_stages


def stage_ranks(pp: int, schedule: str, virtual_stages: int = 2) -> list[int]:
    """The pp rank of each pipeline stage (see the module's Layout).

        >>> stage_ranks(2, "interleaved-1f1b")
        [0, 1, 0, 1]
        >>> stage_ranks(3, "zbv")
        [0, 1, 2, 2, 1, 0]
    """
    schedule = _check_schedule(schedule)
    n = _num_stages(pp, schedule, virtual_stages)
    if SCHEDULES[schedule].placement == "v":
        return [s if s < pp else n - 1 - s for s in range(n)]
    return [s % pp for s in range(n)]


class _OrderOnly:
    """What torch's schedule classes read of a stage when they compute the whole pipeline's order
    (in their constructor, the same on every rank): enough to have that order without processes."""

    submod = None  # (no module: torch's check for compiled stages has nothing to look at)

    def __init__(self, index: int, num_stages: int, pp: int, rank: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp, rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1


def _torch_order(schedule: str, pp: int, microbatches: int, virtual_stages: int = 2) -> dict[int, list[Any]]:
    """The ``pipeline_order`` torch's class for ``schedule`` computes: each pp rank's actions
    (``None`` where it leaves a slot empty); its ``ValueError`` where it refuses the numbers."""
    from torch.distributed import pipelining

    schedule = _check_schedule(schedule)
    kind = SCHEDULES[schedule]
    ranks = stage_ranks(pp, schedule, virtual_stages)
    stages = [_OrderOnly(s, len(ranks), pp, 0) for s, r in enumerate(ranks) if r == 0]
    cls = getattr(pipelining, kind.torch_class)
    built = cls(stages if kind.placement != "one" else stages[0], n_microbatches=microbatches, loss_fn=_no_loss,
                scale_grads=False)
    return built.pipeline_order


def _no_loss(output: Any, target: Any) -> Any:  # (a loss makes torch order backward actions too)
    raise AssertionError("an order-only schedule runs nothing")


def _compute_order(schedule: str, pp: int, microbatches: int, virtual_stages: int = 2) -> list[list[tuple]]:
    """Each pp rank's compute, in the order it runs: ``(stage, kind, micro-batch)`` with kind
    ``F`` (forward), ``B`` (full backward), ``I`` (input gradient) or ``W`` (weight gradient).
    The single-stage schedules are written as their ``_step_microbatches`` runs them (GPipe:
    every forward, then every backward; 1F1B: ``min(m, pp - s)`` forwards, then a backward and
    a forward in turn): the ``pipeline_order`` torch keeps of Schedule1F1B for display skips
    micro-batch 0 on the last rank. The others are run from their ``pipeline_order``."""
    schedule = _check_schedule(schedule)
    if SCHEDULES[schedule].placement == "one":
        out = []
        for s in range(pp):
            warmup = microbatches if schedule == "gpipe" else min(microbatches, pp - s)
            acts = [(s, "F", i) for i in range(warmup)]
            for i in range(microbatches):
                acts.append((s, "B", i))
                if warmup + i < microbatches and schedule != "gpipe":
                    acts.append((s, "F", warmup + i))
            out.append(acts)
        return out
    order = _torch_order(schedule, pp, microbatches, virtual_stages)
    return [[(a.stage_index, a.computation_type.value, a.microbatch_index)
             for action in order[r] if action is not None for a in (action.sub_actions or (action,))
             if a.computation_type.value in _UNIT_COST] for r in range(pp)]


_UNIT_COST = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}  # a full backward is the input's and the weights' parts
_PASSES = tuple(_UNIT_COST)


def unit_costs(schedule: str, pp: int, virtual_stages: int = 2) -> dict[tuple[int, str], float]:
    """``{(stage, pass): time}`` of the zero-bubble paper's unit model (F = I = W = 1, a full
    backward B = 2), as torch 2.13 runs the passes: the first stage has no input gradient to
    hand on, so its input pass does nothing and its weight pass runs the whole backward
    (``PipelineStage.backward_weight_one_chunk`` at stage 0): I = 0, W = 2 there."""
    n = _num_stages(pp, _check_schedule(schedule), virtual_stages)
    costs = {(s, kind): c for s in range(n) for kind, c in _UNIT_COST.items()}
    costs[(0, "I")], costs[(0, "W")] = 0.0, 2.0
    return costs


def schedule_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 2,
                    costs: dict[tuple[int, str], float] | None = None) -> list[float]:
    """Each pp rank's idle share of one step of ``schedule`` as torch orders it: the textbook
    bubble, computed rather than quoted. By default every stage's forward, input-gradient and
    weight-gradient work on one micro-batch takes one unit of time (a full backward two: the
    zero-bubble paper's F = B = W; :func:`unit_costs`), communication none; ``costs`` gives
    instead each ``(stage, pass)``'s own time (``pass`` one of ``F``, ``I``, ``W``, ``B``; e.g.
    measured, ``kiln bench pp-schedules``). Each rank runs its actions in torch's order, each
    as soon as the rank is free and what it needs is done (a forward: the previous stage's
    forward; an input gradient: the next stage's, or the forward on the last stage; a weight
    gradient: its own input gradient). The step lasts until the last rank finishes; a rank's
    idle share is ``1 - its busy time / that``, what ``kiln bench parallel`` measures.

        >>> [round(b, 3) for b in schedule_bubble("1f1b", 2, 4)]   # (p - 1) / (m + p - 1)
        [0.2, 0.2]
    """
    order = _compute_order(schedule, pp, microbatches, virtual_stages)
    last = _num_stages(pp, _check_schedule(schedule), virtual_stages) - 1
    cost = unit_costs(schedule, pp, virtual_stages) if costs is None else costs
    done: dict[tuple[int, str, int], float] = {}  # (stage, "F" | "in" (input gradient) | "W", mb) -> end
    clock, busy, at = [0.0] * pp, [0.0] * pp, [0] * pp

    def needs(stage: int, kind: str, mb: int) -> tuple[int, str, int] | None:
        if kind == "F":
            return (stage - 1, "F", mb) if stage > 0 else None
        if kind in ("I", "B"):
            return (stage, "F", mb) if stage == last else (stage + 1, "in", mb)
        return (stage, "in", mb)  # W

    moved = True
    while moved:
        moved = False
        for r in range(pp):
            while at[r] < len(order[r]):
                stage, kind, mb = order[r][at[r]]
                need = needs(stage, kind, mb)
                if need is not None and need not in done:
                    break
                clock[r] = max(clock[r], done[need] if need is not None else 0.0) + cost[(stage, kind)]
                busy[r] += cost[(stage, kind)]
                done[(stage, "in" if kind in ("I", "B") else kind, mb)] = clock[r]
                at[r] += 1
                moved = True
    if any(at[r] < len(order[r]) for r in range(pp)):
        raise RuntimeError(f"schedule {schedule} with pp={pp} and {microbatches} micro-batches: torch's order "
                           "waits on itself")
    end = max(clock)
    return [1.0 - b / end for b in busy]


def stage_ranges(depth: int, num_stages: int, sizes: list[int] | None = None) -> list[range]:
    """The blocks each pipeline stage runs: ``num_stages`` consecutive ranges covering
    ``range(depth)``.

    ``sizes`` (the config's ``parallel.pp_stages``) gives the number of blocks per stage; it
    must have one positive entry per stage and sum to ``depth``. Without it the split is even,
    and when ``depth`` does not divide, the extra blocks go to the middle stages (the ones
    nearest the centre first), because the first stage also runs the embedding and the last
    one the output head and the loss; with no middle stage left (two stages), the one extra
    block goes to the first stage, since the head (a C x V projection and the loss) costs more
    than the embedding lookup.

        >>> stage_ranges(6, 4)
        [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]
        >>> stage_ranges(3, 2)
        [range(0, 2), range(2, 3)]
    """
    for name, value in (("depth", depth), ("num_stages", num_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")
    if sizes is not None:
        sizes = list(sizes)
        if len(sizes) != num_stages:
            raise ValueError(f"parallel.pp_stages={sizes} has {len(sizes)} entries for {num_stages} pipeline "
                             f"stages; give one block count per stage (or leave it unset for an even split)")
        bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
        if bad:
            raise ValueError(f"parallel.pp_stages={sizes}: every stage needs at least one block "
                             f"(got {bad[0]!r}); give positive block counts")
        if sum(sizes) != depth:
            raise ValueError(f"parallel.pp_stages={sizes} sums to {sum(sizes)} blocks but the model has "
                             f"depth={depth}; the counts must add up to the model's depth")
    else:
        base, extra = divmod(depth, num_stages)
        if base == 0:
            raise ValueError(f"depth={depth} blocks cannot fill {num_stages} pipeline stages: each stage "
                             f"needs at least one block; use fewer stages or a deeper model")
        sizes = [base] * num_stages
        centre = (num_stages - 1) / 2
        middle = sorted(range(1, num_stages - 1), key=lambda i: (abs(i - centre), i))
        for i in (middle + [0])[:extra]:  # extra < num_stages, so at most one beyond the middle
            sizes[i] += 1
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


def check_pipeline(depth: int, pp: int, schedule: str, microbatches: int, batch_per_dp_rank: int,
                   sizes: list[int] | None = None, *, virtual_stages: int = 2, depth_name: str = "depth") -> None:
    """Reject a pipeline configuration before anything is built, naming the numbers and the
    fix: unknown schedule, fewer blocks than stages (``pp * virtual_stages`` for the looped
    schedules, ``2 * pp`` for the V-shaped ones), a bad ``sizes`` list, a batch that
    micro-batches do not divide, fewer micro-batches than a schedule runs (one per pp rank for
    ``1f1b`` and the looped ones, one per stage for ``dualpipev``: torch's DualPipeV refuses
    fewer), and torch's constraint on its looped schedules (``microbatches`` a multiple of
    their number of rounds, ``max(1, microbatches // pp)``). With ``pp == 1`` only the schedule
    name is checked (no pipeline is built). ``depth_name``: what the message calls the block
    count (the config key that sets it)."""
    schedule = _check_schedule(schedule)
    for name, value in (("parallel.pp", pp), ("parallel.microbatches", microbatches),
                        ("batch size per data-parallel rank", batch_per_dp_rank),
                        ("parallel.pp_virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")
    if pp == 1:
        return
    kind = SCHEDULES[schedule]
    n = _num_stages(pp, schedule, virtual_stages)
    if depth < n:
        what = {"one": f"pp={pp}", "loop": f"pp={pp} x virtual_stages={virtual_stages} = {n}",
                "v": f"2 x pp={pp} = {n} (two a rank, in a V)"}[kind.placement]
        raise ValueError(f"the model has {depth_name}={depth} blocks, fewer than the {what} pipeline stages "
                         f"of schedule {schedule} (each stage needs a block); use a deeper model or fewer stages"
                         + (", or schedule 1f1b" if n != pp and depth >= pp else ""))
    stage_ranges(depth, n, sizes)
    if batch_per_dp_rank % microbatches:
        raise ValueError(f"the batch per data-parallel rank ({batch_per_dp_rank}) does not split into "
                         f"parallel.microbatches={microbatches} equal micro-batches; choose a batch "
                         f"size that is a multiple of {microbatches} or a divisor of {batch_per_dp_rank}")
    if kind.min_microbatches == "pp" and microbatches < pp:
        raise ValueError(f"schedule {schedule} needs at least one micro-batch per pipeline rank: "
                         f"parallel.microbatches={microbatches} < pp={pp}; use "
                         f"parallel.microbatches >= {pp} (and a batch it divides) or schedule gpipe")
    if kind.min_microbatches == "stages" and microbatches < n:
        raise ValueError(f"schedule {schedule} needs at least one micro-batch per pipeline stage: "
                         f"parallel.microbatches={microbatches} < 2 x pp = {n} stages; use "
                         f"parallel.microbatches >= {n} (and a batch it divides) or schedule zbv")
    if kind.placement == "loop":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(f"torch's {kind.torch_class} runs max(1, microbatches // pp) = {rounds} rounds "
                             f"and needs parallel.microbatches={microbatches} to be a multiple of it; use a "
                             f"multiple of pp={pp} (e.g. {pp * rounds})")


# -- cutting a model into stages ------------------------------------------------------------------
def _pp_plan(model: nn.Module, plan: ParallelPlan | None = None) -> PipelinePlan:
    """The pipeline plan of ``model``'s family, checked against the model: its ``repeated`` an
    ``nn.ModuleList`` and every parameter and buffer under ``first``, ``repeated`` or ``last``."""
    found = plan if plan is not None else find_plan(model)
    pp_plan = found.pp if found is not None else None
    if pp_plan is None:
        shapes = "; ".join([f"{name}: {model_plan(name).pp.shape()}" for name in models_with("pp")]
                           + [name for name in families_with("pp") if name not in models_with("pp")])
        raise TypeError(f"pipeline parallelism needs a model whose family registers a pipeline plan, a forward "
                        f"last(repeated(first(x))) with every parameter under those modules ({shapes or 'none'}); "
                        f"{type(model).__name__} has no pipeline plan. Train it with parallel.pp=1, or declare "
                        "one with kiln.models.register_model(..., plan=...)")
    why = ""
    try:
        blocks = model.get_submodule(pp_plan.repeated)
        for path in pp_plan.first + pp_plan.last + pp_plan.shared:
            model.get_submodule(path)
    except AttributeError as exc:
        why = f"it lacks a module its plan names ({exc})"
    else:
        if not isinstance(blocks, nn.ModuleList):
            why = f"model.{pp_plan.repeated} is a {type(blocks).__name__}, not an nn.ModuleList"
    if not why:
        prefixes = tuple(f"{p}." for p in (*pp_plan.first, pp_plan.repeated, *pp_plan.last))
        shared = tuple(f"{p}." for p in pp_plan.shared)  # buffers only: every stage keeps them
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        names += [n for n, _ in model.named_buffers(remove_duplicate=False) if not n.startswith(shared)]
        stray = [n for n in names if not n.startswith(prefixes)]
        if stray:
            why = f"it has parameters outside them ({stray[0]})"
    if why:
        raise TypeError(f"pipeline parallelism cuts {type(model).__name__} as {pp_plan.shape()}, with every "
                        f"parameter under those modules, but {why}. Train it with parallel.pp=1")
    return pp_plan


def _owner(fqn: str, ranges: list[range], pp_plan: PipelinePlan) -> int:
    """The stage that holds the parameter or buffer ``fqn``."""
    if fqn.startswith(tuple(f"{p}." for p in pp_plan.first)):
        return 0
    if fqn.startswith(tuple(f"{p}." for p in pp_plan.last)):
        return len(ranges) - 1
    block = int(fqn[len(pp_plan.repeated) + 1:].split(".")[0])
    return next(s for s, r in enumerate(ranges) if block in r)


def stage_of_parameters(model: nn.Module, ranges: list[range], plan: ParallelPlan | None = None) -> dict[str, int]:
    """``{parameter name: the stage that holds it}`` for stages over ``ranges`` (from
    :func:`stage_ranges`), from the family's pipeline plan alone (``kiln plan``, on a ``meta``
    model). A tied parameter is listed once, under its first name."""
    pp_plan = _pp_plan(model, plan)
    return {fqn: _owner(fqn, ranges, pp_plan) for fqn, _ in model.named_parameters()}


def _check_ties(model: nn.Module, ranges: list[range], pp_plan: PipelinePlan) -> None:
    """A parameter reachable under two names must belong to one stage: a stage cannot update a
    weight that another rank holds (tied input/output embeddings are the common case)."""
    seen: dict[int, tuple[str, int]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        stage = _owner(fqn, ranges, pp_plan)
        first = seen.setdefault(id(p), (fqn, stage))
        if first[1] != stage:
            fix = (f"Set model.{pp_plan.tied_by}=false" if pp_plan.tied_by else "Untie them") + \
                f" to train with {len(ranges)} pipeline stages (or parallel.pp=1 to keep the tie)"
            raise ValueError(f"{fqn} (stage {stage}) is the same tensor as {first[0]} (stage {first[1]}): tied "
                             f"weights cannot span pipeline stages. {fix}")


def cut_stage(model: nn.Module, ranges: list[range], index: int, *, plan: ParallelPlan | None = None) -> nn.Module:
    """A copy of ``model`` that runs stage ``index`` of ``ranges`` (from :func:`stage_ranges`):
    the plan's ``first`` modules (unless ``index == 0``), its ``last`` modules (unless last) and
    every block outside ``ranges[index]`` are ``nn.Identity()``; parameter names are those of
    ``model``. Only the parts the stage keeps are copied. ``plan``: default, the one registered
    for the model's class. Raises TypeError for a model its plan does not fit (or without one)
    and ValueError when a tied weight spans two stages."""
    pp_plan = _pp_plan(model, plan)
    blocks = model.get_submodule(pp_plan.repeated)
    if sum(len(r) for r in ranges) != len(blocks) or not 0 <= index < len(ranges):
        raise ValueError(f"stage {index} of {len(ranges)} stages over {sum(len(r) for r in ranges)} blocks "
                         f"does not fit a model with {len(blocks)} blocks")
    _check_ties(model, ranges, pp_plan)
    # deepcopy's memo maps what the stage drops to fresh Identity modules, so the copy keeps the
    # ModuleList's indices (block 5 stays block 5) and never copies the dropped weights
    memo: dict[int, Any] = {}
    if index != 0:
        memo.update((id(model.get_submodule(p)), _Zero() if p in pp_plan.zero_when_skipped else _Skipped())
                    for p in pp_plan.first)
    if index != len(ranges) - 1:
        memo.update((id(model.get_submodule(p)), _Skipped()) for p in pp_plan.last)
    for i, block in enumerate(blocks):
        if i not in ranges[index]:
            memo[id(block)] = _Skipped()
    return copy.deepcopy(model, memo)


class _Skipped(nn.Identity):
    """What a stage has in place of a part another stage owns: passes the stream on, called as
    the model calls the part (a block of a Hugging Face model gets keyword arguments too)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            return args[0]
        for key in ("inputs_embeds", "hidden_states"):
            if kwargs.get(key) is not None:
                return kwargs[key]
        raise TypeError(f"a skipped pipeline part was called without its input (keywords: {sorted(kwargs)})")


class _Zero(nn.Identity):
    """In place of a first-stage table whose output the forward adds to the stream (positions):
    adds nothing on the later stages, which receive the sum already made."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x.new_zeros(())


class _StageCall(nn.Module):
    """A stage module run as its plan's ``call`` says (``call(stage, x, first)``), for torch's
    PipelineStage, which passes tensors between stages."""

    def __init__(self, stage: nn.Module, call: Callable[..., Any], first: bool, own_output: bool = False) -> None:
        super().__init__()
        self.stage, self.call, self.first, self.own_output = stage, call, first, own_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.call(self.stage, x, self.first)
        if not (self.own_output and out._is_view()):
            return out
        # The zero-bubble schedules' input pass detaches each stage output in place, which a view
        # refuses: a Hugging Face causal LM's stage without the head returns hidden_states[:, -0:, :]
        # (the slice its head would read), under tensor parallelism a view of the local shard
        base = out._base
        if base.requires_grad == out.requires_grad and (base.shape, base.stride(), base.storage_offset()) == (
                out.shape, out.stride(), out.storage_offset()):
            return base  # the whole of a tensor autograd tracks: the same values and gradient path
        return out.clone()


# -- the pipeline ---------------------------------------------------------------------------------
_TIMED_STAGE: type | None = None


def _timed_stage_class() -> type:
    """PipelineStage that adds up the time spent in this rank's forward and backward compute
    (what is not that, within a step, is bubble and communication), and each pass's CPU time
    by kind (``pass_cpu_s``). Defined on first use because importing
    torch.distributed.pipelining takes about a second."""
    global _TIMED_STAGE
    if _TIMED_STAGE is None:
        from torch.distributed.pipelining import PipelineStage

        def timed(method: Callable, kind: str) -> Callable:
            def run(self: Any, *args: Any, **kwargs: Any) -> Any:
                if self.compute_s is None:
                    return method(self, *args, **kwargs)
                _sync(self.device)
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return method(self, *args, **kwargs)
                finally:
                    _sync(self.device)
                    self.compute_s += time.perf_counter() - t0
                    # CPU time as well as wall time: on a shared machine the wall time of a pass
                    # also counts the time the OS gave this rank's core to other processes
                    full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)  # (chunk, loss, full)
                    name = "I" if kind == "B" and not full else kind
                    self.pass_cpu_s.setdefault(name, []).append(time.thread_time() - c0)

            return run

        def weight_pass(self: Any, bwd_chunk_id: int, last_backward: bool = False) -> None:
            # torch's weight pass (the zero-bubble schedules' W) adds its gradients to p.grad
            # by hand after torch.autograd.grad, so autograd's post-accumulate-grad hooks never
            # fire: kiln's arena optimizer, which learns from them which parameters got a
            # gradient, would skip every one of them in its step. Fire them as autograd would
            # (timed with the pass: it is weight-pass work, about 2% of it on a 2-block GPT stage).
            reached = _weight_pass_parameters(self, bwd_chunk_id)
            PipelineStage.backward_weight_one_chunk(self, bwd_chunk_id, last_backward=last_backward)
            for p in reached:
                for hook in tuple((p._post_accumulate_grad_hooks or {}).values()):
                    hook(p)

        class _TimedStage(PipelineStage):
            compute_s: float | None = None  # None: not timed (build_pipeline(timing=False))
            pass_cpu_s: dict[str, list[float]]  # "F" | "B" | "I" | "W" -> each such pass's CPU seconds
            forward_one_chunk = timed(PipelineStage.forward_one_chunk, "F")
            backward_one_chunk = timed(PipelineStage.backward_one_chunk, "B")
            backward_weight_one_chunk = timed(weight_pass, "W")

        _TIMED_STAGE = _TimedStage
    return _TIMED_STAGE


def _weight_pass_parameters(stage: Any, chunk: int) -> list[nn.Parameter]:
    """The parameters torch's weight pass of micro-batch ``chunk`` will write by hand: those its
    input pass reached (their gradient accumulators are in the saved parameter groups). Stage 0
    runs the whole backward there instead (autograd's own accumulation, hooks and all), and a
    ``dw_builder`` stage its own function: nothing to add for either."""
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

    if stage.stage_index == 0 or stage.dw_builder is not None or chunk not in stage.backward_state:
        return []
    reached = {node for group in stage.backward_state[chunk][1] for node in group["params"]}
    return [p for p in stage.submod.parameters() if p.requires_grad and _get_grad_fn_or_grad_acc(p) in reached]


def _forward_only(schedule: Any) -> Any:
    """``schedule`` (torch's ZB-V, built without a loss) running its forwards only, for evaluation
    over the V placement: torch has no forward-only V schedule, and its V orders cannot run
    without a backward (at the V's turn they hand input gradients between a rank's two stages).
    Forward-only, the order still holds, having lost only waits: its backward actions become
    no-ops, each dropping the receive torch posted for it (an empty one: the stages have no
    backward), which its backward would have collected."""
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, REDUCE_GRAD

    def skip(action: Any, ctx: Any) -> None:
        ctx.schedule_ref.bwd_recv_ops.pop((action.stage_index, action.microbatch_index), None)

    for kind in (BACKWARD_INPUT, BACKWARD_WEIGHT, REDUCE_GRAD):
        schedule.register_custom_function(kind, skip)
    return schedule


def _sync(device: torch.device) -> None:
    if device.type != "cpu":  # host timers only mean something once the device has caught up
        torch.accelerator.synchronize(device)


class _Runner:
    """torch stage objects and one schedule for one (mode, batch shape). Metadata (the shapes
    of the activations sent between stages) is inferred by torch on the first run from the
    first micro-batch, and receive buffers are sized from it, so a new batch shape needs new
    stage objects: they wrap the same modules and cost only that inference."""

    def __init__(self, stages: list[Any], schedule: Any) -> None:
        self.stages, self.schedule = stages, schedule


class Pipeline:
    """This rank's part of a pipeline-parallel model; built by :func:`build_pipeline`.

    Attributes:
        stages: the local stage modules (pruned copies of the model, whole-model FQNs), in
            stage order; build the optimizer over their parameters (:meth:`parameters`).
        stage_indices: their global stage numbers.
        num_stages: stages in the whole pipeline (``pp``, ``pp * virtual_stages`` or ``2 * pp``).
        is_first / is_last: whether this rank holds the first / the last stage.
        last_rank: the pp rank that holds the last stage, where the loss and the logits are
            (``pp - 1``; 0 for the V-shaped schedules, whose last stage comes back to rank 0).
        pp_group / dp_group: the pipeline and data-parallel process groups (dp_group is None
            without data parallelism).
        last_step_timing: after each :meth:`step`, ``{"wall_s", "compute_s", "bubble",
            "pass_cpu_s"}``: seconds of the schedule run, seconds this rank spent in stage
            forward/backward compute (None unless built with ``timing=True``),
            ``1 - compute_s / wall_s``, and ``{(stage, pass): [CPU seconds of each such pass]}``
            with pass ``F``, ``B`` (full backward), ``I`` or ``W`` (input and weight gradients
            apart): the calling thread's CPU time, all of a pass's on the CPU with one intra-op
            thread, and not counting time the OS gave the core to other processes.
            The first step with a new batch shape also runs torch's shape inference; skip it
            when measuring.
    """

    def __init__(self, stages: list[nn.Module], stage_indices: list[int], num_stages: int, *,
                 schedule: str, microbatches: int, loss_fn: Callable[..., torch.Tensor],
                 pp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup | None,
                 device: torch.device, timing: bool, call: Callable[..., Any] | None = None) -> None:
        self.stages, self.stage_indices, self.num_stages = stages, stage_indices, num_stages
        self.call = call  # the plan's way to run a stage (None: stage(x))
        self.schedule, self.microbatches, self.loss_fn = schedule, microbatches, loss_fn
        self.pp_group, self.dp_group, self.device, self.timing = pp_group, dp_group, device, timing
        self.pp_size, self.pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        self.is_first, self.is_last = 0 in stage_indices, num_stages - 1 in stage_indices
        self.last_rank = stage_ranks(self.pp_size, schedule, len(stage_indices))[-1]
        self.last_step_timing: dict[str, float | None] = {}
        self._runners: dict[tuple, _Runner] = {}
        self._scaled_loss = _ScaledLoss(loss_fn, microbatches)

    # -- parameters -----------------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(FQN in the whole model, parameter)`` for every parameter of the local stages."""
        for stage in self.stages:
            yield from stage.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def state_dict(self) -> dict[str, Any]:
        """The local stages' state, keyed by whole-model FQNs (disjoint across pp ranks)."""
        out: dict[str, Any] = {}
        for stage in self.stages:
            out.update(stage.state_dict())
        return out

    # -- running --------------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one batch through the schedule: ``inputs`` (B, T) enter the
        first stage, ``targets`` meet the logits at the last. Gradients accumulate into
        ``p.grad`` of the local stages and equal those of the mean loss over the batch.
        Returns that mean loss (0-dim float32, detached) on every pp rank."""
        shape = self._agree(inputs, targets, need_targets=True)
        runner = self._runner("train", shape)
        losses: list[torch.Tensor] = []
        for stage in runner.stages:
            stage.compute_s = 0.0 if self.timing else None
            stage.pass_cpu_s = {}
        t0 = time.perf_counter()
        target = targets.to(self.device) if self.is_last else None
        runner.schedule.step(*self._args(inputs), target=target, losses=losses, return_outputs=False)
        if self.timing:
            _sync(self.device)
        wall = time.perf_counter() - t0
        compute = sum(s.compute_s for s in runner.stages) if self.timing else None
        self.last_step_timing = {"wall_s": wall, "compute_s": compute,
                                 "bubble": None if compute is None else max(0.0, 1.0 - compute / wall),
                                 "pass_cpu_s": {(s.stage_index, kind): times for s in runner.stages
                                                for kind, times in s.pass_cpu_s.items()} if self.timing else None}
        if self.is_last:
            # each micro-batch loss is already divided by M (see _ScaledLoss): their sum is the mean
            loss = torch.stack([x.detach().double() for x in losses]).sum()  # fp64: exact in fp64 runs
        else:
            loss = torch.empty((), dtype=torch.float64, device=self.device)
        if self.pp_size > 1:
            dist.broadcast(loss, group_src=self.last_rank, group=self.pp_group)
        return loss

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward only, for evaluation: the stages run in eval mode (dropout off; their
        training flags are restored after) and without autograd. Returns the logits (B, T, V)
        on the rank with the last stage and None on the others; compute metrics there and
        share them with :meth:`share_from_last`. Any batch size works (the micro-batch count
        is the largest divisor of B not above ``microbatches``)."""
        shape = self._agree(inputs, None, need_targets=False)
        runner = self._runner("eval", shape)
        was_training = [s.training for s in self.stages]
        for stage in self.stages:
            stage.eval()
        try:
            for stage in runner.stages:
                stage.compute_s = None
            out = runner.schedule.step(*self._args(inputs), return_outputs=True)
        finally:
            for stage, mode in zip(self.stages, was_training):
                stage.train(mode)
        return out if self.is_last else None

    def share_from_last(self, obj: Any) -> Any:
        """``obj`` as the rank with the last stage has it, on every pp rank (any picklable
        value, e.g. a dict of eval metrics; other ranks pass anything)."""
        if self.pp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group_src=self.last_rank, group=self.pp_group, device=self.device)
        return box[0]

    # -- machinery ------------------------------------------------------------------------------
    def _args(self, inputs: torch.Tensor | None) -> tuple:
        return (inputs.to(self.device),) if self.is_first else ()

    def _agree(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, need_targets: bool) -> tuple:
        """The batch shape, as the first stage's rank sees it, on every pp rank, with missing
        inputs or targets reported on every rank (one 10-int all-reduce): a rank that raised
        alone would leave the others waiting in the schedule. Only the first stage sees the
        inputs, and the other ranks need the shape to size their receive buffers."""
        if self.pp_size > 1 and dist.get_backend(self.pp_group) == "fake" and isinstance(inputs, torch.Tensor):
            # kiln plan's dry run: a fake group carries no values, and every rank of the
            # trainer passes the batch, so this rank's inputs give the shape
            return tuple(inputs.shape)
        info = torch.zeros(10, dtype=torch.int64)  # [no inputs, no targets, ndim, *shape]
        if self.is_first:
            if not isinstance(inputs, torch.Tensor) or not 1 <= inputs.dim() <= 7:
                info[0] = 1
            else:
                info[2] = inputs.dim()
                info[3:3 + inputs.dim()] = torch.tensor(inputs.shape)
        if self.is_last and need_targets and not isinstance(targets, torch.Tensor):
            info[1] = 1
        if self.pp_size > 1:
            on = info.to(self.device) if dist.get_backend(self.pp_group) != "gloo" else info
            dist.all_reduce(on, op=dist.ReduceOp.MAX, group=self.pp_group)
            info = on.cpu()
        values = info.tolist()
        if values[0]:
            raise ValueError("Pipeline: the rank holding the first stage (pp rank 0) got no inputs tensor; "
                             "pass the batch's inputs there (other ranks may pass them or None)")
        if values[1]:
            raise ValueError(f"Pipeline.step: the rank holding the last stage (pp rank {self.last_rank}) got "
                             f"no targets; pass the batch's targets there (other ranks may pass None)")
        shape = tuple(values[3:3 + values[2]])
        if need_targets and shape[0] % self.microbatches:
            raise ValueError(f"Pipeline.step: a batch of {shape[0]} does not split into {self.microbatches} "
                             f"equal micro-batches; use batches whose size is a multiple of {self.microbatches} "
                             f"(e.g. drop the last, smaller batch)")
        return shape

    def _runner(self, mode: str, shape: tuple) -> _Runner:
        key = (mode, shape)
        runner = self._runners.get(key)
        if runner is None:
            if len(self._runners) >= _MAX_RUNNERS:  # every rank sees the same shapes: evicts alike
                del self._runners[next(iter(self._runners))]
            runner = self._runners[key] = self._build_runner(mode, shape[0])
        return runner

    def _build_runner(self, mode: str, batch: int) -> _Runner:
        from torch.distributed import pipelining

        stage_cls = _timed_stage_class()
        run = [module if self.call is None else _StageCall(module, self.call, first=index == 0,
                                                           own_output=SCHEDULES[self.schedule].split_backward)
               for module, index in zip(self.stages, self.stage_indices)]
        stages = [stage_cls(module, index, self.num_stages, self.device, group=self.pp_group)
                  for module, index in zip(run, self.stage_indices)]
        placement = SCHEDULES[self.schedule].placement
        if mode == "train":
            m, loss_fn = self.microbatches, self._scaled_loss
            cls = getattr(pipelining, SCHEDULES[self.schedule].torch_class)
        else:
            # forward only: without backward 1F1B is GPipe's fill-and-drain, and GPipe (single
            # stage per rank) takes any micro-batch count; the looped schedules keep their rounds
            # rule (Interleaved1F1B runs their forward), ZB-V's order any count
            m = max(d for d in range(1, min(batch, self.microbatches) + 1) if batch % d == 0
                    and (placement != "loop" or d % max(1, d // self.pp_size) == 0))
            cls = {"one": pipelining.ScheduleGPipe, "loop": pipelining.ScheduleInterleaved1F1B,
                   "v": pipelining.ScheduleZBVZeroBubble}[placement]  # (V: see _forward_only)
            loss_fn = None  # no loss: the schedule runs no backward
        # scale_grads=False: torch would divide every p.grad by M after the backward (a loop over
        # tensors, and wrong for gradients accumulated over several step() calls); the loss of
        # each micro-batch is divided by M instead (_ScaledLoss), which gives the gradient of the
        # batch mean when loss_fn returns a micro-batch mean and micro-batches are equal.
        schedule = cls(stages if placement != "one" else stages[0], n_microbatches=m, loss_fn=loss_fn,
                       scale_grads=False)
        if mode == "eval" and placement == "v":
            schedule = _forward_only(schedule)
        return _Runner(stages, schedule)


class _ScaledLoss:
    """``loss_fn(logits, targets) / M`` for torch's schedule, which calls it once per
    micro-batch with that micro-batch's logits and targets (it splits ``targets`` along
    dim 0 as it splits the inputs)."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], microbatches: int) -> None:
        self.loss_fn, self.microbatches = loss_fn, microbatches

    def __call__(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        return self.loss_fn(output, target) / self.microbatches


def _groups(pp_group_or_mesh: Any) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    if pp_group_or_mesh is None:
        return dist.group.WORLD, None
    if isinstance(pp_group_or_mesh, dist.ProcessGroup):
        return pp_group_or_mesh, None
    mesh = pp_group_or_mesh  # a DeviceMesh
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1 and (not names or names == ("pp",)):
        return mesh.get_group(), None
    if "pp" not in names or any(n not in ("pp", "dp") for n in names):
        raise ValueError(f"build_pipeline: a mesh with dimensions {names or mesh.ndim} is not a pipeline "
                         f"mesh; build it as init_device_mesh(device, (pp, dp), mesh_dim_names=('pp', 'dp'))")
    return mesh.get_group("pp"), mesh.get_group("dp") if "dp" in names else None


def _to_device(stage: nn.Module, device: torch.device) -> nn.Module:
    """``stage`` on ``device``; parameters still on meta (weights read once laid out) stay there,
    without memory. A stage already there is left alone: kiln plan's fake tensors cannot be
    re-wrapped by ``Module._apply``."""
    tensors = [*stage.parameters(), *stage.buffers()]
    if all(t.is_meta or t.device == device for t in tensors):
        return stage
    return stage._apply(lambda t: t if t.is_meta else t.to(device))


def build_pipeline(model: nn.Module, pp_group_or_mesh: Any = None, *, schedule: str, microbatches: int,
                   loss_fn: Callable[..., torch.Tensor], sizes: list[int] | None = None,
                   virtual_stages: int = 2, device: torch.device | str = "cpu",
                   timing: bool = False, plan: ParallelPlan | None = None) -> Pipeline:
    """Cut ``model`` into pipeline stages and return this rank's :class:`Pipeline`.

    Args:
        model: the whole model, built identically (same seed) on every rank; not modified.
        pp_group_or_mesh: the pipeline process group, a 1-D mesh, or a mesh with dimensions
            ``("pp", "dp")`` (gradients are then averaged over ``pipe.dp_group`` by the caller,
            see the module docstring); None: the whole world is one pipeline.
        schedule: a name in :data:`SCHEDULES` (``gpipe``, ``1f1b``, ``interleaved-1f1b``,
            ``interleaved-zb``, ``zbv``, ``dualpipev``).
        microbatches: M, the micro-batches each batch is split into (along dim 0).
        loss_fn: ``loss_fn(logits, targets) -> mean loss of one micro-batch``; it is called
            once per micro-batch with that micro-batch's slice of ``targets``.
        sizes: blocks per stage (``parallel.pp_stages``); default: :func:`stage_ranges`.
        virtual_stages: stages per rank for the looped schedules (``interleaved-1f1b``,
            ``interleaved-zb``; the V-shaped ones have two, the others one).
        device: where the stages run (they are copied there).
        timing: measure this rank's stage compute time per step (``pipe.last_step_timing``);
            on an accelerator that synchronises the device around every micro-batch.
        plan: the :class:`~kiln.models.ParallelPlan` whose pipeline plan says where the stages
            cut (default: the one registered for the model's class).

    Shapes between stages are not declared: torch 2.13's ``PipelineStage`` infers them
    (``input_args``/``output_args`` left None) from the first micro-batch on the first step,
    one extra forward (and, in training, a backward to the inputs only) per batch shape.
    Collective over the pp group only on the first step, not here.
    """
    schedule = _check_schedule(schedule)
    pp_group, dp_group = _groups(pp_group_or_mesh)
    pp, rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    pp_plan = _pp_plan(model, plan)
    depth = len(model.get_submodule(pp_plan.repeated))
    # the batch is not known yet (step() checks it): pass one that microbatches divides
    check_pipeline(depth, pp, schedule, microbatches, microbatches, sizes, virtual_stages=virtual_stages)
    num_stages = _num_stages(pp, schedule, virtual_stages)
    ranges = stage_ranges(depth, num_stages, sizes)
    _check_ties(model, ranges, pp_plan)
    device = torch.device(device)
    indices = [s for s, r in enumerate(stage_ranks(pp, schedule, virtual_stages)) if r == rank]
    stages = [_to_device(cut_stage(model, ranges, i, plan=plan), device) for i in indices]
    return Pipeline(stages, indices, num_stages, schedule=schedule, microbatches=microbatches, loss_fn=loss_fn,
                    pp_group=pp_group, dp_group=dp_group, device=device, timing=timing, call=pp_plan.call)
