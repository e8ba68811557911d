"""``kiln bench pipeline``: the Lightning article's six ways to a faster pipeline, stacked, as
time to a target validation accuracy.

The article took a training pipeline and added, one after the other, parallel data loading,
multi-GPU data parallel, mixed precision, sharded training, early stopping and evaluation
under ``no_grad``; all but sharding helped, and together they made the pipeline 10x faster.
Here each technique is one config key (or ``--nproc``) on the same ``kiln train`` run, and each
row adds one to the row above:

1. naive: ``data.workers=0``, one process, ``train.precision=fp32``, ``parallel.zero=0``, no
   early stopping, ``train.eval_grad=true`` (evaluation with autograd on, as a hand-written
   loop without ``torch.no_grad`` does);
2. ``data.workers=auto``;  3. ``--nproc 2``;  4. ``train.precision=bf16-mixed``;
5. ``parallel.zero=2``;  6. ``train.early_stopping``: stop after 3 evaluations without the
   validation loss improving by 0.02;
7. ``train.eval_grad=false``: evaluation under ``torch.no_grad`` (kiln's default).

The task: scikit-learn's digits through the CPU-heavy per-sample augmentation of ``kiln bench
dataloader`` (:class:`kiln.bench.dataloader.AugmentedDigits`: upsampling, random resized crop,
random colours, flip, rotation with an elastic distortion, blur, noise, contrast), at 48x48,
classified by a small CNN (:class:`PipelineCNN`). The validation set is the 297 held-out
digits through the same augmentation with a fixed seed, made once per run. Every row trains
with the same seed, batch and constant learning rate for at most ``max_steps`` steps (the
step budget, the article's fixed number of epochs), evaluating every ``eval_every`` steps.

Each row is one ``python -m kiln train pipeline.yaml [--nproc 2] KEY=VALUE ...`` in a fresh
process (the command is in the JSON: paste it to rerun a row). ``--quick`` is a smoke run of the
same rows: each runs its arguments through :func:`kiln.commands.main` in the bench's own process (a
row with ``--nproc 2`` forks its ranks from that process's fork server), so its command and CPU
seconds leave out Python's start-up and the imports, and the ranks' CPU is not counted. Columns:

- time to target: the run's own clock (``wall_seconds`` of ``metrics.csv``, rank 0, from the
  start of setup: data sets, model, loader workers and evaluations included, Python start-up
  and torchrun's not) at the first evaluation whose accuracy reaches ``target``; the speedup
  column is row 1's time over this. A run does not stop at the target: no real run knows its
  target in advance, and stopping there would leave early stopping nothing to save.
- run: the whole run's wall time (``summary.json``; to the step budget, or to the early stop,
  final checkpoint included) and its speedup over row 1: what the article timed.
- command s: the wall time of the whole ``kiln train`` command, Python start-up, torchrun's
  launch of the ranks and the final checkpoint included; CPU s: the CPU time of all its
  processes (launcher, ranks, loader workers). Neither enters the speedups; CPU time depends
  far less than wall time on what else runs on the machine, and shows what a technique costs
  in work (emulated bf16, evaluation with autograd, the steps early stopping leaves out).
- steps (to target / run), final accuracy, and peak memory: rank 0's peak resident set (the
  ranks are symmetric; loader workers are other processes and not counted).

What a small CPU machine limits (cores shared by ranks and loader workers, bf16 emulated,
ZeRO-2 on a model of ~0.1 M parameters, augmentation streams that differ in workers) is said
under the table, from the run's own numbers (:func:`_notes`).

    kiln bench pipeline            # or --quick for a smoke run
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.bench import pp_schedules
from kiln.bench._harness import Bars, Col, Result, Table, benchmark, children_cpu_s
from kiln.bench.dataloader import AugmentedDigits
from kiln.data import build_dataset
from kiln.hardware import machine_info
from kiln.launch import exit_status, train_command
from kiln.train import read_metrics


__all__ = ["PipelineCNN", "augmented_digits", "make_model", "ROWS", "row_commands", "run", "measure"]

# image size through the augmentation; the step budget, evaluation interval and target
FULL = dict(max_steps=400, eval_every=20, target=0.65, patience=3, min_delta=0.02, val_size=None)
QUICK = dict(max_steps=2, eval_every=1, target=0.0, patience=1, min_delta=0.02, val_size=64)
IMAGE = dict(upsample=60, out=48)
BATCH, EVAL_BATCH, LR = 32, 512, 1e-3

# (name, processes, overrides added by this row); each row keeps every override above it
ROWS: list[tuple[str, int, list[str]]] = [
    ("naive", 1, ["data.workers=0", "train.precision=fp32", "parallel.zero=0", "train.early_stopping=null",
                  "train.eval_grad=true"]),
    ("+ workers=auto", 1, ["data.workers=auto"]),
    ("+ --nproc 2", 2, []),
    ("+ bf16-mixed", 2, ["train.precision=bf16-mixed"]),
    ("+ ZeRO-2", 2, ["parallel.zero=2"]),
    ("+ early stopping", 2, ["train.early_stopping={metric:eval_loss,mode:min,patience:PATIENCE,min_delta:MIN_DELTA}"]),
    ("+ no-grad eval", 2, ["train.eval_grad=false"]),
]


class PipelineCNN(nn.Module):
    """Three stride-2 3x3 convolutions (3 -> w -> 2w -> 4w channels) with ReLU and a linear
    classifier on the flattened (4w, H/8, W/8) features: (B, 3, H, W) -> (B, classes).

    The augmentation's images have a standard deviation of about 0.2; ``input_scale`` brings
    them to about 1. (A global-average-pooled head learned nothing in 240 steps here: the
    digit's position matters.)"""

    def __init__(self, width: int = 32, num_classes: int = 10, image_size: int = 48, input_scale: float = 5.0) -> None:
        super().__init__()
        w, side = width, -(-image_size // 8)
        self.input_scale = input_scale
        self.features = nn.Sequential(
            nn.Conv2d(3, w, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(2 * w, 4 * w, 3, stride=2, padding=1), nn.ReLU(),
        )
        self.head = nn.Linear(4 * w * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x * self.input_scale).flatten(1))  # (B, 4w, H/8, W/8) -> (B, C)


def make_model(width: int = 32, num_classes: int = 10, image_size: int = 48, input_scale: float = 5.0) -> PipelineCNN:
    """The bench's model (``model._target_`` of its config)."""
    return PipelineCNN(width, num_classes, image_size, input_scale)


def augmented_digits(seed: int = 0, *, upsample: int = 60, out: int = 48, val_seed: int = 1234,
                     val_size: int | None = None) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    """``(train, val)`` for the bench's config (``data._target_``): kiln's digits split in [0, 1]
    through :class:`~kiln.bench.dataloader.AugmentedDigits`; train draws a new augmentation at
    every access, val is augmented once with ``val_seed`` (the same set in every run and rank);
    ``val_size``: only the first that many validation digits (quick runs)."""
    import random

    import numpy as np

    del seed  # the augmentation draws from the global RNGs, which kiln seeds (and each worker's)
    splits = build_dataset("digits", seed=0)
    x, y = splits.train.tensors  # (N, 1, 8, 8), standardized with scalars: min and max map back to 0 and 1
    lo, hi = x.min(), x.max()
    train = AugmentedDigits(((x - lo) / (hi - lo))[:, 0], y, upsample=upsample, out=out)
    vx, vy = splits.val.tensors[0][:val_size], splits.val.tensors[1][:val_size]
    val_raw = AugmentedDigits(((vx - lo) / (hi - lo))[:, 0].clamp(0, 1), vy, upsample=upsample, out=out)
    state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(val_seed)
        np.random.seed(val_seed)
        torch.manual_seed(val_seed)
        samples = [val_raw[i] for i in range(len(val_raw))]
    random.setstate(state[0])
    np.random.set_state(state[1])
    val = torch.utils.data.TensorDataset(torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples]))
    return train, val


