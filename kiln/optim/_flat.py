"""An update chain (:mod:`kiln.optim._chain`) over a range of an arena's flat buffers, or of a
ZeRO shard's slice of them: where the numbers live, kept apart from what the chain does.

An elementwise chain (SGD, Adam(W) where torch has no fused kernel) is one pass over the flat
range. A chain with a per-tensor transform (LAMB, LARS) is split there. The range is viewed as
(B, blk) rows that never straddle two tensors (:mod:`kiln.optim._segments`), so that a tensor's
norm is a sum over its rows and its factor one value per row, a (B, 1) column; then

1. the transforms before the split compute u and the rows' sums of squares of w and u are taken:
   into a scratch buffer the size of the range when those transforms keep state (LAMB: Adam's
   moments must move once), else chunk by chunk into a chunk-sized buffer read while in cache
   (LARS: d = g + wd*w is never stored, the second kernel recomputes it);
2. the per-tensor factors from the per-tensor norms (summed over the shards where the range is
   one), as a column;
3. u (kept, or recomputed) scaled by the column, and the rest of the chain.

Steps 1 and 3 are one kernel each: ``torch.compile``d, with the numeric hyperparameters in one
small tensor so that a schedule never recompiles, or eager (``compile=False``,
``KILN_OPTIM_EAGER=1``): the reference, which the compiled kernels are tested against.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from kiln.optim._chain import Chain, Transform, Update, elementwise
from kiln.optim._kernels import hyper, hyper_dtype, kernel
from kiln.optim._packing import FlatRange
from kiln.optim._segments import block_sumsq, column, segment_norms, segments

__all__ = ["FlatSpace", "update"]


class FlatSpace:
    """Per-tensor values over a flat range, for a chain's hyperparameters: (B, 1) columns of one
    value per row (in the hyperparameters' dtype, so that a weight decay is not rounded to a
    16-bit one), and (S,) masks; kept in the pack's cache while the values stay the same."""

    def __init__(self, rng: FlatRange) -> None:
        self.rng = rng

    @property
    def is1d(self) -> list[bool]:
        return self.rng.is1d()

    def per_tensor(self, values: Sequence[float]) -> torch.Tensor:
        def build() -> torch.Tensor:
            col = torch.tensor(values, dtype=hyper_dtype(self.rng.arena.param), device=self.rng.arena.device)
            return col.index_select(0, segments(self.rng).row_seg).unsqueeze_(1)

        return self._cached("per_tensor", tuple(values), build)

    def segment_mask(self, keep: Sequence[bool]) -> torch.Tensor:
        return self._cached("mask", tuple(keep), lambda: torch.tensor(keep, device=self.rng.arena.device))

    def _cached(self, kind: str, values: tuple, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        key = (kind, self.rng.i, self.rng.j)
        held = self.rng.cache.get(key)
        if held is None or held[0] != values:  # (one entry per range: a weight-decay schedule replaces it)
            held = self.rng.cache[key] = (values, build())
        return held[1]


# -- the kernels: each the same code eagerly and compiled ---------------------------------------------

class Packed(NamedTuple):
    """A chain's hyperparameters for a compiled kernel: numbers in one tensor (new values, never
    new code), (B, 1) columns as tensors, flags as constants: ``layout[t]`` is transform t's
    ``(name, kind, index or flag)``."""

    numbers: torch.Tensor
    tensors: tuple[torch.Tensor, ...]
    layout: tuple[tuple[tuple[str, str, Any], ...], ...]

    def rows(self, a: int, b: int) -> "Packed":
        """Only rows a..b-1 of the columns (a chunk of the range)."""
        return self._replace(tensors=tuple(t[a:b] for t in self.tensors))


def pack(hs: Sequence[dict[str, Any]], like: torch.Tensor) -> Packed:
    numbers: list[Any] = []
    tensors: list[torch.Tensor] = []
    layout = []
    for h in hs:
        spec = []
        for name, v in h.items():
            if isinstance(v, bool) or v is None:
                spec.append((name, "flag", v))
            elif isinstance(v, torch.Tensor) and v.dim() > 0:
                spec.append((name, "tensor", len(tensors)))
                tensors.append(v)
            else:
                spec.append((name, "number", len(numbers)))
                numbers.append(v)
        layout.append(tuple(spec))
    return Packed(hyper(numbers, like), tuple(tensors), tuple(layout))


def _unpack(hs: Any) -> Any:
    if not isinstance(hs, Packed):
        return hs
    numbers = hs.numbers.unbind(0)
    return [{name: numbers[i] if kind == "number" else hs.tensors[i] if kind == "tensor" else i
             for name, kind, i in spec} for spec in hs.layout]


def _whole(transforms: tuple[Transform, ...], p, g, state, hs) -> None:
    """The whole (elementwise) chain: p moves in place."""
    elementwise(transforms, Update(p, g, state), _unpack(hs), g)


def _into(transforms: tuple[Transform, ...], p, g, state, out, hs) -> None:
    """u of the transforms before the split, written to ``out``."""
    out.copy_(elementwise(transforms, Update(p, g, state), _unpack(hs), g))


def _after(transforms: tuple[Transform, ...], k: int, p, g, state, u, col, hs) -> None:
    """u (None: recomputed by transforms[:k] from g) times the per-row factors ``col``, then
    transforms[k:]. (u * col, not in place: compiled, a kept u is then read, never written.)"""
    x, hs = Update(p, g, state), _unpack(hs)
    if u is None:
        u = elementwise(transforms[:k], x, hs[:k], g)
    elementwise(transforms[k:], x, hs[k:], u * col)


def _call(fn: Callable, compiled: bool | None, like: torch.Tensor, *args: Any) -> None:
    """``fn(*args)``, or its compiled kernel with the hyperparameters (the last argument) packed
    beside ``like``."""
    *args, hs = args
    run = kernel(fn, compiled)
    if run is fn:
        fn(*args, _unpack(hs))
    else:
        run(*args, hs if isinstance(hs, Packed) else pack(hs, like))


def update(chain: Chain, rng: FlatRange, group: dict[str, Any], step: int, compiled: bool | None) -> None:
    """One step of ``chain`` over the segments of ``rng`` (all at step number ``step``)."""
    names = chain.state_names(group)
    p, g, *bufs = rng.args(*names)
    hs = chain.hyper(group, step, FlatSpace(rng))
    k = chain.split
    if k is None:
        _call(_whole, compiled, p, chain.transforms, p, g, dict(zip(names, bufs)), hs)
        return
    seg = segments(rng)
    p, g, *bufs = (t.view(-1, seg.blk) for t in (p, g, *bufs))
    state = dict(zip(names, bufs))
    before, per, rest = chain.transforms[:k], chain.transforms[k], chain.transforms[k + 1:]
    elem_hs = hs[:k] + hs[k + 1:]
    if kernel(_into, compiled) is not _into:  # (packed once for both kernels)
        elem_hs = pack(elem_hs, p)
    nb, n = len(seg.row_seg), rng.j - rng.i
    if any(t.state(group) for t in before):  # u once, kept (one scratch buffer for every range of the arena)
        u = rng.scratch(rng.arena.numel)[:p.numel()].view(-1, seg.blk)
        _call(_into, compiled, p, before, p, g, state, u, _head(elem_hs, k))
        u.view(-1).index_fill_(0, seg.pad, 0)  # the padding's u (0/0 with eps = 0) neither counts nor moves w
        block_sumsq(seg, 0, nb, p, u)
    else:  # u chunk by chunk, its rows' sums taken while in cache; recomputed by the second kernel
        u = None
        d = rng.scratch(max(b - a for a, b in seg.chunks) * seg.blk).view(-1, seg.blk)
        for a, b in seg.chunks:
            _call(_into, compiled, p, before, p[a:b], g[a:b], {}, d[:b - a], _rows(_head(elem_hs, k), a, b))
            block_sumsq(seg, a, b, p[a:b], d[:b - a])
    norms = segment_norms(rng, seg)
    col = column(per.ratio(norms[:n], norms[n:], hs[k]), seg, p.dtype)
    _call(_after, compiled, p, before + rest, k, p, g, state, u, col, elem_hs)


def _head(hs: Any, k: int) -> Any:
    """The hyperparameters of the first k transforms."""
    return hs._replace(layout=hs.layout[:k]) if isinstance(hs, Packed) else hs[:k]


def _rows(hs: Any, a: int, b: int) -> Any:
    if isinstance(hs, Packed):
        return hs.rows(a, b)
    return [{name: v[a:b] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for name, v in h.items()} for h in hs]
