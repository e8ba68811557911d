"""The one gradient reducer of data parallelism: every stage, overlapped with backward or not.

:class:`GradReducer` averages the gradients over the data-parallel ranks once per step. On
kiln's arena it always works in buckets: contiguous element ranges of each arena's flat
gradient (padding included: the buckets tile every buffer), cut at parameter starts from the
end of the buffer, where the last layers sit, whose gradients come first, once a bucket holds
``bucket_bytes``; under ZeRO also at the shard boundaries, so that each bucket has one owner.
*Overlapped*, a bucket's collective starts, asynchronously, as soon as autograd has delivered
its last gradient inside :meth:`GradReducer.sync` (the overlap of torch DDP and DeepSpeed);
*synchronous* means every bucket is launched at the end, in :meth:`GradReducer.reduce`. The
ZeRO stage chooses only the collective (:class:`Backend`): a sum on every rank (stage 0), or
a sum into the bucket's owner (stages 1, 2); then, once, the divide by the world (and the
copy of the owner's sums into its shard's own gradient buffer, ZeRO-2). Without an arena
(tensor-parallel DTensors, plain parameters) the one bucket is a flat copy of the local
gradients per dtype.

Collectives must be issued in the same order on every rank, whatever order gradients come
in on each: a bucket is launched only after every bucket before it in ``order``. The order
starts as the buffers read backwards; after the first step that overlapped it becomes the
order in which rank 0's buckets completed (broadcast once, as DDP rebuilds its buckets after
the first iteration). A bucket whose gradients do not all arrive in the arena (a parameter
unused this step, a gradient autograd put elsewhere because ``p.grad`` was replaced) is not
launched during backward: :meth:`reduce` absorbs such gradients into the arena and then
issues it, and every bucket after it, in the same order. Ranks thus differ only in *when* a
collective starts, never in which one or on what: the result is bitwise the same overlapped
or not, and with two ranks (a + b = b + a) that of one collective per buffer.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from kiln.optim import ShardableOptimizer, has_arena, local_tensor

__all__ = ["Backend", "GradReducer"]

# torch 2.13 renamed the flat collective (the old name warns)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class Backend:
    """The collectives a data-parallel group's communication uses, chosen once.

    gloo's reduce, reduce-scatter and all-gather cost more than its all-reduce and broadcast
    (docs/lab/facts.md, 'gloo's collectives on CPU'): on gloo a sum into one owner is an
    all-reduce, and a gather one broadcast per owner. NCCL's reduce and all-gather move half an
    all-reduce's bytes and are used there.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world = _world(group)
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        self.gloo = self.world > 1 and dist.get_backend(group) == "gloo"

    def sum(self, t: torch.Tensor, async_op: bool = False) -> Any:
        return dist.all_reduce(t, group=self.group, async_op=async_op)  # gloo has no AVG: sum, divide once

    def sum_to(self, t: torch.Tensor, owner: int, async_op: bool = False) -> Any:
        """``t`` summed over the group into rank ``owner`` (every rank, on gloo: see above)."""
        if self.gloo:
            return self.sum(t, async_op)
        return dist.reduce(t, group_dst=owner, group=self.group, async_op=async_op)

    def max_(self, t: torch.Tensor, device: torch.device) -> None:
        """In place, a CPU tensor (NCCL: through ``device``)."""
        on_dev = t if self.gloo or device.type == "cpu" else t.to(device)
        dist.all_reduce(on_dev, op=dist.ReduceOp.MAX, group=self.group)
        if on_dev is not t:
            t.copy_(on_dev.cpu())

    def broadcast(self, t: torch.Tensor, owner: int, async_op: bool = False) -> Any:
        return dist.broadcast(t, group_src=owner, group=self.group, async_op=async_op)

    def gather_shards(self, flat: torch.Tensor, shard: torch.Tensor) -> None:
        """Every rank's shard of ``flat`` (equal, contiguous; ``shard`` is this rank's slice of it)
        into ``flat`` on every rank."""
        if self.gloo:  # each owner broadcasts its shard, all at once
            size = flat.numel() // self.world
            for h in [self.broadcast(flat[r * size:(r + 1) * size], r, async_op=True) for r in range(self.world)]:
                h.wait()
        else:
            _all_gather(flat, shard, group=self.group)  # in place: shard is a slice


class GradReducer:
    """Average the gradients of ``source`` over ``backend``'s group (see the module).

    ``source``: a kiln optimizer on its arena (buckets, ``stage`` 0-2: 1 and 2 need it sharded
    over the same group), or anything else that holds parameters (an optimizer without an
    arena, a module, an iterable of tensors: one flat copy per dtype, stage 0). ``overlap``:
    reduce buckets during the backward run inside :meth:`sync` (arena only).
    """

    def __init__(self, source: Any, stage: int, backend: Backend, *, overlap: bool = False,
                 bucket_bytes: int = 25 * 2**20) -> None:
        self.source, self.stage, self.backend = source, stage, backend
        self.arena = isinstance(source, ShardableOptimizer) and has_arena(source)
        self.spans: list[tuple[int, int, int]] = []  # (arena, lo, hi) per bucket
        self.views: list[torch.Tensor] = []  # each bucket's slice of its arena's flat gradient
        self.owner: list[int] = []  # group rank receiving the bucket's sums (stages 1, 2)
        self.need: list[int] = []  # gradients the bucket waits for
        # per trainable parameter with elements: (arena, start offset, the buckets it overlaps)
        self.slots: dict[int, tuple[int, int, tuple[int, ...]]] = {}
        self.hooks: list[Any] = []
        self.order: list[int] = []
        self.overlap = overlap and self.arena and backend.world > 1
        if self.arena:
            self._cut(bucket_bytes)
        self.learned = False  # order agreed from a step that overlapped
        self.armed = self.overlapped = False
        self._reset()

    def _cut(self, bucket_bytes: int) -> None:
        world, keys = self.backend.world, []
        for a, (arena, params) in enumerate(self.source.packed_params()):
            starts, n = arena.offsets.tolist(), arena.numel
            cuts, acc = {0, n}, 0
            for i in reversed(range(len(params))):
                acc += arena.numels[i] * arena.dtype.itemsize
                if acc >= bucket_bytes:
                    cuts.add(starts[i])
                    acc = 0
            if self.stage > 0:
                cuts.update(range(0, n, n // world))
            edges = sorted(cuts)
            first = len(self.spans)
            for lo, hi in zip(edges[:-1], edges[1:]):
                self.spans.append((a, lo, hi))
                # (views of a ZeRO-2 gradient stay valid while its storage is freed and regrown)
                self.views.append(arena.grad[lo:hi])
                self.owner.append(lo // (n // world) if self.stage > 0 else -1)
                self.need.append(0)
                keys.append((-lo / n, a))  # the end of each buffer first
            for i, p in enumerate(params):
                if not p.requires_grad or arena.numels[i] == 0:
                    continue
                lo, hi = starts[i], starts[i] + arena.numels[i]
                mine = tuple(b for b in range(first, len(self.spans))
                             if self.spans[b][1] < hi and lo < self.spans[b][2])
                for b in mine:
                    self.need[b] += 1
                self.slots[id(p)] = (a, lo, mine)
                if self.overlap:
                    self.hooks.append(p.register_post_accumulate_grad_hook(self._hook()))
        self.order = sorted(range(len(self.spans)), key=keys.__getitem__)

    def _reset(self) -> None:
        self.count = [0] * len(self.spans)
        self.arrived: set[int] = set()
        self.completed: list[int] = []  # buckets in the order their gradients completed
        self.handles: list[Any] = []
        self.next = 0  # order[:next] are launched

    # -- during backward ----------------------------------------------------------------------
    def _hook(self) -> Callable[[torch.Tensor], None]:
        ref = weakref.ref(self)  # a dropped optimizer is not kept alive by its parameters' hooks

        def hook(p: torch.Tensor) -> None:
            reducer = ref()
            if reducer is not None and reducer.armed:
                reducer.arrive(p)

        return hook

    def arrive(self, p: torch.Tensor) -> None:
        """A gradient accumulated during the armed backward: count it, launch what is ready."""
        a, lo, mine = self.slots[id(p)]
        if id(p) in self.arrived:
            raise RuntimeError(
                "kiln.parallel: a parameter received a second gradient inside sync_gradients(True), where its "
                "bucket may already be communicated: run only the step's last backward inside it")
        self.arrived.add(id(p))
        grad = self.source.arenas[a].grad
        g = p.grad
        if g is None or g.data_ptr() != grad.data_ptr() + lo * grad.element_size():
            return  # outside the arena: its buckets wait for reduce(), which absorbs it first
        count, need = self.count, self.need
        for b in mine:
            count[b] += 1
            if count[b] == need[b]:
                self.completed.append(b)
        order = self.order
        while self.next < len(order) and count[order[self.next]] == need[order[self.next]]:
            self._launch(order[self.next])
            self.next += 1

    def _launch(self, b: int) -> None:
        view, backend = self.views[b], self.backend
        handle = backend.sum(view, async_op=True) if self.stage == 0 else backend.sum_to(view, self.owner[b], True)
        self.handles.append(handle)

    @contextlib.contextmanager
    def sync(self, last: bool = True) -> Iterator[None]:
        """Around each micro-batch's backward: with ``overlap``, the step's last one
        (``last=True``) reduces each bucket as soon as backward completes it; otherwise the
        gradients only accumulate until :meth:`reduce`. Every rank must make the same calls."""
        if not last or not self.overlap:
            yield
            return
        if self.handles:
            raise RuntimeError("kiln.parallel: sync_gradients(True) twice in one step while the first backward's "
                               "buckets are communicated: reduce_gradients() (or step()) comes between")
        self._reset()
        self.armed = self.overlapped = True
        try:
            yield
        finally:
            self.armed = False

    def drop(self) -> None:
        """Wait for launched collectives (nothing may write into the gradients after this) and
        forget the step."""
        for h in self.handles:
            h.wait()
        self.armed = False
        self._reset()

    # -- after backward ------------------------------------------------------------------------
    @torch.no_grad()
    def reduce(self) -> None:
        """Issue every bucket not launched yet, in order, wait for all, then divide once: the
        gradients (under ZeRO this rank's shard of them) hold the mean over the group."""
        world = self.backend.world
        if not self.arena:
            if world > 1:
                self._reduce_lists()
            return
        opt = self.source
        arenas = opt.arenas
        if world > 1:
            self._launch_all()
        elif self.stage == 0:
            return
        else:
            opt.flat_grads()  # absorbs gradients placed outside the arena
        if self.stage == 0:
            # ranks that disagree on which parameters received a gradient (a branch taken on
            # some ranks only) step the same ones
            device = arenas[0].device if arenas else torch.device("cpu")
            opt.union_received(lambda flags: self.backend.max_(flags, device))
            for arena in arenas:
                arena.grad.div_(world)
            return
        for arena, shard in zip(arenas, opt.shards):  # this rank's sums sit in its shard's range
            if shard.grad.data_ptr() != arena.grad[shard.lo:].data_ptr():
                shard.grad.copy_(arena.grad[shard.lo:shard.hi])
            shard.grad.div_(world)

    def _launch_all(self) -> None:
        """Every bucket not launched during backward, in order; then wait for all."""
        opt = self.source
        self.armed = False
        launched = self.next
        for h in self.handles:
            h.wait()
        arenas = opt.arenas
        before = [a.grad._version for a in arenas]
        opt.flat_grads()  # absorbs gradients placed outside the arena
        if launched and [a.grad._version for a in arenas] != before:
            raise RuntimeError(
                "kiln.parallel: a gradient was assigned between the backward inside sync_gradients(True) and "
                "reduce_gradients(), after its bucket was reduced: assign it before that backward")
        for b in self.order[self.next:]:
            self._launch(b)
        for h in self.handles[launched:]:
            h.wait()
        if self.overlapped and not self.learned:
            self._learn()
        self.overlapped = False
        self._reset()

    def _learn(self) -> None:
        """Adopt the order in which rank 0's buckets completed (ready ones first): a broadcast,
        once, at the same place on every rank (the end of the first step that overlapped)."""
        done = set(self.completed)
        ready = [b for b in self.order if self.need[b] == 0]
        order = ready + self.completed + [b for b in self.order if b not in done and self.need[b]]
        device = self.source.arenas[0].device if not self.backend.gloo else "cpu"
        t = torch.tensor(order, dtype=torch.int64, device=device)
        self.backend.broadcast(t, 0)
        self.order, self.learned = t.tolist(), True

    def _reduce_lists(self) -> None:
        """Parameters as they are (multi-tensor mode; the local shards of tensor-parallel DTensor
        gradients, laid out alike on every dp rank): one flat copy per dtype, summed, divided."""
        params = [p for p in dict.fromkeys(tensors_of(self.source)) if p.requires_grad]  # a tied one once
        for p in params:
            if p.grad is None:  # every rank must send the same buffer: a missing gradient is zero
                p.grad = torch.zeros_like(p)
        grads = [local_tensor(p.grad) for p in params]
        sum_over_ranks(grads, self.backend)
        torch._foreach_div_(grads, self.backend.world)


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """The parameters of an optimizer (a ZeRO wrapper shares its inner one's parameter groups),
    a module's parameters and buffers, or the tensors of an iterable."""
    if isinstance(obj, Optimizer):
        return [p for g in obj.param_groups for p in g["params"]]
    if isinstance(obj, torch.nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    return list(obj)


def sum_over_ranks(tensors: list[torch.Tensor], backend: Backend) -> None:
    """Sum tensors in place over the ranks: one all-reduce per dtype, over a flat copy."""
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        backend.sum(flat)
        torch._foreach_copy_(ts, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in ts]), ts)])
