"""The optimizers without an arena (``contiguous=False``): the same update rules over
per-parameter lists, as ``torch._foreach_*`` kernels, and over the local shards of DTensor
parameters (FSDP2 ``fully_shard``, tensor parallel).

A DTensor's per-tensor norms (LAMB, LARS) are made whole by DTensor itself: the squared
local norms become a partial DTensor over the mesh dimensions the parameters are split on,
and redistributing it to a replicated one sums them (one collective, issued by torch).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.optim.optimizer import _device_dtype_check_for_fused, _get_scalar_dtype

from kiln.optim._chain import Update, run
from kiln.optim._contract import is_dtensor
from kiln.optim._packing import as_real
from kiln.optim._rules import TensorList

__all__ = ["ListSpace", "init_list_state", "no_complex", "step_lists", "update"]


class ListSpace:
    """Per-parameter tensors, as a chain's runner sees them (see :func:`kiln.optim._chain.run`):
    a tensor's norm is its own (a DTensor's local shard's, made whole by ``norms_of``), a
    per-tensor factor one 0-d tensor or number per tensor of a TensorList."""

    def __init__(self, ps: list[torch.Tensor], norms_of: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
        self.is1d = [p.ndim <= 1 for p in ps]
        self.device = ps[0].device
        self.norms_of = norms_of

    def per_tensor(self, values: Sequence[float]) -> list[float]:
        return list(values)  # (a foreach kernel takes a list of scalars)

    def segment_mask(self, keep: Sequence[bool]) -> torch.Tensor:
        return torch.tensor(keep, device=self.device)

    def norms(self, a: TensorList, b: TensorList) -> torch.Tensor:
        return self.norms_of(a.ts + b.ts)

    def scale(self, u: TensorList, r: torch.Tensor) -> TensorList:
        return u.mul_(list(r.unbind()))


def no_complex(name: str) -> str:
    """What LAMB and LARS say to a complex parameter."""
    return (f"kiln.optim.{name} does not support complex parameters (torch.optim has no {name} "
            f"to follow, and the paper's per-tensor trust ratio is defined for real tensors). "
            f"Optimize the complex parameters with kiln.optim.AdamW or SGD (a second optimizer), "
            f"or keep them in the model as real tensors of shape (..., 2) (torch.view_as_real).")


def _by_torch(group: dict[str, Any]) -> bool:
    """The group asks for what only torch's own implementation does (see ArenaOptimizer)."""
    return bool(group.get("capturable") or group.get("differentiable"))


