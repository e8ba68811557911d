"""``kiln tune CONFIG``: measure a few speed settings on this machine and recommend the fastest.

Each candidate is a set of overrides on top of the config (precision, the arena, loader
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
import tempfile
from pathlib import Path
from typing import Any, Iterable

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
    from kiln.config import load_config
    from kiln.train import train

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


def table(rows: list[dict[str, Any]]) -> str:
    base = rows and min(r["samples_per_second"] for r in rows)
    lines = [f"{'samples/s':>10} {'vs slowest':>10} {'peak MB':>8}  overrides"]
    for r in rows:
        lines.append(f"{r['samples_per_second']:10.0f} {r['samples_per_second'] / base:9.2f}x "
                     f"{r['peak_memory_mb']:8.0f}  {' '.join(r['overrides'])}")
    return "\n".join(lines)
