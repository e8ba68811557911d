"""Update rules as chains of transforms (optax's ``chain(scale_by_adam(), add_decayed_weights(),
...)``): each optimizer declares its chain once, and runs it wherever its numbers live.

    >>> from kiln.optim import LAMB
    >>> LAMB.chain
    chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio, learning_rate)

A transform maps the update ``u`` (the gradient where the chain starts) to the next one,
reading the parameters, the state buffers it keeps (under torch.optim's names) and its own
hyperparameters; the last one, :data:`learning_rate`, moves the parameters. Two kinds:

- elementwise, ``update(u, x, h) -> u``: the same code over a flat arena buffer (or a (B, blk)
  view of one), inside ``torch.compile``, and over a :class:`~kiln.optim._rules.TensorList` of
  per-parameter tensors;
- per tensor, ``ratio(w_norm, u_norm, h) -> r``: one factor per parameter tensor from the norms
  of the parameter and of ``u`` (LAMB's and LARS's trust ratio). Taking the norms and scaling
  ``u`` by the factors depend on where the numbers live: the runner's *space* does both.

Where the numbers live is kept apart from what the chain does to them. :func:`run` runs a chain
eagerly over any buffers with a space (per-parameter lists: :class:`kiln.optim._lists.ListSpace`);
:mod:`kiln.optim._flat` runs it over an arena's flat buffers (or a ZeRO shard's slice of them), one
kernel on each side of the per-tensor transform. Torch's fused kernels and kiln's native CPU
kernels are declared beside the chain they fuse, by the optimizer classes, and tested against it.

A transform reads its hyperparameters from the parameter group through its ``hyper(group, step,
space)``: numbers (Python numbers eagerly, 0-d tensors inside a compiled kernel, so that a
schedule never recompiles), flags (bools: fixed for a compiled kernel), and per-tensor values,
which the space lays out (LARS leaves 1-d tensors undecayed). A transform that writes ``u`` in
place calls :func:`own` first, so that the gradient itself is never written.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence

import torch

from kiln.optim import _rules

__all__ = ["Chain", "Space", "Transform", "Update", "add_decayed_weights", "chain", "decay_weights", "elementwise",
           "heavy_ball", "learning_rate", "maximize", "own", "run", "scale_by_adam", "scale_by_trust_ratio"]

Group = Mapping[str, Any]


class Space(Protocol):
    """Where a chain's numbers live, as its transforms' hyperparameters see it
    (:class:`kiln.optim._flat.FlatSpace`, :class:`kiln.optim._lists.ListSpace`)."""

    is1d: list[bool]  # per tensor: ndim <= 1

    def per_tensor(self, values: Sequence[float]) -> Any:
        """One value per tensor, laid out to broadcast over u (a (B, 1) column, a list)."""

    def segment_mask(self, keep: Sequence[bool]) -> torch.Tensor:
        """(S,) bool, one per tensor, beside the per-tensor norms."""


class Update(NamedTuple):
    """What a chain's transforms read and write besides ``u``: the parameters (moved in place by
    the last transform), the gradient (never written) and the state buffers by name."""

    p: Any
    g: Any
    state: Mapping[str, Any]


def own(u: Any, x: Update) -> Any:
    """``u``, or a copy of it where ``u`` is still the gradient: for a transform that writes ``u``."""
    return u * 1 if u is x.g else u


def _keeps_nothing(group: Group) -> tuple[str, ...]:
    return ()


class Transform(NamedTuple):
    """One step of an update rule: ``update`` (elementwise) or ``ratio`` (per tensor), its
    hyperparameters from the group (``hyper(group, step, space) -> dict``), and the names of
    the parameter-sized state buffers it keeps (``state(group)``)."""

    name: str
    hyper: Callable[[Group, int, Space], dict[str, Any]]
    update: Callable[[Any, Update, dict[str, Any]], Any] | None = None
    ratio: Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor] | None = None
    state: Callable[[Group], tuple[str, ...]] = _keeps_nothing

    def __repr__(self) -> str:
        return self.name


class Chain(NamedTuple):
    """Transforms applied in order; at most one of them per tensor (see :mod:`kiln.optim._flat`)."""

    transforms: tuple[Transform, ...]

    def __repr__(self) -> str:
        return f"chain({', '.join(t.name for t in self.transforms)})"

    @property
    def split(self) -> int | None:
        """The index of the per-tensor transform, or None (the chain is elementwise)."""
        return next((i for i, t in enumerate(self.transforms) if t.ratio is not None), None)

    def state_names(self, group: Group) -> tuple[str, ...]:
        """The state buffers the chain keeps for a group with these hyperparameters."""
        # (asked for by every step of every arena: a plain loop over the transforms that keep
        # state, not a generator over all of them)
        names: tuple[str, ...] = ()
        for t in self.transforms:
            if t.state is not _keeps_nothing:
                names += t.state(group)
        return names

    def hyper(self, group: Group, step: int, space: Space) -> tuple[dict[str, Any], ...]:
        """Each transform's hyperparameters for step number ``step`` (1 at the first step)."""
        return tuple(t.hyper(group, step, space) for t in self.transforms)

    def hyper_named(self, group: Group, step: int, space: Space) -> dict[str, dict[str, Any]]:
        """:meth:`hyper` by transform name (a fused kernel reads the values it needs)."""
        return {t.name: h for t, h in zip(self.transforms, self.hyper(group, step, space))}


