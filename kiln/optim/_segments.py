"""Per-tensor statistics over an arena without a loop over tensors (LAMB, LARS).

A range of segments is viewed as one (B, blk) matrix of rows that never straddle two tensors:
blk divides every segment's padded length (at most :data:`MAX_ROW` elements, so that no row
sum is a long fp32 reduction). A tensor's norm is then a sum over its rows, and a per-tensor
factor one value per row, a (B, 1) column that broadcasts. The rows' sums are added per
tensor in fp64: a tensor of tens of millions of elements has 10^5-10^6 rows, and one fp32 sum
of them loses digits (7e-3 at 76 M elements, issue 24).

A segment's alignment padding lies at the end of its last row; ``valid`` says how much of
each row is real, and ``pad`` where the padding is, so that a rule whose padding would not
stay zero (LAMB with ``eps=0``: 0/0) leaves it out.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kiln.optim._kernels import norm_dtype
from kiln.optim._packing import FlatRange

__all__ = ["CHUNK", "MAX_ROW", "Segments", "block_sumsq", "column", "segment_norms", "segments"]

MAX_ROW = 1 << 16  # elements per row at most: a row's sum is one vectorized fp32 reduction
# Elements per chunk of a per-tensor-norm update: the direction of a chunk is computed and its
# block norms taken while the chunk is still in cache (1 << 19 fp32 = 2 MiB per buffer). A GPU
# has no such cache to keep it in, and pays a launch per kernel per chunk: its chunks are long
# (1 << 24 fp32 = 64 MiB), so that LARS on 76 M parameters is 5 chunks, not 145
# (docs/lab/facts.md, 'Per-tensor-norm chunks on a GPU').
CHUNK = 1 << 19
GPU_CHUNK = 1 << 24


class Segments(NamedTuple):
    """Segments i..j-1 of an arena (or a shard's pieces) as rows of one (B, blk) view."""

    blk: int
    rows: torch.Tensor      # (2*(j-i),) int64: blocks per segment, twice (two buffers' norms)
    row_seg: torch.Tensor   # (B,) int64: the segment of each block, 0-based from i
    valid: torch.Tensor     # (B,) int64: real elements of each block (blk but at a padded segment's end)
    pad: torch.Tensor       # (P,) int64: where the segments' alignment padding lies, in the range
    sq: torch.Tensor        # (2*B,) the two buffers' row sums of squares
    chunks: list[tuple[int, int]]  # row ranges [a, b) of about CHUNK elements
    longest: int            # elements of the longest segment


def row_length(common: int) -> int:
    """The longest divisor of ``common`` (every segment's padded length divides it) that is at
    most MAX_ROW elements."""
    if common <= MAX_ROW:
        return common
    return next(common // d for d in range(-(-common // MAX_ROW), common + 1) if common % d == 0)


def segments(rng: FlatRange) -> Segments:
    """The rows of ``rng``, built once and kept in its pack's cache."""
    key = ("segments", rng.i, rng.j)
    seg = rng.cache.get(key)
    if seg is None:
        arena = rng.arena
        lengths, numels = arena.lengths[rng.i:rng.j], arena.numels[rng.i:rng.j]
        blk = row_length(math.gcd(*lengths) or 1)
        rows = torch.tensor([n // blk for n in lengths], dtype=torch.int64)
        row_seg = torch.repeat_interleave(torch.arange(len(lengths)), rows)
        # a block's real elements: what is left of its segment's from the block's start, at most blk
        first = torch.cumsum(rows, 0) - rows  # each segment's first block
        start = (torch.arange(len(row_seg)) - first[row_seg]) * blk
        valid = (torch.tensor(numels, dtype=torch.int64)[row_seg] - start).clamp(0, blk)
        pad = torch.cat([torch.arange(a + n, a + length) for a, n, length
                         in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), numels, lengths)])
        nb, dev = len(row_seg), arena.device
        per = max(1, (CHUNK if dev.type == "cpu" else GPU_CHUNK) // blk)
        sq = torch.empty(2 * nb, dtype=norm_dtype(arena.dtype), device=dev)
        seg = rng.cache[key] = Segments(blk, rows.repeat(2).to(dev), row_seg.to(dev), valid.to(dev), pad.to(dev),
                                        sq, [(a, min(a + per, nb)) for a in range(0, nb, per)], max(lengths))
    return seg


def block_sumsq(seg: Segments, a: int, b: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Sums of squares of rows a..b-1 of x and y, (b - a, blk) each, into seg.sq (x's, then
    y's): eager row norms, squared (what the native kernels compute in their one pass)."""
    nb = len(seg.row_seg)
    for lo, t in ((a, x), (nb + a, y)):
        out = seg.sq[lo:lo + b - a]
        torch.linalg.vector_norm(t, dim=1, dtype=seg.sq.dtype, out=out)
        out.square_()


def segment_norms(rng: FlatRange, seg: Segments) -> torch.Tensor:
    """(2*(j-i),) per-segment L2 norms of the two buffers whose row sums of squares are in
    seg.sq: one segment sum of the blocks' (padding is zero and adds nothing), made whole over
    the other shards where ``rng`` is one."""
    # unsafe: the lengths are ours and valid (the checks cost more than the sum here)
    norms = torch.segment_reduce(seg.sq.double(), "sum", lengths=seg.rows, unsafe=True).sqrt_()
    return rng.norms(norms.to(seg.sq.dtype))


def column(r: torch.Tensor, seg: Segments, dtype: torch.dtype) -> torch.Tensor:
    """A per-segment factor as a (B, 1) column, one value per block, in the buffers' dtype."""
    return (r if r.dtype == dtype else r.to(dtype)).index_select(0, seg.row_seg).unsqueeze_(1)