def _config(spec: dict[str, Any]) -> dict[str, Any]:
    """The base config every row starts from (written as ``pipeline.yaml``)."""
    return {
        "model": {"_target_": f"{__name__}.make_model", "width": 32, "num_classes": 10, "image_size": IMAGE["out"]},
        "data": {"_target_": f"{__name__}.augmented_digits", **IMAGE, "val_size": spec["val_size"], "batch_size": BATCH,
                 "eval_batch_size": EVAL_BATCH, "workers": 0},
        "optim": {"name": "adamw", "lr": LR, "schedule": "constant"},
        "train": {"max_steps": spec["max_steps"], "eval_every": spec["eval_every"], "log_every": spec["eval_every"],
                  "seed": 0, "progress": "none", "device": "cpu", "precision": "fp32",
                  # one intra-op thread per process in every row: with more, each op on one small
                  # image pays thread-pool wake-ups (see kiln bench dataloader), which would flatter
                  # the rows with workers for a reason that is not theirs
                  "threads": 1},
    }


def _row_overrides(index: int, spec: dict[str, Any]) -> list[str]:
    """The overrides of rows 1..index, one per key: a later row's value replaces an earlier one."""
    merged: dict[str, str] = {}
    for _, _, extra in ROWS[: index + 1]:
        for override in extra:
            key, value = override.split("=", 1)
            merged[key] = value.replace("PATIENCE", str(spec["patience"])).replace("MIN_DELTA", str(spec["min_delta"]))
    return [f"{k}={v}" for k, v in merged.items()]


