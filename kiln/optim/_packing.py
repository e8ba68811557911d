"""The optimizer's parameters packed into arenas, and the guard that keeps the arenas true.

:class:`Packing` puts every trainable parameter of a (parameter group, device, dtype) into one
:class:`~kiln.optim._arena.Arena`, one :class:`Pack` of bookkeeping each, and keeps them
authoritative between steps.

Gradients and ``zero_grad``
---------------------------
After packing every trainable parameter's ``p.grad`` is a view into the flat gradient, so
autograd accumulates into the arena in place. ``zero_grad(set_to_none=True)`` (the default)
is one memset that *keeps* the views; it records that no parameter has a gradient yet. Which
parameters really received one is tracked by a post-accumulate-grad hook per parameter (a
byte store), so a parameter that took no part in the backward pass is left exactly as it is,
as torch.optim leaves a parameter whose ``.grad`` is None. The visible difference from torch:
``p.grad`` reads as zeros instead of None after ``zero_grad()``.

Before a step, :meth:`Packing.sync` makes sure the arena is still authoritative:

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
does the check compare every parameter. What the signals cannot see: ``p.grad`` set to None
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
"""

from __future__ import annotations

import operator
import sys
import warnings
import weakref
from typing import Any, Callable, Iterable

import torch

from kiln.errors import KilnWarning
from kiln.optim._arena import Arena, ArenaSlice
from kiln.optim._contract import is_dtensor

__all__ = ["FlatRange", "Pack", "Packing", "as_real", "step_runs"]

_data_ptr = torch.Tensor.data_ptr
_grad_of = operator.attrgetter("grad")
_use_count = torch._C._storage_Use_Count
_DEAD = object()  # what a dead watched view is expected to be: never any p.grad


def as_real(ts: list[torch.Tensor]) -> list[torch.Tensor]:
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


def _flag_hook(flags: bytearray, dirty: bytearray, slot: int, pack: "Pack", i: int) -> Callable[[torch.Tensor], None]:
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


class Pack:
    """One arena (or a shard of one) and its bookkeeping: one parameter group, device, dtype.

    The update rules see a pack only through :class:`FlatRange`."""

    def __init__(self, arena: Arena | ArenaSlice, group: int, params: list[torch.Tensor], s0: int,
                 step_vec: torch.Tensor | None = None) -> None:
        self.arena, self.group, self.params = arena, group, params
        self.s0, self.s1 = s0, s0 + len(params)
        # What p.grad must be, per slot (see Packing.sync): a view of the flat gradient that
        # only p holds, watched through a weak reference (grefs), or None (frozen, no gradient).
        self.grefs: list[weakref.ref | None] = [None] * len(params)
        # while the flat gradient is freed (park_grads: ZeRO-2 between steps) the views, kept
        # alive here, with p.grad None
        self.parked: list[torch.Tensor | None] | None = None
        self.frozen: list[int] = []  # slots whose p.grad must stay None
        self.hookless: list[int] = []  # slots with a view but no gradient hook (see Packing.zero_grad)
        self.ptrs: list[int] = [0] * len(params)  # p.data_ptr() of each parameter (in the arena)
        # The flat parameter's storage: its use count changes when a parameter leaves it
        # (p.data = ..., to_empty(), .half()); puse is the count when all were last checked.
        self.pstore = arena.param.untyped_storage()
        self.puse = -1
        self.state: dict[str, torch.Tensor] = {}          # name -> (N,) flat state
        self.sviews: dict[str, list[torch.Tensor]] = {}   # name -> per-param views
        # CPU, like torch's 'step'; a view of Packing.steps, which counts every arena's at once
        self.step_vec = torch.zeros(len(params), dtype=torch.float32) if step_vec is None else step_vec
        self.uniform = True      # all entries of step_vec equal ...
        self.step = 0            # ... to this Python int (no tensor read per step)
        self.init = [False] * len(params)
        self.n_init = 0
        self.all_ones = b"\x01" * len(params)
        self.grad_version = arena.grad._version
        self.step_t = torch.zeros((), dtype=torch.float32, device=arena.device)
        self.step0 = self.step_vec[0] if params and arena.device.type == "cpu" else None
        self.scratch: torch.Tensor | None = None
        self.is1d = [len(s) <= 1 for s in arena.shapes]
        self.cache: dict[Any, Any] = {}  # per-optimizer constants of this arena (e.g. LARS masks)
        # Over a shard, per-tensor norms are partial: (i, j, norms (2*(j-i),)) -> full norms,
        # the sum over the other shards that the sharding's owner supplies. None: whole arena.
        self.norm_reduce: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None
        # Sharded: the pack over this rank's slice, which holds the state and is stepped; the
        # whole pack keeps the parameters, gradients and step counts.
        self.shard: Pack | None = None
        self.trainable = b""  # on a shard pack: which of the whole arena's segments step

    def expected_grad(self, i: int) -> Any:
        """What p.grad of slot i must be: the arena's view, None, or _DEAD (a watched view died)."""
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

    def rewatch(self, flags: bytearray) -> None:
        self.frozen = [i for i in range(len(self.params)) if self.grefs[i] is None]
        # linked to a view without a gradient hook (frozen when linked, given a gradient by hand)
        self.hookless = [i for i, p in enumerate(self.params) if i not in self.frozen
                         and getattr(p, "_kiln_hooked", None) is not flags]


