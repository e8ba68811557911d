"""The arena: one flat parameter buffer and one flat gradient buffer per (device, dtype, group).

Every parameter becomes a view into ``Arena.param`` and its gradient a view into
``Arena.grad``. Segments start on 64-byte boundaries, and the total length is padded to a
multiple of ``align * shard_multiple`` elements, so that a later ZeRO stage can cut the flat
buffer into ``shard_multiple`` equal, aligned, contiguous shards with :meth:`Arena.shard`.

Padding is zero in both buffers and stays zero: a zero gradient with zero state produces a zero
update under every rule but one, LAMB with ``eps=0``, whose direction there is 0/0; LAMB
therefore leaves the padding out of its norms and its update. Elsewhere a segment's *padded*
range can be used in reductions: the padding adds nothing to a norm.

Example::

    >>> import torch
    >>> from kiln.optim import Arena
    >>> w, b = torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(5))
    >>> arena = Arena([w, b])
    >>> arena.offsets.tolist(), arena.numel          # fp32: 16 elements = 64 bytes
    ([0, 16], 32)
    >>> w.data_ptr() == arena.param.data_ptr()
    True
    >>> arena.shard(0, 2)
    (0, 16)

Legend: N = padded arena length, S = number of segments (parameters).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

__all__ = ["Arena", "ArenaSlice", "Piece", "arena_layout"]

ALIGN_BYTES = 64


def _default_shard_multiple() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def arena_layout(
    numels: Sequence[int], itemsize: int, shard_multiple: int = 1, align_bytes: int = ALIGN_BYTES
) -> tuple[list[int], int]:
    """Return (segment start offsets, padded total length) in elements, as Python ints.

    Pure integer arithmetic, so the layout of buffers with more than 2**31 elements can be
    tested without allocating them.

    >>> arena_layout([3, 0, 20], itemsize=4, shard_multiple=3)
    ([0, 16, 16], 48)
    """
    if shard_multiple < 1:
        raise ValueError(f"shard_multiple must be >= 1, got {shard_multiple}")
    align = max(1, align_bytes // itemsize)
    offsets, pos = [], 0
    for n in numels:
        offsets.append(pos)
        pos += -(-int(n) // align) * align  # round up to the next aligned start
    unit = align * shard_multiple
    total = -(-pos // unit) * unit
    return offsets, total


class Arena:
    """Flat, aligned storage for the parameters (and gradients) of one device and dtype.

    Args:
        params: tensors of one device and dtype; they are re-pointed (``p.data = view``) into
            the arena, keeping their values. Tensors that require grad also get ``p.grad``
            pointed at a view of the flat gradient (an existing gradient is copied in).
        shard_multiple: the padded length is divisible by this (default: the
            torch.distributed world size if initialised, else 1).

    Attributes:
        param, grad: (N,) flat buffers.
        offsets: (S,) int64 segment starts; ``bounds`` (S+1,) adds N at the end.
        numels, shapes: per-segment sizes.
        pviews, gviews: the per-parameter views (shaped like the parameters).
    """

    def __init__(self, params: Sequence[torch.Tensor], shard_multiple: int | None = None,
                 align_bytes: int = ALIGN_BYTES) -> None:
        if not params:
            raise ValueError("an Arena needs at least one tensor")
        self.dtype, self.device = params[0].dtype, params[0].device
        for p in params:
            if p.dtype != self.dtype or p.device != self.device:
                raise ValueError("all tensors of an Arena must share one dtype and device")
        self.shard_multiple = shard_multiple or _default_shard_multiple()
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        starts, self.numel = arena_layout(self.numels, self.dtype.itemsize, self.shard_multiple, align_bytes)
        self._starts = starts
        self._bounds = starts + [self.numel]
        self.offsets = torch.tensor(starts, dtype=torch.int64)
        # padded length of each segment: the padding belongs to the segment before it
        self.lengths = [b - a for a, b in zip(self._bounds[:-1], self._bounds[1:])]
        self.param = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self.grad = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self.pviews = self._views(self.param)
        self.gviews = self._views(self.grad)
        with torch.no_grad():
            for p, pv in zip(params, self.pviews):
                pv.copy_(p.detach())
                p.data = pv  # the parameter object stays; its storage is now the arena

    # -- layout ---------------------------------------------------------------------------
    @property
    def bounds(self) -> torch.Tensor:
        """(S+1,) int64: segment starts followed by N."""
        return torch.tensor(self._bounds, dtype=torch.int64)

    def segment_range(self, i: int, j: int | None = None) -> tuple[int, int]:
        """Element range [start, end) covering segments i..j-1 with their padding."""
        return self._bounds[i], self._bounds[i + 1 if j is None else j]

    def shard(self, rank: int, world_size: int | None = None) -> tuple[int, int]:
        """[start, end) of rank's contiguous shard when the arena is cut into world_size parts."""
        world = world_size or self.shard_multiple
        if self.numel % world:
            raise ValueError(f"arena length {self.numel} is not divisible by {world}; "
                             f"build the arena with shard_multiple={world}")
        size = self.numel // world
        return rank * size, (rank + 1) * size

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + n].view(shape) for o, n, shape in zip(self._starts, self.numels, self.shapes)]

    def new_buffer(self) -> torch.Tensor:
        """A zeroed (N,) buffer with the arena's layout (for optimizer state)."""
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat (N,) buffer that has this arena's layout."""
        return self._views(flat)

    def __repr__(self) -> str:
        mib = self.numel * self.dtype.itemsize / 2**20
        return (f"Arena({len(self.numels)} tensors, {self.numel} elements ({mib:.1f} MiB), "
                f"{self.dtype}, {self.device}, shard_multiple={self.shard_multiple})")



