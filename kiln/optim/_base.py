"""The state holder shared by kiln's optimizers: packing, relinking, bookkeeping.

Subclasses own only hyperparameters and two update methods (one over a flat arena range,
one over per-parameter lists); the math lives in :mod:`kiln.optim._rules`.

Gradients and ``zero_grad``
---------------------------
After construction every trainable parameter's ``p.grad`` is a view into the flat gradient,
so autograd accumulates into the arena in place. ``zero_grad(set_to_none=True)`` (the
default) is one memset that *keeps* the views; it records that no parameter has a gradient
yet. Which parameters really received one is tracked by a post-accumulate-grad hook per
parameter (a byte store), so a parameter that took no part in the backward pass is left
exactly as it is, as torch.optim leaves a parameter whose ``.grad`` is None. The visible
difference from torch: ``p.grad`` reads as zeros instead of None after ``zero_grad()``.

``step()`` first makes sure the arena is still authoritative:

- a gradient that autograd (or the user) placed outside the arena, e.g. after
  ``model.zero_grad()`` set ``p.grad = None``, is copied in and the view restored;
- a parameter whose storage changed with the same dtype/device/shape is copied back in;
- a parameter whose dtype or device changed (``model.half()``, ``model.to("cuda")`` after
  construction) raises an error that names the fix (``optimizer.relink()``).

Finding out costs O(1) per step when nothing changed, not a test per parameter: each
``p.grad`` is a view that only the parameter holds, watched through a weak reference (its
death, when ``p.grad`` is reassigned, marks the gradients dirty); the gradient hooks check the
parameter's pointer and gradient as autograd delivers them (the backward touches each one
anyway); and the flat parameter's storage has a use count that ``p.data = ...`` (``to_empty()``,
``.half()``) lowers. Only when one of these says so, or a frozen parameter holds a gradient,
does ``step()`` compare every parameter. What the signals cannot see: ``p.grad`` set to None
while the user keeps the old gradient tensor alive elsewhere, for a parameter no backward
reaches before ``step()``; and a parameter moved out of the arena at the moment something else
takes a new view of it, for a parameter that then receives no gradient (it is found, and its
values copied in, the next time it does).

A step that finds no new gradient since the previous step does what torch.optim does:
``step(); step()`` applies the update again with the gradients the parameters still hold,
and ``zero_grad(); step()`` updates nothing (torch sees ``p.grad is None`` and skips the
parameter; kiln's per-parameter flags say the same). It also warns, once per optimizer,
because that is the only trace left when the model's parameters were replaced behind the
optimizer's back (``model.load_state_dict(..., assign=True)``, ``to_empty()``, re-created
modules): the optimizer then holds the old Parameter objects and trains nothing, with torch
as with kiln; the warning names the fix (build the optimizer after loading, or load without
``assign=True``, which copies into the arena). "No new gradient" means: no
post-accumulate-grad hook fired, no gradient was assigned outside the arena, and the flat
gradient's version counter did not move since the previous step (or ``zero_grad``). A
``GradScaler`` step skipped for an inf/NaN gradient never calls ``step()``, and the next
backward fires the hooks, so it does not warn (tested).

Complex parameters are updated as pairs of reals (``torch.view_as_real``), as torch.optim
does: a complex arena is handed to the update rules as a real buffer twice as long.

``step()`` itself skips torch's ``profile_hook_step`` wrapper (a ``record_function`` and two
hook chains on every call) unless a profiler is running or a step hook is registered, in
which case it takes exactly torch's path.
"""

from __future__ import annotations

import inspect
import operator
import os
import warnings
import weakref
from typing import Any, Callable, ClassVar, Iterable, Mapping

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import (
    _device_dtype_check_for_fused,
    _get_scalar_dtype,
    _global_optimizer_post_hooks,
    _global_optimizer_pre_hooks,
)

from kiln.optim._arena import Arena, ArenaSlice
from kiln.optim._rules import TensorList
from kiln.optim._norms import tensor_norms

_EAGER_ENV = "KILN_OPTIM_EAGER"
_data_ptr = torch.Tensor.data_ptr
_grad_of = operator.attrgetter("grad")
_COMPILED: dict[str, Callable] = {}


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def _torch_impl(group: dict[str, Any]) -> bool:
    """The group asks for what only torch's own implementation does (see ArenaOptimizer)."""
    return bool(group.get("capturable") or group.get("differentiable"))


def _compiling(compiled: bool | None) -> bool:
    """An optimizer's ``compile`` flag resolved: None means yes unless KILN_OPTIM_EAGER is set."""
    return os.environ.get(_EAGER_ENV, "0") in ("", "0") if compiled is None else bool(compiled)


def _kernel(fn: Callable, compiled: bool | None) -> Callable:
    """fn itself, or fn compiled once per process (dynamic shapes: one graph for every size)."""
    if not _compiling(compiled):
        return fn
    key = f"{fn.__module__}.{fn.__qualname__}"
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=True)
    return _COMPILED[key]


def _hooked_step(opt: "ArenaOptimizer", closure: Callable[[], Any] | None) -> Any:
    return Optimizer.profile_hook_step(type(opt)._step)(opt, closure)


def _flag_hook(flags: bytearray, dirty: bytearray, slot: int, pack: "_Pack", i: int) -> Callable[[torch.Tensor], None]:
    # Holds the flags and the pack's lists, not the optimizer, so a dropped optimizer is not kept
    # alive by its hooks. The two identity tests are the backward's share of the arena check: a
    # parameter that receives a gradient is checked here, where it is in cache anyway.
    grefs, ptrs = pack.grefs, pack.ptrs

    def hook(param: torch.Tensor) -> None:
        flags[slot] = 1
        flags[-1] = 1  # "some gradient arrived since the last step"
        ref = grefs[i]
        if ref is None or param.grad is not ref():
            dirty[1] = 1  # the gradient is not the arena's view (a watched one)
        if param.data_ptr() != ptrs[i]:
            dirty[0] = 1  # the parameter left the arena (p.data = ...)

    return hook


def _dirty_setter(dirty: bytearray) -> Callable[[Any], None]:
    def gone(_ref: Any) -> None:  # a watched gradient view died: p.grad was reassigned
        dirty[1] = 1

    return gone


