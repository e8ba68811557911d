"""The suite's own tools: ``--cpu-times`` (tests/cpu_times.py) counts the CPU of what a test
starts, not only its own."""

from __future__ import annotations

import subprocess
import sys
import time
import types

import pytest

from cpu_times import CpuTimes, _live_children

_BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"


def test_a_tests_cpu_includes_the_processes_it_started_and_lands_in_the_file(tmp_path):
    out = tmp_path / "cpu.txt"
    hook = CpuTimes(str(out)).pytest_runtest_protocol(item=types.SimpleNamespace(nodeid="tests/x.py::y"),
                                                      nextitem=None)
    next(hook)  # the test runs here: a child burns 0.3 s of CPU while this process waits
    subprocess.run([sys.executable, "-c", _BURN], check=True)
    with pytest.raises(StopIteration):
        next(hook)
    cpu, wall, name = out.read_text().rstrip("\n").split("\t")
    assert name == "tests/x.py::y" and float(cpu) >= 0.3 and float(wall) >= 0.3


def test_a_live_child_counts_too():
    """A child not yet waited for (a fork server) counts from /proc while it lives."""
    child = subprocess.Popen([sys.executable, "-c", _BURN + "\nimport sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while _live_children() < 0.3:
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.05)
        assert child.poll() is None  # counted while it lived
    finally:
        child.communicate(b"")
