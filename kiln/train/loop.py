"""kiln's training loop, read top to bottom.

    run = setup(cfg)                      # build, resume, open the run directory (_setup.py)
    for each optimizer step:
        train_step(run, next(run.batches))
            for each of the step's micro-batches: forward under autocast -> loss -> backward
            grads to fp32 masters (bf16-true) -> reduce over dp ranks -> unscale (fp16)
            -> clip -> step (skipped on fp16 overflow) -> schedule -> zero
        log every train.log_every steps, evaluate every train.eval_every steps (with the best
        checkpoint and early stopping), checkpoint every train.checkpoint_every steps
    finish: final checkpoint -> RUN_DIR/hf/ (a transformers model) -> loss.png -> summary.json

The phases of a step are calls into the layer that owns each, in this order, with no callbacks
between them: precision (autocast, loss scaling, master weights), parallel (the reduction over
data-parallel ranks, the global-norm clip), the optimizer.

    >>> from kiln.config import load_config
    >>> result = train(load_config("configs/digits_vit.py", ["train.max_steps=20"]))
    >>> result.summary["steps"]
    20
"""

from __future__ import annotations

import datetime as _dt
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kiln._version import __version__
from kiln.hf import export_checkpoint, is_hf_model
from kiln.train._batches import Step
from kiln.train._build import build_model
from kiln.train._checkpoint import CheckpointWriter, plain
from kiln.train.heartbeat import beat
from kiln.train._plot import plot_loss
from kiln.train.run_dir import CHECKPOINTS, raise_if_stopped, stopped_by
from kiln.train._setup import Run, StepContext, peak_memory_mb, setup
from kiln.train._tasks import evaluate, loss_parts, micro_batch_loss, to_device

__all__ = ["RunResult", "peak_memory_mb", "train", "train_step"]


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]


