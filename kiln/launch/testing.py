"""Run a function in N gloo processes on this machine (tests and benchmarks).

    >>> from kiln.launch.testing import run_distributed
    >>> def fn(rank, world):            # must be importable: defined at module level
    ...     return rank * 10
    >>> run_distributed(fn, 2)          # doctest: +SKIP
    [0, 10]

Each worker joins a fresh gloo group on 127.0.0.1 (a free port picked here), runs with one
intra-op thread (N processes share the cores), and its return value comes back through a
file; an exception in any worker is raised here with the worker's traceback.

Workers are new interpreters (``spawn``), each importing torch and kiln before it runs ``fn``:
seconds of CPU a worker (docs/lab/facts.md, 'What an import costs'). ``start_method="forkserver"``
(or ``KILN_START_METHOD=forkserver``, which kiln's test suite sets) forks them instead from one
server process per caller that has imported torch, torch.distributed and kiln's trainer once: each
worker is still a fresh process (no state from an earlier call), started in a fraction of a
second. The benchmarks keep ``spawn``: a forked worker shares the server's pages, which would
change what they measure.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.launch import WORKER_PRELOAD


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple,
            threads: int, timeout_s: float, backend: str = "gloo", environ: dict[str, str] | None = None,
            cwd: str | None = None) -> None:
    if environ is not None:  # the caller's, as a spawned worker has them (a forkserver's are its own)
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd or ".")
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU a rank
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        # no rank may tear down its connections while another still waits on it (gloo aborts)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# what a forkserver imports once, before it forks the workers: torch.distributed and kiln.parallel,
# then kiln's launcher's fork server's list (kiln.launch.WORKER_PRELOAD), so that a process
# using both has one server for both; that list ends with kiln.launch._gc_freeze, which freezes the rest
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "kiln.parallel", *WORKER_PRELOAD]


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1,
                    timeout_s: float = 120, backend: str = "gloo", start_method: str | None = None) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` new gloo processes (``backend=
    "nccl"``: NCCL, rank r on GPU r); return the list of their return values (by rank). ``fn``
    and ``args`` must be picklable. ``start_method``: ``spawn`` (default) or ``forkserver``
    (default where ``KILN_START_METHOD`` names it; see the module's docstring)."""
    method = start_method or os.environ.get("KILN_START_METHOD") or "spawn"
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method {method!r}: use spawn or forkserver")
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # (read when the server first starts)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args, threads, timeout_s, backend,
                                          dict(os.environ), os.getcwd()),
                           nprocs=world_size, join=True, start_method=method)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]
