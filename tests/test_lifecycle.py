"""Run lifecycle: exact resume after a real kill -9, damaged checkpoints, config mismatch,
checkpoint retention, atomic saves, early stopping, TensorBoard."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from launched import only_run

from kiln.commands import main
from kiln.train import load_checkpoint, read_metrics

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")
VIT = str(ROOT / "configs" / "digits_vit.py")


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.e2e
def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, kill_9_at):
    # dropout on, so the torch RNG state matters; 23 batches per epoch, so the kill lands mid-epoch;
    # fp32 in both runs (kill_9_at's, and not auto: bf16-mixed where bf16 is native)
    args = [VIT, "model.depth=1", "model.dropout=0.1", "train.max_steps=300", "train.checkpoint_every=20",
            "train.log_every=10", "train.eval_every=50", "train.keep_checkpoints=2", "train.precision=fp32"]
    whole_dir, killed_dir = tmp_path / "whole", tmp_path / "killed"
    assert main(["train", *args, f"train.output_dir={whole_dir}"]) == 0

    run = kill_9_at(args, killed_dir, "step-00000040")
    assert _summary(run)["status"] == "running"  # killed mid-run: nothing marked it complete

    assert main(["train", "--resume", str(run)]) == 0
    whole = only_run(whole_dir)
    a, b = _summary(whole), _summary(run)
    assert b["status"] == "completed" and b["steps"] == 300
    assert a["final_train_loss"] == b["final_train_loss"]
    assert a["eval"] == b["eval"]
    wa = load_checkpoint(whole / "checkpoints" / "final")
    wb = load_checkpoint(run / "checkpoints" / "final")
    assert all(torch.equal(wa["model"][k], wb["model"][k]) for k in wa["model"])
    for key, state in wa["optimizer"]["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(wb["optimizer"]["state"][key][n]))
                   for n, v in state.items())
    # metrics.csv continues without duplicated or missing steps
    steps = [int(r["step"]) for r in read_metrics(run)]
    assert steps == sorted(set(steps)) and steps == [int(r["step"]) for r in read_metrics(whole)]
    assert len(b["resumed"]) == 1


def _short_run(tmp_path: Path, *extra: str) -> Path:
    assert main(["train", MLP, f"train.output_dir={tmp_path}", "train.max_steps=20",
                 "train.checkpoint_every=5", *extra]) == 0
    return only_run(tmp_path)


def test_truncated_checkpoint_names_the_file_and_the_last_good_one(tmp_path, capsys):
    run = _short_run(tmp_path)
    shutil.rmtree(run / "checkpoints" / "final")  # as if killed before the final save
    (data,) = (run / "checkpoints" / "step-00000015").glob("*.distcp")
    data.write_bytes(data.read_bytes()[:1000])  # a disk that filled up, a copy cut short
    (run / "checkpoints" / "step-00000010" / "rng-00000.pt").unlink()
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "step-00000015" in err and "truncated or corrupt" in err and data.name in err
    assert "the last good checkpoint is" in err and "step-00000005" in err  # step 10 lost a file too
    assert "Traceback" not in err
    assert (run / "checkpoints" / "step-00000010").exists()  # nothing was deleted


def test_resume_refuses_a_config_that_does_not_match_the_checkpoint(tmp_path, capsys):
    run = _short_run(tmp_path)
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("lr: 0.003", "lr: 0.1"))
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "optim.lr" in err and "0.003" in err and "0.1" in err


@pytest.mark.e2e
def test_resume_can_extend_a_finished_run(tmp_path):
    run = _short_run(tmp_path)
    assert main(["train", "--resume", str(run), "train.max_steps=30"]) == 0
    assert _summary(run)["steps"] == 30
    assert [int(r["step"]) for r in read_metrics(run)][-1] == 30


@pytest.mark.e2e
def test_a_run_extended_past_its_end_resumes_from_its_newest_checkpoint_not_the_old_final(tmp_path):
    from kiln.train import Checkpoints

    run = _short_run(tmp_path)  # finished: final/ holds its last step
    final_step = load_checkpoint(run / "checkpoints" / "final")["step"]
    shutil.copytree(run / "checkpoints" / "final", tmp_path / "old_final")
    assert main(["train", "--resume", str(run), f"train.max_steps={final_step + 10}",
                 "train.checkpoint_every=5"]) == 0
    # as if the extended run had died after its first periodic save: final/ is still the old one
    shutil.rmtree(run / "checkpoints" / "final")
    shutil.copytree(tmp_path / "old_final", run / "checkpoints" / "final")
    newest = Checkpoints(run).latest()
    assert newest.path.name == f"step-{final_step + 5:08d}" and newest.read()["step"] == final_step + 5


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    run = _short_run(tmp_path, "train.keep_checkpoints=2", "train.max_steps=30")
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["best", "final", "step-00000020", "step-00000025"]
    assert load_checkpoint(run / "checkpoints" / "step-00000025")["step"] == 25


@pytest.mark.e2e
def test_early_stopping_stops_records_why_and_keeps_the_best(tmp_path):
    # min_delta=10: no evaluation can improve the loss by that much, so patience runs out
    assert main(["train", MLP, f"train.output_dir={tmp_path}", "train.max_steps=100", "train.eval_every=5",
                 "train.early_stopping.patience=2", "train.early_stopping.min_delta=10"]) == 0
    run = only_run(tmp_path)
    summary = _summary(run)
    assert summary["stopped_early"] is True and summary["stopped_at_step"] == 15 and summary["steps"] == 15
    assert "eval_loss" in summary["stop_reason"] and "2 evaluations" in summary["stop_reason"]
    assert summary["best"]["step"] == 5
    assert load_checkpoint(run / "checkpoints" / "best")["step"] == 5
    assert load_checkpoint(run / "checkpoints" / "final")["step"] == 15


@pytest.mark.e2e
def test_early_stopping_on_accuracy_tracks_the_maximum(tmp_path):
    assert main(["train", MLP, f"train.output_dir={tmp_path}", "train.max_steps=60", "train.eval_every=10",
                 "train.early_stopping.metric=eval_accuracy", "train.early_stopping.mode=max",
                 "train.early_stopping.patience=100"]) == 0
    run = only_run(tmp_path)
    accs = [float(r["eval_accuracy"]) for r in read_metrics(run) if r["eval_accuracy"]]
    summary = _summary(run)
    assert summary["stopped_early"] is False
    assert summary["best"]["value"] == pytest.approx(max(accs), abs=1e-6)


def test_early_stopping_without_evaluations_is_a_config_error(tmp_path, capsys):
    assert main(["train", MLP, "train.eval_every=0", "train.early_stopping.patience=2"]) == 2
    assert "train.eval_every" in capsys.readouterr().err


def test_tensorboard_logger_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    assert main(["train", MLP, f"train.output_dir={tmp_path}", "train.max_steps=10", "train.log_every=5",
                 "train.loggers=[csv,tensorboard]"]) == 0
    events = list((only_run(tmp_path) / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_report_compares_runs_in_one_picture_and_table(tmp_path, capsys):
    for seed in (0, 1):
        assert main(["train", MLP, f"train.output_dir={tmp_path / 'runs'}", "train.max_steps=10",
                     f"train.seed={seed}", "train.log_every=5", "train.eval_every=5"]) == 0
    capsys.readouterr()
    runs = sorted(str(p) for p in (tmp_path / "runs").iterdir())
    out = tmp_path / "cmp.png"
    assert main(["report", *runs, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["run", "status", "steps"]
    for run in runs:
        summary = _summary(Path(run))
        line = next(l for l in lines if l.startswith(Path(run).name))
        assert f"{summary['final_train_loss']:.4g}" in line and "completed" in line
    assert out.stat().st_size > 10_000  # a real picture
    assert main(["report", str(tmp_path)]) == 2  # not a run directory


def test_a_save_that_dies_midway_leaves_the_last_good_checkpoint_intact(tmp_path, monkeypatch):
    import kiln.parallel._checkpoint as sharded
    from kiln.precision import Precision
    from kiln.train import Checkpoints
    from kiln.train._checkpoint import save_checkpoint

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    ckpts = tmp_path / "checkpoints"
    good = save_checkpoint(ckpts / "step-00000001", model, opt, Precision(), {"step": 1})
    original = {p.name: p.read_bytes() for p in good.iterdir()}
    saved, real_save = model.weight.detach().clone(), sharded.dcp.save

    def dying_save(*args, **kwargs):
        real_save(*args, **kwargs)  # the tensors are on disk, the JSON that completes them is not
        raise OSError("disk full")

    monkeypatch.setattr(sharded.dcp, "save", dying_save)
    with torch.no_grad():
        model.weight.zero_()
    for name in ("step-00000001", "step-00000002"):  # overwriting the good one, or writing a new one
        with pytest.raises(OSError, match="disk full"):
            save_checkpoint(ckpts / name, model, opt, Precision(), {"step": 2})
    assert {p.name: p.read_bytes() for p in good.iterdir()} == original  # never opened for writing
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000001"]  # no debris
    assert torch.equal(load_checkpoint(good)["model"]["weight"], saved)
    # a kill -9 leaves its .tmp directory behind: never taken for a checkpoint, cleared by prune
    shutil.copytree(good, ckpts / "step-00000002.tmp")
    (ckpts / "step-00000002.tmp" / "kiln_meta.json").unlink()
    assert Checkpoints(tmp_path).latest().path == good
    Checkpoints(tmp_path).prune(keep=5)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000001"]
