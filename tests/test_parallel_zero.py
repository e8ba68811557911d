"""kiln.parallel: data parallel (zero=0) and ZeRO-1/2 on the arena, with gloo on CPU.

Each test spawns its processes once and runs every (stage, optimizer) case inside them;
each worker also trains the single-process reference (same initial weights, the whole
global batch) and reports how far its parameters ended up from it.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import kiln.optim as ko
from kiln.parallel import (ZeroOptimizer, all_reduce_gradients, broadcast_parameters, init_distributed, is_main,
                           rank, world_size)
from kiln.launch.testing import run_distributed

pytestmark = pytest.mark.distributed  # processes on gloo: the full suite runs them, the fast tier does not

STEPS, BATCH, ACCUM = 5, 16, 2
OPTS = {
    "adamw": lambda gs, sm: ko.AdamW(gs, lr=1e-2, weight_decay=0.1, shard_multiple=sm),
    "lamb": lambda gs, sm: ko.LAMB(gs, lr=1e-2, weight_decay=0.01, compile=False, shard_multiple=sm),
    "sgd": lambda gs, sm: ko.SGD(gs, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, shard_multiple=sm),
    "lars": lambda gs, sm: ko.LARS(gs, lr=0.5, momentum=0.9, weight_decay=1e-3, eta=0.01, compile=False,
                                   shard_multiple=sm),
}


def _model(seed: int, frozen: bool = False) -> nn.Module:
    # hidden 40: shard boundaries cut through the first weight matrix and a LayerNorm weight
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 40), nn.LayerNorm(40), nn.Tanh(), nn.Linear(40, 3))
    if frozen:  # a frozen tensor splits the arena into runs of trainable segments
        model[1].weight.requires_grad_(False)
    return model


def _groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 3, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _reference(name: str, clip: float | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(0, frozen=name.endswith("-frozen"))
    opt = OPTS[name.removesuffix("-frozen")](_groups(model), 1)
    for step in range(STEPS):
        x, y = _batch(step)
        _loss(model, x, y).backward()
        if clip:
            ko.clip_grad_norm_(opt, clip)
        opt.step()
        opt.zero_grad()
    return model, opt


def _rel(a: nn.Module, b: nn.Module) -> float:
    da = torch.cat([p.detach().reshape(-1) for p in a.parameters()])
    db = torch.cat([p.detach().reshape(-1) for p in b.parameters()])
    return float((da - db).norm() / db.norm())


def _train_case(rank_: int, world: int, name: str, stage: int | None, clip: float | None) -> dict:
    """stage None: a plain kiln optimizer + all_reduce_gradients (zero=0 without the wrapper)."""
    frozen = name.endswith("-frozen")
    model = _model(seed=rank_, frozen=frozen)  # different on every rank until the broadcast
    opt = OPTS[name.removesuffix("-frozen")](_groups(model), world)
    broadcast_parameters(model)
    zero = None if stage is None else ZeroOptimizer(opt, stage)
    runner = zero or opt
    out: dict = {}
    per_rank = BATCH // world
    for step in range(STEPS):
        x, y = _batch(step)
        x, y = x[rank_ * per_rank:(rank_ + 1) * per_rank], y[rank_ * per_rank:(rank_ + 1) * per_rank]
        for xm, ym in zip(x.chunk(ACCUM), y.chunk(ACCUM)):  # accumulation: local only
            (_loss(model, xm, ym) / ACCUM).backward()
        if zero is None:
            all_reduce_gradients(opt)
            if clip:
                ko.clip_grad_norm_(opt, clip)
        else:
            zero.reduce_gradients()
            if clip:
                ko.clip_grad_norm_(zero, clip)
        runner.step()
        if stage == 2 and step == STEPS - 1:  # between steps: no full gradient anywhere
            out["grads_none"] = all(p.grad is None for p in model.parameters())
        if step == 0 and zero is not None:  # a scheduler drives the shared hyperparameters
            sched = torch.optim.lr_scheduler.LambdaLR(zero, lambda s: 1.0)
        if zero is not None:
            sched.step()
            out["full_grad_bytes"] = sum(a.grad.untyped_storage().nbytes() for a in opt.arenas)
        runner.zero_grad()
    ref_model, ref_opt = _reference(name, clip)
    out["rel"] = _rel(model, ref_model)
    out["numel"] = sum(a.numel for a in opt.arenas)
    if zero is not None and stage > 0:
        out["state_bytes"] = zero.state_bytes()
        # the inner optimizer's state lives in shard-sized buffers only
        shard_bytes = max(s.numel * s.dtype.itemsize for s in zero.shards)
        out["inner_state_sharded"] = zero.shards == opt.shards and all(
            v.untyped_storage().nbytes() <= shard_bytes for st in opt.state.values() for k, v in st.items() if k != "step")
        sd, ref_sd = zero.state_dict(), ref_opt.state_dict()  # collective
        out["sd_keys_match"] = sd["state"].keys() == ref_sd["state"].keys()
        diffs = [float((v - ref_sd["state"][k][n]).abs().max() / (ref_sd["state"][k][n].abs().max() + 1e-12))
                 for k, s in sd["state"].items() for n, v in s.items() if n != "step"]
        out["sd_rel"] = max(diffs) if diffs else 0.0
        out["sd_steps"] = sorted({int(s["step"]) for s in sd["state"].values() if "step" in s})
        # load the gathered dict into a fresh wrapper: the shards come back exactly
        fresh = ZeroOptimizer(OPTS[name.removesuffix("-frozen")](_groups(_model(0, frozen)), world), stage)
        fresh.load_state_dict(sd)
        mine, back = opt.state_dict(), fresh.optimizer.state_dict()  # this rank's pieces, with step counts
        out["load_exact"] = mine["pieces"] == back["pieces"] and mine["state"].keys() == back["state"].keys() and all(
            torch.equal(v, back["state"][k][n]) for k, s in mine["state"].items() for n, v in s.items())
    return out


def _parity_worker(rank_: int, world: int, cases: list[tuple[str, int | None, float | None]]) -> dict:
    assert (rank(), world_size(), is_main()) == (rank_, world, rank_ == 0)
    assert init_distributed() == (rank_, world)  # already initialised: returns the group
    return {case: _train_case(rank_, world, *case) for case in cases}


def _check(results: list[dict], world: int) -> None:
    for case in results[0]:
        name, stage, _ = case
        for r, res in enumerate(results):
            out = res[case]
            assert out["rel"] < 1e-6, (case, r, out["rel"])
            if stage:
                # optimizer state only for the shard: (number of state buffers + scratch) x N/world
                nbuf = {"adamw": 2, "lamb": 3, "sgd": 1, "lars": 2}[name.removesuffix("-frozen")]
                assert out["state_bytes"] == nbuf * out["numel"] * 4 // world, (case, out)
                assert out["inner_state_sharded"] and out["sd_keys_match"] and out["load_exact"], (case, out)
                assert out["sd_rel"] < 1e-5, (case, out["sd_rel"])
                if name in ("adamw", "lamb", "lars"):
                    assert out["sd_steps"] == [STEPS]
            if stage == 2:
                assert out["grads_none"] and out["full_grad_bytes"] == 0, (case, out)


CASES_2 = [(name, stage, 0.5 if name == "adamw" else None) for name in OPTS for stage in (None, 0, 1, 2)] + [
    ("lamb-frozen", 2, None), ("adamw-frozen", 1, 0.5)]


def test_zero_parity_dp2():
    """dp=2, ranks feed halves of the global batch with 2 micro-batches each: after 5 steps the
    parameters equal one process's with the whole batch, to 1e-6 relative (fp32), for zero 0
    (plain and wrapped), 1 and 2, with AdamW (+ global-norm clipping), LAMB, SGD (Nesterov)
    and LARS (and with a frozen tensor); the gathered state dict equals torch-layout reference state and reloads exactly."""
    _check(run_distributed(_parity_worker, 2, CASES_2), 2)


def test_zero_parity_dp4():
    """dp=4 (4 processes on 2 cores): shards a quarter wide, boundaries in more tensors."""
    cases = [(name, stage, 0.5 if name == "adamw" else None) for name in ("adamw", "lamb", "lars") for stage in (0, 2)]
    _check(run_distributed(_parity_worker, 4, cases), 4)


def test_single_process_is_plain():
    """Without torchrun's environment: no process group, the wrapper steps like the optimizer."""
    os.environ.pop("WORLD_SIZE", None)
    assert init_distributed() == (0, 1) and world_size() == 1 and is_main()
    for stage in (0, 1, 2):
        model, ref = _model(0), _model(0)
        zero = ZeroOptimizer(ko.AdamW(_groups(model), lr=1e-2, shard_multiple=1), stage)
        ref_opt = ko.AdamW(_groups(ref), lr=1e-2, shard_multiple=1)
        for step in range(3):
            x, y = _batch(step)
            for m, o in ((model, zero), (ref, ref_opt)):
                _loss(m, x, y).backward()
                o.step()
                o.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())), stage


