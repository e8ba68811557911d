"""How an update rule runs: eagerly, or compiled once per process, with its hyperparameters
in one small tensor so that a learning-rate schedule never recompiles."""

from __future__ import annotations

import os
from typing import Callable

import torch

__all__ = ["EAGER_ENV", "compiling", "hyper", "hyper_dtype", "kernel", "norm_dtype"]

EAGER_ENV = "KILN_OPTIM_EAGER"
_COMPILED: dict[str, Callable] = {}


def compiling(compiled: bool | None) -> bool:
    """An optimizer's ``compile`` flag resolved: None means yes unless KILN_OPTIM_EAGER is set."""
    return os.environ.get(EAGER_ENV, "0") in ("", "0") if compiled is None else bool(compiled)


def kernel(fn: Callable, compiled: bool | None) -> Callable:
    """fn itself, or fn compiled once per process (dynamic shapes: one graph for every size)."""
    if not compiling(compiled):
        return fn
    key = f"{fn.__module__}.{fn.__qualname__}"
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=True)
    return _COMPILED[key]


def hyper_dtype(like: torch.Tensor) -> torch.dtype:
    return torch.float64 if like.dtype == torch.float64 else torch.float32


def hyper(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Hyperparameters as one small tensor beside ``like``: compiled kernels see new values,
    never new code."""
    return torch.tensor(values, dtype=hyper_dtype(like), device=like.device)


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype per-tensor norms are taken in: at least fp32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
