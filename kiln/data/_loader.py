"""DataLoader construction with reproducible shuffling, and an endless batch stream."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["build_loader", "infinite"]


def build_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    drop_last: bool = False,
    workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader whose shuffling order is fixed by ``seed``.

    The loader owns a ``torch.Generator`` seeded with ``seed``: each epoch draws a new
    permutation from it, so the sequence of epochs is the same in every run with that seed,
    independent of the global RNG.

    >>> from torch.utils.data import TensorDataset
    >>> loader = build_loader(TensorDataset(torch.arange(6)), 4, shuffle=True, seed=0)
    >>> [len(b[0]) for b in loader]
    [4, 2]
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"build_loader: batch_size={batch_size!r} must be a positive integer")
    if not isinstance(workers, int) or workers < 0:
        raise ValueError(f"build_loader: workers={workers!r} must be a non-negative integer")
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        drop_last=drop_last,
        num_workers=workers,
        pin_memory=pin_memory,
        # Re-forking workers every epoch costs seconds on small datasets.
        persistent_workers=workers > 0,
    )


def infinite(loader: DataLoader) -> Iterator[tuple[int, Any]]:
    """Yield ``(epoch, batch)`` forever, starting at epoch 0 and counting up at each pass.

    >>> from torch.utils.data import TensorDataset
    >>> stream = infinite(build_loader(TensorDataset(torch.arange(3)), 2, shuffle=False, seed=0))
    >>> [(epoch, batch[0].tolist()) for epoch, batch in (next(stream) for _ in range(3))]
    [(0, [0, 1]), (0, [2]), (1, [0, 1])]
    """
    epoch = 0
    while True:
        # Samplers such as DistributedSampler shuffle per epoch only when told the epoch.
        set_epoch = getattr(getattr(loader, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield epoch, batch
        if empty:
            # Otherwise this loop would spin forever without yielding.
            raise ValueError("infinite: the loader yielded no batches (empty dataset, or drop_last with too few samples)")
        epoch += 1
