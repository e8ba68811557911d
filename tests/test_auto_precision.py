"""train.precision=auto: decided from the model's own timings where bf16 could win (a CPU with
native bf16), by rule elsewhere; recorded in the run directory and reproduced on rerun and resume."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import kiln.precision.auto as ap
import kiln.hardware
from kiln.commands import main
from kiln.config import load_config
from kiln.train import load_checkpoint, train

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")
VIT = str(ROOT / "configs" / "digits_vit.py")
RAW_NATIVE = kiln.hardware._cpu_capability()["native_bf16"]  # what this CPU really does, unpatched


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path_factory):
    """Each test its own cache of timings: one test's measurement is not another's."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


def _cpu(monkeypatch, native_bf16: bool) -> None:
    """kiln.hardware reports a CPU with (or without) native bf16, as KILN_BF16 would make it."""
    monkeypatch.setenv("KILN_BF16", "native" if native_bf16 else "emulated")


def _timings(monkeypatch, fp32: float, bf16: float) -> list[int]:
    """The measurement returns these medians (ms); the list counts the calls."""
    calls: list[int] = []

    def fake(forward, device, modes=ap.CANDIDATES, after=None, **kwargs):
        forward().backward()  # the passes do run, on the real model and batch
        after()
        calls.append(1)
        return {"fp32": [fp32] * 3, "bf16-mixed": [bf16] * 3}

    monkeypatch.setattr(ap, "measure", fake)
    return calls


def _no_measuring(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("train.precision=auto measured when it should not have")

    monkeypatch.setattr(ap, "measure", refuse)


# ---- the decision --------------------------------------------------------------------------

def test_bf16_must_win_by_the_margin():
    assert ap.decide({"fp32": 10.0, "bf16-mixed": 9.0}) == "bf16-mixed"  # 10% faster
    assert ap.decide({"fp32": 10.0, "bf16-mixed": 9.7}) == "fp32"  # 3%: inside the noise
    assert ap.decide({"fp32": 10.0, "bf16-mixed": 14.0}) == "fp32"


def test_rules_where_nothing_is_measured(monkeypatch):
    _no_measuring(monkeypatch)
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    _cpu(monkeypatch, native_bf16=False)  # AVX2: bf16 emulated, it cannot win
    choice = ap.choose_for_model(model, lambda: model(x).sum(), "cpu", cache=False)
    assert (choice.mode, choice.how) == ("fp32", "rule") and "emulated" in choice.line()
    monkeypatch.setattr(kiln.hardware, "native_low_precision", lambda device, dtype: True)
    # an Ampere+ GPU: bf16-mixed by rule where the model is sharded over GPUs; measured where one holds it
    assert (ap.rule("cuda").mode, ap.rule("cuda").how) == ("bf16-mixed", "rule")
    assert ap.rule("cuda", whole_model=True) is None
    monkeypatch.setattr(kiln.hardware, "native_low_precision", lambda device, dtype: False)
    assert ap.rule("cuda").mode == ap.rule("cuda", whole_model=True).mode == "fp32"  # a V100
    assert ap.rule("cpu").mode == "fp32"


def test_the_passes_leave_no_trace(monkeypatch):
    """Gradients, BatchNorm's statistics and the random streams are as before the measurement."""
    _cpu(monkeypatch, native_bf16=True)
    _timings(monkeypatch, fp32=10.0, bf16=5.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 2))
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)  # an arena's gradient view, say
    model.eval()
    x = torch.randn(32, 8)
    before = ({k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state())
    choice = ap.choose_for_model(model, lambda: model(x).square().mean(), "cpu", cache=False)
    assert (choice.mode, choice.how, choice.ms) == ("bf16-mixed", "measured", {"fp32": 10.0, "bf16-mixed": 5.0})
    assert all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), before[1])
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 3.0)) and model[3].weight.grad is None
    assert not model.training  # put back as it was