_DEAD = object()  # what a dead watched view is expected to be: never any p.grad
_use_count = torch._C._storage_Use_Count


class _Pack:
    """One arena plus the optimizer's bookkeeping for it (one group, device, dtype)."""

    def __init__(self, arena: Arena, group: int, params: list[torch.Tensor], s0: int) -> None:
        self.arena, self.group, self.params = arena, group, params
        self.s0, self.s1 = s0, s0 + len(params)
        # What p.grad must be, per slot (see ArenaOptimizer._sync): a view of the flat gradient
        # that only p holds, watched through a weak reference (grefs), or a view the arena holds
        # itself (strong: not watchable, e.g. put back by ZeRO-2), or None (frozen, no gradient).
        self.grefs: list[weakref.ref | None] = [None] * len(params)
        self.strong: list[torch.Tensor | None] = [None] * len(params)
        self.unwatched = 0        # slots whose expected gradient is strong
        self.frozen: list[int] = []  # slots whose p.grad must stay None
        self.hookless: list[int] = []  # slots with a view but no gradient hook (see zero_grad)
        self.ptrs: list[int] = [0] * len(params)  # p.data_ptr() of each parameter (in the arena)
        # The flat parameter's storage: its use count changes when a parameter leaves it
        # (p.data = ..., to_empty(), .half()); puse is the count when all were last checked.
        self.pstore = arena.param.untyped_storage()
        self.puse = -1
        self.state: dict[str, torch.Tensor] = {}          # name -> (N,) flat state
        self.sviews: dict[str, list[torch.Tensor]] = {}   # name -> per-param views
        self.step_vec = torch.zeros(len(params), dtype=torch.float32)  # CPU, like torch's 'step'
        self.uniform = True      # all entries of step_vec equal ...
        self.step = 0            # ... to this Python int (no tensor read per step)
        self.init = [False] * len(params)
        self.n_init = 0
        self.all_ones = b"\x01" * len(params)
        self.grad_version = arena.grad._version
        self.step_t = torch.zeros((), dtype=torch.float32, device=arena.device)
        self.step0 = self.step_vec[0] if params and arena.device.type == "cpu" else None
        self.scratch: torch.Tensor | None = None
        self.scratch_views: list[torch.Tensor] = []
        self.is1d = [len(s) <= 1 for s in arena.shapes]
        self.cache: dict[Any, Any] = {}  # per-optimizer constants of this arena (e.g. LARS masks)
        # Over an ArenaSlice (a shard) per-tensor norms are partial: (i, j, norms (2*(j-i),))
        # -> full norms, a collective (see ArenaOptimizer.shard). None over a whole arena.
        self.norm_reduce: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None
        # Sharded (ArenaOptimizer.shard): the pack over this rank's slice, which holds the state
        # and is stepped; the whole pack keeps the parameters, gradients and step counts.
        self.shard: _Pack | None = None
        self.trainable = b""  # on a shard pack: which of the whole arena's segments step

    def expected_grad(self, i: int) -> Any:
        """What p.grad of slot i must be: the arena's view, None, or _DEAD (a watched view died)."""
        if self.strong[i] is not None:
            return self.strong[i]
        ref = self.grefs[i]
        if ref is None:
            return None
        v = ref()
        return _DEAD if v is None else v

    def grads_intact(self) -> bool:
        """Every p.grad is what it must be: an identity test per parameter (the slow check)."""
        return all(map(operator.is_, map(_grad_of, self.params), map(self.expected_grad, range(len(self.params)))))

    def step_tensor(self, step: int) -> torch.Tensor:
        """A 0-d tensor holding ``step`` beside the arena (for torch's fused kernels): in the
        uniform case on CPU a view of step_vec, which already holds it (no fill per step)."""
        if self.step0 is not None and self.uniform and step == self.step:
            return self.step0
        self.step_t.fill_(step)
        return self.step_t

    def set_uniform(self) -> None:
        steps = self.step_vec.tolist()
        self.uniform = not steps or all(s == steps[0] for s in steps)
        self.step = int(steps[0]) if steps else 0


