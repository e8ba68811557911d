"""Data parallel (zero=0) and ZeRO stages 1 and 2 on kiln's arena.

Every rank holds the whole model. With ``stage=0`` each rank also holds every gradient and
all optimizer state, and gradients are averaged with one ``all_reduce`` per arena. With
ZeRO (Rajbhandari et al., arXiv 1910.02054) each rank owns the contiguous shard
``arena.shard(rank, world)`` of every arena:

- stage 1: gradients are reduce-scattered (averaged) into the rank's shard, the rank updates
  only its shard with optimizer state the size of the shard, and one ``all_gather`` per arena
  rebuilds the full parameters. The full flat gradient stays allocated between steps (the
  shard gradient is a view of it: the reduce-scatter runs in place).
- stage 2: as stage 1, but the full flat gradient is freed right after the reduce-scatter
  (its storage resized to 0, every ``p.grad`` set to None) and comes back as zeros, with
  the ``p.grad`` views re-linked, when autograd delivers the first gradient of the next
  backward (a gradient pre-hook per parameter). Between steps (through the forward pass,
  where activation memory peaks) a rank holds only its shard's gradient.
  The full gradient still exists during backward: DeepSpeed's stage 2 additionally
  reduces buckets *during* backward; that overlap is future work.

A shard boundary cuts through parameter tensors. SGD, Adam and AdamW are elementwise and run
unchanged on the shard (an :class:`~kiln.optim.ArenaSlice`). LAMB and LARS need per-tensor
norms: each rank computes the partial squared norms of w and of the update direction over
its pieces, one ``all_reduce`` (sum) of that (2*S,) vector per arena completes them, and
every piece of a tensor then applies the same trust ratio.

The order of calls per optimizer step, on every rank (a trainer does exactly this)::

    zero = ZeroOptimizer(kiln.optim.AdamW(model.parameters(), shard_multiple=world), stage=2)
    broadcast_parameters(model)              # once, before training: rank 0's initial values
    for step in ...:
        for micro in range(accumulate):      # gradients accumulate locally, no communication
            (loss_fn(model(x[micro])) / accumulate).backward()
        zero.reduce_gradients()              # once per step (step() calls it if you do not)
        total = kiln.optim.clip_grad_norm_(zero, 1.0)  # optional: global norm over all ranks' shards
        zero.step()                          # shard update (+ all-gather of parameters)
        zero.zero_grad()

With a plain kiln optimizer instead (zero=0 without the wrapper), call
``all_reduce_gradients(opt)`` after the *last* micro-step's backward only, then clip and step
as in one process.

Every rank must make the same calls in the same order (they are collectives). Each rank
should feed its own part of the global batch and divide its loss as one process would for
its micro-batch: gradients are averaged over ranks, so dp ranks with batch B/dp each train
exactly like one process with batch B (tested to 1e-6).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from kiln.optim import ArenaOptimizer, ArenaSlice
from kiln.optim._base import _Pack, step_runs
from kiln.optim._optimizers import _norm_dtype

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
def broadcast_parameters(module_or_optimizer: Any, src: int = 0,
                         group: dist.ProcessGroup | None = None) -> int:
    """Copy rank ``src``'s parameters (and a module's buffers) to every rank.

    One broadcast per distinct storage: the byte span of a storage that covers all of the
    object's tensors in it, so an arena (all parameters of a group, dtype, device) goes in
    one message and stray tensors go one each. Call once before training (after building the
    optimizer or before; both work). Returns the number of broadcasts.
    """
    if _world(group) == 1:
        return 0
    spans: dict[tuple, list[Any]] = {}  # storage key -> [storage, device, lo byte, hi byte]
    for t in _tensors_of(module_or_optimizer):
        if t is None or t.numel() == 0:
            continue
        st = t.untyped_storage()
        lo = t.storage_offset() * t.element_size()
        hi = lo + t.numel() * t.element_size()  # views kiln makes are contiguous
        if not t.is_contiguous():
            hi = st.nbytes()
            lo = 0
        key = (t.device, st.data_ptr())
        span = spans.setdefault(key, [st, t.device, lo, hi])
        span[2], span[3] = min(span[2], lo), max(span[3], hi)
    for st, device, lo, hi in spans.values():
        flat = torch.empty(0, dtype=torch.uint8, device=device).set_(st, lo, (hi - lo,))
        dist.broadcast(flat, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    return len(spans)


@torch.no_grad()
def _union_received(opt: ArenaOptimizer, group: dist.ProcessGroup | None) -> None:
    """OR the "received a gradient" flags over ranks, so a parameter used by some ranks only is
    updated on every rank (with the averaged gradient) and the replicas stay identical."""
    flags = torch.frombuffer(opt._flags, dtype=torch.uint8)  # shares memory with the bytearray
    device = opt._packs[0].arena.device if opt._packs else torch.device("cpu")
    if dist.get_backend(group) == "gloo" or device.type == "cpu":
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    else:
        on_dev = flags.to(device)
        dist.all_reduce(on_dev, op=dist.ReduceOp.MAX, group=group)
        flags.copy_(on_dev.cpu())


@torch.no_grad()
def all_reduce_gradients(optimizer: Optimizer | Any, group: dist.ProcessGroup | None = None, *,
                         sync_unused: bool = True) -> None:
    """Average the gradients of ``optimizer``'s parameters over the ranks of ``group`` (zero=0).

    With a kiln optimizer (``contiguous=True``): one ``all_reduce`` (sum) per arena on the flat
    gradient in place, then one divide; the arena's padding is zero and stays zero. With
    ``sync_unused`` (default) one more tiny all-reduce ORs which parameters received a
    gradient, so ranks that disagree (a branch taken on some ranks only) still step the same
    parameters. Other optimizers, or parameters: one all-reduce per dtype over a flat copy of
    the (local) gradients, a missing gradient counting as zero. Call it once per optimizer step, after the *last* micro-batch's backward of a
    gradient accumulation, before unscaling, clipping and ``step()``.
    """
    world = _world(group)
    if world == 1:
        return
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.reduce_gradients()
        return
    if isinstance(optimizer, ArenaOptimizer) and optimizer.contiguous:
        if sync_unused:
            _union_received(optimizer, group)
        for g in optimizer.flat_grads():
            dist.all_reduce(g, group=group)  # gloo has no AVG: sum, then divide once
            g.div_(world)
        return
    # Parameters as they are (multi-tensor mode; the local shards of tensor-parallel DTensor
    # gradients, laid out alike on every dp rank): one all-reduce per dtype over a flat copy.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in dict.fromkeys(_tensors_of(optimizer)):  # a tied parameter once
        if not p.requires_grad:
            continue
        if p.grad is None:  # every rank must send the same buffer: a missing gradient is zero
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(getattr(p.grad, "_local_tensor", p.grad))
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])


# -- ZeRO-1 / ZeRO-2 ----------------------------------------------------------------------------
def _on_grad_hook(zero_ref: "weakref.ref[ZeroOptimizer]") -> Callable[[torch.Tensor], None]:
    def hook(_grad: torch.Tensor) -> None:
        zero = zero_ref()
        if zero is not None and zero._freed:
            zero.materialize_grads()  # runs before autograd accumulates into p.grad

    return hook


class ZeroOptimizer(Optimizer):
    """ZeRO stage 1 or 2 (or plain data parallel, ``stage=0``) around a kiln optimizer.

    Args:
        optimizer: a kiln optimizer (``contiguous=True``) built with
            ``shard_multiple=world_size`` (the default inside an initialised process group),
            so every arena divides into equal shards. Its optimizer state is never allocated
            at full size: the wrapper keeps state only for this rank's shard.
        stage: 0 (all-reduce, full state on every rank), 1 (sharded optimizer state), 2
            (sharded state and gradients). Stage 3 is FSDP2, outside the arena.
        group: the data-parallel process group (default: the whole world).

    It shares ``param_groups`` with the wrapped optimizer (learning-rate schedulers work on
    either) and is a ``torch.optim.Optimizer`` for them. After wrapping, use only the wrapper:
    the inner optimizer's own ``step``/``zero_grad`` do not know about the shards. Every
    trainable parameter steps on every step (as under DDP, a parameter no rank used gets a
    zero gradient); frozen parameters (``requires_grad=False``) never do. Stage 2 drops any
    gradient present when it is built.
    """

    def __init__(self, optimizer: ArenaOptimizer, stage: int = 1, group: dist.ProcessGroup | None = None):
        if not isinstance(optimizer, ArenaOptimizer) or not optimizer.contiguous:
            raise TypeError("ZeroOptimizer needs one of kiln.optim's optimizers with contiguous=True")
        if stage not in (0, 1, 2):
            raise ValueError(f"stage must be 0, 1 or 2 (stage 3 is FSDP2 fully_shard), got {stage}")
        self.optimizer, self.stage, self.group = optimizer, stage, group
        self.world = _world(group)
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        params = [p for g in optimizer.param_groups for p in g["params"]]
        super().__init__(list(dict.fromkeys(params)), optimizer.defaults)
        # one set of hyperparameters: schedulers and the inner update read the same dicts
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.state = optimizer.state
        self._reduced = False
        self._freed = False
        self._shards: list[_Pack] = []
        self._trainable: list[bytes] = []
        self._grad_hooks: list[Any] = []
        if stage == 0:
            return
        for pk in optimizer._packs:
            arena = pk.arena
            if arena.numel % self.world:
                raise ValueError(
                    f"an arena of {arena.numel} elements does not divide into {self.world} shards: build "
                    f"the optimizer with shard_multiple={self.world} (the default once the process group "
                    f"is initialised)")
            lo, hi = arena.shard(self.rank, self.world)
            grad = None if stage == 1 else torch.zeros(hi - lo, dtype=arena.dtype, device=arena.device)
            sl = ArenaSlice(arena, lo, hi, grad)  # stage 1: the shard gradient is a view (in place)
            first = sl.seg_ids[0] if sl.seg_ids else 0
            sp = _Pack(sl, pk.group, [pk.params[k] for k in sl.seg_ids], pk.s0 + first)
            if optimizer._per_tensor_norms:
                sp.norm_reduce = self._norm_reducer(len(pk.params), sl)
            self._shards.append(sp)
            self._trainable.append(bytes(int(p.requires_grad) for p in pk.params))
        if stage == 2:
            self._grad_nbytes = [pk.arena.grad.untyped_storage().nbytes() for pk in optimizer._packs]
            ref = weakref.ref(self)
            for pk in optimizer._packs:
                for p in pk.params:
                    if p.requires_grad:
                        self._grad_hooks.append(p.register_hook(_on_grad_hook(ref)))
            self._free_grads()

    # -- gradients ----------------------------------------------------------------------------
    @torch.no_grad()
    def _free_grads(self) -> None:
        for pk in self.optimizer._packs:
            for p in pk.params:
                p.grad = None
            pk.arena.grad.untyped_storage().resize_(0)
        self._freed = True

    @torch.no_grad()
    def materialize_grads(self) -> None:
        """Stage 2: bring back the full flat gradients as zeros and re-link every ``p.grad``
        view. Runs by itself at the first gradient of a backward; call it before writing
        gradients into the arena by hand (e.g. master-weight copies)."""
        if not self._freed:
            return
        for pk, nbytes in zip(self.optimizer._packs, self._grad_nbytes):
            pk.arena.grad.untyped_storage().resize_(nbytes)
            pk.arena.grad.zero_()
            for p, view in zip(pk.params, pk.gexpect):
                if view is not None:
                    p.grad = view
            pk.grad_version = pk.arena.grad._version
        self._freed = False

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the gradients over ranks: ``all_reduce`` per arena (stage 0), or
        ``reduce_scatter`` per arena into this rank's shard (stages 1, 2; stage 2 then frees
        the full gradient). Once per optimizer step, after the last micro-batch's backward;
        later calls in the same step do nothing."""
        if self._reduced:
            return
        self._reduced = True
        if self.world == 1 and self.stage == 0:
            return
        if self.stage == 0:
            all_reduce_gradients(self.optimizer, self.group)
            return
        self.materialize_grads()  # a step with no backward since the last one: zero gradients
        self.optimizer._sync(check_fresh=False)  # absorb gradients placed outside the arena
        for pk, sp in zip(self.optimizer._packs, self._shards):
            if self.world > 1:
                _reduce_scatter(sp.arena.grad, pk.arena.grad, group=self.group)
            elif sp.arena.grad.data_ptr() != pk.arena.grad.data_ptr():
                sp.arena.grad.copy_(pk.arena.grad)
            sp.arena.grad.div_(self.world)
        if self.stage == 2:
            self._free_grads()

    def flat_grads(self) -> list[torch.Tensor]:
        """The gradients this rank steps: the full flat gradients (stage 0) or this rank's shard
        of each (stages 1, 2), averaged once :meth:`reduce_gradients` has run this step. A loss
        scaler's non-finite check over them must be OR-ed over ranks (each sees its shard)."""
        if self.stage == 0:
            return self.optimizer.flat_grads()
        return [sp.arena.grad for sp in self._shards]

    def grad_parts(self) -> list[tuple[list[torch.Tensor], tuple[Any, ...]]]:
        """For :func:`kiln.optim.clip_grad_norm_`: the full gradients (stage 0, replicated), or
        this rank's shards, whose norms sum over the data-parallel group."""
        if self.stage == 0:
            return self.optimizer.grad_parts()
        return [(self.flat_grads(), (self.group,) if self.world > 1 else ())]

    def mark_grads_ready(self) -> None:
        self.optimizer.mark_grads_ready()

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Stages 0, 1: one memset per arena. Stage 2: nothing to clear while the full gradient
        is freed (it comes back as zeros at the next backward)."""
        self._reduced = False
        if self.stage == 2 and self._freed:
            if set_to_none:
                self.optimizer._flags[:] = bytes(len(self.optimizer._flags))
            return
        self.optimizer.zero_grad(set_to_none)

    # -- the update -----------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce the gradients if not done yet this step, update this rank's shard, and
        all-gather the parameters (stages 1, 2); stage 0 runs the wrapped optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        if self.stage == 0:
            self.optimizer.step()
        else:
            with torch.no_grad():
                for k, (pk, sp) in enumerate(zip(self.optimizer._packs, self._shards)):
                    self._step_shard(pk, sp, self._trainable[k])
                    if self.world > 1:  # in place: this rank's shard is a slice of the output
                        _all_gather(pk.arena.param, sp.arena.param, group=self.group)
        self._reduced = False
        return loss

    def _step_shard(self, pk: _Pack, sp: _Pack, trainable: bytes) -> None:
        """Update the shard's pieces in runs that share a step count. The runs are those of the
        whole arena, the same on every rank, so LAMB/LARS norm all-reduces match up even on
        a rank whose shard a run does not reach."""
        opt, group = self.optimizer, self.param_groups[pk.group]
        n = len(pk.params)
        if pk.uniform and trainable == pk.all_ones:
            runs = [(0, n, pk.step + 1)]
        else:
            runs = step_runs(trainable, [int(s) for s in pk.step_vec.tolist()])
        if not runs:
            return
        opt._ensure_state(sp, group)
        ids = sp.arena.seg_ids
        k0, k1 = (ids[0], ids[-1] + 1) if ids else (0, 0)
        for i, j, step in runs:
            a, b = max(i, k0), min(j, k1)
            if a < b:
                opt._update_flat(sp, group, a - k0, b - k0, step)
            elif sp.norm_reduce is not None:
                sp.norm_reduce(0, 0, torch.zeros(0))  # take part in the other ranks' all-reduce
        if trainable == pk.all_ones:
            pk.step_vec.add_(1)
            pk.step += 1
        else:
            idx = torch.tensor([i for i in range(n) if trainable[i]], dtype=torch.int64)
            pk.step_vec[idx] += 1
            pk.set_uniform()

    def _norm_reducer(self, nseg: int, sl: ArenaSlice) -> Callable[[int, int, torch.Tensor], torch.Tensor]:
        """(i, j, partial norms of pieces i..j-1: w norms then update norms) -> full norms."""
        ids = torch.tensor(sl.seg_ids, dtype=torch.int64, device=sl.device)
        dtype = _norm_dtype(sl.dtype)
        group, world = self.group, self.world

        def reduce(i: int, j: int, norms: torch.Tensor) -> torch.Tensor:
            sq = torch.zeros(2 * nseg, dtype=dtype, device=sl.device)  # (2*S,) squared norms
            n = j - i
            if n:
                sq[ids[i:j]] = norms[:n].to(dtype).square()
                sq[ids[i:j] + nseg] = norms[n:].to(dtype).square()
            if world > 1:
                dist.all_reduce(sq, group=group)
            return sq[torch.cat([ids[i:j], ids[i:j] + nseg])].sqrt()

        return reduce

    # -- inspection and state -------------------------------------------------------------------
    @property
    def shards(self) -> list[ArenaSlice]:
        """This rank's shard of each arena (stages 1, 2)."""
        return [sp.arena for sp in self._shards]

    def state_bytes(self) -> int:
        """Bytes of optimizer state (and scratch) this rank holds."""
        packs = self.optimizer._packs if self.stage == 0 else self._shards
        total = 0
        for pk in packs:
            bufs = list(pk.state.values()) + ([pk.scratch] if pk.scratch is not None else [])
            total += sum(b.untyped_storage().nbytes() for b in bufs)
        return total

    def _index_of(self) -> dict[int, int]:
        """id(param) -> index in a torch.optim state dict (torch's numbering)."""
        out, start = {}, 0
        for g in self.param_groups:
            for i, p in enumerate(g["params"], start):
                out.setdefault(id(p), i)
            start += len(g["params"])
        return out

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout, keyed per parameter, with the full state: stages 1 and 2
        all-gather each state buffer (a collective: call it on every rank; each gets the
        whole dict). Sharded checkpoints (kiln.parallel.save_sharded) write each rank's shard
        without this gather."""
        if self.stage == 0:
            return self.optimizer.state_dict()
        sd = Optimizer.state_dict(self.optimizer)  # param_groups; the inner keeps no per-param state
        index = self._index_of()
        state: dict[int, dict[str, Any]] = {}
        names = set()
        for pk, sp in zip(self.optimizer._packs, self._shards):
            group = self.param_groups[pk.group]
            if sp.state:
                names = self.optimizer._state_names(group)
            full = {}
            for name in (names if sp.state else ()):
                buf = pk.arena.new_buffer()
                if self.world > 1:
                    _all_gather(buf, sp.state[name], group=self.group)
                else:
                    buf.copy_(sp.state[name])
                full[name] = pk.arena.views(buf)
            for i, p in enumerate(pk.params):
                stepped = int(pk.step_vec[i]) > 0
                if not stepped:
                    continue
                st: dict[str, Any] = {}
                if self.optimizer._has_step_state:
                    st["step"] = pk.step_vec[i].clone()
                for name, views in full.items():
                    st[name] = views[i].clone()
                if st:  # as torch: no entry for a stateless update (SGD without momentum)
                    state[index[id(p)]] = st
        sd["state"] = state
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch.optim-layout state dict (e.g. from :meth:`state_dict`, or from
        ``torch.optim.AdamW``): hyperparameters into the groups, this rank's slice of each
        state tensor into its shard."""
        if self.stage == 0:
            self.optimizer.load_state_dict(state_dict)
            return
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for g, sg in zip(self.param_groups, saved_groups):
            g.update({k: v for k, v in sg.items() if k != "params"})
        index = self._index_of()
        saved = state_dict["state"]
        for pk, sp in zip(self.optimizer._packs, self._shards):
            group = self.param_groups[pk.group]
            names = self.optimizer._state_names(group)
            self.optimizer._ensure_state(sp, group)
            sl = sp.arena
            piece_of = {k: n for n, k in enumerate(sl.seg_ids)}
            bounds = pk.arena._bounds
            for i, p in enumerate(pk.params):
                st = saved.get(index[id(p)])
                pk.step_vec[i] = 0.0 if not st else float(st.get("step", 1.0))
                if i not in piece_of:
                    continue
                n = piece_of[i]
                # the piece's real elements, as offsets into the whole parameter
                a = sl.lo + sl._pieces[n][0] - bounds[i]
                b = sl.lo + sl._pieces[n][1] - bounds[i]
                for name in names:
                    view = sp.sviews[name][n]
                    src = st.get(name) if st else None
                    if src is None:
                        view.zero_()
                    else:
                        view.copy_(src.reshape(-1)[a:b])
            pk.set_uniform()

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.stage}, world={self.world}, rank={self.rank}, {self.optimizer!r})"
