"""Tests for kiln.optim: numerics against torch.optim and paper references, and the
must-not-break behaviours of the arena (zero_grad, relinking, groups, frozen and tied
parameters, GradScaler, clipping, schedulers, state dicts, >2^31 offsets)."""

from __future__ import annotations

import copy
import inspect
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("KILN_OPTIM_EAGER", "1")  # the compiled path has its own test below

import kiln.optim as ko  # noqa: E402
from kiln.optim._chain import Update, run  # noqa: E402
from kiln.optim._lists import ListSpace  # noqa: E402
from kiln.optim._norms import tensor_norms  # noqa: E402
from kiln.optim._rules import TensorList  # noqa: E402



pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


X = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randn(32, 4, generator=torch.Generator().manual_seed(2))


def make_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4)).to(dtype)


def two_groups(model, **second):
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, **second}]


def train(model, opt, steps, x=X, y=Y, zero=lambda o, m: o.zero_grad()):
    for _ in range(steps):
        zero(opt, model)
        F.mse_loss(model(x.to(next(model.parameters()).dtype)), y.to(next(model.parameters()).dtype)).backward()
        opt.step()


def max_rel(m1, m2):
    return max(((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()
               for a, b in zip(m1.parameters(), m2.parameters()))


# -- arena ------------------------------------------------------------------------------------
def test_arena_layout_is_aligned_padded_and_views_share_storage():
    w, b, e = (torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(7)),
               torch.nn.Parameter(torch.randn(0)))
    vals = [w.detach().clone(), b.detach().clone()]
    arena = ko.Arena([w, b, e], shard_multiple=3)
    assert arena.offsets.dtype == torch.int64
    assert arena.offsets.tolist() == [0, 16, 32] and arena.numel == 48  # 16 fp32 = 64 bytes
    assert arena.numel % (16 * 3) == 0 and arena.shard(1) == (16, 32)
    assert all(o * 4 % 64 == 0 for o in arena.offsets.tolist())
    assert torch.equal(w, vals[0]) and torch.equal(b, vals[1]) and e.numel() == 0
    assert w.data_ptr() == arena.param.data_ptr() and b.data_ptr() == arena.param[16:].data_ptr()
    assert arena.param[15] == 0 and arena.param[23:32].abs().sum() == 0  # padding is zero
    assert arena.numels == [15, 7, 0] and arena.shapes == [(3, 5), (7,), (0,)]


def test_arena_offsets_beyond_2_pow_31_without_allocating():
    offsets, total = ko.arena_layout([2**31 + 3, 5, 2**31], itemsize=2, shard_multiple=8)
    assert offsets == [0, 2**31 + 32, 2**31 + 64] and total % (32 * 8) == 0 and total >= 2**32 + 64
    # the same logic on the meta device: int64 offsets, views at > 2^31 elements
    big = torch.nn.Parameter(torch.empty(2**31 + 3, device="meta"))
    small = torch.nn.Parameter(torch.empty(4, 5, device="meta"))
    arena = ko.Arena([big, small])
    assert arena.offsets.tolist() == [0, 2**31 + 16] and arena.offsets.dtype == torch.int64
    assert small.shape == (4, 5) and small.storage_offset() == 2**31 + 16
    assert arena.segment_range(1) == (2**31 + 16, 2**31 + 48)


# -- numerics ---------------------------------------------------------------------------------
TORCH_PAIRS = [
    ("sgd_nesterov", torch.optim.SGD, ko.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.05)),
    ("sgd_momentum", torch.optim.SGD, ko.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.05)),
    ("adam", torch.optim.Adam, ko.Adam, dict(lr=1e-3, weight_decay=0.05)),
    ("adamw", torch.optim.AdamW, ko.AdamW, dict(lr=1e-3, weight_decay=0.1)),
    ("adamw_amsgrad", torch.optim.AdamW, ko.AdamW, dict(lr=1e-3, weight_decay=0.1, amsgrad=True)),
]


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("name,tcls,kcls,kw", TORCH_PAIRS, ids=[t[0] for t in TORCH_PAIRS])
def test_matches_torch_optim_100_steps_two_groups(name, tcls, kcls, kw, contiguous):
    m1, m2 = make_model(), make_model()
    o1 = tcls(two_groups(m1, lr=kw["lr"] / 2), foreach=False, **kw)
    o2 = kcls(two_groups(m2, lr=kw["lr"] / 2), contiguous=contiguous, **kw)
    train(m1, o1, 100)
    train(m2, o2, 100)
    assert max_rel(m1, m2) < 1e-6


