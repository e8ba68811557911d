"""Checkpoints written in the background (train.async_checkpoint, issue 41 part 3): the same
directories as a save that stops training, atomic under kill -9, a failed write reported with
the last good checkpoint, and one save in flight at a time."""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from kiln.commands import main
from kiln.config import load_config
from kiln.parallel import AsyncSaver, read_sharded, save_sharded
from kiln.train import load_checkpoint, read_metrics, train
from kiln.train.run_dir import disk_full_in
from launched import KilnProcess

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")
# periodic saves at 4 and 8 (keep 1: step-4 is pruned), best/ at each evaluation, final/ at 12
RUN = ["train.max_steps=12", "train.checkpoint_every=4", "train.eval_every=4", "train.keep_checkpoints=1",
       "train.log_every=4", "train.precision=fp32", "train.progress=none"]


def _only(out: Path) -> Path:
    (run,) = out.iterdir()
    return run


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return read_sharded(path)[0]


def _meta(path: Path) -> dict:
    return json.loads((path / "kiln_meta.json").read_text())


def _untimed(tree: dict) -> dict:
    """``tree`` without its wall-clock figures (``*seconds``), at every depth."""
    return {k: _untimed(v) if isinstance(v, dict) else v for k, v in tree.items() if "seconds" not in k}


def _same_checkpoints(a: Path, b: Path) -> list[str]:
    """Both runs' checkpoint directories, checked equal to the bit: every tensor, every RNG file,
    the trainer's state but the config (which names the mode)."""
    names = sorted(p.name for p in (a / "checkpoints").iterdir())
    assert names == sorted(p.name for p in (b / "checkpoints").iterdir())
    for name in names:
        x, y = _tensors(a / "checkpoints" / name), _tensors(b / "checkpoints" / name)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
        ex, ey = (_untimed(_meta(run / "checkpoints" / name)["extra"]) for run in (a, b))
        assert ex.pop("config")["train"].pop("async_checkpoint") != ey.pop("config")["train"].pop("async_checkpoint")
        assert ex == ey and ex["step"] > 0
        for rng in (a / "checkpoints" / name).glob("rng-*.pt"):
            assert rng.read_bytes() == (b / "checkpoints" / name / rng.name).read_bytes()
    return names


