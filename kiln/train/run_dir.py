"""The run directory: config.yaml, metrics.csv, summary.json, checkpoints/, loss.png.

``summary.json`` says ``"status": "running"`` from the first second, and only a run that
finished says ``"completed"``; a crash or Ctrl-C (or SIGTERM) leaves ``"failed"`` or
``"interrupted"`` with the error, so a broken run never looks complete.

A run directory has one writer at a time: :class:`RunLock`, an exclusive ``flock`` on
``RUN_DIR/.lock`` held for as long as the run writes. The kernel drops it when its process
dies, so a killed run never blocks its own resume. Under ``kiln train --nproc N`` the launcher
holds it for its workers (kiln/launch/__init__.py).
"""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

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


LOCK = ".lock"


class RunDirBusy(RuntimeError):
    """Another live process writes this run directory."""


class RunLock:
    """An exclusive lock on a run directory: ``flock`` on ``RUN_DIR/.lock``, which records the
    holder's pid and host. Taken without waiting; released by :meth:`release`, or by the kernel
    when the holder dies (kill -9 included), so a stale lock never blocks.

    A lock this process's launcher holds is this process's: the launcher of ``kiln train --nproc
    N`` holds it for the whole run, and torchrun's agent, inside the launcher's process, starts
    the workers (and restarts them) through a fork server of its own: its rank 0 writes the
    directory under the launcher's lock."""

    def __init__(self, fd: int | None):
        self._fd = fd

    @classmethod
    def acquire(cls, path: Path) -> "RunLock":
        """Lock run directory ``path``, or raise RunDirBusy naming the process that holds it."""
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec'd children
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            if held_by_parent(path):
                return cls(None)  # our launcher's lock: this is rank 0 of its workers
            holder = held_by(path)
            who = f"process {holder[0]} on {holder[1]}" if holder else "another process"
            raise RunDirBusy(
                f"{path} is being written by {who}; a run directory takes one writer at a time. Wait for "
                f"it to finish, or stop it, then continue with kiln train --resume {path}") from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        except BaseException:
            os.close(fd)
            raise
        return cls(fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def held_by(path: Path) -> tuple[str, str] | None:
    """``(pid, host)`` written in ``path``'s lock file, or None if it holds none (yet)."""
    for _ in range(20):  # the holder writes its pid just after taking the lock
        try:
            fields = (path / LOCK).read_text().split()
        except OSError:
            return None
        if len(fields) == 2:
            return fields[0], fields[1]
        time.sleep(0.01)
    return None


def held_by_parent(path: Path) -> bool:
    """Whether this process's launcher holds ``path``'s lock (its pid and host are in the file):
    the parent, or the parent's parent where the parent is the fork server that kiln's launcher
    starts its ranks from."""
    holder = held_by(path)
    if holder is None or holder[1] != socket.gethostname():
        return False
    parent = os.getppid()
    if holder[0] == str(parent):
        return True
    try:  # the launcher's fork server (Linux's /proc): "python -c from multiprocessing.forkserver import main"
        server = b"multiprocessing.forkserver" in Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        return False
    return server and holder[0] == str(parent_pid(parent))


def parent_pid(pid: int) -> int | None:
    """Process ``pid``'s parent (Linux's /proc), or None where it cannot be read."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # after "pid (name)"
    except (OSError, IndexError, ValueError):
        return None


class RunDir:
    """One run's directory. Created fresh; never reuses or overwrites an existing one. The
    process that creates or opens it holds its :class:`RunLock` until :meth:`close`."""

    def __init__(self, path: Path):
        self.path = path
        self.checkpoints = path / CHECKPOINTS
        self._metrics_file = None
        self._metrics_writer: csv.DictWriter | None = None
        self._lock: RunLock | None = None
        self.summary: dict[str, Any] = {}

    @classmethod
    def create(cls, output_dir: str | Path, prefix: str) -> "RunDir":
        root = Path(output_dir)
        root.mkdir(parents=True, exist_ok=True)
        prefix = re.sub(r"[^A-Za-z0-9_.-]+", "-", prefix).strip("-") or "run"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for i in range(1000):
            run = cls(root / (f"{prefix}-{stamp}" + (f"-{i}" if i else "")))
            try:
                run.path.mkdir()  # fails if it exists: two runs never share a directory
            except FileExistsError:
                continue
            try:
                # first of all, so that no stop leaves a directory without a status
                run.write_summary(status="running")
                run._lock = RunLock.acquire(run.path)
                run.checkpoints.mkdir()
            except BaseException as exc:
                run.stopped(exc)
                raise
            return run
        raise RuntimeError(f"could not create a new run directory under {root}")

    @classmethod
    def open(cls, path: Path) -> "RunDir":
        """An existing run directory, to continue (``kiln train --resume``), locked; RunDirBusy
        if another process writes it."""
        run = cls(path)
        run.checkpoints.mkdir(parents=True, exist_ok=True)  # KILN_RUN_DIR may name a path not made yet
        run._lock = RunLock.acquire(path)
        try:
            summary = path / SUMMARY
            if summary.exists():
                run.summary = json.loads(summary.read_text())
        except BaseException:
            run.close()
            raise
        return run

    def stopped(self, exc: BaseException) -> None:
        """Record in summary.json that the run stopped on ``exc`` (``interrupted`` for Ctrl-C
        and SIGTERM, else ``failed``), and release the directory."""
        status = "interrupted" if stopped_by(exc) is not None else "failed"
        try:
            self.write_summary(status=status, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
        finally:
            self.close()

    # ------------------------------------------------------------------ metrics

    def truncate_metrics(self, after_step: int) -> None:
        """Drop rows logged after ``after_step`` (a resumed run logs those steps again)."""
        path = self.path / METRICS
        if not path.exists():
            return
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            fields, rows = reader.fieldnames, [r for r in reader if int(r["step"]) <= after_step]
        if fields is None:  # no header (a kill before it reached the disk): an empty log
            path.unlink()
            return

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
        new = not path.exists() or path.stat().st_size == 0
        if not new:  # a resumed run appends under the header it has (written by an older kiln, say)
            with open(path, newline="") as f:
                fields = next(csv.reader(f), None) or fields
        self._metrics_file = open(path, "a", newline="")
        self._metrics_writer = csv.DictWriter(self._metrics_file, fieldnames=fields, extrasaction="ignore")
        if new:
            self._metrics_writer.writeheader()
            self._metrics_file.flush()  # a kill before the first row still leaves a readable log

    def log_metrics(self, row: dict[str, Any]) -> None:
        assert self._metrics_writer is not None, "open_metrics first"
        self._metrics_writer.writerow({k: _fmt(v) for k, v in row.items()})
        self._metrics_file.flush()  # a crash keeps every row logged so far

    def close(self) -> None:
        """Close metrics.csv and release the directory's lock (idempotent)."""
        try:
            if self._metrics_file is not None:
                self._metrics_file.close()
                self._metrics_file = None
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    # ------------------------------------------------------------------ summary

    def write_summary(self, **updates: Any) -> None:
        self.summary.update(updates)
        atomic_write_text(self.path / SUMMARY, json.dumps(self.summary, indent=2, sort_keys=False) + "\n")


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else value


def mark_stopped(path: Path, status: str, error: str, *, over_ended: bool = False) -> None:
    """Mark run directory ``path`` ``status`` in summary.json if it still says ``running``:
    what the launcher of ``--nproc N`` does when its rank 0 could not; ``over_ended``: also if
    rank 0 marked it failed or interrupted itself (never over ``completed``)."""
    file = path / SUMMARY
    try:
        summary = json.loads(file.read_text()) if file.exists() else {}
    except ValueError:
        summary = {}
    if summary.get("status", "running") in (("running", "failed", "interrupted") if over_ended else ("running",)):
        summary.update(status=status, error=error)
        atomic_write_text(file, json.dumps(summary, indent=2, sort_keys=False) + "\n")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt, so that a run a scheduler stops ends as
    one the user stopped: ``interrupted``, with its checkpoints intact (exit status 143)."""


_received: list[int] = []  # the stop signals this process got (kiln train's handlers note them)


def on_stop_signal(signum: int, frame: Any) -> None:
    """The handler ``kiln train`` sets for SIGINT and SIGTERM: notes the signal, then raises
    KeyboardInterrupt (Terminated for SIGTERM) where the run is."""
    _received.append(signum)
    if signum == signal.SIGTERM:
        raise Terminated(f"SIGTERM (signal {signum})")
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Within it, SIGINT raises KeyboardInterrupt and SIGTERM (what schedulers send before they
    kill) raises Terminated, and :func:`stopped_by` knows which came; the handlers before it
    come back after, SIGHUP's and SIGQUIT's too (torchrun's agent, which ``kiln train --nproc``
    runs in this process, points them at its own handler for good: a caller of
    ``kiln.commands.main`` would otherwise get its exception on every later SIGHUP or SIGQUIT).
    Only the main thread can set handlers: elsewhere it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    kept = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGQUIT)}
    previous = {**kept, **{s: signal.signal(s, on_stop_signal) for s in (signal.SIGINT, signal.SIGTERM)}}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _received.clear()


def raise_if_stopped() -> None:
    """Raise again the stop of a signal that arrived while Python ran a finalizer or a callback,
    which drops the exception a handler raises ("Exception ignored in ..."): the run would go on
    as if never stopped (a Ctrl-C right after the run directory was made, 1 run in ~60 here)."""
    if _received:
        on_stop_signal(_received.pop(), None)


def stopped_by(exc: BaseException | None) -> int | None:
    """The signal that stopped the run ``exc`` ended: SIGINT or SIGTERM, for an interrupt in
    ``exc`` or after one arrived (a collective whose peer stopped first fails with an error of
    its own, and a distributed checkpoint save may drop the interrupt it caught); else None."""
    interrupt = interrupt_in(exc)
    if interrupt is not None:
        return signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT
    return _received[-1] if _received else None


def find_cause(exc: BaseException | None, match: Callable[[BaseException], bool]) -> BaseException | None:
    """The first error behind ``exc`` that ``match`` accepts: ``exc`` itself, its causes and
    contexts, and the per-rank errors another error keeps (torch.distributed.checkpoint's
    CheckpointException holds them in ``failures``, as ``(exception, traceback)``)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if match(e):
            return e
        failures = getattr(e, "failures", None)
        for failure in failures.values() if isinstance(failures, dict) else ():
            failure = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(failure, BaseException):
                todo.append(failure)
        todo += [e.__cause__, e.__context__]
    return None


def interrupt_in(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt (or Terminated) behind ``exc`` (see :func:`find_cause`)."""
    return find_cause(exc, lambda e: isinstance(e, KeyboardInterrupt))  # type: ignore[return-value]


def disk_full_in(exc: BaseException | None) -> OSError | None:
    """The full disk (ENOSPC) or exceeded quota (EDQUOT) behind ``exc`` (see :func:`find_cause`)."""
    full = (errno.ENOSPC, errno.EDQUOT)
    return find_cause(exc, lambda e: isinstance(e, OSError) and e.errno in full)  # type: ignore[return-value]


def read_metrics(run_dir: str | Path) -> list[dict[str, str]]:
    with open(Path(run_dir) / METRICS, newline="") as f:
        return list(csv.DictReader(f))