class FlatRange:
    """Segments ``i..j-1`` of one pack, as an update rule sees them: flat slices of the
    parameters, gradients and state, and the pack's constants, scratch and norm completion.

    ``args(*names)``: ``[param, grad, *state]`` flat over the range (real views of complex
    buffers); ``norms(partial)``: per-segment norms of this range made whole (over the other
    shards when the pack is one); ``cache`` and ``scratch(n)`` persist across steps."""

    __slots__ = ("pack", "i", "j")

    def __init__(self, pack: Pack, i: int, j: int) -> None:
        self.pack, self.i, self.j = pack, i, j

    @property
    def arena(self) -> Arena | ArenaSlice:
        return self.pack.arena

    @property
    def cache(self) -> dict[Any, Any]:
        return self.pack.cache

    @property
    def sharded(self) -> bool:
        """The norms of this range are partial (a shard): :meth:`norms` completes them."""
        return self.pack.norm_reduce is not None

    def args(self, *names: str) -> list[torch.Tensor]:
        a, pack = self.pack.arena, self.pack
        if self.i == 0 and self.j == len(pack.params):
            ts = [a.param, a.grad] + [pack.state[n] for n in names]
        else:
            lo, hi = a.segment_range(self.i, self.j)
            ts = [a.param[lo:hi], a.grad[lo:hi]] + [pack.state[n][lo:hi] for n in names]
        if a.dtype.is_complex:  # as torch.optim: each complex number is two reals, (n,) -> (2n,)
            ts = [torch.view_as_real(t).view(-1) for t in ts]
        return ts

    def step_tensor(self, step: int) -> torch.Tensor:
        return self.pack.step_tensor(step)

    def is1d(self) -> list[bool]:
        return self.pack.is1d[self.i:self.j]

    def norms(self, partial: torch.Tensor) -> torch.Tensor:
        """(2*(j-i),) norms of two buffers per segment, whole (summed over the shards)."""
        reduce = self.pack.norm_reduce
        return partial if reduce is None else reduce(self.i, self.j, partial)

    def scratch(self, n: int) -> torch.Tensor:
        """A buffer of at least ``n`` elements of the arena's dtype, kept for the next step."""
        pack = self.pack
        if pack.scratch is None or pack.scratch.numel() < n:
            pack.scratch = torch.empty(n, dtype=pack.arena.dtype, device=pack.arena.device)
        return pack.scratch[:n]


