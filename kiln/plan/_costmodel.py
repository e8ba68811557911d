"""How long a training step takes, predicted from its plan and this machine's measured speeds:
the cost model that ``kiln tune --memory-budget`` and ``parallel.auto=true`` rank candidate
configurations with before any of them runs.

A rank's step is charged for what its plan (:func:`kiln.plan.plan`) counted in the traced step:

    seconds = bubble * (flops / matmul_flops_per_s[dtype] + ops * seconds_per_op * (1/2 if compiled))
              + collective_bytes / collective_bytes_per_s + collectives * collective_latency

``bubble`` is what a pipeline's idle share stretches the compute by, ``1 / (1 - idle)``: for
GPipe and 1F1B (m + pp - 1) / m for m micro-batches, for the others the idle share of torch's
order of their schedule at unit costs (:func:`kiln.parallel._pp.schedule_bubble`: smaller for
interleaved 1F1B, smaller still for the zero-bubble ones); the step takes as long as its
slowest rank. The speeds are measured once per machine, thread count and number of
local processes, in a second or two (a matmul in fp32 and bf16, a small model's forward and
backward for the cost of one operator, and for several processes a gloo all-reduce of 4 bytes and
of 4 MB between them), and cached (:mod:`kiln._cache`). The operator term matters on a CPU with
small models, where per-operator overhead, not arithmetic, sets the pace: it is what makes more
micro-batches, recomputation and tensor parallelism cost time there. The halving under
``train.compile`` is a guess, not a measurement (inductor fuses the elementwise operators that
make most of the count); the tuner's timed trials are what decide.

    >>> speeds = Speeds(flops_per_s={"fp32": 1e11, "bf16": 1e10}, seconds_per_op=1e-5,
    ...                 collective_bytes_per_s=1e9, collective_latency_s=1e-4)
    >>> round(speeds.step_seconds(flops=1e9, ops=1000, collectives=0, collective_bytes=0), 3)
    0.02
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kiln import _cache
from kiln.hardware.flops import matmul_flops

__all__ = ["Speeds", "measure_speeds", "pipeline_stretch", "predict_seconds", "threads_per_process"]

CACHE = "machine_speeds"
COMPILED_OP_SHARE = 0.5  # the share of operator overhead left under torch.compile (a guess: see above)


@dataclass
class Speeds:
    """This machine's measured speeds, for one process among ``processes`` local ones."""

    flops_per_s: dict[str, float]  # a square matmul's FLOP/s by dtype: fp32, bf16
    seconds_per_op: float  # one operator of a small model's forward and backward, autograd included
    collective_bytes_per_s: float  # bytes handed to an all-reduce, per second (0: one process)
    collective_latency_s: float  # one small all-reduce

    def step_seconds(self, *, flops: float, ops: int, collectives: int, collective_bytes: int,
                     dtype: str = "fp32", compiled: bool = False, bubble: float = 1.0) -> float:
        compute = flops / self.flops_per_s[dtype] + ops * self.seconds_per_op * (COMPILED_OP_SHARE if compiled else 1)
        comm = collectives * self.collective_latency_s
        if collective_bytes:
            comm += collective_bytes / self.collective_bytes_per_s
        return bubble * compute + comm


def threads_per_process(nproc: int) -> int:
    """The intra-op threads each of ``nproc`` local processes trains with: torchrun sets
    OMP_NUM_THREADS=1 for several; one process has torch's default."""
    return 1 if nproc > 1 else torch.get_num_threads()


@functools.lru_cache(maxsize=None)
def pipeline_stretch(schedule: str, pp: int, microbatches: int) -> float:
    """``1 / (1 - idle)``: how much longer than its compute a rank's pipeline step takes, from the
    schedule's idle share at unit costs (1.0 without a pipeline).

        >>> pipeline_stretch("1f1b", 2, 4)   # (m + pp - 1) / m
        1.25
    """
    if pp <= 1:
        return 1.0
    from kiln.parallel import schedule_bubble

    idle = schedule_bubble(schedule, pp, microbatches)
    return round(1.0 / (1.0 - sum(idle) / len(idle)), 12)  # (unit costs: exact fractions, less the round-off)


