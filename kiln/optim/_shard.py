"""An optimizer that steps only a slice of each arena (ZeRO-1/2's shard), as a view.

What the slice is, and how values computed on it are combined with the other ranks', are
the business of whoever shards (:class:`kiln.parallel.ZeroOptimizer`): this module only
steps the rank's :class:`~kiln.optim.ArenaSlice` of every arena with optimizer state for the
slice alone, and asks the given ``sum_over`` to complete per-tensor norms (LAMB, LARS) that
the slice holds only part of. kiln.optim never communicates.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kiln.optim._arena import ArenaSlice
from kiln.optim._kernels import norm_dtype
from kiln.optim._packing import Pack, Packing

__all__ = ["Sharding", "check_pieces"]

SumOver = Callable[..., Any]  # sum_over(t): sum t in place over the shards (t, "max" for a maximum)


def _norm_completer(nseg: int, sl: ArenaSlice, sum_over: SumOver) -> Callable[[int, int, torch.Tensor], torch.Tensor]:
    """(i, j, partial norms of pieces i..j-1 of sl: w norms then update norms) -> full norms:
    squared, scattered into a (2*S,) vector over the arena's S segments, summed over the shards."""
    ids = torch.tensor(sl.seg_ids, dtype=torch.int64, device=sl.device)
    dtype = norm_dtype(sl.dtype)

    def complete(i: int, j: int, norms: torch.Tensor) -> torch.Tensor:
        sq = torch.zeros(2 * nseg, dtype=dtype, device=sl.device)
        n = j - i
        if n:
            sq[ids[i:j]] = norms[:n].to(dtype).square()
            sq[ids[i:j] + nseg] = norms[n:].to(dtype).square()
        sum_over(sq)
        return sq[torch.cat([ids[i:j], ids[i:j] + nseg])].sqrt()

    return complete


class Sharding:
    """This rank's slice of every arena of a :class:`Packing`, one shard :class:`Pack` each
    (which holds the state and is stepped), built by ``ArenaOptimizer.shard``."""

    def __init__(self, packing: Packing, rank: int, world: int, sum_over: SumOver | None, keep_full_grad: bool,
                 per_tensor_norms: bool) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        if sum_over is not None and not callable(sum_over):
            raise TypeError(
                "kiln.optim: shard()'s sum_over is a function that sums a tensor in place over the shards "
                f"(got {type(sum_over).__name__}); kiln.parallel.ZeroOptimizer shards over a process group")
        if per_tensor_norms and world > 1 and sum_over is None:
            raise ValueError("kiln.optim: this optimizer's per-tensor norms span the shards: shard() needs "
                             "sum_over, a function that sums a tensor in place over them")
        for pk in packing.packs:
            if pk.arena.numel % world:
                raise ValueError(
                    f"an arena of {pk.arena.numel} elements does not divide into {world} shards: build the "
                    f"optimizer with shard_multiple={world} (the default once the process group is initialised)")
        self.rank, self.world, self.sum_over, self.keep_full_grad = rank, world, sum_over, keep_full_grad
        self.packs: list[Pack] = []
        for pk in packing.packs:
            lo, hi = pk.arena.shard(rank, world)
            grad = None if keep_full_grad else torch.zeros(hi - lo, dtype=pk.arena.dtype, device=pk.arena.device)
            sl = ArenaSlice(pk.arena, lo, hi, grad)
            sp = Pack(sl, pk.group, [pk.params[k] for k in sl.seg_ids], pk.s0)
            sp.trainable = bytes(int(p.requires_grad) for p in pk.params)
            if per_tensor_norms and world > 1:
                sp.norm_reduce = _norm_completer(len(pk.params), sl, sum_over)
            pk.shard = sp
            pk.state, pk.sviews, pk.scratch = {}, {}, None  # no full-size state
            pk.init, pk.n_init = [False] * len(pk.params), 0
            self.packs.append(sp)

    @property
    def slices(self) -> list[ArenaSlice]:
        return [sp.arena for sp in self.packs]

    def grad_parts(self) -> list[tuple[list[torch.Tensor], tuple[Any, ...]]]:
        """The shards' gradients, for :func:`kiln.optim.clip_grad_norm_`, combined by sum_over."""
        if self.world > 1 and self.sum_over is None:
            raise TypeError("grad_parts() of a shard needs the sum_over of its shard() call")
        reducers = (lambda x, op: self.sum_over(x, op) if op != "sum" else self.sum_over(x),) if self.world > 1 else ()
        return [([sp.arena.grad for sp in self.packs], reducers)]

    def pieces(self, param_groups: list[dict[str, Any]], packing: Packing) -> dict[int, tuple[int, int]]:
        """``{index: (start, stop)}``: elements of each flattened parameter this rank holds,
        keyed by the parameter's index in the state dict (torch's numbering)."""
        index: dict[int, int] = {}
        start = 0
        for g in param_groups:
            for i, p in enumerate(g["params"], start):
                index.setdefault(id(p), i)
            start += len(g["params"])
        return {index[id(pk.params[pc.index])]: (pc.start, pc.stop)
                for pk in packing.packs if pk.shard for pc in pk.shard.arena.pieces if pc.stop > pc.start}


def check_pieces(pieces: dict[int, tuple[int, int]] | None, mine: dict[int, tuple[int, int]] | None,
                 state: dict[int, Any]) -> None:
    """A state dict's ``pieces`` (None: a full dict) can load into an optimizer whose shards hold
    ``mine`` (None: not sharded): the same sharding, or a full dict."""
    if mine is None and pieces is not None:
        raise ValueError("kiln.optim: a sharded state dict (with 'pieces') needs an optimizer sharded "
                         "the same way; load a full state dict instead")
    if mine is not None and pieces is not None and any(tuple(pieces.get(k, ())) != tuple(mine.get(k, ()))
                                                       for k in state):
        raise ValueError("kiln.optim: this state dict holds pieces of another sharding (another world size "
                         "or layout); load a full state dict instead (ZeroOptimizer.state_dict() gathers one)")