def train(cfg: Any, *, name: str = "run", resume: Path | str | None = None,
          run_dir: Path | str | None = None) -> RunResult:
    """Train as ``cfg`` (a validated config from ``kiln.config.load_config``) says.

    ``resume=RUN_DIR`` continues that run from its newest checkpoint, in the same directory;
    ``run_dir`` names a new, empty run directory instead of creating one under output_dir.
    Started by torchrun, every process calls this; rank 0 alone writes the run directory.
    """
    threads = torch.get_num_threads()  # train.threads holds for this run only: the caller's comes back
    try:
        run = setup(cfg, name=name, resume=resume, run_dir=run_dir)  # records a stop inside it itself
    except BaseException:
        torch.set_num_threads(threads)
        raise
    step, stopped, saves = run.start_step, None, None  # (no call here: Python checks for signals at calls)
    try:  # at once: a Ctrl-C between setup and the loop is recorded like one in the loop
        tc = cfg.train
        # plain ints, read once: a lookup in an OmegaConf config costs about as much host time as
        # a small model's whole optimizer step (docs/lab/facts.md, 'Host time')
        log_every, eval_every, checkpoint_every = tc.log_every, tc.eval_every, tc.checkpoint_every
        compiled = tc.compile
        # writes checkpoints now, or in the background while the next steps run (train.async_checkpoint)
        saves = CheckpointWriter(run.out.path, tc.keep_checkpoints, run.main, tc.async_checkpoint)
        run.model.train()
        beat.device = str(run.device)  # (what the launcher names, if this rank stops answering)
        for step in range(run.start_step + 1, run.total_steps + 1):
            beat.step = step
            started = time.perf_counter()
            lr = run.scheduler.get_last_lr()[0]  # the rate this step runs at (the scheduler steps in it)
            with run.memory.step():  # the first steps' peak of live tensor bytes
                batch = next(run.batches)
                with run.mfu.count(batch.samples, compiled and step == run.start_step + 1):  # one step's FLOPs
                    loss, grad_norm = train_step(run, batch)
            raise_if_stopped()
            saves.poll()  # a background save that has ended: its error raised now, old checkpoints pruned
            if step == run.start_step + 1 and (compiled or step < run.total_steps):
                _warmed_up(run, step, time.perf_counter() - started, compiled)  # timed apart
            run.meter.add_loss(loss)  # read to the host once per log window, not every step

            row: dict[str, Any] = {}
            if step % log_every == 0 or step == run.total_steps:
                row.update(_train_metrics(run, lr, grad_norm))
            if (eval_every and step % eval_every == 0) or step == run.total_steps:
                row.update(_evaluate(run))
                # after each evaluation, in this order: best checkpoint, then early stopping
                if run.best is not None:
                    improved, stop = run.best.update(step, row)
                    if improved:
                        checkpoint(run, saves, "best", step)
                    if stop and run.stopper is not None:
                        stopped = {"step": step, "reason": run.stopper.reason}
            if row:
                _log(run, step, row)
            if stopped:
                run.progress.message(f"kiln: early stop at step {step}: {stopped['reason']}")
                break
            if checkpoint_every and step % checkpoint_every == 0 and step < run.total_steps:
                checkpoint(run, saves, f"step-{step:08d}", step, prune=True)
        return _finish(run, saves, step, stopped)
    except BaseException as exc:
        # Ctrl-C or SIGTERM (Terminated), also wrapped in another error or followed by one
        status = "interrupted" if stopped_by(exc) is not None else "failed"
        run.out.write_summary(status=status, error=f"{type(exc).__name__}: {exc}", failed_at_step=step,
                              traceback=traceback.format_exc(), wall_seconds=run.meter.wall_seconds())
        run.loggers.summary(run.out.summary)
        raise
    finally:
        if saves is not None:
            saves.abandon()  # a save still being written finishes (or fails) before the group goes
        torch.set_num_threads(threads)
        run.progress.close()
        run.out.close()
        run.loggers.close(run.out.summary.get("status", "failed"))
        if run.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def train_step(ctx: StepContext, step: Step) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step on this rank; returns the step's mean loss (a detached 0-d tensor,
    not yet averaged over ranks) and the gradient norm before clipping (None without clipping).
    ``ctx``: what the step uses (a :class:`Run` is one; ``kiln plan`` builds one alone)."""
    precision, par, optimizer, dp = ctx.precision, ctx.par, ctx.optimizer, ctx.dp
    loss_sum = None
    # Each micro-batch's mean loss is divided by its part of the step: by its share of the
    # step's samples, or, for a loss over tokens (padding, -100 labels), of the positions the
    # whole step scores over every rank, so that the sum over micro-batches (averaged over dp)
    # is the mean over the step, as one big batch would give.
    parts = loss_parts(ctx.task, step.micro, step.samples, dp, par.sum_over_dp, ctx.device)
    # 1. forward and backward of each micro-batch; gradients accumulate locally, except that the
    #    last backward starts reducing each bucket of gradients over dp as soon as it is complete
    for i, batch in enumerate(step.micro):  # a tuple (inputs, targets, ...) or a mapping (HF: input_ids, ...)
        batch = to_device(batch, ctx.device, precision.input_dtype)
        if par.pipeline is not None:  # the schedule runs forward and backward of its micro-batches
            if isinstance(batch, Mapping):
                raise TypeError("a pipeline (parallel.pp > 1) takes batches (inputs, targets); this data gives "
                                f"mappings ({', '.join(batch)}): use a dataset of tuples, or parallel.pp=1")
            with precision.autocast():
                loss = par.pipeline.step(batch[0], batch[1])
        else:
            with par.loss_context():  # (tensor parallel's loss_parallel holds over the backward too)
                with precision.autocast():  # the forward and the loss; backward runs in the
                    # dtypes the forward saved, outside autocast, as torch.amp prescribes
                    loss = _divided(micro_batch_loss(ctx.task, ctx.model, batch), parts[i])
                with par.sync_gradients(last=i == len(step.micro) - 1):
                    precision.backward(loss)  # fp16: backward of the scaled loss
        value = par.value(loss)
        # one micro-batch: its loss as it is (kept in fp64 by the meter); several: summed in fp64
        loss_sum = value if loss_sum is None else loss_sum.double() + value
    # 2. the true, reduced gradients; fp16 unscales after the reduction, so that every rank
    #    sees the same inf and skips the same step
    precision.grads_to_masters()  # bf16-true: bf16 gradients -> fp32 master gradients
    par.reduce_gradients()  # average over dp: into every replica, or into each rank's shard (ZeRO-1/2)
    precision.unscale(optimizer)  # fp16: gradients / scale, non-finite check over all ranks
    # 3. clip, step, zero
    grad_norm = None
    if ctx.clip_grad_norm is not None:  # the norm over every shard, stage and rank
        grad_norm = par.clip(optimizer, ctx.clip_grad_norm)
    if precision.step(optimizer):  # False: fp16 overflow, step skipped, nothing changed
        ctx.scheduler.step()
    precision.zero_grad(optimizer)  # kiln's optimizers: one memset of the flat gradient
    ctx.meter.samples_seen += step.samples
    return loss_sum, grad_norm


def _divided(loss: torch.Tensor, part: Any) -> torch.Tensor:
    """``loss / part``; a part of exactly 1 (one micro-batch of the whole step, as most runs
    take) divides by nothing, as ``x / 1.0 == x`` bit for bit."""
    return loss if isinstance(part, (int, float)) and part == 1 else loss / part


def _warmed_up(run: Run, step: int, seconds: float, compiled: bool) -> None:
    """A process's first step is warm-up, reported apart (speed and the ETA start after it): the
    compile, oneDNN's bf16 kernels built for each new shape on a CPU, first allocations, the FLOP
    count. A plain loop's per-step time leaves it out too."""
    run.first_step_seconds = seconds
    run.compile_seconds = seconds if compiled else None
    run.meter.restart_clock()
    run.progress.restart_clock(step)


