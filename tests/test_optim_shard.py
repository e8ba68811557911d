"""kiln.optim sharding (``ArenaOptimizer.shard``) in one process: W optimizer instances, each
sharded as rank r of W and fed its piece of the same gradients, step exactly like one
optimizer over the whole arena once their shards are concatenated (the all-gather ZeRO does):
bitwise for SGD and Adam(W); for LAMB and LARS, whose per-tensor norms are summed over the
shards (here by a stand-in for the all-reduce, the instances stepping in W threads), to the
papers' per-tensor reference in float64."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import kiln.optim as ko
from test_optim import _ref_lamb, _ref_lars  # the per-tensor references (tests/ is on sys.path)

STEPS = 6
SHAPES = [(24, 17), (17,), (5, 9), (1,), (33,), (40, 3)]  # shard boundaries cut through tensors
OPTS = {
    "adamw": lambda gs, w: ko.AdamW(gs, lr=1e-2, weight_decay=0.1, shard_multiple=w),
    "adam-amsgrad": lambda gs, w: ko.Adam(gs, lr=1e-2, weight_decay=0.1, amsgrad=True, shard_multiple=w),
    "sgd-nesterov": lambda gs, w: ko.SGD(gs, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3,
                                         shard_multiple=w),
    "sgd": lambda gs, w: ko.SGD(gs, lr=0.05, shard_multiple=w),
    "lamb": lambda gs, w: ko.LAMB(gs, lr=1e-2, weight_decay=0.1, compile=False, shard_multiple=w),
    "lars": lambda gs, w: ko.LARS(gs, lr=0.5, weight_decay=1e-2, compile=False, shard_multiple=w),
    "lars-nesterov": lambda gs, w: ko.LARS(gs, lr=0.5, weight_decay=1e-2, nesterov=True, compile=False,
                                           shard_multiple=w),
    # the native CPU kernels (kiln.optim._native): a shard's LAMB runs its two passes apart
    "lamb-native": lambda gs, w: ko.LAMB(gs, lr=1e-2, weight_decay=0.1, compile=True, shard_multiple=w),
    "lars-native": lambda gs, w: ko.LARS(gs, lr=0.5, weight_decay=1e-2, compile=True, shard_multiple=w),
}


def _params(dtype: torch.dtype, frozen: tuple[int, ...] = (), cplx: bool = False) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    ps = [nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(dtype)) for s in SHAPES]
    if cplx:  # a complex arena of its own, stepped as pairs of reals
        ps.append(nn.Parameter(torch.randn(6, 5, generator=g, dtype=torch.complex128).to(torch.complex64)))
    for i in frozen:
        ps[i].requires_grad_(False)
    return ps


def _groups(ps: list[nn.Parameter]) -> list[dict]:
    return [{"params": ps[0::2]}, {"params": ps[1::2], "lr": 5e-3, "weight_decay": 0.0}]


def _grads(ps: list[nn.Parameter], step: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g, dtype=torch.complex128 if p.is_complex() else torch.float64)
            .to(p.dtype) if p.requires_grad else None for p in ps]


class _Sum:
    """Stands in for an all-reduce (sum) over W simulated ranks that step in W threads: every
    rank adds the same tensors in the same order, so all get the same bits."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * world

    def for_rank(self, r: int):
        def sum_(t: torch.Tensor) -> None:
            self.slots[r] = t.clone()
            self.barrier.wait()
            total = self.slots[0].clone()
            for s in self.slots[1:]:
                total += s
            self.barrier.wait()  # nobody reuses the slots before everyone has read them
            t.copy_(total)

        return sum_


def _shard_all(name: str, dtype: torch.dtype, world: int, threaded: bool = False, **kw):
    ranks = []
    sums = _Sum(world) if threaded else None
    for r in range(world):
        ps = _params(dtype, **kw)
        opt = OPTS[name](_groups(ps), world)
        assert opt.shard(r, world, sums.for_rank(r) if sums else None) == opt.shards
        ranks.append((ps, opt))
    return ranks


