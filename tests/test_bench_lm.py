"""``kiln bench overhead`` and ``kiln bench lm`` in their quick forms: every row trains, the
figures are what the report says they are, and the rows of ``lm`` are the same training."""

from __future__ import annotations

import json

import pytest

from kiln.bench import run_benchmark

pytestmark = pytest.mark.e2e


def test_bench_overhead_quick(tmp_path):
    report = run_benchmark("overhead", tmp_path, quick=True)
    us = report["us_per_step"]
    assert set(us) == {"plain loop", "kiln train"}
    for row in us.values():  # a 7 K-parameter step: microseconds, not seconds; CPU time within wall time
        assert 20 < row["cpu"] < 200_000 and 20 < row["wall"] < 200_000, us
    for kind in ("cpu", "wall"):  # one round: the ratio is that round's
        assert report["kiln_vs_plain"][kind] == pytest.approx(us["kiln train"][kind] / us["plain loop"][kind])
    assert report["target_on"] == "cpu" and report["targets"]["kiln_vs_plain_cpu"]["limit"] == 1.1
    assert json.loads((tmp_path / "overhead.json").read_text())["steps"] == 200


def test_bench_lm_quick_rows_are_the_same_training(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_BF16", "emulated")  # train.precision=auto is then fp32 in every row, on any CPU
    report = run_benchmark("lm", tmp_path, quick=True)
    rows = {r["run"]: r for r in report["rows"]}
    assert list(rows) == ["plain loop", "kiln", "kiln compile", "kiln fp8", "kiln fp8 compile"]
    for name in ("kiln fp8", "kiln fp8 compile"):  # float8 needs a GPU of compute capability 8.9+
        fp8 = rows.pop(name)
        assert fp8["tokens_per_s"] is None and "no CUDA GPU" in fp8["not_run"] and "kiln[fp8]" in fp8["not_run"]
    assert report["fp8_speedup"] == {} and report["fp8_not_run"] == fp8["not_run"]
    assert "not run: train.precision=fp8 needs" in (tmp_path / "lm.txt").read_text()
    for name, row in rows.items():
        assert row["precision"] == "fp32", name
        assert row["tokens_per_s"] > 0 and row["tensor_peak_mb"] > 0 and row["process_peak_mb"] > 100, name
        # the first window's mean loss: same weights, batches and learning rates as the plain loop
        assert abs(row["loss_diff"]) < 1e-4, (name, row["loss_diff"])
    assert rows["plain loop"]["loss_diff"] == 0.0
    assert report["flops_per_step"] > 0
    assert set(report["targets"]) == {"kiln_vs_plain_tokens_per_s", "kiln_vs_plain_process_peak"}
