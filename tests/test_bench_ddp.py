"""``kiln bench ddp --quick``: every method on every model, 1 and 2 processes, JSON and chart
written; the rows' arithmetic consistent; each column ran what it names (DDP, torch's fused
AdamW, kiln's optimizer, ZeRO stage and overlap), and the methods trained the same thing."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from kiln.bench import BENCHMARKS, run_benchmark
from kiln.bench.ddp import METHODS, MODELS, build_model

pytestmark = pytest.mark.distributed  # processes on gloo: the full suite runs them, the fast tier does not


def _n_params(name: str, quick: bool) -> int:
    with torch.device("meta"):  # counted, not allocated
        return sum(p.numel() for p in build_model(name, quick).parameters())


def test_full_size_large_gpt_has_20_to_50m_parameters():
    assert 20e6 <= _n_params("gpt_large", quick=False) <= 50e6


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    return out, run_benchmark("ddp", out, quick=True)


def test_writes_json_text_and_chart(quick_run):
    out, report = quick_run
    assert "ddp" in BENCHMARKS
    assert json.loads((out / "ddp.json").read_text()) == json.loads(json.dumps(report))
    assert (out / "ddp.png").stat().st_size > 0
    assert "kiln_zero2" in (out / "ddp.txt").read_text()


def test_every_method_on_every_model_with_consistent_ratios(quick_run):
    _, report = quick_run
    assert [r["model"] for r in report["rows"]] == list(MODELS)
    for row in report["rows"]:
        name = row["model"]
        assert row["n_params"] == _n_params(name, quick=True)
        assert row["steps"] == report["setup"]["steps"][name]["timed"]
        assert row["samples_per_s_1"] > 0 and row["global_batch"] > 0
        assert list(row["methods"]) == list(METHODS)
        def paired(m: str, ref: str) -> float:  # the median of the ratios within a round
            return statistics.median(a["samples_per_s"] / b["samples_per_s"] for a, b in
                                     zip(row["methods"][m]["rounds"], row["methods"][ref]["rounds"]))

        for method, m in row["methods"].items():
            for key in ("samples_per_s", "step_ms", "comm_ms_per_step", "backward_ms_per_step"):
                assert m[key] > 0, (name, method, key, m[key])
            assert 0.0 <= m["hidden_share"] <= 1.0, (name, method, m["hidden_share"])
            assert math.isclose(m["vs_torch_ddp"], paired(method, "torch_ddp"))
            assert math.isclose(m["efficiency"], m["samples_per_s"] / (2 * row["samples_per_s_1"]))
            assert math.isclose(m["step_ms"], row["global_batch"] / m["samples_per_s"] * 1e3)
            assert math.isclose(m["exposed_comm_ms_per_step"], m["comm_ms_per_step"] * (1 - m["hidden_share"]))
            assert len(m["rounds"]) == report["setup"]["rounds"]
        assert math.isclose(row["zero2_vs_overlap"], paired("kiln_zero2", "kiln_overlap"))
        assert len(row["zero2_vs_overlap_by_round"]) == report["setup"]["rounds"]


def test_each_column_ran_what_it_names(quick_run):
    _, report = quick_run
    for row in report["rows"]:
        ms = row["methods"]
        ddp = ms["torch_ddp"]["classes"]
        assert ddp["module"] == "torch.nn.parallel.distributed.DistributedDataParallel"
        assert ddp["optimizer"] == "torch.optim.adamw.AdamW" and ddp["fused"] is True
        with torch.device("meta"):
            model = type(build_model(row["model"], quick=True))
        for method, stage in (("kiln_sync", None), ("kiln_overlap", 0), ("kiln_zero2", 2)):
            c = ms[method]["classes"]
            assert c["module"] == f"{model.__module__}.{model.__qualname__}", c  # the model itself, unwrapped
            assert c["inner_optimizer"].startswith("kiln.optim.") and c["inner_optimizer"].endswith("AdamW"), c
            wrapper = c["inner_optimizer"] if stage is None else "kiln.parallel._zero.ZeroOptimizer"
            assert c["optimizer"] == wrapper, c
            assert c["stage"] == stage, (method, c)
        # what went over the wire, per the profiler
        events = {m: set(ms[m]["rounds"][0]["comm_ms_by_event"]) for m in METHODS}
        assert "gloo:all_reduce" in events["torch_ddp"] and "gloo:all_reduce" in events["kiln_overlap"]
        # ZeRO-2 on gloo: all-reduced buckets (gloo's reduce costs more) and one broadcast per
        # shard owner and chunk for the parameters (gloo's all-gather costs 4.7x as much)
        assert {"gloo:all_reduce", "gloo:broadcast"} <= events["kiln_zero2"]
        assert not {"gloo:reduce", "gloo:all_gather", "gloo:reduce_scatter"} & events["kiln_zero2"]
        # overlap, seen from outside: reduced after backward, nothing is hidden; during backward,
        # each bucket's collective starts inside the autograd node whose hook completed it
        assert ms["kiln_sync"]["hidden_share"] == 0.0
        for method in ("torch_ddp", "kiln_overlap", "kiln_zero2"):
            assert ms[method]["hidden_share"] > 0.0, (row["model"], method)


def test_methods_train_the_same_thing(quick_run):
    _, report = quick_run
    for row in report["rows"]:
        losses = {m: torch.tensor(v["losses"]) for m, v in row["methods"].items()}
        ref = losses["torch_ddp"]
        assert len(ref) == sum(report["setup"]["steps"][row["model"]].values())
        for method, got in losses.items():
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=f"{row['model']} {method}")
