"""``kiln bench pipeline``: the quick run writes its files with positive numbers; each row runs
the config it claims (read back from the run's own config.yaml); evaluation under
``train.eval_grad=true`` records an autograd graph and the no-grad row's holds none; and the
techniques that change no number leave the accuracy where the row before left it."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from kiln.bench import BENCHMARKS, run_benchmark
from kiln.bench.pipeline import QUICK, ROWS, PipelineCNN, _config, row_commands
from kiln.config import load_config
from kiln.errors import ConfigError

# per row: processes, data.workers, train.precision, parallel.zero, early stopping on, train.eval_grad
EXPECTED = [
    (1, 0, "fp32", 0, False, True),
    (1, "auto", "fp32", 0, False, True),
    (2, "auto", "fp32", 0, False, True),
    (2, "auto", "bf16-mixed", 0, False, True),
    (2, "auto", "bf16-mixed", 2, False, True),
    (2, "auto", "bf16-mixed", 2, True, True),
    (2, "auto", "bf16-mixed", 2, True, False),
]


def _curve(row: dict) -> list[tuple[int, float, float]]:
    return [(e["step"], e["accuracy"], e["loss"]) for e in row["curve"]]


@pytest.mark.distributed  # seven kiln train runs in this process, five of them launching two ranks
def test_quick_run_writes_files_and_each_row_runs_its_config(tmp_path, monkeypatch):
    import kiln.bench.pp_schedules

    assert "pipeline" in BENCHMARKS
    # the schedules' table after the six ways: two of its rows here (tests/test_bench_pp_schedules.py runs all)
    monkeypatch.setattr(kiln.bench.pp_schedules, "PP_SCHEDULES", ("1f1b", "zbv"))
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    handlers = [signal.getsignal(s) for s in stops]
    report = run_benchmark("pipeline", tmp_path, quick=True)
    # a quick run's rows run through kiln.commands.main here: launching the ranks under torchrun's
    # agent leaves this process's signal handlers as they were (the agent sets four)
    assert report["setup"]["rows_in_this_process"] is True
    assert [signal.getsignal(s) for s in stops] == handlers
    assert json.loads((tmp_path / "pipeline.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "pipeline.png").stat().st_size > 0
    assert (tmp_path / "pipeline.txt").read_text().startswith("kiln bench pipeline: ")
    assert report["machine"]["cpu"] and "native_bf16" in report["machine"]
    schedules = report["schedules"]["rows"]
    assert [r["schedule"] for r in schedules] == ["1f1b", "zbv"]
    assert all(0 <= i < 1 for r in schedules for i in r["idle_per_rank"]) and schedules[1]["bubble_theory"] < schedules[0]["bubble_theory"]
    assert "zbv_idle_vs_1f1b" in report["targets"] and "mean idle" in (tmp_path / "pipeline.txt").read_text()
    rows = report["rows"]
    assert [r["name"] for r in rows] == [name for name, _, _ in ROWS]
    for row, (procs, workers, precision, zero, stopping, eval_grad) in zip(rows, EXPECTED):
        config = row["config"]  # from the run directory's config.yaml and summary.json
        assert config["processes"] == procs == row["nproc"], row["name"]
        assert config["workers"] == workers, row["name"]
        assert config["precision"] == precision, row["name"]
        assert config["zero"] == zero, row["name"]
        assert (config["early_stopping"] is not None) == stopping, row["name"]
        if stopping:
            assert config["early_stopping"]["metric"] == "eval_loss"
            assert config["early_stopping"]["patience"] == QUICK["patience"]
            assert config["early_stopping"]["min_delta"] == QUICK["min_delta"]
        assert config["eval_grad"] is eval_grad, row["name"]
        for key in ("time_to_target_s", "run_s", "command_s", "cpu_s", "peak_memory_mb", "samples_per_s",
                    "speedup_to_target", "speedup_run"):
            assert row[key] > 0, (row["name"], key, row[key])
        assert row["steps_to_target"] >= 1 and 1 <= row["steps"] <= QUICK["max_steps"]
        assert 0 <= row["final_accuracy"] <= 1
        assert row["speedup_run"] == rows[0]["run_s"] / row["run_s"]
        assert row["time_to_target_s"] <= row["run_s"]  # the target is met at an evaluation inside the run
    # Numerically neutral techniques change no number of the same layout: ZeRO-2 (a
    # reduce-scatter of the same sums), early stopping until it stops, no-grad evaluation.
    assert _curve(rows[4]) == _curve(rows[3])
    assert _curve(rows[5]) == _curve(rows[4])[: len(rows[5]["curve"])]
    assert _curve(rows[6]) == _curve(rows[5])
    # Workers draw the augmentations from other random streams: close to row 1, not equal.
    assert abs(rows[1]["final_accuracy"] - rows[0]["final_accuracy"]) <= 0.15


def _row_config(tmp_path, row: int, extra: list[str] = ()):
    """Row ``row``'s config keys on one process (the graph check needs no second rank)."""
    import yaml

    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(_config(QUICK)))
    overrides = row_commands(QUICK)[row - 1]["overrides"]
    return load_config(path, [*overrides, f"train.output_dir={tmp_path / 'runs'}", *extra])