def chain(*transforms: Transform) -> Chain:
    """The transforms, applied in order."""
    if sum(t.ratio is not None for t in transforms) > 1:
        raise ValueError("a chain holds at most one per-tensor transform (the flat runner splits it there)")
    return Chain(transforms)


def elementwise(transforms: tuple[Transform, ...], x: Update, hs: Any, u: Any) -> Any:
    """The elementwise ``transforms`` applied to ``u``, each with its hyperparameters from ``hs``."""
    for t, h in zip(transforms, hs):
        u = t.update(u, x, h)
    return u


def run(chain: Chain, x: Update, hs: tuple[dict[str, Any], ...], space: Any) -> Any:
    """The whole chain, eagerly, from the gradient: ``space.norms(a, b)`` gives the (2S,) norms
    of two buffers per tensor (a's, then b's) and ``space.scale(u, r)`` multiplies each tensor
    of ``u`` by its factor, in place."""
    u = x.g
    for t, h in zip(chain.transforms, hs):
        if t.ratio is None:
            u = t.update(u, x, h)
            continue
        u = own(u, x)
        norms = space.norms(x.p, u)
        n = len(norms) // 2
        u = space.scale(u, t.ratio(norms[:n], norms[n:], h))
    return u


# -- the shared transforms -------------------------------------------------------------------------
# An optimizer's chain is built from these once, at class definition: a compiled kernel keys its
# graphs on the transforms it runs, so the same objects must come back every step.

def _maximize(u: Any, x: Update, h: dict[str, Any]) -> Any:
    return -u if h["maximize"] else u


maximize = Transform("maximize", lambda group, step, space: {"maximize": bool(group.get("maximize", False))},
                     _maximize)
"""-u where the group maximizes (torch.optim's ``maximize=True``)."""


def _decay_hyper(group: Group, step: int, space: Any) -> dict[str, Any]:
    wd = group["weight_decay"]
    if group.get("exclude_1d") and _rules.nonzero(wd) and any(space.is1d):
        # LARS: biases and norm weights (ndim <= 1) are not decayed
        return {"weight_decay": space.per_tensor([0.0 if one else wd for one in space.is1d])}
    return {"weight_decay": wd}


def _decay(u: Any, x: Update, h: dict[str, Any]) -> Any:
    wd = h["weight_decay"]
    return _rules.add_decayed_weights(own(u, x), x.p, wd) if _rules.nonzero(wd) else u


add_decayed_weights = Transform("add_decayed_weights", _decay_hyper, _decay)
"""u + weight_decay * p: L2 decay into the gradient (SGD, Adam, LARS), or decoupled decay into
a direction (LAMB). With the group's ``exclude_1d`` (LARS), tensors with ndim <= 1 get none."""


def _decay_weights(u: Any, x: Update, h: dict[str, Any]) -> Any:
    if _rules.nonzero(h["weight_decay"]):
        x.p.mul_(1 - h["lr"] * h["weight_decay"])
    return u


