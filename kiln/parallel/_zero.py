"""Data parallel (zero=0) and ZeRO stages 1 and 2 on kiln's arena.

Every rank holds the whole model. Its gradients are averaged by the one reducer,
:class:`~kiln.parallel._reducer.GradReducer` (in buckets, overlapped with the last backward or
launched at its end; the stage chooses the collective). Under ZeRO (Rajbhandari et al., arXiv
1910.02054) the optimizer steps only the rank's contiguous shard of each arena
(:meth:`kiln.optim.ArenaOptimizer.shard`) and holds state for that alone; this wrapper owns the
sharding: it gives the optimizer the sum over the group that completes LAMB's and LARS's norms,
has the reducer sum each bucket into its owner, and gathers the parameters after the step
(:class:`~kiln.parallel._reducer.Backend` picks the collectives: gloo's are slow at some).
Stage 2 also frees the full gradient after the reduction until the next backward's first
gradient (a gradient pre-hook brings it back as zeros), so through the forward pass, where
activation memory peaks, a rank holds only its shard's gradient.

:meth:`ZeroOptimizer.overlap_param_gather` overlaps the other direction: the parameters each
rank stepped go out in chunks after the step, and the next forward waits, module by module,
only for the chunks its parameters sit in (see :class:`_Gather`).

The calls per step, the same on every rank (they are collectives); dp ranks with batch B/dp
each train like one process with batch B (gradients are averaged; tested to 1e-6)::

    zero = ZeroOptimizer(kiln.optim.AdamW(model.parameters(), shard_multiple=world), stage=2)
    broadcast_parameters(model)              # once, before training: rank 0's initial values
    for step in ...:
        for micro in range(accumulate):      # gradients accumulate locally, no communication ...
            with zero.sync_gradients(micro == accumulate - 1):  # ... but in the last backward (overlap=True)
                (loss_fn(model(x[micro])) / accumulate).backward()
        zero.reduce_gradients()              # once per step (step() calls it if you do not)
        total = kiln.optim.clip_grad_norm_(zero, 1.0)  # optional: global norm over all ranks' shards
        zero.step()                          # shard update (+ all-gather of parameters)
        zero.zero_grad()

With ``zero.overlap_param_gather(model)`` called once before the loop, ``step()`` returns with
the parameter exchange still running; ``model``'s forward waits for it piece by piece, and
``zero.wait_parameters()`` waits for all of it (before reading parameters any other way).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import math
import sys
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from kiln.optim import Arena, ArenaSlice, ShardableOptimizer, arena_missing, no_arena_setting, torch_method
from kiln.parallel._dist import reducer
from kiln.parallel._reducer import Backend, GradReducer, sum_over_ranks, tensors_of

__all__ = ["ZeroOptimizer", "broadcast_parameters", "all_reduce_gradients", "sync_gradients"]

_HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=None)
def _madvise() -> Callable[..., int] | None:
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def _huge_pages(t: torch.Tensor) -> None:
    """Ask Linux for transparent huge pages over a CPU buffer that is freed and regrown every
    step (stage 2's flat gradient): its first touch then faults 2 MiB at a time instead of
    4 KiB, and its free unmaps far fewer pages, each several times faster
    (docs/lab/facts.md, 'Transparent huge pages for ZeRO-2's gradient'). A hint only: without
    THP, or elsewhere, nothing changes."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu":
        return
    a = t.data_ptr()
    lo, hi = -(-a // _HUGE_PAGE) * _HUGE_PAGE, (a + t.untyped_storage().nbytes()) // _HUGE_PAGE * _HUGE_PAGE
    if hi > lo:
        madvise(lo, hi - lo, _MADV_HUGEPAGE)


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


@torch.no_grad()
def broadcast_parameters(module_or_optimizer: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> int:
    """Copy rank ``src``'s parameters (and a module's buffers) to every rank, once before training:
    one broadcast per storage (the byte span covering the tensors in it: an arena in one
    message). Returns the number of broadcasts."""
    if _world(group) == 1:
        return 0
    spans: dict[tuple, list[Any]] = {}  # storage key -> [storage, device, lo byte, hi byte]
    for t in tensors_of(module_or_optimizer):
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


@torch.no_grad()
def all_reduce_gradients(optimizer: Optimizer | Any, group: dist.ProcessGroup | None = None) -> None:
    """Average the gradients of ``optimizer``'s parameters over ``group`` (zero=0), once per step,
    after the *last* micro-batch's backward, before unscaling, clipping and ``step()``: the
    reducer's buckets, all launched now (a kiln optimizer on its arena: one collective per
    bucket of its flat gradients, then one divide; ranks that disagree on which parameters
    received a gradient step the same ones), or one all-reduce per dtype over a flat copy of
    the (local) gradients, None as zero. A :class:`ZeroOptimizer` reduces its own."""
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.reduce_gradients()
        return
    backend = Backend(group)
    if backend.world > 1:
        GradReducer(optimizer, 0, backend).reduce()


def sync_gradients(optimizer: Optimizer, last: bool = True) -> contextlib.AbstractContextManager:
    """``optimizer.sync_gradients(last)`` for a :class:`ZeroOptimizer`, else nothing: the
    context a training loop puts around each micro-batch's backward, ``last`` for the step's
    last one (see :meth:`ZeroOptimizer.sync_gradients`)."""
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.sync_gradients(last)
    return contextlib.nullcontext()


# -- ZeRO-1 / ZeRO-2 ----------------------------------------------------------------------------
class ZeroOptimizer(Optimizer):
    """ZeRO stage 1 or 2 (or plain data parallel, ``stage=0``) around a kiln optimizer; itself a
    :class:`~kiln.optim.KilnOptimizer` (what it hands out is the inner optimizer's, this rank's
    shards where the step reads them).

    Args:
        optimizer: a kiln optimizer on its arena (a :class:`~kiln.optim.ShardableOptimizer`
            with ``contiguous=True``) built with ``shard_multiple=world``
            (the default in an initialised process group). Stages 1 and 2 shard it
            (:meth:`~kiln.optim.ArenaOptimizer.shard`): its state never exists at full size.
        stage: 0 (all-reduce, full state on every rank), 1 (sharded optimizer state), 2
            (sharded state and gradients). Stage 3 is FSDP2, outside the arena.
        group: the data-parallel process group (default: the whole world).
        overlap: reduce the gradients in buckets during the backward run inside
            :meth:`sync_gradients` (``True``), each as soon as it is complete, instead of all
            after it. The trainer's default for ``dp > 1`` (``parallel.overlap_grad_reduce``).
        bucket_mb: the size of a bucket, in MiB, with ``overlap``.

    It shares ``param_groups`` with the wrapped optimizer (schedulers work on either); after
    wrapping use only the wrapper. Every trainable parameter steps on every step (as under
    DDP); frozen ones never do. Stage 2 drops any gradient present when it is built.
    """

    def __init__(self, optimizer: ShardableOptimizer, stage: int = 1, group: dist.ProcessGroup | None = None, *,
                 overlap: bool = False, bucket_mb: float = 25.0):
        if stage not in (0, 1, 2):
            raise ValueError(f"stage must be 0, 1 or 2 (stage 3 is FSDP2 fully_shard), got {stage}")
        missing = no_arena_setting(optimizer)
        if missing is not None and stage > 0:
            raise TypeError(f"ZeroOptimizer: {arena_missing(f'zero-{stage}', *missing)}")
        if missing is not None or not isinstance(optimizer, ShardableOptimizer):
            raise TypeError(f"ZeroOptimizer needs one of kiln.optim's optimizers with contiguous=True, got "
                            f"{type(optimizer).__name__}")
        self.optimizer, self.stage, self.group = optimizer, stage, group
        self.backend = Backend(group)
        self.world, self.rank = self.backend.world, self.backend.rank
        super().__init__(list(dict.fromkeys(p for g in optimizer.param_groups for p in g["params"])),
                         optimizer.defaults)
        # one set of hyperparameters: schedulers and the inner update read the same dicts
        self.param_groups, self.defaults, self.state = optimizer.param_groups, optimizer.defaults, optimizer.state
        self._reduced = self._freed = False
        self._gather: _Gather | None = None
        if stage > 0:
            # stage 1 reduces in place into its shard; kiln.optim sums LAMB/LARS norms over the
            # shards with ours
            optimizer.shard(self.rank, self.world, reducer(group), keep_full_grad=stage == 1)
        self.reducer = GradReducer(optimizer, stage, self.backend, overlap=overlap, bucket_bytes=int(bucket_mb * 2**20))
        if stage == 2:
            self._grad_nbytes = [a.grad.untyped_storage().nbytes() for a in optimizer.arenas]

            def hook(_grad: torch.Tensor, ref: Any = weakref.ref(self)) -> None:  # a dropped wrapper: no-op
                if (zero := ref()) is not None and zero._freed:
                    zero.materialize_grads()  # runs before autograd accumulates into p.grad

            self._grad_hooks = [p.register_hook(hook) for _, ps in optimizer.packed_params() for p in ps
                                if p.requires_grad]
            self._free_grads()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        torch_method("add_param_group")(self, param_group)  # (torch's, without importing torch._dynamo)

    # -- gradients ----------------------------------------------------------------------------
    def _free_grads(self) -> None:
        self.optimizer.park_grads()
        self._freed = True

    def materialize_grads(self) -> None:
        """Stage 2: bring back the full flat gradients as zeros, ``p.grad`` views re-linked. Runs
        by itself at a backward's first gradient; call it before writing gradients by hand."""
        if self._freed:
            self.optimizer.unpark_grads(self._grad_nbytes, before_touch=_huge_pages)
            self._freed = False

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the gradients over ranks (stage 0), or into this rank's shard (stages 1 and
        2; stage 2 then frees the full gradient): the reducer's buckets, those not reduced
        during backward launched now. Once per step, after the last backward; later calls in
        the step do nothing."""
        if self._reduced:
            return
        self._reduced = True
        if self.stage > 0:
            self.materialize_grads()  # a step with no backward since the last one: zero gradients
        self.reducer.reduce()
        if self.stage == 2:
            self._free_grads()

    def sync_gradients(self, last: bool = True) -> contextlib.AbstractContextManager:
        """With ``overlap``: around the backward of a step's last micro-batch (``last=True``),
        reduce each gradient bucket as soon as backward completes it; with ``last=False``, or
        without ``overlap``, gradients only accumulate (``reduce_gradients`` reduces them). Every
        rank must make the same calls. Until ``reduce_gradients`` (or ``step``) the gradients
        are being communicated: leave them alone between the two."""
        return self.reducer.sync(last)

    def overlap_param_gather(self, module: torch.nn.Module, chunk_mb: float = 4.0) -> None:
        """Stages 1 and 2: leave the parameter exchange that ends each :meth:`step` running, and
        let the next forward of ``module`` wait for it module by module (Megatron-LM's
        ``overlap_param_gather``): a submodule's forward pre-hook waits only for the chunks
        holding its own parameters, so the exchange of the later layers is hidden behind the
        forward of the earlier ones. The exchange is one broadcast per chunk of ``chunk_mb``
        MiB from the shard's owner, in the order of ``module``'s parameters (about forward
        order); bitwise the same values as the synchronous exchange.

        Until then the parameters of other ranks' shards still hold the last step's values.
        ``module``'s forward (training or evaluation) and ``state_dict``/``load_state_dict``,
        this wrapper's ``step``, ``state_dict`` and ``load_state_dict`` wait by themselves;
        anything else that reads the parameters between ``step`` and the next forward (an
        EMA, a checkpoint written from the arena) calls :meth:`wait_parameters` first. A
        parameter of the optimizer that is not a parameter of ``module`` is waited for at
        ``module``'s own forward; the parameters of a submodule whose forward is not called
        (its parent reads ``child.weight`` itself) at the forward of its nearest ancestor
        that is (learned from the first forward, which nothing is in flight for). Not under
        ``torch.compile`` (the waits would break its graphs): call this on the model before
        compiling it, or not at all."""
        if self.stage == 0 or self.world == 1:
            return  # nothing is exchanged
        if self._gather is not None:
            raise RuntimeError("overlap_param_gather was already called on this ZeroOptimizer")
        self._gather = _Gather(self, module, int(chunk_mb * 2**20))

    def wait_parameters(self) -> None:
        """Wait for the parameter exchange of :meth:`overlap_param_gather` (nothing to wait for
        otherwise): every parameter then holds this step's value on every rank."""
        if self._gather is not None:
            self._gather.wait()

    def flat_grads(self) -> list[torch.Tensor]:
        """The gradients this rank steps, averaged once :meth:`reduce_gradients` ran: the full
        flat ones (stage 0) or this rank's shards (a non-finite check must be OR-ed over ranks)."""
        if self.stage == 0:
            return self.optimizer.flat_grads()
        return [s.grad for s in self.optimizer.shards]

    def grad_parts(self) -> list[tuple[list[torch.Tensor], tuple[Any, ...]]]:
        """For :func:`kiln.optim.clip_grad_norm_`: the full gradients, or the shards (over the group)."""
        return self.optimizer.grad_parts()

    def grad_buffers(self) -> list[torch.Tensor]:
        """Every buffer that holds gradients: the arenas' flat ones (stage 2: empty storages while
        freed) and the shards' (memory accounting)."""
        return self.optimizer.grad_buffers()

    def mark_grads_ready(self) -> None:
        self.optimizer.mark_grads_ready()  # gradients written by hand (master weights)

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """One memset per arena; nothing while stage 2 has freed the full gradient (it comes
        back as zeros, and the next reduce-scatter overwrites the shard's)."""
        self._reduced = False
        self.reducer.drop()  # reductions launched and never waited for: they write no more
        if not self._freed:
            self.optimizer.zero_grad(set_to_none)

    # -- the update -----------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce the gradients (if not done yet), step (this rank's shard), all-gather the parameters."""
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self.reduce_gradients()
        self.wait_parameters()  # the last exchange's sends read what this step writes
        self.optimizer.step()
        if self._gather is not None:
            self._gather.launch()  # waited for in the next forward, module by module
        elif self.world > 1:
            with torch.no_grad():
                for arena, shard in zip(self.optimizer.arenas, self.optimizer.shards):
                    self.backend.gather_shards(arena.param, shard.param)
        self._reduced = False
        return loss

    # -- inspection and state -------------------------------------------------------------------
    @property
    def contiguous(self) -> bool:
        return True  # (checked in __init__: the parameters live in the inner optimizer's arenas)

    @property
    def arenas(self) -> list[Arena]:
        return self.optimizer.arenas

    @property
    def shards(self) -> list[ArenaSlice]:
        return self.optimizer.shards  # this rank's shard of each arena (stages 1, 2)

    def packed_params(self) -> list[tuple[Arena, list[torch.Tensor]]]:
        return self.optimizer.packed_params()

    def shard_pieces(self) -> dict[int, tuple[int, int]]:
        """Where this rank's shards cut each parameter (stages 1, 2; stage 0: empty)."""
        return self.optimizer.shard_pieces()

    def state_tensors(self) -> list[torch.Tensor]:
        return self.optimizer.state_tensors()  # this rank's flat state buffers and scratch

    def state_bytes(self) -> int:
        return self.optimizer.state_bytes()  # optimizer state (and scratch) this rank holds

    @torch.no_grad()
    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """torch.optim's layout with the full state, every rank's pieces gathered: a collective.
        ``copy=False``: the inner optimizer's views instead, no collective: stages 1 and 2 hand
        this rank's pieces and ``"pieces"`` (what save_sharded writes from)."""
        self.wait_parameters()  # (the state is not the parameters, but a checkpoint reads both)
        sd = self.optimizer.state_dict(copy=copy)
        if self.stage == 0 or not copy:
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
            sum_over_ranks(full, self.backend)  # pieces do not overlap: the sum is the gather
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A torch.optim-layout dict (:meth:`state_dict`'s, ``torch.optim.AdamW``'s): each rank
        takes its pieces (or the inner optimizer's sharded dict, of the same sharding)."""
        self.wait_parameters()
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.stage}, world={self.world}, rank={self.rank}, {self.optimizer!r})"


# -- parameter exchange overlapped with the next forward -----------------------------------------
class _Gather:
    """The parameters of every rank's shard sent by their owner after a ZeRO step, waited for in
    the next forward (:meth:`ZeroOptimizer.overlap_param_gather`).

    Each arena's shards are cut into chunks of about ``chunk_bytes``; :meth:`launch` issues one
    asynchronous broadcast per chunk from its owner, in the order of first use (below), the
    same on every rank. Every module of ``module`` gets a forward pre-hook that waits for the
    received chunks up to the last one holding its own parameters (earlier ones too: the wait
    is in issue order, whatever order they complete in). A rank never waits in a forward for
    the chunks it sends (its own values are current); :meth:`wait` waits for everything.
    """

    def __init__(self, zero: ZeroOptimizer, module: torch.nn.Module, chunk_bytes: int) -> None:
        self.backend, self.rank = zero.backend, zero.rank
        # Issue order: by the first parameter of ``module`` (registration order, about the order
        # of use) that a chunk holds; the optimizer's parameters outside ``module`` first (the
        # root waits for them), chunks of padding alone last. Arenas interleave: a layer's
        # weight and bias (two arenas under weight-decay groups) come early together.
        first = {id(p): i for i, p in enumerate(module.parameters())}
        found: list[tuple[float, int, torch.Tensor, int, list[int]]] = []
        for arena, params in zero.optimizer.packed_params():
            per = max(1, chunk_bytes // arena.dtype.itemsize)
            starts = arena.offsets.tolist()
            for r in range(zero.world):
                lo, hi = arena.shard(r, zero.world)
                for c in range(lo, hi, per):
                    e = min(c + per, hi)
                    held = [id(params[i]) for i in range(max(0, bisect.bisect_right(starts, c) - 1),
                                                         bisect.bisect_left(starts, e))
                            if c < starts[i] + arena.numels[i]]
                    key = min((first.get(i, -1) for i in held), default=math.inf)
                    found.append((key, len(found), arena.param[c:e], r, held))
        found.sort(key=lambda f: f[:2])
        self.chunks = [(t, r) for _, _, t, r, _ in found]  # (slice of an arena's parameters, owner)
        last: dict[int, int] = {}  # id(parameter) -> the last received chunk holding part of it
        for k, (_, _, _, r, held) in enumerate(found):
            if r != self.rank:
                for i in held:
                    last[i] = k
        # each module waits up to the last received chunk of its own parameters; the root also
        # for the optimizer's parameters that no module holds
        self.need: dict[int, int] = {}  # id(module) -> the last received chunk its forward needs
        self.parent: dict[int, int] = {}
        self.hooks: list[Any] = []
        outside = last.keys() - {id(p) for p in module.parameters()}
        for m in module.modules():
            own = {id(p) for p in m.parameters(recurse=False)} | (outside if m is module else set())
            self.need[id(m)] = max((last[i] for i in own if i in last), default=-1)
            self.parent.update((id(c), id(m)) for c in m.children())
            self.hooks.append(m.register_forward_pre_hook(self._hook(id(m))))
        self.called: set[int] | None = set()  # modules whose forward ran before the first exchange
        ref = weakref.ref(self)
        self.hooks.append(module.register_state_dict_pre_hook(lambda *_: (g := ref()) and g.wait()))
        self.hooks.append(module.register_load_state_dict_pre_hook(lambda *_: (g := ref()) and g.wait()))
        self.handles: list[Any] = []
        self.waited = 0  # handles[:waited] are waited for

    def _hook(self, key: int) -> Callable[..., None]:
        ref = weakref.ref(self)

        def hook(_module: torch.nn.Module, _args: Any) -> None:
            gather = ref()
            if gather is None:
                return
            if gather.called is not None:
                gather.called.add(key)
            need = gather.need[key]
            if gather.waited <= need < len(gather.handles):
                gather.wait(need + 1)

        return hook

    @torch.no_grad()
    def launch(self) -> None:
        if self.called:  # the first exchange after a forward: a module that forward never called
            # holds parameters read some other way (a parent's F.linear(x, child.weight)): its
            # nearest called ancestor waits for them from now on
            for key, need in list(self.need.items()):
                up = key
                while up not in self.called and up in self.parent:
                    up = self.parent[up]
                self.need[up] = max(self.need[up], need)
            self.called = None
        self.handles = [self.backend.broadcast(t, r, async_op=True) for t, r in self.chunks]
        self.waited = 0

    def wait(self, upto: int | None = None) -> None:
        """Wait for the chunks received among the first ``upto`` (a forward), or for every
        chunk, the sent ones too (``None``: then nothing is in flight)."""
        if upto is None:
            for h in self.handles:
                h.wait()
            self.handles, self.waited = [], 0
            return
        for k in range(self.waited, upto):
            if self.chunks[k][1] != self.rank:
                self.handles[k].wait()
        self.waited = max(self.waited, upto)
