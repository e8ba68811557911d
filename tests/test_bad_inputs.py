"""Bad inputs to ``kiln train`` and ``kiln bench`` (issue 17): each is one ``kiln: error:`` line
that names the key and the fix, exit status 2, and no run directory, found before anything is
built; a full disk while saving is one line naming what could not be written and the
checkpoint to resume from, exit status 1, with the run marked failed."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")
VIT = str(ROOT / "configs" / "digits_vit.py")


def _refused(capsys, argv: list[str]) -> str:
    """Run ``kiln ARGV`` in process; return its one stderr line after checking exit status 2."""
    from kiln.commands import main

    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("kiln: error: "), err
    return err


# (override, what the line must name, the fix it must give)
REFUSED = [
    ("train.threads=-1", "train.threads=-1", "positive, or null"),
    ("train.threads=0", "train.threads=0", "positive, or null"),
    ("data.workers=-1", "data.workers=-1", "'auto'"),
    ("optim.betas=[0.9,1.5]", "optim.betas[1]=1.5", "[0, 1)"),
    ("optim.lr=nan", "optim.lr=nan", "set optim.lr to a finite value"),
    ("optim.lr=inf", "optim.lr=inf", "set optim.lr to a finite value"),
    ("optim.weight_decay=nan", "optim.weight_decay=nan", "finite value"),
    ("optim.eps=inf", "optim.eps=inf", "finite value"),
    ("optim.betas=[0.9,nan]", "optim.betas[1]=nan", "finite value"),
    ("optim.min_lr_ratio=nan", "optim.min_lr_ratio=nan", "finite value"),
    ("train.clip_grad_norm=inf", "train.clip_grad_norm=inf", "finite value"),
    ("parallel.timeout_s=inf", "parallel.timeout_s=inf", "finite value"),
    ("optim.warmup_steps=-1", "optim.warmup_steps=-1", "0 (no warm-up) or positive"),
    ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio=1.5", "[0, 1]"),
    ("optim.min_lr_ratio=-0.1", "optim.min_lr_ratio=-0.1", "[0, 1]"),
    ("optim.eps=0", "optim.eps=0.0", "must be positive"),
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1", "0 or positive"),
]


@pytest.mark.parametrize("override,key,fix", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_bad_value_is_one_line_before_anything_is_built(tmp_path, capsys, override, key, fix):
    runs = tmp_path / "runs"
    err = _refused(capsys, ["train", VIT, "train.max_steps=20", f"train.output_dir={runs}", override])
    assert key in err and fix in err
    assert not runs.exists()


@pytest.mark.parametrize("momentum", ["1.0", "-0.5", "nan"])
def test_sgd_momentum_outside_0_1_is_refused(tmp_path, capsys, momentum):
    runs = tmp_path / "runs"
    err = _refused(capsys, ["train", VIT, "train.max_steps=20", f"train.output_dir={runs}", "optim.name=sgd",
                            f"optim.momentum={momentum}"])
    assert "optim.momentum=" in err and ("[0, 1)" in err or "finite value" in err)
    assert not runs.exists()


@pytest.mark.parametrize("under", [False, True], ids=["the-file", "under-the-file"])
def test_an_output_dir_that_is_a_file_is_refused(tmp_path, capsys, under):
    file = tmp_path / "results.txt"
    file.write_text("not a directory\n")
    output_dir = file / "sub" if under else file
    err = _refused(capsys, ["train", VIT, "train.max_steps=20", f"train.output_dir={output_dir}"])
    assert f"train.output_dir={output_dir}" in err and "not a directory" in err
    assert "set train.output_dir to a directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"] and file.read_text() == "not a directory\n"


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_negative_max_restarts_is_refused_before_the_run_directory(tmp_path, capsys, nproc):
    runs = tmp_path / "runs"
    err = _refused(capsys, ["train", VIT, "--nproc", nproc, "--max-restarts", "-1", "train.max_steps=20",
                            f"train.output_dir={runs}"])
    assert "--max-restarts -1" in err and "0 (no restarts) or positive" in err
    assert not runs.exists()


def test_unknown_benchmark_leaves_no_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = _refused(capsys, ["bench", "nosuch"])
    assert "unknown benchmark 'nosuch'" in err and "optimizer" in err  # the names to choose from
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------- non-ASCII overrides


def test_non_ascii_overrides_parse_like_ascii_ones():
    from kiln.config import load_config

    from kiln.config import parse_overrides

    cfg = load_config(MLP, ["train.output_dir=/tmp/out_é", "train.run_name='démo über'", "train.max_steps=7"])
    assert cfg.train.output_dir == "/tmp/out_é" and cfg.train.run_name == "démo über"
    assert cfg.train.max_steps == 7  # the other overrides are still typed
    assert parse_overrides(["data.args={städte: [Zürich, 3], n: 2}"]) == [
        ("data.args", {"städte": ["Zürich", 3], "n": 2})]


def test_a_non_ascii_output_dir_trains(tmp_path, capsys):
    from kiln.commands import main

    out = tmp_path / "out_é"
    code = main(["train", MLP, "train.max_steps=2", "train.eval_every=0", "train.progress=none",
                 f"train.output_dir={out}"])
    assert code == 0, capsys.readouterr().err
    (run,) = out.iterdir()
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


# ------------------------------------------------------------------------------- KILN_RUN_DIR


def test_kiln_run_dir_whose_parents_do_not_exist_is_created(tmp_path, capsys, monkeypatch):
    from kiln.commands import main

    run = tmp_path / "new" / "dir" / "deeper"
    monkeypatch.setenv("KILN_RUN_DIR", str(run))
    code = main(["train", MLP, "train.max_steps=2", "train.progress=none"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert (run / "checkpoints" / "final").is_dir()


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["torchrun", "kiln --nproc 2"])
def test_kiln_run_dir_whose_parents_do_not_exist_under_torchrun(tmp_path, monkeypatch, launcher):
    """The documented multi-process form (torchrun starts the workers, KILN_RUN_DIR names the
    run), and kiln's own launcher (here through kiln.commands.main in this process), which writes
    where KILN_RUN_DIR says too."""
    from kiln.commands import main

    run = tmp_path / "new" / "dir" / "deeper"
    args = ["train.max_steps=4", "train.progress=none", f"train.output_dir={tmp_path / 'elsewhere'}"]
    if launcher == "torchrun":
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "-m", "kiln", "train", MLP, *args], env={**os.environ, "KILN_RUN_DIR": str(run)},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        monkeypatch.setenv("KILN_RUN_DIR", str(run))
        assert main(["train", MLP, "--nproc", "2", *args]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4 and summary["processes"] == 2
    assert not (tmp_path / "elsewhere").exists()  # not under train.output_dir


# ---------------------------------------------------------------------------------- disk full


def test_disk_full_names_the_path_and_the_last_good_checkpoint_and_the_resume_works(tmp_path, capsys,
                                                                                     monkeypatch, disk_full_at):
    from kiln.commands import main

    runs = tmp_path / "runs"
    disk_full_at("step-00000008", errno.ENOSPC)
    code = main(["train", MLP, "train.max_steps=12", "train.checkpoint_every=4", "train.eval_every=0",
                 "train.progress=none", f"train.output_dir={runs}"])
    err = capsys.readouterr().err.strip()
    (run,) = runs.iterdir()
    assert code == 1
    assert err.splitlines() == [
        f"kiln: error: no space left on device while writing {run}/checkpoints/step-00000008; the last good "
        f"checkpoint is {run}/checkpoints/step-00000004: free some space, then continue with "
        f"kiln train --resume {run}"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failed_at_step"] == 8
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004"]  # no debris

    monkeypatch.undo()  # space freed: the advice given works
    assert main(["train", "--resume", str(run)]) == 0, capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 12
    assert summary["resumed"][0]["step"] == 4


def test_quota_exceeded_at_the_first_save_says_to_start_again(tmp_path, capsys, disk_full_at):
    from kiln.commands import main

    runs = tmp_path / "runs"
    disk_full_at("step-00000004", errno.EDQUOT)
    code = main(["train", MLP, "train.max_steps=12", "train.checkpoint_every=4", "train.eval_every=0",
                 "train.progress=none", f"train.output_dir={runs}"])
    err = capsys.readouterr().err.strip()
    (run,) = runs.iterdir()
    assert code == 1 and len(err.splitlines()) == 1, err
    assert f"disk quota exceeded while writing {run}/checkpoints/step-00000004" in err
    assert "no checkpoint to resume from" in err and f"kiln train {run}/config.yaml" in err
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"


# ------------------------------------------------------------------------------- warnings


def _stderr_of_plan(fresh_python, filters: str = "") -> list[str]:
    """The stderr lines of ``kiln plan`` of a run in bf16-mixed on a CPU that emulates bf16 (which
    warns), in an interpreter of its own (pytest records the warnings of its own process instead
    of showing them), after ``filters`` (Python, as ``-W`` would set them); then ``exit N``."""
    code = f"""
