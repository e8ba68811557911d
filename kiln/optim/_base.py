"""kiln's optimizers as torch.optim sees them: a thin facade for parameter groups, the state
dict and the step, over the pieces that do the work:

- :mod:`kiln.optim._packing`: the parameters packed into arenas, and the guard that keeps the
  arenas true between steps (gradients placed elsewhere, parameters moved, no new gradient);
- :mod:`kiln.optim._stepping`: which ranges of the arenas a step updates, and the state
  exposed per parameter as torch keys it;
- :mod:`kiln.optim._shard`: the rank's slice of each arena that a sharded optimizer steps;
- :mod:`kiln.optim._lists`: the optimizers without an arena (``contiguous=False``, DTensors);
- :mod:`kiln.optim._chain`: the update rules, chains of shared transforms, run over a range of
  an arena by :mod:`kiln.optim._flat` and over per-parameter lists by ``_lists``.

A subclass declares its hyperparameters and its :attr:`~ArenaOptimizer.chain`; where torch has
a fused kernel for the same math (SGD, Adam(W)) it declares ``_torch_fused`` and
``_update_torch`` (torch's own implementation, for capturable/differentiable groups), and where
kiln's native CPU kernels fuse the chain (LAMB, LARS) ``_native_flat``. The flat, list and
torch paths derive from these.

The :class:`~kiln.optim.KilnOptimizer` protocol lists what other packages may ask of one.
Complex parameters are updated as pairs of reals (``torch.view_as_real``), as torch.optim
does. ``step()`` skips torch's ``profile_hook_step`` wrapper (a ``record_function`` and two
hook chains on every call) unless a profiler is running or a step hook is registered, in
which case it takes exactly torch's path.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, ClassVar, Iterable, Mapping

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from kiln.optim import _flat, _lists, _stepping
from kiln.optim._access import ArenaAccess
from kiln.optim._arena import ArenaSlice
from kiln.optim._chain import Chain
from kiln.optim._kernels import compiling, norm_dtype
from kiln.optim._norms import tensor_norms
from kiln.optim._packing import FlatRange, Packing
from kiln.optim._shard import Sharding, SumOver, check_pieces


def _by_torch(group: dict[str, Any]) -> bool:
    """The group asks for what only torch's own implementation does (see ArenaOptimizer)."""
    return bool(group.get("capturable") or group.get("differentiable"))


def torch_method(name: str) -> Callable[..., Any]:
    """``torch.optim.Optimizer``'s method ``name``, for a subclass to call in place of
    ``super()``. torch wraps ``add_param_group``, ``zero_grad``, ``state_dict`` and
    ``load_state_dict`` in ``torch._disable_dynamo``, whose first call imports torch's compiler
    (``torch._dynamo``), seconds of every process that builds an optimizer and checkpoints
    (docs/lab/facts.md, 'What an import costs'). Where
    dynamo is not loaded nothing can be tracing, so the function underneath is called; once it
    is loaded, torch's wrapped method, as ``super()`` would."""
    method = getattr(Optimizer, name)
    return method if "torch._dynamo" in sys.modules else getattr(method, "__wrapped__", method)


def _hooked_step(opt: "ArenaOptimizer", closure: Callable[[], Any] | None) -> Any:
    return Optimizer.profile_hook_step(type(opt)._step)(opt, closure)