def _train_metrics(run: Run, lr: float, grad_norm: torch.Tensor | None) -> dict[str, Any]:
    """The log window's train loss and speed (None for a window of only the compiling step);
    ``lr`` is the rate the window's last step ran at. Closes the window."""
    m = run.meter
    # note: waits for the device; done once per log window, not per step
    run.last_train_loss = m.window_mean(run.world)
    elapsed = time.perf_counter() - m.window_start
    timed = m.samples_seen - m.window_samples
    m.train_seconds += elapsed
    m.timed_samples += timed
    scaler = run.precision.scaler
    row = dict(
        train_loss=run.last_train_loss, lr=lr,
        grad_norm=None if grad_norm is None else float(grad_norm),
        loss_scale=scaler.scale if scaler else None, skipped_steps=scaler.skipped_steps if scaler else None,
        samples_per_second=timed / max(elapsed, 1e-9) if timed else None,
    )
    row["mfu"] = run.mfu.of(row["samples_per_second"])  # None where no peak is known
    m.close_window()
    return row


def _evaluate(run: Run) -> dict[str, float]:
    with run.precision.autocast():
        run.last_eval = evaluate(run.task, run.model, run.data.val, run.device, run.precision.input_dtype,
                                 forward=run.par.eval_forward(run.model), share=run.par.share_metrics,
                                 grad=run.cfg.train.eval_grad)
    return {f"eval_{k}": v for k, v in run.last_eval.items()}


def _log(run: Run, step: int, row: dict[str, Any]) -> None:
    row.update(step=step, epoch=round(run.batches.epochs_done, 4), peak_memory_mb=peak_memory_mb(run.device),
               wall_seconds=run.meter.wall_seconds())
    run.out.log_metrics(row)
    run.loggers.log(step, row)  # a logger that fails is dropped with a warning: the run goes on
    speed, mfu = row.get("samples_per_second"), row.get("mfu")
    run.progress.update(step, epoch=run.batches.epoch, loss=row.get("train_loss"), lr=row.get("lr"),
                        **{"samples/s": None if speed is None else round(speed)},
                        mfu=None if mfu is None else f"{mfu:.2%}",
                        **{f"val_{k}": v for k, v in run.last_eval.items() if "eval_loss" in row})
    run.meter.window_start = time.perf_counter()  # evaluation and logging are not training time


