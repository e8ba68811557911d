"""Multi-process training through the CLI (torchrun, gloo): same model as one process, a dead
rank ends the run with a clear error, the elastic agent's restart resumes it, and a sharded
checkpoint resumes under another number of processes and ZeRO stage."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kiln.train import load_checkpoint, read_metrics
from launched import KilnProcess, kiln_here, max_rel, only_run, ranks_of

pytestmark = pytest.mark.distributed  # processes on gloo: the full suite runs them, the fast tier does not

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")


def _kiln(*args: str) -> subprocess.CompletedProcess:
    return kiln_here(*args)  # in this process: a kiln train --nproc N launcher without its own interpreter


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """The one-process reference run of each set of arguments, trained once (in this process)
    for every two-process layout compared with it."""
    from kiln.commands import main

    runs: dict[tuple[str, ...], Path] = {}

    def run(*args: str) -> Path:
        if args not in runs:
            out = tmp_path_factory.mktemp("one")
            assert main(["train", MLP, *args, f"train.output_dir={out}"]) == 0
            runs[args] = only_run(out)
        return runs[args]

    return run


LAYOUTS = [("fp32", 1, 0, "adamw"), ("fp64", 2, 0, "adamw"), ("fp64", 2, 1, "adamw"), ("fp64", 1, 2, "lamb"),
           ("fp32", 2, 2, "adamw"), ("fp64", 2, 3, "adamw"), ("fp64", 1, 3, "lamb")]


def _common(precision: str, accumulate: int, optim: str) -> tuple[str, ...]:
    # random Gaussian images: no always-zero pixel whose tiny gradient Adam would blow up
    return ("train.max_steps=5", "optim.lr=1e-3", f"train.accumulate={accumulate}", "train.log_every=5",
            f"train.precision={precision}", "data.name=synthetic_images", f"optim.name={optim}",
            "train.clip_grad_norm=1.0")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """Every layout's two-process run, each a whole kiln.train run in one pair of gloo processes
    started once (tests/group_runs.py): 24 s of CPU for the seven, where seven launches of kiln
    train --nproc 2 took 140 s (20 s each, most of it three processes importing torch and the
    trainer). The launcher's own part is tested below and in test_run_safety."""
    from group_runs import train_in_one_group

    out = tmp_path_factory.mktemp("two")
    runs = [(MLP, [*_common(p, a, o), f"parallel.zero={z}", f"train.output_dir={out / str(i)}"])
            for i, (p, a, z, o) in enumerate(LAYOUTS)]
    return dict(zip(LAYOUTS, train_in_one_group(2, runs)))


@pytest.mark.parametrize("precision, accumulate, zero, optim", LAYOUTS)
def test_two_processes_train_the_same_model_as_one(two_process_runs, one_process_runs, precision, accumulate, zero,
                                                   optim):
    common = _common(precision, accumulate, optim)
    a, b = one_process_runs(*common), two_process_runs[precision, accumulate, zero, optim]
    ca, cb = load_checkpoint(a / "checkpoints" / "final"), load_checkpoint(b / "checkpoints" / "final")
    # The averaged gradients agree to fp32 rounding (Adam's first moment is their running mean) ...
    # (read whole, keyed as in one process, whichever ranks wrote which shards)
    moments = {k: ca["optimizer"]["state"][k]["exp_avg"] for k in ca["optimizer"]["state"]}
    assert max_rel(moments, {k: cb["optimizer"]["state"][k]["exp_avg"] for k in moments}) < 1e-6
    # ... and the weights too: to 1e-12 in fp64; in fp32 Adam's m / sqrt(v) magnifies the last
    # bit of near-zero gradients, so weights agree to a few 1e-6 of their largest value.
    assert max_rel(ca["model"], cb["model"]) < (1e-12 if precision == "fp64" else 1e-5)
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


def _start_and_kill_a_rank(tmp_path: Path, *extra: str, rank: int = 1,
                           sig: signal.Signals = signal.SIGKILL) -> tuple[KilnProcess, Path, dict[int, int]]:
    """``kiln train --nproc 2`` with signal ``sig`` sent to rank ``rank`` once step 40's checkpoint
    is written; returns the launcher, the run directory and the ranks' pids."""
    proc = KilnProcess(["train", MLP, "--nproc", "2", "train.max_steps=3000", "train.checkpoint_every=20",
                        "train.log_every=20", "train.eval_every=0", "parallel.timeout_s=60",
                        f"train.output_dir={tmp_path}", *extra])  # the later of two overrides wins
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("*/checkpoints/step-00000040")):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    workers = ranks_of(proc.pid)
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[rank], sig)
    return proc, only_run(tmp_path), workers


def _error_line(err: str) -> str:
    (line,) = [line for line in err.splitlines() if line.startswith("kiln: error: ")]
    return line


