"""The arithmetic of kiln's update rules, each piece written once: the transforms of
:mod:`kiln.optim._chain` call these, and the native CPU kernels (:mod:`kiln.optim._native`)
are tested against the chains built from them.

Each function works unchanged on

- a flat (N,) arena buffer or a (B, blk) view of one, eagerly;
- the same inside ``torch.compile``, hyperparameters then 0-d tensors (so a learning-rate
  schedule never recompiles): no Python branch here reads a hyperparameter's value unless it
  is a Python number;
- a :class:`TensorList` of per-parameter tensors (``contiguous=False``), whose arithmetic maps
  onto ``torch._foreach_*`` kernels; this mode serves FSDP2 / DTensor parameters.

The pieces:

- :func:`adam_moments` (m, v and AMSGrad's max, in place) and :func:`adam_direction`
  (m-hat / (sqrt(v-hat) + eps), a new tensor);
- :func:`add_decayed_weights`: u + wd * p (decay into a gradient, or decoupled decay into a
  direction);
- :func:`trust_ratio`: the per-tensor factor ||w|| / ||u|| of LAMB and LARS, from per-tensor
  norms the caller reduced (see :mod:`kiln.optim._segments`);
- :func:`heavy_ball`: momentum (SGD's, with dampening and Nesterov; LARS's);
- :func:`apply`: p - lr * direction.

State is updated in place (``lerp_``, ``mul_``, ``addcmul_``, ...): the TensorList path then
costs one ``_foreach_*_`` launch per operation instead of a fresh list of tensors per
operation, and inside ``torch.compile`` in-place and pure code compile to the same kernel.

>>> import torch
>>> p, u = torch.ones(4), torch.full((4,), 0.5)
>>> apply(p, add_decayed_weights(u, p, 0.5), 0.1).tolist()
[0.8999999761581421, 0.8999999761581421, 0.8999999761581421, 0.8999999761581421]
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["TensorList", "adam_direction", "adam_moments", "add_decayed_weights", "apply", "heavy_ball", "nonzero",
           "trust_ratio"]


def _ts(x: Any) -> Any:
    return x.ts if isinstance(x, TensorList) else x


class TensorList:
    """A list of tensors with elementwise arithmetic done by ``torch._foreach_*`` kernels.

    Scalars (Python numbers) broadcast; so does a TensorList of 0-d tensors (one per
    tensor, e.g. a per-tensor trust ratio). Methods ending in ``_`` work in place and
    return ``self``, as on a tensor.
    """

    __slots__ = ("ts",)

    def __init__(self, ts: Iterable[torch.Tensor]) -> None:
        self.ts = list(ts)

    def __len__(self) -> int:
        return len(self.ts)

    # out of place: a new list of tensors per operation
    def __add__(self, o: Any) -> "TensorList":
        return TensorList(torch._foreach_add(self.ts, _ts(o)))

    __radd__ = __add__

    def __sub__(self, o: Any) -> "TensorList":
        return TensorList(torch._foreach_sub(self.ts, _ts(o)))

    def __rsub__(self, o: Any) -> "TensorList":  # scalar - list
        return TensorList(torch._foreach_add(torch._foreach_neg(self.ts), o))

    def __mul__(self, o: Any) -> "TensorList":
        return TensorList(torch._foreach_mul(self.ts, _ts(o)))

    __rmul__ = __mul__

    def __truediv__(self, o: Any) -> "TensorList":
        return TensorList(torch._foreach_div(self.ts, _ts(o)))

    def __neg__(self) -> "TensorList":
        return TensorList(torch._foreach_neg(self.ts))

    def sqrt(self) -> "TensorList":
        return TensorList(torch._foreach_sqrt(self.ts))

    def lerp(self, end: "TensorList", weight: float) -> "TensorList":
        return TensorList(torch._foreach_lerp(self.ts, end.ts, weight))

    def maximum_(self, o: "TensorList") -> "TensorList":
        torch._foreach_maximum_(self.ts, o.ts)
        return self

    def clone(self) -> "TensorList":
        return TensorList(t.clone() for t in self.ts)

    # in place
    def add_(self, o: Any, alpha: float = 1) -> "TensorList":
        if alpha == 1:
            torch._foreach_add_(self.ts, _ts(o))
        else:
            torch._foreach_add_(self.ts, _ts(o), alpha=alpha)
        return self

    def sub_(self, o: Any) -> "TensorList":
        torch._foreach_sub_(self.ts, _ts(o))
        return self

    def mul_(self, o: Any) -> "TensorList":
        torch._foreach_mul_(self.ts, _ts(o))
        return self

    def div_(self, o: Any) -> "TensorList":
        torch._foreach_div_(self.ts, _ts(o))
        return self

    def sqrt_(self) -> "TensorList":
        torch._foreach_sqrt_(self.ts)
        return self

    def lerp_(self, end: "TensorList", weight: float) -> "TensorList":
        torch._foreach_lerp_(self.ts, end.ts, weight)
        return self

    def addcmul_(self, t1: "TensorList", t2: "TensorList", value: float = 1) -> "TensorList":
        torch._foreach_addcmul_(self.ts, t1.ts, t2.ts, value=value)
        return self

    def addcdiv_(self, t1: "TensorList", t2: "TensorList", value: float = 1) -> "TensorList":
        torch._foreach_addcdiv_(self.ts, t1.ts, t2.ts, value=value)
        return self

    def copy_(self, src: "TensorList") -> "TensorList":
        torch._foreach_copy_(self.ts, src.ts)
        return self


# -- the pieces ------------------------------------------------------------------------------------

def nonzero(x: Any) -> bool:
    """Whether a hyperparameter may be nonzero: a tensor (compiled; its value unknown at trace
    time) always, a list of per-tensor values if any is, a number if it is."""
    if isinstance(x, torch.Tensor):
        return True
    return any(x) if isinstance(x, list) else bool(x)


def adam_moments(g, m, v, vmax=None, *, beta1, beta2, c1=None, c2=None):
    """Adam's moments, in place: m = beta1*m + (1-beta1)*g (torch's lerp);
    v = beta2*v + (1-beta2)*g^2; AMSGrad's vmax = max(vmax, v). c1, c2 may pass 1-beta1, 1-beta2
    precomputed in float64 (a compiled caller holds betas as fp32 tensors, where 1-0.9 would
    round differently)."""
    m.lerp_(g, 1 - beta1 if c1 is None else c1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2 if c2 is None else c2)
    if vmax is not None:
        vmax.maximum_(v) if isinstance(vmax, TensorList) else torch.maximum(vmax, v, out=vmax)


def adam_direction(m, v, *, eps, bc1, bc2):
    """The bias-corrected direction (m / bc1) / (sqrt(v / bc2) + eps), a new tensor (v: AMSGrad's
    max where it keeps one); bc1, bc2 are 1 - beta1**t and 1 - beta2**t."""
    return (m / ((v / bc2).sqrt_().add_(eps))).div_(bc1)


def add_decayed_weights(u, p, weight_decay):
    """u + weight_decay * p, in place on u (a gradient's copy: coupled decay; a direction:
    decoupled decay, LAMB's). weight_decay may be a tensor that broadcasts (per row of the
    arena: (B, 1), 0 where a tensor is excluded) or, over a TensorList, a list with one value
    per tensor."""
    if isinstance(weight_decay, torch.Tensor):
        return u.addcmul_(p, weight_decay)
    if isinstance(weight_decay, list):
        return u.add_(p * weight_decay)  # (a foreach multiply by a list of scalars)
    return u.add_(p, alpha=weight_decay) if weight_decay else u


def trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, *, eta=1.0, clip=None) -> torch.Tensor:
    """Per-tensor trust ratio eta * ||w|| / ||u||; 1 where either norm is 0.

    w_norm, u_norm: (S,) per-segment norms. clip, if given, caps ||w|| (LAMB's trust_clip).
    """
    if clip is not None:
        w_norm = w_norm.clamp(max=clip)
    # norms are >= 0, so "both > 0" is "the smaller > 0"; where that fails the quotient (inf
    # or nan) is discarded. Five small kernels: this runs once per step over S values.
    ok = torch.minimum(w_norm, u_norm) > 0
    return torch.where(ok, (w_norm if eta == 1.0 else eta * w_norm) / u_norm, 1.0)


def heavy_ball(d, buf, *, momentum, dampening=0.0, nesterov=False, first=False):
    """Momentum on direction d, in place on buf (and d, with Nesterov): buf = d on the first
    step (torch.optim.SGD), else momentum*buf + (1-dampening)*d; returns d + momentum*buf
    (Nesterov) or buf. A buffer that starts at zero makes any step a first one (LARS)."""
    if first:
        buf.copy_(d)
    else:  # (products, not alpha=: a compiled caller's momentum is a 0-d tensor)
        buf.mul_(momentum).add_(d * (1 - dampening) if nonzero(dampening) else d)
    return d.add_(buf * momentum) if nesterov else buf


def apply(p, step, lr):
    """p = p - lr * step, in place: one pass (one foreach launch over a TensorList), or, with lr
    a tensor (compiled), a product the compiler fuses."""
    if isinstance(lr, (int, float)):
        return p.add_(step, alpha=-lr)
    return p.sub_(step * lr)