def test_measured_once_per_model_and_machine(monkeypatch):
    _cpu(monkeypatch, native_bf16=True)
    calls = _timings(monkeypatch, fp32=10.0, bf16=8.0)
    model, x = nn.Linear(8, 8), torch.randn(4, 8)
    first = ap.choose_for_model(model, lambda: model(x).sum(), "cpu", batch=x)
    again = ap.choose_for_model(model, lambda: model(x).sum(), "cpu", batch=x)
    assert (first.how, again.how, again.mode, len(calls)) == ("measured", "cached", "bf16-mixed", 1)
    other = ap.choose_for_model(model, lambda: model(x).sum(), "cpu", batch=torch.randn(16, 8))  # another shape
    assert other.how == "measured" and len(calls) == 2


def test_the_real_measurement_stops_early_for_a_hopeless_mode(one_thread):
    """measure() itself, on a step whose bf16 run is made 10x slower."""
    import time

    def forward():
        time.sleep(0.02 if torch.is_autocast_enabled("cpu") else 0.002)

    times = ap.measure(forward, "cpu")
    assert len(times["bf16-mixed"]) == 1 and len(times["fp32"]) == 1  # dropped after round one
    assert ap.decide({m: v[0] for m, v in times.items()}) == "fp32"


@pytest.mark.skipif(RAW_NATIVE, reason="this CPU computes bf16 natively: bf16 need not measure slower here")
def test_auto_picks_fp32_for_the_digits_vit_where_bf16_measures_slower(monkeypatch, tmp_path, one_thread):
    """The issue's test, measured for real: on a CPU that emulates bf16, made to look native
    (KILN_BF16=native), the digits ViT's bf16 passes measure slower and auto picks fp32."""
    _cpu(monkeypatch, native_bf16=True)
    summary, run = _train(tmp_path, VIT, "train.max_steps=2", "train.threads=1")
    auto = summary["precision_auto"]
    assert summary["precision"] == "fp32" and auto["how"] == "measured"
    assert auto["ms"]["bf16-mixed"] > auto["ms"]["fp32"]
    assert load_config(run / "config.yaml").train.precision == "fp32"


# ---- in a run: recorded, rerun, resumed -----------------------------------------------------

def _train(tmp_path: Path, config: str, *overrides: str) -> tuple[dict, Path]:
    before = set(tmp_path.iterdir())
    assert main(["train", config, f"train.output_dir={tmp_path}", "train.eval_every=0", "train.progress=none",
                 *overrides]) == 0
    (run,) = [p for p in set(tmp_path.iterdir()) - before if (p / "summary.json").is_file()]
    return json.loads((run / "summary.json").read_text()), run


@pytest.mark.parametrize("fp32, bf16, expected", [(10.0, 6.0, "bf16-mixed"), (10.0, 12.0, "fp32")])
def test_the_choice_is_recorded_and_a_rerun_reproduces_it(monkeypatch, tmp_path, capsys, fp32, bf16, expected):
    _cpu(monkeypatch, native_bf16=True)
    calls = _timings(monkeypatch, fp32=fp32, bf16=bf16)
    summary, run = _train(tmp_path, MLP, "train.max_steps=3", "train.progress=plain")
    assert len(calls) == 1
    assert summary["precision"] == expected
    assert summary["precision_auto"] == {"mode": expected, "how": "measured", "ms": {"fp32": fp32, "bf16-mixed": bf16},
                                         "rounds": 3}
    out = capsys.readouterr().out
    line = f"kiln: train.precision=auto -> {expected}: forward+backward of this model on one micro-batch: " \
           f"fp32 {fp32:.1f} ms, bf16-mixed {bf16:.1f} ms"
    assert line in out
    assert load_config(run / "config.yaml").train.precision == expected  # the rerun's config names it
    first = load_checkpoint(run / "checkpoints" / "final")
    assert first["precision"]["mode"] == expected

    _no_measuring(monkeypatch)  # a rerun from config.yaml does not measure, and trains bitwise alike
    again, rerun = _train(tmp_path, str(run / "config.yaml"))
    assert again["precision"] == expected and "precision_auto" not in again
    second = load_checkpoint(rerun / "checkpoints" / "final")
    assert all(torch.equal(first["model"][k], second["model"][k]) for k in first["model"])
    # and the auto run is bitwise the explicit run of its mode: the measurement touched nothing
    explicit, _ = _train(tmp_path, MLP, "train.max_steps=3", f"train.precision={expected}")
    assert explicit["final_train_loss"] == summary["final_train_loss"]


