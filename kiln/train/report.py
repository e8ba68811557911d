"""``kiln report RUN_DIR [RUN_DIR ...]``: several runs in one picture and one table, so the
effect of a change is visible at a glance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.train._run_dir import METRICS, SUMMARY, read_metrics

_COLUMNS = ("status", "steps", "final_train_loss", "eval_loss", "eval_accuracy", "samples_per_second",
            "peak_memory_mb", "wall_seconds")


def _row(run: Path) -> dict[str, Any]:
    summary = json.loads((run / SUMMARY).read_text()) if (run / SUMMARY).exists() else {}
    row = {"run": run.name, **{k: summary.get(k) for k in _COLUMNS}}
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
    """A plain-text table of the runs' summaries, one row per run."""
    rows = [_row(r) for r in runs]
    header = ["run", *_COLUMNS]
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
    """Train loss, eval loss and eval accuracy of every run against step, in one figure."""
    from kiln._plotting import pyplot

    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("train_loss", "train loss", True), ("eval_loss", "eval loss", True),
              ("eval_accuracy", "eval accuracy", False))
    for run in runs:
        rows = read_metrics(run)
        for ax, (key, title, log) in zip(axes, panels):
            points = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
            if points:
                ax.plot(*zip(*points), marker="o" if key.startswith("eval") else None, markersize=3, label=run.name)
    for ax, (_, title, log) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