@torch.no_grad()
def _feed(opt: ko.ArenaOptimizer, ps: list[nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    """Write this rank's piece of the full gradients into its shards' gradient buffers."""
    index = {id(p): k for k, p in enumerate(ps)}
    for (arena, aps), shard in zip(opt.packed_params(), opt.shards):
        full = arena.new_buffer()
        for view, p in zip(arena.views(full), aps):
            if grads[index[id(p)]] is not None:
                view.copy_(grads[index[id(p)]])
        shard.grad.copy_(full[shard.lo:shard.hi])


def _step(ranks, threaded: bool) -> None:
    """Step every rank (in threads where norms are summed over them), then all-gather."""
    if threaded:
        errors: list[BaseException] = []

        def run(opt):
            try:
                opt.step()
            except BaseException as e:  # noqa: BLE001  re-raised below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(opt,)) for _, opt in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    else:
        for _, opt in ranks:
            opt.step()
    with torch.no_grad():
        for k in range(len(ranks[0][1].arenas)):
            full = torch.cat([opt.shards[k].param for _, opt in ranks])
            for _, opt in ranks:
                opt.arenas[k].param.copy_(full)


def _whole_step(opt: ko.ArenaOptimizer, ps: list[nn.Parameter], grads, only=None) -> None:
    opt.zero_grad()
    for k, (p, g) in enumerate(zip(ps, grads)):
        if g is not None and (only is None or k in only):
            p.grad = g.clone()  # placed outside the arena: copied in, counts as received
    opt.step()


def _step_alike(whole: ko.ArenaOptimizer, whole_ps: list[nn.Parameter], ranks, steps: range) -> None:
    """Step the whole optimizer and the ranks' shards on the same gradients; after every step
    the gathered arenas equal the whole one's bit for bit."""
    for step in steps:
        grads = _grads(whole_ps, step)
        _whole_step(whole, whole_ps, grads)
        for ps, opt in ranks:
            _feed(opt, ps, grads)
        _step(ranks, threaded=False)
        for k, arena in enumerate(whole.arenas):
            assert torch.equal(arena.param, ranks[0][1].arenas[k].param), (step, k)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["adamw", "adam-amsgrad", "sgd-nesterov", "sgd"])
def test_shards_step_bitwise_like_the_whole_arena(name, world):
    """fp32 and complex arenas, a frozen tensor: after every step the concatenated shards equal
    the whole optimizer's arena bit for bit; each rank's state dict holds exactly its pieces of
    the whole one's state (none at all for SGD without momentum), the pieces tile every
    parameter, and the ranks' state adds up to the whole one's."""
    whole_ps = _params(torch.float32, frozen=(2,), cplx=True)
    whole = OPTS[name](_groups(whole_ps), world)
    ranks = _shard_all(name, torch.float32, world, frozen=(2,), cplx=True)
    _step_alike(whole, whole_ps, ranks, range(STEPS))
    assert torch.equal(whole_ps[2], ranks[0][0][2])  # frozen: never stepped
    sd = whole.state_dict()
    if name == "sgd":
        assert sd["state"] == {}
    covered: dict[int, list[tuple[int, int]]] = {}
    for _, opt in ranks:
        mine = opt.state_dict()
        assert mine["state"].keys() == sd["state"].keys()
        for idx, (a, b) in mine["pieces"].items():
            covered.setdefault(idx, []).append((a, b))
        for idx, st in mine["state"].items():
            a, b = mine["pieces"].get(idx, (0, 0))
            for n, v in st.items():
                want = sd["state"][idx][n]
                assert torch.equal(v, want if n == "step" else want.reshape(-1)[a:b]), (idx, n)
    by_index = [p for g in whole.param_groups for p in g["params"]]
    for idx, p in enumerate(by_index):
        ranges = sorted(covered[idx])
        assert ranges[0][0] == 0 and ranges[-1][1] == p.numel(), (idx, ranges)
        assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:])), (idx, ranges)
    assert sum(opt.state_bytes() for _, opt in ranks) == whole.state_bytes()


