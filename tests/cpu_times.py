"""Each test's CPU time, its processes' included: ``python -m pytest --cpu-times FILE ...`` (any
worker count; tests/conftest.py registers :class:`CpuTimes`) appends ``cpu_s<TAB>wall_s<TAB>nodeid``
lines to ``FILE``, one per test.

The suite is CPU-bound on a 2-core machine (97-99% busy over a run), so what shortens it is less
CPU work, which ``--durations`` does not show: a test that waits on a signalled process takes
wall time but little CPU, and one that starts processes spends CPU its own clock does not see.
A test's figure is this process's CPU, its ended children's (``RUSAGE_CHILDREN``: those it
waited for, and theirs), and the live children's own and reaped time from /proc, such as a fork
server's; processes that outlive their parent are not counted.

    python -m pytest -q -n auto --cpu-times /tmp/cpu.txt && sort -rn /tmp/cpu.txt | head -40
"""

from __future__ import annotations

import os
import resource
import time

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _live_children() -> float:
    from kiln.train.run_dir import parent_pid

    me, total = os.getpid(), 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or parent_pid(int(entry)) != me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # (ended meanwhile: RUSAGE_CHILDREN has it once it is waited for)
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the name, which may hold spaces
        total += sum(int(x) for x in fields[11:15]) / _TICK  # utime, stime, cutime, cstime
    return total


def _cpu() -> float:
    own, ended = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime + _live_children()


class CpuTimes:
    """The plugin: one line a test to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        wall, cpu = time.monotonic(), _cpu()
        yield
        with open(self.path, "a") as f:
            f.write(f"{_cpu() - cpu:.2f}\t{time.monotonic() - wall:.2f}\t{item.nodeid}\n")