FUSED = [(name, kcls, kw) for name, _, kcls, kw in TORCH_PAIRS] + [
    ("sgd_maximize", ko.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.05, maximize=True)),
    ("sgd_plain", ko.SGD, dict(lr=1e-2)),
    ("adam_amsgrad_maximize", ko.Adam, dict(lr=1e-3, weight_decay=0.05, amsgrad=True, maximize=True)),
]


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("name,kcls,kw", FUSED, ids=[t[0] for t in FUSED])
def test_each_fused_kernel_matches_the_chain_it_fuses(name, kcls, kw, contiguous):
    """torch's fused kernel, what SGD and Adam(W) run on CPU and CUDA, against the class's
    chain over the same buffers (_force_rule): the flat arena and per-parameter lists, fp64."""
    m1, m2 = make_model(torch.float64), make_model(torch.float64)
    o1, o2 = (kcls(two_groups(m), contiguous=contiguous, **kw) for m in (m1, m2))
    o2._force_rule = True
    train(m1, o1, 30)
    train(m2, o2, 30)
    assert max_rel(m1, m2) < 1e-12


def _ref_lamb(params, grads, state, lr, b1, b2, eps, wd, t, clip=None):
    """Per-tensor LAMB straight from the paper (Algorithm 2 with bias correction)."""
    for i, (w, g) in enumerate(zip(params, grads)):
        m, v = state.setdefault(i, (torch.zeros_like(w), torch.zeros_like(w)))
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        state[i] = (m, v)
        u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps) + wd * w
        wn, un = w.norm(), u.norm()
        if clip is not None:
            wn = wn.clamp(max=clip)
        r = wn / un if wn > 0 and un > 0 else 1.0
        w -= lr * r * u


def _ref_lars(params, grads, bufs, lr, mom, wd, eta, nesterov, exclude_1d=True):
    """Per-tensor LARS as documented in kiln.optim.LARS."""
    for i, (w, g) in enumerate(zip(params, grads)):
        skip = exclude_1d and w.ndim <= 1
        d = g if skip else g + wd * w
        wn, dn = w.norm(), d.norm()
        q = 1.0 if skip or wn == 0 or dn == 0 else eta * wn / dn
        buf = mom * bufs.get(i, torch.zeros_like(w)) + q * d
        bufs[i] = buf
        w -= lr * ((q * d + mom * buf) if nesterov else buf)


def _groups_ref(model):
    """The reference sees the same two groups: (params, lr, wd) per group."""
    return [(list(p for p in model.parameters() if p.ndim > 1), 1.0),
            (list(p for p in model.parameters() if p.ndim <= 1), 0.0)]


# LAMB and LARS implementations: the arena's eager rule, the arena's native CPU kernels
# (kiln.optim._native; compile=True on CPU), per-parameter lists
IMPLS = {"arena": dict(compile=False), "native": dict(compile=True), "lists": dict(contiguous=False)}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("clip", [None, 0.5])
def test_lamb_matches_paper_reference(impl, clip):
    m1, m2 = make_model(), make_model()
    lr, wd = 1e-3, 0.1
    opt = ko.LAMB(two_groups(m2, lr=lr / 2), lr=lr, weight_decay=wd, trust_clip=clip, **IMPLS[impl])
    train(m2, opt, 100)
    states = [{}, {}]
    for t in range(1, 101):
        for p in m1.parameters():
            p.grad = None
        F.mse_loss(m1(X), Y).backward()
        with torch.no_grad():
            for k, (ps, wdk) in enumerate(_groups_ref(m1)):
                _ref_lamb(ps, [p.grad for p in ps], states[k], lr / (2 if k else 1), 0.9, 0.999, 1e-6,
                          wd * wdk, t, clip)
    assert max_rel(m1, m2) < 1e-6


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_matches_reference(impl, nesterov):
    m1, m2 = make_model(), make_model()
    lr, wd = 0.5, 0.01
    groups = [{"params": list(m2.parameters())[:3]}, {"params": list(m2.parameters())[3:], "lr": lr / 2}]
    opt = ko.LARS(groups, lr=lr, weight_decay=wd, nesterov=nesterov, **IMPLS[impl])
    train(m2, opt, 100)
    bufs = [{}, {}]
    ps = list(m1.parameters())
    for _ in range(100):
        for p in ps:
            p.grad = None
        F.mse_loss(m1(X), Y).backward()
        with torch.no_grad():
            for k, (sub, lrk) in enumerate([(ps[:3], lr), (ps[3:], lr / 2)]):
                _ref_lars(sub, [p.grad for p in sub], bufs[k], lrk, 0.9, wd, 0.001, nesterov)
    assert max_rel(m1, m2) < 1e-6


def _lamb_rows_reference(p, g, m, v, seg_rows, blk, hp):
    """LAMB's chain (ko.LAMB.chain, run eagerly over a list of tensors) on rows of blk elements,
    seg_rows rows per tensor: (new w, u, ratios); m and v are updated in place."""
    b1, b2, c1, c2, eps, wd, bc1, bc2, lr, clip = hp.tolist()
    step = round(math.log(1 - bc1) / math.log(b1))  # bc1 = 1 - b1 ** step
    group = dict(betas=(b1, b2), eps=eps, weight_decay=wd, lr=lr, trust_clip=None if clip < 0 else clip)
    seen = {}

    class Seen(ListSpace):  # what the chain's trust ratio saw: u, and the ratios
        def norms(self, a, b):
            seen["u"] = torch.cat(b.ts)
            return super().norms(a, b)

        def scale(self, u, r):
            seen["r"] = r
            return super().scale(u, r)

    sizes = [r * blk for r in seg_rows]
    w = p.clone()
    parts = [TensorList(t.split(sizes)) for t in (w, g, m, v)]
    space = Seen(parts[0].ts, lambda ts: tensor_norms(ts, 2))
    hs = ko.LAMB.chain.hyper(group, step, space)
    run(ko.LAMB.chain, Update(parts[0], parts[1], {"exp_avg": parts[2], "exp_avg_sq": parts[3]}), hs, space)
    return w, seen["u"].clone(), seen["r"]


