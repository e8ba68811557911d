"""Datasets (a registry of builders returning train/val splits) and loader construction.

    >>> from kiln.data import build_dataset, build_loader, infinite
    >>> splits = build_dataset("synthetic_images", seed=0, num_samples=256, val_samples=64)
    >>> loader = build_loader(splits.train, 32, shuffle=True, seed=0)
    >>> epoch, (x, y) = next(infinite(loader))
    >>> x.shape, y.shape
    (torch.Size([32, 1, 8, 8]), torch.Size([32]))
"""

from kiln.data._datasets import (DataSplits, build_dataset, check_dataset, dataset_signature, list_datasets,
                                 register_dataset)
from kiln.data._loader import StepSampler, build_loader, infinite, resolve_workers, shard_iterable, worker_seed

# Imported for their @register_dataset side effect.
from kiln.data import _text, _tokens  # noqa: F401  isort: skip

__all__ = [
    "DataSplits",
    "build_dataset",
    "check_dataset",
    "dataset_signature",
    "list_datasets",
    "register_dataset",
    "StepSampler",
    "build_loader",
    "infinite",
    "resolve_workers",
    "shard_iterable",
    "worker_seed",
]
