"""Dataset registry and the built-in datasets.

A dataset is a builder ``builder(seed: int, **kwargs) -> DataSplits`` registered by name::
    @register_dataset("digits")
    def digits(seed: int, *, split_seed: int = 0) -> DataSplits: ...

    splits = build_dataset("digits", seed=0)
    splits.train[0]          # (image (1, 8, 8) float32, label int64)

``seed`` is the training seed; anything random about a dataset that must not change
between training runs (such as the digits train/val split) takes its own argument.

A data set that reads files takes ``path`` (and ``val_path``): a config names them by the
top-level keys ``data.path`` and ``data.val_path``. A data set may register a ``check`` that
the config runs before anything is built (:func:`check_dataset`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from torch.utils.data import Dataset, TensorDataset

from kiln import _cache
from kiln.errors import did_you_mean


__all__ = ["DataSplits", "register_dataset", "build_dataset", "check_dataset", "list_datasets", "dataset_signature"]

_TASKS = ("classification", "lm", "mlm", "seq2seq")


@dataclass
class DataSplits:
    train: Dataset  # training samples
    val: Dataset  # held-out samples for evaluation
    # "classification": samples are (x, label); "lm": (input_ids, next ids); "mlm": (masked ids,
    # original ids at masked positions and -100, cross-entropy's ignore_index, elsewhere)
    task: str
    num_classes: int  # number of labels, or the vocabulary size for "lm" and "mlm"
    input_shape: tuple  # shape of one input sample, e.g. (1, 8, 8) or (seq_len,)

    def __post_init__(self) -> None:
        if self.task not in _TASKS:
            raise ValueError(f"DataSplits.task={self.task!r} is not allowed; use one of {', '.join(map(repr, _TASKS))}")
        self.input_shape = tuple(self.input_shape)


_Builder = TypeVar("_Builder", bound=Callable[..., DataSplits])
_DATASETS: dict[str, Callable[..., DataSplits]] = {}
_CHECKS: dict[str, Callable[..., dict[str, Any]]] = {}


def _did_you_mean(word: str, choices: list[str]) -> str:
    return did_you_mean(word, choices) or "."


def register_dataset(name: str, *, check: Callable[..., dict[str, Any]] | None = None) -> Callable[[_Builder], _Builder]:
    """Register ``builder(seed, **kwargs) -> DataSplits`` under ``name``; returns the builder unchanged.

    ``check(args, *, path, val_path, model) -> args``: run by :func:`check_dataset` when a
    config is loaded, before anything is built; see there.
    """

    def decorator(builder: _Builder) -> _Builder:
        if name in _DATASETS:
            raise ValueError(f"dataset {name!r} is already registered (by {_DATASETS[name]!r})")
        if "seed" not in inspect.signature(builder).parameters:
            raise TypeError(f"register_dataset({name!r}): the builder must take a 'seed' argument")
        _DATASETS[name] = builder
        if check is not None:
            _CHECKS[name] = check
        return builder

    return decorator


def list_datasets() -> list[str]:
    """Names of all registered datasets, sorted."""
    return sorted(_DATASETS)


def _lookup(name: str) -> Callable[..., DataSplits]:
    try:
        return _DATASETS[name]
    except KeyError:
        names = list_datasets()
        raise ValueError(
            f"unknown dataset {name!r}{_did_you_mean(name, names)} Registered datasets: {', '.join(names)}"
        ) from None


def dataset_signature(name: str) -> inspect.Signature:
    """Signature of dataset ``name``'s keyword options (the builder's, without ``seed``)."""
    # eval_str: this module uses postponed annotations; callers want real types, not strings.
    sig = inspect.signature(_lookup(name), eval_str=True)
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "seed"])


def check_dataset(name: str, args: dict[str, Any], *, path: str | None = None, val_path: str | None = None,
                  model: dict[str, Any] | None = None) -> dict[str, Any]:
    """The builder arguments ``args`` of data set ``name``, checked by the data set's own
    ``check`` and completed from the model: ``model`` holds the sizes a kiln model declares
    (``vocab_size``, ``seq_len``; empty for a model kiln did not build from its registry).
    ``path``/``val_path``: the files a config names. Without a registered check, ``args`` as
    given. Raises :class:`kiln.errors.ConfigError` naming the key."""
    check = _CHECKS.get(name)
    if check is None:
        return dict(args)
    return check(dict(args), path=path, val_path=val_path, model=dict(model or {}))


def build_dataset(name: str, seed: int = 0, **kwargs: Any) -> DataSplits:
    """Build the train/val splits of dataset ``name``.

    >>> splits = build_dataset("synthetic_images", seed=1, num_samples=64, val_samples=16)
    >>> len(splits.train), len(splits.val), splits.input_shape
    (64, 16, (1, 8, 8))
    """
    builder = _lookup(name)
    params = dataset_signature(name).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        options = list(params)
        for key in kwargs:
            if key not in options:
                raise ValueError(
                    f"dataset {name!r} has no option {key!r}{_did_you_mean(key, options)} "
                    f"Options: {', '.join(options) or '(none)'}"
                )
    splits = builder(seed=seed, **kwargs)
    if not isinstance(splits, DataSplits):
        raise TypeError(f"dataset builder {name!r} returned {type(splits).__name__}, expected DataSplits")
    return splits


def _check_positive(dataset: str, **values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"dataset {dataset!r}: {key}={value!r} must be a positive integer")


# --------------------------------------------------------------------------- built-in datasets

_DIGITS_VAL = 297  # 1797 images -> 1500 train / 297 val


def _digits_arrays() -> tuple[Any, Any]:
    """``(images (1797, 8, 8), target (1797,))`` as ``sklearn.datasets.load_digits`` gives
    them, read from the file scikit-learn ships, without importing scikit-learn (it imports
    scipy: seconds of every process that trains on digits; docs/lab/facts.md, 'What an import costs')."""
    import gzip
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # finds the package, imports nothing
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits data set is scikit-learn's: pip install scikit-learn")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def _digits_split(target: Any, split_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's stratified ``train_test_split`` of the digits (297 held out), computed
    once per scikit-learn version and split seed and kept in kiln's cache (:mod:`kiln._cache`)."""
    from importlib.metadata import version

    key = f"digits|{_DIGITS_VAL}|{split_seed}|scikit-learn {version('scikit-learn')}"
    hit = _cache.get("data_splits", key)
    if hit is None:
        from sklearn.model_selection import train_test_split

        train_idx, val_idx = train_test_split(range(len(target)), test_size=_DIGITS_VAL, stratify=target,
                                              random_state=split_seed)
        hit = {"train": [int(i) for i in train_idx], "val": [int(i) for i in val_idx]}
        _cache.put("data_splits", key, hit)
    return torch.tensor(hit["train"]), torch.tensor(hit["val"])


