"""``kiln tune CONFIG``: measure a few speed settings on this machine and recommend the fastest.

With a memory budget (``kiln tune CONFIG --nproc N --memory-budget 8GB``, :func:`tune_within`)
it searches the layout too: ``dp x tp x pp``, the ZeRO stage, the micro-batch, activation
checkpointing, precision and (``--compile``) compile. Every candidate is planned on fake tensors
(:func:`kiln.plan.plan`) and dropped when its fullest rank's peak is over the budget, without
running it; the rest are ranked by a cost model (:mod:`kiln.plan._costmodel`: the plan's FLOPs,
operators and collective bytes against this machine's measured matmul, operator and collective
speeds), and the ``trials`` best predicted are trained for a few steps each (``kiln train --nproc
N`` in a temporary directory), their speed and peak tensor memory measured. The pick is the
fastest trial whose measured peak is within the budget. :mod:`kiln.plan.search` says how the
candidates are planned (not all of them: best first, until the fastest that fit are known).

Without a budget, each candidate is a set of overrides on top of the config (precision, the arena, loader
workers, optionally compile); each is trained for ``steps`` steps in this process, in a
temporary run directory, and ranked by measured samples/s. Nothing is estimated: what is
recommended is what ran fastest here.

    >>> rows = tune("configs/digits_mlp.yaml", steps=20)      # doctest: +SKIP
    >>> rows[0]["overrides"]
    ['train.precision=bf16-mixed', 'optim.contiguous=true', 'data.workers=0']
"""

from __future__ import annotations

import itertools
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any, Iterable

from kiln.config import load_config, parse_overrides
from kiln.launch import RUN_DIR_ENV, exit_status, train_command
from kiln.plan.search import AXES, NoFit, search
from kiln.train import train

CANDIDATES: dict[str, tuple[str, ...]] = {
    "train.precision": ("fp32", "bf16-mixed"),
    "optim.contiguous": ("true", "false"),
    "data.workers": ("0", "auto"),
}


def candidates(compile: bool = False, keys: Iterable[str] | None = None) -> list[list[str]]:
    """Every combination of the candidate values, as lists of overrides."""
    grid = dict(CANDIDATES)
    if compile:
        grid["train.compile"] = ("false", "true")
    if keys is not None:
        grid = {k: grid[k] for k in keys}
    return [[f"{k}={v}" for k, v in zip(grid, values)] for values in itertools.product(*grid.values())]


def tune(config: str | Path, overrides: Iterable[str] = (), *, steps: int = 30, compile: bool = False,
         keys: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Train every candidate for ``steps`` steps; rows sorted fastest first."""

    overrides = list(overrides)
    load_config(config, overrides)  # a bad config fails here, before any trial
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="kiln-tune-"))
    try:
        for trial in candidates(compile, keys):
            cfg = load_config(config, [*overrides, *trial, f"train.max_steps={steps}", "train.eval_every=0",
                                       "train.checkpoint_every=0", "train.progress=none",
                                       "train.early_stopping=null", f"train.output_dir={scratch}"])
            summary = train(cfg, name="tune").summary
            rows.append({"overrides": trial, "samples_per_second": summary["samples_per_second"],
                         "peak_memory_mb": summary["peak_memory_mb"],
                         "final_train_loss": summary["final_train_loss"]})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return sorted(rows, key=lambda r: -r["samples_per_second"])


def _trial(config: str | Path, overrides: list[str], nproc: int, steps: int, scratch: Path) -> dict[str, Any]:
    """Train ``overrides`` for ``steps`` steps in ``nproc`` processes, as ``kiln train --nproc N``
    would, in a directory under ``scratch``; its summary.json (or the error, under "error").

    This process is the trial's launcher (even of one process: a trial's peak is its own, and a
    trial that crashes takes only its ranks with it); the ranks are forked from the fork server
    that every trial shares, which imported torch and the trainer once, rather than each trial
    starting two new interpreters (its launcher and that launcher's fork server), seconds of CPU
    before it trained (docs/lab/facts.md, 'What an import costs'). Their output goes to files
    under the trial's directory."""
    import contextlib
    import io
    import json
    import os

    out = Path(tempfile.mkdtemp(prefix="trial-", dir=scratch))
    args = [*overrides, f"train.max_steps={steps}", "train.log_every=2", "train.eval_every=0",
            "train.checkpoint_every=0", "train.progress=none", "train.early_stopping=null", "train.loggers=[csv]",
            "train.measure_memory=true", f"train.output_dir={out}"]
    environ, err = dict(os.environ), io.StringIO()
    os.environ.pop(RUN_DIR_ENV, None)  # a trial's run directory is its own
    if nproc > 1:  # what torchrun's agent would set for the ranks, and say so on every trial
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = exit_status(lambda: train_command(str(config), args, nproc=nproc, rank_logs=out / "logs"))
    except Exception as exc:  # a bug the trial hit is the trial's error, as a crashed process's was
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        os.environ.clear()
        os.environ.update(environ)
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):  # Ctrl-C or SIGTERM stopped the trial:
        signal.raise_signal(code - 128)  # the same stop, to the tuner (it ends as kiln train would)
    summaries = list(out.glob("*/summary.json"))
    summary = json.loads(summaries[0].read_text()) if summaries else {}
    if code != 0 or summary.get("status") != "completed":
        text = err.getvalue()
        lines = [ln for ln in text.splitlines() if ln.startswith("kiln: error")] or text.strip().splitlines()[-1:]
        return {"error": (lines[0] if lines else f"exit status {code}")[:300]}
    return summary


