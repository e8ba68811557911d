"""Communication time from ``torch.profiler`` (CPU activities) for the benchmarks that run
processes on gloo (``kiln bench parallel``, ``kiln bench ddp``): time intervals of the
collectives' events on any thread, their union, and their overlap with other intervals. The
profiler itself, quiet, is :func:`kiln._profiling.profiled`."""

from __future__ import annotations

from typing import Any

# On gloo (torch 2.13) a collective shows as its op on the calling thread (``c10d::allreduce_``,
# ``c10d::reduce_``, ...: the launch, or the whole call when synchronous) and as its execution
# on one of gloo's worker threads (``gloo:all_reduce``, ...: waits for the peer included).
# DDP's reducer issues the same ops; its ``torch.distributed.ddp.reducer::*`` events are
# copies into and out of its buckets, not communication. NCCL's would be ``nccl:*``.
COMM_PREFIXES = ("c10d::", "gloo:", "_c10d_functional::", "nccl:")


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merge(intervals))


def intersection_seconds(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of (union of xs) ∩ (union of ys)."""
    xs, ys = merge(xs), merge(ys)
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:  # the one that ends first cannot meet anything further on
            i += 1
        else:
            j += 1
    return total


def span(event: Any) -> tuple[float, float]:
    return event.time_range.start / 1e6, event.time_range.end / 1e6  # microseconds -> seconds


def comm_spans(prof: Any) -> tuple[list[tuple[float, float]], dict[str, float]]:
    """The intervals (seconds) of every communication event on this rank, any thread, and the
    summed seconds per event name (for the JSON)."""
    spans, by_name = [], {}
    for e in prof.events():
        if e.name.startswith(COMM_PREFIXES):
            a, b = span(e)
            spans.append((a, b))
            by_name[e.name] = by_name.get(e.name, 0.0) + (b - a)
    return spans, by_name


def comm_seconds(prof: Any) -> tuple[float, dict[str, float]]:
    """Seconds during which any communication event was running on this rank (union over
    threads), and the summed seconds per event name."""
    spans, by_name = comm_spans(prof)
    return union_seconds(spans), by_name
