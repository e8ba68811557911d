"""Data parallel (zero=0) and ZeRO stages 1 and 2 on kiln's arena.

Every rank holds the whole model. Stage 0 averages gradients with one ``all_reduce`` per
arena. Under ZeRO (Rajbhandari et al., arXiv 1910.02054) the optimizer shards itself
(:meth:`kiln.optim.ArenaOptimizer.shard`: it steps only the rank's contiguous shard of each
arena, holds state for that alone, sums LAMB/LARS norms over the group); this wrapper moves
the bytes. Stage 1 reduce-scatters gradients (averaged) in place into the shard, a view of
the full gradient, and all-gathers the parameters after the step. Stage 2 also frees the full
gradient after the reduce-scatter (storage resized to 0, ``p.grad`` None) until the next
backward's first gradient (a gradient pre-hook brings it back as zeros), so through the
forward pass, where activation memory peaks, a rank holds only its shard's gradient.
(Reducing buckets *during* backward, as DeepSpeed does, is future work.)

The calls per step, the same on every rank (they are collectives); dp ranks with batch B/dp
each train like one process with batch B (gradients are averaged; tested to 1e-6)::

    zero = ZeroOptimizer(kiln.optim.AdamW(model.parameters(), shard_multiple=world), stage=2)
    broadcast_parameters(model)              # once, before training: rank 0's initial values
    for step in ...:
        for micro in range(accumulate):      # gradients accumulate locally, no communication
            (loss_fn(model(x[micro])) / accumulate).backward()
        zero.reduce_gradients()              # once per step (step() calls it if you do not)
        total = kiln.optim.clip_grad_norm_(zero, 1.0)  # optional: global norm over all ranks' shards
        zero.step()                          # shard update (+ all-gather of parameters)
        zero.zero_grad()
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from kiln.optim import ArenaOptimizer, ArenaSlice

__all__ = ["ZeroOptimizer", "broadcast_parameters", "all_reduce_gradients"]

# torch 2.13 renamed the flat collectives (the old names warn)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


# -- zero=0: data parallel ----------------------------------------------------------------------
def _tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, ZeroOptimizer):
        obj = obj.optimizer
    if isinstance(obj, Optimizer):
        return [p for g in obj.param_groups for p in g["params"]]
    if isinstance(obj, torch.nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    return list(obj)


@torch.no_grad()
def broadcast_parameters(module_or_optimizer: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> int:
    """Copy rank ``src``'s parameters (and a module's buffers) to every rank, once before training:
    one broadcast per storage (the byte span covering the tensors in it: an arena in one
    message). Returns the number of broadcasts."""
    if _world(group) == 1:
        return 0
    spans: dict[tuple, list[Any]] = {}  # storage key -> [storage, device, lo byte, hi byte]
    for t in _tensors_of(module_or_optimizer):
        if t is None or t.numel() == 0:
            continue
        st, lo = t.untyped_storage(), t.storage_offset() * t.element_size()
        hi = lo + t.numel() * t.element_size()  # views kiln makes are contiguous
        if not t.is_contiguous():
            lo, hi = 0, st.nbytes()
        span = spans.setdefault((t.device, st.data_ptr()), [st, t.device, lo, hi])
        span[2], span[3] = min(span[2], lo), max(span[3], hi)
    for st, device, lo, hi in spans.values():
        flat = torch.empty(0, dtype=torch.uint8, device=device).set_(st, lo, (hi - lo,))
        dist.broadcast(flat, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    return len(spans)


def _sum_over_ranks(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum tensors in place over the ranks of group: one all-reduce per dtype, over a flat copy."""
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(ts, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in ts]), ts)])


