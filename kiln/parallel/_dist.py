"""Process-group set-up and rank queries, for processes started by torchrun.

``torchrun --nproc-per-node N train.py`` (or ``kiln train --nproc N``) sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT; :func:`init_distributed` reads them. Without them
(or with WORLD_SIZE=1) it does nothing, so the same script runs as one plain process.

    >>> from kiln.parallel import init_distributed, rank, world_size, is_main
    >>> init_distributed()          # no torchrun environment: a no-op
    (0, 1)
    >>> rank(), world_size(), is_main()
    (0, 1, True)
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["init_distributed", "rank", "world_size", "is_main", "backend_for", "reducer"]


def backend_for(device: torch.device | str | None = None) -> str:
    """``nccl`` when CUDA is usable (and the device, if given, is CUDA), else ``gloo``."""
    if device is not None and torch.device(device).type != "cuda":
        return "gloo"
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(timeout_s: float = 600) -> tuple[int, int]:
    """Join the process group described by torchrun's environment; return (rank, world_size).

    Backend ``nccl`` if CUDA is available (and the CUDA device is set to LOCAL_RANK first, so
    NCCL's communicator lands on this process's GPU), else ``gloo``. ``timeout_s`` bounds how
    long a collective waits for a straggler before raising instead of hanging forever.
    Idempotent: a second call returns the current (rank, world_size).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    backend = backend_for()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=timeout_s)
    store, rank_, world = next(dist.rendezvous("env://", rank=int(os.environ["RANK"]), world_size=world,
                                               timeout=timeout))
    # After an elastic restart the agent's store still holds the previous attempt's keys, and
    # gloo could read a dead rank's address from them: give every attempt its own key space.
    store = dist.PrefixStore(f"kiln/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=store, rank=rank_, world_size=world, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank (0 outside a process group)."""
    return dist.get_rank(group) if _initialized() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of processes (1 outside a process group)."""
    return dist.get_world_size(group) if _initialized() else 1


def is_main() -> bool:
    """True on global rank 0 (and in a single process): the one that logs and writes files."""
    return rank() == 0


def reducer(group: dist.ProcessGroup | None) -> Any:
    """``reduce(t, op="sum")``: ``t`` summed (or, with op "max", maxed) in place over the ranks
    of ``group``. What kiln.optim, which never communicates itself, is given to complete values
    that other ranks hold the rest of (a ZeRO shard's norms, a pipeline's other stages)."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def reduce(t: torch.Tensor, op: str = "sum") -> None:
        dist.all_reduce(t, op=ops[op], group=group)

    return reduce