@pytest.mark.parametrize("order", ["shard_then_load", "load_then_shard"])
def test_differing_step_counts_and_a_full_state_dict(order):
    """Two tensors miss the first 2 steps, so the arena steps in runs of unequal step counts;
    ranks built from the whole optimizer's full state dict (loaded into a shard, or held
    when sharding) go on bitwise like it, in fp64."""
    world = 2
    whole_ps = _params(torch.float64)
    whole = OPTS["adamw"](_groups(whole_ps), world)
    for step in range(2):
        _whole_step(whole, whole_ps, _grads(whole_ps, step), only={0, 2, 3, 5})
    sd = whole.state_dict()
    assert sorted(int(s["step"]) for s in sd["state"].values()) == [2, 2, 2, 2]
    ranks = []
    for r in range(world):
        ps = _params(torch.float64)
        with torch.no_grad():
            for p, q in zip(ps, whole_ps):
                p.copy_(q)
        opt = OPTS["adamw"](_groups(ps), world)
        if order == "shard_then_load":
            opt.shard(r, world)
            opt.load_state_dict(sd)
        else:
            opt.load_state_dict(sd)
            opt.shard(r, world)
        ranks.append((ps, opt))
    _step_alike(whole, whole_ps, ranks, range(2, 2 + STEPS))
    steps = {idx: int(s["step"]) for idx, s in ranks[1][1].state_dict()["state"].items()}
    assert steps == {idx: int(s["step"]) for idx, s in whole.state_dict()["state"].items()}
    assert sorted(steps.values()) == [STEPS] * 2 + [STEPS + 2] * 4


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["lamb", "lars", "lars-nesterov", "lamb-native", "lars-native"])
def test_lamb_and_lars_shards_sum_norms_like_the_paper(name, world):
    """fp64 with a frozen tensor: every tensor's trust ratio comes from norms summed over the
    shards (a rank whose shard a run misses still joins the sum); the gathered parameters
    follow the per-tensor reference to 1e-12."""
    ref_ps = [p.detach().clone() for p in _params(torch.float64, frozen=(2,))]
    trainable = [k for k in range(len(SHAPES)) if k != 2]
    ranks = _shard_all(name, torch.float64, world, threaded=True, frozen=(2,))
    state: list[dict] = [{}, {}]
    for step in range(STEPS):
        grads = _grads(ranks[0][0], step)
        lamb = name.startswith("lamb")
        for gi, (lr, wd) in enumerate([(1e-2 if lamb else 0.5, 0.1 if lamb else 1e-2), (5e-3, 0.0)]):
            ks = [k for k in trainable if k % 2 == gi]
            ws, gs = [ref_ps[k] for k in ks], [grads[k] for k in ks]
            if lamb:
                _ref_lamb(ws, gs, state[gi], lr, 0.9, 0.999, 1e-6, wd, step + 1)
            else:
                _ref_lars(ws, gs, state[gi], lr, 0.9, wd, 0.001, name == "lars-nesterov")
        for ps, opt in ranks:
            _feed(opt, ps, grads)
        _step(ranks, threaded=True)
    for ps, _ in ranks:
        for k, (p, ref) in enumerate(zip(ps, ref_ps)):
            assert (p.detach() - ref).abs().max() <= 1e-12 * ref.abs().max(), (k, name, world)


def test_shard_refuses_what_it_cannot_do():
    ps = _params(torch.float32)
    with pytest.raises(ValueError, match="shard_multiple=3"):
        ko.AdamW(_groups(ps), shard_multiple=2).shard(0, 3)
    with pytest.raises(TypeError, match="contiguous"):
        ko.AdamW(_groups(_params(torch.float32)), contiguous=False).shard(0, 2)
    opt = ko.AdamW(_groups(_params(torch.float32)), shard_multiple=2)
    opt.shard(1, 2)
    with pytest.raises(RuntimeError, match="already sharded"):
        opt.shard(0, 2)
    other = ko.AdamW(_groups(_params(torch.float32)), shard_multiple=2)
    other.shard(0, 2)
    for o in (opt, other):
        o.arenas[0].grad.normal_()
        o.step()
    with pytest.raises(ValueError, match="another sharding"):
        other.load_state_dict(opt.state_dict())  # rank 1's pieces into rank 0
    with pytest.raises(ValueError, match="sharded the same way"):
        ko.AdamW(_groups(_params(torch.float32)), shard_multiple=2).load_state_dict(opt.state_dict())
