"""What a kiln optimizer hands to other packages: its arenas, the buffers that hold its
gradients and its state, and the gradients' freeing and return (ZeRO-2). These are the
members of the :class:`~kiln.optim.KilnOptimizer` protocol that read the packing and the
sharding; :class:`~kiln.optim.ArenaOptimizer` takes them from :class:`ArenaAccess`.

Every tensor handed out is a plain local tensor: the flat buffers, or, without an arena, each
parameter's gradient or state tensor (a DTensor's local shard, ``to_local()``: in-place work on
it reaches the DTensor).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kiln.optim._arena import Arena, ArenaSlice
from kiln.optim._clip import param_grad_parts
from kiln.optim._contract import local_tensor
from kiln.optim._packing import Packing
from kiln.optim._shard import Sharding

__all__ = ["ArenaAccess"]


class ArenaAccess:
    """The arena's buffers as other packages see them (a mixin of ArenaOptimizer, over its
    ``packing`` and ``sharding``)."""

    contiguous: bool
    packing: Packing | None
    sharding: Sharding | None
    param_groups: list[dict[str, Any]]
    state: Any

    def _grads(self) -> list[torch.Tensor]:
        return [local_tensor(p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None]

    @property
    def arenas(self) -> list[Arena]:
        """The arenas, one per (parameter group, device, dtype), in parameter-group order."""
        return [pk.arena for pk in self.packing.packs] if self.packing else []

    @property
    def shards(self) -> list[ArenaSlice]:
        """This rank's shard of each arena, in :attr:`arenas` order (empty: not sharded)."""
        return self.sharding.slices if self.sharding is not None else []

    def packed_params(self) -> list[tuple[Arena, list[torch.Tensor]]]:
        """``(arena, its parameters in segment order)`` for each arena."""
        return [(pk.arena, list(pk.params)) for pk in self.packing.packs] if self.packing else []

    def shard_pieces(self) -> dict[int, tuple[int, int]]:
        """Where this rank's shards hold each parameter: ``{index: (start, stop)}``, elements
        [start, stop) of the flattened parameter, keyed by its index in ``state_dict()``
        (torch's numbering). Parameters this rank holds no element of are absent; not sharded:
        empty."""
        return self.sharding.pieces(self.param_groups, self.packing) if self.sharding is not None else {}

    # -- gradients ------------------------------------------------------------------------------------
    def flat_grads(self) -> list[torch.Tensor]:
        """The tensors holding all gradients: one flat buffer per arena (after absorbing any
        gradient placed outside it), or every ``p.grad`` with ``contiguous=False``. A check or
        a scaling over all gradients is then one operation per buffer."""
        return self.packing.flat_grads() if self.contiguous else self._grads()

    def grad_parts(self) -> list[tuple[list[torch.Tensor], tuple[Any, ...]]]:
        """``[(tensors, reducers)]``: the tensors that hold this optimizer's gradients on this
        rank and how their norms combine with other ranks' into the whole gradient's (see
        :func:`kiln.optim.clip_grad_norm_`): the flat buffers, or each parameter's (local)
        grad; once sharded, the shards' gradients (what ``step()`` reads)."""
        if self.sharding is not None:
            return self.sharding.grad_parts()
        if not self.contiguous:
            return param_grad_parts(p for g in self.param_groups for p in g["params"])
        return [(self.flat_grads(), ())]

    def grad_buffers(self) -> list[torch.Tensor]:
        """Every buffer that holds gradients: each arena's flat gradient and each shard's
        (its own buffer under ZeRO-2, else a view of the arena's), or every ``p.grad``. What
        memory accounting counts as gradients (one storage may appear twice)."""
        if not self.contiguous:
            return self._grads()
        return [pk.arena.grad for pk in [*self.packing.packs, *(self.sharding.packs if self.sharding else [])]]

    def mark_grads_ready(self) -> None:
        """Count every trainable parameter as having received a gradient this step. For code
        that writes the flat gradient itself instead of through autograd (the fp32 master
        weights of ``bf16-true`` training, a reduce-scatter into a ZeRO shard)."""
        self.packing.mark_grads_ready()

    def union_received(self, all_reduce_max: Callable[[torch.Tensor], Any]) -> None:
        """Agree with other replicas on which parameters received a gradient this step, so that
        they all step the same ones: ``all_reduce_max`` gets the flags as a uint8 tensor (one
        byte per parameter and one "any" byte, sharing memory with the optimizer's) and must
        take their maximum over the replicas in place (``dist.all_reduce(t, op=MAX)``)."""
        all_reduce_max(torch.frombuffer(self.packing.flags, dtype=torch.uint8))

    def park_grads(self) -> None:
        """Free the memory of every flat gradient (``p.grad`` None) until :meth:`unpark_grads`:
        ZeRO-2 between steps, where the rank's shard holds what the step reads."""
        self.packing.park_grads()

    def unpark_grads(self, nbytes: list[int], before_touch: Callable[[torch.Tensor], None] | None = None) -> None:
        """The flat gradients back, ``nbytes`` each (their sizes before :meth:`park_grads`), as
        zeros with every ``p.grad`` its view again; ``before_touch(flat)`` runs before the
        first write (a page-size hint)."""
        self.packing.unpark_grads(nbytes, before_touch)

    def materialize_grads(self) -> None:
        """Make the full gradients writable before writing them by hand. Nothing to do here: the
        gradients are always there (a ZeRO-2 wrapper brings back the ones it freed)."""

    def wait_parameters(self) -> None:
        """Wait until every parameter holds this step's value. Nothing to wait for here (a ZeRO
        wrapper that gathers parameters during the next forward waits for them)."""

    # -- state ----------------------------------------------------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of optimizer state this rank holds: each arena's flat state buffers
        (once sharded, the shards') and the update's scratch buffers; or, without an arena,
        each state tensor (a DTensor's local shard)."""
        if not self.contiguous:
            return [local_tensor(v) for st in self.state.values() for v in st.values() if torch.is_tensor(v)]
        packs = self.packing.packs + (self.sharding.packs if self.sharding is not None else [])
        return [b for pk in packs for b in [*pk.state.values(), *([pk.scratch] if pk.scratch is not None else [])]]

    def state_bytes(self) -> int:
        """Bytes of optimizer state (and scratch buffers) this optimizer holds on this rank:
        once sharded, its shards only; of a DTensor's state, its local shard."""
        if not self.contiguous:
            return sum(t.nbytes for t in self.state_tensors())
        return sum(t.untyped_storage().nbytes() for t in self.state_tensors())
