"""The ranks that ``kiln train --nproc N`` started, found from outside, to kill one of them."""

from __future__ import annotations

from pathlib import Path


def ranks_of(launcher: int) -> dict[int, int]:
    """rank -> pid of the ranks under launcher process ``launcher``: its fork server's children,
    each named "kiln rank N" (/proc/PID/comm)."""
    from kiln.train._run_dir import parent_pid

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
    """``kiln ARGS`` run by this process (kiln.cli.main), as ``subprocess.run(["kiln", *args],
    capture_output=True, text=True)`` would report it: what this process printed (not its ranks,
    whose output goes where this process's file descriptors go). ``kiln train --nproc N`` here is
    the launcher itself, without the ~4 s of CPU a new interpreter spends importing torch and
    kiln; its ranks are forked as ever. For tests of a command's outcome; what a process boundary
    does (signals, kill -9, exit codes of an interpreter) is tested through real processes."""
    import contextlib
    import io
    import subprocess

    from kiln.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["kiln", *args], code, out.getvalue(), err.getvalue())
