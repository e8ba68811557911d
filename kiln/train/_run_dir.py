"""The run directory: config.yaml, metrics.csv, summary.json, checkpoints/, loss.png.

``summary.json`` says ``"status": "running"`` from the first second, and only a run that
finished says ``"completed"``; a crash or Ctrl-C leaves ``"failed"`` or ``"interrupted"``
with the error, so a broken run never looks complete.
"""

from __future__ import annotations

import csv
import json
import os
import re
import time
from pathlib import Path
from typing import Any

SUMMARY = "summary.json"
METRICS = "metrics.csv"
CONFIG = "config.yaml"
CHECKPOINTS = "checkpoints"


def atomic_write_bytes(path: Path, write: Any) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, then rename it into place:
    a crash in the middle never leaves a half-written ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, lambda f: f.write(text.encode()))


class RunDir:
    """One run's directory. Created fresh; never reuses or overwrites an existing one."""

    def __init__(self, path: Path):
        self.path = path
        self.checkpoints = path / CHECKPOINTS
        self._metrics_file = None
        self._metrics_writer: csv.DictWriter | None = None
        self.summary: dict[str, Any] = {}

    @classmethod
    def create(cls, output_dir: str | Path, prefix: str) -> "RunDir":
        root = Path(output_dir)
        root.mkdir(parents=True, exist_ok=True)
        prefix = re.sub(r"[^A-Za-z0-9_.-]+", "-", prefix).strip("-") or "run"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for i in range(1000):
            path = root / (f"{prefix}-{stamp}" + (f"-{i}" if i else ""))
            try:
                path.mkdir()  # fails if it exists: two runs never share a directory
            except FileExistsError:
                continue
            run = cls(path)
            run.checkpoints.mkdir()
            return run
        raise RuntimeError(f"could not create a new run directory under {root}")

    @classmethod
    def open(cls, path: Path) -> "RunDir":
        """An existing run directory, to continue (``kiln train --resume``)."""
        run = cls(path)
        summary = path / SUMMARY
        if summary.exists():
            run.summary = json.loads(summary.read_text())
        run.checkpoints.mkdir(parents=True, exist_ok=True)  # KILN_RUN_DIR may name a path not made yet
        return run

    # ------------------------------------------------------------------ metrics

    def truncate_metrics(self, after_step: int) -> None:
        """Drop rows logged after ``after_step`` (a resumed run logs those steps again)."""
        path = self.path / METRICS
        if not path.exists():
            return
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            fields, rows = reader.fieldnames, [r for r in reader if int(r["step"]) <= after_step]
        def write(f: Any) -> None:
            import io

            text = io.StringIO()
            writer = csv.DictWriter(text, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
            f.write(text.getvalue().encode())

        atomic_write_bytes(path, write)

    def open_metrics(self, fields: list[str]) -> None:
        path = self.path / METRICS
        new = not path.exists()
        self._metrics_file = open(path, "a", newline="")
        self._metrics_writer = csv.DictWriter(self._metrics_file, fieldnames=fields, extrasaction="ignore")
        if new:
            self._metrics_writer.writeheader()

    def log_metrics(self, row: dict[str, Any]) -> None:
        assert self._metrics_writer is not None, "open_metrics first"
        self._metrics_writer.writerow({k: _fmt(v) for k, v in row.items()})
        self._metrics_file.flush()  # a crash keeps every row logged so far

    def close(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None

    # ------------------------------------------------------------------ summary

    def write_summary(self, **updates: Any) -> None:
        self.summary.update(updates)
        atomic_write_text(self.path / SUMMARY, json.dumps(self.summary, indent=2, sort_keys=False) + "\n")


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else value


def read_metrics(run_dir: str | Path) -> list[dict[str, str]]:
    with open(Path(run_dir) / METRICS, newline="") as f:
        return list(csv.DictReader(f))
