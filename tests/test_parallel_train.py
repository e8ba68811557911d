"""The trainer in dp x tp x pp layouts, through the CLI (torchrun, gloo): the same config trains
the same model in any layout, bad layouts are refused before any process starts, and
checkpoints move between layouts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from launched import kiln_here

pytestmark = pytest.mark.distributed  # processes on gloo: the full suite runs them, the fast tier does not

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "configs" / "gpt_tiny.py")
MLP = str(ROOT / "configs" / "digits_mlp.yaml")


def _kiln(*args: str) -> subprocess.CompletedProcess:
    return kiln_here(*args)  # in this process: a kiln train --nproc N launcher without its own interpreter


def _summary(folder: Path) -> dict:
    (run,) = folder.iterdir()
    return {**json.loads((run / "summary.json").read_text()), "run_dir": str(run)}


def _train(tmp_path: Path, name: str, config: str, *args: str) -> dict:
    # fp32 unless args name another precision (the later override wins): train.precision=auto
    # is bf16-mixed on a CPU with native bf16, and these runs are compared in fp32 round-off
    out = _kiln("train", config, "train.precision=fp32", *args, f"train.output_dir={tmp_path / name}",
                "train.progress=none")
    assert out.returncode == 0, out.stderr[-3000:]
    return _summary(tmp_path / name)


def _final_weights(summary: dict) -> dict:
    from kiln.train import load_checkpoint

    return load_checkpoint(Path(summary["run_dir"]) / "checkpoints" / "final")["model"]


def _assert_same_model(a: dict, b: dict) -> None:
    # Same weights up to round-off magnified by Adam, which divides each gradient by its own
    # running scale: where a gradient is tiny, a round-off difference in it moves the weight by
    # a visible part of a step. 1e-4 of a tensor's largest value (measured: up to 6e-5 after 6
    # steps); atol for the key projection's bias, whose true gradient is 0 (softmax ignores a
    # shift common to all keys), so its values are Adam steps on round-off in both runs (~1e-6).
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-4 * a[k].abs().max().item() + 3e-6, msg=k)


def test_gpt_in_tp2_x_pp2_trains_like_one_process_and_checkpoints_move_between_them(tmp_path):
    # 1F1B over 4 micro-batches on one side, the whole batch at once on the other: the same
    # model up to fp32 round-off of the gradient sums.
    common = ["train.max_steps=6", "train.log_every=2", "train.eval_every=6", "model.depth=2",
              "train.clip_grad_norm=1.0", "data.args.num_samples=512", "optim.schedule=cosine"]
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.microbatches=4"]
    one = _train(tmp_path, "one", GPT, *common)
    four = _train(tmp_path, "four", GPT, "--nproc", "4", *common, *layout)
    assert four["layout"] == {"dp": 1, "tp": 2, "pp": 2, "replicate": 1} and four["processes"] == 4
    assert four["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-5)
    assert four["eval"]["loss"] == pytest.approx(one["eval"]["loss"], rel=1e-5)
    _assert_same_model(_final_weights(one), _final_weights(four))  # written by 4 ranks, read whole
    # Each run goes on from its final checkpoint in the other layout: the 4-process one (each
    # rank saved its stage's tensor-parallel shards) in one process, the one-process one as
    # tp=2 x pp=2; both continue the same training.
    more = ["train.max_steps=9", "train.progress=none"]
    a = _kiln("train", "--resume", one["run_dir"], "--nproc", "4", *more, *layout)
    b = _kiln("train", "--resume", four["run_dir"], *more, "parallel.tp=1", "parallel.pp=1")
    assert a.returncode == 0, a.stderr[-3000:]
    assert b.returncode == 0, b.stderr[-3000:]
    sa, sb = ({**json.loads((Path(s["run_dir"]) / "summary.json").read_text()), "run_dir": s["run_dir"]}
              for s in (one, four))
    assert sa["steps"] == sb["steps"] == 9 and sa["layout"]["tp"] == 2 and sb["layout"]["tp"] == 1
    assert sa["final_train_loss"] == pytest.approx(sb["final_train_loss"], rel=1e-5)
    _assert_same_model(_final_weights(sa), _final_weights(sb))


def test_a_onecycle_run_is_not_stretched_on_resume(tmp_path):
    done = _train(tmp_path, "one", GPT, "train.max_steps=4", "model.depth=1", "train.eval_every=0")
    out = _kiln("train", "--resume", done["run_dir"], "train.max_steps=8")
    assert out.returncode == 2 and "optim.schedule=onecycle was laid out for 4 steps" in out.stderr
    assert "train.max_steps=4" in out.stderr and "Traceback" not in out.stderr


LOW_PRECISION = {"fp16-mixed": "parallel.zero=3", "bf16-true": "parallel.zero=2"}


def _low_precision(precision: str) -> list[str]:
    return ["train.max_steps=8", "train.log_every=8", f"train.precision={precision}", "data.name=synthetic_images",
            "train.clip_grad_norm=1.0", "optim.lr=1e-3", "train.progress=none"]


@pytest.fixture(scope="module")
def low_precision_runs(tmp_path_factory):
    """precision -> (one process's summary, two processes' summary): the one-process runs here,
    in this process; the two-process runs in one pair of gloo processes started once
    (tests/group_runs.py), as workers of kiln train --nproc 2 run them."""
    from group_runs import train_in_one_group

    from kiln.commands import main

    out = tmp_path_factory.mktemp("low_precision")
    for precision in LOW_PRECISION:
        assert main(["train", MLP, *_low_precision(precision), f"train.output_dir={out / precision / 'one'}"]) == 0
    train_in_one_group(2, [(MLP, [*_low_precision(precision), zero, f"train.output_dir={out / precision / 'two'}"])
                           for precision, zero in LOW_PRECISION.items()])
    return {precision: (_summary(out / precision / "one"), _summary(out / precision / "two"))
            for precision in LOW_PRECISION}


@pytest.mark.filterwarnings("ignore::kiln.precision.PrecisionWarning")  # emulated on AVX2
def test_fp16_with_fsdp2_trains_like_one_process(low_precision_runs):
    # the loss scaler works on FSDP2's DTensor gradient shards and agrees on overflow across ranks
    one, two = low_precision_runs["fp16-mixed"]
    assert two["skipped_steps"] == one["skipped_steps"]
    assert two["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-4)  # fp16 round-off


@pytest.mark.filterwarnings("ignore::kiln.precision.PrecisionWarning")  # emulated on AVX2
def test_bf16_true_with_zero2_trains_like_one_process(low_precision_runs):
    # the fp32 master weights of bf16-true are stepped through ZeRO-2: their gradient is
    # reduce-scattered, each rank steps its shard, the masters are all-gathered and cast to bf16
    one, two = low_precision_runs["bf16-true"]
    # bf16 activations: the two reduction orders round differently in the last bf16 bit
    assert two["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-4)
    a, b = _final_weights(one), _final_weights(two)
    assert {v.dtype for v in b.values()} == {torch.bfloat16}  # the model itself is bf16
    rel = [((a[k].float() - b[k].float()).abs().max() / a[k].float().abs().max()).item() for k in a]
    assert max(rel) < 2e-2  # within a few bf16 steps (2^-8 = 4e-3 of the value each)


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


def _plan_mb(text: str, line: str) -> list[float]:
    import re

    row = next(r for r in text.splitlines() if r.startswith(line))
    return [float(x.replace(",", "")) for x in re.findall(r"([\d,]+\.\d) MB", row)]


def test_plan_shows_the_fullest_ranks_memory_in_a_layout(capsys):
    from kiln.commands import main

    big = ["model.dim=256", "model.depth=4"]  # 3.3 M parameters: MB figures with 3 significant digits
    assert main(["plan", GPT, *big]) == 0
    whole = _plan_mb(capsys.readouterr().out, "memory")  # params, grads, state, total
    assert main(["plan", GPT, *big, "--nproc", "4", "parallel.zero=2"]) == 0
    out = capsys.readouterr().out
    assert "dp=4 x tp=1 x pp=1" in out
    params, grads, state, _ = _plan_mb(out, "per rank")
    # ZeRO-2: parameters whole, gradients and optimizer state a quarter each
    assert params == whole[0] and grads == pytest.approx(whole[1] / 4, abs=0.1)
    assert state == pytest.approx(whole[2] / 4, abs=0.1)
    assert main(["plan", GPT, *big, "--nproc", "4", "parallel.tp=2", "parallel.pp=2"]) == 0
    params = _plan_mb(capsys.readouterr().out, "per rank")[0]
    # tensor parallel halves the matrices, the pipeline halves the blocks; the replicated norms,
    # biases and positions keep the fullest rank a little above a quarter
    assert 0.25 * whole[0] < params < 0.32 * whole[0]
    # the state comes from the optimizer class: SGD keeps none without momentum, one buffer with it
    assert main(["plan", GPT, *big, "optim.name=sgd"]) == 0
    assert _plan_mb(capsys.readouterr().out, "memory")[2] == 0
    assert main(["plan", GPT, *big, "optim.name=sgd", "optim.momentum=0.9"]) == 0
    assert _plan_mb(capsys.readouterr().out, "memory")[2] == pytest.approx(whole[2] / 2, abs=0.1)
    assert main(["plan", GPT, "--nproc", "3", "parallel.tp=2"]) == 2
    assert "3 process(es) cannot be split" in capsys.readouterr().err
