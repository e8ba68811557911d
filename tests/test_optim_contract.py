"""kiln.optim's written contract (kiln/optim/_contract.py): the KilnOptimizer and
ShardableOptimizer protocols, the members that hand out the arena's buffers (kiln/optim/_access.py),
and the one table of the features that need the arena."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kiln.optim as ko
from kiln.config import ConfigError, OptimConfig, ParallelConfig, TrainConfig, load_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    F.mse_loss(model(torch.ones(4, 6)), torch.zeros(4, 3)).backward()
    opt.step()


def _storages(ts: list[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in ts}


@pytest.mark.parametrize("cls", list(ko.OPTIMIZERS.values()), ids=lambda c: c.__name__)
def test_every_optimizer_keeps_the_protocols_and_torch_ones_do_not(cls):
    model = _model()
    arena, lists = cls(model.parameters()), cls(model.parameters(), contiguous=False)
    assert isinstance(arena, ko.KilnOptimizer) and isinstance(arena, ko.ShardableOptimizer)
    assert ko.has_arena(arena) and ko.no_arena_setting(arena) is None
    assert isinstance(lists, ko.KilnOptimizer) and not ko.has_arena(lists)
    assert ko.no_arena_setting(lists) == ("optim.contiguous", False)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not isinstance(plain, ko.KilnOptimizer) and not ko.has_arena(plain)
    assert ko.no_arena_setting(plain)[0] == "optim.impl"


def test_gradient_and_state_buffers_are_the_arenas_then_the_shards():
    model = _model()
    opt = ko.AdamW(model.parameters(), shard_multiple=2)
    _step(model, opt)
    (arena,) = opt.arenas
    assert opt.grad_buffers() == [arena.grad] and opt.flat_grads() == [arena.grad]
    state = opt.state_tensors()
    assert len(state) == 2 and all(t.shape == (arena.numel,) for t in state)  # exp_avg, exp_avg_sq, flat
    assert opt.state_bytes() == 2 * arena.numel * 4
    for p in model.parameters():  # the state torch.optim keys per parameter are views of those buffers
        assert _storages([opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]]) <= _storages(state)
    assert opt.shard_pieces() == {} and opt.shards == []
    opt.shard(1, 2, keep_full_grad=False)  # ZeRO-2's layout: the shard's gradient is a buffer of its own
    (shard,) = opt.shards
    assert opt.grad_buffers() == [arena.grad, shard.grad] and len(_storages(opt.grad_buffers())) == 2
    assert [t.shape for t in opt.state_tensors()] == [(arena.numel // 2,)] * 2
    assert opt.state_bytes() == arena.numel * 4
    assert opt.shard_pieces() and all(0 <= a <= b for a, b in opt.shard_pieces().values())


def test_park_and_unpark_free_and_restore_the_flat_gradients():
    model = _model()
    opt = ko.SGD(model.parameters(), lr=0.1)
    _step(model, opt)
    (arena,) = opt.arenas
    views = [p.grad for p in model.parameters()]
    nbytes = [a.grad.untyped_storage().nbytes() for a in opt.arenas]
    opt.park_grads()
    assert arena.grad.untyped_storage().nbytes() == 0 and all(p.grad is None for p in model.parameters())
    opt.unpark_grads(nbytes)
    assert arena.grad.untyped_storage().nbytes() == nbytes[0] and arena.grad.eq(0).all()
    assert all(p.grad is v for p, v in zip(model.parameters(), views))
    opt.materialize_grads()  # (nothing to do on the optimizer itself: no error, no change)
    opt.wait_parameters()
    assert all(p.grad is v for p, v in zip(model.parameters(), views))


def test_without_an_arena_the_members_hand_out_each_parameters_tensors():
    model = _model()
    opt = ko.LAMB(model.parameters(), contiguous=False)
    _step(model, opt)
    params = list(model.parameters())
    assert opt.arenas == [] and opt.packed_params() == [] and opt.shards == []
    assert opt.grad_buffers() == [p.grad for p in params] == opt.flat_grads()
    assert len(opt.state_tensors()) == 3 * len(params)  # step, exp_avg, exp_avg_sq
    assert opt.state_bytes() == sum(t.nbytes for t in opt.state_tensors())


def test_the_arena_table_names_both_fixes_for_every_conflict():
    assert ko.arena_conflicts({"train.precision": "bf16-mixed", "optim.contiguous": False, "parallel.zero": 0,
                               "parallel.tp": 2, "optim.impl": "kiln"}) == []
    lines = ko.arena_conflicts({"train.precision": "bf16-true", "parallel.zero": 1, "optim.contiguous": False,
                                "parallel.tp": 1, "optim.impl": "kiln"})
    assert len(lines) == 2  # bf16-true and zero=1, each over optim.contiguous=false
    assert all("optim.contiguous=false" in s and "set optim.contiguous=true" in s and "\n" not in s for s in lines)
    assert "use train.precision=bf16-mixed" in lines[0] and "use parallel.zero=3 (FSDP2)" in lines[1]
    # parallel.zero=3 leaves the arena out for bf16-true; overlap_grad_reduce is no error, only left out
    assert ko.arena_conflicts({"train.precision": "bf16-true", "parallel.zero": 3}) == [
        ko.arena_missing("bf16-true", "parallel.zero", 3)]
    assert ko.arena_conflicts({"parallel.overlap_grad_reduce": True, "optim.contiguous": False}) == []
    assert not ko.ARENA_FEATURES["overlap_grad_reduce"].required
    assert ko.arena_conflicts({"parallel.zero": 2, "parallel.tp": 4}) == [ko.arena_missing("zero-2", "parallel.tp", 4)]


def test_the_arena_tables_name_config_keys_and_values_the_schema_takes():
    """(kiln.config reads these tables: a renamed key or value would leave a conflict unchecked.)"""
    types = {f"{ns}.{name}": tp for ns, cls in (("optim", OptimConfig), ("train", TrainConfig),
                                                ("parallel", ParallelConfig))
             for name, tp in typing.get_type_hints(cls).items()}
    for need in ko.ARENA_FEATURES.values():
        tp = types[need.key]
        assert need.value in typing.get_args(tp) or isinstance(need.value, tp), need
    assert {no.key for no in ko.NO_ARENA} <= set(types)
    impls = typing.get_args(types["optim.impl"])
    (impl,) = [no for no in ko.NO_ARENA if no.key == "optim.impl"]
    assert [v for v in impls if impl.leaves_out(v)] == [v for v in impls if v != "kiln"]


# -- the contract's readers: ZeRO's wrapper keeps it, the config check and the runtime share one table --

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")


def _config_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(MLP, overrides)
    return str(err.value)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_optimizer_keeps_the_protocol_and_hands_out_the_inner_optimizers_buffers(stage):
    from kiln.parallel import ZeroOptimizer

    model = _model()
    inner = ko.AdamW(model.parameters(), shard_multiple=1)
    zero = ZeroOptimizer(inner, stage)  # one process: the whole arena is this rank's shard
    assert isinstance(zero, ko.KilnOptimizer) and ko.has_arena(zero)
    assert not isinstance(zero, ko.ShardableOptimizer)  # it shards; nothing shards it
    _step(model, zero)
    assert zero.arenas == inner.arenas and zero.shards == inner.shards
    assert [ps for _, ps in zero.packed_params()] == [ps for _, ps in inner.packed_params()]
    assert zero.grad_buffers() == inner.grad_buffers() and zero.state_tensors() == inner.state_tensors()
    assert zero.state_bytes() == 2 * inner.arenas[0].numel * 4
    assert (zero.shard_pieces() == {}) == (stage == 0)
    views, full = zero.state_dict(copy=False), zero.state_dict()
    p0 = next(iter(model.parameters()))
    assert ("pieces" in views) == (stage > 0) and "pieces" not in full  # the wrapper's own dict is whole
    assert full["state"][0]["exp_avg"].shape == p0.shape
    assert views["state"][0]["exp_avg"].untyped_storage().data_ptr() in _storages(zero.state_tensors())
    assert full["state"][0]["exp_avg"].untyped_storage().data_ptr() not in _storages(zero.state_tensors())
    # the clip asks the wrapper for its parts: the gradients the step read, which ZeRO-2 keeps
    # only in the shards (every p.grad is freed: a clip of the parameters' would find none)
    expected = torch.cat([g.flatten() for g in zero.flat_grads()]).norm()
    assert expected > 0 and (stage < 2 or all(p.grad is None for p in model.parameters()))
    assert torch.allclose(ko.clip_grad_norm_(zero, 1e9), expected)


@pytest.mark.parametrize("feature", [f for f, need in ko.ARENA_FEATURES.items() if need.required])
def test_the_config_refuses_each_arena_conflict_with_the_tables_one_line(feature):
    need = ko.ARENA_FEATURES[feature]
    left_out = {"optim.impl": "torch-fused", "optim.contiguous": False, "parallel.zero": 3, "parallel.tp": 2}
    assert set(left_out) == {no.key for no in ko.NO_ARENA}
    for key, value in left_out.items():
        if key == need.key:
            continue  # (parallel.zero=3 is no ZeRO-1/2 to refuse)
        setting = str(value).lower() if isinstance(value, bool) else value
        msg = _config_error([f"{need.key}={need.value}", f"{key}={setting}"])
        assert msg == ko.arena_missing(feature, key, value)
        assert need.setting in msg and f"{key}={setting}" in msg  # the key, and both fixes
        (no,) = [no for no in ko.NO_ARENA if no.key == key]
        assert no.undo in msg and need.instead in msg


def test_the_runtime_refuses_with_the_configs_reasons():
    from kiln.parallel import ZeroOptimizer
    from kiln.precision import MasterWeights

    model = _model()
    lists = ko.AdamW(model.parameters(), contiguous=False)
    with pytest.raises(ValueError) as err:
        MasterWeights(model, lists)
    assert str(err.value) == _config_error(["train.precision=bf16-true", "optim.contiguous=false"])
    assert all(p.dtype == torch.float32 for p in model.parameters())  # refused before the model became bf16
    with pytest.raises(ValueError, match=r"optim.impl=torch \(SGD\) leaves out .*: set optim.impl=kiln"):
        MasterWeights(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for stage in (1, 2):
        with pytest.raises(TypeError) as err:
            ZeroOptimizer(lists, stage)
        assert _config_error([f"parallel.zero={stage}", "optim.contiguous=false"]) in str(err.value)
    with pytest.raises(TypeError, match="contiguous=True"):
        ZeroOptimizer(lists, 0)
    with pytest.raises(TypeError, match="contiguous=True"):  # a wrapper is no optimizer to shard again
        ZeroOptimizer(ZeroOptimizer(ko.AdamW(model.parameters()), 0), 0)


def test_a_layout_keeps_the_arena_unless_the_table_leaves_it_out():
    from kiln.parallel import Layout, Parallel

    model = torch.nn.Linear(2, 2)
    assert not Parallel(model, Layout(dp=2), zero=3).arena  # FSDP2's DTensor shards
    assert not Parallel(model, Layout(tp=2), zero=0).arena  # tensor-parallel DTensors
    assert Parallel(model, Layout(dp=1), zero=3).arena  # one replica: no FSDP2 is applied
    assert Parallel(model, Layout(dp=2), zero=2).arena and Parallel(model, Layout(dp=2), zero=0).arena
