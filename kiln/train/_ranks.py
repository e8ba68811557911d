"""What changes when several processes train together: who writes, what is averaged, what is
gathered. In one process every function here is a no-op or an identity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def data_parallel_size(cfg: Any, world: int) -> int:
    from kiln.config import ConfigError

    dp = cfg.parallel.dp if cfg.parallel.dp is not None else world
    if dp != world:
        raise ConfigError(f"parallel.dp={dp} but {world} process(es) were started; start dp processes "
                          f"(kiln train ... --nproc {dp}) or set parallel.dp={world}")
    if cfg.data.batch_size % (dp * cfg.train.accumulate):
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} is not divisible by parallel.dp={dp} x "
            f"train.accumulate={cfg.train.accumulate}; each rank needs a whole micro-batch"
        )
    return dp


def broadcast_path(path: Path | None) -> Path:
    """Rank 0's run directory, on every rank (a no-op in one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return path
    box = [str(path) if path is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def gather(obj: Any, world: int) -> list[Any]:
    """``obj`` from every rank, in rank order (a one-element list in one process)."""
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def mean_over_ranks(x: torch.Tensor, world: int) -> torch.Tensor:
    if world == 1:
        return x
    import torch.distributed as dist

    x = x.detach().clone()
    dist.all_reduce(x)
    return x / world


class NullRun:
    """The run directory as seen from ranks other than 0: it writes nothing."""

    def __init__(self, path: Path):
        self.path, self.summary = path, {}

    def write_summary(self, **updates: Any) -> None:
        self.summary.update(updates)

    def save_checkpoint(self, name: str, state: dict[str, Any]) -> None:
        return None

    def open_metrics(self, fields: list[str]) -> None:
        return None

    def log_metrics(self, row: dict[str, Any]) -> None:
        return None

    def truncate_metrics(self, after_step: int) -> None:
        return None

    def close(self) -> None:
        return None