@register_dataset("digits")
def digits(seed: int, *, split_seed: int = 0) -> DataSplits:
    """scikit-learn's 1797 handwritten 8x8 digits (bundled, no download), 1500 train / 297 val.

    The stratified split depends only on ``split_seed``, so runs with different training
    seeds see the same split. Pixels are scaled to [0, 1], then standardized with the
    train split's (scalar) mean and std. ``seed`` is unused: nothing here is random per run.
    """
    del seed
    images, target = _digits_arrays()
    x = torch.from_numpy(images).to(torch.float32).unsqueeze(1) / 16.0  # (1797, 1, 8, 8) in [0, 1]
    y = torch.from_numpy(target).to(torch.int64)  # (1797,)
    train_idx, val_idx = _digits_split(target, split_seed)
    x_train, x_val = x[train_idx], x[val_idx]
    mean, std = x_train.mean(), x_train.std()
    return DataSplits(
        train=TensorDataset((x_train - mean) / std, y[train_idx]),
        val=TensorDataset((x_val - mean) / std, y[val_idx]),
        task="classification",
        num_classes=10,
        input_shape=(1, 8, 8),
    )


_TEACHER_SIDE = 8  # synthetic_images: the teacher sees at most 8 x 8 cells of an image


@register_dataset("synthetic_images")
def synthetic_images(
    seed: int,
    *,
    num_samples: int = 4096,
    image_size: int = 8,
    channels: int = 1,
    num_classes: int = 10,
    val_samples: int = 512,
) -> DataSplits:
    """Gaussian images labelled by a random linear teacher, so the task is learnable.

    Teacher, train and val all come from one ``torch.Generator`` seeded with ``seed``:
    the same seed gives identical data. Images larger than :data:`_TEACHER_SIDE` pixels a side
    are labelled from their average over a ``_TEACHER_SIDE`` x ``_TEACHER_SIDE`` grid of cells:
    a teacher over every pixel of ImageNet's 3 x 224 x 224 with 1000 classes would hold 150 M
    weights (602 MB) and take minutes of CPU to label a few thousand images. Sizes up to 8 are
    labelled pixel by pixel, as they always were.

        >>> build_dataset("synthetic_images", image_size=224, channels=3, num_classes=1000,
        ...               num_samples=8, val_samples=2).input_shape
        (3, 224, 224)
    """
    _check_positive(
        "synthetic_images", num_samples=num_samples, image_size=image_size, channels=channels,
        num_classes=num_classes, val_samples=val_samples,
    )
    g = torch.Generator().manual_seed(seed)
    shape = (channels, image_size, image_size)
    side = min(image_size, _TEACHER_SIDE)
    teacher = torch.randn(channels * side * side, num_classes, generator=g)  # (F, K)
    x = torch.randn(num_samples + val_samples, *shape, generator=g)  # (N, C, H, W)
    seen = x if side == image_size else torch.nn.functional.adaptive_avg_pool2d(x, side)  # (N, C, side, side)
    y = (seen.flatten(1) @ teacher).argmax(dim=1)  # (N,) int64
    return DataSplits(
        train=TensorDataset(x[:num_samples], y[:num_samples]),
        val=TensorDataset(x[num_samples:], y[num_samples:]),
        task="classification",
        num_classes=num_classes,
        input_shape=shape,
    )


@register_dataset("synthetic_tokens")
def synthetic_tokens(
    seed: int,
    *,
    num_samples: int = 2048,
    seq_len: int = 64,
    vocab_size: int = 256,
    val_samples: int = 256,
) -> DataSplits:
    """Uniform random token sequences for language-model benchmarks (throughput, not accuracy).

    Each sample is ``(input_ids, targets)``, both ``(seq_len,)`` int64, with
    ``targets[t] == input_ids[t + 1]``: seq_len + 1 tokens are drawn per sequence.
    """
    _check_positive(
        "synthetic_tokens", num_samples=num_samples, seq_len=seq_len, vocab_size=vocab_size, val_samples=val_samples
    )
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab_size, (num_samples + val_samples, seq_len + 1), generator=g)  # (N, T+1)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (N, T) each
    return DataSplits(
        train=TensorDataset(inputs[:num_samples], targets[:num_samples]),
        val=TensorDataset(inputs[num_samples:], targets[num_samples:]),
        task="lm",
        num_classes=vocab_size,
        input_shape=(seq_len,),
    )
