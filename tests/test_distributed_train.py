"""Multi-process training through the CLI (torchrun, gloo): same model as one process, a dead
rank ends the run with a clear error, and the elastic agent's restart resumes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.train import load_checkpoint, read_metrics

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")


def _kiln(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=timeout)


def _only_run(folder: Path) -> Path:
    (run,) = folder.iterdir()
    return run


def _max_rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a)


@pytest.mark.parametrize("precision, accumulate, zero, optim", [
    ("fp32", 1, 0, "adamw"), ("fp64", 2, 0, "adamw"), ("fp64", 2, 1, "adamw"), ("fp64", 1, 2, "lamb"),
    ("fp32", 2, 2, "adamw"), ("fp64", 2, 3, "adamw"), ("fp64", 1, 3, "lamb"),
])
def test_two_processes_train_the_same_model_as_one(tmp_path, precision, accumulate, zero, optim):
    # random Gaussian images: no always-zero pixel whose tiny gradient Adam would blow up
    common = ["train.max_steps=5", "optim.lr=1e-3", f"train.accumulate={accumulate}", "train.log_every=5",
              f"train.precision={precision}", "data.name=synthetic_images", f"optim.name={optim}",
              "train.clip_grad_norm=1.0"]
    one = _kiln("train", MLP, *common, f"train.output_dir={tmp_path / 'one'}")
    two = _kiln("train", MLP, "--nproc", "2", *common, f"parallel.zero={zero}", f"train.output_dir={tmp_path / 'two'}")
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = _only_run(tmp_path / "one"), _only_run(tmp_path / "two")
    ca, cb = load_checkpoint(a / "checkpoints" / "final.pt"), load_checkpoint(b / "checkpoints" / "final.pt")
    # The averaged gradients agree to fp32 rounding (Adam's first moment is their running mean) ...
    # (ZeRO checkpoints hold the full state, gathered from the shards, keyed as in one process)
    moments = {k: ca["optimizer"]["state"][k]["exp_avg"] for k in ca["optimizer"]["state"]}
    assert _max_rel(moments, {k: cb["optimizer"]["state"][k]["exp_avg"] for k in moments}) < 1e-6
    # ... and the weights too: to 1e-12 in fp64; in fp32 Adam's m / sqrt(v) magnifies the last
    # bit of near-zero gradients, so weights agree to a few 1e-6 of their largest value.
    assert _max_rel(ca["model"], cb["model"]) < (1e-12 if precision == "fp64" else 1e-5)
    sa = json.loads((a / "summary.json").read_text())
    sb = json.loads((b / "summary.json").read_text())
    assert sb["processes"] == 2 and sa["processes"] == 1
    assert sb["final_train_loss"] == pytest.approx(sa["final_train_loss"], rel=1e-6)
    # rank 0 alone wrote: one metrics header, one row per logged step
    assert [r["step"] for r in read_metrics(b)] == ["5"]


def test_batch_not_divisible_by_the_processes_is_refused_before_training(tmp_path):
    out = _kiln("train", MLP, "--nproc", "2", "data.batch_size=63", "train.accumulate=1",
                f"train.output_dir={tmp_path}")
    assert out.returncode != 0
    assert "data.batch_size=63" in out.stderr and "parallel.dp=2" in out.stderr


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _start_and_kill_a_rank(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "train", MLP, "--nproc", "2", "train.max_steps=3000",
         "train.checkpoint_every=20", "train.log_every=20", "train.eval_every=0", "parallel.timeout_s=60",
         f"train.output_dir={tmp_path}", *extra],  # the later of two overrides wins
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("*/checkpoints/step-00000040.pt")):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    return proc, _only_run(tmp_path)


def test_a_killed_rank_ends_the_run_with_a_clear_error_not_a_hang(tmp_path):
    proc, run = _start_and_kill_a_rank(tmp_path)
    start = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert time.monotonic() - start < 60  # bounded: torchrun's agent stops the survivors
    assert proc.returncode == 1
    assert "training failed" in err and f"kiln train --resume {run}" in err
    assert json.loads((run / "summary.json").read_text())["status"] != "completed"
    assert list((run / "checkpoints").glob("step-*.pt"))  # nothing lost


def test_the_elastic_agent_restarts_the_group_and_training_resumes(tmp_path):
    proc, run = _start_and_kill_a_rank(tmp_path, "--max-restarts", "1", "train.max_steps=400")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 400
    assert summary["resumed"] and summary["resumed"][0]["step"] >= 40
    steps = [int(r["step"]) for r in read_metrics(run)]
    assert steps == sorted(set(steps)) and steps[-1] == 400


@pytest.mark.parametrize("first, then", [(("--nproc", "2", "parallel.zero=2"), ("parallel.zero=0",)),
                                         ((), ("--nproc", "2", "parallel.zero=1")),
                                         (("--nproc", "2", "parallel.zero=3"), ("parallel.zero=0",)),
                                         ((), ("--nproc", "2", "parallel.zero=3"))])
def test_a_checkpoint_resumes_under_another_layout(tmp_path, first, then):
    common = ["train.max_steps=10", "train.checkpoint_every=5", "train.keep_checkpoints=5", "optim.lr=1e-3",
              "data.name=synthetic_images", "train.precision=fp64", "train.log_every=5"]
    whole = _kiln("train", MLP, *first, *common, f"train.output_dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-2000:]
    run = _only_run(tmp_path / "whole")
    expected = load_checkpoint(run / "checkpoints" / "final.pt")
    for name in ("final.pt", "step-00000010.pt", "best.pt"):
        (run / "checkpoints" / name).unlink(missing_ok=True)
    again = _kiln("train", "--resume", str(run), *then)
    assert again.returncode == 0, again.stderr[-2000:]
    got = load_checkpoint(run / "checkpoints" / "final.pt")
    assert _max_rel(expected["model"], got["model"]) < 1e-12
    state = expected["optimizer"]["state"]
    assert _max_rel({k: v["exp_avg_sq"] for k, v in state.items()},
                    {k: v["exp_avg_sq"] for k, v in got["optimizer"]["state"].items()}) < 1e-12
