"""What other packages may ask of a kiln optimizer, written once: the :class:`KilnOptimizer`
protocol (precision, clipping, memory accounting, checkpoints, benchmarks), the
:class:`ShardableOptimizer` protocol (what ZeRO asks of the optimizer it shards), and the one
table of the features that need the arena, which the config check and the runtime both read.

    >>> import torch, kiln.optim
    >>> opt = kiln.optim.AdamW(torch.nn.Linear(4, 2).parameters(), contiguous=False)
    >>> isinstance(opt, kiln.optim.KilnOptimizer), has_arena(opt)
    (True, False)
    >>> print(arena_missing("bf16-true", *no_arena_setting(opt)))
    train.precision=bf16-true keeps its fp32 master weights in kiln's arena, which optim.contiguous=false leaves out (kiln's optimizers then step per-parameter lists): set optim.contiguous=true, or use train.precision=bf16-mixed
"""

from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple, Protocol, runtime_checkable

import torch

from kiln.optim._arena import Arena, ArenaSlice

__all__ = ["ARENA_FEATURES", "NO_ARENA", "ArenaNeed", "KilnOptimizer", "NoArena", "ShardableOptimizer",
           "arena_conflicts", "arena_missing", "has_arena", "is_dtensor", "local_tensor", "no_arena_setting"]

GradPart = tuple[list[torch.Tensor], tuple[Callable[[torch.Tensor, str], Any], ...]]


class _CheckedOncePerClass(type(Protocol)):  # type: ignore[misc]
    """``isinstance`` against a protocol, decided once per class of the instance. Python's own
    check of a protocol with data members looks up every member of the instance on every call
    (0.2-0.3 ms for these, on Python 3.11), and the step asks it (the clip, the loss scaler's
    unscale); every instance of a class has the same members, so the answer is the class's."""

    _answers: dict[tuple[type, type], bool] = {}

    def __instancecheck__(cls, instance: Any) -> bool:
        key = (cls, type(instance))
        answer = _CheckedOncePerClass._answers.get(key)
        if answer is None:
            answer = _CheckedOncePerClass._answers[key] = super().__instancecheck__(instance)
        return answer


@runtime_checkable
class KilnOptimizer(Protocol, metaclass=_CheckedOncePerClass):
    """A kiln optimizer (:class:`~kiln.optim.ArenaOptimizer`), or a wrapper that steps one
    (``kiln.parallel.ZeroOptimizer``), as code outside kiln.optim may use it: torch.optim's
    interface plus the members below. Every tensor handed out is a plain local tensor.

    Without an arena (``contiguous`` False: ``contiguous=False``, DTensor parameters) the
    gradient and state members hand out the parameters' own tensors and :attr:`arenas`,
    :attr:`shards` and :meth:`packed_params` are empty."""

    param_groups: list[dict[str, Any]]
    state: Any
    contiguous: bool  # the parameters live in arenas (see ARENA_FEATURES for what needs them)

    def step(self, closure: Callable[[], Any] | None = None) -> Any: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """torch.optim's layout; ``copy=False``: views of the state, valid until the next step
        (what a checkpoint writes from); sharded: this rank's pieces, and ``"pieces"``."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    @property
    def arenas(self) -> list[Arena]:
        """The arenas, one per (parameter group, device, dtype)."""

    @property
    def shards(self) -> list[ArenaSlice]:
        """This rank's slice of each arena (ZeRO-1/2), or empty."""

    def packed_params(self) -> list[tuple[Arena, list[torch.Tensor]]]:
        """``(arena, its parameters in segment order)`` per arena (bf16-true's masters mirror them)."""

    def shard_pieces(self) -> dict[int, tuple[int, int]]:
        """``{state-dict index: (start, stop)}`` of the flattened parameter this rank's shards
        hold; empty when not sharded."""

    def flat_grads(self) -> list[torch.Tensor]:
        """The gradients the step reads, one tensor per flat buffer (or per parameter): a check
        or a scaling over all of them is one operation each (loss scaling, the non-finite check)."""

    def grad_parts(self) -> list[GradPart]:
        """The gradients as :func:`kiln.optim.clip_grad_norm_` combines them over ranks."""

    def grad_buffers(self) -> list[torch.Tensor]:
        """Every buffer that holds gradients (memory accounting)."""

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of optimizer state and scratch this rank holds (memory accounting)."""

    def state_bytes(self) -> int:
        """Bytes of optimizer state (and scratch) this rank holds."""

    def mark_grads_ready(self) -> None:
        """Count every trainable parameter as having a gradient (gradients written by hand)."""

    def materialize_grads(self) -> None:
        """Make the full gradients writable before writing them by hand (ZeRO-2 frees them)."""

    def wait_parameters(self) -> None:
        """Wait until every parameter holds this step's value (before reading them otherwise)."""


@runtime_checkable
class ShardableOptimizer(KilnOptimizer, Protocol):
    """What ``kiln.parallel``'s ZeRO and its gradient reducer ask of the optimizer they wrap:
    a kiln optimizer on its arena (:func:`has_arena`) that steps one slice of it."""

    def shard(self, rank: int, world: int, sum_over: Callable[..., Any] | None = None, *,
              keep_full_grad: bool = True) -> list[ArenaSlice]:
        """Step only this rank's slice of every arena from now on; ``sum_over`` sums a tensor
        over the other slices' ranks (per-tensor norms, the clip)."""

    def union_received(self, all_reduce_max: Callable[[torch.Tensor], Any]) -> None:
        """Agree with the other replicas on which parameters received a gradient this step."""

    def park_grads(self) -> None:
        """Free every flat gradient's memory between steps (ZeRO-2)."""

    def unpark_grads(self, nbytes: list[int], before_touch: Callable[[torch.Tensor], None] | None = None) -> None:
        """The flat gradients back as zeros, ``nbytes`` each."""


