"""The trainer in dp x tp x pp layouts, through the CLI (torchrun, gloo): the same config trains
the same model in any layout, bad layouts are refused before any process starts, and
checkpoints move between layouts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "configs" / "gpt_tiny.py")
MLP = str(ROOT / "configs" / "digits_mlp.yaml")


def _kiln(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=timeout)


def _summary(folder: Path) -> dict:
    (run,) = folder.iterdir()
    return json.loads((run / "summary.json").read_text())


def _train(tmp_path: Path, name: str, config: str, *args: str) -> dict:
    out = _kiln("train", config, *args, f"train.output_dir={tmp_path / name}", "train.progress=none")
    assert out.returncode == 0, out.stderr[-3000:]
    return _summary(tmp_path / name)


def test_gpt_in_tp2_x_pp2_trains_like_one_process(tmp_path):
    # 1F1B over 4 micro-batches on one side, one process with accumulate=4 on the other: the same
    # micro-batches and gradient sums, so the runs agree to fp32 round-off.
    common = ["train.max_steps=6", "train.log_every=6", "train.eval_every=6", "model.depth=2",
              "train.clip_grad_norm=1.0", "data.args.num_samples=512"]
    one = _train(tmp_path, "one", GPT, *common, "train.accumulate=4")
    four = _train(tmp_path, "four", GPT, "--nproc", "4", *common, "parallel.tp=2", "parallel.pp=2",
                  "parallel.microbatches=4")
    assert four["layout"] == {"dp": 1, "tp": 2, "pp": 2} and four["processes"] == 4
    assert four["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-5)
    assert four["eval"]["loss"] == pytest.approx(one["eval"]["loss"], rel=1e-5)
    assert four["eval"]["accuracy"] == pytest.approx(one["eval"]["accuracy"], abs=1e-3)


def test_fp16_with_fsdp2_trains_like_one_process(tmp_path):
    # the loss scaler works on FSDP2's DTensor gradient shards and agrees on overflow across ranks
    common = ["train.max_steps=8", "train.log_every=8", "train.precision=fp16-mixed", "data.name=synthetic_images",
              "train.clip_grad_norm=1.0", "optim.lr=1e-3"]
    one = _train(tmp_path, "one", MLP, *common)
    two = _train(tmp_path, "two", MLP, "--nproc", "2", *common, "parallel.zero=3")
    assert two["skipped_steps"] == one["skipped_steps"]
    assert two["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-4)  # fp16 round-off


@pytest.mark.parametrize("args, words", [
    (["--nproc", "3", "parallel.tp=2"], ["3 process(es)", "parallel.tp=2", "--nproc 2"]),
    (["--nproc", "4", "parallel.tp=2", "parallel.pp=2", "parallel.dp=2"], ["= 8 ranks", "4 process(es)"]),
    (["--nproc", "2", "parallel.tp=3"], ["parallel.tp=3", "model.heads=4"]),
    (["--nproc", "2", "parallel.pp=2", "parallel.microbatches=3"], ["microbatches=3", "32"]),
])
def test_bad_layout_is_refused_before_any_process_starts(tmp_path, args, words):
    out = _kiln("train", GPT, *args, f"train.output_dir={tmp_path}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "kiln: error:" in out.stderr and "Traceback" not in out.stderr
    for word in words:
        assert word in out.stderr, (word, out.stderr)
    assert "torch/distributed/run.py" not in out.stderr  # refused by kiln, not by a started launcher
    assert not any(tmp_path.iterdir())  # no run directory left behind
