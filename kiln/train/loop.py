"""kiln's training loop: one function, read top to bottom.

    build (data, model [+ activation checkpointing], optimizer, schedule [, compile])
    create the run directory
    for each optimizer step:
        for each of train.accumulate micro-batches:
            forward under autocast -> loss / K -> (scaled) backward
        unscale -> clip (optional) -> optimizer step (skipped on fp16 overflow)
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
from kiln.precision import Precision
from kiln.train._build import (
    build_data,
    build_model,
    build_optimizer,
    build_scheduler,
    pick_device,
    seed_everything,
)
from kiln.train._plot import plot_loss
from kiln.train._progress import Progress
from kiln.train._run_dir import CONFIG, RunDir
from kiln.train._tasks import evaluate, loss_fn, metric_names


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this run: allocated CUDA memory, or the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm; returns the norm before clipping."""
    import kiln.optim

    return kiln.optim.clip_grad_norm_(optimizer, max_norm)


def train(cfg: Any, *, name: str = "run") -> RunResult:
    """Train as ``cfg`` (a validated config from ``kiln.config.load_config``) says."""
    wall_start = time.perf_counter()
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    device = pick_device(tc.device)
    seed_everything(tc.seed)

    # ---- build everything before touching the disk --------------------------------------
    precision = Precision(tc.precision, device)
    data = build_data(cfg.data, seed=tc.seed, accumulate=tc.accumulate, device=device)
    model = build_model(cfg.model).to(device, dtype=precision.param_dtype)
    if tc.activation_checkpointing != "none":
        from kiln.memory import apply_ac

        apply_ac(model, tc.activation_checkpointing, every=tc.ac_every)
    optimizer = build_optimizer(cfg.optim, model)  # after .to(): the arena lives on the device
    if tc.compile:
        from kiln.compile import apply_compile

        model = apply_compile(model)  # compiles lazily: the first step pays for it
    steps_per_epoch = len(data.train) // tc.accumulate
    if steps_per_epoch == 0:
        from kiln.config import ConfigError

        raise ConfigError(
            f"the training set gives {len(data.train)} micro-batches per epoch, fewer than "
            f"train.accumulate={tc.accumulate}; lower data.batch_size or train.accumulate"
        )
    total_steps = tc.max_steps if tc.max_steps is not None else tc.epochs * steps_per_epoch
    scheduler = build_scheduler(cfg.optim, optimizer, total_steps)
    n_params = sum(p.numel() for p in model.parameters())

    # ---- the run directory ---------------------------------------------------------------
    run = RunDir.create(tc.output_dir, tc.run_name or name)
    save_config(cfg, run.path / CONFIG)
    run.write_summary(
        status="running", started_at=_dt.datetime.now().isoformat(timespec="seconds"),
        kiln_version=kiln.__version__, torch_version=torch.__version__, device=str(device),
        parameters=n_params, total_steps=total_steps,
    )
    evals = [f"eval_{m}" for m in metric_names(data.task)]
    run.open_metrics(["step", "epoch", "train_loss", "lr", "grad_norm", "loss_scale", "skipped_steps",
                      "samples_per_second", "peak_memory_mb", "wall_seconds", *evals])
    progress = Progress(total_steps, mode=tc.progress)
    progress.message(f"kiln: {n_params:,} parameters on {device}, {total_steps} steps -> {run.path}")

    batches = _forever(data.train)
    window_loss = torch.zeros((), device=device)  # sum of step losses since the last log
    window_steps, window_start = 0, time.perf_counter()
    train_seconds, samples_seen = 0.0, 0
    last_train_loss, last_eval, grad_norm = float("nan"), {}, None
    compile_seconds = None
    epoch = 0
    try:
        model.train()
        for step in range(1, total_steps + 1):
            step_start = time.perf_counter()
            for _ in range(tc.accumulate):
                epoch, (inputs, targets) = next(batches)
                inputs = _to_device(inputs, device, precision.param_dtype)
                targets = targets.to(device, non_blocking=True)
                with precision.autocast():
                    # Each micro-batch holds batch_size / K samples, so dividing its mean loss by
                    # K makes the summed gradient that of the mean over the whole batch.
                    loss = loss_fn(data.task, model, (inputs, targets)) / tc.accumulate
                precision.backward(loss)  # fp16: backward of the scaled loss
                window_loss += loss.detach()
            if tc.clip_grad_norm is not None:
                precision.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                grad_norm = clip_gradients(optimizer, tc.clip_grad_norm)
            if precision.step(optimizer):  # False: fp16 overflow, step skipped, nothing changed
                scheduler.step()
            optimizer.zero_grad()  # kiln's optimizers: one memset of the flat gradient
            if tc.compile and step == 1:
                compile_seconds = time.perf_counter() - step_start  # reported apart from step time
            window_steps += 1
            samples_seen += cfg.data.batch_size

            row: dict[str, Any] = {}
            if step % tc.log_every == 0 or step == total_steps:
                # note: .item() waits for the device; done once per log window, not per step
                last_train_loss = (window_loss / window_steps).item()
                elapsed = time.perf_counter() - window_start
                if compile_seconds is not None and step <= tc.log_every:
                    elapsed -= compile_seconds  # the compiling first step is not training speed
                train_seconds += elapsed
                row.update(
                    train_loss=last_train_loss, lr=scheduler.get_last_lr()[0],
                    grad_norm=None if grad_norm is None else float(grad_norm),
                    loss_scale=precision.scaler.scale if precision.scaler else None,
                    skipped_steps=precision.scaler.skipped_steps if precision.scaler else None,
                    samples_per_second=window_steps * cfg.data.batch_size / max(elapsed, 1e-9),
                )
                window_loss.zero_()
                window_steps = 0
            if (tc.eval_every and step % tc.eval_every == 0) or step == total_steps:
                with precision.autocast():
                    last_eval = evaluate(data.task, model, data.val, device, precision.param_dtype)
                row.update({f"eval_{k}": v for k, v in last_eval.items()})
            if row:
                row.update(step=step, epoch=round(epoch + _epoch_fraction(step, tc.accumulate, len(data.train)), 4),
                           peak_memory_mb=peak_memory_mb(device),
                           wall_seconds=time.perf_counter() - wall_start)
                run.log_metrics(row)
                progress.update(step, loss=row.get("train_loss"), lr=row.get("lr"),
                                **{"samples/s": _round(row.get("samples_per_second"))},
                                **{f"val_{k}": v for k, v in last_eval.items() if "eval_loss" in row})
                window_start = time.perf_counter()  # evaluation and logging are not training time
            if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < total_steps:
                run.save_checkpoint(f"step-{step:08d}", _checkpoint(model, optimizer, scheduler, step, precision))

        run.save_checkpoint("final", _checkpoint(model, optimizer, scheduler, total_steps, precision))
        summary = dict(
            status="completed", steps=total_steps,
            epochs=round(total_steps * tc.accumulate / len(data.train), 4),
            final_train_loss=last_train_loss, eval=last_eval,
            samples_per_second=samples_seen / max(train_seconds, 1e-9),
            peak_memory_mb=peak_memory_mb(device),
            wall_seconds=time.perf_counter() - wall_start,
            compile_seconds=compile_seconds,
            skipped_steps=precision.scaler.skipped_steps if precision.scaler else 0,
            finished_at=_dt.datetime.now().isoformat(timespec="seconds"),
        )
        run.close()
        plot_loss(run.path)
        run.write_summary(**summary)  # last: "completed" only once everything else is on disk
        progress.close()
        shown = "  ".join(f"{k} {v:.4f}" for k, v in last_eval.items())
        progress.message(
            f"kiln: done in {summary['wall_seconds']:.1f} s, {summary['samples_per_second']:.0f} samples/s, "
            f"train loss {last_train_loss:.4f}, eval {shown} -> {run.path}"
        )
        return RunResult(run.path, run.summary)
    except BaseException as exc:
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        run.write_summary(status=status, error=f"{type(exc).__name__}: {exc}",
                          traceback=traceback.format_exc(), wall_seconds=time.perf_counter() - wall_start)
        raise
    finally:
        progress.close()
        run.close()


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    # torch.compile wraps the model; checkpoints hold the plain model's keys.
    return getattr(model, "_orig_mod", model)


def _forever(loader: Any):
    """Yield ``(epoch, batch)`` across epochs without end."""
    epoch = 0
    while True:
        for batch in loader:
            yield epoch, batch
        epoch += 1


def _epoch_fraction(step: int, accumulate: int, batches_per_epoch: int) -> float:
    return (step * accumulate % batches_per_epoch) / batches_per_epoch


def _round(x: Any) -> Any:
    return None if x is None else round(x)


def _to_device(x: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # Floating inputs follow the parameters' dtype (fp64 runs); token ids stay integers.
    return x.to(device, dtype=dtype if x.is_floating_point() else None, non_blocking=True)


def _checkpoint(model: torch.nn.Module, optimizer: Any, scheduler: Any, step: int,
                precision: Precision) -> dict[str, Any]:
    return {
        "model": _unwrapped(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "precision": precision.state_dict(),
        "step": step,
        "kiln_version": kiln.__version__,
    }
