"""``kiln bench parallel`` on a reduced grid (1x1x1, 2x1x1, 1x2x1, 1x1x2 as dp x tp x pp; a small
GPT and BERT, one timed step), through the benchmark's own ``run``: the numbers a wrong
layout or a wrong measurement would change.

- Parameters each rank holds (summed local shard sizes, measured) equal what the tensor-parallel
  plan and the pipeline split say, counted here from the model's parameter names; model state
  (parameters + gradients + AdamW's two moments, fp32) is 16 bytes per local parameter, within
  0.1% (arena alignment padding, step counts).
- 2x1x1 replicates: the same state bytes as 1x1x1.
- Communication time is exactly 0 in one process and positive otherwise; the bubble of the
  pipeline rows is a fraction, next to its textbook numbers.
"""

from __future__ import annotations

import json

import pytest

from kiln.bench import BENCHMARKS, get_benchmark
from kiln.bench import parallel as bench

pytestmark = pytest.mark.distributed  # processes on gloo: the full suite runs them, the fast tier does not

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]
SETTINGS = {"model": dict(vocab_size=256, seq_len=16, dim=128, depth=4, heads=4), "batch": 8, "microbatches": 4,
            "steps": 1, "warmup": 1, "profiled": 1}
def _expected_local_params(name: str, tp: int, pp: int) -> int:
    """The most parameters any rank holds under tp x pp, counted from the whole model's names
    and its family's plan (kiln's GPT/BERT, or transformers' Llama)."""
    from kiln.models import repeated_blocks
    from kiln.parallel._pp import stage_of_parameters, stage_ranges
    from kiln.parallel._tp import tp_sharded_names  # what apply_tp splits; checked here against the real shards

    model = bench._build(name, SETTINGS["model"])
    sharded = tp_sharded_names(model, tp)
    owner = stage_of_parameters(model, stage_ranges(len(repeated_blocks(model)), pp)) if pp > 1 else {}
    per_stage = [0] * pp
    for fqn, p in model.named_parameters():
        per_stage[owner.get(fqn, 0)] += p.numel() // tp if fqn in sharded else p.numel()
    return max(per_stage)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_parallel")
    result = bench.run(out, family="gpt,bert,llama", layouts=LAYOUTS, settings=SETTINGS)
    result["_out"] = out
    return result


def test_registered_and_files_written(report):
    assert "parallel" in BENCHMARKS and get_benchmark("parallel") is bench.run
    out = report.pop("_out")
    assert json.loads((out / "parallel.json").read_text()) == json.loads(json.dumps(report))
    assert (out / "parallel.png").stat().st_size > 0
    lines = [line.split()[:2] for line in (out / "parallel.txt").read_text().splitlines()]  # one a row
    assert sum(line in [[m, f"{dp}x{tp}x{pp}"] for m in ("gpt", "bert", "llama") for dp, tp, pp in LAYOUTS]
               for line in lines) == 3 * len(LAYOUTS)
    assert [(r["model"], r["layout"]) for r in report["rows"]] == [
        (m, f"{dp}x{tp}x{pp}") for m in ("gpt", "bert", "llama") for dp, tp, pp in LAYOUTS]


@pytest.mark.parametrize("model", ["gpt", "bert", "llama"])
def test_state_bytes_follow_the_layout(report, model):
    rows = {r["layout"]: r for r in report["rows"] if r["model"] == model}
    for layout, r in rows.items():
        tp, pp = r["tp"], r["pp"]
        expected = _expected_local_params(model, tp, pp)
        assert r["n_params_local_max"] == expected, (layout, r["n_params_local_max"], expected)
        # fp32 parameters + gradients + exp_avg + exp_avg_sq = 16 bytes per local parameter
        assert 16 * expected <= r["state_bytes"] <= 1.001 * 16 * expected, (layout, r["state_bytes"], expected)
    assert rows["2x1x1"]["state_bytes"] == rows["1x1x1"]["state_bytes"]  # replicated
    for layout in ("1x2x1", "1x1x2"):  # about half; not exactly: norms, biases and the position table
        assert 0.49 < rows[layout]["state_vs_1x1x1"] < 0.56, (layout, rows[layout]["state_vs_1x1x1"])
    for r in rows.values():
        # the peak RSS above the run's start holds at least the state (every byte of it written)
        assert r["peak_rss_bytes"] >= 0.9 * r["state_bytes"], (r["layout"], r["peak_rss_bytes"], r["state_bytes"])
        # the timed steps' growth of the resident set: something (activations, the step's
        # temporaries) and never more than the whole run's peak above its start
        assert 0 < r["work_rss_bytes"] <= r["peak_rss_bytes"], (r["layout"], r["work_rss_bytes"], r["peak_rss_bytes"])
        # the speed is the global batch over rank 0's timed wall time, and the step time its inverse
        assert r["samples_per_s"] == pytest.approx(r["global_batch"] * r["steps"] / r["per_rank"][0]["wall_s"])
        assert r["samples_per_s"] * r["step_ms"] / 1e3 == pytest.approx(r["global_batch"])
        assert all(0 < x["wall_s"] <= x["phase_s"]["timed"] for x in r["per_rank"])


@pytest.mark.parametrize("model", ["gpt", "bert", "llama"])
def test_comm_and_bubble(report, model):
    m = SETTINGS["microbatches"]
    for r in (r for r in report["rows"] if r["model"] == model):
        if r["ranks"] == 1:
            assert r["comm_ms_per_step"] == 0.0 and r["comm_share"] == 0.0
        else:
            assert r["comm_ms_per_step"] > 0 and 0 < r["comm_share"] <= 1, r
        if r["pp"] > 1:
            assert 0 < r["bubble"] <= r["bubble_max"] < 1, r
            assert all(0 < x["bubble"] < 1 for x in r["per_rank"])
            assert r["bubble_gpipe"] == (r["pp"] - 1) / m
            assert r["bubble_fill_drain"] == (r["pp"] - 1) / (m + r["pp"] - 1)
        else:
            assert r["bubble"] is None and r["bubble_gpipe"] is None