def predict_seconds(planned: Any, speeds: Speeds, *, precision: str, compiled: bool, microbatches: int,
                    schedule: str = "1f1b") -> float:
    """Seconds of one optimizer step of ``planned`` (a :class:`kiln.plan.Plan`): its slowest rank;
    ``schedule``: its pipeline schedule (``parallel.pp_schedule``)."""
    dtype = "bf16" if precision.startswith("bf16") else "fp32"
    bubble = pipeline_stretch(schedule, planned.layout.pp, microbatches)
    return max(speeds.step_seconds(flops=r.flops, ops=r.ops, collectives=r.collectives,
                                   collective_bytes=r.collective_bytes, dtype=dtype, compiled=compiled,
                                   bubble=bubble)
               for r in planned.ranks)


# --------------------------------------------------------------------------- measuring


def _key(nproc: int, threads: int) -> str:
    from kiln.hardware import machine_line

    return f"{machine_line()} | threads {threads} | processes {nproc} | torch {torch.__version__}"


def measure_speeds(nproc: int, *, cache: bool = True) -> Speeds:
    """This machine's speeds for one of ``nproc`` local processes (cached: see the module)."""
    threads = threads_per_process(nproc)
    key = _key(nproc, threads)
    if cache:
        found = _cache.get(CACHE, key)
        if found:
            try:
                return Speeds(**found)
            except TypeError:
                pass  # an entry of another version: measure again
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        speeds = Speeds(flops_per_s={"fp32": _matmul(torch.float32), "bf16": _matmul(torch.bfloat16)},
                        seconds_per_op=_op_seconds(), collective_bytes_per_s=0.0, collective_latency_s=0.0)
    finally:
        torch.set_num_threads(saved)
    if nproc > 1:
        speeds.collective_latency_s, speeds.collective_bytes_per_s = _collectives(nproc)
    if cache:
        _cache.put(CACHE, key, asdict(speeds))
    return speeds


def _best_seconds(fn: Any, budget_s: float = 0.3, least: int = 3) -> float:
    """The fastest of repeated calls of ``fn`` (the least disturbed by a shared machine)."""
    fn()
    best, started, n = float("inf"), time.perf_counter(), 0
    while n < least or time.perf_counter() - started < budget_s:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        n += 1
    return best


def _fastest_of(fn: Any, n: int) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _matmul(dtype: torch.dtype, n: int = 256) -> float:
    """A small model's matmul speed: the fastest of 0.3 s of ``n`` x ``n`` matmuls (the MFU's
    peak, :func:`kiln.hardware.flops.cpu_peak`, times the same matmul at 1024)."""
    return matmul_flops(dtype, n, repeats=100_000, budget_s=0.3)


def _op_seconds() -> float:
    """Seconds per operator of a small model's forward and backward: overhead, not arithmetic."""
    from torch.utils._python_dispatch import TorchDispatchMode

    with torch.random.fork_rng(devices=[]):  # the global random stream stays the run's
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                    torch.nn.Linear(16, 16))
        x = torch.randn(8, 16)

    def step() -> None:
        model(x).square().mean().backward()

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return _best_seconds(lambda: [step() for _ in range(10)]) / (10 * Count.ops)


def _collectives(nproc: int) -> tuple[float, float]:
    """(latency of a 4-byte all-reduce, bytes per second of a 4 MB one) between ``nproc`` local
    gloo processes, each on one thread."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="kiln-speeds-") as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(_collective_worker, args=(nproc, os.path.join(tmp, "store"), out), nprocs=nproc,
                           start_method="spawn")
        latency, seconds = (float(v) for v in open(out).read().split())
    return latency, 4 * 2**20 / max(seconds - latency, 1e-9)


def _collective_worker(rank: int, nproc: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=nproc)
    try:
        small, large = torch.zeros(1), torch.zeros(2**20)
        # a fixed number of calls (a loop that stops by time could stop at another count on
        # another rank, and wait forever in its last all-reduce)
        latency = _fastest_of(lambda: dist.all_reduce(small), 30)
        seconds = _fastest_of(lambda: dist.all_reduce(large), 8)
        if rank == 0:
            with open(out, "w") as f:
                f.write(f"{latency} {seconds}")
    finally:
        dist.destroy_process_group()
