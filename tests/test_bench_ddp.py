"""Smoke test of ``kiln bench ddp --quick``: both models measured at 1 and 2 processes,
JSON and chart written, the rows' arithmetic consistent."""

from __future__ import annotations

import json

import pytest

from kiln.bench import BENCHMARKS, run_benchmark

pytestmark = pytest.mark.slow  # processes on gloo: the full suite runs them, the fast tier does not


def test_ddp_benchmark_quick_writes_positive_numbers(tmp_path):
    assert "ddp" in BENCHMARKS
    report = run_benchmark("ddp", tmp_path, quick=True)
    assert json.loads((tmp_path / "ddp.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "ddp.png").stat().st_size > 0
    assert [r["model"] for r in report["rows"]] == ["vit", "gpt"]
    for row in report["rows"]:
        for key in ("samples_per_s_1", "samples_per_s_2", "speedup", "efficiency", "comm_ms_per_step",
                    "step_ms_1", "step_ms_2", "n_params"):
            assert row[key] > 0, (row["model"], key, row[key])
        assert row["efficiency"] == row["samples_per_s_2"] / (2 * row["samples_per_s_1"])
        assert row["global_batch"] > 0 and row["steps"] == report["setup"]["steps"]
