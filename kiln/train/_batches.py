"""The stream of micro-batches a run consumes, resumable at any point."""

from __future__ import annotations

from typing import Any


class Batches:
    """``next()`` gives ``(epoch, micro_batch)`` forever. Built at ``(epoch, position)`` it
    replays the first ``position`` batches of that epoch, so a resumed run sees exactly the
    batches an uninterrupted one would (the order depends only on the seed and the epoch)."""

    def __init__(self, loader: Any, epoch: int = 0, position: int = 0):
        self.loader = loader
        if position >= len(loader):  # saved at the very end of an epoch
            epoch, position = epoch + 1, 0
        self.epoch, self.position = epoch, 0
        self._it = self._start()
        for _ in range(position):
            next(self)

    def _start(self) -> Any:
        set_epoch = getattr(self.loader, "set_epoch", None) or getattr(self.loader.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        return iter(self.loader)

    def __next__(self) -> tuple[int, Any]:
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.position = self.epoch + 1, 0
            self._it = self._start()
            batch = next(self._it)
        self.position += 1
        return self.epoch, batch
