"""Optimizers over a contiguous parameter arena: ``kiln.optim``.

Every trainable parameter of a (parameter group, device, dtype) becomes a view into one
flat, 64-byte-aligned buffer (an :class:`Arena`), and its gradient a view into a second one,
so the optimizer update, ``zero_grad`` and gradient clipping are each one operation over one
tensor instead of a Python loop over hundreds.

    >>> import torch, kiln.optim
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> decay = [p for p in model.parameters() if p.ndim > 1]
    >>> no_decay = [p for p in model.parameters() if p.ndim <= 1]
    >>> opt = kiln.optim.OPTIMIZERS["adamw"](
    ...     [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, weight_decay=0.1)
    >>> model(torch.randn(4, 8)).sum().backward()
    >>> total_norm = kiln.optim.clip_grad_norm_(opt, 1.0)   # one reduction per arena
    >>> opt.step(); opt.zero_grad()                          # one fused update, one memset

``contiguous=False`` keeps the parameters as they are and runs the same update rules as
multi-tensor (``torch._foreach_*``) kernels, for FSDP2 / DTensor parameters.

What other packages may ask of these optimizers is the :class:`KilnOptimizer` protocol (and
:class:`ShardableOptimizer`, what ZeRO asks of the one it shards); which features need the
arena is :data:`ARENA_FEATURES`, and the settings that leave it out :data:`NO_ARENA`.
"""

import contextlib
from collections.abc import Iterator

import torch

from kiln.optim import _base, _clip, _norms
from kiln.optim._arena import Arena, ArenaSlice, Piece, arena_layout
from kiln.optim._base import ArenaOptimizer, torch_method
from kiln.optim._clip import clip_grad_norm_
from kiln.optim._contract import (ARENA_FEATURES, NO_ARENA, ArenaNeed, KilnOptimizer, NoArena, ShardableOptimizer,
                                  arena_conflicts, arena_missing, has_arena, local_tensor, no_arena_setting)
from kiln.optim._native import native_kernels_build
from kiln.optim._optimizers import LAMB, LARS, SGD, Adam, AdamW

# optim.name -> class; what each takes and keeps is declared on the class (config_options, state_names)
OPTIMIZERS = {cls.config_name: cls for cls in (AdamW, Adam, SGD, LAMB, LARS)}
# optim.impl=torch-*: optim.name -> torch.optim's class (kiln's defaults are torch's, so the same
# config keys build the same optimizer); torch has no LAMB or LARS
TORCH_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}

__all__ = ["ARENA_FEATURES", "NO_ARENA", "Arena", "ArenaNeed", "ArenaSlice", "NoArena", "Piece", "arena_conflicts",
           "arena_layout", "arena_missing", "ArenaOptimizer", "KilnOptimizer", "ShardableOptimizer", "SGD", "Adam",
           "AdamW", "LAMB", "LARS", "OPTIMIZERS", "TORCH_OPTIMIZERS", "clip_grad_norm_", "has_arena", "local_tensor",
           "native_kernels_build", "no_arena_setting", "norms_as_row_views", "torch_method"]


@contextlib.contextmanager
def norms_as_row_views() -> Iterator[None]:
    """Inside it, kiln's blocked norms (the clip's, LAMB's and LARS's) reduce each long tensor's
    64 Ki-element rows as one reduction over a (rows, BLOCK) view instead of a list of views:
    the same norms in the same dtype, for ``kiln plan``'s trace on fake tensors, where the list
    costs a fake operator per row (5,400 for a 354 M-parameter arena, minutes for 7 B)."""
    import math

    def tensor_norms(tensors: list[torch.Tensor], p: float = 2.0, dtype: torch.dtype | None = None) -> torch.Tensor:
        p = float(p)
        if not tensors or not (p > 0 and any(t.numel() > _norms.BLOCK for t in tensors)):
            return original(tensors, p, dtype)
        dtype = dtype or torch.promote_types(tensors[0].dtype, torch.float32)
        out = []
        for t in tensors:
            flat = t.reshape(-1)
            full = flat.numel() // _norms.BLOCK * _norms.BLOCK
            if full == 0:
                out.append(torch.linalg.vector_norm(flat, p, dtype=dtype))
                continue
            rows = torch.linalg.vector_norm(flat[:full].view(-1, _norms.BLOCK), p, dim=1, dtype=dtype)
            if full < flat.numel():
                rows = torch.cat([rows, torch.linalg.vector_norm(flat[full:], p, dtype=dtype).reshape(1)])
            out.append(rows.max() if math.isinf(p) else rows.pow(p).sum().pow(1.0 / p))
        return torch.stack(out)

    original = _norms.tensor_norms
    _base.tensor_norms = _clip.tensor_norms = _norms.tensor_norms = tensor_norms
    try:
        yield
    finally:
        _base.tensor_norms = _clip.tensor_norms = _norms.tensor_norms = original
