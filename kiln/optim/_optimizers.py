"""SGD, Adam, AdamW, LAMB and LARS over the arena (or over per-parameter lists), each
declared as a chain of the shared transforms of :mod:`kiln.optim._chain`::

    SGD   = chain(maximize, add_decayed_weights, heavy_ball, learning_rate)
    Adam  = chain(maximize, add_decayed_weights, scale_by_adam, learning_rate)
    AdamW = chain(maximize, decay_weights, scale_by_adam, learning_rate)
    LAMB  = chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio, learning_rate)
    LARS  = chain(add_decayed_weights, scale_by_trust_ratio, heavy_ball, learning_rate)

The chain is the rule; faster kernels for the same math are declared beside it and tested
against it:

- SGD, Adam, AdamW: torch's fused CPU/CUDA kernels (``torch._fused_sgd_``,
  ``torch._fused_adam_``, ``torch._fused_adamw_``), called on the one flat tensor of each arena
  (one kernel, no per-parameter launch) and on per-parameter lists alike (per-tensor step
  counts). Elsewhere (or with ``_force_rule``, in tests) the chain runs.
- LAMB, LARS: on CPU (fp32, fp64 arenas) the hand-written kernels of :mod:`kiln.optim._native`
  (built on first use by the C++ toolchain torch.compile uses): LAMB's whole step is one call
  that takes the tensors in cache-sized groups, so it moves AdamW's 7 element passes, not 10;
  LARS is two passes (its norms, then the update). Elsewhere (CUDA, 16-bit arenas, no
  compiler) the chain runs as two ``torch.compile``d kernels around its trust ratio (see
  :mod:`kiln.optim._flat`); ``KILN_OPTIM_EAGER=1`` or ``compile=False`` runs it eagerly.

With ``contiguous=False`` (per-parameter lists, for FSDP2 / DTensor parameters) the fused
kernels run on the lists, and LAMB and LARS run their chains on
:class:`~kiln.optim._rules.TensorList`, i.e. as in-place ``torch._foreach_*_`` kernels with
``torch._foreach_norm`` for the norms.

Complex parameters (SGD, Adam, AdamW) go through the same kernels as pairs of reals
(``torch.view_as_real``), as torch.optim treats them; LAMB and LARS refuse them. A group
with ``capturable=True`` or ``differentiable=True`` runs torch's own functional update
(``torch.optim.adam.adam``, ``torch.optim.sgd.sgd``) over the parameters as they are, so
that those flags mean, and fail, exactly what they do in torch; such an optimizer keeps no
arena.

Example::

    >>> import torch, kiln.optim
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = kiln.optim.AdamW(model.parameters(), lr=1e-2)
    >>> model(torch.randn(8, 4)).square().mean().backward()
    >>> opt.step(); opt.zero_grad()
    >>> opt.arenas[0].param.data_ptr() == model.weight.data_ptr()
    True
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Mapping

import torch
from torch.optim.adam import adam as _torch_adam
from torch.optim.optimizer import _to_scalar
from torch.optim.sgd import sgd as _torch_sgd

from kiln.optim import _native
from kiln.optim._base import ArenaOptimizer, torch_method
from kiln.optim._chain import (Chain, add_decayed_weights, chain, decay_weights, heavy_ball, learning_rate,
                               maximize, scale_by_adam, scale_by_trust_ratio)
from kiln.optim._flat import FlatSpace
from kiln.optim._kernels import hyper
from kiln.optim._packing import FlatRange
from kiln.optim._segments import Segments, column, segment_norms, segments

__all__ = ["SGD", "Adam", "AdamW", "LAMB", "LARS"]


def _torch_checks(torch_cls: type, **hyper: Any) -> None:
    """torch's own constructor checks on these arguments, so that kiln refuses exactly what
    torch refuses, with the same error and message (a throwaway optimizer over one 0-d tensor)."""
    class Checked(torch_cls):  # type: ignore[misc,valid-type]
        add_param_group = torch_method("add_param_group")  # (no import of torch._dynamo: see torch_method)

    Checked([torch.zeros((), requires_grad=True)], **hyper)


class SGD(ArenaOptimizer):
    """torch.optim.SGD (momentum, dampening, Nesterov, weight decay) over the arena.

    Internally a step count tells the first step (when the momentum buffer is set to the
    gradient, as torch does); it is not part of the state dict, which holds only
    ``momentum_buffer`` like torch's (and nothing at all without momentum).

    Every argument of torch.optim.SGD is taken with torch's default and checked by torch's
    own constructor. ``foreach`` and ``fused`` choose among torch's kernels, which compute the
    same update: kiln always runs its fused one (and refuses ``fused=True`` for complex
    parameters at the step, as torch does). ``differentiable=True`` runs torch's own
    implementation over the parameters as they are (no arena).
    """

    config_name = "sgd"
    config_options = ("momentum", "nesterov", "weight_decay")
    chain = chain(maximize, add_decayed_weights, heavy_ball(torch_sgd=True), learning_rate)

    _has_step_state = False  # torch's SGD keeps no 'step': a parameter has stepped iff it has a buffer

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float | torch.Tensor = 0.0, nesterov: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, differentiable: bool = False,
                 fused: bool | None = None, contiguous: bool = True, shard_multiple: int | None = None):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                        differentiable=differentiable, fused=fused)
        _torch_checks(torch.optim.SGD, **defaults)
        super().__init__(params, defaults, contiguous=contiguous, shard_multiple=shard_multiple)

    @staticmethod
    def _torch_fused(group: dict[str, Any], ps: list[torch.Tensor], gs: list[torch.Tensor],
                     state: dict[str, list[torch.Tensor]], steps: Any, *, first: bool) -> None:
        torch._fused_sgd_(ps, gs, state.get("momentum_buffer", []), weight_decay=group["weight_decay"],
                          momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
                          nesterov=group["nesterov"], maximize=group["maximize"], is_first_step=first)

    def _update_torch(self, group: dict[str, Any], ps: list[torch.Tensor]) -> None:
        momentum = group["momentum"]
        bufs = [self.state[p].get("momentum_buffer") for p in ps] if momentum else []
        _torch_sgd(ps, [p.grad for p in ps], bufs, foreach=group["foreach"], fused=group["fused"],
                   weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
                   dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
        for p, b in zip(ps, bufs):
            self.state[p]["momentum_buffer"] = b


class Adam(ArenaOptimizer):
    """torch.optim.Adam over the arena (``decoupled_weight_decay=True`` gives AdamW).

    Every argument of torch.optim.Adam is taken with torch's default and checked by torch's
    own constructor. ``foreach`` and ``fused`` choose among torch's kernels, which compute the
    same update: kiln always runs its fused one (and refuses ``fused=True`` for complex
    parameters at the step, as torch does). ``capturable=True`` and ``differentiable=True``
    run torch's own implementation over the parameters as they are (no arena), so they work,
    and fail, exactly where torch's do.
    """

    config_name = "adam"
    config_options = ("betas", "eps", "weight_decay")
    chain = chain(maximize, add_decayed_weights, scale_by_adam, learning_rate)

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 foreach: bool | None = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 decoupled_weight_decay: bool = False, contiguous: bool = True,
                 shard_multiple: int | None = None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        _torch_checks(torch.optim.Adam, **defaults)
        defaults["betas"] = tuple(map(_to_scalar, betas))  # as torch: 1-element tensors become 0-d
        super().__init__(params, defaults, contiguous=contiguous, shard_multiple=shard_multiple)

    @classmethod
    def chain_for(cls, group: Mapping[str, Any]) -> Chain:
        # torch.optim.Adam's decoupled_weight_decay=True is AdamW
        return AdamW.chain if group.get("decoupled_weight_decay", issubclass(cls, AdamW)) else Adam.chain

    @staticmethod
    def _torch_fused(group: dict[str, Any], ps: list[torch.Tensor], gs: list[torch.Tensor],
                     state: dict[str, list[torch.Tensor]], steps: list[torch.Tensor], *, first: bool) -> None:
        fn = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
        beta1, beta2 = group["betas"]
        fn(ps, gs, state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq", []), steps, lr=group["lr"],
           beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=group["amsgrad"],
           maximize=group["maximize"])

    def _update_torch(self, group: dict[str, Any], ps: list[torch.Tensor]) -> None:
        states = [self.state[p] for p in ps]
        beta1, beta2 = group["betas"]
        _torch_adam(ps, [p.grad for p in ps], [st["exp_avg"] for st in states],
                    [st["exp_avg_sq"] for st in states],
                    [st["max_exp_avg_sq"] for st in states] if group["amsgrad"] else [],
                    [st["step"] for st in states], foreach=group["foreach"], capturable=group["capturable"],
                    differentiable=group["differentiable"], fused=group["fused"],
                    has_complex=any(map(torch.is_complex, ps)),
                    decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=group["amsgrad"],
                    beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                    eps=group["eps"], maximize=group["maximize"])


class AdamW(Adam):
    """torch.optim.AdamW over the arena: decoupled weight decay, default 1e-2."""

    config_name = "adamw"  # the same config_options as Adam
    chain = chain(maximize, decay_weights, scale_by_adam, learning_rate)

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None, contiguous: bool = True,
                 shard_multiple: int | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, contiguous=contiguous, shard_multiple=shard_multiple)


# -- LAMB and LARS ------------------------------------------------------------------------------
# The native LAMB step (see _native) takes tensors in groups of about _LAMB_GROUP bytes per
# buffer (w, g, m, v and u of a group stay in a 1 MiB L2 cache), and keeps u for groups up to
# _LAMB_KEEP bytes (a 4 MiB tensor's five buffers in a 32 MiB L3); longer ones recompute u.
_LAMB_GROUP = 1 << 19
_LAMB_KEEP = 1 << 22

class LAMB(ArenaOptimizer):
    """LAMB (You et al., "Large Batch Optimization for Deep Learning", arXiv 1904.00962).

    Per parameter tensor w, with bias-corrected Adam moments::

        m = b1*m + (1-b1)*g;   v = b2*v + (1-b2)*g^2
        u = (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps) + weight_decay*w
        r = ||w|| / ||u||   (1 if either norm is 0; ||w|| capped at trust_clip if given)
        w = w - lr * r * u

    Norms are per tensor, never over the whole buffer. With ``contiguous=True`` on CPU the
    step is one native kernel that fuses the chain (``compile=False`` or ``KILN_OPTIM_EAGER=1``
    runs the chain eagerly instead): per group of tensors that fits in cache it updates m and
    v, keeps u, sums the squares, takes the ratios and moves w while the group is still in
    cache: AdamW's 7 element passes over memory (a group too long for the 4 MiB buffer
    recomputes u: 10), where the trust ratio forces any schedule over the whole arena to at
    least 10. A ZeRO shard runs the two passes apart, its norms summed across ranks between
    them. Elsewhere the chain's first kernel writes u to a scratch buffer the size of the arena
    (12 passes).
    """

    config_name = "lamb"
    config_options = ("betas", "eps", "weight_decay")
    chain = chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio, learning_rate)

    _per_tensor_norms = True
    _supports_complex = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, *, trust_clip: float | None = None,
                 contiguous: bool = True, shard_multiple: int | None = None, compile: bool | None = None):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, trust_clip=trust_clip)
        self.compile = compile
        super().__init__(params, defaults, contiguous=contiguous, shard_multiple=shard_multiple)

    def _native_flat(self, rng: FlatRange, group: dict[str, Any], step: int) -> bool:
        p, g, m, v = rng.args("exp_avg", "exp_avg_sq")
        native = _native.kernel("lamb", p)
        if native is None:
            return False
        h = self.chain.hyper_named(group, step, FlatSpace(rng))
        adam, trust, lr = h["scale_by_adam"], h["scale_by_trust_ratio"], h["learning_rate"]["lr"]
        hp = hyper([adam["b1"], adam["b2"], adam["c1"], adam["c2"], adam["eps"], h["add_decayed_weights"]["weight_decay"],
                    adam["bc1"], adam["bc2"], lr, -1.0 if trust["clip"] is None else trust["clip"]], p)
        seg = segments(rng)
        nb, n = len(seg.row_seg), rng.j - rng.i
        # one call per step where the norms are whole here (the rest of the step, ratios
        # included, in the kernel: see _native); a shard's sums are completed across ranks
        # between the two passes, which keep no u
        ub = self._lamb_buffer(rng, seg) if not rng.sharded else seg.sq[:0]
        run = functools.partial(native, p, g, m, v, seg.sq, ub, hp, seg.rows, seg.valid, n, nb, seg.blk,
                                _LAMB_GROUP // p.element_size(), ub.numel())
        if not rng.sharded:
            run(0, torch.get_num_threads())
            return True
        run(1, torch.get_num_threads())
        norms = segment_norms(rng, seg)
        r = scale_by_trust_ratio.ratio(norms[:n], norms[n:], trust)
        torch.index_select(r * -lr, 0, seg.row_seg, out=seg.sq[:nb])  # each row's coefficient; u recomputed
        run(2, torch.get_num_threads())
        return True

    @staticmethod
    def _lamb_buffer(rng: FlatRange, seg: Segments) -> torch.Tensor:
        """The native kernel's buffer for u: one group of tensors long (up to _LAMB_KEEP bytes;
        a longer group recomputes u), kept as the pack's scratch."""
        size = rng.arena.param.element_size()
        return rng.scratch(min(max(_LAMB_GROUP // size, seg.longest), _LAMB_KEEP // size))


class LARS(ArenaOptimizer):
    """LARS (You et al., "Large Batch Training of Convolutional Networks", arXiv 1708.03888),
    in the form VISSL uses. Per parameter tensor w with gradient g::

        d = g + weight_decay*w
        q = eta * ||w|| / ||d||        (1 if either norm is 0)
        buf = momentum*buf + q*d       (buf starts at 0, so the first step sets buf = q*d)
        w = w - lr * (q*d + momentum*buf if nesterov else buf)

    With ``exclude_1d=True`` tensors with ndim <= 1 (biases, norm weights) get neither
    adaptation nor decay: q = 1 and d = g, i.e. plain SGD with momentum.
    """

    config_name = "lars"
    config_options = ("momentum", "nesterov", "weight_decay")
    chain = chain(add_decayed_weights, scale_by_trust_ratio, heavy_ball(torch_sgd=False), learning_rate)

    _per_tensor_norms = True
    _supports_complex = False

    def __init__(self, params: Iterable[Any], lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, eta: float = 0.001, *, nesterov: bool = False,
                 exclude_1d: bool = True, contiguous: bool = True, shard_multiple: int | None = None,
                 compile: bool | None = None):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, nesterov=nesterov,
                        exclude_1d=exclude_1d)
        self.compile = compile
        super().__init__(params, defaults, contiguous=contiguous, shard_multiple=shard_multiple)

    def _native_flat(self, rng: FlatRange, group: dict[str, Any], step: int) -> bool:
        p, g, buf = rng.args("momentum_buffer")
        native = _native.kernels(p, "lars", "lars_apply")
        if native is None:
            return False
        space = FlatSpace(rng)
        h = self.chain.hyper_named(group, step, space)
        seg = segments(rng)
        nb, n, nt = len(seg.row_seg), rng.j - rng.i, torch.get_num_threads()
        wd = h["add_decayed_weights"]["weight_decay"]
        if not isinstance(wd, torch.Tensor):  # (the kernels take a decay per row)
            wd = space.per_tensor([wd] * n)
        # the rows' sums of squares of w and d = g + wd*w, nothing written; the update recomputes d
        native[0](p, g, wd, seg.sq, nb, seg.blk, nt)
        norms = segment_norms(rng, seg)
        q = scale_by_trust_ratio.ratio(norms[:n], norms[n:], h["scale_by_trust_ratio"])
        momentum = h["heavy_ball"]
        native[1](p, g, buf, wd, column(q, seg, p.dtype), hyper([h["learning_rate"]["lr"], momentum["momentum"]], p),
                  int(momentum["nesterov"]), nb, seg.blk, nt)
        return True
