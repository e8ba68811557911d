"""Everything a run needs before its first step: :func:`setup` builds it and, when resuming,
puts it back exactly where the checkpoint left off. What it returns, :class:`Run`, is what
``loop.py`` works on.

Everything that can be wrong with the config is checked before anything is built (kiln.config,
then the layout, the plan of steps and the model), and everything is built before the run
directory is created or reopened, so a bad run leaves no half-made directory behind.
"""

from __future__ import annotations

import copy
import datetime as _dt
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln._version import __version__
from kiln.config import save_config
from kiln.errors import ConfigError
from kiln.hardware import machine_line
from kiln.hf import deferred_weights, load_inner_weights, load_weights, materialize, weights_source
from kiln.parallel import Parallel, broadcast_parameters, init_distributed, parallelize
from kiln.precision import Precision
from kiln.train._batches import Batches, step_plan, steps_per_epoch
from kiln.train._tensor_peak import TensorMemory
from kiln.train._mfu import Mfu
from kiln.train._build import (
    Data,
    build_data,
    build_model,
    build_optimizer,
    build_scheduler,
    build_task,
    check_model,
    pick_device,
    seed_everything,
)
from kiln.train._callbacks import EarlyStopping
from kiln.train._checkpoint import checkpoint_to_resume, load_into, plain, set_rng_state
from kiln.train._chunked_loss import AUTO_MIN_BYTES, apply_chunked_head, chunked_head_path
from kiln.train._loggers import Loggers, check_loggers
from kiln.train._progress import Progress
from kiln.train._ranks import NullRun, broadcast_path, check_layout
from kiln.train.run_dir import CONFIG, RunDir, RunLock
from kiln.train._tasks import Task, loss_from_logits


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this run: allocated CUDA memory, or the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@dataclass
class Meter:
    """Counters of a run that a checkpoint carries over: the open log window and the totals."""

    device: torch.device
    window_loss: torch.Tensor = None  # sum of step losses since the last log (fp64: exact in fp64 runs)
    window_steps: int = 0
    window_samples: int = 0  # samples_seen when the window opened
    samples_seen: int = 0
    train_seconds: float = 0.0  # time in steps, without evaluation, logging and compiling
    timed_samples: int = 0  # the samples of those steps (not the compiling first step's)
    elapsed_before: float = 0.0  # wall time of the runs this one resumes
    wall_start: float = field(default_factory=time.perf_counter)
    window_start: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        if self.window_loss is None:
            self.window_loss = torch.zeros((), dtype=torch.float64, device=self.device)

    def wall_seconds(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.wall_start

    def restart_clock(self) -> None:
        """Time the open window from now, without the samples seen so far (after compiling)."""
        self.window_start, self.window_samples = time.perf_counter(), self.samples_seen

    def state_dict(self) -> dict[str, Any]:
        return {"window": {"loss": self.window_loss.item(), "steps": self.window_steps},
                "totals": {"train_seconds": self.train_seconds, "samples_seen": self.samples_seen,
                           "timed_samples": self.timed_samples, "wall_seconds": self.wall_seconds()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        totals = state["totals"]
        self.window_loss += state["window"]["loss"]
        self.window_steps = state["window"]["steps"]
        self.train_seconds = totals["train_seconds"]
        self.samples_seen = self.window_samples = totals["samples_seen"]
        self.timed_samples = totals.get("timed_samples", self.samples_seen)  # (checkpoints before it)
        self.elapsed_before = totals["wall_seconds"]


@dataclass
class Run:
    """One rank's view of a run: what it trains, with what, and where it writes."""

    cfg: Any
    rank: int
    world: int
    layout: Any  # kiln.parallel.Layout: dp x tp x pp
    device: torch.device
    precision: Precision
    data: Data
    task: Task  # how a batch becomes a loss, and the eval metrics
    par: Parallel  # this rank's part of the model and the layout's pieces of a step
    model: nn.Module  # what forward calls: par.model, compiled with train.compile
    optimizer: torch.optim.Optimizer  # kiln's optimizer, or ZeRO-1/2 around it
    scheduler: Any
    batches: Batches
    out: RunDir | NullRun  # the run directory (rank 0), or a stand-in that writes nothing
    progress: Progress
    loggers: Loggers  # rank 0's TensorBoard, W&B, MLflow (train.loggers); none on other ranks
    best: EarlyStopping | None  # tracks the best evaluation, for checkpoints/best
    stopper: EarlyStopping | None  # the same object when early stopping is on
    meter: Meter
    total_steps: int
    start_step: int
    memory: TensorMemory  # the peak of live tensor bytes over the first steps
    mfu: Mfu  # FLOPs per step (counted on the first) against the devices' peak
    clip_grad_norm: float | None = None  # train.clip_grad_norm, read once (the step reads no config)
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
    instead of creating one under ``train.output_dir``."""
    meter_start = time.perf_counter()
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    import torch.distributed as dist

    # a process group the caller made (its own script, a test) stays up after the run
    owns_group = not (dist.is_available() and dist.is_initialized())
    rank, world = init_distributed(cfg.parallel.timeout_s)
    if rank == 0:
        check_loggers(tc.loggers)  # rank 0 alone logs: a logger that cannot start stops the run now
    layout = check_layout(cfg, world)  # dp x tp x pp, checked against the batch and the model
    coords = layout.coords(rank)  # this rank's place: {"pp": .., "dp": .., "tp": ..}
    device = pick_device(tc.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", torch.cuda.current_device())  # init_distributed chose LOCAL_RANK
    seed_everything(tc.seed)  # the same on every rank: identical initial weights
    out = None
    if resume is not None and rank == 0:
        out = RunDir.open(Path(resume))  # locked first: RunDirBusy if another process writes it
    try:
        run = _setup(cfg, name, resume, run_dir, out, meter_start, rank, world, layout, coords, device)
        run.owns_group = owns_group and world > 1
        return run
    except BaseException:
        if out is not None:
            out.close()  # rewrote nothing: the run keeps the summary it had
        raise


def _setup(cfg: Any, name: str, resume: Path | str | None, run_dir: Path | str | None, out: RunDir | None,
           meter_start: float, rank: int, world: int, layout: Any, coords: dict[str, int],
           device: torch.device) -> Run:
    tc, dp = cfg.train, layout.dp
    resumed = checkpoint_to_resume(Path(resume), cfg) if resume is not None else None

    # ---- build everything before touching the disk --------------------------------------
    # An explicit bf16/fp16 mode on hardware that emulates it warns, once. train.precision=auto
    # is fp32 or bf16-mixed, which build everything alike: settled below, once the model exists.
    precision = Precision(tc.precision, device)
    # the ranks of one data-parallel replica (its tp and pp ranks) read the same samples
    data = build_data(cfg.data, seed=tc.seed, accumulate=tc.accumulate, device=device,
                      rank=coords["dp"], world_size=dp)
    per_epoch = steps_per_epoch(data.train, tc.accumulate)
    _check_steps(cfg, data, layout, per_epoch)
    with deferred_weights():  # kiln.hf.from_pretrained: parameters on meta, its weights read once laid out
        model = build_model(cfg.model)
    weights = weights_source(model)  # the local Hugging Face directory they come from, or None
    if weights is None:
        load_inner_weights(model)  # from_pretrained inside a module of the user's: read whole, now
    model = _to(model, device, precision.param_dtype)
    check_model(cfg, model)
    task = build_task(cfg, data, model)
    n_params = sum(p.numel() for p in model.parameters())  # the whole model, before any sharding
    if precision.requested == "auto":
        # fp32 or bf16-mixed, whichever trains this model faster here (kiln/precision/auto.py):
        # timed on rank 0 before the model is laid out (its passes then need no collective);
        # config.yaml records the choice, so a rerun from it does not measure
        precision.settle(_auto_precision(cfg, resumed, model, task, data, layout, device, rank, world))
        cfg = copy.deepcopy(cfg)  # (not the caller's)
        cfg.train.precision = precision.mode
    par, optimizer = lay_out(cfg, model, layout, coords, device, precision, task=task, weights=weights,
                             resuming=resumed is not None)
    model = par.model
    if tc.compile:
        from kiln.compile import apply_compile

        model = apply_compile(model)  # compiles lazily: the first step pays for it
    total_steps = tc.max_steps if tc.max_steps is not None else tc.epochs * per_epoch
    scheduler = build_scheduler(cfg.optim, optimizer, total_steps)
    if resumed is not None:
        check_extends(Path(resume), resumed[1]["step"], total_steps)
        _check_schedule_length(cfg, resumed[1]["scheduler"], total_steps)
    stopper = EarlyStopping(**tc.early_stopping) if tc.early_stopping is not None else None
    best = stopper or (EarlyStopping("eval_loss") if tc.checkpoint_every else None)  # tracks best/

    # ---- state: fresh, or exactly where the checkpoint left off ---------------------------
    meter = Meter(device, wall_start=meter_start)
    start_step, epoch, in_epoch = 0, 0, 0  # resume point: steps done, epoch, steps into it
    if resumed is not None:
        ckpt = resumed[1]
        # every rank reads its part of each tensor, however this run shards it; into the
        # arena in place (never assign=True)
        load_into(resumed[0], par.model, optimizer, precision)
        scheduler.load_state_dict(ckpt["scheduler"])
        precision.load_state_dict(ckpt["precision"])
        if best is not None and ckpt.get("best"):
            best.load_state_dict(ckpt["best"])
        start_step, epoch, in_epoch = ckpt["step"], ckpt["data"]["epoch"], ckpt["data"]["step"]
        meter.load_state_dict(ckpt)
    # whole steps of data.batch_size samples; replays the steps of the epoch already done
    batches = Batches(data.train, tc.accumulate, cfg.data.batch_size, epoch, in_epoch)
    if resumed is not None:  # after the replay, which may have drawn random numbers
        per_rank = resumed[1]["rng"]
        set_rng_state(per_rank[rank] if len(per_rank) == world else per_rank[0])

    # ---- the run directory ---------------------------------------------------------------
    if rank != 0:
        out = NullRun(broadcast_path(None))  # rank 0 alone writes; the others only learn where
    elif resumed is None:
        # summary.json says "running" before anything else is in the directory
        out = RunDir.open(Path(run_dir)) if run_dir is not None else RunDir.create(tc.output_dir, tc.run_name or name)
    try:  # from here on, a stop (Ctrl-C included) is recorded in summary.json, as in the loop
        if rank == 0 and resumed is None:
            broadcast_path(out.path)
            save_config(cfg, out.path / CONFIG)
            out.write_summary(
                status="running", started_at=_dt.datetime.now().isoformat(timespec="seconds"),
                kiln_version=__version__, torch_version=torch.__version__, device=str(device),
                precision=precision.mode, machine=machine_line(), parameters=n_params, total_steps=total_steps,
                **({"precision_auto": precision.auto.record()} if precision.auto is not None else {}),
                **({"precision_fp8": precision.fp8.record()} if precision.fp8 is not None else {}),
            )
        elif rank == 0:
            broadcast_path(out.path)
            out.truncate_metrics(after_step=start_step)  # rows logged after the checkpoint come again
            save_config(cfg, out.path / CONFIG)  # may extend max_steps
            # train.device may change on resume (RESUMABLE_CHANGES): the summary names where it goes on
            out.write_summary(status="running", total_steps=total_steps, precision=precision.mode, device=str(device),
                              machine=machine_line(),
                              resumed=[*out.summary.get("resumed", []), {"from": str(resumed[0]), "step": start_step}])
        out.open_metrics(["step", "epoch", "train_loss", "lr", "grad_norm", "loss_scale", "skipped_steps",
                          "samples_per_second", "mfu", "peak_memory_mb", "wall_seconds",
                          *(f"eval_{m}" for m in task.metric_names())])
        # rank 0 alone logs; a resumed run continues the logged runs RUN_DIR/loggers.json names
        loggers = Loggers.open(tc.loggers, out.path, plain(cfg), resumed=resumed is not None) if rank == 0 \
            else Loggers()
        progress = Progress(total_steps, mode=tc.progress if rank == 0 else "none", initial=start_step)
        shown_layout = f", {world} processes ({layout})" if world > 1 else ""
        shown_precision = f"{precision.mode} (auto)" if precision.auto is not None else precision.mode
        if precision.auto is not None:
            progress.message(f"kiln: {precision.auto.line()}")
        progress.message(f"kiln: {n_params:,} parameters on {device}{shown_layout}, {shown_precision}, "
                         f"steps {start_step + 1}..{total_steps} -> {out.path}")
        mfu = Mfu(device, precision, world, layout.tp, main=rank == 0)  # (a CPU's peak: measured once, cached)
        meter.window_start = time.perf_counter()
        return Run(cfg=cfg, rank=rank, world=world, layout=layout, device=device, precision=precision, data=data,
                   task=task, par=par, model=model, optimizer=optimizer, scheduler=scheduler, batches=batches,
                   out=out, progress=progress, loggers=loggers, best=best, stopper=stopper, meter=meter,
                   memory=TensorMemory(device, (par.model, optimizer), enabled=tc.measure_memory), mfu=mfu,
                   total_steps=total_steps, start_step=start_step, clip_grad_norm=tc.clip_grad_norm)
    except BaseException as exc:
        out.stopped(exc)
        raise


def lay_out(cfg: Any, model: nn.Module, layout: Any, coords: dict[str, int], device: torch.device,
            precision: Precision, *, task: Task | None = None, weights: str | None = None,
            resuming: bool = False) -> tuple[Parallel, Any]:
    """This rank's part of ``model`` and the optimizer that steps it, as the config lays them
    out: float8 linears (``train.precision=fp8``), activation checkpointing, the chunked LM head (``task.head``, when ``task`` is given
    and ``train.chunked_lm_loss`` applies), pipeline stages, tensor parallel, FSDP2, the weights
    read from ``weights`` (a Hugging Face directory; not when ``resuming``: the checkpoint fills
    them), kiln's optimizer, precision's master weights and the data-parallel side (ZeRO-1/2 or
    the gradient reducer). What :func:`setup` runs, and what ``kiln plan`` traces on fake
    tensors. Returns ``(par, optimizer)``: the optimizer the step uses (ZeRO's wrapper)."""
    tc, dp, world = cfg.train, layout.dp, layout.world
    precision.convert(model)  # fp8: the linears become float8 ones, before anything wraps or splits them
    if tc.activation_checkpointing != "none":
        from kiln.memory import apply_ac

        apply_ac(model, tc.activation_checkpointing, every=tc.ac_every, blocks=tc.ac_blocks)
    # a causal LM's head and loss in chunks of rows (kiln/train/_chunked_loss.py): the model
    # returns the hidden states its output projection took, and the task's loss makes the logits
    head = chunked_head_path(cfg, model, task.kind, layout.pp) if task is not None else None
    if head is not None:
        task.head = apply_chunked_head(model, head, min_bytes=AUTO_MIN_BYTES if tc.chunked_lm_loss == "auto" else 0)
    # Pipeline stages, then tensor parallel, then (zero=3) FSDP2 over the dp ranks; par.model
    # is this rank's part, under the whole model's parameter names. The pipeline schedule
    # calls the loss itself, once per micro-batch: divided by K, as train_step divides it.
    par = parallelize(model, layout, zero=cfg.parallel.zero, sequence_parallel=cfg.parallel.sequence_parallel,
                      pp_schedule=cfg.parallel.pp_schedule, microbatches=cfg.parallel.microbatches,
                      pp_stages=cfg.parallel.pp_stages, device=device, chunked_head=head is not None,
                      loss_fn=lambda logits, targets: loss_from_logits(logits, targets) / tc.accumulate)
    # FSDP2 and tensor parallelism hold DTensors: the optimizer steps them in multi-tensor mode
    # (there is no one flat arena to slice).
    if weights is not None and not resuming:
        # each rank reads from the safetensors files only the part of each tensor it holds
        load_weights(par.model, weights, device=device)
    elif weights is not None:
        materialize(par.model, device)  # the checkpoint fills it, below
    optimizer = build_optimizer(cfg.optim, par.model, contiguous=None if par.arena else False)
    precision.attach(par.model, optimizer)  # bf16-true: the model becomes bf16, fp32 masters stay
    if world > 1:
        if par.arena and dp > 1:  # (FSDP2 and TP kept each rank's part of identical, same-seed weights)
            broadcast_parameters(optimizer, group=par.dp_group)  # replica 0's weights in every replica
        # each replica and stage its own dropout masks; the tp ranks of one replica the same
        # ones, as they hold the same activations
        torch.manual_seed(tc.seed + coords["dp"] + dp * coords["pp"])
        # Gradient buckets reduced during the last micro-batch's backward (train_step's
        # sync_gradients), not after it: not under a pipeline, whose schedule runs many
        # backwards, nor bf16-true, whose gradients reach the masters only after backward.
        overlap = (cfg.parallel.overlap_grad_reduce and layout.pp == 1 and precision.masters is None
                   and getattr(optimizer, "contiguous", False))  # kiln's optimizer, on its arena
        # ZeRO-1/2: each rank keeps the optimizer state (and, stage 2, the gradient) of one
        # contiguous shard of every arena; from here on only the wrapper is used
        optimizer = par.data_parallel(optimizer, overlap=overlap)
        if dp > 1 and cfg.parallel.zero in (1, 2):
            if overlap and cfg.parallel.overlap_param_gather and not tc.compile:
                # (compiled, the per-module waits would break the graphs; evaluation's forward
                # and the checkpoint's reads wait too)
                optimizer.overlap_param_gather(par.model)
            precision.wrap(optimizer)  # bf16-true: the masters are now stepped through ZeRO
    return par, optimizer


def _auto_precision(cfg: Any, resumed: Any, model: nn.Module, task: Task, data: Data, layout: Any,
                    device: torch.device, rank: int, world: int) -> Any:
    """What ``train.precision=auto`` trains in (:mod:`kiln.precision.auto`): a resumed run's
    checkpoint's mode, the rule's, or rank 0's measurement of ``model``, given to every rank."""
    from kiln.precision.auto import CANDIDATES, AutoChoice, rule

    if resumed is not None and resumed[1].get("precision", {}).get("mode") in CANDIDATES:
        # never measured again: a resumed run goes on in the mode it trained in
        return AutoChoice(resumed[1]["precision"]["mode"], "checkpoint", f"as {resumed[0].name} trained")
    ruled = rule(device, whole_model=layout.tp == layout.pp == 1 and cfg.parallel.zero < 3)
    if ruled is not None:  # the same on every rank
        return ruled
    choice = _measure_precision(cfg, model, task, data, layout, device) if rank == 0 else None
    if world > 1:
        import torch.distributed as dist

        box = [choice]
        dist.broadcast_object_list(box, src=0)  # the others wait here while rank 0 measures
        choice = box[0]
    return choice


def _measure_precision(cfg: Any, model: nn.Module, task: Task, data: Data, layout: Any,
                       device: torch.device) -> Any:
    """Forward and backward of ``model`` (the whole model, not yet laid out) on this rank's
    first micro-batch, in fp32 and bf16-mixed."""
    from kiln.precision.auto import AutoChoice, choose_for_model, same_random
    from kiln.train._tasks import micro_batch_loss, to_device

    tc = cfg.train
    micro = max(1, cfg.data.batch_size // (tc.accumulate * layout.dp))
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
    extra = f"loss={task.kind}|ac={tc.activation_checkpointing},{tc.ac_every}|compile={tc.compile}"
    return choose_for_model(model, lambda: micro_batch_loss(task, model, batch), device, batch=batch, extra=extra)


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
