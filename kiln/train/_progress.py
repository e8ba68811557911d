"""Progress display: a live bar on a terminal, plain periodic lines otherwise (CI, log files)."""

from __future__ import annotations

import sys
import time
from typing import Any


def _fmt_seconds(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """``update(step, **fields)`` after each logged step; ``close()`` at the end.

    mode: ``bar`` (rich live bar), ``plain`` (a line at most every ``interval`` seconds, and on
    the first and last step), ``none``, or ``auto`` (bar when stdout is a terminal).
    """

    def __init__(self, total: int, mode: str = "auto", interval: float = 2.0, stream: Any = None,
                 initial: int = 0):
        self.total, self.initial = total, initial
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "plain"
        self.mode = mode
        self.interval = interval
        self._start = time.perf_counter()
        self._last_line = -float("inf")
        self._bar = None
        if mode == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TextColumn("ETA"), TimeRemainingColumn(),
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total, completed=initial, info="")
            self._bar.start()

    def update(self, step: int, **fields: Any) -> None:
        if self.mode not in ("bar", "plain"):  # train.progress=none: no line to format
            return
        info = "  ".join(f"{k} {_fmt(v)}" for k, v in fields.items() if v is not None)
        if self.mode == "bar":
            self._bar.update(self._task, completed=step, info=info)
        elif self.mode == "plain":
            now = time.perf_counter()
            if now - self._last_line >= self.interval or step >= self.total or step <= self.initial + 1:
                elapsed = now - self._start
                eta = elapsed / max(step - self.initial, 1) * (self.total - step)
                print(f"step {step}/{self.total}  {info}  eta {_fmt_seconds(eta)}", file=self.stream, flush=True)
                self._last_line = now

    def restart_clock(self, step: int) -> None:
        """Estimate the time left from the steps after ``step`` only (after a compiling step)."""
        self._start, self.initial = time.perf_counter(), step
        if self.mode == "bar":
            self._bar.reset(self._task, total=self.total, completed=step)

    def message(self, text: str) -> None:
        if self.mode == "bar":
            self._bar.console.print(text)
        elif self.mode == "plain":
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
