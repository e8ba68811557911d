"""Tests for kiln.data's loader options: workers, pinning, prefetch, worker seeding, sharding; bench smoke."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, TensorDataset

import kiln.data._loader as loader_mod
from kiln.data import build_loader, infinite, resolve_workers, shard_iterable, worker_seed


class RandomAugment(Dataset):
    """Returns (index, worker id, np.random.rand(), random.random(), torch.rand(1)): augmentation draws."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        worker = -1 if info is None else info.id
        return torch.tensor([i, worker, np.random.rand(), random.random(), torch.rand(1).item()], dtype=torch.float64)


def _stream(loader, epochs: int = 2) -> torch.Tensor:
    """(epochs * N, 5) rows of RandomAugment, in the order the loader yields them."""
    return torch.cat([torch.cat(list(loader)) for _ in range(epochs)])


# --------------------------------------------------------------------------- options


def test_resolve_workers_auto(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for cpus, expected in [(1, 0), (2, 2), (6, 6), (64, 8)]:
        monkeypatch.setattr(loader_mod, "_usable_cpus", lambda cpus=cpus: cpus)
        assert resolve_workers("auto") == expected, cpus
    # CPUs are shared among the processes torchrun started on this machine.
    monkeypatch.setattr(loader_mod, "_usable_cpus", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_workers("auto") == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resolve_workers("auto") == 2
    assert resolve_workers(3) == 3
    for bad in (-1, 1.5, "four", True):
        with pytest.raises(ValueError, match="workers="):
            resolve_workers(bad)


def test_loader_options_reach_the_dataloader(monkeypatch):
    ds = TensorDataset(torch.arange(8))
    loader = build_loader(ds, 2, shuffle=False, seed=0, workers=2, prefetch_factor=3)
    assert loader.num_workers == 2 and loader.persistent_workers and loader.prefetch_factor == 3
    assert not build_loader(ds, 2, shuffle=False, seed=0, workers=2, persistent_workers=False).persistent_workers
    plain = build_loader(ds, 2, shuffle=False, seed=0)
    assert plain.num_workers == 0 and not plain.persistent_workers and plain.prefetch_factor is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert build_loader(ds, 2, shuffle=False, seed=0, pin_memory="auto").pin_memory is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert build_loader(ds, 2, shuffle=False, seed=0, pin_memory="auto").pin_memory is True
    with pytest.raises(ValueError, match="pin_memory='yes'"):
        build_loader(ds, 2, shuffle=False, seed=0, pin_memory="yes")


def test_worker_only_options_need_workers(monkeypatch):
    ds = TensorDataset(torch.arange(8))
    with pytest.raises(ValueError, match="prefetch_factor=4 needs worker processes"):
        build_loader(ds, 2, shuffle=False, seed=0, prefetch_factor=4)
    with pytest.raises(ValueError, match="persistent_workers=True needs worker processes"):
        build_loader(ds, 2, shuffle=False, seed=0, workers=0, persistent_workers=True)
    with pytest.raises(ValueError, match="prefetch_factor=0"):
        build_loader(ds, 2, shuffle=False, seed=0, workers=1, prefetch_factor=0)
    # "auto" on a one-CPU machine means no workers; the same config must still run there.
    monkeypatch.setattr(loader_mod, "_usable_cpus", lambda: 1)
    loader = build_loader(ds, 2, shuffle=False, seed=0, workers="auto", prefetch_factor=4, persistent_workers=True)
    assert loader.num_workers == 0 and not loader.persistent_workers and loader.prefetch_factor is None


def test_order_independent_of_workers_over_epochs():
    """Torch draws worker base seeds from the loader's generator; that must not move the shuffle."""
    ds = TensorDataset(torch.arange(40))
    orders = []
    for workers, persistent in [(0, None), (2, True), (2, False)]:
        loader = build_loader(ds, 4, shuffle=True, seed=9, workers=workers, persistent_workers=persistent)
        orders.append([[i for (b,) in loader for i in b.tolist()] for _ in range(3)])
    assert orders[0] == orders[1] == orders[2]
    assert orders[0][0] != orders[0][1]


def test_loader_does_not_touch_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    for _ in build_loader(TensorDataset(torch.arange(10)), 3, shuffle=True, seed=0):
        pass
    assert torch.equal(torch.rand(3), expected)


# --------------------------------------------------------------------------- worker seeding


def test_worker_seed_is_distinct_per_component():
    states = {tuple(worker_seed(*key).generate_state(4)) for key in
              [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (-1, 0, 0, 0)]}
    assert len(states) == 6
    # the stream is a function of the four numbers alone, the same in any process and release: a
    # run resumed elsewhere draws what it would have drawn (pinned to today's values)
    assert worker_seed(5, 1, 2, 3).generate_state(4).tolist() == [4076403739, 2763885724, 3843034612, 61433562]
    # a negative seed (SeedSequence refuses them) is taken modulo 2**64, not refused or folded onto another
    assert worker_seed(-1, 0, 0, 0).generate_state(2).tolist() == worker_seed(2**64 - 1, 0, 0, 0).generate_state(2).tolist()


@pytest.mark.parametrize("persistent", [True, False])
def test_worker_augmentation_streams(persistent):
    """NumPy, random and torch draws differ across workers and epochs, and repeat exactly per seed."""

    def stream(seed):
        return _stream(build_loader(RandomAugment(), 4, shuffle=True, seed=seed, workers=2,
                                    persistent_workers=persistent))

    a, b, c = stream(0), stream(0), stream(1)
    assert torch.equal(a, b)  # the whole stream, every library, both epochs
    assert not torch.equal(a[:, 2:], c[:, 2:])
    assert set(a[:, 1].tolist()) == {0.0, 1.0}
    n = len(RandomAugment())
    for epoch in range(2):
        rows = a[epoch * n : (epoch + 1) * n]
        w0, w1 = rows[rows[:, 1] == 0], rows[rows[:, 1] == 1]
        # The classic bug: forked workers inherit one RNG state and draw the same values.
        for col in (2, 3, 4):
            assert not set(w0[:, col].tolist()) & set(w1[:, col].tolist()), col
    # A new epoch draws new augmentations, whether the workers persist or are re-forked.
    assert not set(a[:n, 2].tolist()) & set(a[n:, 2].tolist())


def test_workers_are_seeded_from_seed_rank_worker_epoch():
    """Each worker's first draws are those of worker_seed(seed, rank, worker_id, epoch)."""
    loader = build_loader(RandomAugment(), 4, shuffle=False, seed=7, workers=2, rank=1, world_size=2,
                          persistent_workers=False)
    epochs = [torch.cat(list(loader)) for _ in range(2)]
    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        for epoch, rows in enumerate(epochs):
            for worker in (0, 1):
                seeder = loader_mod._SeedWorker(7, 1)
                seeder.epoch = epoch
                seeder(worker)
                first = rows[rows[:, 1] == worker][0]
                assert first[2:].tolist() == [np.random.rand(), random.random(), torch.rand(1).item()]
    finally:
        random.setstate(state[0]), np.random.set_state(state[1]), torch.set_rng_state(state[2])


def test_worker_streams_differ_across_ranks():
    """Same seed on two ranks (as in data parallel): the ranks' augmentations must still differ."""
    rows = [_stream(build_loader(RandomAugment(), 4, shuffle=True, seed=0, workers=2, rank=r, world_size=2), 1)
            for r in (0, 1)]
    for col in (2, 3, 4):
        assert not set(rows[0][:, col].tolist()) & set(rows[1][:, col].tolist()), col


# --------------------------------------------------------------------------- distributed sampling


def _indices(loader) -> list[int]:
    return [i for (b,) in loader for i in b.tolist()]


def test_map_style_ranks_are_disjoint_and_cover():
    ds = TensorDataset(torch.arange(40))
    loaders = [build_loader(ds, 4, shuffle=True, seed=3, rank=r, world_size=2) for r in (0, 1)]
    assert all(isinstance(lo.sampler, DistributedSampler) for lo in loaders)
    epochs = []
    for _ in range(2):  # plain iteration advances the sampler's epoch
        parts = [_indices(lo) for lo in loaders]
        assert len(parts[0]) == len(parts[1]) == 20
        assert not set(parts[0]) & set(parts[1])
        assert sorted(parts[0] + parts[1]) == list(range(40))
        epochs.append(parts)
    assert epochs[0][0] != epochs[1][0]  # reshuffled per epoch
    again = build_loader(ds, 4, shuffle=True, seed=3, rank=0, world_size=2)
    assert [_indices(again) for _ in range(2)] == [epochs[0][0], epochs[1][0]]
    # infinite() sets the same epochs.
    fresh = build_loader(ds, 4, shuffle=True, seed=3, rank=0, world_size=2)
    stream = [(e, b) for e, (b,) in _take(infinite(fresh), 10)]
    assert [i for e, b in stream if e == 1 for i in b.tolist()] == epochs[1][0]
    # Resuming at epoch 1 replays epoch 1's order, with and without ranks.
    resumed = build_loader(ds, 4, shuffle=True, seed=3, rank=0, world_size=2)
    first = _take(infinite(resumed, start_epoch=1), 5)
    assert [e for e, _ in first] == [1] * 5 and [i for _, (b,) in first for i in b.tolist()] == epochs[1][0]


def test_resume_replays_epoch_without_ranks():
    ds = TensorDataset(torch.arange(12))
    loader = build_loader(ds, 4, shuffle=True, seed=1)
    epochs = [_indices(loader) for _ in range(3)]
    resumed = _take(infinite(build_loader(ds, 4, shuffle=True, seed=1), start_epoch=2), 3)
    assert [i for _, (b,) in resumed for i in b.tolist()] == epochs[2]


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_map_style_uneven_split():
    ds = TensorDataset(torch.arange(21))
    padded = [_indices(build_loader(ds, 4, shuffle=False, seed=0, rank=r, world_size=2)) for r in (0, 1)]
    assert len(padded[0]) == len(padded[1]) == 11  # padded with a repeat so both ranks run the same steps
    assert set(padded[0]) | set(padded[1]) == set(range(21))
    dropped = [_indices(build_loader(ds, 4, shuffle=False, seed=0, drop_last=True, rank=r, world_size=2))
               for r in (0, 1)]
    assert not set(dropped[0]) & set(dropped[1])
    assert [len(d) for d in dropped] == [8, 8]  # 10 samples per rank, then drop_last drops the short batch


def test_rank_defaults_and_checks(monkeypatch):
    ds = TensorDataset(torch.arange(8))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    single = build_loader(ds, 2, shuffle=True, seed=0).sampler
    assert single.num_replicas == 1 and single.rank == 0  # one process: a rank of one
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets them
    sampler = build_loader(ds, 2, shuffle=True, seed=0).sampler
    assert isinstance(sampler, DistributedSampler) and sampler.rank == 1 and sampler.num_replicas == 2
    with pytest.raises(ValueError, match=r"rank=2 must be an integer in \[0, world_size=2\)"):
        build_loader(ds, 2, shuffle=True, seed=0, rank=2, world_size=2)


class Stream(IterableDataset):
    def __init__(self, n: int, rank: int, world_size: int):
        self.n, self.rank, self.world_size = n, rank, world_size

    def __iter__(self):
        return shard_iterable(range(self.n), self.rank, self.world_size)


def test_one_process_batch_is_the_union_of_the_ranks_micro_batches():
    # what makes dp=N train the same model as one process with the same global batch
    ds = TensorDataset(torch.arange(100))
    single = [b[0].tolist() for b in build_loader(ds, 8, shuffle=True, seed=3, drop_last=True, rank=0, world_size=1)]
    ranks = [[b[0].tolist() for b in build_loader(ds, 4, shuffle=True, seed=3, drop_last=True, rank=r, world_size=2)]
             for r in (0, 1)]
    assert len(single) == len(ranks[0]) == len(ranks[1]) == 12
    for whole, a, b in zip(single, *ranks):
        assert sorted(whole) == sorted(a + b)


def test_shard_iterable_two_ranks_two_workers():
    seen = []
    for rank in (0, 1):
        loader = build_loader(Stream(50, rank, 2), 4, shuffle=False, seed=0, workers=2)
        seen += [i for b in loader for i in b.tolist()]
    assert len(seen) == 50 and sorted(seen) == list(range(50))
    # In the main process (no workers) a rank's share is every world_size-th item.
    assert list(Stream(7, 1, 2)) == [1, 3, 5]


def test_iterable_dataset_cannot_shuffle():
    with pytest.raises(ValueError, match="shuffle=True is not possible for an IterableDataset"):
        build_loader(Stream(4, 0, 1), 2, shuffle=True, seed=0)


# --------------------------------------------------------------------------- benchmark smoke


def test_dataloader_bench_quick(tmp_path):
    from kiln.bench import BENCHMARKS, run_benchmark

    assert "dataloader" in BENCHMARKS
    report = run_benchmark("dataloader", tmp_path, quick=True)
    saved = json.loads((tmp_path / "dataloader.json").read_text())
    assert saved["results"].keys() == report["results"].keys() == {"workers=0", "workers=auto"}
    for name, r in saved["results"].items():
        for key in ("samples_per_s", "time_to_first_batch_s", "ms_per_batch"):
            assert r[key] > 0, (name, key)
    assert saved["results"]["workers=0"]["workers"] == 0
    assert saved["speedup"] > 0 and saved["setup"]["quick"] is True
    assert (tmp_path / "dataloader.png").stat().st_size > 0
