"""kiln.optim against torch.optim, which is the contract (STYLE rule 12): torch's own optimizer
test inputs (``optim_db``, with the fused / differentiable variants torch's suite adds on a
CPU), torch's error inputs, every constructor argument of torch's SGD, Adam and AdamW,
complex parameters, and what ``state`` holds. (``step()`` without a new gradient: in
tests/test_optim.py, beside the arena behaviours it touches.)

Each case runs torch's class and kiln's (``contiguous=True`` and ``False``) on identical
parameters: fp32 and fp64 tensors, a 0-d tensor, one parameter that gets no gradient at one
step, and, in the "complex" set, complex64 and complex128 ones. Either both raise (errors of
one family: one type a subclass of the other) or the results agree to the tolerance below.

Tolerance. kiln runs torch's fused kernels (one call over a flat arena or a list), torch's
default on CPU is its for-loop; the two round differently: ``lerp`` vs ``mul/add``, the bias
corrections folded into one step size, division order. tests/test_optim.py holds kiln to a
relative error of 1e-6 after 100 fp32 steps; here, after 6 to 20 steps: fp32 (and
complex64) rel 1e-6, fp64 (and complex128) rel 1e-14 (seen: 1.3e-7 and 7e-17). Where torch
runs the fused kernel (``fused=True``) on real parameters, kiln's multi-tensor mode
(``contiguous=False``) runs the same kernel on the same tensors and must match it bitwise;
over an arena it may not (the CPU kernel's vectorized body and scalar tail round
differently, and the arena moves where a tensor's elements fall against the vector
boundaries), so that mode keeps the tolerance.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import kiln.optim as ko

from torch.testing._internal.common_optimizers import (  # needs expecttest (the test extra)
    OptimizerErrorEnum,
    _get_optim_inputs_including_global_cliquey_kwargs,
    optim_db,
)

KILN = {torch.optim.SGD: ko.SGD, torch.optim.Adam: ko.Adam, torch.optim.AdamW: ko.AdamW}
INFOS = {info.optim_cls: info for info in optim_db if info.optim_cls in KILN}
STEPS = 6
SKIP_AT = 1  # the step at which parameter "u" gets no gradient (p.grad is None for torch)
REL_TOL = {torch.float32: 1e-6, torch.float64: 1e-14}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# -- the harness ------------------------------------------------------------------------------
def make_params(kind: str) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)

    def param(*shape, dtype=torch.float32):
        return torch.nn.Parameter(torch.randn(shape, generator=g, dtype=dtype))

    ps = {"w": param(4, 3), "s": param(), "u": param(2, 2), "d": param(5, dtype=torch.float64)}
    if kind == "complex":
        ps["c"] = param(2, 3, dtype=torch.complex64)
        ps["z"] = param(3, dtype=torch.complex128)
    return ps


def loss(ps: dict[str, torch.Tensor], t: int) -> torch.Tensor:
    """A smooth loss whose gradient changes from step to step; "u" sits out step SKIP_AT. The
    gradients shrink 100x halfway, so that AMSGrad's running maximum parts from Adam's v."""
    total = torch.zeros((), dtype=torch.float64)
    scale = 1.0 if t < STEPS // 2 else 0.01
    for k, (name, p) in enumerate(ps.items()):
        if name == "u" and t == SKIP_AT:
            continue
        x = torch.view_as_real(p) if p.is_complex() else p
        total = total + scale * (x * (1.0 + 0.3 * t + 0.1 * k)).sin().sum().double()
    return total


def run(cls: type, kwargs: dict, kind: str, steps: int = STEPS, **extra):
    """Train a fresh copy of the parameters; (params, state_dict) or the exception raised."""
    ps = make_params(kind)
    try:
        opt = cls(list(ps.values()), **copy.deepcopy(kwargs), **extra)
        for t in range(steps):
            opt.zero_grad()
            loss(ps, t).backward()
            opt.step()
    except Exception as e:  # noqa: BLE001 - the outcome to compare
        return e
    return ps, opt.state_dict()


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def rel_err(k: torch.Tensor, t: torch.Tensor) -> float:
    """max |k - t| / max |t| (complex tensors as pairs of reals)."""
    k, t = _real(k.detach()), _real(t.detach())
    return ((k - t).abs().max() / t.abs().max().clamp_min(1e-12)).item() if t.numel() else 0.0


def tol(t: torch.Tensor) -> float:
    return REL_TOL[t.dtype.to_real()]


def assert_close(k: torch.Tensor, t: torch.Tensor, what: str, bitwise: bool = False) -> None:
    assert k.dtype == t.dtype and k.shape == t.shape, what
    if bitwise:
        assert torch.equal(k, t), f"{what}: not bitwise equal, max diff {(k - t).abs().max().item():.3g}"
        return
    err = rel_err(k, t)
    assert err < tol(t), f"{what}: relative error {err:.3g}"


def same_error_family(a: BaseException, b: BaseException) -> bool:
    return isinstance(a, type(b)) or isinstance(b, type(a))


def assert_same_outcome(k_out, t_out, what: str, bitwise: bool = False) -> None:
    if isinstance(t_out, Exception):
        assert isinstance(k_out, Exception), f"{what}: torch raised {t_out!r}, kiln did not"
        assert same_error_family(k_out, t_out), f"{what}: torch raised {t_out!r}, kiln {k_out!r}"
        return
    if isinstance(k_out, Exception):
        raise AssertionError(f"{what}: kiln raised {k_out!r}, torch did not") from k_out
    (k_ps, k_sd), (t_ps, t_sd) = k_out, t_out
    for name in t_ps:
        assert_close(k_ps[name], t_ps[name], f"{what}: param {name}", bitwise)
    # state: the same entries, keyed per parameter index, holding the same names and values
    assert k_sd["state"].keys() == t_sd["state"].keys(), what
    for i, t_st in t_sd["state"].items():
        assert k_sd["state"][i].keys() == t_st.keys(), f"{what}: state {i}"
        for n, v in t_st.items():
            assert_close(k_sd["state"][i][n], v, f"{what}: state {i} {n}", bitwise)
    assert [g.keys() for g in k_sd["param_groups"]] == [g.keys() for g in t_sd["param_groups"]], what


def bitwise(kwargs: dict, kind: str, contiguous: bool) -> bool:
    """torch and kiln run the same fused kernel on the same tensors (see the docstring)."""
    return bool(kwargs.get("fused")) and kind == "real" and not contiguous


# -- torch's optimizer test inputs --------------------------------------------------------------
OPTIM_DB_CASES = [(tcls, oi.desc, oi.kwargs) for tcls, info in INFOS.items()
                  for oi in _get_optim_inputs_including_global_cliquey_kwargs("cpu", None, info)]


@pytest.mark.parametrize("kind", ["real", "complex"])
@pytest.mark.parametrize("tcls,desc,kwargs", OPTIM_DB_CASES,
                         ids=[f"{c.__name__}-{d}" for c, d, _ in OPTIM_DB_CASES])
def test_optim_db_inputs_match_torch_or_raise_as_torch(tcls, desc, kwargs, kind):
    t_out = run(tcls, kwargs, kind)
    for contiguous in (True, False):
        k_out = run(KILN[tcls], kwargs, kind, contiguous=contiguous)
        assert_same_outcome(k_out, t_out, f"{desc} contiguous={contiguous}",
                            bitwise=bitwise(kwargs, kind, contiguous))


def test_optim_db_covers_what_this_file_claims():
    # the cases above come from torch: make sure they hold what the docstring promises
    # (torch adds foreach=True only on devices with foreach kernels: the flag test covers it)
    flags = {k for _, _, kw in OPTIM_DB_CASES for k, v in kw.items() if v is True}
    assert {"fused", "differentiable", "maximize", "amsgrad", "nesterov"} <= flags
    assert any(torch.is_tensor(kw.get("lr")) for _, _, kw in OPTIM_DB_CASES)
    assert {c for c, _, _ in OPTIM_DB_CASES} == set(KILN)


ERROR_CASES = [(tcls, e) for tcls, info in INFOS.items()
               for e in info.optim_error_inputs_func(device="cpu", dtype=torch.float32)]


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("tcls,err", ERROR_CASES,
                         ids=[f"{c.__name__}-{e.optimizer_error_input.desc}" for c, e in ERROR_CASES])
def test_optim_db_error_inputs_raise_as_torch(tcls, err, contiguous):
    oi = err.optimizer_error_input
    params = oi.params if oi.params is not None else [torch.nn.Parameter(torch.randn(2, 2))]
    kcls = KILN[tcls]
    if issubclass(err.error_type, Warning):
        with pytest.warns(err.error_type, match=err.error_regex):
            kcls(params, **oi.kwargs, contiguous=contiguous)
        return
    with pytest.raises(err.error_type, match=err.error_regex):
        opt = kcls(params, **oi.kwargs, contiguous=contiguous)
        if err.error_on == OptimizerErrorEnum.STEP_ERROR:
            opt.step()


# -- every constructor argument of torch's classes ------------------------------------------------
def torch_arguments(tcls: type) -> dict[str, inspect.Parameter]:
    return {n: p for n, p in inspect.signature(tcls.__init__).parameters.items() if n not in ("self", "params")}


@pytest.mark.parametrize("tcls", list(KILN), ids=[c.__name__ for c in KILN])
def test_constructor_takes_every_torch_argument_with_torch_default(tcls):
    theirs = torch_arguments(tcls)
    ours = {n: p for n, p in inspect.signature(KILN[tcls].__init__).parameters.items()
            if n not in ("self", "params")}
    for name, p in theirs.items():
        assert name in ours, f"{name} missing"
        assert ours[name].default == p.default, name
        assert ours[name].kind == p.kind, f"{name}: positional in one, keyword-only in the other"
    positional = [n for n, p in theirs.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    assert set(ours) - set(theirs) == {"contiguous", "shard_multiple"}
    assert ours["contiguous"].default is True


def other_values(default):
    """Non-default values of a constructor argument that move the result visibly: flip a
    bool, both explicit choices for None (foreach, fused), sqrt of a number in (0, 1) (so
    betas stay below 1 and eps grows enough to matter), 0.5 for a zero, per element for
    a tuple."""
    if isinstance(default, bool):
        return [not default]
    if default is None:
        return [True, False]
    if isinstance(default, tuple):
        return [tuple(other_values(d)[0] for d in default)]
    return [0.5 if default == 0 else default ** 0.5]


FLAG_CASES = [(tcls, name, value) for tcls in KILN for name, p in torch_arguments(tcls).items()
              for value in other_values(p.default)]


@pytest.mark.parametrize("kind", ["real", "complex"])
@pytest.mark.parametrize("tcls,name,value", FLAG_CASES,
                         ids=[f"{c.__name__}-{n}={v}" for c, n, v in FLAG_CASES])
def test_every_torch_argument_changes_the_result_as_in_torch_or_raises_as_torch(tcls, name, value, kind):
    """The argument on top of each of torch's base inputs for the class (momentum for nesterov
    and dampening, amsgrad for capturable, ...): kiln's outcome is torch's. Where torch's
    result moves with the argument, kiln's therefore moves the same way: a dropped flag fails."""
    moved = False
    for oi in INFOS[tcls].optim_inputs_func(device="cpu"):
        if name in oi.kwargs:
            continue
        kwargs = {**oi.kwargs, name: value}
        t_out = run(tcls, kwargs, kind)
        base = run(tcls, oi.kwargs, kind)
        if not isinstance(t_out, Exception) and not isinstance(base, Exception):
            # moved well past the tolerance, so that a kiln that ignored it would fail
            moved |= any(rel_err(a, b) > 10 * tol(b) for a, b in zip(t_out[0].values(), base[0].values()))
        for contiguous in (True, False):
            k_out = run(KILN[tcls], kwargs, kind, contiguous=contiguous)
            assert_same_outcome(k_out, t_out, f"{oi.desc} + {name}={value} contiguous={contiguous}",
                                bitwise=bitwise(kwargs, kind, contiguous))
    # a flag whose torch result never moves must be one that picks an implementation or is
    # refused on CPU; everything else has to have been exercised for real
    assert moved or name in ("foreach", "fused", "capturable", "differentiable"), name


