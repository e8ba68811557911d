"""kiln: faster, leaner PyTorch training by changing a config rather than the model.

Public API (imported lazily so that ``import kiln`` stays cheap)::

    import kiln
    model = kiln.create_model("vit", dim=64, depth=4)
    opt = kiln.optim.AdamW(model.parameters(), lr=3e-3)   # parameters now live in one arena
    cfg = kiln.load_config("configs/digits_vit.py", ["train.max_steps=100"])
    result = kiln.train(cfg)
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from kiln._version import __version__

# torchao's import logs a warning for each of its compiled kernels built for another torch, and
# torch's pytree one for each Enum torchao registers; transformers imports torchao too (its
# quantizer checks), not only train.precision=fp8. kiln's float8 training uses none of those
# kernels, and kiln says what it has to say in one line each. A level the user set is kept.
for _name in ("torchao", "torch.utils._pytree"):
    if logging.getLogger(_name).level == logging.NOTSET:
        logging.getLogger(_name).setLevel(logging.ERROR)

# name -> (module, attribute or None for the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "optim": ("kiln.optim", None),
    "models": ("kiln.models", None),
    "data": ("kiln.data", None),
    "config": ("kiln.config", None),
    "precision": ("kiln.precision", None),
    "memory": ("kiln.memory", None),
    "parallel": ("kiln.parallel", None),
    "bench": ("kiln.bench", None),
    "create_model": ("kiln.models", "create_model"),
    "register_model": ("kiln.models", "register_model"),
    "list_models": ("kiln.models", "list_models"),
    "LazyCall": ("kiln.config", "LazyCall"),
    "load_config": ("kiln.config", "load_config"),
    "train": ("kiln.train", "train"),
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover
    from kiln import bench, config, data, memory, models, optim, parallel, precision
    from kiln.config import LazyCall, load_config
    from kiln.models import create_model, list_models, register_model
    from kiln.train import train


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