class Piece(NamedTuple):
    """The part of one parameter that an :class:`ArenaSlice` holds: elements ``[start, stop)``
    of the flattened parameter, found at ``offset`` in the slice's buffers. ``index`` is the
    parameter's segment in the parent arena. The one record of where a parameter lies in a shard:
    optimizer state dicts and sharded checkpoints read it from here."""

    index: int
    start: int
    stop: int
    offset: int


class ArenaSlice:
    """The element range [lo, hi) of an :class:`Arena`, laid out like an arena of its own, so
    that an optimizer's flat update runs on it unchanged (ZeRO: the rank's shard, see
    :meth:`kiln.optim.ArenaOptimizer.shard`).

    A range cuts through parameter tensors; each parameter it touches becomes one
    :class:`Piece` (``pieces``). Piece k covers the range's part of that segment's padded
    extent (so the pieces tile [0, hi - lo) with no gap), ``numels[k]`` counts only real
    elements, and ``pviews``, ``gviews`` and :meth:`views` are 1-D views of those elements.
    ``shapes`` stay the whole parameters' shapes (an optimizer reads them to tell 1-D tensors
    apart, e.g. LARS's ``exclude_1d``), and ``seg_ids[k]`` is the piece's segment index in the
    parent arena. Per-tensor statistics over pieces are partial: whoever owns the other ranges
    must add theirs in (the ``group`` of :meth:`~kiln.optim.ArenaOptimizer.shard`).

    Args:
        arena: the parent arena; ``param`` is a view of ``arena.param[lo:hi]``.
        lo, hi: the range in elements.
        grad: the (hi - lo,) gradient buffer of the range; default a view of ``arena.grad``.

    >>> import torch
    >>> w, b = torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(5))
    >>> arena = Arena([w, b], shard_multiple=2)       # segments [0, 32) and [32, 48), N = 64
    >>> s = ArenaSlice(arena, *arena.shard(0, 2))     # [0, 32): all of w
    >>> s.seg_ids, s.numels, ArenaSlice(arena, 16, 48).numels
    ([0], [30], [14, 5])
    >>> ArenaSlice(arena, 16, 48).pieces              # w's elements 16..29, then all of b
    [Piece(index=0, start=16, stop=30, offset=0), Piece(index=1, start=0, stop=5, offset=16)]
    """

    def __init__(self, arena: Arena, lo: int, hi: int, grad: torch.Tensor | None = None) -> None:
        if not 0 <= lo <= hi <= arena.numel:
            raise ValueError(f"range [{lo}, {hi}) is outside the arena's {arena.numel} elements")
        self.parent, self.lo, self.hi = arena, lo, hi
        self.dtype, self.device = arena.dtype, arena.device
        self.numel = hi - lo
        self.shard_multiple = 1
        self.param = arena.param[lo:hi]
        self.grad = arena.grad[lo:hi] if grad is None else grad
        if self.grad.shape != (self.numel,):
            raise ValueError(f"grad must have shape ({self.numel},), got {tuple(self.grad.shape)}")
        bounds = arena._bounds
        self.pieces: list[Piece] = []
        local_bounds: list[int] = []
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            if b <= lo or a >= hi or (a == b):
                continue
            n = arena.numels[k]
            start = min(max(a, lo), a + n) - a  # the piece's real elements (none if only padding)
            self.pieces.append(Piece(k, start, max(start, min(a + n, hi) - a), max(a, lo) - lo))
            local_bounds.append(max(a, lo) - lo)
        self.seg_ids = [pc.index for pc in self.pieces]
        self._bounds = local_bounds + [self.numel]
        self._starts = local_bounds
        self.shapes = [arena.shapes[k] for k in self.seg_ids]
        self.numels = [pc.stop - pc.start for pc in self.pieces]
        self.lengths = [b - a for a, b in zip(self._bounds[:-1], self._bounds[1:])]
        self.pviews = self.views(self.param)
        self.gviews = self.views(self.grad)

    def segment_range(self, i: int, j: int | None = None) -> tuple[int, int]:
        """Local element range [start, end) covering pieces i..j-1 with their padding."""
        return self._bounds[i], self._bounds[i + 1 if j is None else j]

    def new_buffer(self) -> torch.Tensor:
        """A zeroed (hi - lo,) buffer: optimizer state for the range only."""
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """1-D views of each piece's real elements in a (hi - lo,) buffer."""
        return [flat[pc.offset:pc.offset + pc.stop - pc.start] for pc in self.pieces]

    def __repr__(self) -> str:
        return (f"ArenaSlice([{self.lo}, {self.hi}) of {self.parent.numel}, {len(self.seg_ids)} pieces, "
                f"{self.dtype}, {self.device})")