def init_list_state(state: dict[Any, Any], p: torch.Tensor, group: dict[str, Any], names: tuple[str, ...]) -> dict:
    """p's state before its first step, stored in ``state`` as torch.optim lays it out: 'step'
    on the CPU unless capturable or fused (then beside p, float32 if fused)."""
    on_p = group.get("capturable") or group.get("fused")
    st = state[p]
    st["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")),
                             device=p.device if on_p else "cpu")
    for name in names:
        st[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def step_lists(opt: Any) -> None:
    """One step of ``opt`` over its parameters as they are: torch's own implementation for
    groups that ask for it, else :func:`update` per bucket of tensors that share a device,
    dtype, DTensor layout and the optimizer's list key (usually the step count)."""
    for group in opt.param_groups:
        fused, by_torch = group.get("fused"), _by_torch(group)
        with_grad: list[torch.Tensor] = []
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if fused and torch.is_complex(p):
                _device_dtype_check_for_fused(p)  # torch refuses fused=True for complex
            st = opt.state.get(p) or opt._init_list_state(p, group)
            if by_torch:
                with_grad.append(p)
                continue
            dkey = (p.device_mesh, tuple(p.placements)) if is_dtensor(p) else None
            buckets.setdefault((p.device, p.dtype, dkey, opt._list_key(p, st)), []).append(p)
        if with_grad:
            opt._update_torch(group, with_grad)
        for (_, _, dkey, key), ps in buckets.items():
            if dkey is None:
                update(opt, group, ps, key)
            else:
                _update_dtensors(opt, group, ps, key)


def update(opt: Any, group: dict[str, Any], ps: list[torch.Tensor], key: Any) -> None:
    """One multi-tensor step of ``ps`` (all with gradients, sharing a device, a dtype and the
    list key ``key``): torch's fused kernel where the optimizer declares one that serves here,
    else the optimizer's chain over TensorLists. Complex tensors as pairs of reals."""
    chain = opt.chain_for(group)
    names = chain.state_names(group)
    # torch.optim.SGD makes its momentum buffers at a parameter's first step (key 0: none yet)
    made = ({p: {n: torch.empty_like(p, memory_format=torch.preserve_format) for n in names} for p in ps}
            if names and not opt._has_step_state and key == 0 else {})
    if made or not (names or opt._has_step_state):  # (SGD without momentum: torch keeps no entry)
        sts = [made.get(p) for p in ps]
    else:
        sts = [opt.state[p] for p in ps]
    state = {n: as_real([st[n] for st in sts]) for n in names}
    steps = [st["step"] for st in sts] if opt._has_step_state else None
    params, grads = as_real(ps), as_real([p.grad for p in ps])
    if opt._fused_ok(ps[0].device, ps[0].dtype):
        if steps is not None:
            if steps[0].device != ps[0].device:  # torch.optim keeps 'step' on the CPU; CUDA kernels want it beside p
                for p in ps:
                    opt.state[p]["step"] = opt.state[p]["step"].to(p.device)
                steps = [opt.state[p]["step"] for p in ps]
            torch._foreach_add_(steps, 1.0)  # (the kernel reads each tensor's count)
        opt._torch_fused(group, params, grads, state, steps, first=key == 0)
    else:
        space = ListSpace(ps, opt._tensor_norms)
        run(chain, Update(TensorList(params), TensorList(grads), {n: TensorList(v) for n, v in state.items()}),
            chain.hyper(group, key + 1, space), space)
        if steps is not None:
            torch._foreach_add_(steps, 1.0)
    for p, st in made.items():
        opt.state[p].update(st)


def _norm_completer(mesh: Any, placements: tuple[Any, ...]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Local per-tensor norms -> whole-tensor norms over the split mesh dimensions (None: no
    dimension is split). Not ``is_shard()``: FSDP2's dp placement over a tensor-parallel shard
    is a _StridedShard, which is split over its mesh dim but is not is_shard() in torch 2.13."""
    if all(pl.is_replicate() for pl in placements):
        return None
    from torch.distributed.tensor import DTensor, Partial, Replicate

    pending = [Replicate() if pl.is_replicate() else Partial() for pl in placements]

    def complete(norms: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(norms.square(), mesh, pending, run_check=False).full_tensor().sqrt()

    return complete


def _update_dtensors(opt: Any, group: dict[str, Any], ps: list[torch.Tensor], key: Any) -> None:
    """Run :func:`update` on the local shards of DTensor parameters (all on one mesh
    with the same placements): parameters, gradients and state as plain local tensors, so
    the fused / foreach kernels run unchanged; per-tensor norms (LAMB, LARS) are completed
    over the mesh; state created during the update is wrapped back into DTensors."""
    from torch.distributed.tensor import DTensor

    mesh, placements = ps[0].device_mesh, tuple(ps[0].placements)
    if any(pl.is_partial() for pl in placements):
        raise ValueError(f"kiln.optim: parameters with Partial placements are not supported: {placements}")

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    locs, saved, local_state, given = [], opt.state, {}, []
    for p in ps:
        # grad mode is off in a step: a Parameter's to_local() is a fresh view of its shard, any
        # other DTensor's the shard itself; either way updates land in the parameter, and the
        # .grad set here is taken off again below
        lp = p.to_local()
        lp.grad = local(p.grad)
        locs.append(lp)
        local_state[lp] = {k: local(v) for k, v in saved.get(p, {}).items()}
        given.append(dict(local_state[lp]))
    opt.state = local_state
    opt.complete_norms = _norm_completer(mesh, placements)
    try:
        update(opt, group, locs, key)
    finally:
        opt.state = saved
        opt.complete_norms = None
    for p, lp, before in zip(ps, locs, given):
        lp.grad = None
        if not local_state[lp]:  # no state (SGD without momentum): no entry, as torch
            continue
        st = saved[p]
        for k, v in local_state[lp].items():
            if v is before.get(k):  # updated in place (the DTensor's own shard, or a plain 'step')
                continue
            if torch.is_tensor(v) and k != "step" and v.shape == lp.shape:
                v = DTensor.from_local(v, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
            st[k] = v