def row_commands(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Each row's name, process count and config overrides."""
    return [{"row": i + 1, "name": name, "nproc": nproc, "overrides": _row_overrides(i, spec)}
            for i, (name, nproc, _) in enumerate(ROWS)]


# what a row's command must not inherit: a run directory named by a launcher above, and a thread count
_NOT_INHERITED = ("KILN_RUN_DIR", "OMP_NUM_THREADS")


def _command(argv: list[str]) -> tuple[int, str]:
    """``python -m kiln ARGV`` as a new process: its exit status and its output."""
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    done = subprocess.run([sys.executable, "-m", "kiln", *argv], env=env, capture_output=True, text=True)
    return done.returncode, done.stdout[-3000:] + "\n" + done.stderr[-3000:]


def _in_this_process(argv: list[str]) -> tuple[int, str]:
    """``kiln ARGV`` (``train CONFIG [--nproc N] key=value ...``) in this process, as the command
    runs it (:func:`kiln.launch.train_command` under :func:`kiln.launch.exit_status`), for quick
    runs: no interpreter to start and no imports to repeat; ``--nproc 2`` forks its ranks from
    this process's fork server. Its output goes where this process's goes."""
    _, config, *rest = argv
    nproc = int(rest[rest.index("--nproc") + 1]) if "--nproc" in rest else 1
    overrides = [a for a in rest if "=" in a]
    saved = {k: os.environ.pop(k) for k in _NOT_INHERITED if k in os.environ}
    try:
        return exit_status(lambda: train_command(config, overrides, nproc=nproc)), "(its output is above)"
    finally:
        os.environ.update(saved)


def _cpu_s(in_process: bool) -> float:
    """CPU seconds so far of the finished child processes, and of this one when rows run in it."""
    if not in_process:
        return children_cpu_s()
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    return children_cpu_s() + own.ru_utime + own.ru_stime


def _run_row(config: Path, row: dict[str, Any], runs_dir: Path, target: float, in_process: bool) -> dict[str, Any]:
    out = runs_dir / f"row{row['row']}"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["train", str(config), *(["--nproc", str(row["nproc"])] if row["nproc"] > 1 else []), *row["overrides"],
            f"train.output_dir={out}", f"train.run_name=row{row['row']}"]
    cpu_before, start = _cpu_s(in_process), time.perf_counter()
    code, output = (_in_this_process if in_process else _command)(argv)
    command_s = time.perf_counter() - start
    cpu_s = _cpu_s(in_process) - cpu_before  # the command and every process it waited for
    if code != 0:
        raise RuntimeError(f"row {row['row']} ({row['name']}) failed with exit code {code}:\n"
                           f"kiln {' '.join(argv)}\n{output}")
    import yaml

    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "summary.json").read_text())
    config_used = yaml.safe_load((run_dir / "config.yaml").read_text())
    evals = [r for r in read_metrics(run_dir) if r.get("eval_accuracy")]
    curve = [{"step": int(r["step"]), "wall_s": float(r["wall_seconds"]), "accuracy": float(r["eval_accuracy"]),
              "loss": float(r["eval_loss"])} for r in evals]
    hit = next((e for e in curve if e["accuracy"] >= target), None)
    return {
        **row, "command": " ".join(["kiln", "train", "pipeline.yaml"] + argv[2:-2]),
        "config": {"workers": config_used["data"]["workers"], "precision": config_used["train"]["precision"],
                   "zero": config_used["parallel"]["zero"], "early_stopping": config_used["train"]["early_stopping"],
                   "eval_grad": config_used["train"]["eval_grad"], "processes": summary["processes"]},
        "time_to_target_s": hit["wall_s"] if hit else None, "steps_to_target": hit["step"] if hit else None,
        "run_s": summary["wall_seconds"], "steps": summary["steps"], "command_s": command_s, "cpu_s": cpu_s,
        "stopped_early": summary["stopped_early"], "final_accuracy": summary["eval"]["accuracy"],
        "best_accuracy": max(e["accuracy"] for e in curve), "peak_memory_mb": summary["peak_memory_mb"],
        "samples_per_s": summary["samples_per_second"], "curve": curve, "run_dir": str(run_dir),
    }


