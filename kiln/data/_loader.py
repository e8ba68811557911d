"""DataLoader construction: worker count, pinning, prefetch, worker seeding, distributed sampling.

Reproducibility rules that :func:`build_loader` enforces:

- The sample order depends only on ``seed`` and the epoch: never on the global RNG, the number
  of workers, whether workers persist, or the epochs before it (so a resumed run replays
  epoch ``e`` directly). Torch draws each iterator's worker base seed from the loader's
  generator; a shuffle sampler sharing that generator would make later epochs' order depend
  on ``persistent_workers``.
- Every worker of every rank seeds Python ``random``, NumPy's global RNG and torch with
  :func:`worker_seed` ``(seed, rank, worker_id, epoch)``. Torch's own per-worker seeds are
  the same on every rank that shares a seed, so without this all ranks draw the same
  augmentations.
- With ``world_size > 1`` map-style data goes through ``DistributedSampler``: each rank sees
  a disjoint ``1/world_size`` of every epoch. Iterable data shards itself with
  :func:`shard_iterable` (a loader cannot split a stream it cannot index).
- With ``accumulate=K`` the batch is the *global* batch of one optimizer step, planned by
  :class:`StepSampler`: the ``world_size`` ranks' K micro-batches of a step hold exactly the
  samples of that step's batch in one process with ``accumulate=1``, at every step, across
  epoch ends too (``drop_last`` drops the tail at the level of the global batch, so an epoch is
  a whole number of steps).
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Any, Callable, Iterable, Iterator, Literal, TypeVar, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler, SequentialSampler

__all__ = ["StepSampler", "build_loader", "infinite", "resolve_workers", "worker_seed", "shard_iterable"]

_MAX_AUTO_WORKERS = 8  # past ~8 workers per process the main process, not the workers, is the bottleneck

T = TypeVar("T")


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # respects taskset / cgroup cpusets, unlike os.cpu_count()
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_workers(workers: Union[int, Literal["auto"]]) -> int:
    """The number of worker processes ``build_loader`` starts for ``workers``.

    ``"auto"``: the usable CPUs divided among the processes of this machine (torchrun's
    ``LOCAL_WORLD_SIZE``), capped at 8; 0 (load in the main process) when that leaves a single
    CPU, because one worker on one CPU only adds the cost of moving batches between processes.

    >>> resolve_workers(3)
    3
    """
    if workers == "auto":
        local_procs = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        per_proc = _usable_cpus() // local_procs
        return 0 if per_proc <= 1 else min(per_proc, _MAX_AUTO_WORKERS)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"build_loader: workers={workers!r} must be a non-negative integer or 'auto'")
    return workers


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Fill in ``rank``/``world_size`` from torch.distributed, then torchrun's environment, else 0/1."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            found = dist.get_rank(), dist.get_world_size()
        else:
            found = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        rank = found[0] if rank is None else rank
        world_size = found[1] if world_size is None else world_size
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be an integer in [0, world_size={world_size})")
    return rank, world_size


def worker_seed(seed: int, rank: int, worker_id: int, epoch: int) -> np.random.SeedSequence:
    """The seed sequence of one loader worker; distinct inputs give independent streams.

    >>> a, b = worker_seed(0, 0, 0, 0), worker_seed(0, 1, 0, 0)
    >>> bool((a.generate_state(2) != b.generate_state(2)).any())
    True
    """
    # SeedSequence hashes the whole tuple, so (seed=1, rank=0) and (seed=0, rank=1) do not
    # collide as they would with seed + rank.
    return np.random.SeedSequence([seed % 2**64, rank, worker_id, epoch])


def _torch_seed(seq: np.random.SeedSequence) -> int:
    return int(seq.generate_state(1, np.uint64)[0] >> np.uint64(1))  # 63 bits: manual_seed takes an int64


class _SeedWorker:
    """``worker_init_fn``: seeds ``random``, NumPy and torch in a worker from :func:`worker_seed`.

    A picklable object rather than a closure, so it also works with the spawn start method.
    """

    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank = seed, rank
        self.epoch = 0  # set by _Loader before it starts workers

    def __call__(self, worker_id: int) -> None:
        words = [int(w) for w in worker_seed(self.seed, self.rank, worker_id, self.epoch).generate_state(4)]  # uint32
        random.seed(words[0] << 32 | words[1])
        np.random.seed(words)  # the legacy global RNG, which np.random.rand() and most augmentation code use
        torch.manual_seed((words[2] << 32 | words[3]) >> 1)  # 63 bits: manual_seed takes an int64


class _Loader(DataLoader):
    """A DataLoader that knows its epoch: iterating it tells the sampler and the worker seeder.

    Each ``iter(loader)`` runs epoch ``loader.epoch`` and then counts it up, so a plain
    ``for epoch in range(n): for batch in loader`` reshuffles a ``DistributedSampler`` every
    epoch. ``set_epoch(e)`` jumps (e.g. when resuming). Workers started at epoch ``e`` are
    seeded with it; persistent workers are started once and their streams run on.
    """

    epoch: int = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for sampler in (self.sampler, self.batch_sampler):
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
        if isinstance(self.worker_init_fn, _SeedWorker):
            self.worker_init_fn.epoch = self.epoch
        self.epoch += 1
        return super().__iter__()


class StepSampler(Sampler[list[int]]):
    """This rank's micro-batches, planned as whole optimizer steps of ``batch_size`` samples.

    Epoch ``e`` permutes the ``n`` indices as ``DistributedSampler`` does (``randperm`` seeded
    with ``seed + e``; ``arange`` without shuffling) and cuts the permutation into global
    batches of ``batch_size``. Of step ``s``'s batch ``G``, rank ``r`` takes ``G[r::world_size]``
    and splits it into ``accumulate`` consecutive micro-batches. So the micro-batches of all
    ranks and micro-steps of a step hold exactly the samples of one process's step with
    ``accumulate=1``, at every step of every epoch: the layout changes how a step is computed,
    never which samples it sees, and a run resumed in another layout continues on the same ones.

    ``drop_last=True`` drops the ``n % batch_size`` samples left over at an epoch's end (the
    same samples whatever the layout); ``drop_last=False`` keeps them as a smaller last step,
    split as evenly as possible: :meth:`step_samples` says how many samples a step holds over
    all ranks, so that each micro-batch's loss can be weighted by its share.

    >>> sampler = StepSampler(10, 4, accumulate=2, shuffle=False)
    >>> list(sampler), sampler.steps_per_epoch
    ([[0, 1], [2, 3], [4, 5], [6, 7]], 2)
    >>> [list(StepSampler(10, 4, rank=r, world_size=2, shuffle=False, drop_last=False)) for r in (0, 1)]
    [[[0, 2], [4, 6], [8]], [[1, 3], [5, 7], [9]]]
    """

    def __init__(self, n: int, batch_size: int, *, accumulate: int = 1, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True) -> None:
        for name, value in (("batch_size", batch_size), ("accumulate", accumulate)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"StepSampler: {name}={value!r} must be a positive integer")
        parts = accumulate * world_size
        if batch_size % parts:
            raise ValueError(f"StepSampler: batch_size={batch_size} is not divisible by world_size={world_size} x "
                             f"accumulate={accumulate}; every rank needs whole micro-batches")
        full, tail = divmod(n, batch_size)
        if tail and not drop_last and tail < parts:
            raise ValueError(
                f"StepSampler: the last step of each epoch would hold {tail} samples ({n} % {batch_size}), fewer "
                f"than the {world_size} rank(s) x {accumulate} micro-batch(es) that split it, so a micro-batch "
                "would be empty; set drop_last=True or choose a batch size that divides the data set better")
        self.sizes = [batch_size] * full + ([tail] if tail and not drop_last else [])
        if not self.sizes:
            raise ValueError(f"StepSampler: {n} samples make no batch of {batch_size} with drop_last=True; "
                             "lower the batch size or set drop_last=False")
        self.n, self.accumulate, self.rank, self.world_size = n, accumulate, rank, world_size
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    @property
    def steps_per_epoch(self) -> int:
        return len(self.sizes)

    def step_samples(self, step: int) -> int:
        """Samples in step ``step`` of an epoch (0-based), over every rank and micro-batch."""
        return self.sizes[step]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.sizes) * self.accumulate  # micro-batches of this rank per epoch

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)  # DistributedSampler's order
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        order = order.tolist()  # (Python lists from here: a tensor op per step costs microseconds)
        start = 0
        for size in self.sizes:
            mine = order[start + self.rank:start + size:self.world_size]
            start += size
            # torch.tensor_split's cut: the first len % accumulate micro-batches one longer
            each, longer = divmod(len(mine), self.accumulate)
            at = 0
            for k in range(self.accumulate):
                stop = at + each + (k < longer)
                yield mine[at:stop]
                at = stop


def _worker_options(workers: Union[int, Literal["auto"]], pin_memory: Union[bool, Literal["auto"]],
                    persistent_workers: bool | None, prefetch_factor: int | None) -> tuple[int, bool, bool, int | None]:
    """build_loader's worker settings, checked and resolved: (workers, pin_memory,
    persistent_workers, prefetch_factor)."""
    num_workers = resolve_workers(workers)
    if pin_memory == "auto":
        pin_memory = torch.cuda.is_available()
    elif not isinstance(pin_memory, bool):
        raise ValueError(f"build_loader: pin_memory={pin_memory!r} must be true, false or 'auto'")
    if prefetch_factor is not None and (
        not isinstance(prefetch_factor, int) or isinstance(prefetch_factor, bool) or prefetch_factor < 1
    ):
        raise ValueError(f"build_loader: prefetch_factor={prefetch_factor!r} must be a positive integer or None")
    if num_workers == 0:
        if workers == 0 and prefetch_factor is not None:
            raise ValueError(
                f"build_loader: prefetch_factor={prefetch_factor} needs worker processes (workers > 0 or 'auto'); "
                "the main process loads one batch at a time"
            )
        if workers == 0 and persistent_workers:
            raise ValueError("build_loader: persistent_workers=True needs worker processes (workers > 0 or 'auto')")
        return 0, pin_memory, False, None
    return num_workers, pin_memory, True if persistent_workers is None else persistent_workers, prefetch_factor


def _batching(dataset: Dataset, batch_size: int, shuffle: bool, seed: int, drop_last: bool, rank: int,
              world_size: int, accumulate: int | None) -> dict[str, Any]:
    """build_loader's batching arguments for the DataLoader: a StepSampler's micro-batches of
    whole steps (``accumulate`` given, map-style data), or a batch size and a sampler."""
    if accumulate is not None and isinstance(dataset, IterableDataset):
        if not isinstance(accumulate, int) or accumulate < 1 or batch_size % (accumulate * world_size):
            raise ValueError(f"build_loader: batch_size={batch_size} is not divisible by world_size={world_size} x "
                             f"accumulate={accumulate}")
        batch_size //= accumulate * world_size  # a stream: this rank's micro-batches, in stream order
    elif accumulate is not None:
        return dict(batch_sampler=StepSampler(len(dataset), batch_size, accumulate=accumulate, rank=rank,
                                              world_size=world_size, shuffle=shuffle, seed=seed,
                                              drop_last=drop_last))
    if isinstance(dataset, IterableDataset):
        if shuffle:
            raise ValueError(
                "build_loader: shuffle=True is not possible for an IterableDataset (it has no indices); "
                "shuffle inside the dataset, e.g. with a buffer seeded from torch.utils.data.get_worker_info().seed"
            )
        # The loader cannot split a stream; the dataset must (kiln.data.shard_iterable).
        sampler = None
    elif world_size > 1 or shuffle:
        # One process shuffles exactly like a rank of N: the epoch's permutation depends only on
        # (seed, epoch), and rank r of N takes every N-th index of it. So the N ranks' micro-batches
        # of a step together hold the very samples of the one-process batch, and a run trains the
        # same model whatever the number of processes (and a resumed run replays epoch e directly).
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
    else:
        sampler = SequentialSampler(dataset)
    return dict(batch_size=batch_size, sampler=sampler, drop_last=drop_last)


def build_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    drop_last: bool = False,
    workers: Union[int, Literal["auto"]] = 0,
    pin_memory: Union[bool, Literal["auto"]] = False,
    persistent_workers: bool | None = None,
    prefetch_factor: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    collate_fn: Callable[[list], Any] | None = None,
    accumulate: int | None = None,
) -> DataLoader:
    """A DataLoader whose order and worker randomness are fixed by ``seed`` (and the epoch).

    ``workers``: worker processes, or ``"auto"`` (see :func:`resolve_workers`).
    ``pin_memory``: page-locked batches for faster host-to-GPU copies; ``"auto"``: when CUDA is available.
    ``persistent_workers``: keep workers alive between epochs (default: whenever there are
    workers; re-forking them costs seconds per epoch on small datasets).
    ``prefetch_factor``: batches each worker loads ahead (None: torch's default, 2).
    ``rank``/``world_size``: this process's shard of map-style data (default: from
    torch.distributed if initialized, else torchrun's RANK/WORLD_SIZE, else one process).
    With ``drop_last=False`` a rank's shard is padded with repeated samples so that every rank
    runs the same number of steps; with ``drop_last=True`` the tail is dropped instead.
    ``accumulate``: micro-batches per optimizer step. When given, ``batch_size`` is the global
    batch of one step over all ranks, and the loader yields this rank's micro-batches of
    ``batch_size / (world_size * accumulate)`` samples as planned by :class:`StepSampler`
    (``loader.batch_sampler``): an epoch is a whole number of steps, and every step holds the
    samples of the one-process step whatever the layout. Iterable data cannot be planned: it
    gets micro-batches of that size from its own stream.

    With ``workers="auto"`` resolving to 0 (one CPU), ``persistent_workers`` and
    ``prefetch_factor`` are ignored, so one config runs on every machine; with an explicit
    ``workers=0`` they are an error.

    >>> from torch.utils.data import TensorDataset
    >>> loader = build_loader(TensorDataset(torch.arange(6)), 4, shuffle=True, seed=0)
    >>> [len(b[0]) for b in loader]
    [4, 2]
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"build_loader: batch_size={batch_size!r} must be a positive integer")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"build_loader: seed={seed!r} must be an integer")
    num_workers, pin_memory, persistent_workers, prefetch_factor = _worker_options(
        workers, pin_memory, persistent_workers, prefetch_factor)
    rank, world_size = _rank_world(rank, world_size)
    batching = _batching(dataset, batch_size, shuffle, seed, drop_last, rank, world_size, accumulate)
    # Only feeds torch's per-iterator worker base seed (get_worker_info().seed; _SeedWorker then
    # reseeds the RNGs): without it torch would draw that seed from, and so advance, the global
    # RNG every epoch. Per rank, so that get_worker_info().seed differs across ranks too.
    generator = torch.Generator().manual_seed(_torch_seed(np.random.SeedSequence([seed % 2**64, rank], spawn_key=(1,))))
    return _Loader(
        dataset,
        **batching,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        worker_init_fn=_SeedWorker(seed, rank) if num_workers > 0 else None,
        generator=generator,
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
    )


