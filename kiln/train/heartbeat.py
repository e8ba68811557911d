"""Each rank's sign of life, so that when a run of ``kiln train --nproc N`` fails on a collective
that timed out, the launcher names the rank that stopped, not the ranks that waited
``parallel.timeout_s`` for it and noticed.

A thread in each rank writes ``rank-R.json`` every second into the folder ``KILN_HEARTBEAT_DIR``
names (the launcher's own temporary folder): the time, the step the loop is in, the host, the
pid and the device. A thread, not the loop: a rank that waits in a collective keeps beating (the
wait releases the GIL), while a rank that stopped (SIGSTOP, a frozen process or host) falls
silent. The loop's part is one attribute store a step (``beat.step = step``); the thread's, one
file of ~100 bytes a second, renamed into place. A rank that exits on its own (done, an error,
a stop signal it handled) marks its last beat ``ended``; a rank killed outright (kill -9, the
OOM killer) leaves none.

    >>> beats = {0: {"time": 100.0, "step": 22}, 1: {"time": 79.0, "step": 21}}
    >>> silent_ranks(beats, at=100.5, after_s=10)
    [1]
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["HEARTBEAT_DIR_ENV", "beat", "read_beats", "silent_ranks"]

HEARTBEAT_DIR_ENV = "KILN_HEARTBEAT_DIR"
EVERY_S = 1.0


class Heartbeat:
    """This process's beats: the step the loop is in and the device go into each."""

    def __init__(self) -> None:
        self.step: int | None = None  # set by the loop, at the start of each step
        self.device: str | None = None
        self._path: Path | None = None
        self._lock = threading.Lock()  # the last beat, marked ended, is never written over

    def start(self, folder: Path, rank: int, every_s: float = EVERY_S) -> None:
        """Write this rank's beat into ``folder`` now and every ``every_s`` seconds after, from a
        daemon thread, until :meth:`end`."""
        self._path = folder / f"rank-{rank}.json"
        if not self._write():
            return

        def run() -> None:
            while True:
                time.sleep(every_s)
                with self._lock:
                    if self._path is None or not self._write():
                        return

        threading.Thread(target=run, name="kiln-heartbeat", daemon=True).start()

    def end(self) -> None:
        """The last beat, marked ended: this rank exits on its own."""
        with self._lock:
            if self._path is not None:
                self._write(ended=True)
                self._path = None

    def _write(self, **extra: Any) -> bool:
        record = {"time": time.time(), "step": self.step, "host": socket.gethostname(), "pid": os.getpid(),
                  "device": self.device, **extra}
        tmp = self._path.with_name(f".{self._path.name}.tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self._path)  # (a reader never sees half a record)
        except OSError:  # the launcher removed the folder: it has ended
            return False
        return True


beat = Heartbeat()  # this process's


def read_beats(folder: Path) -> dict[int, dict[str, Any]]:
    """rank -> its last beat, for every rank that wrote one into ``folder``."""
    beats = {}
    for path in folder.glob("rank-*.json"):
        try:
            beats[int(path.stem.split("-")[1])] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return beats


def silent_ranks(beats: dict[int, dict[str, Any]], at: float, after_s: float) -> list[int]:
    """The ranks whose last beat came more than ``after_s`` seconds before time ``at``."""
    return sorted(rank for rank, b in beats.items() if at - b["time"] > after_s)
