"""The one global-norm clip: :func:`clip_grad_norm_`, for every kind of gradient kiln trains.

A gradient is described by *parts*: ``(local tensors, process groups)``. The p-th powers of a
part's local tensors are summed, then summed over the ranks of each of its groups, so that
every element of the whole model's gradient counts exactly once:

- an arena's flat gradient, replicated on every rank: ``(flat buffers, ())``;
- a ZeRO-1/2 shard of it: ``(shard buffers, (dp group,))``;
- a DTensor gradient (FSDP2, tensor parallel, both): its local tensor, over the group of each
  mesh dimension it is split on (a replicated dimension adds nothing);
- a pipeline stage: the caller's ``extra_group`` sums the stages' totals.

Whatever holds the gradients says what its parts are: :func:`grad_parts` asks an object's
``grad_parts()`` method (kiln's optimizers and ZeRO's wrapper have one) or reads parameters'
``.grad``. One reduction per part and group, one multiply per tensor; no data-dependent branch
(a host sync on GPUs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Sequence

import torch

from kiln.optim._norms import tensor_norms

GradPart = tuple[list[torch.Tensor], tuple[Any, ...]]  # (local tensors, process groups to sum over)


def _local_and_groups(t: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """A gradient's local tensor and the groups that hold the rest of it. _StridedShard
    (FSDP2 over a TP shard) is not ``is_shard()`` in torch 2.13, so all but Replicate count."""
    local = getattr(t, "_local_tensor", None)
    if local is None:
        return t, ()
    if any(p.is_partial() for p in t.placements):
        raise ValueError(f"a gradient with Partial placements {t.placements}: reduce it before clipping")
    mesh = t.device_mesh
    return local, tuple(mesh.get_group(d) for d, p in enumerate(t.placements) if not p.is_replicate())


def param_grad_parts(params: Iterable[torch.Tensor]) -> list[GradPart]:
    """The parts of the ``.grad`` of ``params`` (each parameter once), grouped by the process
    groups their local tensors sum over."""
    parts: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        local, groups = _local_and_groups(p.grad)
        parts.setdefault(groups, []).append(local)
    return [(ts, groups) for groups, ts in parts.items()]


def grad_parts(obj: Any) -> list[GradPart]:
    """The gradient parts of an optimizer (its ``grad_parts()``, or its parameters' ``.grad``),
    a tensor or an iterable of parameters."""
    if callable(getattr(obj, "grad_parts", None)):
        return obj.grad_parts()
    if isinstance(obj, torch.optim.Optimizer):
        return param_grad_parts(p for g in obj.param_groups for p in g["params"])
    if isinstance(obj, torch.Tensor):
        obj = [obj]
    return param_grad_parts(obj)


def _all_reduce(x: torch.Tensor, groups: Sequence[Any], inf: bool) -> None:
    import torch.distributed as dist

    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    for group in groups:
        dist.all_reduce(x, op=op, group=group)


@torch.no_grad()
def clip_grad_norm_(grads: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    extra_group: Any = None) -> torch.Tensor:
    """Scale all gradients of ``grads`` so that their global norm is at most ``max_norm``;
    returns the norm before clipping, a 0-d tensor, the same on every rank, like
    ``torch.nn.utils.clip_grad_norm_``.

    ``grads``: one of kiln's optimizers (one reduction per arena, or per shard under ZeRO), any
    ``torch.optim.Optimizer``, parameters (plain, tensor-parallel or FSDP2 DTensors, mixed), or
    a list of :data:`GradPart`. ``extra_group``: the ranks that hold the model's other
    parameters (pipeline stages), whose gradients count too. Every rank of a group must call it.

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
    for tensors, groups in parts:
        if not tensors:
            continue
        # at least fp32; fp64 gradients keep fp64 (equivalence checks compare to 1e-12); an
        # arena's flat gradient is long: blocked, or one fp32 norm of 25 M elements is 1e-3 off
        norms = tensor_norms(tensors, p)
        part = norms.max() if inf else norms.pow(p).sum()
        _all_reduce(part, groups, inf)
        totals.append(part)
    device = totals[0].device if totals else torch.device("cpu")
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in totals) else torch.float32
    totals = [t.to(device, dtype) for t in totals]
    if not totals:  # no gradient on this rank, but the other stages wait for its part
        total = torch.zeros((), dtype=dtype, device=device)
    else:
        total = torch.stack(totals).max() if inf else torch.stack(totals).sum()
    if extra_group is not None:
        _all_reduce(total, (extra_group,), inf)
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
