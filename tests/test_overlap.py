"""Gradient communication overlapped with backward (``ZeroOptimizer(overlap=True)``).

Two gloo processes train the same fp64 model for several steps with the reduction after
backward (today's path: one all-reduce or reduce-scatter per arena) and with buckets reduced
during backward; the weights must be bitwise equal, through accumulation (K=2), a parameter
unused on one rank in one step, a step whose gradients all arrive outside the arena
(``model.zero_grad()`` before the last backward) and two arenas (weight-decay groups). A hook on the
first layer's weight, which gets its gradient last, records how many buckets were already
launched: collectives really start during backward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.distributed  # processes on gloo

STEPS, UNUSED_STEP, FOREIGN_STEP = 6, 2, 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.extra = nn.Linear(16, 16)  # skipped by rank 0 in one step
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:  # (B, 16) -> (B, 4)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if use_extra:
            x = x + self.extra(x)
        return self.head(x)


def _train(rank: int, world: int, stage: int, overlap: bool, accumulate: int) -> dict:
    import kiln.optim
    from kiln.parallel import ZeroOptimizer, broadcast_parameters, sync_gradients

    torch.manual_seed(0)
    model = Net().double()
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    opt = kiln.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    # buckets of ~1 KiB: several per arena (a 16 x 16 fp64 weight is 2 KiB)
    zero = ZeroOptimizer(opt, stage, overlap=overlap, bucket_mb=1 / 1024)
    broadcast_parameters(model)
    buckets = zero.reducer if zero.reducer.overlap else None  # (without overlap: every bucket after backward)
    at_first_layer: list[int] = []  # buckets launched when the first layer's weight gradient is computed
    model.layers[0].weight.register_hook(lambda g: at_first_layer.append(buckets.next if buckets else 0))
    gen = torch.Generator().manual_seed(100 + rank)
    launched, early = [], []
    for step in range(STEPS):
        for micro in range(accumulate):
            if step == FOREIGN_STEP and micro == accumulate - 1:
                # p.grad = None: autograd puts the last backward's gradients outside the arena
                # (the first micro-batch's are dropped, with either path)
                model.zero_grad(set_to_none=True)
            x = torch.randn(8, 16, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 4, (8,), generator=gen)
            use_extra = not (step == UNUSED_STEP and rank == 0)
            loss = nn.functional.cross_entropy(model(x, use_extra), y) / accumulate
            with sync_gradients(zero, last=micro == accumulate - 1):
                loss.backward()
        launched.append(buckets.next if buckets else 0)  # before reduce_gradients: during backward
        early.append(at_first_layer[-1])
        zero.step()
        zero.zero_grad()
    out = {"weights": [p.detach().clone() for p in model.parameters()], "launched": launched, "early": early,
           "n_buckets": len(buckets.spans) if buckets else 0, "order_learned": bool(buckets and buckets.learned)}
    if buckets is not None:  # a second backward inside sync_gradients(True) is refused
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        with sync_gradients(zero, last=True):
            model(x, True).sum().backward()
            try:
                model(x, True).sum().backward()
            except RuntimeError as exc:
                out["twice"] = str(exc)
        zero.zero_grad()
    return out


class Mix(nn.Module):
    """Reads its child's parameters itself, never calling the child."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.linear(x, self.inner.weight, self.inner.bias)


