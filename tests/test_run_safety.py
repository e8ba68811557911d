"""Runs that never lose results (issue 17), through the CLI with real signals: a finished run
is not resumed over, one process writes a run directory, and SIGINT, SIGTERM or kill -9 at any
moment (before the first metrics row, before the loop, inside a checkpoint save, under
--nproc 2) leaves an honest summary.json, intact checkpoints, and a run that resumes."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from kiln.commands import main
from kiln.config import load_config
from kiln.errors import ConfigError
from kiln.train import Checkpoints, load_checkpoint, read_metrics, train
from kiln.train.run_dir import RunLock
from launched import KilnProcess, ranks_of

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")
# long enough never to finish while a test works on it; a row every step slows it a little
LONG = ["train.max_steps=100000", "train.eval_every=0", "train.progress=none"]


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _start(out: Path, *args: str, env: dict | None = None) -> KilnProcess:
    """``kiln train ARGS`` writing under ``out``, a process of its own (see KilnProcess)."""
    return KilnProcess(["train", *args, f"train.output_dir={out}"], env={**os.environ, **(env or {})}, cwd=str(ROOT))


def _wait_for(proc: KilnProcess, pattern: str, root: Path, timeout: float = 120) -> Path:
    """The first path under ``root`` matching ``pattern``, once it appears while ``proc`` runs."""
    deadline = time.monotonic() + timeout
    while True:
        found = list(root.glob(pattern))
        if found:
            return found[0]
        assert proc.poll() is None, f"ended early: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"{pattern} never appeared"
        time.sleep(0.005)


def _ended(proc: KilnProcess, timeout: float = 120) -> tuple[int, list[str]]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, [line for line in err.splitlines() if line.strip()]


def _newest_step(run: Path) -> int:
    return max(c.step for c in Checkpoints(run) if not c.final)


def _resume_to(run: Path, steps: int) -> dict:
    assert main(["train", "--resume", str(run), f"train.max_steps={steps}", "train.progress=none"]) == 0
    summary = _summary(run)
    assert summary["status"] == "completed" and summary["steps"] == steps
    logged = [int(r["step"]) for r in read_metrics(run)]
    assert logged == sorted(set(logged)) and logged[-1] == steps  # no step twice, none after the end
    return summary


def test_resuming_a_finished_run_is_refused_before_anything_is_rewritten(tmp_path, capsys):
    assert main(["train", MLP, f"train.output_dir={tmp_path}", "train.max_steps=10", "train.log_every=5",
                 "train.checkpoint_every=5"]) == 0
    (run,) = tmp_path.iterdir()
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert _summary(run)["eval"] and _summary(run)["final_train_loss"] > 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 2
    assert main(["train", "--resume", str(run), "train.max_steps=10"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0] == err[1]
    assert err[0].startswith("kiln: error: ") and "already trained 10 steps" in err[0]
    assert f"kiln train --resume {run} train.max_steps=N with N > 10" in err[0]
    # the library refuses it as well, before it touches the directory
    with pytest.raises(ConfigError, match="already trained 10 steps"):
        train(load_config(run / "config.yaml"), resume=run)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


@pytest.mark.e2e  # kiln train processes, signalled: the full suite's
def test_kill_9_before_the_first_metrics_row_resumes(tmp_path):
    # checkpoint_every < log_every: checkpoints on disk, and not one metrics row yet
    proc = _start(tmp_path, MLP, *LONG, "train.checkpoint_every=2", "train.log_every=100000")
    _wait_for(proc, "*/checkpoints/step-00000002", tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    (run,) = tmp_path.iterdir()
    assert _summary(run)["status"] == "running"
    assert (run / "metrics.csv").read_text().startswith("step,epoch,train_loss")  # the header is on disk
    assert read_metrics(run) == []
    # and a metrics.csv left with no header at all (as kiln 0.1 left it) is an empty log
    (run / "metrics.csv").write_text("")
    summary = _resume_to(run, _newest_step(run) + 2)
    assert summary["resumed"][0]["step"] == summary["steps"] - 2
    assert len(read_metrics(run)) == 1


@pytest.mark.e2e  # kiln train processes, signalled: the full suite's
def test_a_second_writer_is_refused_and_a_killed_writer_does_not_block(tmp_path):
    proc = _start(tmp_path, MLP, *LONG, "train.log_every=1", "train.checkpoint_every=5",
                  "train.keep_checkpoints=1000")
    _wait_for(proc, "*/checkpoints/step-00000005", tmp_path)
    (run,) = tmp_path.iterdir()
    # a resume of the live run, and a new run told to write the same directory
    second = [_start(tmp_path / "other", "--resume", str(run)),
              _start(tmp_path / "other", MLP, env={"KILN_RUN_DIR": str(run)})]
    for other in second:
        code, err = _ended(other)
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith(f"kiln: error: {run} is being written by process {proc.pid} on ")
        assert f"kiln train --resume {run}" in err[0]
    assert proc.poll() is None  # the writer never noticed
    assert _summary(run)["status"] == "running" and "resumed" not in _summary(run)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    RunLock.acquire(run).release()  # the kernel dropped the killed writer's lock: nothing stale blocks


@pytest.mark.e2e  # kiln train processes, signalled: the full suite's
def test_ctrl_c_right_after_the_run_directory_is_made_marks_it_interrupted(tmp_path):
    proc = _start(tmp_path, MLP, *LONG)
    run = _wait_for(proc, "*/summary.json", tmp_path).parent  # the first file in a new run directory
    os.kill(proc.pid, signal.SIGINT)
    code, err = _ended(proc)
    assert code == 130 and err == ["kiln: interrupted"]
    summary = _summary(run)
    assert summary["status"] == "interrupted" and "KeyboardInterrupt" in summary["error"]


def _slow_second_save(marker: str) -> None:
    """In a KilnProcess: DCP's second write of a run touches ``marker`` and then takes a minute,
    time for the test to signal inside a save."""
    import time

    from torch.distributed.checkpoint import filesystem

    real, calls = filesystem._FileSystemWriter.write_data, []

    def write_data(self, plan, planner):
        calls.append(1)
        if len(calls) == 2:  # inside the second save: tell the test, and give it time to signal
            Path(marker).touch()
            time.sleep(60)
        return real(self, plan, planner)

    filesystem._FileSystemWriter.write_data = write_data


@pytest.mark.e2e  # kiln train processes, signalled: the full suite's
def test_ctrl_c_inside_a_checkpoint_save_is_an_interrupt_not_a_failure(tmp_path):
    marker, out = tmp_path / "saving", tmp_path / "runs"
    args = ["train", MLP, *LONG, "train.checkpoint_every=2", "train.log_every=1", f"train.output_dir={out}"]
    proc = KilnProcess(args, cwd=str(ROOT), before=_slow_second_save, before_args=(str(marker),))
    _wait_for(proc, "saving", tmp_path)
    os.kill(proc.pid, signal.SIGINT)  # DCP wraps the KeyboardInterrupt in a CheckpointException
    code, err = _ended(proc)
    assert code == 130 and err == ["kiln: interrupted"], err
    (run,) = out.iterdir()
    summary = _summary(run)
    assert summary["status"] == "interrupted" and summary["failed_at_step"] == 4
    assert "write_data" in summary["traceback"]  # it landed inside DCP's save
    assert [p.name for p in (run / "checkpoints").iterdir() if not p.name.endswith(".tmp")] == ["step-00000002"]
    assert load_checkpoint(run / "checkpoints" / "step-00000002")["step"] == 2
    assert [int(r["step"]) for r in read_metrics(run)] == [1, 2, 3, 4]
    _resume_to(run, 6)


@pytest.mark.e2e  # kiln train processes, signalled: the full suite's
def test_sigterm_stops_a_run_like_ctrl_c(tmp_path):
    proc = _start(tmp_path, MLP, *LONG, "train.log_every=1", "train.checkpoint_every=5")
    _wait_for(proc, "*/checkpoints/step-00000005", tmp_path)
    os.kill(proc.pid, signal.SIGTERM)
    code, err = _ended(proc)
    assert code == 143 and err == ["kiln: terminated (SIGTERM)"]
    (run,) = tmp_path.iterdir()
    summary = _summary(run)
    assert summary["status"] == "interrupted" and "Terminated" in summary["error"]
    newest = Checkpoints(run).latest()  # what a resume continues from
    state = newest.read()
    assert state["step"] == _newest_step(run) and load_checkpoint(newest.path)["step"] == state["step"]
    logged = [int(r["step"]) for r in read_metrics(run)]
    assert logged == list(range(1, len(logged) + 1)) and len(logged) >= state["step"]


# ------------------------------------------------------------------------------ --nproc 2


def _start_two(tmp_path: Path) -> tuple[KilnProcess, Path]:
    proc = _start(tmp_path, MLP, "--nproc", "2", *LONG, "train.log_every=5", "train.checkpoint_every=10",
                  "parallel.timeout_s=60")
    (run,) = [p.parents[1] for p in [_wait_for(proc, "*/checkpoints/step-00000010", tmp_path)]]
    return proc, run


@pytest.mark.distributed
def test_two_processes_ctrl_c_gives_one_line_and_the_launcher_holds_the_lock(tmp_path):
    proc, run = _start_two(tmp_path)
    for extra in ([], ["--nproc", "2"]):  # a resume of the live run, in one process or two
        code, err = _ended(_start(tmp_path / "other", "--resume", str(run), *extra))
        assert code == 2 and len(err) == 1, err
        assert f"is being written by process {proc.pid} on " in err[0]  # the launcher
    os.kill(proc.pid, signal.SIGINT)  # the launcher, as a Ctrl-C in its terminal reaches it first
    code, err = _ended(proc)
    assert code == 130 and "Traceback" not in "\n".join(err)
    assert err[-1] == (f"kiln: interrupted (SIGINT); {run} keeps its checkpoints; continue with "
                       f"kiln train --resume {run} --nproc 2")
    assert not [line for line in err if "death signal" in line], err  # the agent's note, quieted
    assert _summary(run)["status"] == "interrupted"
    _resume_to(run, _newest_step(run) + 2)


@pytest.mark.distributed
def test_two_processes_sigterm_marks_the_run_interrupted(tmp_path):
    proc, run = _start_two(tmp_path)
    os.kill(proc.pid, signal.SIGTERM)
    code, err = _ended(proc)
    assert code == 143 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("kiln: interrupted (SIGTERM); ")
    assert _summary(run)["status"] == "interrupted"
    assert load_checkpoint(Checkpoints(run).latest().path)["step"] >= 10


@pytest.mark.distributed
def test_two_processes_a_killed_rank_0_is_marked_failed_by_the_launcher(tmp_path):
    proc, run = _start_two(tmp_path)
    workers = ranks_of(proc.pid)
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[0], signal.SIGKILL)  # rank 0 cannot write its summary
    code, err = _ended(proc)
    assert code == 1 and "training failed" in err[-1]
    summary = _summary(run)
    # named first, as killed, whether torchrun saw it end or rank 1 fail on the broken connection first
    assert summary["status"] == "failed" and summary["error"].startswith("training failed (rank 0: killed"), summary
    assert err[-1].startswith(f"kiln: error: {summary['error']}. ")
    _resume_to(run, _newest_step(run) + 2)  # its lock went with the launcher



@pytest.mark.distributed
def test_two_processes_a_killed_launcher_stops_its_ranks_and_the_run_resumes(tmp_path):
    """kill -9 of the launcher leaves no agent to stop the ranks, and takes the run directory's
    lock with it: the ranks stop as on SIGTERM within seconds (each watches its fork server's
    parent), the run is left marked ended, not running, and it resumes from its checkpoints. Rank
    0 marks it interrupted where its SIGTERM came first, failed where rank 1 stopped first and
    rank 0's collective broke on the closed connection."""
    proc, run = _start_two(tmp_path)
    ranks = ranks_of(proc.pid)
    assert sorted(ranks) == [0, 1], ranks
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_comm(pid).startswith("kiln rank") for pid in ranks.values()):
        assert time.monotonic() < deadline, "the ranks outlived their launcher by 30 s"
        time.sleep(0.1)
    summary = _summary(run)
    assert summary["status"] in ("interrupted", "failed"), summary
    if summary["status"] == "interrupted":
        assert "SIGTERM" in summary["error"], summary
    _resume_to(run, _newest_step(run) + 2)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text()
    except OSError:  # (gone)
        return ""