decay_weights = Transform(
    "decay_weights", lambda group, step, space: {"lr": group["lr"], "weight_decay": group["weight_decay"]},
    _decay_weights)
"""p = p * (1 - lr * weight_decay), u unchanged: AdamW's decoupled decay, in torch's order
(the parameters decay before the step)."""


def _adam_state(group: Group) -> tuple[str, ...]:
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq")


def _adam_hyper(group: Group, step: int, space: Any) -> dict[str, Any]:
    b1, b2 = group["betas"]
    # c1, c2 in float64 here: a compiled kernel holds the betas as fp32, where 1 - 0.9 rounds otherwise
    return {"b1": b1, "b2": b2, "c1": 1 - b1, "c2": 1 - b2, "eps": group["eps"],
            "bc1": 1 - b1 ** step, "bc2": 1 - b2 ** step}


def _adam(u: Any, x: Update, h: dict[str, Any]) -> Any:
    m, v, vmax = x.state["exp_avg"], x.state["exp_avg_sq"], x.state.get("max_exp_avg_sq")
    _rules.adam_moments(u, m, v, vmax, beta1=h["b1"], beta2=h["b2"], c1=h["c1"], c2=h["c2"])
    return _rules.adam_direction(m, v if vmax is None else vmax, eps=h["eps"], bc1=h["bc1"], bc2=h["bc2"])


scale_by_adam = Transform("scale_by_adam", _adam_hyper, _adam, state=_adam_state)
"""Adam's moments (m, v and AMSGrad's running maximum, in place) and its bias-corrected direction
(m / bc1) / (sqrt(v / bc2) + eps), a new tensor."""


def _trust_hyper(group: Group, step: int, space: Any) -> dict[str, Any]:
    keep = None
    if group.get("exclude_1d") and any(space.is1d):  # LARS: no adaptation of 1-d tensors
        keep = space.segment_mask([not one for one in space.is1d])
    return {"eta": group.get("eta", 1.0), "clip": group.get("trust_clip"), "keep": keep}


def _trust(w_norm: torch.Tensor, u_norm: torch.Tensor, h: dict[str, Any]) -> torch.Tensor:
    r = _rules.trust_ratio(w_norm, u_norm, eta=h["eta"], clip=h["clip"])
    return r if h["keep"] is None else torch.where(h["keep"], r, 1.0)


scale_by_trust_ratio = Transform("scale_by_trust_ratio", _trust_hyper, ratio=_trust)
"""u * eta * ||w|| / ||u|| per tensor (1 where either norm is 0; ||w|| capped at the group's
``trust_clip``): LAMB's and LARS's trust ratio. With ``exclude_1d`` (LARS) 1-d tensors keep 1."""


def heavy_ball(*, torch_sgd: bool) -> Transform:
    """Momentum: buf = momentum*buf + (1-dampening)*u; u becomes buf, or u + momentum*buf with
    Nesterov. ``torch_sgd``: torch.optim.SGD's, whose buffer exists only with momentum and is
    set to u at the first step; else LARS's, whose buffer is kept always and starts at zero
    (the same first step, as momentum*0 + u)."""

    def state(group: Group) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] or not torch_sgd else ()

    def hyper(group: Group, step: int, space: Any) -> dict[str, Any]:
        return {"momentum": group["momentum"], "dampening": group.get("dampening", 0.0),
                "nesterov": bool(group["nesterov"]), "first": torch_sgd and step == 1}

    def update(u: Any, x: Update, h: dict[str, Any]) -> Any:
        buf = x.state.get("momentum_buffer")
        if buf is None:  # (no momentum)
            return u
        return _rules.heavy_ball(own(u, x) if h["nesterov"] else u, buf, momentum=h["momentum"],
                                 dampening=h["dampening"], nesterov=h["nesterov"], first=h["first"])

    return Transform("heavy_ball", hyper, update, state=state)


def _learning_rate(u: Any, x: Update, h: dict[str, Any]) -> Any:
    return _rules.apply(x.p, u, h["lr"])


learning_rate = Transform("learning_rate", lambda group, step, space: {"lr": group["lr"]}, _learning_rate)
"""p = p - lr * u, in place: the chain's last transform."""