def is_dtensor(t: Any) -> bool:
    # no DTensor exists before torch.distributed.tensor is imported (a second of imports, with
    # sympy, that a run without tensor parallelism or FSDP2 never needs)
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (``to_local()``: in place work on it reaches the DTensor), else
    ``t``: the plain tensor a :class:`KilnOptimizer` hands out, for a parameter or gradient
    that did not come from one."""
    return t.to_local() if is_dtensor(t) else t


def has_arena(optimizer: Any) -> bool:
    """``optimizer`` is a kiln optimizer whose parameters live in arenas."""
    return isinstance(optimizer, KilnOptimizer) and bool(optimizer.contiguous)


# -- the features that need the arena ----------------------------------------------------------------

def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


class ArenaNeed(NamedTuple):
    """A feature that works on kiln's arena, asked for by ``key=value`` in a config."""

    key: str
    value: Any
    uses: str  # what the feature does with the arena
    instead: str  # the other way to what the user wants, where there is no arena
    required: bool  # False: where there is no arena the feature is left out, with no error

    @property
    def setting(self) -> str:
        return f"{self.key}={_text(self.value)}"


class NoArena(NamedTuple):
    """A config key whose values in ``leaves_out`` leave every optimizer without an arena."""

    key: str
    leaves_out: Callable[[Any], bool]
    why: str
    undo: str


ARENA_FEATURES: dict[str, ArenaNeed] = {
    "bf16-true": ArenaNeed("train.precision", "bf16-true", "keeps its fp32 master weights in kiln's arena",
                           "use train.precision=bf16-mixed", True),
    "zero-1": ArenaNeed("parallel.zero", 1, "shards kiln's arena (each rank keeps the optimizer state of one slice)",
                        "use parallel.zero=3 (FSDP2) or parallel.zero=0", True),
    "zero-2": ArenaNeed("parallel.zero", 2,
                        "shards kiln's arena (each rank keeps the optimizer state and gradient of one slice)",
                        "use parallel.zero=3 (FSDP2) or parallel.zero=0", True),
    "overlap_grad_reduce": ArenaNeed(
        "parallel.overlap_grad_reduce", True,
        "reduces the gradient during the backward in buckets, slices of the arena's flat gradient",
        "the gradients are reduced after the backward", False),
}
"""Feature -> what it needs of the arena and what to do instead; :data:`NO_ARENA` lists the
settings that leave the arena out."""

NO_ARENA: tuple[NoArena, ...] = (
    NoArena("optim.impl", lambda v: v != "kiln", "torch.optim's classes keep no arena", "set optim.impl=kiln"),
    NoArena("optim.contiguous", lambda v: not v, "kiln's optimizers then step per-parameter lists",
            "set optim.contiguous=true"),
    NoArena("parallel.zero", lambda v: v == 3, "FSDP2 holds each parameter as a DTensor shard of its own",
            "use parallel.zero=1 or 2"),
    NoArena("parallel.tp", lambda v: (v or 1) > 1,
            "tensor-parallel parameters are DTensors, which a flat buffer cannot hold", "use parallel.tp=1"),
)


def arena_missing(feature: str, key: str, value: Any) -> str:
    """The one-line reason ``feature`` (a key of :data:`ARENA_FEATURES`) cannot run where
    ``key=value`` (a setting of :data:`NO_ARENA`) leaves the arena out, naming both fixes."""
    need = ARENA_FEATURES[feature]
    (no,) = [no for no in NO_ARENA if no.key == key]
    return f"{need.setting} {need.uses}, which {key}={_text(value)} leaves out ({no.why}): {no.undo}, or {need.instead}"


def arena_conflicts(settings: dict[str, Any]) -> list[str]:
    """What is wrong with a config's ``settings`` (``{"train.precision": "bf16-true", ...}``, the
    keys of both tables; absent keys count as not set): the :func:`arena_missing` reason of each
    required feature asked for where a setting leaves the arena out.

    >>> arena_conflicts({"parallel.zero": 2, "optim.impl": "torch-fused", "train.precision": "bf16-mixed"})
    ["parallel.zero=2 shards kiln's arena (each rank keeps the optimizer state and gradient of one slice), which optim.impl=torch-fused leaves out (torch.optim's classes keep no arena): set optim.impl=kiln, or use parallel.zero=3 (FSDP2) or parallel.zero=0"]
    """
    return [arena_missing(name, no.key, settings[no.key])
            for name, need in ARENA_FEATURES.items() if need.required and settings.get(need.key) == need.value
            for no in NO_ARENA if no.key in settings and no.leaves_out(settings[no.key])]


def no_arena_setting(optimizer: Any) -> tuple[str, Any] | None:
    """The setting that leaves ``optimizer`` without an arena, as ``(key, value)`` for
    :func:`arena_missing` (a runtime check that knows no config), or None: it has one."""
    if not isinstance(optimizer, KilnOptimizer):
        return ("optim.impl", f"torch ({type(optimizer).__name__})")
    return None if optimizer.contiguous else ("optim.contiguous", False)