class Packing:
    """The parameters of an optimizer's groups packed into arenas, one :class:`Pack` per
    (group, device, dtype), and the guard that keeps them there (see the module)."""

    def __init__(self, param_groups: list[dict[str, Any]], shard_multiple: int | None) -> None:
        self.shard_multiple = shard_multiple
        self.packs: list[Pack] = []
        self.hooks: list[Any] = []
        # one byte per parameter (received a gradient since the last step) and one "any"
        self.flags = bytearray(1)
        # [0]: a parameter may have left the arena; [1]: a p.grad may not be the arena's view.
        # Set by the gradient hooks and by the death of a watched gradient view (see sync).
        self.dirty = bytearray(b"\x01\x01")
        dirty = self.dirty

        def gone(_ref: Any) -> None:  # a watched gradient view died: p.grad was reassigned
            dirty[1] = 1

        self._grad_gone = gone
        self.warned_stale = False  # the "no new gradient" warning is shown once
        self.build(param_groups)

    # -- packing ------------------------------------------------------------------------------
    def build(self, param_groups: list[dict[str, Any]]) -> None:
        seen: set[int] = set()
        plan: list[tuple[int, list[torch.Tensor]]] = []
        for gi, group in enumerate(param_groups):
            buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in group["params"]:
                if id(p) in seen:  # tied weights: one slot, updated once
                    continue
                seen.add(id(p))
                if p.is_sparse:
                    raise ValueError("kiln.optim does not support sparse parameters; use contiguous=False")
                if is_dtensor(p):
                    raise TypeError(
                        "kiln.optim: a parameter is a DTensor (FSDP2 fully_shard / tensor parallel): its "
                        "shards cannot be packed into an arena. Build the optimizer with contiguous=False "
                        "(multi-tensor mode), e.g. kiln.optim.AdamW(model.parameters(), contiguous=False)")
                buckets.setdefault((p.device, p.dtype), []).append(p)
            plan.extend((gi, ps) for ps in buckets.values())
        nslots = sum(len(ps) for _, ps in plan)
        self.flags = flags = bytearray(nslots + 1)
        self.all_set = b"\x01" * (nslots + 1)  # flags when every parameter received a gradient
        # every parameter's step count, one slot each: each pack's step_vec is its slice, so
        # that the common step counts all arenas with one add (see step_arenas)
        self.steps = torch.zeros(nslots, dtype=torch.float32)
        self.packs, slot = [], 0
        with torch.no_grad():
            for gi, ps in plan:
                grads = [p.grad for p in ps]
                arena = Arena(ps, self.shard_multiple)
                pack = Pack(arena, gi, ps, slot, self.steps[slot:slot + len(ps)])
                for i, (p, g) in enumerate(zip(ps, grads)):
                    if g is not None:
                        arena.gviews[i].copy_(g)
                        flags[slot + i] = 1
                        flags[-1] = 1  # counts as fresh for the next step
                    self.link_grad(pack, i)
                pack.ptrs[:] = [p.data_ptr() for p in ps]  # in place: the hooks hold the list
                pack.rewatch(self.flags)
                pack.grad_version = arena.grad._version
                self.packs.append(pack)
                slot += len(ps)

    def unpack(self) -> None:
        """Remove the gradient hooks (before packing again: ``relink``)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for pack in self.packs:
            for p in pack.params:
                if getattr(p, "_kiln_hooked", None) is self.flags:
                    del p._kiln_hooked

    def link_grad(self, pack: Pack, i: int, force: bool = False) -> None:
        """Point p.grad at a fresh view of the flat gradient that only p holds, watched by a weak
        reference whose death (p.grad reassigned) marks the gradients dirty; frozen parameters
        without a gradient keep None, as with torch (``force``: link a view anyway)."""
        p = pack.params[i]
        if force or p.requires_grad or p.grad is not None:
            lo, n = pack.arena.segment_range(i)[0], pack.arena.numels[i]
            view = pack.arena.grad[lo:lo + n].view(pack.arena.shapes[i])
            # the new reference first: the old one then dies silently with the old view
            pack.grefs[i] = weakref.ref(view, self._grad_gone)
            p.grad = view
        else:  # frozen without a gradient: leave .grad None, as torch does
            pack.grefs[i] = None
        if p.requires_grad and getattr(p, "_kiln_hooked", None) is not self.flags:
            self.hooks.append(p.register_post_accumulate_grad_hook(
                _flag_hook(self.flags, self.dirty, pack.s0 + i, pack, i)))
            p._kiln_hooked = self.flags  # one hook per parameter per build

    def flat_grads(self) -> list[torch.Tensor]:
        self.sync(check_fresh=False)
        return [pk.arena.grad for pk in self.packs]

    def mark_grads_ready(self) -> None:
        for pk in self.packs:
            for i, p in enumerate(pk.params):
                if p.requires_grad:
                    self.flags[pk.s0 + i] = 1
        self.flags[-1] = 1

    # -- the guard ------------------------------------------------------------------------------
    def sync(self, check_fresh: bool, grads: bool = True) -> None:
        """Make the arena authoritative again (see the module docstring). ``grads=False``:
        parameters only (a sharded step whose full gradient may be freed).

        O(1) in the common case: nothing marked dirty (no watched gradient view died, no
        gradient hook saw a foreign gradient or a moved parameter), the flat parameter's
        storage has the use count it had at the last full check (a parameter moved out of it
        by ``p.data = ...`` drops it by one), and every frozen parameter still has no gradient.
        Otherwise one identity test and one pointer comparison per parameter."""
        dirty, flags = self.dirty, self.flags
        foreign = False
        if dirty[0] or (grads and dirty[1]) or not self._intact(grads):
            dirty[0] = 0  # cleared first: whatever happens during the check marks it again
            if grads:
                dirty[1] = 0
            for pack in self.packs:
                if list(map(_data_ptr, pack.params)) != pack.ptrs:
                    self._relink_params(pack)
                if grads and not pack.grads_intact():
                    foreign |= self._absorb_grads(pack)
                pack.puse = _use_count(pack.pstore._cdata)
        if check_fresh and not foreign and not flags[-1] and not self.warned_stale:
            if all(pk.arena.grad._version == pk.grad_version for pk in self.packs) and any(
                    p.requires_grad for pk in self.packs for p in pk.params):
                self.warned_stale = True
                warnings.warn(
                    "kiln.optim: step() found no new gradient for any of its parameters since the "
                    "previous step; like torch.optim it applies the update again to the gradients the "
                    "parameters hold (none after zero_grad()). If backward() did run, the model's "
                    "parameters were replaced after the optimizer was built (model.load_state_dict(..., "
                    "assign=True), to_empty(), re-created modules), so the optimizer holds the old ones "
                    "and trains nothing: build the optimizer after loading, or load without assign=True "
                    "(it copies into the arena). Shown once per optimizer.", KilnWarning, stacklevel=6)

    def _intact(self, grads: bool) -> bool:
        """The O(1) part of :meth:`sync`: per arena one storage use count (and, where there
        are any, the frozen parameters' and the unwatchable gradients' slots)."""
        for pack in self.packs:
            if _use_count(pack.pstore._cdata) != pack.puse:
                return False
            if grads and pack.frozen and any(pack.params[k].grad is not None for k in pack.frozen):
                return False
        return True

    def _relink_params(self, pack: Pack) -> None:
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

    def _absorb_grads(self, pack: Pack) -> bool:
        foreign = False
        flags = self.flags
        with torch.no_grad():
            for i, p in enumerate(pack.params):
                g, view = p.grad, pack.arena.gviews[i]
                if g is pack.expected_grad(i):
                    continue
                if g is None:  # model.zero_grad() or a user set it to None: no gradient
                    view.zero_()
                    flags[pack.s0 + i] = 0
                else:
                    view.copy_(g)
                    flags[pack.s0 + i] = 1
                    foreign = True
                self.link_grad(pack, i, force=True)
        pack.rewatch(self.flags)
        return foreign

    def zero_grad(self, set_to_none: bool, shards: Iterable[Pack] = ()) -> None:
        """One memset per arena (and per shard gradient of its own). With set_to_none=True the
        gradient views stay in place (reading as zeros) but every parameter counts as having
        no gradient until autograd delivers one, so parameters outside the next backward are
        not updated. Outside ``torch.no_grad``, which costs a small model's step as much host
        time as the memsets: no flat gradient requires grad. Views are relinked inside it."""
        check = self.dirty[1]  # O(1) unless a gradient may have been reassigned
        for pack in self.packs:
            # a gradient assigned by hand since the last step would otherwise be accumulated into
            if (check or pack.frozen) and not pack.grads_intact():
                with torch.no_grad():
                    for i, p in enumerate(pack.params):
                        e = pack.expected_grad(i)
                        if p.grad is not e:
                            if e is _DEAD:
                                self.link_grad(pack, i, force=True)
                            else:
                                p.grad = e
                pack.rewatch(self.flags)
            if set_to_none and pack.hookless:
                # as torch: None, so that autograd's next gradient (the parameter unfrozen) is
                # a fresh tensor the check sees, not an unseen accumulation into the view
                for i in pack.hookless:
                    pack.grefs[i] = None
                    pack.params[i].grad = None
                pack.rewatch(self.flags)
            pack.arena.grad.zero_()
            pack.grad_version = pack.arena.grad._version
        self.dirty[1] = 0
        for sp in shards:
            sp.arena.grad.zero_()
        if set_to_none:
            self.flags[:] = bytes(len(self.flags))

    # -- a freed flat gradient (ZeRO-2 between steps) -------------------------------------------
    @torch.no_grad()
    def park_grads(self) -> None:
        """Free every flat gradient's memory (storage resized to 0) with ``p.grad`` None; the
        views are kept, so that :meth:`unpark_grads` puts the same ones back and the guard sees
        nothing to absorb."""
        for pack in self.packs:
            if pack.parked is None:
                pack.parked = [p.grad for p in pack.params]
                for p in pack.params:
                    p.grad = None
            pack.arena.grad.untyped_storage().resize_(0)

    @torch.no_grad()
    def unpark_grads(self, nbytes: list[int], before_touch: Callable[[torch.Tensor], None] | None = None) -> None:
        """The flat gradients back, ``nbytes`` each, as zeros, and every ``p.grad`` its view
        again (``before_touch(flat)`` runs before the first write: a page-size hint)."""
        for pack, size in zip(self.packs, nbytes):
            grad = pack.arena.grad
            grad.untyped_storage().resize_(size)
            if before_touch is not None:
                before_touch(grad)
            grad.zero_()
            if pack.parked is not None:
                for p, view in zip(pack.params, pack.parked):
                    p.grad = view
                pack.parked = None
