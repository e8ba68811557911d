"""Run a function in N gloo processes on this machine (tests and benchmarks).

    >>> from kiln.parallel.testing import run_distributed
    >>> def fn(rank, world):            # must be importable: defined at module level
    ...     return rank * 10
    >>> run_distributed(fn, 2)          # doctest: +SKIP
    [0, 10]

Each worker joins a fresh gloo group on 127.0.0.1 (a free port picked here), runs with one
intra-op thread (N processes share the cores), and its return value comes back through a
file; an exception in any worker is raised here with the worker's traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple,
            threads: int, timeout_s: float, backend: str = "gloo") -> None:
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


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1,
                    timeout_s: float = 120, backend: str = "gloo") -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes (``backend=
    "nccl"``: NCCL, rank r on GPU r); return the list of their return values (by rank). ``fn``
    and ``args`` must be picklable."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, free_port(), out_dir, fn, args, threads, timeout_s, backend),
                 nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]