def measure(quick: bool = False, *, out: Path) -> Result:
    """Run the seven rows, each a ``kiln train`` command whose run directory is under ``out/runs``;
    the config every row starts from is ``out/pipeline.yaml``."""
    import yaml

    spec = QUICK if quick else FULL
    config = out / "pipeline.yaml"
    config.write_text(yaml.safe_dump(_config(spec), sort_keys=False))
    rows = [_run_row(config, row, out / "runs", spec["target"], in_process=quick) for row in row_commands(spec)]
    base = rows[0]
    for r in rows:
        r["speedup_to_target"] = (base["time_to_target_s"] / r["time_to_target_s"]
                                  if base["time_to_target_s"] and r["time_to_target_s"] else None)
        r["speedup_run"] = base["run_s"] / r["run_s"]
    cols = [Col("#", "row"), Col("row", "name"), Col("proc", lambda r: r["config"]["processes"]),
            Col("workers", lambda r: str(r["config"]["workers"])), Col("to target s", "time_to_target_s", ".1f"),
            Col("steps", "steps_to_target"), Col("speedup", "speedup_to_target", ".2f"), Col("run s", "run_s", ".1f"),
            Col("steps", "steps"), Col("speedup", "speedup_run", ".2f"), Col("command s", "command_s", ".1f"),
            Col("CPU s", "cpu_s", ".0f"), Col("final acc", "final_accuracy", ".1%"),
            Col("peak MB/rank", "peak_memory_mb", ".0f")]
    label = lambda r: f"{r['row']}. {r['name']}"  # noqa: E731
    chart = [Bars("cumulative speedup over row 1", rows, label, {"time to target": "speedup_to_target",
                  "whole run": "speedup_run"}, "speedup (higher is better)", lines={"row 1": 1.0}),
             Bars("validation accuracy", rows, label, {"final": "final_accuracy", "best": "best_accuracy"},
                  "accuracy", lines={"target": spec["target"]})]
    report = {"setup": dict(spec, batch_size=BATCH, eval_batch_size=EVAL_BATCH, lr=LR, image=IMAGE, quick=quick,
                            rows_in_this_process=quick, base_config=_config(spec)), "rows": rows}
    title = (f"six ways to a faster pipeline, stacked; target: validation accuracy >= {spec['target']:.0%}; "
             f"budget {spec['max_steps']} steps of {BATCH}, evaluation every {spec['eval_every']}")
    # then every pipeline schedule at pp=2 (kiln bench pp-schedules): each rank's measured idle
    # share beside the schedule's theoretical bubble, and the step time
    schedules = pp_schedules.measure(quick)
    report["schedules"] = schedules.report
    tables = [Table(rows, cols), *(dataclasses.replace(t, title=schedules.title) for t in schedules.tables)]
    # every row's processes run one intra-op thread (train.threads)
    return Result(report, tables, title, chart + schedules.chart, targets=schedules.targets,
                  notes=_notes(rows, machine_info()) + schedules.notes, threads=1, processes=2)