def test_a_killed_rank_ends_the_run_with_a_clear_error_not_a_hang(tmp_path):
    proc, run, _ = _start_and_kill_a_rank(tmp_path)
    start = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert time.monotonic() - start < 60  # bounded: torchrun's agent stops the survivors
    assert proc.returncode == 1
    assert "training failed" in err and f"kiln train --resume {run}" in err
    # the rank that died is named first, whichever rank torchrun saw end first (rank 0, whose
    # collective broke on the dead connection, as often as not)
    assert _error_line(err).startswith("kiln: error: training failed (rank 1: killed"), err[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("training failed (rank 1: killed")
    assert list((run / "checkpoints").glob("step-*"))  # nothing lost


def test_a_stopped_rank_is_named_not_the_rank_that_timed_out_waiting_for_it(tmp_path):
    # rank 1 stops (SIGSTOP: it holds its connections, and answers nothing); rank 0's next
    # collective times out after parallel.timeout_s and rank 0 fails, naming only what it saw
    proc, run, workers = _start_and_kill_a_rank(tmp_path, "parallel.timeout_s=6", sig=signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while _alive(workers[0]):  # rank 0 fails, then torchrun's agent waits 30 s for the stopped rank's
        assert time.monotonic() < deadline  # SIGTERM, in vain: kill -9 it once the agent has seen rank 0 end
        time.sleep(0.1)
    time.sleep(1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(workers[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    line = _error_line(err)
    assert line.startswith("kiln: error: training failed (rank 1: stopped answering in step "), err[-2000:]
    silent = int(re.search(r"no sign of life for (\d+) s when rank 0 failed; rank 0: RuntimeError: ", line)[1])
    assert 5 <= silent <= 12  # parallel.timeout_s=6, and whole seconds
    assert re.search(r"rank 1: stopped answering in step \d+ \(pid %d on .+, cpu\)" % workers[1], line)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and line.startswith(f"kiln: error: {summary['error']}. {run} keeps")
    assert list((run / "checkpoints").glob("step-*"))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (or is stopped), not a zombie or gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_the_elastic_agent_restarts_the_group_and_training_resumes(tmp_path):
    proc, run, _ = _start_and_kill_a_rank(tmp_path, "--max-restarts", "1", "train.max_steps=400")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 400
    assert summary["resumed"] and summary["resumed"][0]["step"] >= 40
    steps = [int(r["step"]) for r in read_metrics(run)]
    assert steps == sorted(set(steps)) and steps[-1] == 400


def test_a_sharded_checkpoint_resumes_under_other_layouts_with_the_same_weights(tmp_path):
    # Saved by 2 processes under ZeRO-2 (each rank writes its shard of the optimizer state).
    # Resumed from step 5 under another layout for two steps (a resume must have steps left:
    # kiln refuses one that would only rewrite a finished run), saved there, and resumed from
    # that under yet another layout, the run must continue as the uninterrupted one did.
    common = ["train.max_steps=10", "train.checkpoint_every=5", "train.log_every=5", "train.eval_every=0",
              "optim.lr=1e-3", "optim.schedule=constant", "data.name=synthetic_images", "train.clip_grad_norm=1.0",
              "train.precision=fp32"]  # not auto: bf16-mixed where bf16 is native, and compared to 1e-5
    whole = _kiln("train", MLP, "--nproc", "2", "parallel.zero=2", *common, f"train.output_dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-2000:]
    run = only_run(tmp_path / "whole")
    for case, (first, then) in enumerate([
        (("parallel.zero=0",), ("--nproc", "2", "parallel.zero=1")),  # 2 processes -> 1 -> 2 (ZeRO-1)
        (("--nproc", "4", "parallel.zero=3"), ("parallel.zero=0",)),  # 2 -> 4 (ZeRO-3: FSDP2) -> 1
    ]):
        copy = tmp_path / f"resume-{case}"
        shutil.copytree(run, copy)
        shutil.rmtree(copy / "checkpoints" / "final")  # as if killed after step 5
        loaded = _kiln("train", "--resume", str(copy), *first, "train.max_steps=7")
        assert loaded.returncode == 0, loaded.stderr[-2000:]
        assert json.loads((copy / "summary.json").read_text())["steps"] == 7
        shutil.rmtree(copy / "checkpoints" / "step-00000005")  # resume from the final of step 7
        again = _kiln("train", "--resume", str(copy), *then, "train.max_steps=10")
        assert again.returncode == 0, again.stderr[-2000:]
        summary = json.loads((copy / "summary.json").read_text())
        assert summary["steps"] == 10 and summary["processes"] == (2 if "--nproc" in then else 1)
        assert summary["resumed"][-1]["from"].endswith("final")
        # (train losses are logged per window, which the extra stop at step 7 cuts differently)
        a, b = load_checkpoint(run / "checkpoints" / "final"), load_checkpoint(copy / "checkpoints" / "final")
        assert max_rel(a["model"], b["model"]) < 1e-5
        moments = {k: st["exp_avg"] for k, st in a["optimizer"]["state"].items()}
        assert max_rel(moments, {k: b["optimizer"]["state"][k]["exp_avg"] for k in moments}) < 1e-5
