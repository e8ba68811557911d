"""Full (unsharded) checkpoints for FSDP2 runs, so that a checkpoint written under
``parallel.zero=3`` has the same keys and shapes as one from any other layout and loads into
any of them. Every rank takes part (gathering shards is collective); rank 0 writes the file."""

from __future__ import annotations

from typing import Any

import torch


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options())


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's torch-keyed state dict with every DTensor gathered into a full tensor."""
    from torch.distributed.tensor import DTensor

    sd = optimizer.state_dict()
    for entry in sd["state"].values():
        for key, value in entry.items():
            if isinstance(value, DTensor):
                entry[key] = value.full_tensor().cpu()
    return sd


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Load a full state dict into an optimizer of FSDP2 (DTensor) parameters: each state
    tensor shaped like its parameter is sharded like it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in sd["state"].items():
        p = params[int(index)]
        if not isinstance(p, DTensor):
            continue
        for key, value in entry.items():
            if torch.is_tensor(value) and tuple(value.shape) == tuple(p.shape):
                entry[key] = distribute_tensor(value.to(p.device, p.dtype), p.device_mesh, p.placements)
    optimizer.load_state_dict(sd)