class ArenaOptimizer(ArenaAccess, Optimizer):
    """Base class: packs parameters into arenas and keeps torch.optim's public behaviour.

    Groups that ask for ``capturable=True`` (CUDA graphs) or ``differentiable=True`` (autograd
    through the step) are stepped by torch's own functional implementation (``_update_torch``)
    over the parameters as they are, and the optimizer then keeps no arena (``contiguous`` is
    set to False): an arena's host-side step counts and re-pointed storage would defeat both.
    """

    _has_step_state = True  # torch keeps state[p]['step']; False: state made at the first step (SGD)
    _per_tensor_norms = False  # the update needs per-tensor norms (LAMB, LARS): see shard()
    _supports_complex = True  # complex parameters stepped as pairs of reals, as torch.optim does
    _force_rule = False  # (tests) the chain where torch's fused kernel would run
    # Its name in a config's optim.name, and the optim.* keys it takes (kiln.train builds it
    # with lr, those keys and the parameter groups; a key it does not take is refused).
    config_name: ClassVar[str]
    config_options: ClassVar[tuple[str, ...]] = ()
    chain: ClassVar[Chain]  # the update rule (kiln.optim._chain), declared by each subclass
    compile: bool | None = False  # the chain's kernels compiled (None: unless KILN_OPTIM_EAGER is set)
    # torch's fused kernel for the chain's math, over flat buffers or per-parameter lists alike:
    # (group, params, grads, {state name: tensors}, step counts or None, first=) -> None
    _torch_fused: ClassVar[Callable[..., None] | None] = None

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], *, contiguous: bool = True,
                 shard_multiple: int | None = None) -> None:
        self.contiguous = contiguous
        self.shard_multiple = shard_multiple
        self.packing: Packing | None = None
        self.sharding: Sharding | None = None
        # over DTensor shards: local per-tensor norms -> whole ones (set by _lists per bucket)
        self.complete_norms: Callable[[torch.Tensor], torch.Tensor] | None = None
        super().__init__(params, defaults)
        if contiguous and any(map(_by_torch, self.param_groups)):
            self.contiguous = False  # torch's own implementation, no arena (see the class docstring)
        if self.contiguous:
            self.packing = Packing(self.param_groups, shard_multiple)

    # -- the update rule ----------------------------------------------------------------------
    @classmethod
    def chain_for(cls, group: Mapping[str, Any]) -> Chain:
        """The chain that steps a group with these hyperparameters."""
        return cls.chain

    @classmethod
    def state_names(cls, group: Mapping[str, Any]) -> tuple[str, ...]:
        """The parameter-sized state tensors a group with these hyperparameters keeps."""
        return cls.chain_for(group).state_names(group)

    @classmethod
    def state_names_for(cls, **options: Any) -> tuple[str, ...]:
        """:meth:`state_names` of a group built with these keyword arguments (the constructor's
        defaults for the rest, and for any given as None), without building anything."""
        group = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
                 if p.default is not inspect.Parameter.empty}
        group.update((k, v) for k, v in options.items() if v is not None)
        return cls.state_names(group)

    def _fused_ok(self, device: torch.device, dtype: torch.dtype) -> bool:
        """torch's fused kernel serves this device and dtype (complex: on the real view)."""
        return (self._torch_fused is not None and device.type in ("cpu", "cuda")
                and (dtype.is_floating_point or dtype.is_complex) and not self._force_rule)

    def _native_flat(self, rng: FlatRange, group: dict[str, Any], step: int) -> bool:
        """Step ``rng`` with kiln's native CPU kernels if they serve it (False: they do not)."""
        return False

    def _update_flat(self, rng: FlatRange, group: dict[str, Any], step: int) -> None:
        """Update the segments of ``rng`` (all received, all at step number ``step``)."""
        if self._fused_ok(rng.arena.device, rng.arena.dtype):
            names = self.state_names(group)
            p, g, *bufs = rng.args(*names)
            self._torch_fused(group, [p], [g], {n: [b] for n, b in zip(names, bufs)},
                              [rng.step_tensor(step)] if self._has_step_state else None, first=step == 1)
        elif not (compiling(self.compile) and self._native_flat(rng, group, step)):
            _flat.update(self.chain_for(group), rng, group, step, self.compile)

    def _update_torch(self, group: dict[str, Any], ps: list[torch.Tensor]) -> None:
        """torch.optim's own functional update of ps, for capturable/differentiable groups."""
        raise NotImplementedError

    def _list_key(self, p: torch.Tensor, st: dict[str, Any]) -> Any:
        """What the tensors of one multi-tensor update must share besides device and dtype: the
        step count (one bias correction for the whole list), none where torch's fused kernel
        takes one per tensor, or whether they stepped before (SGD: its first step differs)."""
        if not self._has_step_state:
            return int(bool(st))
        return None if self._fused_ok(p.device, p.dtype) else int(st["step"])

    def _init_list_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        if not self._has_step_state:
            return {}  # not stored: torch keeps no entry before the first step
        return _lists.init_list_state(self.state, p, group, self.state_names(group))

    def _tensor_norms(self, ts: list[torch.Tensor]) -> torch.Tensor:
        """(S,) L2 norm of each tensor of ts (a tensor's local shard: of the whole tensor)."""
        norms = tensor_norms(ts, 2, dtype=norm_dtype(ts[0].dtype)) if ts else torch.zeros(0)
        return norms if self.complete_norms is None else self.complete_norms(norms)

    # -- packing --------------------------------------------------------------------------------
    def relink(self) -> None:
        """Rebuild the arenas from the parameters as they are now (after ``model.half()``,
        ``model.to(device)``, ``add_param_group``), keeping the optimizer state (cast to the
        parameters' new dtype and device)."""
        if not self.contiguous:
            return
        if self.sharding is not None:
            raise RuntimeError(
                "kiln.optim: a sharded optimizer cannot be relinked (its shards are cut from the "
                "arenas): build the optimizer (and ZeroOptimizer) again after moving or casting the model")
        sd = self.state_dict() if self.packing.packs else None
        self.packing.unpack()
        self.state.clear()
        self.packing.build(self.param_groups)
        if sd is not None:
            self.load_state_dict(sd)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.sharding is not None:
            raise RuntimeError("kiln.optim: add_param_group() after shard(): add the group before sharding")
        torch_method("add_param_group")(self, param_group)
        group = self.param_groups[-1]
        if not self._supports_complex and any(torch.is_complex(p) for p in group["params"]):
            self.param_groups.pop()
            raise ValueError(_lists.no_complex(type(self).__name__))
        if getattr(self, "packing", None) is not None:  # (None while torch's __init__ adds the groups)
            if _by_torch(group):
                self.param_groups.pop()
                raise ValueError(
                    "kiln.optim: a parameter group with capturable=True or differentiable=True runs "
                    "torch's own per-parameter implementation, which an arena cannot serve: build the "
                    "optimizer with contiguous=False (or with the flag set for all groups).")
            self.relink()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """One memset per arena. With set_to_none=True (default) the gradient views stay in
        place (reading as zeros) but every parameter counts as having no gradient until
        autograd delivers one, so parameters outside the next backward are not updated.
        (No ``torch.no_grad`` here: the flat gradients never require grad, and entering it
        costs a small model's step as much host time as the memsets; see Packing.zero_grad.)"""
        if not self.contiguous:
            return torch_method("zero_grad")(self, set_to_none)
        own = self.sharding.packs if self.sharding is not None and not self.sharding.keep_full_grad else ()
        self.packing.zero_grad(set_to_none, own)

    # -- the step ----------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        # torch.optim wraps every Optimizer subclass's step in profile_hook_step (a
        # record_function and two hook chains, which cost host time every step:
        # docs/lab/facts.md, 'Host time'); this step has the attribute that stops the wrapping
        # and takes torch's wrapped path only when a profiler runs or a step hook is registered,
        # so hooks and profiles behave exactly as with torch.optim.
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
                _lists.step_lists(self)
            elif self.sharding is not None:
                _stepping.step_shards(self)
            else:
                _stepping.step_arenas(self)
        finally:
            torch._C._set_grad_enabled(prev)
        return loss

    # -- state dict -----------------------------------------------------------------------------
    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """torch.optim's layout (state[index] = {'step': ..., 'exp_avg': ...}); tensors are
        copies (``copy=False``: views of the arena's state until the next step, what a checkpoint
        writes from). Sharded: each state tensor is this rank's piece of it, flat, and
        ``"pieces"`` holds :meth:`shard_pieces` (``kiln.parallel.ZeroOptimizer`` gathers a full one)."""
        sd = torch_method("state_dict")(self)
        if copy:
            sd["state"] = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                           for k, s in sd["state"].items()}
        if self.sharding is not None:
            sd["pieces"] = self.shard_pieces()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's ``load_state_dict``, into the arena's state. Sharded: a dict from
        :meth:`state_dict` of the same sharding (it has ``"pieces"``), or a full torch-layout
        one (kiln's or torch.optim's), of which each rank takes its pieces."""
        pieces = state_dict.get("pieces")
        check_pieces(pieces, self.shard_pieces() if self.sharding is not None else None, state_dict["state"])
        groups, state = self.param_groups, self.state
        torch_method("load_state_dict")(self, state_dict)
        # torch replaces the group dicts and the state: keep the objects that a ZeroOptimizer
        # (or anything else holding them) shares
        for g, new in zip(groups, self.param_groups):
            g.clear()
            g.update(new)
        state.clear()
        state.update(self.state)
        self.param_groups, self.state = groups, state
        if self.contiguous:
            _stepping.load_state(self, pieces is not None)

    # -- sharding (ZeRO-1/2) ----------------------------------------------------------------------
    def shard(self, rank: int, world: int, sum_over: SumOver | None = None, *,
              keep_full_grad: bool = True) -> list[ArenaSlice]:
        """From now on step only this rank's contiguous shard, ``arena.shard(rank, world)`` of
        every arena, with optimizer state for the shard only; returns the shards (:attr:`shards`).

        What :meth:`step` reads is each shard's ``grad``: with ``keep_full_grad`` a view of
        the full flat gradient (fill it in place, e.g. a reduce-scatter), else a buffer of its
        own, so that the full gradient can be freed between steps (ZeRO-2). Every trainable
        parameter (``requires_grad``) steps on every step, as under DDP (no rank knows which
        parameters the others' backward reached); frozen ones never do. Runs of parameters
        with differing step counts are cut as over the whole arena, the same on every rank.

        ``sum_over(t)``: sums a tensor in place over the ranks that hold the other shards
        (``sum_over(t, "max")``: their maximum). LAMB's and LARS's per-tensor norms are summed
        with it (once per run, which a rank whose shard the run does not reach joins too), and
        :meth:`grad_parts` hands it to the clip. kiln.optim never communicates:
        :class:`kiln.parallel.ZeroOptimizer` shards over a process group and supplies it.

        Afterwards ``state[p]`` and :meth:`state_dict` hold this rank's piece of each state
        tensor, :meth:`shard_pieces` says where each piece lies in its parameter, and
        :meth:`load_state_dict` takes a sharded or a full dict. State held before sharding is
        cut to the shard.

        >>> model = torch.nn.Linear(30, 2)
        >>> opt = kiln.optim.AdamW(model.parameters(), shard_multiple=2)
        >>> [(s.lo, s.hi) for s in opt.shard(1, 2)]    # weight [0, 64), bias [64, 80), N = 96
        [(48, 96)]
        >>> opt.shard_pieces()                          # weight elements 48..59, all of bias
        {0: (48, 60), 1: (0, 2)}
        """
        if not self.contiguous:
            raise TypeError("kiln.optim: shard() needs the arena (contiguous=True)")
        if self.sharding is not None:
            raise RuntimeError("kiln.optim: the optimizer is already sharded")
        sd = self.state_dict() if any(pk.n_init for pk in self.packing.packs) else None
        self.sharding = Sharding(self.packing, rank, world, sum_over, keep_full_grad, self._per_tensor_norms)
        self.state.clear()
        if sd is not None:
            self.load_state_dict(sd)
        return self.shards