class ArenaOptimizer(Optimizer):
    """Base class: packs parameters into arenas and keeps torch.optim's public behaviour.

    Groups that ask for ``capturable=True`` (CUDA graphs) or ``differentiable=True`` (autograd
    through the step) are stepped by torch's own functional implementation
    (:meth:`_update_torch`) over the parameters as they are, and the optimizer then keeps no
    arena (``contiguous`` is set to False): an arena's host-side step counts and re-pointed
    storage would defeat both flags.
    """

    _has_step_state = True  # torch keeps state[p]['step'] for this optimizer
    _per_tensor_norms = False  # the update needs per-tensor norms (LAMB, LARS): see shard()
    _supports_complex = True  # complex parameters stepped as pairs of reals, as torch.optim does

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], *, contiguous: bool = True,
                 shard_multiple: int | None = None) -> None:
        self.contiguous = contiguous
        self.shard_multiple = shard_multiple
        self._packs: list[_Pack] = []
        self._complex_packs: list[_Pack] = []
        self._shards: list[_Pack] = []  # one per pack once sharded (shard())
        self._shard_spec: tuple[int, int, Any, bool] | None = None  # rank, world, group, keep_full_grad
        self._built = False
        self._hooks: list[Any] = []
        self._flags = bytearray(1)
        # [0]: a parameter may have left the arena; [1]: a p.grad may not be the arena's view.
        # Set by the gradient hooks and by the death of a watched gradient view (see _sync).
        self._dirty = bytearray(b"\x01\x01")
        self._grad_gone = _dirty_setter(self._dirty)
        self._warned_stale = False  # the "no new gradient" warning is shown once
        super().__init__(params, defaults)
        if contiguous and any(map(_torch_impl, self.param_groups)):
            self.contiguous = False  # torch's own implementation, no arena (see the class docstring)
        if self.contiguous:
            self._build()
        self._built = True

    # -- what a subclass declares -----------------------------------------------------------
    # Its name in a config's optim.name, and the optim.* keys it takes (kiln.train builds it
    # with lr, those keys and the parameter groups; a key it does not take is refused).
    config_name: ClassVar[str]
    config_options: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def state_names(cls, group: Mapping[str, Any]) -> tuple[str, ...]:
        """The parameter-sized state tensors a group with these hyperparameters keeps."""
        raise NotImplementedError

    @classmethod
    def state_names_for(cls, **options: Any) -> tuple[str, ...]:
        """:meth:`state_names` of a group built with these keyword arguments (the constructor's
        defaults for the rest, and for any given as None), without building anything."""
        group = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
                 if p.default is not inspect.Parameter.empty}
        group.update((k, v) for k, v in options.items() if v is not None)
        return cls.state_names(group)

    # -- subclass interface ---------------------------------------------------------------

    def _update_flat(self, pack: _Pack, group: dict[str, Any], i: int, j: int, step: int) -> None:
        """Update segments i..j-1 of pack (all received, all at step number `step`)."""
        raise NotImplementedError

    def _update_list(self, group: dict[str, Any], params: list[torch.Tensor], step: int) -> None:
        """Multi-tensor update of params (all with grads, all at step number `step`)."""
        raise NotImplementedError

    # -- packing --------------------------------------------------------------------------
    def _build(self) -> None:
        seen: set[int] = set()
        plan: list[tuple[int, list[torch.Tensor]]] = []
        for gi, group in enumerate(self.param_groups):
            buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in group["params"]:
                if id(p) in seen:  # tied weights: one slot, updated once
                    continue
                seen.add(id(p))
                if p.is_sparse:
                    raise ValueError("kiln.optim does not support sparse parameters; use contiguous=False")
                if _is_dtensor(p):
                    raise TypeError(
                        "kiln.optim: a parameter is a DTensor (FSDP2 fully_shard / tensor parallel): its "
                        "shards cannot be packed into an arena. Build the optimizer with contiguous=False "
                        "(multi-tensor mode), e.g. kiln.optim.AdamW(model.parameters(), contiguous=False)")
                buckets.setdefault((p.device, p.dtype), []).append(p)
            plan.extend((gi, ps) for ps in buckets.values())
        nslots = sum(len(ps) for _, ps in plan)
        self._flags = flags = bytearray(nslots + 1)
        self._packs, slot = [], 0
        with torch.no_grad():
            for gi, ps in plan:
                grads = [p.grad for p in ps]
                arena = Arena(ps, self.shard_multiple)
                pack = _Pack(arena, gi, ps, slot)
                for i, (p, g) in enumerate(zip(ps, grads)):
                    if g is not None:
                        arena.gviews[i].copy_(g)
                        flags[slot + i] = 1
                        flags[-1] = 1  # counts as fresh for the next step
                    self._link_grad(pack, i)
                pack.ptrs[:] = [p.data_ptr() for p in ps]  # in place: the hooks hold the list
                self._rewatch(pack)
                pack.grad_version = arena.grad._version
                self._packs.append(pack)
                slot += len(ps)
        self._complex_packs = [pk for pk in self._packs if pk.arena.dtype.is_complex]

    def _link_grad(self, pack: _Pack, i: int, force: bool = False) -> None:
        """Point p.grad at a fresh view of the flat gradient that only p holds, watched by a weak
        reference whose death (p.grad reassigned) marks the gradients dirty; frozen parameters
        without a gradient keep None, as with torch (``force``: link a view anyway)."""
        p = pack.params[i]
        pack.strong[i] = None
        if force or p.requires_grad or p.grad is not None:
            lo, n = pack.arena._starts[i], pack.arena.numels[i]
            view = pack.arena.grad[lo:lo + n].view(pack.arena.shapes[i])
            # the new reference first: the old one then dies silently with the old view
            pack.grefs[i] = weakref.ref(view, self._grad_gone)
            p.grad = view
        else:  # frozen without a gradient: leave .grad None, as torch does
            pack.grefs[i] = None
        if p.requires_grad and getattr(p, "_kiln_hooked", None) is not self._flags:
            self._hooks.append(p.register_post_accumulate_grad_hook(
                _flag_hook(self._flags, self._dirty, pack.s0 + i, pack, i)))
            p._kiln_hooked = self._flags  # one hook per parameter per build

    def relink(self) -> None:
        """Rebuild the arenas from the parameters as they are now (after ``model.half()``,
        ``model.to(device)``, ``add_param_group``), keeping the optimizer state (cast to the
        parameters' new dtype and device)."""
        if not self.contiguous:
            return
        if self._shards:
            raise RuntimeError(
                "kiln.optim: a sharded optimizer cannot be relinked (its shards are cut from the "
                "arenas): build the optimizer (and ZeroOptimizer) again after moving or casting the model")
        sd = self.state_dict() if self._packs else None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for pack in self._packs:
            for p in pack.params:
                if getattr(p, "_kiln_hooked", None) is self._flags:
                    del p._kiln_hooked
        self.state.clear()
        self._build()
        if sd is not None:
            self.load_state_dict(sd)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._shards:
            raise RuntimeError("kiln.optim: add_param_group() after shard(): add the group before sharding")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if not self._supports_complex and any(torch.is_complex(p) for p in group["params"]):
            self.param_groups.pop()
            name = type(self).__name__
            raise ValueError(
                f"kiln.optim.{name} does not support complex parameters (torch.optim has no {name} "
                f"to follow, and the paper's per-tensor trust ratio is defined for real tensors). "
                f"Optimize the complex parameters with kiln.optim.AdamW or SGD (a second optimizer), "
                f"or keep them in the model as real tensors of shape (..., 2) (torch.view_as_real).")
        if self._built and self.contiguous:
            if _torch_impl(group):
                self.param_groups.pop()
                raise ValueError(
                    "kiln.optim: a parameter group with capturable=True or differentiable=True runs "
                    "torch's own per-parameter implementation, which an arena cannot serve: build the "
                    "optimizer with contiguous=False (or with the flag set for all groups).")
            self.relink()

    @property
    def arenas(self) -> list[Arena]:
        """The arenas, one per (parameter group, device, dtype), in parameter-group order."""
        return [pk.arena for pk in self._packs]

    def packed_params(self) -> list[tuple[Arena, list[torch.Tensor]]]:
        """``(arena, its parameters in segment order)`` for each arena."""
        return [(pk.arena, list(pk.params)) for pk in self._packs]

    def flat_grads(self) -> list[torch.Tensor]:
        """The tensors holding all gradients: one flat buffer per arena (after absorbing any
        gradient placed outside it), or every ``p.grad`` with ``contiguous=False``. A check or
        a scaling over all gradients is then one operation per buffer."""
        if not self.contiguous:
            return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        self._sync(check_fresh=False)
        return [pk.arena.grad for pk in self._packs]

    def grad_parts(self) -> list[tuple[list[torch.Tensor], tuple[Any, ...]]]:
        """``[(tensors, process groups)]``: the tensors that hold this optimizer's gradients on
        this rank and the groups over which their norms sum to the whole gradient's (see
        :func:`kiln.optim.clip_grad_norm_`): the flat buffers, or each parameter's (local) grad;
        once sharded, the shards' gradients (what :meth:`step` reads), summed over the group."""
        if self._shards:
            _, world, group, _ = self._shard_spec  # type: ignore[misc]
            if not _is_process_group(group):
                raise TypeError("grad_parts() of a shard needs the process group of its shard() call")
            return [([sp.arena.grad for sp in self._shards], (group,) if world > 1 else ())]
        if not self.contiguous:
            from kiln.optim._clip import param_grad_parts

            return param_grad_parts(p for g in self.param_groups for p in g["params"])
        return [(self.flat_grads(), ())]

    def mark_grads_ready(self) -> None:
        """Count every trainable parameter as having received a gradient this step. For code
        that writes the flat gradient itself instead of through autograd (the fp32 master
        weights of ``bf16-true`` training, a reduce-scatter into a ZeRO shard)."""
        for pk in self._packs:
            for i, p in enumerate(pk.params):
                if p.requires_grad:
                    self._flags[pk.s0 + i] = 1
        self._flags[-1] = 1

    def union_received(self, all_reduce_max: Callable[[torch.Tensor], Any]) -> None:
        """Agree with other replicas on which parameters received a gradient this step, so that
        they all step the same ones: ``all_reduce_max`` gets the flags as a uint8 tensor (one
        byte per parameter and one "any" byte, sharing memory with the optimizer's) and must
        take their maximum over the replicas in place (``dist.all_reduce(t, op=MAX)``)."""
        all_reduce_max(torch.frombuffer(self._flags, dtype=torch.uint8))

    # -- per-step checks ------------------------------------------------------------------
    def _sync(self, check_fresh: bool, grads: bool = True) -> None:
        """Make the arena authoritative again (see the module docstring). ``grads=False``:
        parameters only (a sharded step whose full gradient may be freed).

        O(1) in the common case: nothing marked dirty (no watched gradient view died, no
        gradient hook saw a foreign gradient or a moved parameter), the flat parameter's
        storage has the use count it had at the last full check (a parameter moved out of it
        by ``p.data = ...`` drops it by one), and every frozen parameter still has no gradient.
        Otherwise one identity test and one pointer comparison per parameter."""
        dirty, flags = self._dirty, self._flags
        foreign = False
        if dirty[0] or (grads and dirty[1]) or not self._intact(grads):
            dirty[0] = 0  # cleared first: whatever happens during the check marks it again
            if grads:
                dirty[1] = 0
            for pack in self._packs:
                params = pack.params
                if list(map(_data_ptr, params)) != pack.ptrs:
                    self._relink_params(pack)
                if grads and not pack.grads_intact():
                    foreign |= self._absorb_grads(pack)
                pack.puse = _use_count(pack.pstore._cdata)
        if check_fresh and not foreign and not flags[-1] and not self._warned_stale:
            if all(pk.arena.grad._version == pk.grad_version for pk in self._packs) and any(
                    p.requires_grad for pk in self._packs for p in pk.params):
                self._warned_stale = True
                warnings.warn(
                    "kiln.optim: step() found no new gradient for any of its parameters since the "
                    "previous step; like torch.optim it applies the update again to the gradients the "
                    "parameters hold (none after zero_grad()). If backward() did run, the model's "
                    "parameters were replaced after the optimizer was built (model.load_state_dict(..., "
                    "assign=True), to_empty(), re-created modules), so the optimizer holds the old ones "
                    "and trains nothing: build the optimizer after loading, or load without assign=True "
                    "(it copies into the arena). Shown once per optimizer.", stacklevel=5)

    def _intact(self, grads: bool) -> bool:
        """The O(1) part of :meth:`_sync`: per arena one storage use count (and, where there
        are any, the frozen parameters' and the unwatchable gradients' slots)."""
        for pack in self._packs:
            if _use_count(pack.pstore._cdata) != pack.puse:
                return False
            if grads and (pack.unwatched or (pack.frozen and any(
                    pack.params[k].grad is not None for k in pack.frozen))):
                return False
        return True

    def _relink_params(self, pack: _Pack) -> None:
        arena = pack.arena
        with torch.no_grad():
            for i, p in enumerate(pack.params):
                if p.data_ptr() == pack.ptrs[i]:
                    continue
                if p.dtype != arena.dtype or p.device != arena.device or tuple(p.shape) != arena.shapes[i]:
                    raise RuntimeError(
                        f"kiln.optim: parameter {i} of group {pack.group} is now {p.dtype} {tuple(p.shape)} "
                        f"on {p.device}, but its arena holds {arena.dtype} {arena.shapes[i]} on "
                        f"{arena.device}: the model was moved or cast after the optimizer was built "
                        f"(model.to(...), .half(), load_state_dict(assign=True)). Call "
                        f"optimizer.relink() to rebuild the arena (state is kept and cast), or build "
                        f"the optimizer after moving the model.")
                # same dtype/device/shape but new storage (p.data = ...): copy the values back in
                arena.pviews[i].copy_(p.detach())
                p.data = arena.pviews[i]
                pack.ptrs[i] = p.data_ptr()

    def _absorb_grads(self, pack: _Pack) -> bool:
        foreign = False
        flags = self._flags
        with torch.no_grad():
            for i, p in enumerate(pack.params):
                g, view = p.grad, pack.arena.gviews[i]
                if g is pack.expected_grad(i):
                    continue
                if g is view:  # the arena's own view, put back by ZeRO-2: adopted, not watchable
                    pack.grefs[i], pack.strong[i] = None, view
                    continue
                if g is None:  # model.zero_grad() or a user set it to None: no gradient
                    view.zero_()
                    flags[pack.s0 + i] = 0
                else:
                    view.copy_(g)
                    flags[pack.s0 + i] = 1
                    foreign = True
                self._link_grad(pack, i, force=True)
        self._rewatch(pack)
        return foreign

    def _rewatch(self, pack: _Pack) -> None:
        pack.unwatched = sum(v is not None for v in pack.strong)
        pack.frozen = [i for i in range(len(pack.params)) if pack.grefs[i] is None and pack.strong[i] is None]
        # linked to a view without a gradient hook (frozen when linked, given a gradient by hand)
        pack.hookless = [i for i, p in enumerate(pack.params) if i not in pack.frozen
                         and getattr(p, "_kiln_hooked", None) is not self._flags]

    # -- public API -----------------------------------------------------------------------
    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """One memset per arena. With set_to_none=True (default) the gradient views stay in
        place (reading as zeros) but every parameter counts as having no gradient until
        autograd delivers one, so parameters outside the next backward are not updated."""
        if not self.contiguous:
            return super().zero_grad(set_to_none)
        check = self._dirty[1]  # O(1) unless a gradient may have been reassigned
        for pack in self._packs:
            # a gradient assigned by hand since the last step would otherwise be accumulated into
            if (check or pack.unwatched or pack.frozen) and not pack.grads_intact():
                for i, p in enumerate(pack.params):
                    e = pack.expected_grad(i)
                    if p.grad is not e:
                        if e is _DEAD:
                            self._link_grad(pack, i, force=True)
                        else:
                            p.grad = e
                self._rewatch(pack)
            if set_to_none and pack.hookless:
                # as torch: None, so that autograd's next gradient (the parameter unfrozen) is
                # a fresh tensor the check sees, not an unseen accumulation into the view
                for i in pack.hookless:
                    pack.grefs[i], pack.strong[i] = None, None
                    pack.params[i].grad = None
                self._rewatch(pack)
            pack.arena.grad.zero_()
            pack.grad_version = pack.arena.grad._version
        self._dirty[1] = 0
        if self._shard_spec and not self._shard_spec[3]:  # shard gradients of their own
            for sp in self._shards:
                sp.arena.grad.zero_()
        if set_to_none:
            self._flags[:] = bytes(len(self._flags))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        # torch.optim wraps every Optimizer subclass's step in profile_hook_step (a
        # record_function and two hook chains, ~10 us); this step has the attribute that
        # stops the wrapping and takes torch's wrapped path only when a profiler runs or a
        # step hook is registered, so hooks and profiles behave exactly as with torch.optim.
        if (self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or _global_optimizer_pre_hooks
                or _global_optimizer_post_hooks or torch.autograd._profiler_enabled()):
            return _hooked_step(self, closure)
        return self._step(closure)

    step.hooked = True  # type: ignore[attr-defined]

    def _step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # as torch's _use_grad_for_differentiable: autograd records the step only if asked to
        # (set directly: the context manager is three Python calls per step)
        prev, want = torch.is_grad_enabled(), bool(self.defaults.get("differentiable"))
        torch._C._set_grad_enabled(want)
        try:
            if not self.contiguous:
                self._step_lists()
            else:
                self._step_arena()
        finally:
            torch._C._set_grad_enabled(prev)
        return loss

    def _step_arena(self) -> None:
        if self._shards:
            self._step_shards()
            return
        self._sync(check_fresh=True)
        flags = self._flags
        for pack in self._complex_packs:
            if self.param_groups[pack.group].get("fused") and any(flags[pack.s0:pack.s1]):
                _device_dtype_check_for_fused(pack.params[0])  # torch refuses fused=True for complex
        for pack in self._packs:
            recv = flags[pack.s0:pack.s1]
            if pack.uniform and recv == pack.all_ones:
                # the common case: one update over the whole flat buffer
                group = self.param_groups[pack.group]
                self._ensure_state(pack, group)
                pack.step += 1  # first: the update may read the count from step_vec (step_tensor)
                pack.step_vec.add_(1)
                try:
                    self._update_flat(pack, group, 0, len(pack.params), pack.step)
                except BaseException:
                    pack.step -= 1
                    pack.step_vec.sub_(1)
                    raise
                if pack.n_init < len(pack.params):
                    self._init_entries(pack, group, range(len(pack.params)))
            else:
                done = self._step_runs(pack, self.param_groups[pack.group], recv)
                if done:
                    self._init_entries(pack, self.param_groups[pack.group], done)
            pack.grad_version = pack.arena.grad._version
        flags[-1] = 0

    def _step_runs(self, pack: _Pack, group: dict[str, Any], recv: bytes) -> list[int]:
        """Update only parameters that received a gradient, in runs of consecutive segments
        that share a step count (frozen or unused parameters split the arena)."""
        steps = [int(s) for s in pack.step_vec.tolist()]
        received = [i for i in range(len(pack.params)) if recv[i]]
        if not received:
            return []
        self._ensure_state(pack, group)
        for i, j, step in step_runs(recv, steps):
            self._update_flat(pack, group, i, j, step)
        idx = torch.tensor(received, dtype=torch.int64)
        pack.step_vec[idx] += 1
        pack.set_uniform()
        return received

    def _ensure_state(self, pack: _Pack, group: dict[str, Any]) -> None:
        """Allocate pack's flat state; a sharded pack's lives on its shard, and ``pack.sviews``
        then holds each parameter's piece (empty where the shard has none of it)."""
        sp = pack.shard or pack
        for name in self.state_names(group):
            if name not in sp.state:
                sp.state[name] = sp.arena.new_buffer()
                sp.sviews[name] = sp.arena.views(sp.state[name])
                if sp is not pack:
                    views = [sp.state[name][:0]] * len(pack.params)
                    for pc, view in zip(sp.arena.pieces, sp.sviews[name]):
                        views[pc.index] = view
                    pack.sviews[name] = views

    def _init_entries(self, pack: _Pack, group: dict[str, Any], indices: Iterable[int]) -> None:
        """Expose per-parameter state the way torch.optim keys it (views into the arena)."""
        names = self.state_names(group)
        expose = bool(names) or self._has_step_state  # SGD without momentum: no entry, as torch
        for i in indices:
            if pack.init[i]:
                continue
            if expose:
                st = self.state[pack.params[i]]
                if self._has_step_state:
                    st["step"] = pack.step_vec[i]
                for name in names:
                    st[name] = pack.sviews[name][i]
            pack.init[i] = True
            pack.n_init += 1

    def _scratch(self, pack: _Pack) -> torch.Tensor:
        if pack.scratch is None:
            pack.scratch = pack.arena.new_buffer()
            pack.scratch_views = pack.arena.views(pack.scratch)
        return pack.scratch

    # -- state dict -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout (state[index] = {'step': ..., 'exp_avg': ...}); tensors are
        copies, so loading them elsewhere never aliases the arena. Sharded: each state tensor
        is this rank's piece of it, flat (empty where the rank holds none of the parameter),
        and ``"pieces"`` holds :meth:`shard_pieces`; a full dict is a gather of every rank's
        (``kiln.parallel.ZeroOptimizer.state_dict``)."""
        sd = super().state_dict()
        sd["state"] = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                       for k, s in sd["state"].items()}
        if self._shards:
            sd["pieces"] = self.shard_pieces()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's ``load_state_dict``, into the arena's state. Sharded: a dict from
        :meth:`state_dict` of the same sharding (it has ``"pieces"``), or a full torch-layout
        one (kiln's or torch.optim's), of which each rank takes its pieces."""
        pieces = state_dict.get("pieces")
        if self._shards:
            mine = self.shard_pieces()
            if pieces is not None and any(tuple(pieces.get(k, ())) != tuple(mine.get(k, ()))
                                          for k in state_dict["state"]):
                raise ValueError(
                    "kiln.optim: this state dict holds pieces of another sharding (another world size "
                    "or layout); load a full state dict instead (ZeroOptimizer.state_dict() gathers one)")
        elif pieces is not None:
            raise ValueError("kiln.optim: a sharded state dict (with 'pieces') needs an optimizer sharded "
                             "the same way; load a full state dict instead")
        groups, state = self.param_groups, self.state
        super().load_state_dict(state_dict)
        # torch replaces the group dicts and the state: keep the objects that a ZeroOptimizer
        # (or anything else holding them) shares
        for g, new in zip(groups, self.param_groups):
            g.clear()
            g.update(new)
        state.clear()
        state.update(self.state)
        self.param_groups, self.state = groups, state
        if not self.contiguous:
            return
        with torch.no_grad():
            for pack in self._packs:
                group = self.param_groups[pack.group]
                names = self.state_names(group)
                piece_of = {pc.index: pc for pc in pack.shard.arena.pieces} if pack.shard else None
                pack.init = [False] * len(pack.params)
                pack.n_init = 0
                for i, p in enumerate(pack.params):
                    st = self.state.get(p)
                    if not st:
                        pack.step_vec[i] = 0
                        for name in pack.sviews:
                            pack.sviews[name][i].zero_()
                        continue
                    self._ensure_state(pack, group)
                    for name in names:
                        src = st.get(name)
                        if src is None or (piece_of is not None and i not in piece_of):
                            continue
                        if piece_of is not None:  # this rank's piece, or a full tensor to cut it from
                            src = src.reshape(-1) if pieces is not None else \
                                src.reshape(-1)[piece_of[i].start:piece_of[i].stop]
                        pack.sviews[name][i].copy_(src)
                    pack.step_vec[i] = float(st["step"]) if "step" in st else 1.0
                    self.state[p] = {}
                    self._init_entries(pack, group, [i])
                pack.set_uniform()

    # -- sharding (ZeRO-1/2) ----------------------------------------------------------------
    def shard(self, rank: int, world: int, group: Any = None, *, keep_full_grad: bool = True) -> list[ArenaSlice]:
        """From now on step only this rank's contiguous shard, ``arena.shard(rank, world)`` of
        every arena, with optimizer state for the shard only; returns the shards (:attr:`shards`).

        What :meth:`step` reads is each shard's ``grad``: with ``keep_full_grad`` a view of
        the full flat gradient (fill it in place, e.g. a reduce-scatter), else a buffer of its
        own, so that the full gradient can be freed between steps (ZeRO-2). Every trainable
        parameter (``requires_grad``) steps on every step, as under DDP (no rank knows which
        parameters the others' backward reached); frozen ones never do. Runs of parameters
        with differing step counts are cut as over the whole arena, the same on every rank.

        ``group``: the ranks that hold the other shards. LAMB's and LARS's per-tensor norms are
        summed over it (one all-reduce per run, which a rank whose shard the run does not reach
        joins too), and :meth:`grad_parts` names it. A process group (None: the default one),
        or a function that sums a tensor in place over the shards (a test's stand-in).

        Afterwards ``state[p]`` and :meth:`state_dict` hold this rank's piece of each state
        tensor, :meth:`shard_pieces` says where each piece lies in its parameter, and
        :meth:`load_state_dict` takes a sharded or a full dict. State held before sharding is
        cut to the shard. :class:`kiln.parallel.ZeroOptimizer` does the communication.

        >>> model = torch.nn.Linear(30, 2)
        >>> opt = kiln.optim.AdamW(model.parameters(), shard_multiple=2)
        >>> [(s.lo, s.hi) for s in opt.shard(1, 2)]    # weight [0, 64), bias [64, 80), N = 96
        [(48, 96)]
        >>> opt.shard_pieces()                          # weight elements 48..59, all of bias
        {0: (48, 60), 1: (0, 2)}
        """
        if not self.contiguous:
            raise TypeError("kiln.optim: shard() needs the arena (contiguous=True)")
        if self._shards:
            raise RuntimeError("kiln.optim: the optimizer is already sharded")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        for pk in self._packs:
            if pk.arena.numel % world:
                raise ValueError(
                    f"an arena of {pk.arena.numel} elements does not divide into {world} shards: build the "
                    f"optimizer with shard_multiple={world} (the default once the process group is initialised)")
        sd = self.state_dict() if any(pk.n_init for pk in self._packs) else None
        self._shard_spec = (rank, world, group, keep_full_grad)
        for pk in self._packs:
            lo, hi = pk.arena.shard(rank, world)
            grad = None if keep_full_grad else torch.zeros(hi - lo, dtype=pk.arena.dtype, device=pk.arena.device)
            sl = ArenaSlice(pk.arena, lo, hi, grad)
            sp = _Pack(sl, pk.group, [pk.params[k] for k in sl.seg_ids], pk.s0)
            sp.trainable = bytes(int(p.requires_grad) for p in pk.params)
            if self._per_tensor_norms and world > 1:
                sp.norm_reduce = _norm_reducer(len(pk.params), sl, group)
            pk.shard = sp
            pk.state, pk.sviews, pk.scratch, pk.scratch_views = {}, {}, None, []  # no full-size state
            pk.init, pk.n_init = [False] * len(pk.params), 0
            self._shards.append(sp)
        self.state.clear()
        if sd is not None:
            self.load_state_dict(sd)
        return self.shards

    @property
    def shards(self) -> list[ArenaSlice]:
        """This rank's shard of each arena, in :attr:`arenas` order (empty: not sharded)."""
        return [sp.arena for sp in self._shards]

    def shard_pieces(self) -> dict[int, tuple[int, int]]:
        """Where this rank's shards hold each parameter: ``{index: (start, stop)}``, elements
        [start, stop) of the flattened parameter, keyed by its index in :meth:`state_dict`
        (torch's numbering). Parameters this rank holds no element of are absent."""
        index: dict[int, int] = {}
        start = 0
        for g in self.param_groups:
            for i, p in enumerate(g["params"], start):
                index.setdefault(id(p), i)
            start += len(g["params"])
        return {index[id(pk.params[pc.index])]: (pc.start, pc.stop)
                for pk in self._packs if pk.shard for pc in pk.shard.arena.pieces if pc.stop > pc.start}

    def state_bytes(self) -> int:
        """Bytes of optimizer state (and scratch buffers) this optimizer holds on this rank:
        once sharded, its shards only; of a DTensor's state, its local shard."""
        if not self.contiguous:
            return sum(getattr(v, "_local_tensor", v).nbytes
                       for st in self.state.values() for v in st.values() if torch.is_tensor(v))
        bufs = [b for pk in self._packs + self._shards
                for b in [*pk.state.values(), *([pk.scratch] if pk.scratch is not None else [])]]
        return sum(b.untyped_storage().nbytes() for b in bufs)

    def _step_shards(self) -> None:
        """Update each shard's pieces in the runs of the whole arena (the same on every rank,
        so LAMB/LARS norm all-reduces match up even on a rank whose shard a run misses)."""
        self._sync(check_fresh=False, grads=self._shard_spec[3])  # type: ignore[index]
        for pk, sp in zip(self._packs, self._shards):
            group, n, trainable = self.param_groups[pk.group], len(pk.params), sp.trainable
            if pk.arena.dtype.is_complex and group.get("fused") and any(trainable):
                _device_dtype_check_for_fused(pk.params[0])  # torch refuses fused=True for complex
            if pk.uniform and trainable == pk.all_ones:
                runs = [(0, n, pk.step + 1)]
            else:
                runs = step_runs(trainable, [int(s) for s in pk.step_vec.tolist()])
            if not runs:
                continue
            self._ensure_state(pk, group)
            ids = sp.arena.seg_ids
            k0, k1 = (ids[0], ids[-1] + 1) if ids else (0, 0)
            for i, j, step in runs:
                a, b = max(i, k0), min(j, k1)
                if a < b:
                    self._update_flat(sp, group, a - k0, b - k0, step)
                elif sp.norm_reduce is not None:
                    sp.norm_reduce(0, 0, torch.zeros(0))  # take part in the other ranks' all-reduce
            if trainable == pk.all_ones:
                pk.step_vec.add_(1)
                pk.step += 1
            else:
                pk.step_vec[torch.tensor([i for i in range(n) if trainable[i]], dtype=torch.int64)] += 1
                pk.set_uniform()
            if pk.n_init < n:
                self._init_entries(pk, group, [i for i in range(n) if trainable[i]])
        self._flags[-1] = 0

    # -- multi-tensor mode (contiguous=False) ---------------------------------------------
    def _step_lists(self) -> None:
        for group in self.param_groups:
            fused, by_torch = group.get("fused"), _torch_impl(group)
            with_grad: list[torch.Tensor] = []
            buckets: dict[tuple, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if fused and torch.is_complex(p):
                    _device_dtype_check_for_fused(p)  # torch refuses fused=True for complex
                st = self.state.get(p) or self._init_list_state(p, group)
                if by_torch:
                    with_grad.append(p)
                    continue
                dkey = (p.device_mesh, tuple(p.placements)) if _is_dtensor(p) else None
                buckets.setdefault((p.device, p.dtype, dkey, self._list_key(p, st)), []).append(p)
            if with_grad:
                self._update_torch(group, with_grad)
            for (_, _, dkey, key), ps in buckets.items():
                if dkey is None:
                    self._update_list(group, ps, key)
                else:
                    self._update_list_dtensor(group, ps, key)

    # -- DTensor parameters (FSDP2 fully_shard, tensor parallel) ------------------------------
    _list_norm_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _tensor_norms(self, ts: list[torch.Tensor]) -> torch.Tensor:
        """(S,) L2 norm of each tensor of ts; over DTensor shards, the norm of the full tensor
        (squared local norms summed over the sharded mesh dimensions: one all-reduce)."""
        norms = _list_norms(ts)
        return norms if self._list_norm_reduce is None else self._list_norm_reduce(norms)

    def _update_list_dtensor(self, group: dict[str, Any], ps: list[torch.Tensor], key: Any) -> None:
        """Run :meth:`_update_list` on the local shards of DTensor parameters (all on one mesh
        with the same placements): parameters, gradients and state as plain local tensors, so
        the fused / foreach kernels run unchanged; per-tensor norms (LAMB, LARS) are completed
        over the mesh; state created during the update is wrapped back into DTensors."""
        from torch.distributed.tensor import DTensor

        mesh, placements = ps[0].device_mesh, tuple(ps[0].placements)
        if any(pl.is_partial() for pl in placements):
            raise ValueError(f"kiln.optim: parameters with Partial placements are not supported: {placements}")
        # not is_shard(): FSDP2's dp placement over a tensor-parallel shard is a _StridedShard,
        # which is split over its mesh dim but is not is_shard() in torch 2.13
        sharded = [d for d, pl in enumerate(placements) if not pl.is_replicate()]

        def reduce(norms: torch.Tensor) -> torch.Tensor:
            sq = norms.square()
            for d in sharded:
                torch.distributed.all_reduce(sq, group=mesh.get_group(d))
            return sq.sqrt()

        def local(t: Any) -> Any:
            return t._local_tensor if isinstance(t, DTensor) else t

        locs, saved, local_state = [], self.state, {}
        for p in ps:
            lp = p._local_tensor.detach()  # a view of the shard: updates land in the parameter
            lp.grad = local(p.grad)
            locs.append(lp)
            local_state[lp] = {k: local(v) for k, v in saved.get(p, {}).items()}
        self.state = local_state  # type: ignore[assignment]
        self._list_norm_reduce = reduce if sharded else None
        try:
            self._update_list(group, locs, key)
        finally:
            self.state = saved
            self._list_norm_reduce = None
        for p, lp in zip(ps, locs):
            lp.grad = None
            if not local_state[lp]:  # no state (SGD without momentum): no entry, as torch
                continue
            st = saved[p]
            for k, v in local_state[lp].items():
                old = st.get(k)
                if old is v or (isinstance(old, DTensor) and old._local_tensor is v):
                    continue
                if torch.is_tensor(v) and k != "step" and v.shape == lp.shape:
                    v = DTensor.from_local(v, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
                st[k] = v

    def _init_list_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """p's state before its first step, stored in ``self.state`` as torch.optim lays it
        out: 'step' on the CPU unless capturable or fused (then beside p, float32 if fused)."""
        on_p = group.get("capturable") or group.get("fused")
        st = self.state[p]
        st["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")),
                                 device=p.device if on_p else "cpu")
        for name in self.state_names(group):
            st[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    def _update_torch(self, group: dict[str, Any], ps: list[torch.Tensor]) -> None:
        """torch.optim's own functional update of ps (all with gradients), for the groups that
        ask for capturable=True or differentiable=True."""
        raise NotImplementedError

    def _list_key(self, p: torch.Tensor, st: dict[str, Any]) -> Any:
        """What the tensors of one multi-tensor update must share besides device and dtype:
        by default the step count (one bias correction for the whole list)."""
        return int(st["step"])

    def _advance_list(self, ps: list[torch.Tensor]) -> None:
        torch._foreach_add_([self.state[p]["step"] for p in ps], 1.0)

    def _lists(self, ps: list[torch.Tensor], *names: str) -> list[TensorList]:
        """(params, grads, *state) as TensorLists; real views of complex tensors, as torch.optim."""
        lists = [ps, [p.grad for p in ps]] + [[self.state[p][n] for p in ps] for n in names]
        if ps and torch.is_complex(ps[0]):  # a bucket shares one dtype
            lists = [_as_real(ts) for ts in lists]
        return [TensorList(ts) for ts in lists]


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype per-tensor norms are taken in: at least fp32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _list_norms(ts: list[torch.Tensor]) -> torch.Tensor:
    """(S,) L2 norm of each tensor of a list (fp32 for 16-bit tensors)."""
    if not ts:
        return torch.zeros(0)
    return tensor_norms(ts, 2, dtype=_norm_dtype(ts[0].dtype))  # (a shard of an embedding can be long)


def _is_process_group(group: Any) -> bool:
    import torch.distributed as dist

    return group is None or isinstance(group, dist.ProcessGroup)


def _norm_reducer(nseg: int, sl: ArenaSlice, group: Any) -> Callable[[int, int, torch.Tensor], torch.Tensor]:
    """(i, j, partial norms of pieces i..j-1 of sl: w norms then update norms) -> full norms:
    squared, scattered into a (2*S,) vector over the arena's S segments, summed over group."""
    ids = torch.tensor(sl.seg_ids, dtype=torch.int64, device=sl.device)
    dtype = _norm_dtype(sl.dtype)
    if _is_process_group(group):
        def sum_(t: torch.Tensor) -> Any:
            return torch.distributed.all_reduce(t, group=group)
    else:
        sum_ = group

    def reduce(i: int, j: int, norms: torch.Tensor) -> torch.Tensor:
        sq = torch.zeros(2 * nseg, dtype=dtype, device=sl.device)
        n = j - i
        if n:
            sq[ids[i:j]] = norms[:n].to(dtype).square()
            sq[ids[i:j] + nseg] = norms[n:].to(dtype).square()
        sum_(sq)
        return sq[torch.cat([ids[i:j], ids[i:j] + nseg])].sqrt()

    return reduce


def _as_real(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Real views of complex tensors (each complex number as two reals), others unchanged."""
    return [torch.view_as_real(t) if torch.is_complex(t) else t for t in ts]


def step_runs(mask: Any, steps: list[int]) -> list[tuple[int, int, int]]:
    """The runs ``(i, j, step)`` of consecutive segments ``i..j-1`` whose ``mask`` is set and
    whose step counts are equal, with the step number to apply: what one update call over a
    range of the arena can cover (unset segments, frozen or without a gradient, split it)."""
    runs, i, n = [], 0, len(steps)
    while i < n:
        if not mask[i]:
            i += 1
            continue
        j = i + 1
        while j < n and mask[j] and steps[j] == steps[i]:
            j += 1
        runs.append((i, j, steps[i] + 1))
        i = j
    return runs


def _flat_args(pack: _Pack, i: int, j: int, *names: str) -> list[torch.Tensor]:
    """(param, grad, *state) flat slices covering segments i..j-1 (real views of complex ones)."""
    a = pack.arena
    if i == 0 and j == len(pack.params):
        ts = [a.param, a.grad] + [pack.state[n] for n in names]
    else:
        lo, hi = a.segment_range(i, j)
        ts = [a.param[lo:hi], a.grad[lo:hi]] + [pack.state[n][lo:hi] for n in names]
    if a.dtype.is_complex:  # as torch.optim: each complex number is two reals, (n,) -> (2n,)
        ts = [torch.view_as_real(t).view(-1) for t in ts]
    return ts
