"""Update rules, each written once (optax style) and run unchanged by three callers:

- a flat (N,) arena buffer, eagerly (reference and fallback path);
- the same, inside ``torch.compile`` (LAMB, LARS), with hyperparameters as 0-d tensors so a
  learning-rate schedule never recompiles;
- a :class:`TensorList` of per-parameter tensors (``contiguous=False``), whose arithmetic
  maps onto ``torch._foreach_*`` kernels; this mode serves FSDP2 / DTensor parameters.

Two kinds of rule:

- :func:`sgd` and :func:`adam` are pure (they return new tensors) and are the *reference*
  for torch's fused kernels (``torch._fused_sgd_``, ``torch._fused_adam(w)_``), which are
  what kiln runs on both the flat buffer and the per-parameter lists wherever they exist
  (CPU, CUDA); the rules run only on other devices and in the tests that pin them to the
  kernels.
- :func:`lamb_direction` and :func:`momentum_update` update the optimizer state they are
  given *in place* (``lerp_``, ``mul_``, ``addcmul_``, ...), because they are the only
  implementation of their math: in place, the TensorList path costs one ``_foreach_*_``
  launch per operation instead of a fresh list of tensors per operation (allocating ~200
  tensors of up to 256 KB per operation was most of the 94 ms of the old multi-tensor
  step), and inside ``torch.compile`` in-place and pure code compile to the same kernel.

Per-tensor statistics (LAMB, LARS trust ratios) are the caller's job: it reduces over
segments and hands the rule a per-segment vector (see :func:`trust_ratio`).

>>> import torch
>>> p, g = torch.ones(4), torch.full((4,), 0.5)
>>> new_p, new_buf = sgd(p, g, None, lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0,
...                      nesterov=False, first_step=True)
>>> new_p.tolist()
[0.949999988079071, 0.949999988079071, 0.949999988079071, 0.949999988079071]
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["TensorList", "sgd", "adam", "lamb_direction", "trust_ratio", "lars_direction",
           "momentum_update"]


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

    def maximum(self, o: "TensorList") -> "TensorList":
        return TensorList(torch._foreach_maximum(self.ts, o.ts))

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

    def copy_into(self, dst: "TensorList") -> None:
        torch._foreach_copy_(dst.ts, self.ts)


def sgd(p, g, buf, *, lr, momentum, dampening, weight_decay, nesterov, first_step, maximize=False):
    """torch.optim.SGD's rule. Returns (new_p, new_buf); buf is None without momentum.

    d = g + wd*p;  buf = d on the first step, else momentum*buf + (1-dampening)*d;
    step = d + momentum*buf (Nesterov) or buf;  p = p - lr*step.
    """
    d = -g if maximize else g
    if weight_decay:
        d = d + weight_decay * p
    if momentum:
        buf = d if first_step else buf * momentum + (1 - dampening) * d
        d = d + momentum * buf if nesterov else buf
    return p - lr * d, buf


def adam(p, g, m, v, vmax, *, lr, beta1, beta2, eps, weight_decay, decoupled, bc1, bc2,
         maximize=False):
    """Adam (decoupled=False: L2 decay into the gradient) or AdamW (decoupled=True).

    bc1, bc2 are the bias corrections 1-beta1**t and 1-beta2**t. vmax is the AMSGrad running
    maximum or None. Returns (p, m, v, vmax), the same ordering of operations as torch's
    for-loop implementation so that results agree to rounding.
    """
    if maximize:
        g = -g
    if weight_decay:
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m = m.lerp(g, 1 - beta1)
    v = v * beta2 + (1 - beta2) * (g * g)
    if vmax is not None:
        vmax = vmax.maximum(v)
    denom = (v if vmax is None else vmax).sqrt() / (bc2 ** 0.5) + eps
    return p - (lr / bc1) * (m / denom), m, v, vmax


def lamb_direction(p, g, m, v, *, beta1, beta2, eps, weight_decay, bc1, bc2, c1=None, c2=None):
    """LAMB's per-element direction (You et al. 2019, arXiv 1904.00962, Algorithm 2).

    m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g^2     (m, v updated in place)
    u = (m/bc1) / (sqrt(v/bc2) + eps) + wd*p                   (returned, a new tensor)

    The caller scales u per tensor by :func:`trust_ratio` and applies p = p - lr * ratio * u.
    c1, c2 may pass 1-beta1, 1-beta2 precomputed in float64 (a compiled caller holds betas
    as fp32 tensors, where 1-0.9 would round differently).
    """
    m.lerp_(g, 1 - beta1 if c1 is None else c1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2 if c2 is None else c2)
    denom = (v / bc2).sqrt_().add_(eps)
    return (p * weight_decay).addcdiv_(m, denom, value=1 / bc1)


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


def lars_direction(p, g, *, weight_decay):
    """LARS's direction d = g + wd*p, whose per-tensor norm sets the trust ratio. weight_decay
    may be a tensor that broadcasts (per block over the arena, 0 where a tensor is excluded);
    the arena takes the norms of the same sum computed by ``torch.addcmul(g, p, wd)``."""
    return g + weight_decay * p


def momentum_update(p, d, buf, *, lr, momentum, nesterov):
    """Heavy-ball step on an already-scaled direction d, in place on p and buf (and d, which
    is consumed): buf = momentum*buf + d;  p = p - lr * (d + momentum*buf if nesterov else buf).

    With buf starting at zero, the first step sets buf = d, as torch.optim.SGD does.
    """
    buf.mul_(momentum).add_(d)
    step = d.add_(buf * momentum) if nesterov else buf
    p.sub_(step * lr)
