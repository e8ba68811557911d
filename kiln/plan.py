"""``kiln plan CONFIG``: what a config will build, before spending any compute on it.

The model is built on the ``meta`` device (shapes only, no memory), so planning a model far
larger than this machine's memory is instant.
"""

from __future__ import annotations

from typing import Any

import torch

# Optimizer state per parameter, in parameter-sized tensors.
_STATE_TENSORS = {"adamw": 2, "adam": 2, "lamb": 2, "sgd": 1, "lars": 1}


def _mb(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:,.1f} MB"


def describe(cfg: Any) -> str:
    from kiln.train._build import build_model

    with torch.device("meta"):
        model = build_model(cfg.model)
    params = [p for p in model.parameters()]
    n_total = sum(p.numel() for p in params)
    n_train = sum(p.numel() for p in params if p.requires_grad)
    n_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    state = _STATE_TENSORS[cfg.optim.name]
    if cfg.optim.name == "sgd" and not cfg.optim.momentum:
        state = 0
    state_bytes = state * grad_bytes
    tc, dc = cfg.train, cfg.data
    micro = dc.batch_size // tc.accumulate
    model_name = cfg.model.get("name") or cfg.model.get("_target_")
    lines = [
        f"model       {model_name}: {n_total:,} parameters ({n_train:,} trainable), "
        f"{len(params)} tensors",
        f"memory      parameters {_mb(n_bytes)} + gradients {_mb(grad_bytes)} + "
        f"{cfg.optim.name} state {_mb(state_bytes)} = {_mb(n_bytes + grad_bytes + state_bytes)}"
        " (activations not included)",
        f"batch       {dc.batch_size} samples per step = {tc.accumulate} micro-batch(es) of {micro}",
        f"optimizer   {cfg.optim.name} lr {cfg.optim.lr:g}, schedule {cfg.optim.schedule}, "
        f"contiguous arena {'on' if cfg.optim.contiguous else 'off'}",
        f"data        {dc.name} {dict(dc.args) or ''}".rstrip(),
        "length      " + (f"{tc.max_steps} steps" if tc.max_steps is not None else f"{tc.epochs} epochs"),
    ]
    return "\n".join(lines)
