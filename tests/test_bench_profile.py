"""kiln/bench/_profile.py: communication intervals from a profile, their union and overlap."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from kiln.bench._profile import comm_seconds, comm_spans, intersection_seconds, merge, union_seconds


def _covered(intervals: list[tuple[float, float]], grid: int = 1000) -> set[int]:
    return {k for a, b in intervals for k in range(round(a * grid), round(b * grid))}


def test_union_and_intersection_match_a_grid_count():
    rng = random.Random(0)
    for _ in range(200):
        xs = [(a, a + rng.randint(0, 40) / 1000) for a in (rng.randint(0, 200) / 1000 for _ in range(rng.randint(0, 6)))]
        ys = [(a, a + rng.randint(0, 40) / 1000) for a in (rng.randint(0, 200) / 1000 for _ in range(rng.randint(0, 6)))]
        assert union_seconds(xs) == pytest.approx(len(_covered(xs)) / 1000, abs=1e-9)
        assert intersection_seconds(xs, ys) == pytest.approx(len(_covered(xs) & _covered(ys)) / 1000, abs=1e-9)
        merged = merge(xs)
        assert all(b < c for (_, b), (c, _) in zip(merged, merged[1:]))  # disjoint, sorted


def test_edge_cases():
    assert union_seconds([]) == 0.0 and intersection_seconds([], [(0.0, 1.0)]) == 0.0
    assert merge([(0.0, 1.0), (1.0, 2.0)]) == [(0.0, 2.0)]  # touching intervals join
    assert intersection_seconds([(0.0, 1.0)], [(1.0, 2.0)]) == 0.0
    assert intersection_seconds([(0.0, 3.0)], [(0.5, 1.0), (2.0, 2.5)]) == pytest.approx(1.0)


def _event(name: str, start_us: float, end_us: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start_us, end=end_us))


def test_comm_events_are_picked_by_name_and_counted_once_where_they_overlap():
    prof = SimpleNamespace(events=lambda: [
        _event("c10d::allreduce_", 0, 10), _event("gloo:all_reduce", 5, 30),  # op and its worker-thread run
        _event("aten::mm", 0, 100),  # compute
        _event("torch.distributed.ddp.reducer::copy_bucket_to_grad", 40, 50),  # a copy, not communication
        _event("gloo:all_gather", 60, 70),
    ])
    spans, by_name = comm_spans(prof)
    assert len(spans) == 3 and set(by_name) == {"c10d::allreduce_", "gloo:all_reduce", "gloo:all_gather"}
    total, _ = comm_seconds(prof)
    assert total == pytest.approx(40e-6)