def tune_within(config: str | Path, overrides: Iterable[str] = (), *, nproc: int = 1, budget: int,
                trials: int = 3, steps: int = 12, compile: bool = False, exhaustive: bool = False,
                say: Any = lambda line: None) -> Any:
    """The fastest configuration of ``config`` over ``nproc`` processes whose peak tensor memory
    fits ``budget`` bytes a process (see the module). Returns a :class:`kiln.plan.search.Search`
    whose ``pick`` is the chosen candidate; raises :class:`kiln.plan.search.NoFit` when nothing fits."""
    import time

    from omegaconf import OmegaConf

    overrides = list(overrides)
    cfg = load_config(config, overrides)  # a bad config fails here, before any plan
    given = {k for k, _ in parse_overrides(overrides)}
    pinned = {k: OmegaConf.select(cfg, k) for k in AXES if k in given}  # typed, as validated

    def load(more: list[str]) -> Any:
        return load_config(config, [*overrides, *more])

    started = time.perf_counter()
    found = search(load, nproc, budget, pinned=pinned, compiles=(False, True) if compile else (False,),
                   want=trials, exhaustive=exhaustive, say=say)
    scratch = Path(tempfile.mkdtemp(prefix="kiln-tune-"))
    try:
        for c in found.ranked[:trials]:
            say(f"  trial {' '.join(c.overrides)} ({steps} steps)")
            summary = _trial(config, [*overrides, *c.overrides], nproc, steps, scratch)
            if "error" in summary:
                c.trial_note = summary["error"]
                continue
            peak_mb = summary.get("peak_tensor_memory_mb")
            c.measured_peak_bytes = None if peak_mb is None else int(round(peak_mb * 2**20))
            c.samples_per_second = summary.get("samples_per_second")
            if c.measured_peak_bytes is not None and c.measured_peak_bytes > budget:
                c.trial_note = "measured over the budget"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    timed = [c for c in found.ranked[:trials] if c.samples_per_second and not c.trial_note]
    if not timed:
        notes = "; ".join(f"{' '.join(c.overrides)}: {c.trial_note}" for c in found.ranked[:trials])
        raise NoFit(f"none of the {min(trials, len(found.ranked))} configurations tried trained within the "
                    f"budget ({notes})")
    found.pick = max(timed, key=lambda c: c.samples_per_second)
    found.seconds = time.perf_counter() - started
    return found


def budget_report(found: Any, config: str | Path, overrides: list[str], nproc: int, budget_text: str) -> str:
    """The table of planned candidates (fastest predicted first) and the pick, for the terminal."""
    pick = found.pick
    per_step = found.samples_per_step
    lines = [f"{'pred MB':>9} {'meas MB':>9} {'pred s/s':>9} {'meas s/s':>9}  overrides"]
    shown = sorted(found.planned, key=lambda c: (c.status != "fits", c.predicted_s or 0))
    for c in shown:
        meas = "" if c.measured_peak_bytes is None else f"{c.measured_peak_bytes / 2**20:9.1f}"
        speed = "" if c.samples_per_second is None else f"{c.samples_per_second:9.1f}"
        mark = "" if c.status == "fits" else f"  ({c.status})"
        lines.append(f"{c.predicted_peak_bytes / 2**20:9.1f} {meas:>9} {per_step / c.predicted_s:9.1f} {speed:>9}  "
                     f"{' '.join(c.overrides)}{mark}{'  [' + c.trial_note + ']' if c.trial_note else ''}")
    unplanned = sum(c.plan is None for c in found.candidates)
    lines.append(f"{len(found.candidates)} candidates: {found.plans} planned in {found.plan_seconds:.0f} s, "
                 f"{unplanned} not planned (slower by the cost model, implied over budget, or invalid); "
                 f"{sum(c.samples_per_second is not None for c in found.candidates)} timed; {found.seconds:.0f} s in all")
    lines.append(f"pick: predicted peak {pick.predicted_peak_bytes / 2**20:,.1f} MB, measured "
                 f"{pick.measured_peak_bytes / 2**20:,.1f} MB (budget {budget_text} a process); predicted "
                 f"{per_step / pick.predicted_s:,.1f} samples/s, measured {pick.samples_per_second:,.1f}")
    nproc_arg = f" --nproc {nproc}" if nproc > 1 else ""
    given = {o.split("=", 1)[0] for o in overrides}
    chosen = [o for o in pick.overrides if o.split("=", 1)[0] not in given]
    lines.append(f"kiln train {config}{nproc_arg} {' '.join([*overrides, *chosen])}")
    return "\n".join(lines)


def budget_json(found: Any) -> dict[str, Any]:
    """``kiln tune --memory-budget --json``: ``pick`` and ``candidates`` (every planned one)."""
    per_step = found.samples_per_step
    return {"budget_bytes": found.budget, "pick": found.pick.as_json(per_step),
            "candidates": [c.as_json(per_step) for c in found.planned],
            "not_planned": len(found.candidates) - len(found.planned), "plans": found.plans,
            "plan_seconds": round(found.plan_seconds, 2), "seconds": round(found.seconds, 2),
            "speeds": vars(found.speeds)}


def table(rows: list[dict[str, Any]]) -> str:
    base = rows and min(r["samples_per_second"] for r in rows)
    lines = [f"{'samples/s':>10} {'vs slowest':>10} {'peak MB':>8}  overrides"]
    for r in rows:
        lines.append(f"{r['samples_per_second']:10.0f} {r['samples_per_second'] / base:9.2f}x "
                     f"{r['peak_memory_mb']:8.0f}  {' '.join(r['overrides'])}")
    return "\n".join(lines)
