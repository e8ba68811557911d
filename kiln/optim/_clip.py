"""The one global-norm clip: :func:`clip_grad_norm_`, for every kind of gradient kiln trains.

A gradient is described by *parts*: ``(local tensors, reducers)``. The p-th powers of a
part's local tensors are summed, then combined over the other ranks by each of its reducers,
so that every element of the whole model's gradient counts exactly once:

- an arena's flat gradient, replicated on every rank: ``(flat buffers, ())``;
- a ZeRO-1/2 shard of it: ``(shard buffers, (the sum over the shards,))``, the reducer the
  sharding's owner (:class:`kiln.parallel.ZeroOptimizer`) gave the optimizer;
- a DTensor gradient (FSDP2, tensor parallel, both): its local tensor, combined over each mesh
  dimension it is split on by DTensor itself (a replicated dimension adds nothing);
- a pipeline stage: the caller's ``extra_reduce`` combines the stages' totals.

A reducer is ``reduce(x, op)``: combine the 0-d tensor ``x`` in place over the ranks that hold
the rest, ``op`` "sum" or "max" (the inf-norm). kiln.optim itself never communicates: whoever
splits the gradient across ranks supplies the reducer.

Whatever holds the gradients says what its parts are: :func:`grad_parts` asks a
:class:`~kiln.optim.KilnOptimizer` (kiln's optimizers and ZeRO's wrapper) for its
``grad_parts()`` or reads parameters' ``.grad``. One reduction per part, one multiply per tensor; no data-dependent branch (a host
sync on GPUs). Norms of long tensors (an arena's flat gradient) are blocked
(:func:`kiln.optim._norms.tensor_norms`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Callable, Sequence

import torch

from kiln.optim._contract import KilnOptimizer, is_dtensor
from kiln.optim._norms import tensor_norms

Reducer = Callable[[torch.Tensor, str], Any]  # reduce(x, op): combine x in place over other ranks
GradPart = tuple[list[torch.Tensor], tuple[Reducer, ...]]  # (local tensors, reducers)


def _dtensor_reducer(mesh: Any, placements: tuple[Any, ...]) -> Reducer:
    """Combine a local statistic over the mesh dimensions a DTensor is split on, by DTensor's
    own redistribution (a partial value made whole). _StridedShard (FSDP2 over a TP shard) is
    not ``is_shard()`` in torch 2.13, so every placement but Replicate counts."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def reduce(x: torch.Tensor, op: str) -> None:
        pending = [Replicate() if p.is_replicate() else Partial(op) for p in placements]
        x.copy_(DTensor.from_local(x, mesh, pending, run_check=False).full_tensor())

    return reduce


def _local_and_key(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A gradient's local tensor and what its reducer depends on (None: a plain tensor)."""
    if not is_dtensor(t):
        return t, None
    if any(p.is_partial() for p in t.placements):
        raise ValueError(f"a gradient with Partial placements {t.placements}: reduce it before clipping")
    placements = tuple(t.placements)
    return t.to_local(), None if all(p.is_replicate() for p in placements) else (t.device_mesh, placements)


def param_grad_parts(params: Iterable[torch.Tensor]) -> list[GradPart]:
    """The parts of the ``.grad`` of ``params`` (each parameter once), grouped by how their
    local tensors combine over the ranks."""
    parts: dict[Any, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        local, key = _local_and_key(p.grad)
        parts.setdefault(key, []).append(local)
    return [(ts, () if key is None else (_dtensor_reducer(*key),)) for key, ts in parts.items()]


def grad_parts(obj: Any) -> list[GradPart]:
    """The gradient parts of an optimizer (a kiln one's ``grad_parts()``, or its parameters'
    ``.grad``), a tensor or an iterable of parameters."""
    if isinstance(obj, KilnOptimizer):
        return obj.grad_parts()
    if isinstance(obj, torch.optim.Optimizer):
        return param_grad_parts(p for g in obj.param_groups for p in g["params"])
    if isinstance(obj, torch.Tensor):
        obj = [obj]
    return param_grad_parts(obj)


def _reduce(x: torch.Tensor, reducers: Sequence[Reducer], inf: bool) -> None:
    for reduce in reducers:
        reduce(x, "max" if inf else "sum")


@torch.no_grad()
def clip_grad_norm_(grads: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    extra_reduce: Reducer | None = None) -> torch.Tensor:
    """Scale all gradients of ``grads`` so that their global norm is at most ``max_norm``;
    returns the norm before clipping, a 0-d tensor, the same on every rank, like
    ``torch.nn.utils.clip_grad_norm_``.

    ``grads``: one of kiln's optimizers (one reduction per arena, or per shard under ZeRO), any
    ``torch.optim.Optimizer``, parameters (plain, tensor-parallel or FSDP2 DTensors, mixed), or
    a list of :data:`GradPart`. ``extra_reduce``: combines the total with the ranks that hold
    the model's other parameters (pipeline stages), whose gradients count too. Every rank that
    a reducer combines over must call it.

    >>> model = torch.nn.Linear(4, 2)
    >>> model(torch.ones(3, 4)).sum().backward()
    >>> total = clip_grad_norm_(model.parameters(), 0.5)
    >>> bool(torch.isclose(torch.cat([p.grad.flatten() for p in model.parameters()]).norm(), torch.tensor(0.5)))
    True
    """
    parts = grads if isinstance(grads, list) and all(isinstance(x, tuple) for x in grads) else grad_parts(grads)
    p = float(norm_type)
    inf = math.isinf(p)
    totals = []
    for tensors, reducers in parts:
        if not tensors:
            continue
        # at least fp32; fp64 gradients keep fp64 (equivalence checks compare to 1e-12); an
        # arena's flat gradient is long: blocked, or one fp32 norm of 25 M elements is 1e-3 off
        norms = tensor_norms(tensors, p)
        part = norms.max() if inf else norms.pow(p).sum()
        _reduce(part, reducers, inf)
        totals.append(part)
    device = totals[0].device if totals else torch.device("cpu")
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in totals) else torch.float32
    totals = [t.to(device, dtype) for t in totals]
    if not totals:  # no gradient on this rank, but the other stages wait for its part
        total = torch.zeros((), dtype=dtype, device=device)
    else:
        total = torch.stack(totals).max() if inf else torch.stack(totals).sum()
    if extra_reduce is not None:
        _reduce(total, (extra_reduce,), inf)
    if not inf:
        total = total.pow(1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so they "
                           "cannot be clipped")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for tensors, _ in parts:
        if tensors:
            torch._foreach_mul_(tensors, coef.to(tensors[0].device))
    return total
