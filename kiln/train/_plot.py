"""Loss curves: ``loss.png`` in a run directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln._plotting import log_scale, subplots
from kiln.train.run_dir import read_metrics


def _series(rows: list[dict[str, str]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for row in rows:
        if row.get(key):
            xs.append(int(row["step"]))
            ys.append(float(row[key]))
    return xs, ys


def _decades(values: list[float]) -> float:
    """How many powers of ten the positive ``values`` span (0 with fewer than two)."""
    import math

    positive = [v for v in values if v > 0 and math.isfinite(v)]
    return math.log10(max(positive) / min(positive)) if len(positive) > 1 else 0.0


def plot_loss(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Train and eval loss against step, from ``metrics.csv``: ``loss.png`` in the run directory,
    or ``out``."""
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / "loss.png"
    loss_figure(run_dir).savefig(out, dpi=100)
    return out


def loss_figure(run_dir: Path) -> Any:
    """The ``matplotlib`` figure :func:`plot_loss` saves."""

    rows = read_metrics(run_dir)
    fig, ax = subplots(figsize=(7, 4.2))
    losses = []
    for key, label, style in (("train_loss", "train", "-"), ("eval_loss", "eval", "o-")):
        xs, ys = _series(rows, key)
        if xs:
            ax.plot(xs, ys, style if len(xs) > 1 else "o", label=label, markersize=3)  # (one point: a dot)
            losses += ys
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if _decades(losses) >= 1:
        # a log axis where the losses span a decade or more; over less, its ticks would be the
        # minor ones, each drawn and labelled (slower: docs/lab/facts.md, 'Host time'),
        # for a curve a linear axis shows as well
        log_scale(ax.yaxis)
    ax.set_title(run_dir.name, y=1.0)  # (placed, not fitted around the ticks: docs/lab/facts.md, 'Host time')
    ax.grid(alpha=0.3)
    ax.legend()
    # fixed margins, not tight_layout's measuring of every label (a third of the picture's time)
    fig.subplots_adjust(left=0.11, right=0.98, bottom=0.11, top=0.92)
    return fig
