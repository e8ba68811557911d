"""``kiln bench checkpoint`` in its quick form: both saves write a complete checkpoint, and the
figures are what the report says they are."""

from __future__ import annotations

import json

import pytest

from kiln.bench import run_benchmark

pytestmark = pytest.mark.e2e


def test_bench_checkpoint_quick(tmp_path):
    report = run_benchmark("checkpoint", tmp_path, quick=True)
    # AdamW keeps two fp32 moments per fp32 parameter: 12 bytes a parameter, and a few steps
    assert 12 * report["params"] <= report["state_bytes"] < 12 * report["params"] + 4096
    (r,) = report["per_round"]
    for mode in ("sync", "async", "write"):  # the stall: the window less as many plain steps
        assert r[mode]["stall"] == pytest.approx(r[mode]["window"] - report["steps"] * r["step"])
        assert 0 < r[mode]["call"] < r[mode]["window"]
        # the CPU a save added: the window's, every thread of the process, less as many plain steps'
        assert r[mode]["cpu_added"] == pytest.approx(r[mode]["cpu"] - report["steps"] * r["step_cpu"])
    # the training thread's CPU time over its wall time: a share of one core (one training thread)
    assert 0 < r["core_share"] <= 1.05 and report["core_share"] == r["core_share"]
    assert r["sync"]["waited"] < 0.01  # nothing left to wait for after a save that wrote its files
    # the async call copies 38 MiB and returns; the sync call writes and syncs the files
    assert r["async"]["call"] < r["sync"]["call"]
    assert report["async_vs_sync"] == pytest.approx(r["async"]["stall"] / r["sync"]["stall"])
    assert report["targets"]["async_vs_sync_stall"]["limit"] == 0.2
    assert not list(tmp_path.glob("checkpoint-bench-*"))  # its checkpoints removed
    assert json.loads((tmp_path / "checkpoint.json").read_text())["rounds"] == 1