# ------------------------------------------------------------------------- which rank failed


def _beat(at: float, step: int, ended: bool = False) -> dict:
    return {"time": at, "step": step, "host": "node7", "pid": 4242, "device": "cpu",
            **({"ended": True} if ended else {})}


def test_the_launcher_names_the_rank_that_stopped_or_died_not_the_rank_that_noticed(tmp_path):
    from types import SimpleNamespace

    from kiln.launch import _failures as said

    (tmp_path / "error.json").write_text("{}")

    def failure(exitcode: int, message: str, at: int = 1000, recorded: bool = True) -> SimpleNamespace:
        """torchrun's ProcessFailure: a recorded error is dated from its error file"""
        return SimpleNamespace(exitcode=exitcode, message=message, timestamp=at,
                               error_file=str(tmp_path / "error.json") if recorded else "<N/A>")

    timeout = failure(1, "RuntimeError: [gloo] Timed out waiting 20000ms for recv operation to complete")
    # rank 1 stopped (SIGSTOP) in step 21; rank 0 beat on while its collective waited 20 s for it
    assert said({0: timeout}, {0: _beat(999.6, 22), 1: _beat(979.2, 21)}, silent_after_s=10) == (
        "rank 1: stopped answering in step 21 (pid 4242 on node7, cpu): no sign of life for 21 s when rank 0 "
        "failed; rank 0: RuntimeError: [gloo] Timed out waiting 20000ms for recv operation to complete", True)
    # rank 1 killed outright (kill -9): rank 0's collective broke on the connection at once
    reset = failure(1, "RuntimeError: Connection reset by peer")
    assert said({0: reset}, {0: _beat(999.8, 41), 1: _beat(999.5, 41)}, 10) == (
        "rank 1: killed in step 41 (pid 4242 on node7, cpu) before rank 0 failed, with no exit of its own (kill -9, "
        "the OOM killer); rank 0: RuntimeError: Connection reset by peer", True)
    # ... not a rank that exited on its own (ended), nor one that beat on after the failure
    alone = ("rank 0: RuntimeError: Connection reset by peer", False)  # (summary.json keeps rank 0's own error)
    assert said({0: reset}, {0: _beat(999.8, 41), 1: _beat(999.5, 41, ended=True)}, 10) == alone
    assert said({0: reset}, {0: _beat(999.8, 41), 1: _beat(1025.0, 41)}, 10) == alone
    # torchrun saw the killed rank end first; it dates that failure after stopping the others
    killed = failure(-9, "Signal 9 (SIGKILL) received by PID 4242", at=1031, recorded=False)
    assert said({0: killed}, {0: _beat(1000.0, 12), 1: _beat(1001.0, 12, ended=True)}, 10) == \
        ("rank 0: killed by signal 9 (SIGKILL) in step 12 (pid 4242 on node7, cpu)", True)
    # of many ranks that timed out, the first two and how many more
    fails = {r: failure(1, f"RuntimeError: timed out {r}", at=1000 + r) for r in (5, 2, 4, 3)}
    beats = {**{r: _beat(1000.0 + r, 9) for r in range(2, 6)}, 1: _beat(900.0, 8), 0: _beat(1001.5, 9, ended=True)}
    assert said(fails, beats, 10) == (
        "rank 1: stopped answering in step 8 (pid 4242 on node7, cpu): no sign of life for 102 s when rank 2 failed; "
        "rank 2: RuntimeError: timed out 2; rank 3: RuntimeError: timed out 3; 2 more ranks failed after them", True)


def test_a_heartbeat_beats_until_its_rank_ends_and_marks_the_end(tmp_path):
    from kiln.train.heartbeat import Heartbeat, read_beats

    heart = Heartbeat()
    heart.start(tmp_path, rank=3, every_s=0.02)
    first = read_beats(tmp_path)[3]  # written before start() returns
    assert first["step"] is None and first["pid"] == os.getpid() and "ended" not in first
    heart.step, heart.device = 17, "cpu"
    deadline = time.monotonic() + 10
    while read_beats(tmp_path)[3]["step"] != 17:  # the thread's next beat
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert read_beats(tmp_path)[3]["time"] > first["time"]
    heart.end()
    last = read_beats(tmp_path)[3]
    assert last["ended"] and last["device"] == "cpu"
    time.sleep(0.1)
    assert read_beats(tmp_path)[3] == last  # nothing after the end