run = benchmark("pipeline", measure)


def _notes(rows: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    """What the table says about each technique on this machine, from its own numbers."""
    notes = []
    for prev, r in zip(rows, rows[1:]):
        if prev["time_to_target_s"] and r["time_to_target_s"]:
            ratio = prev["time_to_target_s"] / r["time_to_target_s"]
            verdict = "helped" if ratio > 1.05 else ("hurt" if ratio < 0.95 else "made no clear difference")
            notes.append(f"row {r['row']} ({r['name']}): time to target x{ratio:.2f} over row {prev['row']} "
                         f"({verdict}); whole run x{prev['run_s'] / r['run_s']:.2f}")
    first, last = rows[0], rows[-1]
    if last["speedup_to_target"]:
        notes.append(f"all six together (row {last['row']} over row 1): time to target "
                     f"x{last['speedup_to_target']:.2f}, whole run x{last['speedup_run']:.2f} "
                     "(the article: 10x, on GPUs)")
    stop, before = rows[5], rows[4]
    if stop["stopped_early"]:
        notes.append(f"early stopping ended row 6 at step {stop['steps']} of {before['steps']}: final accuracy "
                     f"{stop['final_accuracy']:.1%} against {before['final_accuracy']:.1%} at the budget (row 5)")
    else:
        notes.append("early stopping did not fire within the step budget: it saved nothing here")
    same = [(e["step"], e["accuracy"], e["loss"]) for e in last["curve"]] == [
        (e["step"], e["accuracy"], e["loss"]) for e in rows[5]["curve"]]
    notes.append(f"workers change only the augmentations' random streams: final accuracy "
                 f"{rows[1]['final_accuracy']:.1%} against row 1's {first['final_accuracy']:.1%}; no-grad evaluation "
                 f"changes no number (row 7's evaluations {'equal' if same else 'DIFFER from'} row 6's); its peak "
                 f"memory {last['peak_memory_mb']:.0f} MB against {rows[5]['peak_memory_mb']:.0f} MB")
    cpus = len(os.sched_getaffinity(0))
    per_rank = cpus // 2
    if per_rank <= 1:
        notes.append(f"{cpus} CPU cores: data.workers=auto gives one process {min(cpus, 8) if cpus > 1 else 0} "
                     "workers but each of 2 processes none (one CPU each), so from row 3 on every rank augments "
                     "its own half-batch in-process, and the ranks' compute competes with it for the same cores")
    if not info["native_bf16"]:
        notes.append("bf16 is emulated on this CPU (no AVX-512-BF16/AMX): bf16-mixed is expected to be slower "
                     "than fp32 here; on a GPU or a bf16 CPU it is the article's speedup")
    notes.append("ZeRO-2 shards the gradients and optimizer state of a ~0.1 M-parameter model: nothing worth "
                 "saving, a reduce-scatter plus all-gather instead of one all-reduce (the article found no gain "
                 "from sharding either)")
    return notes
