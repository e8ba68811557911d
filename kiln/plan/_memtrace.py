"""Live tensor bytes over a traced step, by what each storage is for: the tracker behind
``kiln plan`` (:mod:`kiln.plan`).

:class:`StorageTracker` is a ``TorchDispatchMode`` that sees every tensor an operator returns
(under ``FakeTensorMode`` they take no memory, but each has a storage of a known size) and
follows each storage from its first sight until it is freed (a weak reference's callback), so
the running sum of live storage bytes is the allocator's, op by op. It keeps a log of every
allocation and free; :meth:`StorageTracker.peak` finds the highest point of a window of that
log and says which storages were live there. What each storage is for is decided after the
step, when everything is known (:meth:`StorageTracker.breakdown`).

``torch.distributed._tools.mem_tracker.MemTracker`` does most of this, but it cannot serve
kiln's step: it raises when a root module runs forward twice in one step (a pipeline
schedule runs each stage once per micro-batch), files every forward output as an activation
whether or not backward keeps it, has no category for communication buffers, and names a
storage's kind when it first sees it (kiln's arena makes a parameter's first storage a
temporary one, re-pointed into the flat buffer).

Categories (bytes): ``parameters`` (parameters and buffers), ``gradients``,
``optimizer_state`` (the optimizer's state and bf16-true's fp32 master weights),
``activations`` (saved by autograd for backward, and the step's input batch),
``communication`` (buffers handed to a collective that are none of the above: gradient
buckets, ZeRO and FSDP gather chunks), ``temporary`` (the rest: logits and loss of a large
vocabulary, gradients of activations, the clip's norms).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from kiln.hardware.flops import op_flops

__all__ = ["CATEGORIES", "StorageTracker", "storages_of"]

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "communication", "temporary")


def storages_of(t: Any) -> Iterator[torch.UntypedStorage]:
    """The storages behind a tensor (a DTensor's local shard; nothing for ``meta``)."""
    stack = [t]
    while stack:
        obj = stack.pop()
        if is_traceable_wrapper_subclass(obj):
            attrs, _ = obj.__tensor_flatten__()
            stack.extend(v for v in (getattr(obj, a) for a in attrs) if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.Tensor) and not _on_meta(obj):
            yield obj.untyped_storage()


def _on_meta(t: torch.Tensor) -> bool:
    # a fake tensor's device, read without asking the dispatcher (t.device would come back
    # through the tracker as prim.device: tens of thousands of calls in a big model's step)
    fake_device = getattr(t, "fake_device", None)
    return fake_device.type == "meta" if fake_device is not None else t.is_meta


_QUERIES = {torch.ops.prim.device.default, torch.ops.aten.sym_size.default, torch.ops.aten.sym_stride.default,
            torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default, torch.ops.aten.dim.default,
            torch.ops.aten.is_contiguous.default, torch.ops.aten.is_contiguous.memory_format,
            torch.ops.aten.is_strides_like_format.default, torch.ops.aten.is_non_overlapping_and_dense.default,
            torch.ops.aten.size.default, torch.ops.aten.stride.default, torch.ops.aten.numel.default,
            torch.ops.aten.storage_offset.default, torch.ops.prim.layout.default}


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested tuples, lists and mappings (an operator's arguments and outputs, a
    batch): what ``tree_flatten`` finds, without its cost on every operator."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list, type({}.values()))):
        for x in obj:
            yield from _tensors_in(x)
    elif isinstance(obj, dict) or (hasattr(obj, "keys") and hasattr(obj, "values") and not isinstance(obj, type)):
        for x in obj.values():
            yield from _tensors_in(x)


def _is_collective(func: Any) -> bool:
    return func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd")


class StorageTracker(TorchDispatchMode):
    """Follows every storage that operators return while it is active (see the module's
    docstring). Enter it inside ``FakeTensorMode``; tensors made before (``from_tensor``, a
    real batch) are followed once they are passed to :meth:`follow` or reach an operator.

    With ``real_inputs``: an operator whose tensor arguments are all real (not fake) runs for
    real, outside the fake mode, so that the data's own arithmetic (counting the positions a
    loss scores, ``.item()``) gives its true values; it meets the fake model as an input."""

    def __init__(self, fake_mode: Any = None) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.size: dict[int, int] = {}  # storage key -> bytes, while live
        self.refs: dict[int, weakref.ref] = {}
        self.log: list[tuple[int, int]] = []  # (storage key, +bytes | -bytes) in time order
        self.live = 0
        self.marks: dict[str, set[int]] = {"saved": set(), "collective": set()}
        self._next = 0
        self.count_flops = False  # add each operator's FLOPs to ``flops`` (kiln.hardware.flops.op_flops)
        self.flops = 0
        # while counting, also: operators dispatched, and collectives with the bytes handed to them
        # (what kiln tune's cost model charges for per-operator overhead and communication)
        self.ops = self.collectives = self.collective_bytes = 0
        self.paused = 0  # > 0: operators run unseen (DTensor's sharding propagation: see patched())

    # ------------------------------------------------------------------ following storages
    def _key(self, st: torch.UntypedStorage) -> int | None:
        for key, ref in self._ids.get(id(st), ()):
            if ref() is st:
                return key
        return None

    def follow(self, *tensors: Any) -> list[int]:
        """Start following the storages of ``tensors`` (pytrees allowed); their keys."""
        keys = []
        for t in _tensors_in(tensors):
            for st in storages_of(t):
                key = self._key(st)
                if key is None:
                    key = self._add(st)
                elif st.nbytes() != self.size[key]:  # resized in place (FSDP2 frees and refills)
                    self._resize(key, st.nbytes())
                keys.append(key)
        return keys

    @property
    def _ids(self) -> dict[int, list[tuple[int, weakref.ref]]]:
        if not hasattr(self, "_by_id"):
            self._by_id: dict[int, list[tuple[int, weakref.ref]]] = {}
        return self._by_id

    def _add(self, st: torch.UntypedStorage) -> int:
        key, self._next = self._next, self._next + 1
        nbytes = st.nbytes()
        ident = id(st)

        def freed(_: Any, key: int = key, ident: int = ident) -> None:
            self._free(key, ident)

        ref = weakref.ref(st, freed)
        self._ids.setdefault(ident, []).append((key, ref))
        self.refs[key] = ref
        self.size[key] = nbytes
        self.live += nbytes
        self.log.append((key, nbytes))
        return key

    def _free(self, key: int, ident: int) -> None:
        nbytes = self.size.pop(key, None)
        self.refs.pop(key, None)
        held = [kr for kr in self._ids.get(ident, ()) if kr[0] != key]
        if held:
            self._ids[ident] = held
        else:
            self._ids.pop(ident, None)
        if nbytes:
            self.live -= nbytes
            self.log.append((key, -nbytes))

    def _resize(self, key: int, nbytes: int) -> None:
        change = nbytes - self.size[key]
        self.size[key] = nbytes
        self.live += change
        self.log.append((key, change))

    # ------------------------------------------------------------------ the dispatch mode
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # (True wraps every call below in torch._dynamo.disable: a frame per operator)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if func in _QUERIES or self.paused:  # metadata, no tensor made; or not the step's own
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local ops, which come back through here
        if func is torch.ops._c10d_functional.wait_tensor.default and self.fake_mode is not None:
            # its fake kernel returns a new tensor; eager waits on the collective's output in
            # place (torch's MemTracker does the same)
            return args[0]
        flat = list(_tensors_in((args, kwargs.values())))
        if self.fake_mode is not None and flat and not any(_is_fake(t) or _on_meta(t) for t in flat):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():  # the data's own arithmetic, for real
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if _is_collective(func):
            self.marks["collective"].update(self.follow(flat))
        self.follow(out)
        if self.count_flops:
            self.flops += op_flops(func, args, kwargs, out)
            self.ops += 1
            if _is_collective(func):
                self.collectives += 1
                self.collective_bytes += sum(t.numel() * t.element_size() for t in flat)
        return out

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """What the dispatch mode alone gets wrong, set right while tracing:

        - ``UntypedStorage.resize_``, which no dispatch mode sees, is followed: FSDP2 frees a
          gathered parameter by resizing its storage to 0 and refills it before the next gather.
        - DTensor's sharding propagation is not followed. Under a fake mode it runs each operator
          once more, on fake tensors of the *global* shapes, to learn the output's metadata
          (``ShardingPropagator._propagate_tensor_meta_non_cached``, uncached while a fake mode is
          active); eager runs that on a fake mode of its own, with no memory and no FLOPs. Seen,
          it charged a tensor-parallel step a whole-vocabulary loss gradient it never holds and
          the FLOPs of unsplit matmuls."""
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        resize, propagate = torch.UntypedStorage.resize_, ShardingPropagator._propagate_tensor_meta_non_cached
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = resize(st, size)
            key = tracker._key(st)
            if key is not None and st.nbytes() != tracker.size.get(key):
                tracker._resize(key, st.nbytes())
            return out

        def propagate_unseen(prop: Any, op_schema: Any) -> Any:
            tracker.paused += 1
            try:
                return propagate(prop, op_schema)
            finally:
                tracker.paused -= 1

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate_unseen  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]
            ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]

    @contextlib.contextmanager
    def saved_for_backward(self) -> Iterator[None]:
        """Mark what autograd saves for backward (checkpointed regions save through their own
        hooks, inside, and keep nothing)."""
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.marks["saved"].update(self.follow(t))
            # an alias without the graph: returning ``t`` itself would tie a saved output to its
            # own node in a cycle that no collector sees, keeping the graph of a forward whose
            # backward never runs (a pipeline's shape inference) alive for good
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    # ------------------------------------------------------------------ reading the log
    def position(self) -> int:
        return len(self.log)

    def peak(self, start: int, end: int | None = None) -> tuple[int, dict[int, int]]:
        """The highest live bytes between log positions ``start`` and ``end`` (the bytes live
        at ``start`` included), and the storages live there: key -> bytes."""
        end = len(self.log) if end is None else end
        live = self._replay({}, 0, start)
        total = best = sum(live.values())
        best_at = start
        for i in range(start, end):
            total += self.log[i][1]
            if total > best:
                best, best_at = total, i + 1
        return best, self._replay(live, start, best_at)

    def _replay(self, live: dict[int, int], start: int, end: int) -> dict[int, int]:
        for key, change in self.log[start:end]:
            live[key] = live.get(key, 0) + change
            if live[key] == 0:
                del live[key]
        return live


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return any(_is_fake(getattr(t, a)) for a in attrs if isinstance(getattr(t, a), torch.Tensor))
    return isinstance(t, FakeTensor)
