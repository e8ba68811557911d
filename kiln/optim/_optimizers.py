"""SGD, Adam, AdamW, LAMB and LARS over the arena (or over per-parameter lists).

Fast paths with ``contiguous=True``:

- SGD, Adam, AdamW: torch's fused CPU/CUDA kernels (``torch._fused_sgd_``,
  ``torch._fused_adam_``, ``torch._fused_adamw_``) called on the one flat tensor of each
  arena: the same math as torch.optim, one kernel, no per-parameter launch.
- LAMB, LARS: per-tensor norms and factors never loop over tensors: the flat range is viewed
  as (B, blk) rows, blk dividing every tensor's padded length, so a tensor's norm is a sum
  over its rows and its factor one value per row (see ``_segments``). On CPU (fp32, fp64) the
  passes are hand-written kernels (``kiln.optim._native``, built on first use by the C++
  toolchain torch.compile uses): LAMB's whole step is one call that takes the tensors in
  cache-sized groups, so it moves AdamW's 7 element passes, not 10; LARS is two passes (its
  norms, then the update). Elsewhere (CUDA, 16-bit arenas, no compiler) the elementwise rule
  is one ``torch.compile``d kernel (hyperparameters in a tensor, so a schedule never
  recompiles) plus row norms and one segment sum. Set ``KILN_OPTIM_EAGER=1`` or pass
  ``compile=False`` to run the same rule eagerly (nothing to build).

With ``contiguous=False`` (per-parameter lists, for FSDP2 / DTensor parameters) SGD, Adam
and AdamW call the same fused kernels on the lists (one launch per step, per-tensor step
counts), and LAMB and LARS run their rules on :class:`~kiln.optim._rules.TensorList`, i.e.
as in-place ``torch._foreach_*_`` kernels with ``torch._foreach_norm`` for the norms.

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

from kiln.optim import _native, _rules
from kiln.optim._base import ArenaOptimizer, torch_method
from kiln.optim._kernels import compiling, hyper, hyper_dtype, kernel
from kiln.optim._packing import FlatRange, as_real
from kiln.optim._segments import Segments, block_sumsq, column, segment_norms, segments

__all__ = ["SGD", "Adam", "AdamW", "LAMB", "LARS"]


def _torch_checks(torch_cls: type, **hyper: Any) -> None:
    """torch's own constructor checks on these arguments, so that kiln refuses exactly what
    torch refuses, with the same error and message (a throwaway optimizer over one 0-d tensor)."""
    class Checked(torch_cls):  # type: ignore[misc,valid-type]
        add_param_group = torch_method("add_param_group")  # (no import of torch._dynamo: see torch_method)

    Checked([torch.zeros((), requires_grad=True)], **hyper)


def _fused_ok(device: torch.device, dtype: torch.dtype, opt: ArenaOptimizer) -> bool:
    """torch has fused SGD/Adam(W) kernels for this device and dtype (complex: on the real view),
    and no test forces the rule."""
    return (device.type in ("cpu", "cuda") and (dtype.is_floating_point or dtype.is_complex)
            and not getattr(opt, "_force_rule", False))


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

    _has_step_state = False

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float | torch.Tensor = 0.0, nesterov: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, differentiable: bool = False,
                 fused: bool | None = None, contiguous: bool = True, shard_multiple: int | None = None):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                        differentiable=differentiable, fused=fused)
        _torch_checks(torch.optim.SGD, **defaults)
        super().__init__(params, defaults, contiguous=contiguous, shard_multiple=shard_multiple)

    @classmethod
    def state_names(cls, group: Mapping[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] else ()

    def _update_flat(self, rng: FlatRange, group: dict[str, Any], step: int) -> None:
        p, g, *bufs = rng.args(*self.state_names(group))
        if _fused_ok(p.device, p.dtype, self):
            _fused_sgd([p], [g], bufs, group, first=step == 1)
            return
        _rules.sgd(p, g, bufs[0] if bufs else None, lr=group["lr"], momentum=group["momentum"],
                   dampening=group["dampening"], weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                   first_step=step == 1, maximize=group["maximize"])

    # torch's SGD has no 'step' in its state: a parameter has stepped iff it has a buffer
    def _init_list_state(self, p, group):  # noqa: D102
        return {}  # not stored: without momentum torch keeps no entry at all

    def _list_key(self, p: torch.Tensor, st: dict[str, Any]) -> int:
        return 1 if st.get("momentum_buffer") is not None else 0

    def _update_list(self, group: dict[str, Any], ps: list[torch.Tensor], key: int) -> None:
        first = key == 0
        momentum = group["momentum"]
        if _fused_ok(ps[0].device, ps[0].dtype, self):
            gs = [p.grad for p in ps]
            if not momentum:
                bufs = []
            elif first:  # the kernel sets buf = d on the first step
                bufs = [torch.empty_like(g) for g in gs]
            else:
                bufs = [self.state[p]["momentum_buffer"] for p in ps]
            _fused_sgd(as_real(ps), as_real(gs), as_real(bufs), group, first=first)
        else:
            P, G = self._lists(ps)
            if not momentum:
                bufs = []
            elif first:  # the rule sets buf = d on the first step
                bufs = [torch.empty_like(p) for p in ps]
            else:
                bufs = [self.state[p]["momentum_buffer"] for p in ps]
            _rules.sgd(P, G, _rules.TensorList(as_real(bufs)) if momentum else None, lr=group["lr"],
                       momentum=momentum, dampening=group["dampening"], weight_decay=group["weight_decay"],
                       nesterov=group["nesterov"], first_step=first, maximize=group["maximize"])
        if momentum and first:
            for p, b in zip(ps, bufs):
                self.state[p]["momentum_buffer"] = b

    def _update_torch(self, group: dict[str, Any], ps: list[torch.Tensor]) -> None:
        momentum = group["momentum"]
        bufs = [self.state[p].get("momentum_buffer") for p in ps] if momentum else []
        _torch_sgd(ps, [p.grad for p in ps], bufs, foreach=group["foreach"], fused=group["fused"],
                   weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
                   dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
        for p, b in zip(ps, bufs):
            self.state[p]["momentum_buffer"] = b


def _fused_sgd(ps, gs, bufs, group, *, first: bool) -> None:
    torch._fused_sgd_(ps, gs, bufs, weight_decay=group["weight_decay"], momentum=group["momentum"],
                      lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"],
                      maximize=group["maximize"], is_first_step=first)


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
    def state_names(cls, group: Mapping[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")

    def _update_flat(self, rng: FlatRange, group: dict[str, Any], step: int) -> None:
        p, g, m, v, *vmax = rng.args(*self.state_names(group))
        if _fused_ok(p.device, p.dtype, self):
            _fused_adam([p], [g], [m], [v], vmax, [rng.step_tensor(step)], group)
            return
        beta1, beta2 = group["betas"]
        _rules.adam(p, g, m, v, vmax[0] if vmax else None, lr=group["lr"], beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"], decoupled=group["decoupled_weight_decay"],
                    bc1=1 - beta1 ** step, bc2=1 - beta2 ** step, maximize=group["maximize"])

    def _list_key(self, p: torch.Tensor, st: dict[str, Any]) -> Any:
        # the fused kernel takes one step count per tensor: no need to read them here
        return None if _fused_ok(p.device, p.dtype, self) else int(st["step"])

    def _update_list(self, group: dict[str, Any], ps: list[torch.Tensor], key: Any) -> None:
        names = self.state_names(group)
        states = [self.state[p] for p in ps]
        steps = [st["step"] for st in states]
        if key is None:
            if steps[0].device != ps[0].device:  # torch.optim keeps 'step' on the CPU; CUDA kernels want it beside p
                for st, p in zip(states, ps):
                    st["step"] = st["step"].to(p.device)
                steps = [st["step"] for st in states]
            torch._foreach_add_(steps, 1.0)
            m, v, *vmax = ([st[n] for st in states] for n in names)
            _fused_adam(as_real(ps), as_real([p.grad for p in ps]), as_real(m), as_real(v),
                        as_real(vmax[0]) if vmax else [], steps, group)
            return
        P, G, M, V, *VM = self._lists(ps, *names)
        beta1, beta2 = group["betas"]
        step = key + 1
        _rules.adam(P, G, M, V, VM[0] if VM else None, lr=group["lr"], beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"], decoupled=group["decoupled_weight_decay"],
                    bc1=1 - beta1 ** step, bc2=1 - beta2 ** step, maximize=group["maximize"])
        torch._foreach_add_(steps, 1.0)

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


def _fused_adam(ps, gs, ms, vs, vmaxs, steps, group) -> None:
    """torch's fused Adam/AdamW kernel: the one implementation of the math on the flat buffer
    and on per-parameter lists alike (per-tensor step counts in ``steps``)."""
    fn = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
    beta1, beta2 = group["betas"]
    fn(ps, gs, ms, vs, vmaxs, steps, lr=group["lr"], beta1=beta1, beta2=beta2,
       weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=group["amsgrad"],
       maximize=group["maximize"])


class AdamW(Adam):
    """torch.optim.AdamW over the arena: decoupled weight decay, default 1e-2."""

    config_name = "adamw"  # the same config_options as Adam

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
def _lamb_kernel(p, g, m, v, u_out, hp):
    """Elementwise LAMB, in place on m, v; the direction u goes to u_out. hp = (b1, b2, c1, c2,
    eps, wd, bc1, bc2) as a tensor (c = 1 - b in float64) so new values never recompile."""
    b1, b2, c1, c2, eps, wd, bc1, bc2 = hp.unbind(0)
    u_out.copy_(_rules.lamb_direction(p, g, m, v, beta1=b1, beta2=b2, eps=eps, weight_decay=wd,
                                      bc1=bc1, bc2=bc2, c1=c1, c2=c2))


def _lars_mom_kernel(p, g, buf, wd, q, hp, nesterov: bool):
    """LARS's chain, in place on p and buf: the direction d = g + wd*p (wd per block, (B, 1):
    0 for tensors excluded from decay) scaled by the per-block trust ratio q (B, 1), then the
    heavy-ball step; hp = (lr, momentum). d is recomputed here rather than read back: it was
    only ever held a chunk at a time, for its norms (see LARS._update_flat)."""
    d = _rules.add_decayed_weights(g * 1, p, wd) * q
    _rules.apply(p, _rules.heavy_ball(d, buf, momentum=hp[1], nesterov=nesterov), hp[0])


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
    step is one native kernel (``compile=False`` or ``KILN_OPTIM_EAGER=1`` runs the eager rule
    instead): per group of tensors that fits in cache it updates m and v, keeps u, sums the
    squares, takes the ratios and moves w while the group is still in cache: AdamW's 7 element
    passes over memory (a group too long for the 4 MiB buffer recomputes u: 10), where the trust
    ratio forces any schedule over the whole arena to at least 10. A ZeRO shard runs the two
    passes apart, its norms summed across ranks between them. Elsewhere a compiled kernel
    writes u to a scratch buffer the size of the arena (12 passes).
    """

    config_name = "lamb"
    config_options = ("betas", "eps", "weight_decay")

    _per_tensor_norms = True
    _supports_complex = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, *, trust_clip: float | None = None,
                 contiguous: bool = True, shard_multiple: int | None = None, compile: bool | None = None):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, trust_clip=trust_clip)
        self.compile = compile
        super().__init__(params, defaults, contiguous=contiguous, shard_multiple=shard_multiple)

    @classmethod
    def state_names(cls, group: Mapping[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def _update_flat(self, rng: FlatRange, group: dict[str, Any], step: int) -> None:
        p, g, m, v = rng.args("exp_avg", "exp_avg_sq")
        b1, b2 = group["betas"]
        hp = [b1, b2, 1 - b1, 1 - b2, group["eps"], group["weight_decay"], 1 - b1 ** step, 1 - b2 ** step]
        seg = segments(rng)
        nb, blk, n = len(seg.row_seg), seg.blk, rng.j - rng.i
        native = _native.kernel("lamb", p) if compiling(self.compile) else None
        if native is not None:
            clip = group["trust_clip"]
            # one call per step where the norms are whole here (the rest of the step, ratios
            # included, in the kernel: see _native); a shard's sums are completed across ranks
            # between the two passes, which keep no u
            ub = self._lamb_buffer(rng, seg) if not rng.sharded else seg.sq[:0]
            run = functools.partial(native, p, g, m, v, seg.sq, ub, hyper(hp + [group["lr"], -1.0 if clip is None else clip], p),
                                    seg.rows, seg.valid, n, nb, blk, _LAMB_GROUP // p.element_size(), ub.numel())
            if not rng.sharded:
                run(0, torch.get_num_threads())
                return
            run(1, torch.get_num_threads())
        else:  # the chain's direction u into a scratch buffer, then its row norms and w's
            u = rng.scratch(rng.arena.numel)[:p.numel()]  # (one buffer for every range of the arena)
            kernel(_lamb_kernel, self.compile)(p, g, m, v, u, hyper(hp, p))
            u.index_fill_(0, seg.pad, 0)  # the padding's u (0/0 with eps = 0) neither counts nor moves w
            block_sumsq(seg, 0, nb, p.view(-1, blk), u.view(-1, blk))
        # Per-tensor norms from rows that never straddle two tensors: one segment sum; the
        # update one pass with the ratio per row (see _segments): no per-tensor kernel.
        norms = segment_norms(rng, seg)
        r = _rules.trust_ratio(norms[:n], norms[n:], clip=group["trust_clip"])
        if native is not None:  # the coefficient of each row into seg.sq, u recomputed
            torch.index_select(r * -group["lr"], 0, seg.row_seg, out=seg.sq[:nb])
            run(2, torch.get_num_threads())
        else:
            p.view(-1, blk).addcmul_(u.view(-1, blk), column(r, seg, p.dtype), value=-group["lr"])

    @staticmethod
    def _lamb_buffer(rng: FlatRange, seg: Segments) -> torch.Tensor:
        """The native kernel's buffer for u: one group of tensors long (up to _LAMB_KEEP bytes;
        a longer group recomputes u), kept as the pack's scratch."""
        size = rng.arena.param.element_size()
        return rng.scratch(min(max(_LAMB_GROUP // size, seg.longest), _LAMB_KEEP // size))

    def _update_list(self, group: dict[str, Any], ps: list[torch.Tensor], key: int) -> None:
        P, G, M, V = self._lists(ps, "exp_avg", "exp_avg_sq")
        b1, b2 = group["betas"]
        step = key + 1
        u = _rules.lamb_direction(P, G, M, V, beta1=b1, beta2=b2, eps=group["eps"],
                                  weight_decay=group["weight_decay"], bc1=1 - b1 ** step, bc2=1 - b2 ** step)
        norms = self._tensor_norms(P.ts + u.ts)  # full-tensor norms over DTensor shards
        r = _rules.trust_ratio(norms[:len(ps)], norms[len(ps):], clip=group["trust_clip"])
        P.sub_(u.mul_(list((group["lr"] * r).unbind())))
        torch._foreach_add_([self.state[p]["step"] for p in ps], 1.0)


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

    @classmethod
    def state_names(cls, group: Mapping[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",)

    def _update_flat(self, rng: FlatRange, group: dict[str, Any], step: int) -> None:
        p, g, buf = rng.args("momentum_buffer")
        seg = segments(rng)
        n = rng.j - rng.i
        p, g, buf = (t.view(-1, seg.blk) for t in (p, g, buf))
        # exclude_1d: biases and norm weights get neither decay nor adaptation; per block, so
        # that one kernel serves every tensor of the range
        keep = self._decayed(rng, seg, bool(group["exclude_1d"]), hyper_dtype(p))
        wd = keep[0] * group["weight_decay"]
        native = _native.kernels(p, "lars", "lars_apply") if compiling(self.compile) else None
        if native is not None:  # the row sums of squares of w and d = g + wd*w, nothing written
            native[0](p, g, wd, seg.sq, len(seg.row_seg), seg.blk, torch.get_num_threads())
        else:
            # d chunk by chunk into a chunk-sized buffer, its row norms taken while in cache
            rows = max(b - a for a, b in seg.chunks)
            d = rng.scratch(rows * seg.blk).view(rows, seg.blk)
            for a, b in seg.chunks:
                torch.addcmul(g[a:b], p[a:b], wd[a:b], out=d[:b - a])
                block_sumsq(seg, a, b, p[a:b], d[:b - a])
        # the update recomputes d, so d never makes a pass of its own
        norms = segment_norms(rng, seg)
        q = _rules.trust_ratio(norms[:n], norms[n:], eta=group["eta"])
        if keep[1] is not None:
            q = torch.where(keep[1], q, 1.0)
        hp = hyper([group["lr"], group["momentum"]], p)
        if native is not None:
            native[1](p, g, buf, wd, column(q, seg, p.dtype), hp, int(group["nesterov"]), len(seg.row_seg),
                      seg.blk, torch.get_num_threads())
        else:
            kernel(_lars_mom_kernel, self.compile)(p, g, buf, wd, column(q, seg, p.dtype), hp,
                                                   bool(group["nesterov"]))

    @staticmethod
    def _decayed(rng: FlatRange, seg: Segments, exclude_1d: bool,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """((B, 1) 1.0 for the blocks of decayed tensors, 0.0 for excluded ones, in the dtype of
        the hyperparameters (so that weight_decay is not rounded to a 16-bit dtype); (j-i,) bool
        mask of the adapted segments, or None when no segment of the range is excluded)."""
        key = ("lars_keep", rng.i, rng.j, exclude_1d, dtype)
        if key not in rng.cache:
            adapt = [not (exclude_1d and one) for one in rng.is1d()]
            mask = torch.tensor(adapt, device=rng.arena.device)
            col = mask.to(dtype).index_select(0, seg.row_seg).unsqueeze(1)
            rng.cache[key] = (col, None if all(adapt) else mask)
        return rng.cache[key]

    def _update_list(self, group: dict[str, Any], ps: list[torch.Tensor], key: int) -> None:
        P, G, B = self._lists(ps, "momentum_buffer")
        exclude = [group["exclude_1d"] and p.ndim <= 1 for p in ps]
        wd = group["weight_decay"]
        d = list(G.ts)
        if wd:  # per-tensor decay: none for excluded tensors
            keep = [k for k, ex in enumerate(exclude) if not ex]
            decayed = _rules.add_decayed_weights(_rules.TensorList([d[k] for k in keep]) * 1,
                                                 _rules.TensorList([ps[k] for k in keep]), wd)
            for k, dk in zip(keep, decayed.ts):
                d[k] = dk
        norms = self._tensor_norms(P.ts + d)  # full-tensor norms over DTensor shards
        q = _rules.trust_ratio(norms[:len(ps)], norms[len(ps):], eta=group["eta"])
        q = torch.where(torch.tensor(exclude, device=q.device), torch.ones_like(q), q)
        step = _rules.heavy_ball(_rules.TensorList(torch._foreach_mul(d, list(q.unbind()))), B,
                                 momentum=group["momentum"], nesterov=group["nesterov"])
        _rules.apply(P, step, group["lr"])
        torch._foreach_add_([self.state[p]["step"] for p in ps], 1.0)