class Rooted(nn.Module):
    """A parameter of the root module's own, ahead of the layers in the arena, and a module
    (``mix``) whose parameters are read by its parent."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.mix = Mix()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 16) -> (B, 4)
        x = x * self.scale
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(self.mix(x))


def _train_gather(rank: int, world: int, stage: int, gather: bool) -> dict:
    import kiln.optim
    from kiln.parallel import ZeroOptimizer, broadcast_parameters, sync_gradients

    torch.manual_seed(0)
    model = Rooted().double()
    temp = nn.Parameter(torch.ones((), dtype=torch.float64))  # the loss's, not the model's
    # two arenas: each layer's weight in one, its bias in the other
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [temp] + [p for p in model.parameters() if p.ndim <= 1]
    opt = kiln.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    zero = ZeroOptimizer(opt, stage, overlap=True, bucket_mb=1 / 1024)
    if gather:  # chunks of 1 KiB: parameters cut across chunks and across the two owners' shards
        zero.overlap_param_gather(model, chunk_mb=1 / 1024)
    broadcast_parameters(zero)
    g = zero._gather
    seen: dict[str, list] = {"first": [], "mix": [], "head": []}  # (received chunks waited for, chunks in flight)
    for name, m in (("first", model.layers[0]), ("mix", model.mix), ("head", model.head)):
        m.register_forward_pre_hook(lambda *_, name=name: seen[name].append((g.waited, len(g.handles)) if g else 0))
    gen = torch.Generator().manual_seed(100 + rank)
    at_step_2 = None
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 4, (8,), generator=gen)
        loss = nn.functional.cross_entropy(model(x) / temp, y)
        with sync_gradients(zero, last=True):
            loss.backward()
        zero.step()
        zero.zero_grad()
        if step == 2:  # read while the exchange may still run: the module's state_dict waits
            at_step_2 = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # an evaluation forward waits too
        model(torch.zeros(2, 16, dtype=torch.float64))
    def where(t: torch.Tensor) -> tuple[int, int]:
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()

    return {"weights": [temp.detach().clone()] + [p.detach().clone() for p in model.parameters()],
            "at_step_2": at_step_2, "seen": seen, "chunks": [(r, *where(t)) for t, r in g.chunks] if g else [],
            **{name: [where(p) for p in m.parameters()] for name, m in
               (("first", model.layers[0]), ("mix", model.mix), ("head", model.head))}}


def _train_all(rank: int, world: int) -> dict:
    # one pair of processes for every case: starting processes costs more than the steps
    out = {(stage, overlap): _train(rank, world, stage, overlap, 2) for stage in (0, 1, 2) for overlap in (False, True)}
    out.update({("gather", stage, on): _train_gather(rank, world, stage, on) for stage in (1, 2) for on in (False, True)})
    return out


@pytest.fixture(scope="module")
def runs():
    from kiln.launch.testing import run_distributed

    return run_distributed(_train_all, 2, timeout_s=300)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overlapped_reduction_is_bitwise_the_reduction_after_backward(runs, stage):
    off = [r[(stage, False)] for r in runs]
    on = [r[(stage, True)] for r in runs]
    for r in range(2):
        assert len(on[r]["weights"]) == 12
        for a, b in zip(off[r]["weights"], on[r]["weights"]):
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(on[0]["weights"], on[1]["weights"]))  # replicas agree
    # the weights moved (the comparison is not between two untouched models)
    torch.manual_seed(0)
    start = [p.detach() for p in Net().double().parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(start, on[0]["weights"]))
    n = on[0]["n_buckets"]
    assert n >= 6 and on[0]["order_learned"]  # 5 in the weights' arena, 1 in the others'
    for r in range(2):
        launched, early = on[r]["launched"], on[r]["early"]
        assert launched[FOREIGN_STEP] == 0  # every gradient outside the arena: all reduced after backward
        for step in range(STEPS):
            if step in (UNUSED_STEP, FOREIGN_STEP):
                continue
            assert launched[step] == n  # every bucket started before reduce_gradients ...
            assert 0 < early[step] < n  # ... some before the first layer's gradient existed
        assert "second gradient" in on[r]["twice"]
    # rank 0 skipped `extra` in UNUSED_STEP: its bucket (and the ones after it in the order)
    # waited for reduce_gradients there, while rank 1 launched them all during backward
    assert on[0]["launched"][UNUSED_STEP] < n == on[1]["launched"][UNUSED_STEP]
    assert off[0]["n_buckets"] == 0 and off[0]["launched"] == [0] * STEPS


@pytest.mark.parametrize("stage", [1, 2])
def test_parameter_exchange_overlapped_with_the_next_forward_is_bitwise_the_same(runs, stage):
    """overlap_param_gather: the same weights, bitwise, as the exchange at the end of step();
    a module's state_dict read right after a step sees the new values; each forward waits for
    the chunks of its own parameters only."""
    off = [r[("gather", stage, False)] for r in runs]
    on = [r[("gather", stage, True)] for r in runs]
    for r in range(2):
        assert len(on[r]["weights"]) == 14
        assert all(torch.equal(a, b) for a, b in zip(off[r]["weights"], on[r]["weights"]))
        assert all(torch.equal(a, b) for a, b in zip(on[0]["weights"], on[r]["weights"]))  # replicas agree
        assert on[r]["at_step_2"].keys() == off[r]["at_step_2"].keys()
        assert all(torch.equal(on[r]["at_step_2"][k], off[r]["at_step_2"][k]) for k in on[r]["at_step_2"])
    torch.manual_seed(0)
    assert not torch.equal(Rooted().double().layers[0].weight, on[0]["weights"][2])  # trained
    n = len(on[0]["chunks"])
    assert n >= 10 and [c[0] for c in on[0]["chunks"]].count(0) == n // 2
    assert [(o, hi - lo) for o, lo, hi in on[0]["chunks"]] == [(o, hi - lo) for o, lo, hi in on[1]["chunks"]]

    def holding(r: int, module: str, owner: int) -> list[int]:  # chunks of `owner` holding the module's parameters
        return [k for k, (o, lo, hi) in enumerate(on[r]["chunks"]) if o == owner and any(
            lo < b and a < hi for a, b in on[r][module])]

    # the forwards of steps 1, 2, 4, 5 and the evaluation after the last step found every chunk
    # in flight; step 0's (before any step) and step 3's (after step 2's state_dict waited) none
    overlapped = [1, 2, 4, 5, 6]
    for r in range(2):
        seen = on[r]["seen"]
        assert len(seen["first"]) == len(seen["head"]) == STEPS + 1
        assert [seen["first"][i][1] for i in (0, 3)] == [0, 0]
        assert all(seen["first"][i][1] == n for i in overlapped)
    # rank 1 waits at the first layer for rank 0's chunks of it, not for all of rank 0's (the
    # chunks go out in the order of use, the weight's and the bias's arena interleaved) ...
    need, of_rank_0 = holding(1, "first", 0), [k for k, c in enumerate(on[1]["chunks"]) if c[0] == 0]
    assert need
    for i in overlapped:
        waited = on[1]["seen"]["first"][i][0]
        assert waited == max(need) + 1
        assert waited <= max(of_rank_0)  # some of rank 0's chunks still in flight
    # ... rank 0 holds the first layer itself and waits for nothing there, and at the head
    # (in rank 1's shard) for rank 1's chunks of it
    assert not holding(0, "first", 1) and holding(0, "head", 1)
    assert all(on[0]["seen"]["first"][i][0] == 0 for i in overlapped)
    assert all(on[0]["seen"]["head"][i][0] > max(holding(0, "head", 1)) for i in overlapped)
    # rank 0's mix forward waits for its child's parameters (rank 1's), which the child's own
    # forward, never called, cannot
    assert holding(0, "mix", 1)
    assert all(on[0]["seen"]["mix"][i][0] > max(holding(0, "mix", 1)) for i in overlapped)


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """(ZeRO stage, overlap) -> run directory: the trainer in two processes, fp64, two
    micro-batches per step; the four runs in one pair of gloo processes started once
    (tests/group_runs.py), as workers of kiln train --nproc 2 run them."""
    from pathlib import Path

    from group_runs import train_in_one_group

    mlp = str(Path(__file__).resolve().parents[1] / "configs" / "digits_mlp.yaml")
    out = tmp_path_factory.mktemp("trainer")
    cases = [(zero, overlap) for zero in (0, 2) for overlap in ("true", "false")]
    runs = [(mlp, ["train.max_steps=4", "optim.lr=1e-3", "train.accumulate=2", "train.log_every=4",
                   "train.precision=fp64", "data.name=synthetic_images", "train.clip_grad_norm=1.0",
                   f"parallel.zero={zero}", f"parallel.overlap_grad_reduce={overlap}",
                   f"train.output_dir={out / f'{zero}-{overlap}'}"]) for zero, overlap in cases]
    return dict(zip(cases, train_in_one_group(2, runs)))


@pytest.mark.parametrize("zero", [0, 2])
def test_the_trainer_overlaps_by_default_with_the_same_weights(trainer_runs, zero):
    """Two processes: parallel.overlap_grad_reduce (the default) against false, fp64, two
    micro-batches per step: the final weights and optimizer state are bitwise equal."""
    from kiln.train import load_checkpoint

    on, off = (load_checkpoint(trainer_runs[zero, overlap] / "checkpoints" / "final") for overlap in ("true", "false"))
    assert on["model"].keys() == off["model"].keys()
    assert all(torch.equal(on["model"][k], off["model"][k]) for k in on["model"])
    for k, st in on["optimizer"]["state"].items():
        assert torch.equal(st["exp_avg"], off["optimizer"]["state"][k]["exp_avg"])