# -- complex parameters ---------------------------------------------------------------------------
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("tcls", [torch.optim.Adam, torch.optim.AdamW], ids=["Adam", "AdamW"])
def test_complex_parameters_step_as_pairs_of_reals_like_torch(tcls, amsgrad, contiguous):
    # 20 steps at lr 1e-2: a rule that squared the complex gradient instead drifted 0.15 from
    # torch, and amsgrad crashed on torch.maximum of complex tensors
    kwargs = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    t_out = run(tcls, kwargs, "complex", steps=20)
    k_out = run(KILN[tcls], kwargs, "complex", steps=20, contiguous=contiguous)
    assert_same_outcome(k_out, t_out, f"{tcls.__name__} {kwargs}")
    assert k_out[1]["state"][4]["exp_avg_sq"].dtype == torch.complex64  # state stays complex, as torch's


@pytest.mark.parametrize("contiguous", [True, False])
def test_sgd_momentum_on_complex_parameters_matches_torch(contiguous):
    kwargs = dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)
    t_out = run(torch.optim.SGD, kwargs, "complex", steps=20)
    assert_same_outcome(run(ko.SGD, kwargs, "complex", steps=20, contiguous=contiguous), t_out, str(kwargs))


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("tcls", list(KILN), ids=[c.__name__ for c in KILN])
def test_fused_true_with_complex_parameters_is_refused_at_the_step_as_torch(tcls, contiguous):
    c = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    opt = KILN[tcls]([c], fused=True, contiguous=contiguous)  # torch builds it too
    opt.step()  # no gradient yet: nothing to refuse, as torch
    c.grad = torch.ones_like(c)
    with pytest.raises(RuntimeError, match="fused=True. requires all the params to be floating point"):
        opt.step()
    ref = tcls([torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))], fused=True)
    ref.param_groups[0]["params"][0].grad = torch.ones(3, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="fused=True. requires all the params to be floating point"):
        ref.step()


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("cls", [ko.LAMB, ko.LARS])
def test_lamb_and_lars_refuse_complex_parameters_naming_the_fix(cls, contiguous):
    w = torch.nn.Parameter(torch.randn(3, 3))
    c = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"complex parameters.*kiln\.optim\.AdamW or SGD"):
        cls([w, c], contiguous=contiguous)
    opt = cls([w], contiguous=contiguous)
    with pytest.raises(ValueError, match="complex parameters"):
        opt.add_param_group({"params": [c]})
    assert len(opt.param_groups) == 1  # the refused group is not left behind


