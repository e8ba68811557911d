"""Model registry: one factory, one interface for every model (timm style).

A model is registered together with its config dataclass::

    @register_model("vit", ViTConfig)
    class ViT(nn.Module):
        def __init__(self, cfg: ViTConfig): ...

    model = create_model("vit", depth=2)      # builds ViTConfig(depth=2), then ViT(cfg)

Every config class also has ``example_input(batch_size, generator=None)``, returning
a random batch of the input its model expects (float images, or token ids for a
language model), so code that knows only a model's name can build a correctly
shaped input with :func:`example_input`; the model tests loop over
:func:`list_models` and use it, so a new model is tested the day it lands.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, TypeVar

import torch
from torch import nn

__all__ = ["register_model", "create_model", "list_models", "model_config_class", "example_input"]

_Builder = TypeVar("_Builder", bound=Callable[..., nn.Module])

# name -> (builder, config dataclass)
_MODELS: dict[str, tuple[Callable[[Any], nn.Module], type]] = {}


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else "."


def register_model(name: str, config_cls: type) -> Callable[[_Builder], _Builder]:
    """Register ``builder(config) -> nn.Module`` under ``name``; returns the builder unchanged.

    ``config_cls`` must be a dataclass whose every field has a default, so that
    ``create_model(name)`` builds the model with its defaults.
    """
    if not dataclasses.is_dataclass(config_cls) or not isinstance(config_cls, type):
        raise TypeError(f"register_model({name!r}): config_cls must be a dataclass type, got {config_cls!r}")
    missing = [
        f.name
        for f in dataclasses.fields(config_cls)
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise TypeError(f"register_model({name!r}): config fields without a default: {', '.join(missing)}")
    if not callable(getattr(config_cls, "example_input", None)):
        raise TypeError(f"register_model({name!r}): {config_cls.__name__} needs an example_input(batch_size) method")

    def decorator(builder: _Builder) -> _Builder:
        if name in _MODELS:
            raise ValueError(f"model {name!r} is already registered (by {_MODELS[name][0]!r})")
        _MODELS[name] = (builder, config_cls)
        return builder

    return decorator


def list_models() -> list[str]:
    """Names of all registered models, sorted."""
    return sorted(_MODELS)


def _lookup(name: str) -> tuple[Callable[[Any], nn.Module], type]:
    try:
        return _MODELS[name]
    except KeyError:
        names = list_models()
        raise ValueError(
            f"unknown model {name!r}{_did_you_mean(name, names)} Registered models: {', '.join(names)}"
        ) from None


def model_config_class(name: str) -> type:
    """The config dataclass of model ``name`` (the config validator reads its fields)."""
    return _lookup(name)[1]


def _build_config(name: str, kwargs: dict[str, Any]) -> Any:
    _, config_cls = _lookup(name)
    options = [f.name for f in dataclasses.fields(config_cls) if f.init]
    for key in kwargs:
        if key not in options:
            raise ValueError(
                f"model {name!r} has no option {key!r}{_did_you_mean(key, options)} Options: {', '.join(options)}"
            )
    return config_cls(**kwargs)


def create_model(name: str, **kwargs: Any) -> nn.Module:
    """Build model ``name`` from ``config_cls(**kwargs)``.

    >>> model = create_model("mlp", hidden=[32])
    >>> model(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
    """
    builder, _ = _lookup(name)
    return builder(_build_config(name, kwargs))


def example_input(name: str, batch_size: int = 2, *, generator: torch.Generator | None = None, **kwargs: Any) -> torch.Tensor:
    """A random input batch for model ``name`` built with ``kwargs`` (delegates to ``cfg.example_input``)."""
    return _build_config(name, kwargs).example_input(batch_size, generator=generator)
