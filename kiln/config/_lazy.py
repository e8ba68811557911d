"""``LazyCall``: describe a call in a config without making it (the LiBai/detectron2 idea).

    >>> from kiln.config import LazyCall as L
    >>> from kiln.models import create_model
    >>> node = L(create_model)(name="mlp", hidden=[32])
    >>> node["_target_"], node["name"]
    ('kiln.models.create_model', 'mlp')

The node is a plain dict, so it can be edited, overridden from the command line, saved as YAML
and instantiated later with ``kiln.config.instantiate``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def target_path(obj: Callable[..., Any]) -> str:
    """Dotted import path of ``obj``, preferring the shortest public one
    (``kiln.models.create_model`` rather than ``kiln.models._registry.create_model``)."""
    module, name = obj.__module__, obj.__qualname__
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        candidate = ".".join(parts[:i])
        try:
            found = importlib.import_module(candidate)
        except ImportError:
            continue
        if getattr(found, name, None) is obj:
            return f"{candidate}.{name}"
    return f"{module}.{name}"


def locate(path: str) -> Any:
    """Import the object at dotted ``path`` (``package.module.attr``)."""
    module_path, _, attr = path.rpartition(".")
    if not module_path:
        raise ImportError(f"{path!r} is not a dotted path such as 'package.module.function'")
    try:
        module = importlib.import_module(module_path)
    except ImportError:
        parent = locate(module_path)  # a nested attribute: package.Class.method
        return getattr(parent, attr)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"module {module_path!r} has no attribute {attr!r}") from None


class LazyCall:
    """``LazyCall(f)(**kwargs)`` returns ``{"_target_": "path.to.f", **kwargs}``."""

    def __init__(self, target: Callable[..., Any]):
        if not callable(target):
            raise TypeError(f"LazyCall needs a callable, got {target!r}")
        self._target = target

    def __call__(self, **kwargs: Any) -> dict[str, Any]:
        return {"_target_": target_path(self._target), **kwargs}


def instantiate(node: Any) -> Any:
    """Build the object a ``_target_`` node describes (nested nodes are built first)."""
    from hydra.utils import instantiate as _hydra_instantiate
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    return _hydra_instantiate(node, _convert_="all")
