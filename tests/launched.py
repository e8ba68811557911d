"""kiln run from a test, and what it made found from outside: the ranks that ``kiln train
--nproc N`` started (to kill one of them), the run directory a training made, and how far two
runs' tensors are apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


def ranks_of(launcher: int) -> dict[int, int]:
    """rank -> pid of the ranks under launcher process ``launcher``: its fork server's children,
    each named "kiln rank N" (/proc/PID/comm)."""
    from kiln.train.run_dir import parent_pid

    children: dict[int | None, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        children.setdefault(parent_pid(int(proc.name)), []).append(int(proc.name))
    ranks, todo = {}, list(children.get(launcher, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("kiln rank ") and name[len("kiln rank "):].isdigit():
            ranks[int(name[len("kiln rank "):])] = pid
    return ranks


def kiln_here(*args: str) -> "subprocess.CompletedProcess[str]":
    """``kiln ARGS`` run by this process (kiln.commands.main), as ``subprocess.run(["kiln", *args],
    capture_output=True, text=True)`` would report it: what this process printed (not its ranks,
    whose output goes where this process's file descriptors go). ``kiln train --nproc N`` here is
    the launcher itself, without the ~4 s of CPU a new interpreter spends importing torch and
    kiln; its ranks are forked as ever. For tests of a command's outcome; what a process boundary
    does (signals, kill -9, exit codes of an interpreter) is tested through real processes."""
    import contextlib
    import io
    import subprocess

    from kiln.commands import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["kiln", *args], code, out.getvalue(), err.getvalue())


class KilnProcess:
    """``python -m kiln ARGS`` as a process of its own, the way ``subprocess.Popen`` reports one
    (``pid``, ``poll()``, ``wait()``, ``communicate()`` giving ``(None, stderr)``, ``returncode``,
    negative for a signal; stdout goes to /dev/null), for tests of what crosses a process
    boundary: signals, kill -9, exit statuses, the run directory's lock between processes.

    It is forked from this test process's fork server (multiprocessing's, which kiln's launcher
    and ``run_distributed`` use too), which imported torch and kiln once: a new interpreter
    spends ~5 s of CPU importing them before ``kiln train`` starts. The child gets ``env`` (this
    process's environment by default) and ``cwd``, and the signal handlers a new interpreter
    has. ``before(*before_args)``, a module-level function, runs in the child first (to patch
    what the test needs slow). Tests of what a *fresh* interpreter does (imports, the first bf16
    question) start ``python`` itself."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                 before: Callable[..., Any] | None = None, before_args: tuple = ()) -> None:
        import multiprocessing
        import os
        import tempfile

        fd, self._stderr = tempfile.mkstemp(prefix="kiln-stderr-")
        os.close(fd)
        self.args = ["kiln", *args]
        self._process = multiprocessing.get_context("forkserver").Process(
            target=_kiln_main, args=(list(args), dict(os.environ if env is None else env),
                                     str(cwd or os.getcwd()), self._stderr, before, before_args))
        self._process.start()
        self.pid: int = self._process.pid
        self.returncode: int | None = None
        self._err: str | None = None  # what it wrote to stderr, once it ended

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, once the process ended (its stderr file read and removed then)."""
        import os
        import subprocess

        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        if self._err is None:
            self._err = Path(self._stderr).read_text()
            os.unlink(self._stderr)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        self.wait(timeout)
        return None, self._err


def _kiln_main(args: list[str], environ: dict[str, str], cwd: str, stderr: str, before: Callable[..., Any] | None,
               before_args: tuple) -> None:
    """A :class:`KilnProcess`: ``kiln ARGS`` with ``environ`` in ``cwd``, stderr to the file
    ``stderr``, after ``before(*before_args)``, exiting with kiln's exit status."""
    import os
    import sys

    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    err = os.open(stderr, os.O_WRONLY | os.O_TRUNC)
    out = os.open(os.devnull, os.O_WRONLY)
    os.dup2(err, 2)
    os.dup2(out, 1)
    os.close(err)
    os.close(out)
    sys.argv = [sys.executable, "-m", "kiln", *args]
    if before is not None:
        before(*before_args)
    from kiln.commands import main

    sys.exit(main(args))


def only_run(folder: Path) -> Path:
    """The one run directory that a training made under ``folder`` (its ``train.output_dir``)."""
    (run,) = folder.iterdir()
    return run


def max_rel(a: dict, b: dict) -> float:
    """The largest difference between same-named tensors of ``a`` and ``b``, each relative to the
    largest magnitude of ``a``'s tensor."""
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a)
