"""ZeRO-3 with FSDP2: :func:`apply_fsdp` shards a kiln model with ``fully_shard``.

Each of the model's repeated blocks (``kiln.models.repeated_blocks``: kiln's models keep them
in ``model.blocks``, a family's pipeline plan may name another ``nn.ModuleList``) becomes one
FSDP unit (its parameters all-gathered for its forward and backward, re-sharded after), then
the root takes the rest (embeddings, head). Parameters become DTensors sharded on dim 0 over the mesh.

Per step, on every rank (FSDP2 reduce-scatters and averages the gradients during backward)::

    model = apply_fsdp(model)                                   # before building the optimizer
    opt = kiln.optim.AdamW(model.parameters(), contiguous=False)  # multi-tensor over the shards
    for step in ...:
        loss_fn(model(x_rank)).backward()       # x_rank: this rank's part of the global batch
        total = kiln.optim.clip_grad_norm_(opt, 1.0)  # optional: the global norm over the shards
        opt.step(); opt.zero_grad()

kiln's optimizers run on the local shards (fused AdamW/Adam/SGD kernels unchanged); LAMB and
LARS complete their per-tensor norms with one all-reduce of the vector of squared partial norms.
For gradient accumulation, ``model.set_requires_gradient_sync(False)`` on all but the last
micro-batch skips the reduce-scatters (FSDP2's API).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from kiln.models import repeated_blocks

__all__ = ["apply_fsdp", "is_fsdp"]


def apply_fsdp(model: nn.Module, *, mesh=None, mp_policy=None, reshard_after_forward: bool = True,
               root_reshard_after_forward: bool | None = None) -> nn.Module:
    """Shard ``model`` in place with FSDP2 (``fully_shard`` on each repeated block, then on the
    root) and return it. ``mesh``: a 1-D ``DeviceMesh`` (default: all ranks on the
    model's device type), or a 2-D one ``("replicate", "shard")`` for HSDP (sharded over the
    second dimension, gradients all-reduced over the first: ``kiln.parallel.fsdp_mesh``);
    ``mp_policy``: an FSDP2 ``MixedPrecisionPolicy`` (e.g.
    ``param_dtype=torch.bfloat16``). ``root_reshard_after_forward``: the root's own choice
    (default: ``reshard_after_forward``); False keeps its parameters gathered from its forward
    to its backward, for a loss that reads them after the forward (the chunked LM loss reads
    the output projection's weight). Call after the process group is initialised and before
    the optimizer is built; every rank must build the same model (same seed), as FSDP2 keeps
    each rank's own shard of the values it finds."""
    import torch._dynamo  # noqa: F401  (see below)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Imported up front, not by FSDP2's hooks at their first call in the middle of the first step,
    # which leaves the later steps more live tensor memory than kiln plan predicts
    # (docs/lab/facts.md, 'FSDP2 and the moment torch's compiler is imported'). FSDP2 imports it anyway.
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("apply_fsdp needs an initialised process group (kiln.parallel.init_distributed)")

    try:
        blocks = repeated_blocks(model)
    except TypeError as exc:
        raise TypeError(f"apply_fsdp shards block by block: {exc}") from None
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        p = next(model.parameters(), None)
        device_type = p.device.type if p is not None else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    kw = dict(mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy())
    for block in blocks:
        if next(block.parameters(), None) is None:  # e.g. a block another pipeline stage owns
            continue
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
    root = reshard_after_forward if root_reshard_after_forward is None else root_reshard_after_forward
    fully_shard(model, reshard_after_forward=root, **kw)
    return model


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by FSDP2 (its parameters are DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
