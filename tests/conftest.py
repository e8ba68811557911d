"""Fixtures shared by kiln's test modules."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: on tiny tensors on a shared 2-core machine, every op
    with two threads can wait a scheduler tick."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def kill_9_at():
    """``kill_9_at(args, out, checkpoint) -> run directory``: start ``python -m kiln train *args``
    writing under ``out`` and SIGKILL it the moment ``checkpoints/<checkpoint>`` is complete
    (it appears by a rename), as a crashed machine would; the run must not end before that."""

    def run(args: list[str], out: Path, checkpoint: str, timeout: float = 120) -> Path:
        proc = subprocess.Popen([sys.executable, "-m", "kiln", "train", *map(str, args), f"train.output_dir={out}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not list(Path(out).glob(f"*/checkpoints/{checkpoint}")):
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, f"no {checkpoint} within {timeout} s"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        (run_dir,) = Path(out).iterdir()
        assert not (run_dir / "checkpoints" / "final").exists()  # killed mid-run
        return run_dir

    return run