def test_a_resumed_auto_run_keeps_its_mode(monkeypatch, tmp_path):
    """Resumed with train.precision=auto (an elastic restart reads the original config), the run
    goes on in its checkpoint's mode even where a new measurement would choose the other."""
    _cpu(monkeypatch, native_bf16=True)
    _timings(monkeypatch, fp32=10.0, bf16=6.0)
    summary, run = _train(tmp_path, MLP, "train.max_steps=2", "train.checkpoint_every=1")
    assert summary["precision"] == "bf16-mixed"
    _no_measuring(monkeypatch)  # it would now say fp32, if asked
    cfg = load_config(MLP, [f"train.output_dir={tmp_path}", "train.max_steps=4", "train.eval_every=0",
                            "train.progress=none", "train.checkpoint_every=1"])
    assert cfg.train.precision == "auto"
    result = train(cfg, resume=run)
    assert result.summary["precision"] == "bf16-mixed" and result.summary["steps"] == 4
    assert load_checkpoint(run / "checkpoints" / "final")["precision"]["mode"] == "bf16-mixed"


@pytest.mark.skipif(not RAW_NATIVE, reason="needs a CPU with native bf16 (AVX-512-BF16 or AMX)")
def test_auto_picks_bf16_for_the_encoder_layer_where_bf16_is_native(one_thread):
    """kiln bench encoder-layer's layer (hidden 128, FFN 512, 16 heads, batch 50 x 80): bf16
    autocast cut its backward from 58 to 39 ms on an AVX-512-BF16 CPU (docs/lab/facts.md)."""
    from kiln.models.encoder import EncoderLayer, EncoderLayerConfig

    layer = EncoderLayer(EncoderLayerConfig(fast_dropout=True))
    x = torch.randn(50, 80, 128)
    choice = ap.choose_for_model(layer, lambda: layer(x).float().square().mean(), "cpu", cache=False)
    assert choice.mode == "bf16-mixed", choice.line()


@pytest.mark.distributed
def test_rank_0_measures_and_every_rank_trains_its_choice(tmp_path):
    """kiln train --nproc 2 with native bf16 claimed (KILN_BF16=native): rank 0 times the model,
    the other rank receives the choice; both train in it (the run completes, checkpoints agree)."""
    env = {**os.environ, "KILN_BF16": "native", "KILN_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "kiln", "train", MLP, "--nproc", "2", "train.max_steps=2",
                          f"train.output_dir={tmp_path}", "train.eval_every=0", "train.progress=plain",
                          "train.threads=1"], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    (run,) = [p for p in tmp_path.iterdir() if (p / "summary.json").is_file()]
    summary = json.loads((run / "summary.json").read_text())
    auto = summary["precision_auto"]
    assert auto["how"] == "measured" and summary["precision"] == auto["mode"] == ap.decide(auto["ms"])
    assert out.stdout.count("train.precision=auto -> ") == 1  # rank 0 says it, once
    assert load_config(run / "config.yaml").train.precision == auto["mode"]


def test_a_mode_that_runs_out_of_memory_loses_and_both_out_of_memory_is_an_error():
    """A model sized to fit a GPU in bf16 may not fit in fp32: that mode's first pass runs out of
    memory, and the other is chosen without timing it further; out of memory in both, the error."""
    after = []

    def forward(fail: set[str]):
        def run():
            mode = "bf16-mixed" if torch.is_autocast_enabled("cpu") else "fp32"
            if mode in fail:
                raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
            return torch.ones(2, requires_grad=True).sum()
        return run

    times = ap.measure(forward({"fp32"}), "cpu", after=lambda: after.append(1))
    assert math.isinf(times["fp32"][0]) and len(times["bf16-mixed"]) == 1 and len(after) == 2
    assert ap.decide({m: v[0] for m, v in times.items()}) == "bf16-mixed"
    times = ap.measure(forward({"bf16-mixed"}), "cpu")
    assert ap.decide({m: v[0] for m, v in times.items()}) == "fp32"
    with pytest.raises(torch.OutOfMemoryError, match="every mode"):
        ap.measure(forward({"fp32", "bf16-mixed"}), "cpu")
