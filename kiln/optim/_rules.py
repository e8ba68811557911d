"""Update rules, each written once as a pure function (optax style).

A rule takes the current tensors and hyperparameters and returns the new tensors; it never
mutates its inputs. The same function serves three callers:

- a flat (N,) arena buffer, eagerly (reference and fallback path);
- the same, inside ``torch.compile`` (LAMB, LARS), with hyperparameters as 0-d tensors so a
  learning-rate schedule never recompiles;
- a :class:`TensorList` of per-parameter tensors (``contiguous=False``), whose arithmetic
  maps onto ``torch._foreach_*`` kernels; this mode serves FSDP2 / DTensor parameters.

Hence rules use only ``+ - * /``, ``.sqrt()``, ``.lerp()`` and ``.maximum()``.
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


class TensorList:
    """A list of tensors with elementwise arithmetic done by ``torch._foreach_*`` kernels.

    Scalars (Python numbers) broadcast; so does a TensorList of 0-d tensors (one per
    tensor, e.g. a per-tensor trust ratio).
    """

    __slots__ = ("ts",)

    def __init__(self, ts: Iterable[torch.Tensor]) -> None:
        self.ts = list(ts)

    def __len__(self) -> int:
        return len(self.ts)

    @staticmethod
    def _other(x: Any) -> Any:
        return x.ts if isinstance(x, TensorList) else x

    def __add__(self, o: Any) -> "TensorList":
        return TensorList(torch._foreach_add(self.ts, self._other(o)))

    __radd__ = __add__

    def __sub__(self, o: Any) -> "TensorList":
        return TensorList(torch._foreach_sub(self.ts, self._other(o)))

    def __rsub__(self, o: Any) -> "TensorList":  # scalar - list
        return TensorList(torch._foreach_add(torch._foreach_neg(self.ts), o))

    def __mul__(self, o: Any) -> "TensorList":
        return TensorList(torch._foreach_mul(self.ts, self._other(o)))

    __rmul__ = __mul__

    def __truediv__(self, o: Any) -> "TensorList":
        return TensorList(torch._foreach_div(self.ts, self._other(o)))

    def __neg__(self) -> "TensorList":
        return TensorList(torch._foreach_neg(self.ts))

    def sqrt(self) -> "TensorList":
        return TensorList(torch._foreach_sqrt(self.ts))

    def lerp(self, end: "TensorList", weight: float) -> "TensorList":
        return TensorList(torch._foreach_lerp(self.ts, end.ts, weight))

    def maximum(self, o: "TensorList") -> "TensorList":
        return TensorList(torch._foreach_maximum(self.ts, o.ts))

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

    m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g^2
    u = (m/bc1) / (sqrt(v/bc2) + eps) + wd*p
    Returns (u, m, v). The caller scales u per tensor by :func:`trust_ratio` and applies
    p = p - lr * ratio * u. c1, c2 may pass 1-beta1, 1-beta2 precomputed in float64 (a
    compiled caller holds betas as fp32 tensors, where 1-0.9 would round differently).
    """
    m = m.lerp(g, 1 - beta1 if c1 is None else c1)
    v = v * beta2 + (1 - beta2 if c2 is None else c2) * (g * g)
    u = (m / bc1) / ((v / bc2).sqrt() + eps) + weight_decay * p
    return u, m, v


def trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, *, eta=1.0, clip=None) -> torch.Tensor:
    """Per-tensor trust ratio eta * ||w|| / ||u||; 1 where either norm is 0.

    w_norm, u_norm: (S,) per-segment norms. clip, if given, caps ||w|| (LAMB's trust_clip).
    """
    if clip is not None:
        w_norm = w_norm.clamp(max=clip)
    ok = (w_norm > 0) & (u_norm > 0)
    return torch.where(ok, eta * w_norm / torch.where(ok, u_norm, 1), torch.ones_like(w_norm))


def lars_direction(p, g, *, weight_decay):
    """LARS's direction d = g + wd*p, whose per-tensor norm sets the trust ratio."""
    return g + weight_decay * p


def momentum_update(p, d, buf, *, lr, momentum, nesterov):
    """Heavy-ball step on an already-scaled direction d: buf = momentum*buf + d;
    p = p - lr * (d + momentum*buf if nesterov else buf). Returns (p, buf).

    With buf starting at zero, the first step sets buf = d, as torch.optim.SGD does.
    """
    buf = buf * momentum + d
    step = d + momentum * buf if nesterov else buf
    return p - lr * step, buf
