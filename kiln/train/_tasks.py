"""What a batch means for each kind of data: how to compute the loss and the eval metrics.

Models are plain PyTorch and only map inputs to logits; the task knows the targets.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


def loss_fn(task: str, model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean loss of ``model`` on one (micro-)batch already on the device."""
    inputs, targets = batch
    return loss_from_logits(model(inputs), targets)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least float32: bf16/fp16 logits are upcast for the loss, fp64 stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def loss_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; logits (B, C) for classification, (B, T, V) for lm and mlm.

    mlm targets are -100 (cross_entropy's default ignore_index) where nothing was masked."""
    return F.cross_entropy(upcast(logits.flatten(0, -2)), targets.flatten())


def metric_names(task: str) -> list[str]:
    return ["loss", "accuracy"]


@torch.inference_mode()
def evaluate(task: str, model: nn.Module, loader: Any, device: torch.device,
             dtype: torch.dtype = torch.float32, forward: Callable[[torch.Tensor], Any] | None = None,
             share: Callable[[dict[str, float]], dict[str, float]] | None = None) -> dict[str, float]:
    """Loss and accuracy over the whole loader, summed per sample (so the last, smaller batch
    counts with its true weight), under inference mode.

    ``forward(inputs) -> logits`` replaces ``model(inputs)`` (a pipeline returns None on ranks
    without the last stage, which then only feed it); ``share(metrics)`` hands the metrics of
    the rank that computed them to every rank."""
    forward = forward or model
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    for inputs, targets in loader:
        if inputs.is_floating_point():
            inputs = inputs.to(dtype)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        logits = forward(inputs)
        if logits is None:
            continue
        logits = upcast(logits.flatten(0, -2))
        targets = targets.flatten()
        loss_sum += F.cross_entropy(logits, targets, reduction="sum").double()
        scored = targets != -100  # mlm scores only the masked positions
        correct += ((logits.argmax(-1) == targets) & scored).sum()
        count += scored.sum()
    model.train(was_training)
    # note: .item() is a device sync; evaluation is rare enough for it not to matter
    n = max(count.item(), 1)
    metrics = {"loss": loss_sum.item() / n, "accuracy": correct.item() / n}
    return share(metrics) if share is not None else metrics
