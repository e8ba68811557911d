"""Everything a run needs before its first step: :func:`setup` builds it and, when resuming,
puts it back exactly where the checkpoint left off. What it returns, :class:`Run`, is what
``loop.py`` works on; what one step uses of it is a :class:`StepContext`.

A rank is built by a short list of stages, each a function of the config and of what the
stages before it returned (torchtitan's ``Trainer.__init__``: device, model, parallelize,
optimizer, data)::
    place = join(cfg)                                    # process group, layout, device, seed
    precision = Precision(cfg.train.precision, place.device)
    data, total_steps = load_data(cfg, place)            # loaders, checked against the steps
    built = make_model(cfg, place, precision, data)      # the whole model and its task
    cfg = settle_precision(cfg, place, precision, built, data, resumed)   # train.precision=auto
    par = lay_out(cfg, place, built, precision)        # AC, chunked head, pp, tp, FSDP2, weights
    optimizer = make_optimizer(cfg, place, precision, par)   # + master weights, ZeRO-1/2
    step = step_context(cfg, place, precision, built, par, optimizer, total_steps)
    run.start_step, run.batches = restore(run, resumed)  # fresh, or where the checkpoint left off
    run.out, run.loggers, run.progress = open_run_dir(run, out, resumed, ...)

``kiln plan`` (:mod:`kiln.plan`) traces a rank on fake tensors through the same functions; it
skips only what has no meaning in a dry run, by not calling it (see :func:`setup`).

Everything that can be wrong with the config is checked before anything is built (kiln.config,
then the layout, the plan of steps and the model), and everything is built before the run
directory is created or reopened, so a bad run leaves no half-made directory behind.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import math
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from kiln._version import __version__
from kiln.compile import apply_compile
from kiln.config import save_config
from kiln.errors import ConfigError
from kiln.hardware import machine_line
from kiln.hf import deferred_weights, load_inner_weights, load_weights, materialize, meta_parameters, weights_source
from kiln.memory import apply_ac
from kiln.optim import has_arena
from kiln.parallel import Parallel, broadcast_parameters, init_distributed, parallelize
from kiln.precision import Precision
from kiln.precision.auto import AutoChoice, CANDIDATES, choose_for_model, rule, same_random
from kiln.train._batches import Batches, step_plan, steps_per_epoch
from kiln.train._build import (
    Data, build_data, build_model, build_optimizer, build_scheduler, build_task, check_model, pick_device,
    seed_everything,
)
from kiln.train._callbacks import EarlyStopping
from kiln.train._checkpoint import checkpoint_to_resume, load_into, plain, set_rng_state
from kiln.train._chunked_loss import AUTO_MIN_BYTES, apply_chunked_head, chunked_head_path
from kiln.train._loggers import Loggers, check_loggers
from kiln.train._mfu import Mfu
from kiln.train._progress import Progress
from kiln.train._ranks import NullRun, broadcast_path, check_layout, mean_over_ranks
from kiln.train._tasks import Task, loss_from_logits, micro_batch_loss, to_device
from kiln.train._tensor_peak import TensorMemory
from kiln.train.run_dir import CONFIG, RunDir, RunLock


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this run: allocated CUDA memory, or the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


_FOLD_EVERY = 256  # step losses a log window holds on the device before they are summed


@dataclass
class Meter:
    """Counters of a run that a checkpoint carries over: the open log window and the totals."""

    device: torch.device
    window_loss: float = 0.0  # sum of the window's step losses folded in so far (fp64, in step order)
    window_steps: int = 0
    # the window's step losses not yet folded in: 0-d tensors as the step left them on the
    # device, so that a step adds no tensor op and no wait to the loop (add_loss)
    window_pending: list[torch.Tensor] = field(default_factory=list)
    window_samples: int = 0  # samples_seen when the window opened
    samples_seen: int = 0
    train_seconds: float = 0.0  # time in steps, without evaluation, logging and compiling
    timed_samples: int = 0  # the samples of those steps (not the compiling first step's)
    elapsed_before: float = 0.0  # wall time of the runs this one resumes
    wall_start: float = field(default_factory=time.perf_counter)
    window_start: float = field(default_factory=time.perf_counter)

    def add_loss(self, loss: torch.Tensor) -> None:
        """A step's loss (a detached 0-d tensor) into the open log window."""
        self.window_pending.append(loss)
        self.window_steps += 1
        if len(self.window_pending) >= _FOLD_EVERY:  # a long log window: bounded memory, one wait
            self.window_sum()

    def window_sum(self) -> float:
        """The sum of the window's step losses. The pending ones are added in step order as
        Python floats, which are IEEE doubles: the same bits as adding each step's loss into an
        fp64 tensor on the device, with one stack and one wait for the device per window."""
        if self.window_pending:
            total = self.window_loss
            for value in torch.stack(self.window_pending).tolist():
                total += value
            self.window_loss = total
            self.window_pending.clear()
        return self.window_loss

    def window_mean(self, world: int) -> float:
        """The window's mean step loss, averaged over the ``world`` ranks (a collective then)."""
        mean = self.window_sum() / self.window_steps if self.window_steps else math.nan  # (as torch's 0/0)
        if world > 1:
            mean = mean_over_ranks(torch.tensor(mean, dtype=torch.float64, device=self.device), world).item()
        return mean

    def close_window(self) -> None:
        self.window_sum()  # (nothing left pending)
        self.window_loss, self.window_steps, self.window_samples = 0.0, 0, self.samples_seen

    def wall_seconds(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.wall_start

    def restart_clock(self) -> None:
        """Time the open window from now, without the samples seen so far (after compiling)."""
        self.window_start, self.window_samples = time.perf_counter(), self.samples_seen

    def state_dict(self) -> dict[str, Any]:
        return {"window": {"loss": self.window_sum(), "steps": self.window_steps},
                "totals": {"train_seconds": self.train_seconds, "samples_seen": self.samples_seen,
                           "timed_samples": self.timed_samples, "wall_seconds": self.wall_seconds()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        totals = state["totals"]
        self.window_loss += float(state["window"]["loss"])
        self.window_steps = state["window"]["steps"]
        self.train_seconds = totals["train_seconds"]
        self.samples_seen = self.window_samples = totals["samples_seen"]
        self.timed_samples = totals.get("timed_samples", self.samples_seen)  # (checkpoints before it)
        self.elapsed_before = totals["wall_seconds"]


@dataclass
class Place:
    """Where this process stands in the run: its rank of ``world``, its coordinates in the
    ``dp x tp x pp`` layout, the device it computes on. What :func:`join` returns; ``kiln plan``
    makes one for each rank it traces, in its fake process group."""

    rank: int
    world: int
    layout: Any  # kiln.parallel.Layout: dp x tp x pp
    device: torch.device
    owns_group: bool = False  # join started the process group: the run ends it

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)  # {"pp": .., "dp": .., "tp": ..}

    @property
    def main(self) -> bool:
        return self.rank == 0


@dataclass
class Built:
    """What :func:`make_model` returns: the model (the whole model on this rank's device until
    :func:`lay_out` replaces it with this rank's part), how a batch becomes its loss, and the
    Hugging Face directory whose weights are read once it is laid out."""

    model: nn.Module
    task: Task
    weights: str | None
    parameters: int  # of the whole model, before any sharding


@dataclass(kw_only=True)
class StepContext:
    """What :func:`kiln.train.loop.train_step` uses, and nothing more; ``kiln train``'s
    :class:`Run` is one, ``kiln plan``'s dry run builds one alone (:func:`step_context`)."""

    device: torch.device
    dp: int  # data-parallel ranks: a micro-batch's loss is averaged over them
    precision: Precision
    task: Task  # how a batch becomes a loss, and the eval metrics
    par: Parallel  # this rank's part of the model and the layout's pieces of a step
    model: nn.Module  # what forward calls: par.model, compiled with train.compile
    optimizer: Any  # kiln's optimizer, or ZeRO-1/2 around it
    scheduler: Any
    meter: Meter
    clip_grad_norm: float | None = None  # train.clip_grad_norm, read once (the step reads no config)


@dataclass(kw_only=True)
class Run(StepContext):
    """One rank's view of a run: its step (the :class:`StepContext`), what it trains on, and
    where it writes. The later stages of :func:`setup` fill the fields that default to None."""

    cfg: Any
    rank: int
    world: int
    layout: Any  # kiln.parallel.Layout: dp x tp x pp
    data: Data
    total_steps: int
    parameters: int  # of the whole model, before any sharding
    memory: TensorMemory  # the peak of live tensor bytes over the first steps
    mfu: Mfu  # FLOPs per step (counted on the first) against the devices' peak
    best: EarlyStopping | None = None  # tracks the best evaluation, for checkpoints/best
    stopper: EarlyStopping | None = None  # the same object when early stopping is on
    start_step: int = 0  # steps done: 0, or the checkpoint's (restore)
    batches: Batches = None  # whole steps of data, from start_step on (restore)
    out: RunDir | NullRun = None  # the run directory (rank 0), or a stand-in that writes nothing (open_run_dir)
    progress: Progress = None
    loggers: Loggers = None  # rank 0's TensorBoard, W&B, MLflow (train.loggers); none on other ranks
    compile_seconds: float | None = None
    first_step_seconds: float | None = None  # the process's first step, left out of samples/s
    owns_group: bool = False  # setup started the process group: the run ends it
    last_train_loss: float = float("nan")
    last_eval: dict[str, float] = field(default_factory=dict)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def plain_model(self) -> nn.Module:
        """The model without compile's wrapper: what checkpoints read and write."""
        return self.par.model


def setup(cfg: Any, *, name: str = "run", resume: Path | str | None = None,
          run_dir: Path | str | None = None) -> Run:
    """Build the run ``cfg`` describes on this rank; ``resume=RUN_DIR`` continues that run from
    its newest checkpoint, in its directory; ``run_dir`` names a new, empty run directory
    instead of creating one under ``train.output_dir``.

    A rank is built by these stages, in this order, each a function of the config and of what
    the stages before it returned. ``kiln plan`` builds each rank it traces by the same
    functions, on fake tensors; it calls neither :func:`join` (its fake process group stands in),
    nor :func:`settle_precision` (a measurement of speed), nor :func:`restore` and
    :func:`open_run_dir` (a dry run resumes nothing and writes nothing)."""
    started = time.perf_counter()
    place = join(cfg)  # device and process group
    # Python's generator as the seed left it. A module imported while the run is built may draw
    # from it at import (rich.style does, which scikit-learn imports with the digits): whether it
    # draws depends on what this process imported before, so the run starts from this state.
    seeded = random.getstate()
    if place.main:
        check_loggers(cfg.train.loggers)  # rank 0 alone logs: a logger that cannot start stops the run now
    out = RunDir.open(Path(resume)) if resume is not None and place.main else None  # locked first: RunDirBusy
    try:
        resumed = checkpoint_to_resume(Path(resume), cfg) if resume is not None else None
        # an explicit bf16/fp16 mode on hardware that emulates it warns, once; train.precision=auto
        # is fp32 or bf16-mixed, which build everything alike: settled once the model exists
        precision = Precision(cfg.train.precision, place.device)
        data, total_steps = load_data(cfg, place)
        built = make_model(cfg, place, precision, data)
        cfg = settle_precision(cfg, place, precision, built, data, resumed)
        par = lay_out(cfg, place, built, precision, resuming=resumed is not None)
        optimizer = make_optimizer(cfg, place, precision, par)
        step = step_context(cfg, place, precision, built, par, optimizer, total_steps)
        if cfg.train.compile:
            step.model = apply_compile(step.model)  # compiles lazily: the first step pays for it
        if resumed is not None:
            check_extends(Path(resume), resumed[1]["step"], total_steps)
            _check_schedule_length(cfg, resumed[1]["scheduler"], total_steps)
        step.meter.wall_start = started
        run = Run(**vars(step), cfg=cfg, rank=place.rank, world=place.world, layout=place.layout, data=data,
                  total_steps=total_steps, parameters=built.parameters, owns_group=place.owns_group,
                  memory=TensorMemory(place.device, (par.model, step.optimizer), enabled=cfg.train.measure_memory),
                  mfu=Mfu(place.device, precision, place.world, place.layout.tp, main=place.main),
                  **_watchers(cfg.train))
        run.start_step, run.batches = restore(run, resumed)
        kept = seeded if resumed is None else random.getstate()  # (resumed: the checkpoint's)
        run.out, run.loggers, run.progress = open_run_dir(run, out, resumed, name=name, run_dir=run_dir)
        random.setstate(kept)
        return run
    except BaseException:
        if out is not None:
            out.close()  # rewrote nothing: the run keeps the summary it had
        raise


def join(cfg: Any) -> Place:
    """The first stage: this process's threads, its place in the process group (joined here,
    from torchrun's environment), the layout checked against the world, batch and model, its
    device, and the seed, the same on every rank (identical initial weights)."""
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    # a process group the caller made (its own script, a test) stays up after the run
    owns_group = not (dist.is_available() and dist.is_initialized())
    rank, world = init_distributed(cfg.parallel.timeout_s)
    layout = check_layout(cfg, world)  # dp x tp x pp, checked against the batch and the model
    device = pick_device(tc.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", torch.cuda.current_device())  # init_distributed chose LOCAL_RANK
    seed_everything(tc.seed)
    return Place(rank, world, layout, device, owns_group=owns_group and world > 1)


def load_data(cfg: Any, place: Place, build: Callable[..., Data] = build_data) -> tuple[Data, int]:
    """The loaders of this rank (the ranks of one data-parallel replica, its tp and pp ranks,
    read the same samples), checked against the plan of steps, and the run's length in steps.
    ``build``: :func:`kiln.train._build.build_data`, or ``kiln plan``'s cache of its results."""
    tc = cfg.train
    data = build(cfg.data, seed=tc.seed, accumulate=tc.accumulate, device=place.device,
                 rank=place.coords["dp"], world_size=place.layout.dp)
    per_epoch = steps_per_epoch(data.train, tc.accumulate)
    _check_steps(cfg, data, place.layout, per_epoch)
    return data, tc.max_steps if tc.max_steps is not None else tc.epochs * per_epoch


def make_model(cfg: Any, place: Place, precision: Precision, data: Data, *, dry: bool = False) -> Built:
    """The whole model on this rank's device, in the precision's parameter dtype, checked
    against the config, and its task. A ``kiln.hf.from_pretrained`` model keeps its parameters
    on ``meta`` (its weights are read once it is laid out); one inside a module of the user's
    is read now, whole. ``dry`` (``kiln plan``'s dry run): every parameter is built on ``meta``
    (no memory, no initialisation: the plan makes them fake tensors) and no weight is read."""
    # kiln.hf.from_pretrained: parameters on meta, its weights read once laid out
    with deferred_weights(), meta_parameters() if dry else contextlib.nullcontext():
        model = build_model(cfg.model)
    weights = None if dry else weights_source(model)  # the local directory they come from, or None
    if not dry and weights is None:
        load_inner_weights(model)  # from_pretrained inside a module of the user's: read whole, now
    model = _to(model, place.device, precision.param_dtype)
    check_model(cfg, model)
    task = build_task(cfg, data, model)
    return Built(model, task, weights, parameters=sum(p.numel() for p in model.parameters()))


def settle_precision(cfg: Any, place: Place, precision: Precision, built: Built, data: Data,
                     resumed: Any) -> Any:
    """``train.precision=auto``'s answer, fp32 or bf16-mixed (:mod:`kiln.precision.auto`): a
    resumed run's checkpoint's mode, the rule's, or rank 0's measurement of the whole model
    (before it is laid out: its passes then need no collective), given to every rank. Returns
    the config with the answer, which config.yaml records (a rerun from it does not measure);
    other modes return ``cfg`` as it is."""
    if precision.requested != "auto":
        return cfg

    if resumed is not None and resumed[1].get("precision", {}).get("mode") in CANDIDATES:
        # never measured again: a resumed run goes on in the mode it trained in
        choice = AutoChoice(resumed[1]["precision"]["mode"], "checkpoint", f"as {resumed[0].name} trained")
    else:
        # the same on every rank; measured where one GPU holds the whole model
        choice = rule(place.device, whole_model=place.layout.tp == place.layout.pp == 1 and cfg.parallel.zero < 3)
    if choice is None:
        choice = _measure_precision(cfg, place, built, data) if place.main else None
        if place.world > 1:
            box = [choice]
            dist.broadcast_object_list(box, src=0)  # the others wait here while rank 0 measures
            choice = box[0]
    precision.settle(choice)
    cfg = copy.deepcopy(cfg)  # (not the caller's)
    cfg.train.precision = precision.mode
    return cfg


def lay_out(cfg: Any, place: Place, built: Built, precision: Precision, *, resuming: bool = False) -> Parallel:
    """This rank's part of the built model, as the config lays it out: float8 linears
    (``train.precision=fp8``), activation checkpointing, the chunked LM head (``built.task.head``, where ``train.chunked_lm_loss``
    applies), pipeline stages, tensor parallel, FSDP2, and the weights read from
    ``built.weights`` (not when ``resuming``: the checkpoint fills them). From here on
    ``built.model`` is this rank's part (``par.model``): a pipeline rank drops the others'."""
    tc, model, task, layout = cfg.train, built.model, built.task, place.layout
    precision.convert(model)  # fp8: the linears become float8 ones, before anything wraps or splits them
    if tc.activation_checkpointing != "none":
        apply_ac(model, tc.activation_checkpointing, every=tc.ac_every, blocks=tc.ac_blocks)
    # a causal LM's head and loss in chunks of rows (kiln/train/_chunked_loss.py): the model
    # returns the hidden states its output projection took, and the task's loss makes the logits
    head = chunked_head_path(cfg, model, task.kind, layout.pp)
    if head is not None:
        task.head = apply_chunked_head(model, head, min_bytes=AUTO_MIN_BYTES if tc.chunked_lm_loss == "auto" else 0)
    # Pipeline stages, then tensor parallel, then (zero=3) FSDP2 over the dp ranks; par.model
    # is this rank's part, under the whole model's parameter names. The pipeline schedule
    # calls the loss itself, once per micro-batch: divided by K, as train_step divides it.
    pc = cfg.parallel
    par = parallelize(model, layout, zero=pc.zero, sequence_parallel=pc.sequence_parallel,
                      pp_schedule=pc.pp_schedule, microbatches=pc.microbatches, pp_stages=pc.pp_stages,
                      device=place.device, chunked_head=head is not None,
                      loss_fn=lambda logits, targets: loss_from_logits(logits, targets) / tc.accumulate)
    if built.weights is not None and not resuming:
        # each rank reads from the safetensors files only the part of each tensor it holds
        load_weights(par.model, built.weights, device=place.device)
    elif built.weights is not None:
        materialize(par.model, place.device)  # the checkpoint fills it (restore)
    built.model = par.model
    return par


def make_optimizer(cfg: Any, place: Place, precision: Precision, par: Parallel) -> Any:
    """kiln's optimizer over this rank's part of the model, precision's master weights, and
    the data-parallel side: ZeRO-1/2 or the gradient reducer. Returns the optimizer the step
    uses (ZeRO's wrapper)."""
    tc, pc, layout, coords = cfg.train, cfg.parallel, place.layout, place.coords
    # FSDP2 and tensor parallelism hold DTensors: the optimizer steps them in multi-tensor mode
    # (there is no one flat arena to slice)
    optimizer = build_optimizer(cfg.optim, par.model, contiguous=None if par.arena else False)
    precision.attach(par.model, optimizer)  # bf16-true: the model becomes bf16, fp32 masters stay
    if place.world == 1:
        return optimizer
    if par.arena and layout.dp > 1:  # (FSDP2 and TP kept each rank's part of identical, same-seed weights)
        broadcast_parameters(optimizer, group=par.dp_group)  # replica 0's weights in every replica
    # each replica and stage its own dropout masks; the tp ranks of one replica the same ones,
    # as they hold the same activations
    torch.manual_seed(tc.seed + coords["dp"] + layout.dp * coords["pp"])
    # Gradient buckets reduced during the last micro-batch's backward (train_step's
    # sync_gradients), not after it: not under a pipeline, whose schedule runs many backwards,
    # nor bf16-true, whose gradients reach the masters only after backward; and only on kiln's
    # arena, whose flat gradient the buckets slice (kiln.optim.ARENA_FEATURES: not required,
    # left out with no error where there is no arena)
    overlap = bool(pc.overlap_grad_reduce and layout.pp == 1 and precision.masters is None and has_arena(optimizer))
    # ZeRO-1/2: each rank keeps the optimizer state (and, stage 2, the gradient) of one
    # contiguous shard of every arena; from here on only the wrapper is used
    optimizer = par.data_parallel(optimizer, overlap=overlap)
    if layout.dp > 1 and pc.zero in (1, 2):
        if overlap and pc.overlap_param_gather and not tc.compile:
            # (compiled, the per-module waits would break the graphs; evaluation's forward and
            # the checkpoint's reads wait too)
            optimizer.overlap_param_gather(par.model)
        precision.wrap(optimizer)  # bf16-true: the masters are now stepped through ZeRO
    return optimizer


def step_context(cfg: Any, place: Place, precision: Precision, built: Built, par: Parallel, optimizer: Any,
                 total_steps: int) -> StepContext:
    """What a step uses: the stages' results, the learning-rate schedule over ``total_steps``
    and a fresh :class:`Meter`."""
    return StepContext(device=place.device, dp=place.layout.dp, precision=precision, task=built.task, par=par,
                       model=par.model, optimizer=optimizer,
                       scheduler=build_scheduler(cfg.optim, optimizer, total_steps), meter=Meter(place.device),
                       clip_grad_norm=cfg.train.clip_grad_norm)


def restore(run: Run, resumed: Any) -> tuple[int, Batches]:
    """The run's state: fresh, or exactly where the checkpoint ``resumed`` left off (weights
    and optimizer state, schedule, loss scale, best evaluation, counters, data position, RNG).
    Returns the steps done and the batches from there on."""
    start_step, epoch, in_epoch = 0, 0, 0  # resume point: steps done, epoch, steps into it
    if resumed is not None:
        ckpt = resumed[1]
        # every rank reads its part of each tensor, however this run shards it; into the
        # arena in place (never assign=True)
        load_into(resumed[0], run.par.model, run.optimizer, run.precision)
        run.scheduler.load_state_dict(ckpt["scheduler"])
        run.precision.load_state_dict(ckpt["precision"])
        if run.best is not None and ckpt.get("best"):
            run.best.load_state_dict(ckpt["best"])
        start_step, epoch, in_epoch = ckpt["step"], ckpt["data"]["epoch"], ckpt["data"]["step"]
        run.meter.load_state_dict(ckpt)
    # whole steps of data.batch_size samples; replays the steps of the epoch already done
    batches = Batches(run.data.train, run.cfg.train.accumulate, run.cfg.data.batch_size, epoch, in_epoch)
    if resumed is not None:  # after the replay, which may have drawn random numbers
        per_rank = resumed[1]["rng"]
        set_rng_state(per_rank[run.rank] if len(per_rank) == run.world else per_rank[0])
    return start_step, batches


def open_run_dir(run: Run, out: RunDir | None, resumed: Any, *, name: str,
                 run_dir: Path | str | None) -> tuple[RunDir | NullRun, Loggers, Progress]:
    """The last stage, once everything is built: the run directory (rank 0 creates it, or
    reopens ``out``, the resumed run's; the other ranks only learn where it is), its
    config.yaml, summary.json and metrics.csv, the loggers and the progress display. A stop
    from here on (Ctrl-C included) is recorded in summary.json, as in the loop."""
    tc, device, precision = run.cfg.train, run.device, run.precision
    if not run.main:
        out = NullRun(broadcast_path(None))  # rank 0 alone writes; the others only learn where
    elif resumed is None:
        # summary.json says "running" before anything else is in the directory
        out = RunDir.open(Path(run_dir)) if run_dir is not None else RunDir.create(tc.output_dir, tc.run_name or name)
    try:
        if run.main:
            broadcast_path(out.path)
            _write_start(run, out, resumed)
        out.open_metrics(["step", "epoch", "train_loss", "lr", "grad_norm", "loss_scale", "skipped_steps",
                          "samples_per_second", "mfu", "peak_memory_mb", "wall_seconds",
                          *(f"eval_{m}" for m in run.task.metric_names())])
        # rank 0 alone logs; a resumed run continues the logged runs RUN_DIR/loggers.json names
        loggers = Loggers.open(tc.loggers, out.path, plain(run.cfg), resumed=resumed is not None) if run.main \
            else Loggers()
        progress = Progress(run.total_steps, mode=tc.progress if run.main else "none", initial=run.start_step)
        shown_layout = f", {run.world} processes ({run.layout})" if run.world > 1 else ""
        shown_precision = f"{precision.mode} (auto)" if precision.auto is not None else precision.mode
        if precision.auto is not None:
            progress.message(f"kiln: {precision.auto.line()}")
        progress.message(f"kiln: {run.parameters:,} parameters on {device}{shown_layout}, {shown_precision}, "
                         f"steps {run.start_step + 1}..{run.total_steps} -> {out.path}")
        run.meter.window_start = time.perf_counter()
        return out, loggers, progress
    except BaseException as exc:
        out.stopped(exc)
        raise


def _write_start(run: Run, out: RunDir, resumed: Any) -> None:
    """Rank 0's config.yaml and summary.json as the run starts or goes on; a resumed run's
    metrics.csv loses the rows logged after its checkpoint (they come again)."""
    precision, device = run.precision, run.device
    if resumed is None:
        save_config(run.cfg, out.path / CONFIG)
        out.write_summary(
            status="running", started_at=_dt.datetime.now().isoformat(timespec="seconds"),
            kiln_version=__version__, torch_version=torch.__version__, device=str(device),
            precision=precision.mode, machine=machine_line(), parameters=run.parameters, total_steps=run.total_steps,
            **({"precision_auto": precision.auto.record()} if precision.auto is not None else {}),
            **({"precision_fp8": precision.fp8.record()} if precision.fp8 is not None else {}),
        )
        return
    out.truncate_metrics(after_step=run.start_step)
    save_config(run.cfg, out.path / CONFIG)  # may extend max_steps
    # train.device may change on resume (RESUMABLE_CHANGES): the summary names where it goes on
    out.write_summary(status="running", total_steps=run.total_steps, precision=precision.mode, device=str(device),
                      machine=machine_line(),
                      resumed=[*out.summary.get("resumed", []), {"from": str(resumed[0]), "step": run.start_step}])


def _watchers(tc: Any) -> dict[str, EarlyStopping | None]:
    """``best`` (tracks the best evaluation, for checkpoints/best) and ``stopper`` (the same
    object, when early stopping is on)."""
    stopper = EarlyStopping(**tc.early_stopping) if tc.early_stopping is not None else None
    return {"best": stopper or (EarlyStopping("eval_loss") if tc.checkpoint_every else None), "stopper": stopper}


def _measure_precision(cfg: Any, place: Place, built: Built, data: Data) -> Any:
    """Forward and backward of the built model (the whole model, not yet laid out) on this
    rank's first micro-batch, in fp32 and bf16-mixed."""

    tc, model, device = cfg.train, built.model, place.device
    micro = max(1, cfg.data.batch_size // (tc.accumulate * place.layout.dp))
    with same_random():  # a loader's workers draw their seeds from torch's stream
        batch = _first_batch(data.train, micro)
    if batch is None:
        return AutoChoice("fp32", "rule", "no training batch to measure on")
    batch = to_device(batch, device, torch.float32)
    if any(p.is_meta for p in model.parameters()):
        # weights still to be read (kiln.hf.from_pretrained): time a copy with random ones
        model = copy.deepcopy(model).to_empty(device=device)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02) if p.is_floating_point() else p.zero_()
    extra = f"loss={built.task.kind}|ac={tc.activation_checkpointing},{tc.ac_every}|compile={tc.compile}"
    return choose_for_model(model, lambda: micro_batch_loss(built.task, model, batch), device, batch=batch,
                            extra=extra)


def _first_batch(loader: Any, size: int) -> Any:
    """A micro-batch of ``size`` samples: the data set's first ones through the loader's
    collate function, or, for a stream, the loader's first batch; None for no data."""
    dataset = getattr(loader, "dataset", None)
    if dataset is not None and not isinstance(dataset, torch.utils.data.IterableDataset):
        try:
            n = min(size, len(dataset))
        except TypeError:
            n = None
        if n:
            return loader.collate_fn([dataset[i] for i in range(n)])
    try:
        return next(iter(loader))
    except StopIteration:
        return None


def _to(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``model.to(device, dtype)``, leaving parameters on ``meta`` there (dtype changed): they
    get memory once the model is laid out."""
    if not any(p.is_meta for p in model.parameters()):
        return model.to(device, dtype=dtype)
    return model._apply(lambda t: t.to(device=None if t.is_meta else device,
                                       dtype=dtype if t.is_floating_point() else None))


def check_resume(run_dir: Path, cfg: Any) -> None:
    """What ``kiln train --resume`` checks before it starts any process (setup and the launcher
    check again, and lock): no other process writes ``run_dir``, its checkpoint matches
    ``cfg``, and ``train.max_steps`` leaves steps to train."""
    RunLock.acquire(run_dir).release()  # RunDirBusy, naming the writer
    done = checkpoint_to_resume(run_dir, cfg)[1]["step"]
    if cfg.train.max_steps is not None:  # (train.epochs: setup checks, once it knows the data)
        check_extends(run_dir, done, cfg.train.max_steps)


def check_extends(run_dir: Path, done: int, total_steps: int) -> None:
    """A resume must have steps left to train: resuming a finished run would only rewrite its
    summary (with no loss and no evaluation), so it is refused, saying how to extend it."""
    if done >= total_steps:
        raise ConfigError(
            f"{run_dir} has already trained {done} steps (this config runs {total_steps}); to train it longer, "
            f"resume with more steps: kiln train --resume {run_dir} train.max_steps=N with N > {done}")


def _check_steps(cfg: Any, data: Data, layout: Any, per_epoch: int) -> None:
    """What the plan of steps must give before anything is built on it."""
    tc = cfg.train
    if per_epoch == 0:
        if tc.max_steps is None:
            raise ConfigError(
                f"train.epochs={tc.epochs} needs epochs of at least one step, but the training data gives fewer "
                f"than train.accumulate={tc.accumulate} micro-batches per epoch (or has no length); lower "
                "data.batch_size or train.accumulate, or set train.max_steps")
        return
    plan = step_plan(data.train)
    if layout.pp > 1 and plan is not None and plan.sizes[-1] != cfg.data.batch_size:
        # a pipeline schedule averages its micro-batches' losses with equal weights
        raise ConfigError(
            f"data.drop_last=false leaves a last step of {plan.sizes[-1]} samples in each epoch (not "
            f"data.batch_size={cfg.data.batch_size}), which a pipeline (parallel.pp={layout.pp}) cannot split "
            "into equal micro-batches; set data.drop_last=true")


def _check_schedule_length(cfg: Any, saved: dict[str, Any], total_steps: int) -> None:
    """OneCycleLR fixes its phases at construction: a resumed run cannot stretch them."""
    planned = saved.get("total_steps")
    if cfg.optim.schedule == "onecycle" and planned is not None and planned != max(total_steps, 2):
        raise ConfigError(
            f"optim.schedule=onecycle was laid out for {planned} steps and cannot be stretched to "
            f"train.max_steps={total_steps} on resume; resume with train.max_steps={planned}, or train with "
            "optim.schedule=cosine|linear|constant, which follow the new length"
        )