import os, sys, warnings
os.environ["KILN_BF16"] = "emulated"
os.dup2(1, 2)  # stderr to what the test reads; the plan's table to nowhere
sys.stdout = open(os.devnull, "w")
{filters}
from kiln.commands import main
code = main(["plan", {MLP!r}, "train.precision=bf16-mixed"])
sys.stderr.write(f"exit {{code}}\\n")
sys.stderr.flush()
"""
    return fresh_python(code).splitlines()


NOTE = ("train.precision=bf16-mixed: bf16 is emulated on this CPU (AMD EPYC, AVX2): expect training several times "
        "slower than fp32; use train.precision=auto (fp32 here)")


@pytest.mark.e2e  # kiln plan in an interpreter of its own: seconds of imports
def test_a_kiln_warning_is_one_line_said_once_without_a_source_line(fresh_python):
    import kiln.hardware

    lines = _stderr_of_plan(fresh_python)
    note = NOTE.replace("AMD EPYC", kiln.hardware.cpu_model())
    # not Python's "kiln/plan/__init__.py:421: PrecisionWarning: ..." and then the line of source
    assert lines == [f"kiln: warning: {note}", "exit 0"], lines


@pytest.mark.e2e
def test_a_kiln_warning_a_filter_makes_an_error_is_one_error_line(fresh_python):
    # as -W error::UserWarning would: the warning raised, and said as kiln's errors are
    lines = _stderr_of_plan(fresh_python, 'warnings.simplefilter("error", UserWarning)')
    assert len(lines) == 2 and lines[0].startswith("kiln: error: train.precision=bf16-mixed: bf16 is emulated")
    assert lines[1] == "exit 2"


def test_kiln_warnings_show_on_rank_0_once_and_filters_still_hold(monkeypatch, capsys):
    import warnings

    import kiln.errors
    from kiln.errors import SHOWN_WARNINGS_ENV, KilnWarning, one_line_warnings, shown_warnings

    def shown(rank: str, launcher_said: str = "[]", action: str = "always") -> str:
        monkeypatch.setattr(kiln.errors, "_shown", set())  # a process of its own
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv(SHOWN_WARNINGS_ENV, launcher_said)
        with warnings.catch_warnings(), one_line_warnings():
            warnings.simplefilter(action)
            # as Python shows a warning outside pytest, which records them instead
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: \
                sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
            for text in ("first", "second", "first"):
                warnings.warn(text, KilnWarning)
            warnings.warn("plain", UserWarning)  # not kiln's: Python's format, as ever
        return capsys.readouterr().err

    err = shown("0")
    assert err.splitlines()[:2] == ["kiln: warning: first", "kiln: warning: second"]
    assert "UserWarning: plain" in err and err.count("kiln: warning:") == 2
    assert json.loads(shown_warnings()) == ["first", "second"]
    assert "kiln: warning:" not in shown("1")
    assert shown("0", launcher_said='["first"]').count("kiln: warning:") == 1
    assert shown("0", action="ignore") == ""  # -W ignore
    with pytest.raises(KilnWarning, match="first"):  # -W error
        shown("0", action="error")
