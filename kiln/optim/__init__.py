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
"""

from kiln.optim._arena import Arena, ArenaSlice, Piece, arena_layout
from kiln.optim._base import ArenaOptimizer
from kiln.optim._clip import clip_grad_norm_
from kiln.optim._native import native_kernels_build
from kiln.optim._optimizers import LAMB, LARS, SGD, Adam, AdamW

# optim.name -> class; what each takes and keeps is declared on the class (config_options, state_names)
OPTIMIZERS = {cls.config_name: cls for cls in (AdamW, Adam, SGD, LAMB, LARS)}

__all__ = ["Arena", "ArenaSlice", "Piece", "arena_layout", "ArenaOptimizer", "SGD", "Adam", "AdamW", "LAMB", "LARS",
           "OPTIMIZERS", "clip_grad_norm_", "native_kernels_build"]
