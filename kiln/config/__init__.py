"""Lazy configs: Python or YAML files of ``model``, ``data``, ``optim``, ``train`` and
``parallel`` namespaces, command-line overrides, validation before anything is built, YAML out.

    >>> from kiln.config import load_config
    >>> cfg = load_config("configs/digits_vit.py", ["train.max_steps=10"])
    >>> cfg.optim.name
    'adamw'
"""

from kiln.config._lazy import LazyCall, instantiate, locate, target_path
from kiln.config._load import load_config, save_config, validate
from kiln.config._schema import DataConfig, OptimConfig, ParallelConfig, TrainConfig
from kiln.config._types import ConfigError

__all__ = [
    "ConfigError",
    "DataConfig",
    "LazyCall",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "instantiate",
    "load_config",
    "locate",
    "save_config",
    "target_path",
    "validate",
]