def shard_iterable(iterable: Iterable[T], rank: int | None = None, world_size: int | None = None) -> Iterator[T]:
    """This (rank, loader worker)'s share of ``iterable``: every ``n``-th item, ``n`` = ranks x workers.

    Call it inside ``IterableDataset.__iter__``; together all workers of all ranks yield each
    item exactly once. ``rank``/``world_size`` default as in :func:`build_loader`. Every shard
    still reads the whole stream and skips the others' items, so make reading cheap (e.g.
    iterate file names and open only your own).

    >>> class Numbers(torch.utils.data.IterableDataset):
    ...     def __iter__(self):
    ...         return shard_iterable(range(6), rank=1, world_size=2)
    >>> list(Numbers())
    [1, 3, 5]
    """
    rank, world_size = _rank_world(rank, world_size)
    info = torch.utils.data.get_worker_info()
    worker_id, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return itertools.islice(iterable, rank * num_workers + worker_id, None, world_size * num_workers)


def infinite(loader: DataLoader, start_epoch: int = 0) -> Iterator[tuple[int, Any]]:
    """Yield ``(epoch, batch)`` forever, starting at ``start_epoch`` and counting up at each pass.

    Resuming at ``start_epoch=e`` gives epoch ``e``'s order and worker seeds, as the first run had.

    >>> from torch.utils.data import TensorDataset
    >>> stream = infinite(build_loader(TensorDataset(torch.arange(3)), 2, shuffle=False, seed=0))
    >>> [(epoch, batch[0].tolist()) for epoch, batch in (next(stream) for _ in range(3))]
    [(0, [0, 1]), (0, [2]), (1, [0, 1])]
    """
    epoch = start_epoch
    while True:
        # Samplers such as DistributedSampler shuffle per epoch only when told the epoch;
        # build_loader's loaders pass it on to their sampler and worker seeds themselves.
        set_epoch = getattr(loader, "set_epoch", None) or getattr(getattr(loader, "sampler", None), "set_epoch", None)
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