@torch.no_grad()
def all_reduce_gradients(optimizer: Optimizer | Any, group: dist.ProcessGroup | None = None, *,
                         sync_unused: bool = True) -> None:
    """Average the gradients of ``optimizer``'s parameters over ``group`` (zero=0), once per step,
    after the *last* micro-batch's backward, before unscaling, clipping and ``step()``.

    A kiln optimizer: one ``all_reduce`` (sum) per arena on the flat gradient in place, then one
    divide; with ``sync_unused`` one more tiny all-reduce ORs which parameters received a
    gradient, so ranks that disagree (a branch taken on some ranks only) step the same ones.
    Otherwise one all-reduce per dtype over a flat copy of the (local) gradients, None as zero."""
    world = _world(group)
    if world == 1:
        return
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.reduce_gradients()
        return
    if isinstance(optimizer, ArenaOptimizer) and optimizer.contiguous:
        if sync_unused:
            optimizer.union_received(lambda flags: _max_over_ranks(flags, optimizer, group))
        for g in optimizer.flat_grads():
            dist.all_reduce(g, group=group)  # gloo has no AVG: sum, then divide once
            g.div_(world)
        return
    # Parameters as they are (multi-tensor mode; the local shards of tensor-parallel DTensor
    # gradients, laid out alike on every dp rank).
    params = [p for p in dict.fromkeys(_tensors_of(optimizer)) if p.requires_grad]  # a tied one once
    for p in params:
        if p.grad is None:  # every rank must send the same buffer: a missing gradient is zero
            p.grad = torch.zeros_like(p)
    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in params]
    _sum_over_ranks(grads, group)
    torch._foreach_div_(grads, world)


def _max_over_ranks(flags: torch.Tensor, optimizer: ArenaOptimizer, group: dist.ProcessGroup | None) -> None:
    device = optimizer.arenas[0].device if optimizer.arenas else torch.device("cpu")
    on_dev = flags if dist.get_backend(group) == "gloo" or device.type == "cpu" else flags.to(device)  # NCCL
    dist.all_reduce(on_dev, op=dist.ReduceOp.MAX, group=group)
    if on_dev is not flags:
        flags.copy_(on_dev.cpu())


