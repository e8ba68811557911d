"""kiln.train.Checkpoints, the one place that finds a run's checkpoints: the order a run wrote
them in, the newest good one, the one of step N, and pruning, at the boundaries where three
finders used to disagree (a checkpoint missing one rank's file, a damaged final/, a final/ at
the step of a periodic one); and the run directory's lock, which the launcher of --nproc N
holds for its own workers only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.errors import CheckpointError
from kiln.precision import Precision
from kiln.train import Checkpoints
from kiln.train._checkpoint import checkpoint_to_resume, save_checkpoint
from kiln.train.run_dir import RunDirBusy, RunLock


def _run_with(tmp_path: Path, names: list[tuple[str, int]]) -> Path:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for name, step in names:
        save_checkpoint(tmp_path / "checkpoints" / name, model, opt, Precision(), {"step": step, "config": {}})
    return tmp_path


def test_order_latest_good_at_and_prune(tmp_path):
    run = _run_with(tmp_path, [("step-00000001", 1), ("step-00000002", 2), ("step-00000003", 3), ("final", 3),
                               ("best", 2)])
    ckpts = Checkpoints(run)
    # final/ after the periodic checkpoint of its step (it holds the finished run's state); best/ apart
    assert [(c.path.name, c.step) for c in ckpts] == [("step-00000001", 1), ("step-00000002", 2),
                                                      ("step-00000003", 3), ("final", 3)]
    assert ckpts.latest().final and ckpts.latest_good().final and ckpts.at(3).final
    assert ckpts.at(2).path.name == "step-00000002" and ckpts.at(2).read()["step"] == 2
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 5; it has steps 1, 2, 3 \(final\): pick one"):
        ckpts.at(5)

    # a checkpoint that lost one rank's file is not good: the newest good one is the one a resume takes
    (run / "checkpoints" / "final" / "rng-00000.pt").unlink()
    (run / "checkpoints" / "step-00000003" / "rng-00000.pt").unlink()
    assert ckpts.latest().final  # the newest, complete or not
    assert ckpts.latest_good().path.name == "step-00000002"
    with pytest.raises(CheckpointError, match="final is truncated or corrupt.*the last good checkpoint is "
                                              ".*step-00000002; move final out of the way"):
        checkpoint_to_resume(run, cfg=None)  # refused before the config matters

    # a final/ whose step cannot be read is the newest (reading it says why), and blocks no other step
    (run / "checkpoints" / "final" / "kiln_meta.json").write_text("{")
    assert ckpts.latest().final and ckpts.latest().step == float("inf")
    assert ckpts.at(1).read()["step"] == 1

    (run / "checkpoints" / "step-00000004.tmp").mkdir()  # debris of a save that died
    ckpts.prune(keep=1)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best", "final", "step-00000003"]


def test_a_run_without_checkpoints(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    ckpts = Checkpoints(tmp_path)
    assert list(ckpts) == [] and ckpts.latest() is None and ckpts.latest_good() is None
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        checkpoint_to_resume(tmp_path, cfg=None)


# run_dir.py is the standard library only: loaded as a file, the child starts without torch
_ACQUIRE = """
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("run_dir", sys.argv[1])
run_dir = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_dir)
try:
    run_dir.RunLock.acquire(Path(sys.argv[2])).release()
    print("taken")
except run_dir.RunDirBusy as exc:
    print("busy:", exc)
"""
_RUN_DIR_PY = str(Path(__file__).resolve().parents[1] / "kiln" / "train" / "run_dir.py")


def test_a_lock_held_by_a_parent_is_its_childs_and_nobody_elses(tmp_path):
    """kiln's launcher holds the run directory's lock; the workers torchrun's agent starts (in
    the launcher's process) write under it, and no one further away does."""
    lock = RunLock.acquire(tmp_path)
    try:
        with pytest.raises(RunDirBusy, match="is being written by process"):
            RunLock.acquire(tmp_path)  # this process is not its own child
        child = subprocess.run([sys.executable, "-c", _ACQUIRE, _RUN_DIR_PY, str(tmp_path)], capture_output=True,
                               text=True, check=True)
        assert child.stdout.strip() == "taken", child.stderr
        grandchild = subprocess.run(
            [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_ACQUIRE!r}, "
                                   f"{_RUN_DIR_PY!r}, {str(tmp_path)!r}], check=True)"],
            capture_output=True, text=True, check=True)
        assert grandchild.stdout.startswith("busy:") and f"{tmp_path} is being written by process" in grandchild.stdout
    finally:
        lock.release()
