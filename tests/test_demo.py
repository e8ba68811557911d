"""The bundled demo keeps the promise its docstring and the README make: configs/digits_vit.py
reaches 97% validation accuracy, trained through the same entry point as `kiln train`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.commands import main
from kiln.config import load_config

ROOT = Path(__file__).resolve().parents[1]
VIT = str(ROOT / "configs" / "digits_vit.py")


@pytest.mark.e2e
def test_the_digits_vit_demo_reaches_97_percent(tmp_path):
    # Seed 5 is not one of the seeds 0-4 the config's docstring reports: a fresh draw, so the
    # test guards the margin, not one lucky run. About half a minute on 2 cores. fp32, as those
    # seeds were measured (on AVX2): train.precision=auto would be bf16-mixed where bf16 is native.
    assert main(["train", VIT, "train.seed=5", "train.precision=fp32", f"train.output_dir={tmp_path}",
                 "train.progress=none"]) == 0
    (run,) = tmp_path.iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["steps"] == load_config(VIT).train.max_steps
    assert summary["eval"]["accuracy"] >= 0.97  # final validation accuracy on all 297 images