@pytest.mark.parametrize("beta1", [0.9, 0.3])  # torch's lerp has a branch at weight 0.5
@pytest.mark.parametrize("clip", [-1.0, 0.8])
def test_native_lamb_kernel_every_mode_on_rows_with_short_tails(beta1, clip):
    """The native kernel on rows of 13 elements (no multiple of any vector width, so every row
    ends in a short tail) and tensors of 2, 1, 0 and 3 rows, one of them zero: the whole step
    with u kept, with u recomputed (a group longer than the buffer) and in one group, and a
    shard's two passes apart, each equal to LAMB's chain in float64 to 1e-13."""
    from kiln.optim import _native

    blk, seg_rows = 13, [2, 1, 0, 3]
    n, B, S = blk * sum(seg_rows), sum(seg_rows), len(seg_rows)
    gen = torch.Generator().manual_seed(0)
    p0, g, m0 = (torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(3))
    v0 = torch.rand(n, generator=gen, dtype=torch.float64)
    p0[2 * blk:3 * blk] = 0.0  # a zero tensor: ratio 1
    hp = torch.tensor([beta1, 0.99, 1 - beta1, 1 - 0.99, 1e-6, 0.05, 1 - beta1 ** 3, 1 - 0.99 ** 3, 1e-2, clip],
                      dtype=torch.float64)
    rows = torch.tensor(seg_rows)
    full = torch.full((B,), blk)  # every element of every row is real (the padded case: test_user_models)
    kernel = _native.kernel("lamb", p0)
    assert kernel is not None
    mr, vr = m0.clone(), v0.clone()
    want, u, r = _lamb_rows_reference(p0.clone(), g, mr, vr, seg_rows, blk, hp)
    assert 0.0 < r.min() < r.max() and r[1] == 1.0
    for name, cap, group in [("kept", 64, 30), ("recomputed", 10, 30), ("one group", n, n)]:
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        sq, ub = (torch.empty(k, dtype=torch.float64) for k in (2 * B, cap))
        kernel(p, g, m, v, sq, ub, hp, rows, full, S, B, blk, group, cap, 0, 2)
        for got, ref in ((p, want), (m, mr), (v, vr)):
            assert torch.allclose(got, ref, rtol=1e-13, atol=1e-15), name
    # a shard: pass A (sums of squares per row), the ratios from them, pass B
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    sq, ub = torch.empty(2 * B, dtype=torch.float64), torch.empty(1, dtype=torch.float64)
    kernel(p, g, m, v, sq, ub, hp, rows, full, S, B, blk, 0, 0, 1, 2)
    assert torch.equal(p, p0) and torch.allclose(m, mr, rtol=1e-15) and torch.allclose(v, vr, rtol=1e-15)
    assert torch.allclose(sq[:B], p0.view(B, blk).square().sum(1), rtol=1e-14)
    assert torch.allclose(sq[B:], u.view(B, blk).square().sum(1), rtol=1e-13)
    sq[:B] = -1e-2 * torch.repeat_interleave(r, rows)
    kernel(p, g, m, v, sq, ub, hp, rows, full, S, B, blk, 0, 0, 2, 2)
    assert torch.allclose(p, want, rtol=1e-13, atol=1e-15)


def test_native_lamb_keeps_no_arena_sized_scratch_and_lars_none():
    """The native LAMB keeps u for one cache-sized group of tensors, not for the arena: its
    state is m and v plus that buffer, against m, v and a whole-arena u eagerly; LARS's native
    kernels recompute the direction and keep no buffer at all."""
    from kiln.optim._optimizers import _LAMB_GROUP

    sizes = {}
    for impl in ("arena", "native"):
        m = make_model()
        opt = ko.LAMB(m.parameters(), lr=1e-3, **IMPLS[impl])
        train(m, opt, 2)
        sizes[impl] = opt.state_bytes()
    arena = opt.arenas[0].param.numel() * 4
    assert sizes["arena"] == 3 * arena
    assert sizes["native"] == 2 * arena + _LAMB_GROUP  # the model is smaller than one group
    m = make_model()
    opt = ko.LARS(m.parameters(), lr=0.1, weight_decay=1e-4, compile=True)
    train(m, opt, 2)
    assert opt.state_bytes() == opt.arenas[0].param.numel() * 4  # the momentum buffer alone