# -- what state holds ------------------------------------------------------------------------------
@pytest.mark.parametrize("contiguous", [True, False])
def test_sgd_keeps_state_entries_only_where_torch_does(contiguous):
    for kwargs in (dict(lr=0.1), dict(lr=0.1, momentum=0.9)):
        t_out = run(torch.optim.SGD, kwargs, "real")
        opt_ps = make_params("real")
        opt = ko.SGD(list(opt_ps.values()), contiguous=contiguous, **kwargs)
        for t in range(STEPS):
            opt.zero_grad()
            loss(opt_ps, t).backward()
            opt.step()
        # without momentum torch has no entry at all (not even {}), with momentum a buffer each
        assert len(opt.state) == len(t_out[1]["state"]) == (4 if kwargs.get("momentum") else 0)
        assert opt.state_dict()["state"].keys() == t_out[1]["state"].keys()


# -- differentiable and capturable: torch's own implementation --------------------------------------
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("tcls,kwargs", [(torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
                                         (torch.optim.Adam, dict(lr=0.1, amsgrad=True)),
                                         (torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1))],
                         ids=["SGD", "Adam", "AdamW"])
def test_differentiable_step_is_differentiable_as_torch(tcls, kwargs, contiguous):
    # torch's own use (as in its test suite): a non-leaf parameter and a gradient that requires
    # grad; the parameter after one step is differentiated back to both
    def unrolled(cls, **extra):
        w0 = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64).requires_grad_()
        g = torch.linspace(0.5, -0.3, 6, dtype=torch.float64).requires_grad_()
        w = w0.clone()  # non-leaf: allowed because differentiable=True
        opt = cls([w], differentiable=True, **kwargs, **extra)
        w.grad = g * 1.0
        opt.step()
        return w.detach(), torch.autograd.grad(w.sin().sum(), (w0, g))

    t_val, t_grads = unrolled(tcls)
    k_val, k_grads = unrolled(KILN[tcls], contiguous=contiguous)
    assert torch.equal(k_val, t_val)  # the same implementation: bitwise
    assert all(torch.equal(a, b) and b.abs().sum() > 0 for a, b in zip(k_grads, t_grads))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capturable=True needs a CUDA device")
def test_capturable_on_cuda_matches_torch():
    ps = [torch.nn.Parameter(torch.randn(5, 3, device="cuda")) for _ in range(2)]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref = ko.AdamW(ps, lr=1e-2, capturable=True), torch.optim.AdamW(refs, lr=1e-2, capturable=True)
    for _ in range(3):
        for a, b in zip(ps, refs):
            a.grad = b.grad = a.detach().sin()
        opt.step()
        ref.step()
    assert all(torch.equal(a, b) for a, b in zip(ps, refs))
    assert opt.state[ps[0]]["step"].device.type == "cuda"  # on the device, as torch keeps it
