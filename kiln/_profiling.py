"""``torch.profiler`` without its noise, for kiln's own measurements (the trainer's tensor
memory, the benchmarks' communication time)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["Profiled", "profiled"]


class Profiled:
    """What :func:`profiled` yields: ``profiler``, torch's (its ``kineto_results`` hold the
    memory events), and :meth:`events`, the operators' events, as ``torch.profiler.profile``
    has them."""

    def __init__(self, profiler: Any) -> None:
        self.profiler = profiler

    def events(self) -> Any:
        return self.profiler.function_events


@contextlib.contextmanager
def profiled(**options: Any) -> Iterator[Profiled]:
    """A profile of CPU activities around the block (``options``: the profiler's own, e.g.
    ``profile_memory=True``); read its events after it.

    This is ``torch.profiler.profile(activities=[CPU])`` without its wrapper, whose start asks
    ``hasattr(torch, "_inductor")``: that imports torch's compiler and dynamo, in every run that
    measures its tensor memory (docs/lab/facts.md, 'What an import costs'); the autograd profiler
    underneath records the same."""
    from torch.autograd.profiler import profile

    prof = profile(use_cpu=True, use_kineto=True, **options)
    with _quiet_stderr():
        prof.__enter__()
    try:
        yield Profiled(prof)
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)


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
