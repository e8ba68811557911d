"""kiln's training loop: one function, read top to bottom.

    build (data, model [+ activation checkpointing], optimizer [+ ZeRO], schedule [, compile])
    create the run directory (rank 0), or reopen it to resume
    for each optimizer step:
        for each of train.accumulate micro-batches:
            forward under autocast -> loss / K -> (scaled) backward, no communication
        finish the gradients: average over ranks, unscale (fp16) or copy to fp32 masters (bf16-true)
        -> clip (optional) -> optimizer step (skipped on fp16 overflow)
        -> schedule step -> zero the gradients
        log every train.log_every steps, evaluate every train.eval_every steps
    final evaluation -> final checkpoint -> summary.json -> loss.png

Everything that can be wrong with the config is checked before this runs (kiln.config), and
everything that is built is built before the run directory exists, so a bad run leaves no
half-made directory behind.

    >>> from kiln.config import load_config
    >>> result = train(load_config("configs/digits_vit.py", ["train.max_steps=20"]))
    >>> result.summary["steps"]
    20
"""

from __future__ import annotations

import datetime as _dt
import resource
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import kiln
from kiln.config import save_config
from kiln.parallel import ZeroOptimizer, broadcast_parameters, init_distributed
from kiln.parallel._layout import parallelize
from kiln.precision import Precision
from kiln.train._batches import Batches, step_plan, steps_per_epoch
from kiln.train._build import (
    build_data,
    build_model,
    build_optimizer,
    build_scheduler,
    check_model,
    pick_device,
    seed_everything,
)
from kiln.train._callbacks import EarlyStopping, TensorBoardLogger
from kiln.train._checkpoint import checkpoint_to_resume, load_into, plain, prune, save_checkpoint, set_rng_state
from kiln.train._plot import plot_loss
from kiln.train._progress import Progress
from kiln.train._ranks import NullRun, broadcast_path, check_layout, mean_over_ranks
from kiln.train._run_dir import CHECKPOINTS, CONFIG, RunDir
from kiln.train._tasks import evaluate, loss_fn, loss_from_logits, metric_names


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this run: allocated CUDA memory, or the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def train(cfg: Any, *, name: str = "run", resume: Path | str | None = None,
          run_dir: Path | str | None = None) -> RunResult:
    """Train as ``cfg`` (a validated config from ``kiln.config.load_config``) says.

    ``resume=RUN_DIR`` continues that run from its newest checkpoint, in the same directory;
    ``run_dir`` names a new, empty run directory instead of creating one under output_dir.
    Started by torchrun, every process calls this; rank 0 alone writes the run directory.
    """
    wall_start = time.perf_counter()
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    rank, world = init_distributed(cfg.parallel.timeout_s)
    main = rank == 0
    layout = check_layout(cfg, world)  # dp x tp x pp, checked against the batch and the model
    coords = layout.coords(rank)  # this rank's place: {"pp": .., "dp": .., "tp": ..}
    dp = layout.dp
    device = pick_device(tc.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", torch.cuda.current_device())  # init_distributed chose LOCAL_RANK
    seed_everything(tc.seed)  # the same on every rank: identical initial weights
    resumed = checkpoint_to_resume(Path(resume), cfg) if resume is not None else None

    # ---- build everything before touching the disk --------------------------------------
    precision = Precision(tc.precision, device)
    # the ranks of one data-parallel replica (its tp and pp ranks) read the same samples
    data = build_data(cfg.data, seed=tc.seed, accumulate=tc.accumulate, device=device,
                      rank=coords["dp"], world_size=dp)
    per_epoch = steps_per_epoch(data.train, tc.accumulate)
    _check_steps(cfg, data, layout, per_epoch)
    model = build_model(cfg.model).to(device, dtype=precision.param_dtype)
    check_model(cfg, model)
    n_params = sum(p.numel() for p in model.parameters())  # the whole model, before any sharding
    if tc.activation_checkpointing != "none":
        from kiln.memory import apply_ac

        apply_ac(model, tc.activation_checkpointing, every=tc.ac_every)
    # Pipeline stages, then tensor parallel, then (zero=3) FSDP2 over the dp ranks; `model` is
    # now this rank's part, under the whole model's parameter names. The pipeline schedule
    # calls the loss itself, once per micro-batch: divided by K, as below.
    par = parallelize(model, layout, zero=cfg.parallel.zero, sequence_parallel=cfg.parallel.sequence_parallel,
                      pp_schedule=cfg.parallel.pp_schedule, microbatches=cfg.parallel.microbatches,
                      pp_stages=cfg.parallel.pp_stages, device=device,
                      loss_fn=lambda logits, targets: loss_from_logits(logits, targets) / tc.accumulate)
    model = par.model
    # FSDP2 and tensor parallelism hold DTensors: the optimizer steps them in multi-tensor mode
    # (there is no one flat arena to slice).
    optimizer = build_optimizer(cfg.optim, model, contiguous=None if par.arena else False)
    precision.attach(model, optimizer)  # bf16-true: the model becomes bf16, fp32 masters stay
    if world > 1:
        if par.arena and dp > 1:  # (FSDP2 and TP kept each rank's part of identical, same-seed weights)
            broadcast_parameters(optimizer, group=par.dp_group)  # replica 0's weights in every replica
        # each replica and stage its own dropout masks; the tp ranks of one replica the same
        # ones, as they hold the same activations
        torch.manual_seed(tc.seed + coords["dp"] + dp * coords["pp"])
        if cfg.parallel.zero in (1, 2) and dp > 1:
            # ZeRO-1/2: each rank keeps the optimizer state (and, stage 2, the gradient) of one
            # contiguous shard of every arena; from here on only the wrapper is used.
            optimizer = ZeroOptimizer(optimizer, cfg.parallel.zero, group=par.dp_group)
            precision.wrap(optimizer)  # bf16-true: the masters are now stepped through ZeRO
    plain_model = model
    if tc.compile:
        from kiln.compile import apply_compile

        model = apply_compile(model)  # compiles lazily: the first step pays for it
    total_steps = tc.max_steps if tc.max_steps is not None else tc.epochs * per_epoch
    scheduler = build_scheduler(cfg.optim, optimizer, total_steps)
    if resumed is not None:
        _check_schedule_length(cfg, resumed[1]["scheduler"], total_steps)
    stopper = EarlyStopping(**tc.early_stopping) if tc.early_stopping is not None else None
    best = stopper or (EarlyStopping("eval_loss") if tc.checkpoint_every else None)  # tracks best.pt

    # ---- state: fresh, or exactly where the checkpoint left off ---------------------------
    start_step, epoch, in_epoch = 0, 0, 0  # resume point: step done, epoch, steps into it
    window_loss = torch.zeros((), dtype=torch.float64, device=device)  # sum of step losses since the last log
    window_steps, train_seconds, samples_seen, elapsed_before = 0, 0.0, 0, 0.0
    if resumed is not None:
        ckpt = resumed[1]
        # every rank reads its part of each tensor, however this run shards it; into the
        # arena in place (never assign=True)
        load_into(resumed[0], plain_model, optimizer, precision)
        scheduler.load_state_dict(ckpt["scheduler"])
        precision.load_state_dict(ckpt["precision"])
        if best is not None and ckpt.get("best"):
            best.load_state_dict(ckpt["best"])
        start_step, epoch, in_epoch = ckpt["step"], ckpt["data"]["epoch"], _steps_into_epoch(ckpt)
        window_loss += ckpt["window"]["loss"]
        window_steps = ckpt["window"]["steps"]
        train_seconds, samples_seen = ckpt["totals"]["train_seconds"], ckpt["totals"]["samples_seen"]
        elapsed_before = ckpt["totals"]["wall_seconds"]
    # whole steps of data.batch_size samples; replays the steps of the epoch already done
    batches = Batches(data.train, tc.accumulate, cfg.data.batch_size, epoch, in_epoch)
    window_samples = samples_seen
    if resumed is not None:  # after the replay, which may have drawn random numbers
        per_rank = resumed[1]["rng"]
        set_rng_state(per_rank[rank] if len(per_rank) == world else per_rank[0])

    # ---- the run directory ---------------------------------------------------------------
    if not main:
        run = NullRun(broadcast_path(None))  # rank 0 alone writes; the others only learn where
    elif resumed is None:
        run = RunDir.open(Path(run_dir)) if run_dir is not None else RunDir.create(tc.output_dir, tc.run_name or name)
        broadcast_path(run.path)
        save_config(cfg, run.path / CONFIG)
        run.write_summary(
            status="running", started_at=_dt.datetime.now().isoformat(timespec="seconds"),
            kiln_version=kiln.__version__, torch_version=torch.__version__, device=str(device),
            parameters=n_params, total_steps=total_steps,
        )
    else:
        run = RunDir.open(Path(resume))
        broadcast_path(run.path)
        run.truncate_metrics(after_step=start_step)  # rows logged after the checkpoint come again
        save_config(cfg, run.path / CONFIG)  # may extend max_steps
        run.write_summary(status="running", total_steps=total_steps,
                          resumed=[*run.summary.get("resumed", []), {"from": str(resumed[0]), "step": start_step}])
    evals = [f"eval_{m}" for m in metric_names(data.task)]
    run.open_metrics(["step", "epoch", "train_loss", "lr", "grad_norm", "loss_scale", "skipped_steps",
                      "samples_per_second", "peak_memory_mb", "wall_seconds", *evals])
    loggers = [TensorBoardLogger(run.path / "tensorboard")] if "tensorboard" in tc.loggers else []
    progress = Progress(total_steps, mode=tc.progress if main else "none", initial=start_step)
    shown_layout = f", {world} processes ({layout})" if world > 1 else ""
    progress.message(f"kiln: {n_params:,} parameters on {device}{shown_layout}, steps {start_step + 1}..{total_steps} -> {run.path}")

    def checkpoint(name: str, step: int) -> None:
        # A collective: every rank writes its own shards and RNG states into checkpoints/<name>/
        # (tensors keyed by parameter name, so any layout resumes from it); this is rank 0's
        # non-tensor state, as JSON (the fp32 master weights of bf16-true are tensors there).
        save_checkpoint(run.path / CHECKPOINTS / name, plain_model, optimizer, precision, {
            "step": step, "scheduler": scheduler.state_dict(),
            "precision": {"mode": precision.mode,
                          "scaler": precision.scaler.state_dict() if precision.scaler else None},
            "best": best.state_dict() if best else None,
            "data": {"epoch": batches.epoch, "step": batches.step},  # steps: the same in any layout
            "window": {"loss": window_loss.item(), "steps": window_steps},
            "totals": {"train_seconds": train_seconds, "samples_seen": samples_seen,
                       "wall_seconds": elapsed_before + time.perf_counter() - wall_start},
            "config": plain(cfg), "kiln_version": kiln.__version__,
        })

    window_start = time.perf_counter()
    last_train_loss, last_eval, grad_norm, compile_seconds = float("nan"), {}, None, None
    step, stopped = start_step, None
    try:
        model.train()
        for step in range(start_step + 1, total_steps + 1):
            step_start = time.perf_counter()
            this = next(batches)
            for inputs, targets in this.micro:
                inputs = _to_device(inputs, device, precision.input_dtype)
                targets = targets.to(device, non_blocking=True)
                if par.pipeline is not None:
                    # the schedule runs forward and backward of every pipeline micro-batch
                    with precision.autocast():
                        loss = par.pipeline.step(inputs, targets)
                else:
                    with precision.autocast(), par.loss_context():
                        # Weighted by its share of the step's samples, a micro-batch's mean loss
                        # sums (and, averaged over dp ranks, averages) to the mean over the whole
                        # step: divided by exactly K when all hold batch_size / (K x dp) samples.
                        parts = this.samples / (len(targets) * dp)  # K when every micro-batch is full
                        loss = loss_fn(data.task, model, (inputs, targets)) / parts
                        precision.backward(loss)  # fp16: backward of the scaled loss
                window_loss += par.value(loss)
            # True fp32 gradients, averaged over the data-parallel ranks (one all-reduce per
            # arena, only now: the micro-steps before accumulated locally without any sync).
            # (FSDP2 reduce-scattered them during backward already.)
            precision.finish_grads(optimizer, par.reduce_gradients)  # (a no-op for one replica)
            if tc.clip_grad_norm is not None:  # the norm over every shard, stage and rank
                grad_norm = par.clip(optimizer, tc.clip_grad_norm)
            if precision.step(optimizer):  # False: fp16 overflow, step skipped, nothing changed
                scheduler.step()
            precision.zero_grad(optimizer)  # kiln's optimizers: one memset of the flat gradient
            if tc.compile and step == start_step + 1:
                compile_seconds = time.perf_counter() - step_start  # reported apart from step time
            window_steps += 1
            samples_seen += this.samples

            row: dict[str, Any] = {}
            if step % tc.log_every == 0 or step == total_steps:
                # note: .item() waits for the device; done once per log window, not per step
                last_train_loss = mean_over_ranks(window_loss / window_steps, world).item()
                elapsed = time.perf_counter() - window_start
                if compile_seconds is not None and step - start_step <= tc.log_every:
                    elapsed -= compile_seconds  # the compiling first step is not training speed
                train_seconds += elapsed
                row.update(
                    train_loss=last_train_loss, lr=scheduler.get_last_lr()[0],
                    grad_norm=None if grad_norm is None else float(grad_norm),
                    loss_scale=precision.scaler.scale if precision.scaler else None,
                    skipped_steps=precision.scaler.skipped_steps if precision.scaler else None,
                    samples_per_second=(samples_seen - window_samples) / max(elapsed, 1e-9),
                )
                window_loss.zero_()
                window_steps, window_samples = 0, samples_seen
            if (tc.eval_every and step % tc.eval_every == 0) or step == total_steps:
                with precision.autocast():
                    last_eval = evaluate(data.task, model, data.val, device, precision.input_dtype,
                                         forward=par.eval_forward(model), share=par.share_metrics)
                row.update({f"eval_{k}": v for k, v in last_eval.items()})
                # after each evaluation, in this order: best checkpoint, then early stopping
                if best is not None:
                    improved, stop = best.update(step, row)
                    if improved:
                        checkpoint("best", step)
                    if stop and stopper is not None:
                        stopped = {"step": step, "reason": stopper.reason}
            if row:
                row.update(step=step, epoch=round(batches.epochs_done, 4),
                           peak_memory_mb=peak_memory_mb(device),
                           wall_seconds=elapsed_before + time.perf_counter() - wall_start)
                run.log_metrics(row)
                for logger in loggers:
                    logger.log(step, row)
                progress.update(step, epoch=batches.epoch, loss=row.get("train_loss"), lr=row.get("lr"),
                                **{"samples/s": _round(row.get("samples_per_second"))},
                                **{f"val_{k}": v for k, v in last_eval.items() if "eval_loss" in row})
                window_start = time.perf_counter()  # evaluation and logging are not training time
            if stopped:
                progress.message(f"kiln: early stop at step {step}: {stopped['reason']}")
                break
            if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < total_steps:
                checkpoint(f"step-{step:08d}", step)
                if main:
                    prune(run.path, tc.keep_checkpoints)

        if stopped and window_steps:  # the loss of the steps since the last log
            last_train_loss = mean_over_ranks(window_loss / window_steps, world).item()
        checkpoint("final", step)
        summary = dict(
            status="completed", steps=step,
            epochs=round(batches.epochs_done, 4),
            final_train_loss=last_train_loss, eval=last_eval,
            samples_per_second=samples_seen / max(train_seconds, 1e-9),
            peak_memory_mb=peak_memory_mb(device),
            wall_seconds=elapsed_before + time.perf_counter() - wall_start,
            processes=world, layout={"dp": layout.dp, "tp": layout.tp, "pp": layout.pp},
            compile_seconds=compile_seconds,
            skipped_steps=precision.scaler.skipped_steps if precision.scaler else 0,
            stopped_early=bool(stopped),
            **({"stopped_at_step": stopped["step"], "stop_reason": stopped["reason"]} if stopped else {}),
            **({"best": {"metric": best.metric, "value": best.best, "step": best.best_step}} if best else {}),
            finished_at=_dt.datetime.now().isoformat(timespec="seconds"),
        )
        run.close()
        if main:
            plot_loss(run.path)
        run.write_summary(**summary)  # last: "completed" only once everything else is on disk
        if world > 1:
            import torch.distributed as dist

            dist.barrier()  # no rank closes its connections while another still uses them
        progress.close()
        shown = "  ".join(f"{k} {v:.4f}" for k, v in last_eval.items())
        progress.message(
            f"kiln: done in {summary['wall_seconds']:.1f} s, {summary['samples_per_second']:.0f} samples/s, "
            f"train loss {last_train_loss:.4f}, eval {shown} -> {run.path}"
        )
        return RunResult(run.path, run.summary)
    except BaseException as exc:
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        run.write_summary(status=status, error=f"{type(exc).__name__}: {exc}", failed_at_step=step,
                          traceback=traceback.format_exc(),
                          wall_seconds=elapsed_before + time.perf_counter() - wall_start)
        raise
    finally:
        progress.close()
        run.close()
        for logger in loggers:
            logger.close()
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _check_steps(cfg: Any, data: Any, layout: Any, per_epoch: int) -> None:
    """What the plan of steps must give before anything is built on it."""
    from kiln.config import ConfigError

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


def _steps_into_epoch(ckpt: dict[str, Any]) -> int:
    data = ckpt["data"]
    if "step" in data:
        return data["step"]
    # written before kiln 0.1.1, which counted micro-batches of the saved run's layout
    saved = ckpt.get("config", {}).get("train", {}).get("accumulate", 1)
    return data.get("position", 0) // saved


def _check_schedule_length(cfg: Any, saved: dict[str, Any], total_steps: int) -> None:
    """OneCycleLR fixes its phases at construction: a resumed run cannot stretch them."""
    planned = saved.get("total_steps")
    if cfg.optim.schedule == "onecycle" and planned is not None and planned != max(total_steps, 2):
        from kiln.config import ConfigError

        raise ConfigError(
            f"optim.schedule=onecycle was laid out for {planned} steps and cannot be stretched to "
            f"train.max_steps={total_steps} on resume; resume with train.max_steps={planned}, or train with "
            "optim.schedule=cosine|linear|constant, which follow the new length"
        )


def _round(x: Any) -> Any:
    return None if x is None else round(x)


def _to_device(x: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # Floating inputs follow the parameters' dtype (fp64 runs); token ids stay integers.
    return x.to(device, dtype=dtype if x.is_floating_point() else None, non_blocking=True)
