"""Loss curves: ``loss.png`` in a run directory."""

from __future__ import annotations

from pathlib import Path

from kiln.train._run_dir import read_metrics


def _series(rows: list[dict[str, str]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for row in rows:
        if row.get(key):
            xs.append(int(row["step"]))
            ys.append(float(row[key]))
    return xs, ys


def plot_loss(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Train and eval loss against step, from ``metrics.csv``."""
    from kiln._plotting import log_scale, subplots

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    fig, ax = subplots(figsize=(7, 4.2))
    for key, label, style in (("train_loss", "train", "-"), ("eval_loss", "eval", "o-")):
        xs, ys = _series(rows, key)
        if xs:
            ax.plot(xs, ys, style, label=label, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    log_scale(ax.yaxis)
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    # fixed margins, not tight_layout's measuring of every label (a third of the picture's time)
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.11, top=0.92)
    out = Path(out) if out is not None else run_dir / "loss.png"
    fig.savefig(out, dpi=100)
    return out
