"""kiln.launch.testing.run_distributed, which the distributed tests and the benchmarks stand on:
each rank's result, the caller's environment and directory in every worker, a worker's error
raised with its traceback, and workers forked from a forkserver that are fresh processes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.launch.testing import run_distributed

pytestmark = pytest.mark.distributed

_TOUCHED: list[int] = []  # a module global a worker changes: a fresh worker never sees it changed


def _report(rank: int, world: int) -> dict:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    seen = list(_TOUCHED)
    _TOUCHED.append(rank)
    return {"rank": rank, "world": world, "sum": float(t), "pid": os.getpid(), "probe": os.environ.get("KILN_PROBE"),
            "cwd": os.getcwd(), "touched_before": seen, "threads": torch.get_num_threads()}


def _fail(rank: int, world: int) -> None:
    # every rank fails, before any collective: which one's error comes back first is a race
    raise ValueError(f"rank {rank} was told to fail")


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_each_rank_runs_in_a_fresh_process_with_the_callers_environment(method, monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_PROBE", f"set-by-the-test-{method}")
    monkeypatch.chdir(tmp_path)
    # two ranks: each spawned one is a new interpreter importing torch (~3 s of CPU)
    first = run_distributed(_report, 2, start_method=method)
    again = run_distributed(_report, 2, start_method=method)
    for results in (first, again):
        assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {2}
        assert {r["sum"] for r in results} == {3.0}  # the group met: 1 + 2
        assert {r["probe"] for r in results} == {f"set-by-the-test-{method}"}
        assert {r["cwd"] for r in results} == {str(tmp_path)} and {r["threads"] for r in results} == {1}
        assert all(r["touched_before"] == [] for r in results)  # nothing left from the call before
    assert not {r["pid"] for r in first} & {r["pid"] for r in again} and os.getpid() not in {r["pid"] for r in first}


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_workers_error_is_raised_with_its_traceback(method):
    with pytest.raises(mp.ProcessRaisedException, match=r"rank [01] was told to fail"):
        run_distributed(_fail, 2, start_method=method, timeout_s=30)


def test_an_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="use spawn or forkserver"):
        run_distributed(_report, 2, start_method="fork")
