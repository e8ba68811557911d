"""Activation checkpointing applied from outside the model: ``apply_ac(model, mode, every)``.

The repeated blocks are found by :func:`kiln.models.repeated_blocks`: kiln's models keep them
in ``model.blocks``; in any other model they are the largest ``nn.ModuleList`` or
``nn.Sequential`` of children of one type (an HF GPT-2's ``transformer.h``, a Llama's
``model.layers``, a timm ViT's ``blocks``), or the dotted path given as ``blocks=``
(``train.ac_blocks``). ``apply_ac`` makes chosen blocks *checkpointed*: their forward runs without keeping
intermediate activations, and the backward pass recomputes them from the block input.
Activation memory drops from "every intermediate of every block" to "one input per
checkpointed block, plus one block's intermediates during its recompute", at the price of
one extra forward of the checkpointed blocks.

Modes:

- ``"none"``: no checkpointing (undoes an earlier ``apply_ac``).
- ``"full"``: every block.
- ``"selective"``: every ``every``-th block, counting from block 0 (blocks 0, k, 2k, ...),
  a middle ground that trades part of the memory saving for less recompute.

The blocks stay the same module objects: ``apply_ac`` only replaces ``block.forward`` on the
instance, so ``state_dict()`` keys, ``named_parameters()`` and ``isinstance`` checks are
exactly those of the unwrapped model, and a checkpoint saved with AC loads without it.

Dropout inside a checkpointed block draws the same mask in the recompute as in the
original forward (``preserve_rng_state=True``), so gradients are bitwise equal to those
of the unwrapped model.

A transformers model keeps a key/value cache (``config.use_cache``, on by default) that each
block appends to: recomputed in backward, a block would append a second time, and the
recompute sees other shapes (a padded batch's mask no longer matches; T5 saves another number
of tensors). So while blocks are checkpointed, the model's training forwards with gradients run
with ``use_cache=False``, as transformers' own gradient checkpointing does; evaluation and
generation keep the cache, and the model's config is left as it was.

    >>> import torch
    >>> from kiln.models import create_model
    >>> model = create_model("vit", depth=4, dropout=0.1)
    >>> apply_ac(model, "selective", every=2)
    [0, 2]
    >>> checkpointed_blocks(model)
    [0, 2]
    >>> model(torch.randn(2, 1, 8, 8)).sum().backward()
"""

from __future__ import annotations

from typing import Any

import inspect

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kiln.models import repeated_blocks

__all__ = ["apply_ac", "remove_ac", "checkpointed_blocks", "AC_MODES"]

AC_MODES = ("none", "selective", "full")


class _CheckpointedForward:
    """Stands in for ``block.forward``: runs the class's forward under non-reentrant checkpoint.

    A small class rather than a closure so the model still pickles and deep-copies
    (``torch.save(model)``, ``copy.deepcopy``): it holds the module, not a bound method.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Calls the class's forward, not the instance attribute (which is this object).
        # Non-reentrant checkpointing supports keyword arguments, inputs that do not
        # require grad and nested checkpoints; the reentrant variant is being deprecated.
        return checkpoint(
            type(self.module).forward, self.module, *args,
            use_reentrant=False, preserve_rng_state=True, **kwargs,
        )


def _no_cache_while_training(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of a cached model under checkpointing: no key/value cache in a training
    forward that records gradients (the blocks' recompute would update it a second time)."""
    if module.training and torch.is_grad_enabled():
        kwargs["use_cache"] = False
    return args, kwargs


def _cached_models(model: nn.Module) -> list[nn.Module]:
    """The outermost modules of ``model`` that keep a key/value cache: a ``config.use_cache``
    and a forward that takes ``use_cache`` (a transformers model, or one inside a user's)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") or not outer for outer, _ in found):
            continue  # inside one already found: the outer model passes use_cache down
        if not hasattr(getattr(module, "config", None), "use_cache"):
            continue
        try:
            takes = "use_cache" in inspect.signature(type(module).forward).parameters
        except (TypeError, ValueError):
            takes = False
        if takes:
            found.append((name, module))
    return [m for _, m in found]


def _remove_cache_hooks(model: nn.Module) -> None:
    for module in model.modules():
        for key, hook in list(module._forward_pre_hooks.items()):
            if hook is _no_cache_while_training:
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)


def _blocks(model: nn.Module, path: str | None = None) -> nn.ModuleList | nn.Sequential:
    try:
        return repeated_blocks(model, path)
    except TypeError as exc:
        raise TypeError(f"activation checkpointing needs the model's repeated blocks: {exc}. Name them with "
                        "train.ac_blocks=dotted.path (an nn.ModuleList or nn.Sequential of blocks).") from None


def _is_checkpointed(block: nn.Module) -> bool:
    return isinstance(block.__dict__.get("forward"), _CheckpointedForward)


def remove_ac(model: nn.Module) -> None:
    """Undo :func:`apply_ac`: every checkpointed module runs its plain forward again."""
    for module in model.modules():
        if _is_checkpointed(module):
            del module.forward  # the class's forward shows through again
    _remove_cache_hooks(model)


def checkpointed_blocks(model: nn.Module, blocks: str | None = None) -> list[int]:
    """Indices of the repeated blocks (``blocks``: their dotted path) that run under activation
    checkpointing."""
    return [i for i, block in enumerate(_blocks(model, blocks)) if _is_checkpointed(block)]


def apply_ac(model: nn.Module, mode: str = "full", every: int = 2, blocks: str | None = None) -> list[int]:
    """Checkpoint repeated blocks of ``model`` in place (``blocks``: their dotted path, found
    by :func:`kiln.models.repeated_blocks` when None); returns the indices checkpointed.

    ``mode`` is ``"none"``, ``"full"`` (every block) or ``"selective"`` (blocks 0, every,
    2*every, ...). Calling it again replaces the previous choice, so ``apply_ac(m, "none")``
    undoes it.

    >>> from kiln.models import create_model
    >>> apply_ac(create_model("vit", depth=3), "full")
    [0, 1, 2]
    """
    if mode not in AC_MODES:
        raise ValueError(f"apply_ac: mode={mode!r} is not one of {', '.join(map(repr, AC_MODES))}")
    if mode == "selective" and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ValueError(f"apply_ac: every={every!r} must be a positive integer")
    found = _blocks(model, blocks)
    remove_ac(model)
    if mode == "none":
        return []
    step = 1 if mode == "full" else every
    chosen = list(range(0, len(found), step))
    for i in chosen:
        # An instance attribute shadows the class's forward; nn.Module.__call__ looks up
        # self.forward, so hooks still run around the checkpointed call.
        found[i].forward = _CheckpointedForward(found[i])
    for cached in _cached_models(model):
        cached.register_forward_pre_hook(_no_cache_while_training, with_kwargs=True)
    return chosen
