"""A step over the arenas: which ranges of segments an update covers, and the optimizer
state torch.optim exposes per parameter (views into the flat state buffers).

The common case is one update over each whole flat buffer. Parameters that received no
gradient (frozen, unused in the backward) or that have another step count split an arena
into runs of consecutive segments (:func:`~kiln.optim._packing.step_runs`), one update each.
A sharded optimizer steps its shard's pieces of the same runs on every rank, so that LAMB's
and LARS's norm sums match up even on a rank whose shard a run misses.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.optim.optimizer import _device_dtype_check_for_fused

from kiln.optim._packing import FlatRange, Pack, step_runs

__all__ = ["ensure_state", "expose_state", "load_state", "step_arenas", "step_shards"]


def _fused_complex_check(opt: Any, pack: Pack, stepping: Any) -> None:
    if pack.arena.dtype.is_complex and opt.param_groups[pack.group].get("fused") and any(stepping):
        _device_dtype_check_for_fused(pack.params[0])  # torch refuses fused=True for complex


def step_arenas(opt: Any) -> None:
    """One step of every arena of ``opt`` (not sharded), each parameter that received a
    gradient since the last step once."""
    packing = opt.packing
    packing.sync(check_fresh=True)
    flags = packing.flags
    for pack in packing.packs:  # (refused before anything steps)
        if pack.arena.dtype.is_complex:
            _fused_complex_check(opt, pack, flags[pack.s0:pack.s1])
    packs = packing.packs
    # the common case: every parameter received a gradient and each arena's step counts are
    # equal: one add counts them all (a tensor op costs a small model's step microseconds)
    every = flags == packing.all_set and all(pk.uniform for pk in packs)
    if every:
        packing.steps.add_(1)
    for k, pack in enumerate(packs):
        recv = flags[pack.s0:pack.s1]
        group = opt.param_groups[pack.group]
        if pack.uniform and recv == pack.all_ones:
            # one update over the whole flat buffer
            ensure_state(opt, pack, group)
            pack.step += 1  # first: the update may read the count from step_vec (step_tensor)
            if not every:
                pack.step_vec.add_(1)
            try:
                opt._update_flat(FlatRange(pack, 0, len(pack.params)), group, pack.step)
            except BaseException:
                pack.step -= 1
                for undone in packs[k:] if every else [pack]:  # (earlier arenas did step)
                    undone.step_vec.sub_(1)
                raise
            if pack.n_init < len(pack.params):
                expose_state(opt, pack, group, range(len(pack.params)))
        else:
            received = [i for i in range(len(pack.params)) if recv[i]]
            if received:
                ensure_state(opt, pack, group)
                for i, j, step in step_runs(recv, [int(s) for s in pack.step_vec.tolist()]):
                    opt._update_flat(FlatRange(pack, i, j), group, step)
                pack.step_vec[torch.tensor(received, dtype=torch.int64)] += 1
                pack.set_uniform()
                expose_state(opt, pack, group, received)
        pack.grad_version = pack.arena.grad._version
    flags[-1] = 0


def step_shards(opt: Any) -> None:
    """One step of this rank's shard of every arena: every trainable parameter, as under DDP."""
    packing, sharding = opt.packing, opt.sharding
    packing.sync(check_fresh=False, grads=sharding.keep_full_grad)
    for pk, sp in zip(packing.packs, sharding.packs):
        group, n, trainable = opt.param_groups[pk.group], len(pk.params), sp.trainable
        _fused_complex_check(opt, pk, trainable)
        if pk.uniform and trainable == pk.all_ones:
            runs = [(0, n, pk.step + 1)]
        else:
            runs = step_runs(trainable, [int(s) for s in pk.step_vec.tolist()])
        if not runs:
            continue
        ensure_state(opt, pk, group)
        ids = sp.arena.seg_ids
        k0, k1 = (ids[0], ids[-1] + 1) if ids else (0, 0)
        for i, j, step in runs:
            a, b = max(i, k0), min(j, k1)
            if a < b:
                opt._update_flat(FlatRange(sp, a - k0, b - k0), group, step)
            elif sp.norm_reduce is not None:
                sp.norm_reduce(0, 0, torch.zeros(0))  # take part in the other ranks' sum
        if trainable == pk.all_ones:
            pk.step_vec.add_(1)
            pk.step += 1
        else:
            pk.step_vec[torch.tensor([i for i in range(n) if trainable[i]], dtype=torch.int64)] += 1
            pk.set_uniform()
        if pk.n_init < n:
            expose_state(opt, pk, group, [i for i in range(n) if trainable[i]])
    packing.flags[-1] = 0


def ensure_state(opt: Any, pack: Pack, group: dict[str, Any]) -> None:
    """Allocate pack's flat state; a sharded pack's lives on its shard, and ``pack.sviews``
    then holds each parameter's piece (empty where the shard has none of it)."""
    sp = pack.shard or pack
    for name in opt.state_names(group):
        if name not in sp.state:
            sp.state[name] = sp.arena.new_buffer()
            sp.sviews[name] = sp.arena.views(sp.state[name])
            if sp is not pack:
                views = [sp.state[name][:0]] * len(pack.params)
                for pc, view in zip(sp.arena.pieces, sp.sviews[name]):
                    views[pc.index] = view
                pack.sviews[name] = views


def expose_state(opt: Any, pack: Pack, group: dict[str, Any], indices: Iterable[int]) -> None:
    """Expose per-parameter state the way torch.optim keys it (views into the arena)."""
    names = opt.state_names(group)
    expose = bool(names) or opt._has_step_state  # SGD without momentum: no entry, as torch
    for i in indices:
        if pack.init[i]:
            continue
        if expose:
            st = opt.state[pack.params[i]]
            if opt._has_step_state:
                st["step"] = pack.step_vec[i]
            for name in names:
                st[name] = pack.sviews[name][i]
        pack.init[i] = True
        pack.n_init += 1


@torch.no_grad()
def load_state(opt: Any, sharded_dict: bool) -> None:
    """After torch's ``load_state_dict`` filled ``opt.state`` with tensors of its own: copy them
    into the arenas' flat state (this rank's pieces when sharded: ``sharded_dict`` holds only
    those, else each full tensor is cut) and expose the views in their place."""
    for pack in opt.packing.packs:
        group = opt.param_groups[pack.group]
        names = opt.state_names(group)
        piece_of = {pc.index: pc for pc in pack.shard.arena.pieces} if pack.shard else None
        pack.init = [False] * len(pack.params)
        pack.n_init = 0
        for i, p in enumerate(pack.params):
            st = opt.state.get(p)
            if not st:
                pack.step_vec[i] = 0
                for name in pack.sviews:
                    pack.sviews[name][i].zero_()
                continue
            ensure_state(opt, pack, group)
            for name in names:
                src = st.get(name)
                if src is None or (piece_of is not None and i not in piece_of):
                    continue
                if piece_of is not None:  # this rank's piece, or a full tensor to cut it from
                    src = src.reshape(-1) if sharded_dict else src.reshape(-1)[piece_of[i].start:piece_of[i].stop]
                pack.sviews[name][i].copy_(src)
            pack.step_vec[i] = float(st["step"]) if "step" in st else 1.0
            opt.state[p] = {}
            expose_state(opt, pack, group, [i])
        pack.set_uniform()