def test_zero_rejects_bad_layout():
    model = _model(0)
    opt = ko.AdamW(model.parameters(), shard_multiple=1)
    with pytest.raises(ValueError, match="stage"):
        ZeroOptimizer(opt, stage=3)
    with pytest.raises(TypeError):
        ZeroOptimizer(torch.optim.AdamW(model.parameters()), stage=1)


def test_bench_zero_quick(tmp_path):
    """``kiln bench zero`` (quick): measured per-rank bytes equal the ZeRO paper's formulas up
    to the arena's alignment padding (HSDP's, with S = dp / replicas in place of dp), and stage 2
    meets its target at dp=2 and dp=4."""
    from kiln.bench import BENCHMARKS, run_benchmark

    assert "zero" in BENCHMARKS
    report = run_benchmark("zero", tmp_path, quick=True)
    assert report["target_met"]
    assert (tmp_path / "zero.json").exists() and (tmp_path / "zero.png").exists()
    rows = report["rows"]
    assert sorted((r["dp"], r["stage"], r["replicate"]) for r in rows) == sorted(
        [(d, s, 1) for d in (2, 4) for s in (0, 1, 2, 3)] + [(4, 3, 2)])
    # HSDP 2 x 2 holds what FSDP2 over 2 ranks holds, twice what FSDP2 over all 4 does
    by = {(r["dp"], r["stage"], r["replicate"]): r for r in rows}
    total = {k: r["param_bytes"] + r["grad_bytes"] + r["state_bytes"] for k, r in by.items()}
    assert total[4, 3, 2] == total[2, 3, 1] == pytest.approx(2 * total[4, 3, 1], rel=0.02)
    for r in rows:
        parts = [r["param_bytes"], r["grad_bytes"], r["state_bytes"]]
        for got, per_param in zip(parts, r["paper_parts"]):
            assert per_param * r["n_params"] <= got <= per_param * r["n_params"] * 1.02 + 64 * 8, r
