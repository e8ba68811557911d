"""``kiln report RUN_DIR [RUN_DIR ...]``: several runs in one picture and one table, so the
effect of a change is visible at a glance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln._plotting import log_scale, subplots
from kiln.train.run_dir import METRICS, SUMMARY, read_metrics


_COLUMNS = ("status", "steps", "final_train_loss", "samples_per_second", "peak_memory_mb", "wall_seconds")


def _eval_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every eval metric any of the runs reported (loss first), in the order first seen."""
    seen = ["eval_loss"]
    for row in rows:
        seen += [k for k in row if k.startswith("eval_") and k not in seen]
    return seen


def _row(run: Path) -> dict[str, Any]:
    summary = json.loads((run / SUMMARY).read_text()) if (run / SUMMARY).exists() else {}
    row: dict[str, Any] = {"run": run.name, **{k: summary.get(k) for k in _COLUMNS}}
    for name, value in (summary.get("eval") or {}).items():
        row[f"eval_{name}"] = value
    return row


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(runs: list[Path]) -> str:
    """A plain-text table of the runs' summaries, one row per run, with whatever eval metrics
    they reported (a user's own metrics too)."""
    rows = [_row(r) for r in runs]
    header = ["run", *_COLUMNS[:3], *_eval_columns(rows), *_COLUMNS[3:]]
    cells = [[_fmt(r.get(h)) for h in header] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells]
    return "\n".join(lines)


def check_runs(paths: list[str]) -> list[Path]:
    runs = [Path(p) for p in paths]
    for run in runs:
        if not (run / METRICS).is_file():
            raise FileNotFoundError(f"{run} is not a kiln run directory (no {METRICS} in it)")
    return runs


def plot(runs: list[Path], out: Path) -> Path:
    """Train loss and every eval metric of every run against step, one panel each, in one figure."""
    metrics = {run: read_metrics(run) for run in runs}
    evals = _eval_columns([row for rows in metrics.values() for row in rows[:1]])
    panels = [("train_loss", "train loss", True)] + [(k, k.replace("_", " "), k.endswith(("loss", "perplexity")))
                                                      for k in evals]
    fig, axes = subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    axes = axes[0]
    for run in runs:
        rows = metrics[run]
        for ax, (key, title, log) in zip(axes, panels):
            points = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
            if points:
                ax.plot(*zip(*points), marker="o" if key.startswith("eval") else None, markersize=3, label=run.name)
    for ax, (_, title, log) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        if log:
            log_scale(ax.yaxis)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out
