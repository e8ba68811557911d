"""Lazy configs: Python or YAML files of ``model``, ``data``, ``optim``, ``train`` and
``parallel`` namespaces, command-line overrides, validation before anything is built, YAML out.

    >>> from kiln.config import load_config
    >>> cfg = load_config("configs/digits_vit.py", ["train.max_steps=10"])
    >>> cfg.optim.name
    'adamw'

The user's own code plugs in through ``_target_`` nodes (``LazyCall``): a model, a data set
builder, ``train.loss``, ``train.metrics`` and ``data.collate_fn``. A target is a dotted path,
or ``/path/to/file.py:name`` for a function defined in a config file or a module beside it;
``instantiate`` builds a node, ``build_callable`` a key that kiln calls later.
"""

from kiln.config._lazy import InstantiateError, LazyCall, build_callable, instantiate, locate, target_path
from kiln.config._load import load_config, parse_overrides, save_config, validate
from kiln.config._units import parse_size
from kiln.config._schema import DataConfig, OptimConfig, ParallelConfig, TrainConfig
from kiln.config._types import ConfigError

__all__ = [
    "ConfigError",
    "DataConfig",
    "InstantiateError",
    "LazyCall",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "build_callable",
    "instantiate",
    "load_config",
    "locate",
    "parse_overrides",
    "parse_size",
    "save_config",
    "target_path",
    "validate",
]
