"""The arena's O(1) per-step check (issue 16, part 3): every change the fast path could miss,
each stepped side by side with torch.optim and compared after every action.

The fast path of ``Packing.sync`` (kiln.optim._packing) trusts three signals instead of looking at every
parameter: weak references to the gradient views it put in ``p.grad`` (they die when p.grad is
reassigned), the gradient hooks (they check the parameter and its gradient as autograd delivers
it), and the use count of the flat parameter's storage (``p.data = ...`` drops it)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("KILN_OPTIM_EAGER", "1")

import kiln.optim as ko  # noqa: E402
from kiln.optim import ArenaOptimizer  # noqa: E402
from kiln.optim._packing import Pack, Packing  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

X = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randn(32, 4, generator=torch.Generator().manual_seed(2))

PAIRS = [
    ("adamw", torch.optim.AdamW, ko.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    ("sgd", torch.optim.SGD, ko.SGD, dict(lr=1e-2, momentum=0.9)),
]


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def backward(m, o):
    F.mse_loss(m(X), Y).backward()


def step(m, o):
    o.step()


def zero(m, o):
    o.zero_grad()


def run_script(kcls, tcls, kw, script, models=None):
    """Apply each action to (torch model, torch optimizer) and (kiln model, kiln optimizer);
    parameters and step counts must agree after every action."""
    models = models or [make_model(), make_model()]
    opts = [tcls(models[0].parameters(), foreach=False, **kw), kcls(models[1].parameters(), **kw)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "no new gradient" warning is tested elsewhere
        for k, action in enumerate(script):
            for m, o in zip(models, opts):
                action(m, o)
            for a, b in zip(models[0].parameters(), models[1].parameters()):
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (k, action)
            steps = [{i: int(st.get("step", -1)) for i, st in o.state_dict()["state"].items()} for o in opts]
            assert steps[0] == steps[1], k
    return models, opts


@pytest.mark.parametrize("name,tcls,kcls,kw", PAIRS, ids=[p[0] for p in PAIRS])
def test_grad_swapped_for_a_same_shape_tensor_between_steps(name, tcls, kcls, kw):
    def swap(m, o):  # a new tensor of the same shape, after backward
        m[0].weight.grad = torch.full_like(m[0].weight, 0.5)

    def swap_again(m, o):  # and again with no backward in between
        m[3].bias.grad = torch.arange(4.0)

    run_script(kcls, tcls, kw, [zero, backward, step, zero, backward, swap, step, swap_again, step,
                                zero, backward, step])


@pytest.mark.parametrize("name,tcls,kcls,kw", PAIRS, ids=[p[0] for p in PAIRS])
def test_grad_set_to_none_for_some_parameters_then_step(name, tcls, kcls, kw):
    def drop(m, o):
        m[1].weight.grad = None
        m[3].weight.grad = None

    # step() after the drop with no backward: torch skips the two; then a backward reaches all
    run_script(kcls, tcls, kw, [zero, backward, step, drop, step, step, backward, step, zero, backward, step])


@pytest.mark.parametrize("name,tcls,kcls,kw", PAIRS, ids=[p[0] for p in PAIRS])
def test_param_data_replaced_with_and_without_a_backward(name, tcls, kcls, kw):
    def replace(m, o):  # same dtype and shape, new storage
        with torch.no_grad():
            m[0].bias.data = torch.linspace(-1, 1, 32)

    def replace_unused(m, o):  # a parameter no backward reaches before the steps
        with torch.no_grad():
            m[3].bias.data = m[3].bias.detach() + 1.0

    # replace then step() again on the same gradients (torch updates the new tensor), then
    # replace before a backward (the hook sees it), then a replaced one gets a gradient later
    run_script(kcls, tcls, kw, [zero, backward, step, replace, step, zero, replace, backward, step,
                                replace_unused, step, zero, backward, step])


def test_frozen_parameter_given_a_gradient_and_unfrozen_mid_training():
    models = [make_model(), make_model()]
    for m in models:
        m[1].weight.requires_grad_(False)

    def hand_grad(m, o):  # a gradient written by hand on a frozen parameter: torch steps it
        m[1].weight.grad = torch.full((32,), 0.25)

    def unfreeze(m, o):
        m[1].bias.requires_grad_(False)
        m[1].bias.grad = None
        m[1].weight.requires_grad_(True)

    def refreeze_bias_unfreeze(m, o):
        m[1].bias.requires_grad_(True)

    kw = dict(lr=1e-2, weight_decay=0.1)
    run_script(ko.AdamW, torch.optim.AdamW, kw,
               [zero, backward, step, hand_grad, step, zero, backward, step, unfreeze, zero, backward, step,
                refreeze_bias_unfreeze, zero, backward, step], models=models)


def test_old_gradient_view_held_elsewhere_then_grad_set_to_none_and_backward():
    # The weak reference cannot see this one (the user's list keeps the view alive), but the
    # gradient hooks do, as autograd hands the parameter a fresh gradient.
    held = []

    def drop_all_keep_refs(m, o):
        held.append([p.grad for p in m.parameters()])
        for p in m.parameters():
            p.grad = None

    run_script(ko.AdamW, torch.optim.AdamW, dict(lr=1e-2),
               [zero, backward, step, drop_all_keep_refs, backward, step, zero, backward, step])


def test_arena_view_put_back_by_hand_is_adopted():
    # what ZeRO-2 does between steps: p.grad = None, then the arena's own view put back
    models = [make_model(), make_model()]
    opts = [torch.optim.AdamW(models[0].parameters(), foreach=False), ko.AdamW(models[1].parameters())]
    for _ in range(3):
        for m, o in zip(models, opts):
            o.zero_grad()
            backward(m, o)
            if isinstance(o, ArenaOptimizer):
                grads = [p.grad.clone() for p in m.parameters()]
                for p in m.parameters():
                    p.grad = None
                arena = o.arenas[0]
                for p, view, g in zip(m.parameters(), arena.gviews, grads):
                    view.copy_(g)
                    p.grad = view
            o.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls,kw", [(ko.AdamW, {}), (ko.LAMB, {}), (ko.LARS, dict(lr=0.1))])
def test_common_training_step_takes_the_o1_path(monkeypatch, cls, kw):
    m = make_model()
    opt = cls(m.parameters(), **kw)
    for _ in range(2):  # the first steps find the arena as built and record its fingerprint
        opt.zero_grad()
        backward(m, opt)
        opt.step()

    def boom(*a, **k):
        raise AssertionError("per-parameter check in the common case")

    monkeypatch.setattr(Pack, "grads_intact", boom)
    monkeypatch.setattr(Packing, "_relink_params", boom)
    monkeypatch.setattr(Packing, "_absorb_grads", boom)
    for _ in range(3):
        opt.zero_grad()
        backward(m, opt)
        opt.step()
    opt.step()  # a step with no new gradient (after its one warning) is O(1) too
    monkeypatch.undo()
    m[0].bias.grad = torch.ones(32)  # and a change is still seen after all that
    before = m[0].bias.detach().clone()
    opt.step()
    assert not torch.equal(before, m[0].bias.detach())
    assert m[0].bias.grad.data_ptr() == opt.arenas[0].gviews[1].data_ptr()


def test_one_add_counts_every_arenas_steps_and_a_failed_update_counts_none_from_it_on(monkeypatch):
    """The common step counts the step of every arena (here two parameter groups) with one add
    over ``Packing.steps``, of which each arena's counts are a slice; training and the exposed
    counts stay torch's, and an arena whose update fails keeps its count, as do those after it."""
    models = [make_model(), make_model()]
    groups = [lambda m: [{"params": [p for p in m.parameters() if p.ndim > 1]},
                         {"params": [p for p in m.parameters() if p.ndim <= 1], "weight_decay": 0.0}]] * 2
    ref = torch.optim.AdamW(groups[0](models[0]), lr=1e-2, weight_decay=0.1, fused=True)  # the same kernel
    opt = ko.AdamW(groups[1](models[1]), lr=1e-2, weight_decay=0.1)
    assert len(opt.packing.packs) == 2
    for _ in range(3):
        for m, o in zip(models, (ref, opt)):
            o.zero_grad()
            backward(m, o)
            o.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
        assert float(ref.state[a]["step"]) == float(opt.state[b]["step"]) == 3.0
    packs = opt.packing.packs
    assert all(pk.step_vec.data_ptr() == opt.packing.steps[pk.s0:pk.s1].data_ptr() for pk in packs)

    calls = []
    update = ko.AdamW._update_flat

    def second_fails(self, rng, group, step):
        calls.append(rng.pack)
        if rng.pack is packs[1]:
            raise RuntimeError("update failed")
        return update(self, rng, group, step)

    monkeypatch.setattr(ko.AdamW, "_update_flat", second_fails)
    opt.zero_grad()
    backward(models[1], opt)
    with pytest.raises(RuntimeError, match="update failed"):
        opt.step()
    assert calls == packs  # the first arena stepped, the second failed
    assert opt.packing.steps.tolist() == [4.0] * packs[0].s1 + [3.0] * (packs[1].s1 - packs[1].s0)
    assert (packs[0].step, packs[1].step) == (4, 3)