def checkpoint(run: Run, saves: CheckpointWriter, name: str, step: int, prune: bool = False,
               now: bool = False) -> None:
    """Write ``checkpoints/<name>/`` (in the background with train.async_checkpoint, unless
    ``now``). A collective: every rank writes its own shards and RNG states (tensors keyed by
    parameter name, so any layout resumes from it); this is rank 0's non-tensor state, as JSON
    (the fp32 master weights of bf16-true are tensors there)."""
    precision = run.precision
    saves.save(name, run.plain_model, run.optimizer, precision, {
        "step": step, "scheduler": run.scheduler.state_dict(),
        "precision": {"mode": precision.mode, "scaler": precision.scaler.state_dict() if precision.scaler else None},
        "best": run.best.state_dict() if run.best else None,
        "data": {"epoch": run.batches.epoch, "step": run.batches.step},  # steps: the same in any layout
        **run.meter.state_dict(),
        "config": plain(run.cfg), "kiln_version": __version__,
    }, prune=prune, now=now)


def _finish(run: Run, saves: CheckpointWriter, step: int, stopped: dict[str, Any] | None) -> RunResult:
    """Final checkpoint, hf/ (a transformers model), loss.png, summary.json (marked completed last)."""
    m, layout, scaler = run.meter, run.layout, run.precision.scaler
    if stopped and m.window_steps:  # the loss of the steps since the last log
        run.last_train_loss = m.window_mean(run.world)
    checkpoint(run, saves, "final", step, now=True)  # after the save in flight; the run ends with both on disk
    if run.main and _is_hf_run(run):
        # RUN_DIR/hf/ for from_pretrained, read back from the final checkpoint, which every layout
        # writes alike (whole tensors by name); the other ranks wait at the barrier below
        final = run.out.path / CHECKPOINTS / "final"
        export_checkpoint(partial(build_model, run.cfg.model), final, run.out.path / "hf")
    speed = m.timed_samples / max(m.train_seconds, 1e-9)
    summary = dict(
        status="completed", steps=step, epochs=round(run.batches.epochs_done, 4),
        final_train_loss=run.last_train_loss, eval=run.last_eval,
        samples_per_second=speed, **run.mfu.summary(speed),
        peak_memory_mb=peak_memory_mb(run.device), peak_tensor_memory_mb=run.memory.peak_mb(run.world),
        wall_seconds=m.wall_seconds(),
        processes=run.world, layout=layout.as_json(),
        first_step_seconds=run.first_step_seconds, compile_seconds=run.compile_seconds,
        skipped_steps=scaler.skipped_steps if scaler else 0,
        stopped_early=bool(stopped),
        **({"stopped_at_step": stopped["step"], "stop_reason": stopped["reason"]} if stopped else {}),
        **({"best": {"metric": run.best.metric, "value": run.best.best, "step": run.best.best_step}}
           if run.best else {}),
        finished_at=_dt.datetime.now().isoformat(timespec="seconds"),
    )
    if run.main:  # metrics.csv is flushed row by row: complete on disk
        plot_loss(run.out.path)
    run.out.write_summary(**summary)  # last: "completed" only once everything else is on disk
    run.loggers.summary(run.out.summary)
    if run.world > 1:
        import torch.distributed as dist

        dist.barrier()  # no rank closes its connections while another still uses them
    run.progress.close()
    shown = "  ".join(f"{k} {v:.4f}" for k, v in run.last_eval.items())
    shown_mfu = f" (MFU {summary['mfu']:.2%})" if summary.get("mfu") is not None else ""
    run.progress.message(
        f"kiln: done in {summary['wall_seconds']:.1f} s, {summary['samples_per_second']:.0f} samples/s{shown_mfu}, "
        f"train loss {run.last_train_loss:.4f}, eval {shown} -> {run.out.path}"
    )
    return RunResult(run.out.path, run.out.summary)


def _is_hf_run(run: Run) -> bool:
    """Whether the run trains a transformers model (a pipeline rank holds copies of it, cut)."""
    pipeline = run.par.pipeline
    return is_hf_model(pipeline.stages[0] if pipeline is not None else run.plain_model)
