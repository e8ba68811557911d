"""End-to-end runs through the CLI: run directory contents, reruns, failures, bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.commands import main
from kiln.train import load_checkpoint, read_metrics

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")
VIT = str(ROOT / "configs" / "digits_vit.py")


def _train(tmp_path: Path, config: str = MLP, *overrides: str) -> Path:
    before = set(tmp_path.glob("*"))
    # fp32 unless overrides name another precision (the later override wins): the runs here are
    # compared with each other, and train.precision=auto is bf16-mixed where bf16 is native
    code = main(["train", config, "train.precision=fp32", f"train.output_dir={tmp_path}", *overrides])
    assert code == 0
    (run_dir,) = set(tmp_path.glob("*")) - before
    return run_dir


def test_run_directory_is_complete(tmp_path, capsys):
    run = _train(tmp_path, MLP, "train.max_steps=30", "train.eval_every=10", "train.log_every=5")
    for name in ("config.yaml", "metrics.csv", "summary.json", "loss.png", "checkpoints/final/kiln_meta.json"):
        assert (run / name).is_file(), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["steps"] == 30
    for key in ("final_train_loss", "samples_per_second", "peak_memory_mb", "wall_seconds"):
        assert isinstance(summary[key], float) and summary[key] > 0 and math.isfinite(summary[key]), key
    assert 0.0 <= summary["eval"]["accuracy"] <= 1.0 and summary["eval"]["loss"] > 0

    rows = read_metrics(run)
    assert [int(r["step"]) for r in rows] == [5, 10, 15, 20, 25, 30]
    assert [bool(r["eval_accuracy"]) for r in rows] == [False, True, False, True, False, True]
    assert float(rows[-1]["train_loss"]) == pytest.approx(summary["final_train_loss"], rel=1e-5)
    assert float(rows[-1]["eval_accuracy"]) == pytest.approx(summary["eval"]["accuracy"], rel=1e-5)
    # the loss fell: the run really trained
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])

    ckpt = load_checkpoint(run / "checkpoints" / "final")  # executes no code from the files
    assert ckpt["step"] == 30 and "model" in ckpt and "optimizer" in ckpt
    # a torch.optim state dict, numbered in the model's parameter order
    assert len(ckpt["optimizer"]["state"]) == len(ckpt["model"]) == 6
    assert ckpt["optimizer"]["state"][0]["exp_avg"].shape == ckpt["model"]["blocks.0.0.weight"].shape

    out = capsys.readouterr().out
    assert "step 30/30" in out  # plain progress lines when stdout is not a terminal


@pytest.mark.e2e
def test_loss_png_is_log_scaled_only_where_the_losses_span_a_decade(tmp_path):
    from kiln.train._plot import loss_figure, plot_loss

    def run(name: str, rows: list[tuple[int, str, str]]) -> Path:
        (tmp_path / name).mkdir()
        lines = ["step,train_loss,eval_loss"] + [",".join(map(str, r)) for r in rows]
        (tmp_path / name / "metrics.csv").write_text("\n".join(lines) + "\n")
        return tmp_path / name

    long = run("long", [(1, 2.3, ""), (50, 0.5, 0.6), (100, 0.2, 0.25)])  # 2.3 / 0.2: over a decade
    short = run("short", [(1, 2.3, ""), (2, 2.2, 2.1)])
    one = run("one", [(2, 2.2, "")])
    assert [loss_figure(r).axes[0].get_yscale() for r in (long, short, one)] == ["log", "linear", "linear"]
    # a curve of one point is drawn (as a dot: a line needs two)
    assert loss_figure(one).axes[0].lines[0].get_marker() == "o"
    assert plot_loss(long) == long / "loss.png" and (long / "loss.png").stat().st_size > 0


def test_rerun_from_saved_config_is_bitwise_identical(tmp_path):
    first = _train(tmp_path, VIT, "train.max_steps=12", "model.depth=1", "train.log_every=4", "model.dropout=0.1")
    second = _train(tmp_path, str(first / "config.yaml"))
    s1 = json.loads((first / "summary.json").read_text())
    s2 = json.loads((second / "summary.json").read_text())
    assert s1["final_train_loss"] == s2["final_train_loss"]
    assert s1["eval"] == s2["eval"]
    w1 = load_checkpoint(first / "checkpoints" / "final")["model"]
    w2 = load_checkpoint(second / "checkpoints" / "final")["model"]
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert second.name.startswith("digits_vit-")  # the rerun is named after the run it repeats


def test_different_seed_gives_a_different_run(tmp_path):
    a = _train(tmp_path, MLP, "train.max_steps=5")
    b = _train(tmp_path, MLP, "train.max_steps=5", "train.seed=1")
    la = json.loads((a / "summary.json").read_text())["final_train_loss"]
    lb = json.loads((b / "summary.json").read_text())["final_train_loss"]
    assert la != lb


def test_train_threads_holds_for_the_run_only(tmp_path):
    """kiln.train in a caller's process (a notebook, a benchmark, a test) gives the caller's
    thread count back: a later run there computes as it would have."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _train(tmp_path, MLP, "train.max_steps=2", "train.threads=1")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_epochs_sets_the_number_of_steps(tmp_path):
    run = _train(tmp_path, MLP, "train.max_steps=null", "train.epochs=2", "data.batch_size=500")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 * (1500 // 500)
    assert summary["epochs"] == pytest.approx(2.0)


def test_failed_run_is_marked_failed(tmp_path, monkeypatch):
    import kiln.train.loop as loop

    calls = {"n": 0}
    real = loop.micro_batch_loss

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected failure")
        return real(*args)

    monkeypatch.setattr(loop, "micro_batch_loss", flaky)
    with pytest.raises(RuntimeError, match="injected failure"):
        main(["train", MLP, f"train.output_dir={tmp_path}", "train.max_steps=10"])
    (run,) = tmp_path.iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "injected failure" in summary["error"]
    assert not (run / "checkpoints" / "final").exists()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["train.max_stepz=5"], "did you mean train.max_steps?"),
        (["train.max_steps=abc"], "expected int"),
        (["optimizer.lr=0.1"], "unknown namespace 'optimizer'"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(tmp_path, capsys, args, expected):
    code = main(["train", MLP, f"train.output_dir={tmp_path}", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("kiln: error: ") and expected in err
    assert "Traceback" not in err
    assert not any(tmp_path.iterdir())  # nothing was built, no run directory made


def test_missing_config_and_malformed_yaml_exit_2(tmp_path, capsys):
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert main(["train", str(bad)]) == 2
    assert "malformed YAML" in capsys.readouterr().err


def test_console_script_help_and_error_without_traceback(tmp_path):
    exe = [sys.executable, "-m", "kiln"]
    out = subprocess.run([*exe, "train", "--help"], capture_output=True, text=True, check=True).stdout
    assert "key=value" in out and "kiln train configs/digits_vit.py" in out
    out = subprocess.run([*exe, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("train", "bench", "plan"):
        assert command in out
    bad = subprocess.run([*exe, "train", MLP, "train.max_stepz=1"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "did you mean train.max_steps?" in bad.stderr and "Traceback" not in bad.stderr


def test_plan_reports_parameters_without_training(capsys):
    assert main(["plan", VIT, "model.depth=2"]) == 0
    out = capsys.readouterr().out
    from kiln.models import create_model

    n = sum(p.numel() for p in create_model("vit", depth=2).parameters())
    assert f"{n:,} parameters" in out


def test_import_kiln_stays_light():
    code = (
        "import sys, kiln; heavy = ['torch', 'matplotlib', 'sklearn', 'omegaconf', 'hydra', 'rich', "
        "'tensorboard']; print([m for m in heavy if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _final(run: Path) -> dict:
    return load_checkpoint(run / "checkpoints" / "final")["model"]


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_switch_trains_bitwise_identically(tmp_path, mode):
    common = (VIT, "model.depth=3", "model.dropout=0.1", "train.max_steps=5")
    plain = _final(_train(tmp_path / "a", *common))
    checkpointed = _final(_train(tmp_path / "b", *common, f"train.activation_checkpointing={mode}",
                                 "train.ac_every=2"))
    assert plain.keys() == checkpointed.keys()
    assert all(torch.equal(plain[k], checkpointed[k]) for k in plain)


@pytest.mark.e2e
def test_compile_switch_matches_eager_and_reports_compile_time(tmp_path):
    common = (MLP, "train.max_steps=20", "train.log_every=20", "optim.lr=1e-3")
    eager = _train(tmp_path / "eager", *common)
    compiled = _train(tmp_path / "compiled", *common, "train.compile=true")
    e = json.loads((eager / "summary.json").read_text())
    c = json.loads((compiled / "summary.json").read_text())
    assert c["compile_seconds"] > 0 and e["compile_seconds"] is None
    assert c["final_train_loss"] == pytest.approx(e["final_train_loss"], rel=1e-5)
    assert _final(compiled).keys() == _final(eager).keys()  # checkpoints hold the plain model's keys


def test_a_compiled_model_is_compiled_for_the_run_and_its_flops_still_counted(tmp_path, monkeypatch):
    """train.compile=true compiles the model's step, and the steps after the first run the
    compiled graphs: the FLOP count (a dispatch mode) runs on the second step, eagerly. Counted on
    the compiled model's first call, it left the model eager for the whole run (kiln compile
    trained at eager speed on an H200); a counting backend shows it without inductor's minutes."""
    graphs, calls = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            calls.append(len(graphs))
            return gm.forward(*args)
        return run

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend=backend))
    run = _train(tmp_path, MLP, "train.max_steps=4", "train.log_every=1", "train.eval_every=0", "train.compile=true")
    summary = json.loads((run / "summary.json").read_text())
    # the model's graphs (its linear layers), none of the counter's, called on steps 1, 3 and 4 at
    # least (step 2 counts FLOPs eagerly); before, dynamo compiled the counter's op_flops 8 times
    assert graphs and all("linear" in gm.code for gm in graphs), [gm.code for gm in graphs]
    assert len(calls) >= 3
    assert summary["flops_per_step"] > 0 and summary["compile_seconds"] > 0
    torch._dynamo.reset()


def test_tune_measures_every_candidate_and_recommends_the_fastest(capsys):
    from kiln.commands.tune import candidates, tune

    assert len(candidates()) == 8 and len(candidates(compile=True)) == 16
    rows = tune(MLP, steps=3, keys=["optim.contiguous"])
    assert sorted(" ".join(r["overrides"]) for r in rows) == ["optim.contiguous=false", "optim.contiguous=true"]
    assert rows[0]["samples_per_second"] >= rows[1]["samples_per_second"] > 0
    assert main(["tune", MLP, "--steps", "1"]) == 2
    assert "--steps 1" in capsys.readouterr().err
    out = subprocess.run([sys.executable, "-m", "kiln", "tune", "--help"], capture_output=True, text=True).stdout
    assert "samples/s" in out


def test_importing_the_trainer_pulls_in_nothing_heavy(fresh_python):
    # import kiln's core adds ~0.1 s to import torch; these would add 0.5-1.5 s each
    code = (
        "import sys, torch, kiln, kiln.optim, kiln.models, kiln.data, kiln.config, kiln.train; "
        "heavy = ['torch._dynamo', 'torch.distributed.checkpoint', 'torch.distributed.fsdp', "
        "'matplotlib', 'sklearn', 'tensorboard', 'hydra']; print([m for m in heavy if m in sys.modules])"
    )
    out = fresh_python(code)
    assert out.strip() == "[]"


@pytest.mark.parametrize("config", ["configs/digits_mlp.yaml", "configs/gpt_tiny.py"])
def test_a_run_imports_neither_torchs_compiler_nor_scikit_learn(fresh_python, tmp_path, config):
    # each of torch._dynamo and sklearn costs a process ~1-2 s, as much as torch itself: a kiln
    # train process that compiles nothing loads neither. Dynamo was reached before by torch.optim's
    # dynamo-disabled methods, torch.profiler's start, DCP's model state dict and initialisation on
    # the meta device (the fit check)
    code = f"""
import os, sys
from kiln.commands import main
os.environ["KILN_CACHE_DIR"] = {str(tmp_path)!r}
args = ["train", {str(ROOT / config)!r}, "train.max_steps=3", "train.eval_every=2", "train.checkpoint_every=2",
        "train.precision=fp32", "train.output_dir={tmp_path / 'runs'}"]
first = main(args)
print(first, [m for m in ("torch._dynamo", "sklearn") if sys.modules.get(m)])
"""
    if "digits" in config:  # the digits' split is computed by scikit-learn once, then cached
        fresh_python(code)
    assert fresh_python(code).strip().splitlines()[-1] == "0 []"


def test_a_draw_from_pythons_generator_while_the_run_is_built_leaves_the_run_as_seeded(tmp_path, monkeypatch):
    """Some modules draw from Python's generator when imported (rich.style does, which
    scikit-learn imports with the digits): the first run in a process imported them while it was
    built, a later one found them imported. Either way the run starts from its seed's state: the
    RNG file of its checkpoint is the same."""
    import random

    import kiln.train._setup as setup

    def rng_file(run: Path) -> bytes:
        return (run / "checkpoints" / "final" / "rng-00000.pt").read_bytes()

    pytest.importorskip("sklearn.datasets")  # what the digits import, imported now: no draw in the first run
    steps = ["train.max_steps=2", "train.eval_every=0", "train.progress=none"]
    plain = _train(tmp_path / "plain", MLP, *steps)
    load_data = setup.load_data
    monkeypatch.setattr(setup, "load_data", lambda *a, **k: (random.getrandbits(24), load_data(*a, **k))[1])
    drawn = _train(tmp_path / "drawn", MLP, *steps)
    assert rng_file(drawn) == rng_file(plain)
