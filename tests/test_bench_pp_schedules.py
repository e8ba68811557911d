"""``kiln bench pp-schedules`` in its quick form (a small GPT, pp=2, two timed rounds) through
the benchmark's own ``run``: a row per schedule with its stages, its theoretical bubble (torch's
order at unit costs and at the measured CPU cost of each pass), each rank's measured idle share
and the step time; the numbers a wrong placement or a wrong measurement would change."""

from __future__ import annotations

import json

import pytest

from kiln.bench import BENCHMARKS, get_benchmark
from kiln.bench import pp_schedules as bench
from kiln.parallel import PP_SCHEDULES

pytestmark = pytest.mark.distributed  # processes on gloo: the full suite runs them, the fast tier does not


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_pp_schedules")
    result = bench.run(out, quick=True)
    result["_out"] = out
    return result


def test_a_row_per_schedule_with_its_theory_and_measured_idle(report):
    assert get_benchmark("pp-schedules") is bench.run and "pp-schedules" in BENCHMARKS
    out = report.pop("_out")
    assert json.loads((out / "pp-schedules.json").read_text()) == json.loads(json.dumps(report))
    rows = {r["schedule"]: r for r in report["rows"]}
    assert list(rows) == list(PP_SCHEDULES)
    # stages: one a rank for GPipe and 1F1B, two for the interleaved and V-shaped ones
    assert {n: r["stages"] for n, r in rows.items()} == {"gpipe": 2, "1f1b": 2, "interleaved-1f1b": 4,
                                                         "interleaved-zb": 4, "zbv": 4, "dualpipev": 4}
    m = bench.QUICK_MICROBATCHES
    assert rows["1f1b"]["bubble_theory"] == pytest.approx(1 / (m + 1))  # (p - 1) / (m + p - 1)
    for name in ("interleaved-zb", "zbv", "dualpipev"):
        assert rows[name]["zero_bubble"] and rows[name]["bubble_theory"] < rows["interleaved-1f1b"]["bubble_theory"]
    for r in rows.values():
        assert len(r["idle_per_rank"]) == 2 and all(0 <= b < 1 for b in r["idle_per_rank"])
        assert r["idle_mean"] == pytest.approx(sum(r["idle_per_rank"]) / 2)
        # the step with the optimizer lasts at least the pipeline's, which lasts longer than nothing
        assert 0 < r["pipeline_ms"] <= r["step_ms"] * 1.05
    assert rows["1f1b"]["step_vs_1f1b"] == pytest.approx(1.0)
    # each pass's CPU time, by stage and kind: whole backwards for 1F1B, input and weight passes
    # apart for the zero-bubble ones, where the first stage's input pass is empty and its weight
    # pass the whole backward (torch's way)
    assert set(rows["1f1b"]["pass_cpu_ms"]) == {"F0", "B0", "F1", "B1"}
    assert set(rows["interleaved-zb"]["pass_cpu_ms"]) == {f"{k}{s}" for k in "FIW" for s in range(4)}
    for name in ("interleaved-zb", "zbv"):
        cpu = rows[name]["pass_cpu_ms"]
        assert cpu["I0"] < cpu["W0"] / 5 and cpu["I1"] > cpu["W0"] / 5, (name, cpu)
    for r in rows.values():
        assert len(r["bubble_costs_per_rank"]) == 2 and all(0 <= b < 1 for b in r["bubble_costs_per_rank"])
        # the passes' CPU time, ordered as the schedule orders them, fits in the pipeline's wall time
        assert 0 < r["cpu_step_ms"] <= r["pipeline_ms"] * 1.05
        if r["descheduled_per_rank"] is not None:  # Linux
            assert all(0 <= d < 1 for d in r["descheduled_per_rank"])
    assert set(report["targets"]) == {f"{n}_idle_vs_1f1b" for n in ("interleaved-zb", "zbv", "dualpipev")}
