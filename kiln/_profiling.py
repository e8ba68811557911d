"""``torch.profiler`` without its noise, for kiln's own measurements (the trainer's tensor
memory, the benchmarks' communication time)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["profiled"]


@contextlib.contextmanager
def profiled(**options: Any) -> Iterator[Any]:
    """``torch.profiler.profile`` of CPU activities around the block (``options``: the
    profiler's own, e.g. ``profile_memory=True``); read its events after it."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], **options)
    with _quiet_stderr():
        prof.start()
    try:
        yield prof
    finally:
        with _quiet_stderr():
            prof.stop()


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    # kineto prints two "USDT: ... profiler_start/stop" lines per profile to fd 2 from C++
    # (no switch turns them off); one run of a benchmark would print hundreds
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
