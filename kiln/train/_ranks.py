"""What changes when several processes train together: who writes, what is averaged, what is
gathered. In one process every function here is a no-op or an identity."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.parallel import check_parallel_config

if TYPE_CHECKING:
    from kiln.parallel import Layout


def check_layout(cfg: Any, world: int) -> "Layout":
    """The dp x tp x pp layout of ``world`` processes, checked against the batch and the model
    before anything is built; raises ConfigError naming the numbers."""

    return check_parallel_config(cfg, world)


def broadcast_path(path: Path | None) -> Path:
    """Rank 0's run directory, on every rank (a no-op in one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return path
    box = [str(path) if path is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


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

    def open_metrics(self, fields: list[str]) -> None:
        return None

    def log_metrics(self, row: dict[str, Any]) -> None:
        return None

    def truncate_metrics(self, after_step: int) -> None:
        return None

    def stopped(self, exc: BaseException) -> None:
        return None

    def close(self) -> None:
        return None