def _evaluation_calls(cfg) -> list[dict]:
    """Train ``cfg`` in this process; for every forward of the model in eval mode, what autograd saw."""
    from kiln.train import train

    calls = []

    def probe(module, args, output):
        if isinstance(module, PipelineCNN) and not module.training:
            calls.append({"grad_enabled": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
                          "graph": output.grad_fn is not None})

    handle = torch.nn.modules.module.register_module_forward_hook(probe)
    try:
        train(cfg)
    finally:
        handle.remove()
    return calls


@pytest.mark.e2e
def test_naive_evaluation_records_a_graph_and_no_grad_evaluation_none(tmp_path):
    steps = ["train.max_steps=2", "train.eval_every=1"]
    naive = _evaluation_calls(_row_config(tmp_path, 1, steps))
    assert len(naive) == 2  # one validation batch per evaluation, two evaluations
    assert all(c == {"grad_enabled": True, "inference": False, "graph": True} for c in naive), naive
    # the last row's keys (bf16-mixed, early stopping, eval_grad=false) on one process, ZeRO off
    last = _evaluation_calls(_row_config(tmp_path, 7, [*steps, "parallel.zero=0"]))
    # no_grad, not inference mode: tensor-parallel DTensors do not run under it (kiln.train._tasks.evaluate)
    assert last and all(c == {"grad_enabled": False, "inference": False, "graph": False} for c in last), last


def test_evaluate_with_grad_records_graphs_gives_the_same_metrics_and_no_gradients():
    from kiln.train._tasks import Task, evaluate

    torch.manual_seed(0)
    model = PipelineCNN(width=4, image_size=16)
    data = [(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))) for _ in range(3)]
    graphs: list[bool] = []
    handle = model.register_forward_hook(lambda module, args, out: graphs.append(out.grad_fn is not None))
    try:
        plain = evaluate(Task("classification"), model, data, torch.device("cpu"))
        with_grad = evaluate(Task("classification"), model, data, torch.device("cpu"), grad=True)
    finally:
        handle.remove()
    assert graphs == [False] * 3 + [True] * 3
    assert with_grad == plain  # the same forward: autograd only records, it changes no value
    assert all(p.grad is None for p in model.parameters()) and model.training  # no backward; mode restored


def test_eval_grad_is_an_off_by_default_bool(tmp_path):
    cfg = _row_config(tmp_path, 7)
    assert cfg.train.eval_grad is False
    assert _row_config(tmp_path, 1).train.eval_grad is True
    with pytest.raises(ConfigError, match="eval_grad"):
        _row_config(tmp_path, 1, ["train.eval_grad=sometimes"])
