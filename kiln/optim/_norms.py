"""Norms of long tensors, blocked: one fp32 reduction over tens of millions of elements loses
digits on CPU, a reduction over 64 Ki-element rows and then over the rows' results does not.

One reduction's relative error grows with the tensor's length, the blocked one's stays near
fp32's rounding at every size (docs/lab/facts.md, 'Long fp32 reductions on CPU').
The arena makes gradients this long: the clip's global norm and the per-tensor norms of the
multi-tensor LAMB and LARS go through :func:`tensor_norms`.
"""

from __future__ import annotations

import math

import torch

BLOCK = 1 << 16  # elements per row of a blocked reduction


def tensor_norms(tensors: list[torch.Tensor], p: float = 2.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(N,) the ``p``-norm of each tensor, in ``dtype`` (default: at least fp32, fp64 stays fp64).
    Tensors longer than :data:`BLOCK` are split into rows of BLOCK elements: one
    ``torch._foreach_norm`` over all rows and short tensors, then each long tensor's norm is the
    norm of its rows' norms.

    >>> x = torch.ones(3 * BLOCK + 5)
    >>> tensor_norms([x, torch.ones(4)]).tolist() == [math.sqrt(3 * BLOCK + 5), 2.0]
    True
    """
    if not tensors:
        return torch.zeros(0, dtype=dtype or torch.float32)
    dtype = dtype or torch.promote_types(tensors[0].dtype, torch.float32)
    p = float(p)
    # (p = 0 counts non-zeros: exact as it is, and not the norm of its rows' counts)
    rows = [t.reshape(-1).split(BLOCK) if p > 0 and t.numel() > BLOCK else (t,) for t in tensors]
    norms = torch.stack(torch._foreach_norm([r for rs in rows for r in rs], p, dtype=dtype))
    if len(norms) == len(tensors):
        return norms
    owner = torch.repeat_interleave(torch.tensor([len(rs) for rs in rows], device=norms.device))
    out = torch.zeros(len(tensors), dtype=dtype, device=norms.device)
    if math.isinf(p):
        return out.scatter_reduce_(0, owner, norms, "amax", include_self=False)
    return out.index_add_(0, owner, norms.pow(p)).pow(1.0 / p)