# -- ZeRO-1 / ZeRO-2 ----------------------------------------------------------------------------
class ZeroOptimizer(Optimizer):
    """ZeRO stage 1 or 2 (or plain data parallel, ``stage=0``) around a kiln optimizer.

    Args:
        optimizer: a kiln optimizer (``contiguous=True``) built with ``shard_multiple=world``
            (the default in an initialised process group). Stages 1 and 2 shard it
            (:meth:`~kiln.optim.ArenaOptimizer.shard`): its state never exists at full size.
        stage: 0 (all-reduce, full state on every rank), 1 (sharded optimizer state), 2
            (sharded state and gradients). Stage 3 is FSDP2, outside the arena.
        group: the data-parallel process group (default: the whole world).

    It shares ``param_groups`` with the wrapped optimizer (schedulers work on either); after
    wrapping use only the wrapper. Every trainable parameter steps on every step (as under
    DDP); frozen ones never do. Stage 2 drops any gradient present when it is built.
    """

    def __init__(self, optimizer: ArenaOptimizer, stage: int = 1, group: dist.ProcessGroup | None = None):
        if not isinstance(optimizer, ArenaOptimizer) or not optimizer.contiguous:
            raise TypeError("ZeroOptimizer needs one of kiln.optim's optimizers with contiguous=True")
        if stage not in (0, 1, 2):
            raise ValueError(f"stage must be 0, 1 or 2 (stage 3 is FSDP2 fully_shard), got {stage}")
        self.optimizer, self.stage, self.group = optimizer, stage, group
        self.world = _world(group)
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        super().__init__(list(dict.fromkeys(p for g in optimizer.param_groups for p in g["params"])),
                         optimizer.defaults)
        # one set of hyperparameters: schedulers and the inner update read the same dicts
        self.param_groups, self.defaults, self.state = optimizer.param_groups, optimizer.defaults, optimizer.state
        self._reduced = self._freed = False
        if stage == 0:
            return
        optimizer.shard(self.rank, self.world, group, keep_full_grad=stage == 1)  # 1: reduce-scatter in place
        if stage == 2:
            self._grad_nbytes = [a.grad.untyped_storage().nbytes() for a in optimizer.arenas]

            def hook(_grad: torch.Tensor, ref: Any = weakref.ref(self)) -> None:  # a dropped wrapper: no-op
                if (zero := ref()) is not None and zero._freed:
                    zero.materialize_grads()  # runs before autograd accumulates into p.grad

            self._grad_hooks = [p.register_hook(hook) for _, ps in optimizer.packed_params() for p in ps
                                if p.requires_grad]
            self._free_grads()

    # -- gradients ----------------------------------------------------------------------------
    @torch.no_grad()
    def _free_grads(self) -> None:
        for arena, params in self.optimizer.packed_params():
            for p in params:
                p.grad = None
            arena.grad.untyped_storage().resize_(0)
        self._freed = True

    @torch.no_grad()
    def materialize_grads(self) -> None:
        """Stage 2: bring back the full flat gradients as zeros, ``p.grad`` views re-linked. Runs
        by itself at a backward's first gradient; call it before writing gradients by hand."""
        if not self._freed:
            return
        for (arena, params), nbytes in zip(self.optimizer.packed_params(), self._grad_nbytes):
            arena.grad.untyped_storage().resize_(nbytes)
            arena.grad.zero_()
            for p, view in zip(params, arena.gviews):
                if p.requires_grad:
                    p.grad = view
        self._freed = False

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the gradients over ranks: ``all_reduce`` per arena (stage 0), or
        ``reduce_scatter`` per arena into this rank's shard (stage 2 then frees the full
        gradient). Once per step, after the last backward; later calls in the step do nothing."""
        if self._reduced:
            return
        self._reduced = True
        if self.stage == 0:
            all_reduce_gradients(self.optimizer, self.group)
            return
        self.materialize_grads()  # a step with no backward since the last one: zero gradients
        full = self.optimizer.flat_grads()  # (after absorbing gradients placed outside the arena)
        for g, shard in zip(full, self.optimizer.shards):
            if self.world > 1:
                _reduce_scatter(shard.grad, g, group=self.group)
            elif shard.grad.data_ptr() != g.data_ptr():
                shard.grad.copy_(g)
            shard.grad.div_(self.world)
        if self.stage == 2:
            self._free_grads()

    def flat_grads(self) -> list[torch.Tensor]:
        """The gradients this rank steps, averaged once :meth:`reduce_gradients` ran: the full
        flat ones (stage 0) or this rank's shards (a non-finite check must be OR-ed over ranks)."""
        if self.stage == 0:
            return self.optimizer.flat_grads()
        return [s.grad for s in self.optimizer.shards]

    def grad_parts(self) -> list[tuple[list[torch.Tensor], tuple[Any, ...]]]:
        """For :func:`kiln.optim.clip_grad_norm_`: the full gradients, or the shards (over the group)."""
        return self.optimizer.grad_parts()

    def mark_grads_ready(self) -> None:
        self.optimizer.mark_grads_ready()  # gradients written by hand (master weights)

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """One memset per arena; nothing while stage 2 has freed the full gradient (it comes
        back as zeros, and the next reduce-scatter overwrites the shard's)."""
        self._reduced = False
        if not self._freed:
            self.optimizer.zero_grad(set_to_none)

    # -- the update -----------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce the gradients (if not done yet), step (this rank's shard), all-gather the parameters."""
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self.reduce_gradients()
        self.optimizer.step()
        if self.world > 1:
            with torch.no_grad():
                for arena, shard in zip(self.optimizer.arenas, self.optimizer.shards):
                    _all_gather(arena.param, shard.param, group=self.group)  # in place: shard is a slice
        self._reduced = False
        return loss

    # -- inspection and state -------------------------------------------------------------------
    @property
    def shards(self) -> list[ArenaSlice]:
        return self.optimizer.shards  # this rank's shard of each arena (stages 1, 2)

    def state_bytes(self) -> int:
        return self.optimizer.state_bytes()  # optimizer state (and scratch) this rank holds

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout with the full state, every rank's pieces gathered: a collective
        (save_sharded writes each rank's pieces without it)."""
        sd = self.optimizer.state_dict()
        if self.stage == 0:
            return sd
        pieces = sd.pop("pieces")
        params = [p for g in self.param_groups for p in g["params"]]
        full = []
        for k in sorted(sd["state"]):  # every rank has the same entries (the stepped parameters)
            st, p = sd["state"][k], params[k]
            for name, piece in st.items():
                if name == "step" or not torch.is_tensor(piece):
                    continue
                st[name] = piece.new_zeros(p.shape)
                if k in pieces:
                    st[name].view(-1)[slice(*pieces[k])] = piece
                full.append(st[name])
        if self.world > 1:
            _sum_over_ranks(full, self.group)  # pieces do not overlap: the sum is the gather
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A torch.optim-layout dict (:meth:`state_dict`'s, ``torch.optim.AdamW``'s): each rank
        takes its pieces (or the inner optimizer's sharded dict, of the same sharding)."""
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.stage}, world={self.world}, rank={self.rank}, {self.optimizer!r})"
