"""``torch.compile`` applied from outside the model, and the compile time reported on its own.

``apply_compile(model)`` compiles the whole model by default (``scope="model"``), or each
entry of ``model.blocks`` (``scope="blocks"``, torchtitan's choice on GPU: one compile is
reused by every identical block, so compile time does not grow with depth). On a small model
on a CPU per-block graph breaks cost more than they save, as ``python -m kiln.compile`` measures
(docs/lab/facts.md, 'Compiling the whole model or each block'), so ``"model"`` is the default.
A cold per-block compile is faster (one block graph, reused), so prefer ``"blocks"`` for deep
models where compile time matters.

Compilation happens lazily at the first call, so the first training step's time is mostly
compile time. :func:`timed_first_call` runs a function once and returns its seconds, so a
trainer or benchmark can log compile time separately instead of folding it into the
steady-state throughput.

    >>> import torch
    >>> from kiln.models import create_model
    >>> model = apply_compile(create_model("vit", depth=1))   # returns the model, compiled lazily
    >>> hasattr(model, "_orig_mod")
    True
"""

from __future__ import annotations

import time
from typing import Any, Callable

from torch import nn
import torch

from kiln.models import create_model

__all__ = ["apply_compile", "timed_first_call", "COMPILE_SCOPES"]

COMPILE_SCOPES = ("model", "blocks")


def apply_compile(model: nn.Module, scope: str = "model", **compile_kwargs: Any) -> nn.Module:
    """Compile ``model`` with ``torch.compile(**compile_kwargs)``; returns the model to use.

    ``scope="model"`` returns ``torch.compile(model)``: an ``OptimizedModule`` that shares the
    parameters; its ``state_dict`` keys carry a ``_orig_mod.`` prefix, so save
    ``model._orig_mod.state_dict()`` (or the uncompiled module you kept) for checkpoints.
    ``scope="blocks"`` compiles each block of ``model.blocks`` in place (``nn.Module.compile``)
    and returns ``model`` itself, whose ``state_dict`` keys are unchanged.
    Activation checkpointing (:func:`kiln.memory.apply_ac`) should be applied first.
    """
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"apply_compile: scope={scope!r} is not one of {', '.join(map(repr, COMPILE_SCOPES))}")
    if scope == "model":
        return torch.compile(model, **compile_kwargs)
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"apply_compile(scope='blocks') needs `model.blocks` (an nn.ModuleList); "
                        f"{type(model).__name__} has none. Use scope='model'.")
    for block in blocks:
        # In place, so the module tree and its state_dict keys stay as they were.
        block.compile(**compile_kwargs)
    return model


def timed_first_call(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn()`` once; return ``(result, seconds)``. Use it on the first training step of a
    compiled model: nearly all of that time is tracing and C++ compilation.

    >>> _, seconds = timed_first_call(lambda: sum(range(10)))
    >>> seconds >= 0
    True
    """
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _compare_scopes(steps: int = 30) -> None:
    """Print first-step and steady step time of eager vs both compile scopes (``python -m kiln.compile``)."""

    x = torch.randn(64, 1, 8, 8)
    y = torch.randint(0, 10, (64,))
    for scope in ("eager", *COMPILE_SCOPES):
        torch.manual_seed(0)
        model = create_model("vit")
        run = model if scope == "eager" else apply_compile(model, scope)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step() -> None:
            loss = nn.functional.cross_entropy(run(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        _, first = timed_first_call(step)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        per_step = (time.perf_counter() - start) / steps
        print(f"{scope:>6}: first step {first:6.2f} s, then {per_step * 1e3:6.2f} ms/step")


if __name__ == "__main__":
    _compare_scopes()