def test_a_background_save_writes_the_state_of_its_step_while_the_next_steps_change_it(tmp_path):
    """The host copy is the state when save() was called: a model changed at once, before the
    write is done, does not reach the files; the directory appears only once it is complete."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    want_m = {names[p]: st["exp_avg"].clone() for p, st in opt.state.items()}
    saver = AsyncSaver()
    saver.save(tmp_path / "a", model, opt, extra={"step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next step, while the write may still run
    for st in opt.state.values():
        st["exp_avg"].zero_()
    assert saver.wait() == tmp_path / "a" and saver.wait() is None
    got = _tensors(tmp_path / "a")
    assert all(torch.equal(got[f"model.{k}"], v) for k, v in want.items())
    assert len(want_m) == 4 and all(torch.equal(got[f"optim.state.{n}.exp_avg"], m) for n, m in want_m.items())
    assert _meta(tmp_path / "a")["extra"] == {"step": 1}
    # the second save reuses the first's host copy, and writes the state of its own call
    saver.save(tmp_path / "b", model, opt, extra={"step": 2})
    saver.wait()
    got = _tensors(tmp_path / "b")
    assert all(torch.equal(got[f"model.{k}"], v) for k, v in model.state_dict().items())
    sync = save_sharded(tmp_path / "c", model, opt, extra={"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]  # no .tmp left
    assert _tensors(sync).keys() == got.keys() and all(torch.equal(_tensors(sync)[k], got[k]) for k in got)


def test_a_failed_background_write_is_raised_at_the_wait_and_leaves_no_directory(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs

    def failing(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fs, "_write_item", failing)
    model = torch.nn.Linear(4, 4)
    saver = AsyncSaver()
    saver.save(tmp_path / "a", model)
    with pytest.raises(BaseException) as raised:  # (DCP's CheckpointException is one)
        saver.wait()
    assert disk_full_in(raised.value).errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # neither a.tmp nor a
    assert saver.wait() is None  # reported once


@pytest.mark.e2e  # two runs of kiln train
def test_async_checkpoints_equal_sync_ones_to_the_bit(tmp_path):
    # The first kiln run of a pytest process ends with another Python `random` state than the
    # runs after it (two sync runs differ so too; seen while writing this test, not found): the
    # runs compared here are not the first
    train(load_config(MLP, ["train.max_steps=1", "train.progress=none", f"train.output_dir={tmp_path / 'warm'}"]))
    runs = {}
    for mode in ("false", "true"):
        out = tmp_path / mode
        train(load_config(MLP, [*RUN, f"train.async_checkpoint={mode}", f"train.output_dir={out}"]))
        runs[mode] = _only(out)
    names = _same_checkpoints(runs["false"], runs["true"])
    # keep_checkpoints=1 pruned step-4 after step-8 was written; best/ tracked the evaluations
    assert names == ["best", "final", "step-00000008"]
    assert _meta(runs["true"] / "checkpoints" / "best")["extra"]["step"] in (4, 8, 12)
    summary = json.loads((runs["true"] / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 12


@pytest.mark.e2e  # kiln train, failed and resumed
def test_a_failed_background_write_ends_the_run_naming_the_last_good_checkpoint(tmp_path, capsys, monkeypatch,
                                                                                 disk_full_at):
    runs = tmp_path / "runs"
    disk_full_at("step-00000008")
    code = main(["train", MLP, "train.max_steps=16", "train.checkpoint_every=4", "train.eval_every=0",
                 "train.progress=none", "train.async_checkpoint=true", f"train.output_dir={runs}"])
    err = capsys.readouterr().err.strip()
    run = _only(runs)
    assert code == 1
    assert err.splitlines() == [
        f"kiln: error: no space left on device while writing {run}/checkpoints/step-00000008; the last good "
        f"checkpoint is {run}/checkpoints/step-00000004: free some space, then continue with "
        f"kiln train --resume {run}"]
    summary = json.loads((run / "summary.json").read_text())
    # seen after the step that wrote it, at the latest when the next save waits for it
    assert summary["status"] == "failed" and 8 <= summary["failed_at_step"] <= 12
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004"]  # no debris

    monkeypatch.undo()
    assert main(["train", "--resume", str(run)]) == 0, capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 16 and summary["resumed"][0]["step"] == 4


def _slow_second_write(marker: str) -> None:
    """In a KilnProcess: DCP's second write of the run (step-4's, in the background thread)
    touches ``marker`` and then takes a minute, time for the test to kill the process inside it."""
    from torch.distributed.checkpoint import filesystem

    real, calls = filesystem._FileSystemWriter.write_data, []

    def write_data(self, plan, planner):
        calls.append(1)
        if len(calls) == 2:
            Path(marker).touch()
            time.sleep(60)
        return real(self, plan, planner)

    filesystem._FileSystemWriter.write_data = write_data


@pytest.mark.e2e  # kiln train processes, one killed
def test_kill_9_during_a_background_write_keeps_the_last_checkpoint_and_the_resume_is_bitwise(tmp_path):
    args = [MLP, "train.max_steps=20", "train.checkpoint_every=2", "train.log_every=1", "train.eval_every=0",
            "train.precision=fp32", "train.progress=none", "train.keep_checkpoints=1000"]
    marker, out = tmp_path / "writing", tmp_path / "killed"
    proc = KilnProcess(["train", *args, "train.async_checkpoint=true", f"train.output_dir={out}"], cwd=str(ROOT),
                       before=_slow_second_write, before_args=(str(marker),))
    deadline = time.monotonic() + 120
    # the write of step-4 hangs in the background; the steps after it run on until step 6's save waits
    while not (marker.exists() and out.exists() and any(int(r["step"]) >= 6 for r in read_metrics(_only(out)))):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "steps 5 and 6 never ran during the background write"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    run = _only(out)
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002", "step-00000004.tmp"]
    assert not (ckpts / "step-00000004.tmp" / "kiln_meta.json").exists()
    assert load_checkpoint(ckpts / "step-00000002")["step"] == 2

    assert main(["train", "--resume", str(run)]) == 0
    whole = tmp_path / "whole"
    assert main(["train", *args, f"train.output_dir={whole}"]) == 0  # uninterrupted, saves that stop training
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed"][0]["step"] == 2
    a, b = _tensors(_only(whole) / "checkpoints" / "final"), _tensors(ckpts / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list(ckpts.glob("*.tmp"))  # the debris cleared by the resumed run's pruning


@pytest.mark.distributed
def test_two_processes_async_checkpoints_equal_sync_ones_to_the_bit(tmp_path):
    """--nproc 2 on gloo, data parallel with ZeRO-2 (each rank writes its shard's pieces of the
    optimizer state, staged beside the state dict)."""
    runs = {}
    for mode in ("false", "true"):
        out = tmp_path / mode
        assert main(["train", MLP, "--nproc", "2", *RUN, "parallel.zero=2", f"train.async_checkpoint={mode}",
                     f"train.output_dir={out}"]) == 0
        runs[mode] = _only(out)
    assert _same_checkpoints(runs["false"], runs["true"]) == ["best", "final", "step-00000008"]
    assert json.loads((runs["true"] / "summary.json").read_text())["processes"] == 2