def test_native_kernels_that_cannot_be_built_warn_once_and_fall_back(monkeypatch):
    """Without a compiler (the build raises) LAMB and LARS warn once, naming the cause and
    the fix, and step exactly as the eager rule does."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    from kiln.optim import _flat, _native

    def broken(*a, **k):
        raise RuntimeError("g++: not found")

    monkeypatch.setattr(_native, "_BUILT", {})
    monkeypatch.setattr(CppPythonBindingsCodeCache, "load_pybinding", broken)
    monkeypatch.setattr(_flat, "kernel", lambda fn, compiled: fn)  # no torch.compile either
    for cls, kw in [(ko.LAMB, dict(lr=1e-2, weight_decay=0.1)), (ko.LARS, dict(lr=0.5, weight_decay=0.01))]:
        m1, m2 = make_model(), make_model()
        o1 = cls(m1.parameters(), compile=False, **kw)
        o2 = cls(m2.parameters(), compile=True, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(m1, o1, 3)
            train(m2, o2, 3)
        msgs = [str(w.message) for w in caught if "native" in str(w.message)]
        assert len(msgs) == 1 and "g++: not found" in msgs[0] and "C++ compiler" in msgs[0], msgs
        assert max_rel(m1, m2) == 0.0


def test_lamb_trust_ratio_is_per_tensor_not_global():
    # two tensors with very different scales: a global ratio would move them by the same factor
    a = torch.nn.Parameter(torch.full((4, 4), 10.0))
    b = torch.nn.Parameter(torch.full((4, 4), 0.01))
    opt = ko.LAMB([a, b], lr=0.1)
    a.grad, b.grad = torch.ones(4, 4), torch.ones(4, 4)
    opt.step()
    # ||u|| = ||1|| per tensor (Adam's first step), so each tensor moves by lr * ||w|| / ||1|| per element
    assert torch.allclose(10.0 - a.detach(), torch.full((4, 4), 0.1 * 10.0), rtol=1e-4)
    assert torch.allclose(0.01 - b.detach(), torch.full((4, 4), 0.1 * 0.01), rtol=1e-4)


def test_lars_zero_norm_gives_ratio_one():
    w = torch.nn.Parameter(torch.zeros(3, 3))
    opt = ko.LARS([w], lr=0.1, momentum=0.0, eta=0.001)
    w.grad = torch.ones(3, 3)
    opt.step()
    assert torch.allclose(w.detach(), torch.full((3, 3), -0.1))  # q = 1, not eta * 0


@pytest.mark.e2e
def test_compiled_lamb_and_lars_match_eager_and_do_not_recompile_on_lr_change(monkeypatch):
    """torch.compile's kernels: what LAMB and LARS run where no native kernel serves (CUDA,
    16-bit arenas, or no C++ compiler), forced here on CPU."""
    from kiln.optim import _native

    monkeypatch.setattr(_native, "kernel", lambda name, like: None)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()  # other tests in this process compiled graphs of their own

    for cls, kw in [(ko.LAMB, dict(lr=1e-2, weight_decay=0.1)), (ko.LARS, dict(lr=0.5, weight_decay=0.01))]:
        m1, m2 = make_model(), make_model()
        o1 = cls(two_groups(m1), compile=False, **kw)
        o2 = cls(two_groups(m2), compile=True, **kw)
        s1 = torch.optim.lr_scheduler.StepLR(o1, 1, gamma=0.9)
        s2 = torch.optim.lr_scheduler.StepLR(o2, 1, gamma=0.9)
        for step in range(5):
            train(m1, o1, 1)
            train(m2, o2, 1)
            s1.step()
            s2.step()
            if step == 0:
                graphs = counters["stats"]["unique_graphs"]
        assert max_rel(m1, m2) < 1e-5
        assert counters["stats"]["unique_graphs"] == graphs, cls  # the new lrs: no new graph
    # one graph per kernel, the two kernels around the trust ratio (see kiln.optim._flat), for both
    # groups' arenas of different sizes
    assert counters["stats"]["unique_graphs"] <= 4


# -- must-not-break ---------------------------------------------------------------------------
def test_zero_grad_set_to_none_and_model_zero_grad_still_train():
    ref, m1, m2 = make_model(), make_model(), make_model()
    o_ref = torch.optim.AdamW(ref.parameters(), foreach=False)
    o1, o2 = ko.AdamW(m1.parameters()), ko.AdamW(m2.parameters())
    train(ref, o_ref, 5)
    train(m1, o1, 5, zero=lambda o, m: o.zero_grad(set_to_none=True))
    train(m2, o2, 5, zero=lambda o, m: m.zero_grad())  # p.grad = None: autograd allocates fresh grads
    assert max_rel(ref, m1) < 1e-6 and max_rel(ref, m2) < 1e-6
    # the foreign gradient was copied in and the view restored
    arena = o2.arenas[0]
    w = m2[0].weight
    assert w.grad.data_ptr() == arena.gviews[0].data_ptr()


def test_gradient_assigned_outside_the_arena_is_copied_in():
    w = torch.nn.Parameter(torch.ones(4))
    opt = ko.SGD([w], lr=1.0)
    w.grad = torch.full((4,), 2.0)  # a new tensor, not the arena view
    opt.step()
    assert torch.equal(w.detach(), torch.full((4,), -1.0))
    assert w.grad.data_ptr() == opt.arenas[0].grad.data_ptr()


def test_half_and_to_after_construction_are_refused_then_relinked():
    m = make_model()
    opt = ko.AdamW(m.parameters())
    train(m, opt, 2)
    m.double()
    opt.zero_grad()
    F.mse_loss(m(X.double()), Y.double()).backward()
    with pytest.raises(RuntimeError, match="relink"):
        opt.step()
    opt.relink()
    before = m[0].weight.detach().clone()
    opt.step()
    assert opt.arenas[0].dtype == torch.float64 and opt.state[m[0].weight]["exp_avg"].dtype == torch.float64
    assert not torch.equal(before, m[0].weight.detach())
    assert int(opt.state[m[0].weight]["step"]) == 3


def _stale_warnings(records) -> list[str]:
    return [str(w.message) for w in records if "no new gradient" in str(w.message)]


def _max_rel_params(ps1, ps2):
    return max(((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item() for a, b in zip(ps1, ps2))


@pytest.mark.parametrize("zero_name", ["optimizer.zero_grad", "model.zero_grad"])
def test_load_state_dict_assign_warns_once_naming_the_fix_and_steps_like_torch(zero_name):
    # after assign=True the model holds new Parameter objects and both optimizers the old ones:
    # torch then trains nothing (optimizer.zero_grad: the old grads are None) or re-applies the
    # old gradients (model.zero_grad clears only the new ones). kiln does the same, and warns once.
    zero = (lambda o, mm: o.zero_grad()) if zero_name == "optimizer.zero_grad" else (lambda o, mm: mm.zero_grad())
    models = [make_model(), make_model()]
    opts = [torch.optim.AdamW(models[0].parameters(), foreach=False), ko.AdamW(models[1].parameters())]
    for m, o in zip(models, opts):
        train(m, o, 1)
    held = [list(o.param_groups[0]["params"]) for o in opts]
    loaded = []
    for m in models:
        m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
        loaded.append({k: v.clone() for k, v in m.state_dict().items()})
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for m, o in zip(models, opts):
            train(m, o, 3, zero=zero)
    msgs = _stale_warnings(rec)
    assert len(msgs) == 1 and "assign=True" in msgs[0] and "build the optimizer after loading" in msgs[0]
    for m, before in zip(models, loaded):  # the live model is not trained, with torch as with kiln
        assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert _max_rel_params(held[0], held[1]) < 1e-6
    assert int(opts[1].state[held[1][0]]["step"]) == int(opts[0].state[held[0][0]]["step"])


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("name,tcls,kcls,kw", TORCH_PAIRS, ids=[t[0] for t in TORCH_PAIRS])
def test_step_without_a_new_gradient_does_what_torch_does(name, tcls, kcls, kw, contiguous):
    # step(); step() applies the update again on the same gradients; zero_grad(); step() skips
    # every parameter (torch: grad None); zero_grad(set_to_none=False); step() steps on zeros.
    # The first backward leaves the last layer without a gradient: it must stay out of repeats.
    models = [make_model(), make_model()]
    opts = [tcls(models[0].parameters(), foreach=False, **kw),
            kcls(models[1].parameters(), contiguous=contiguous, **kw)]

    def backward_partial(m, o):
        F.mse_loss(m[2](m[1](m[0](X)))[:, :4], Y).backward()

    def backward(m, o):
        F.mse_loss(m(X), Y).backward()

    script = [backward_partial, lambda m, o: o.step(), lambda m, o: o.step(),
              lambda m, o: o.zero_grad(), lambda m, o: o.step(),
              backward, lambda m, o: o.step(), lambda m, o: o.step(),
              lambda m, o: o.zero_grad(set_to_none=False), lambda m, o: o.step()]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for k, action in enumerate(script):
            for m, o in zip(models, opts):
                action(m, o)
            assert max_rel(models[0], models[1]) < 1e-6, k
            steps = [{i: int(st.get("step", -1)) for i, st in o.state_dict()["state"].items()} for o in opts]
            assert steps[0] == steps[1], k
    # only the arena can see that no gradient arrived: it says so once (see kiln.optim._base)
    assert len(_stale_warnings(rec)) == (1 if contiguous else 0)


def test_grad_scaler_skipped_step_is_not_a_step_without_gradient():
    m = make_model()
    opt = ko.AdamW(m.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for t in range(3):  # a skipped step (inf gradient) followed by a normal one
            opt.zero_grad()
            scaler.scale(F.mse_loss(m(X), Y)).backward()
            if t == 1:
                m[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
    assert not _stale_warnings(rec)
    assert int(opt.state[m[0].weight]["step"]) == 2 and scaler.get_scale() == 4.0


@pytest.mark.parametrize("name,tcls,kcls,kw", TORCH_PAIRS, ids=[t[0] for t in TORCH_PAIRS])
def test_list_mode_per_tensor_step_counts_and_fallback_rule(name, tcls, kcls, kw):
    """contiguous=False: torch's fused kernel with per-tensor steps (a parameter misses a step),
    and the pure rule (devices without fused kernels) on the same lists agree with torch."""
    models = [make_model() for _ in range(3)]
    opts = [tcls(models[0].parameters(), foreach=False, **kw),
            kcls(models[1].parameters(), contiguous=False, **kw),
            kcls(models[2].parameters(), contiguous=False, **kw)]
    opts[2]._force_rule = True
    for t in range(4):
        for model, o in zip(models, opts):
            o.zero_grad()
            h = model[2](model[1](model[0](X)))
            F.mse_loss(model[3](h) if t != 1 else h[:, :4], Y).backward()
            o.step()
    assert max_rel(models[0], models[1]) < 1e-6 and max_rel(models[0], models[2]) < 1e-6


def test_step_hooks_and_profiler_still_see_kiln_steps():
    m = make_model()
    opt = ko.AdamW(m.parameters())
    seen = []
    h1 = opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    h2 = opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
    train(m, opt, 2)
    h1.remove()
    h2.remove()
    train(m, opt, 1)
    assert seen == ["pre", "post", "pre", "post"]
    with torch.profiler.profile() as prof:
        train(m, opt, 1)
    assert any(e.key == "Optimizer.step#AdamW.step" for e in prof.key_averages())


def test_load_state_dict_without_assign_and_p_data_swap_keep_training():
    m = make_model()
    opt = ko.SGD(m.parameters(), lr=0.1)
    sd = {k: v.clone() + 1 for k, v in m.state_dict().items()}
    m.load_state_dict(sd)  # copies into the arena views
    m[3].bias.data = torch.zeros(4)  # same dtype/shape, new storage: copied back in at step
    train(m, opt, 1)
    arena = opt.arenas[0]
    assert m[3].bias.data_ptr() == arena.pviews[-1].data_ptr()
    assert not torch.equal(m[3].bias.detach(), torch.zeros(4))


def test_dtypes_and_groups_with_own_lr_and_decay():
    m = make_model()
    m[3].to(torch.float64)
    params = list(m.parameters())
    groups = [{"params": params[:2], "lr": 0.1, "weight_decay": 0.5}, {"params": params[2:4], "weight_decay": 0.0},
              {"params": params[4:], "lr": 0.01}]
    opt = ko.AdamW(groups, lr=0.05)
    assert [(a.dtype, len(a.numels)) for a in opt.arenas] == [(torch.float32, 2), (torch.float32, 2),
                                                                (torch.float64, 2)]
    ref = copy.deepcopy(m)
    ref_opt = torch.optim.AdamW([{**g, "params": list(ref.parameters())[i:j]}
                                 for g, (i, j) in zip(groups, [(0, 2), (2, 4), (4, 6)])], lr=0.05, foreach=False)

    def run(model, o):
        for _ in range(5):
            o.zero_grad()
            model[3](torch.tanh(model[1](model[0](X))).double()).square().mean().backward()
            o.step()

    run(m, opt)
    run(ref, ref_opt)
    assert max_rel(m, ref) < 1e-6


def test_frozen_and_unused_parameters_are_left_exactly_alone():
    m = make_model()
    extra = torch.nn.Linear(4, 4)  # never used in forward: no gradient ever
    m[1].weight.requires_grad_(False)
    params = list(m.parameters()) + list(extra.parameters())
    opt = ko.AdamW(params, weight_decay=0.5, lr=0.1)
    frozen, unused = m[1].weight.detach().clone(), extra.weight.detach().clone()
    train(m, opt, 3)
    assert torch.equal(m[1].weight.detach(), frozen) and torch.equal(extra.weight.detach(), unused)
    assert m[1].weight not in opt.state and extra.weight not in opt.state
    assert int(opt.state[m[0].weight]["step"]) == 3
    # a parameter that misses one step: no decay, no momentum that step, and its own step count
    m2, ref = make_model(), make_model()
    o2, oref = ko.AdamW(m2.parameters(), lr=0.05), torch.optim.AdamW(ref.parameters(), lr=0.05, foreach=False)
    for t in range(4):
        for model, o in [(m2, o2), (ref, oref)]:
            o.zero_grad()
            h = model[2](model[1](model[0](X)))
            out = model[3](h) if t != 1 else h[:, :4]  # step 1: the last layer gets no gradient
            F.mse_loss(out, Y).backward()
            o.step()
    assert max_rel(m2, ref) < 1e-6
    assert int(o2.state[m2[3].weight]["step"]) == 3 and int(o2.state[m2[0].weight]["step"]) == 4


def test_tied_parameters_packed_and_updated_once():
    emb = torch.nn.Embedding(10, 8)
    head = torch.nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    ref_emb = copy.deepcopy(emb)
    opt = ko.AdamW(list(emb.parameters()) + list(head.parameters()), lr=0.1)
    assert len(opt.arenas[0].numels) == 1
    ref_opt = torch.optim.AdamW(ref_emb.parameters(), lr=0.1, foreach=False)
    idx = torch.tensor([1, 2, 3])
    for model_e, model_h, o in [(emb, head, opt), (ref_emb, None, ref_opt)]:
        for _ in range(3):
            o.zero_grad()
            h = model_e(idx)
            logits = model_h(h) if model_h is not None else h @ model_e.weight.t()
            F.cross_entropy(logits, idx).backward()
            o.step()
    assert torch.allclose(emb.weight, ref_emb.weight, rtol=0, atol=1e-6)


def test_grad_scaler_unscales_views_and_skips_non_finite_steps():
    m, ref = make_model(), make_model()
    opt, ref_opt = ko.SGD(m.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(ref.parameters(), lr=0.1,
                                                                               momentum=0.9)
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu",
                                                                                             init_scale=1024.0)
    for t in range(4):
        for model, o, s in [(m, opt, scaler), (ref, ref_opt, ref_scaler)]:
            o.zero_grad()
            s.scale(F.mse_loss(model(X), Y)).backward()
            if t == 2:
                model[0].weight.grad[0, 0] = float("inf")
                snapshot = ([p.detach().clone() for p in model.parameters()],
                            [o.state[p]["momentum_buffer"].clone() for p in model.parameters()])
            s.unscale_(o)
            s.step(o)
            s.update()
            if t == 2:  # skipped: parameters and momentum untouched
                assert all(torch.equal(a, b) for a, b in zip(snapshot[0], model.parameters()))
                assert all(torch.equal(a, o.state[p]["momentum_buffer"])
                           for a, p in zip(snapshot[1], model.parameters()))
    assert scaler.get_scale() == ref_scaler.get_scale() == 1024.0 * 0.5
    assert max_rel(m, ref) < 1e-6


def test_torch_clip_grad_norm_and_kiln_clip_grad_norm():
    m1, m2, ref = make_model(), make_model(), make_model()
    o1, o2 = ko.SGD(m1.parameters(), lr=0.1), ko.SGD(m2.parameters(), lr=0.1)
    oref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for model, o, clip in [(m1, o1, lambda: torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.05)),
                           (m2, o2, lambda: ko.clip_grad_norm_(o2, 0.05)),
                           (ref, oref, lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))]:
        o.zero_grad()
        F.mse_loss(model(X), Y).backward()
        model.norm = clip()
        o.step()
    assert torch.allclose(m1.norm, ref.norm) and torch.allclose(m2.norm, ref.norm) and ref.norm > 0.05
    assert max_rel(m1, ref) < 1e-6 and max_rel(m2, ref) < 1e-6


def test_lr_scheduler_is_honoured_every_step():
    m1, m2 = make_model(), make_model()
    o1 = torch.optim.AdamW(two_groups(m1, lr=3e-3), lr=1e-2, foreach=False)
    o2 = ko.AdamW(two_groups(m2, lr=3e-3), lr=1e-2)
    s1 = torch.optim.lr_scheduler.OneCycleLR(o1, max_lr=[1e-2, 3e-3], total_steps=20)
    s2 = torch.optim.lr_scheduler.OneCycleLR(o2, max_lr=[1e-2, 3e-3], total_steps=20)
    for _ in range(20):
        train(m1, o1, 1)
        train(m2, o2, 1)
        s1.step()
        s2.step()
    assert max_rel(m1, m2) < 1e-6


@pytest.mark.parametrize("name,tcls,kcls,kw", [TORCH_PAIRS[0], TORCH_PAIRS[2], TORCH_PAIRS[3]],
                         ids=["sgd", "adam", "adamw"])
def test_state_dict_moves_between_torch_and_kiln(name, tcls, kcls, kw):
    ref, mk, mt = make_model(), make_model(), make_model()
    oref = tcls(two_groups(ref), foreach=False, **kw)
    ok_ = kcls(two_groups(mk), **kw)
    train(ref, oref, 3)
    train(mk, ok_, 3)
    sd = ok_.state_dict()
    assert sorted(sd["state"]) == list(range(6))
    tsd = oref.state_dict()
    assert set(sd["state"]) == set(tsd["state"])
    for k in tsd["state"]:
        assert set(sd["state"][k]) == set(tsd["state"][k])
        for n, v in tsd["state"][k].items():
            assert sd["state"][k][n].shape == v.shape and sd["state"][k][n].dtype == v.dtype
    assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in tsd["param_groups"]]
    # kiln -> torch: continue with torch.optim
    mt.load_state_dict(mk.state_dict())
    ot = tcls(two_groups(mt), foreach=False, **kw)
    ot.load_state_dict(sd)
    # torch -> kiln: a fresh kiln optimizer from torch's state
    mk2 = copy.deepcopy(ref)
    ok2 = kcls(two_groups(mk2), **kw)
    ok2.load_state_dict(oref.state_dict())
    for model, o in [(ref, oref), (mt, ot), (mk2, ok2), (mk, ok_)]:
        train(model, o, 5)
    assert max_rel(ref, mt) < 1e-6 and max_rel(ref, mk2) < 1e-6 and max_rel(ref, mk) < 1e-6


def test_zero_element_parameters():
    w = torch.nn.Parameter(torch.randn(3, 3))
    empty = torch.nn.Parameter(torch.randn(0, 5))
    for cls in (ko.SGD, ko.AdamW, ko.LAMB, ko.LARS):
        opt = cls([w, empty], lr=0.1)
        (w.sum() + empty.sum()).backward()
        opt.step()
        opt.zero_grad()
        assert empty.shape == (0, 5) and torch.isfinite(w).all()
        assert len(opt.state_dict()["state"]) == (0 if cls is ko.SGD else 2)  # torch's SGD: no momentum, no state


def test_zero_grad_is_one_memset_and_updates_are_in_the_arena():
    m = make_model()
    opt = ko.AdamW(m.parameters())
    train(m, opt, 1)
    arena = opt.arenas[0]
    assert arena.grad.abs().sum() > 0
    opt.zero_grad()
    assert arena.grad.abs().sum() == 0 and all(p.grad is not None for p in m.parameters())
    exp_avg = opt.state[m[0].weight]["exp_avg"]
    assert exp_avg.shape == m[0].weight.shape
    flat_exp_avg = opt.packing.packs[0].state["exp_avg"]
    assert exp_avg.untyped_storage().data_ptr() == flat_exp_avg.untyped_storage().data_ptr()


@pytest.mark.parametrize("options", [{}, {"momentum": 0.9}, {"momentum": 0.0}, {"amsgrad": True}])
def test_every_optimizer_keeps_exactly_the_state_it_declares(options):
    # kiln plan and the config read these class facts; a step must create exactly these tensors
    for name, cls in ko.OPTIMIZERS.items():
        takes = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in options.items() if k in takes}
        m = make_model()
        opt = cls(two_groups(m), lr=1e-3, **kwargs)
        train(m, opt, 1)
        params = [p for g in opt.param_groups for p in g["params"]]
        kept = set()
        for i, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                if k != "step":
                    assert v.shape == params[i].shape, (name, k)  # parameter-sized
                    kept.add(k)
        assert kept == set(cls.state_names_for(**kwargs)), (name, kwargs)
        assert opt.config_name == name and all(k in takes for k in cls.config_options)


def test_optimizers_registry_and_trainer_call():
    assert set(ko.OPTIMIZERS) == {"sgd", "adam", "adamw", "lamb", "lars"}
    for name, cls in ko.OPTIMIZERS.items():
        m = make_model()
        opt = cls(two_groups(m), lr=1e-3, weight_decay=0.01, contiguous=True)
        assert isinstance(opt, torch.optim.Optimizer)
        assert opt.param_groups[1]["weight_decay"] == 0.0
        train(m, opt, 2)


@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("exclude_1d", [True, False])
@pytest.mark.parametrize("nesterov", [False, True])
def test_native_lars_matches_the_chain_it_fuses_on_boundary_inputs(wd, exclude_1d, nesterov):
    """LARS's native kernels against its eager chain (add_decayed_weights -> trust_ratio ->
    heavy_ball -> apply) and the per-tensor reference, in fp64: a (20, 20) weight, a 7-element
    vector and a 0-d tensor, whose segments end in alignment padding that must stay zero."""
    torch.manual_seed(0)
    init = [torch.randn(20, 20, dtype=torch.float64), torch.randn(7, dtype=torch.float64),
            torch.randn((), dtype=torch.float64)]
    runs = {}
    for compile in (None, False):  # native where it builds, then the eager chain
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        opt = ko.LARS(ps, lr=0.5, weight_decay=wd, nesterov=nesterov, exclude_1d=exclude_1d, compile=compile)
        for step in range(10):
            opt.zero_grad()
            sum((p * (0.1 * (step + 1) + t)).sum() for p, t in zip(ps, init)).backward()
            opt.step()
        (arena,) = opt.arenas
        real = torch.zeros(arena.numel, dtype=torch.bool)
        for o, n in zip(arena.offsets.tolist(), arena.numels):
            real[o:o + n] = True
        assert arena.param[~real].eq(0).all()
        runs[compile] = [p.detach().clone() for p in ps]
    ref, bufs = [t.clone() for t in init], {}
    for step in range(10):
        _ref_lars(ref, [torch.full_like(t, 0.1 * (step + 1)) + t for t in init], bufs, 0.5, 0.9, wd, 0.001, nesterov,
                  exclude_1d)
    for native, eager, r in zip(runs[None], runs[False], ref):
        torch.testing.assert_close(native, eager, rtol=1e-13, atol=1e-14)
        torch.testing.assert_close(eager, r, rtol=1e-12, atol=1e-13)
