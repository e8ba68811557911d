"""Turning a validated config into the objects a run needs: device, model, data, optimizer,
learning-rate schedule. Each builder is small and usable on its own from Python."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.optim import lr_scheduler

import kiln.optim
from kiln._environment import import_diagnosis
from kiln.config import DataConfig, build_callable, instantiate, locate
from kiln.data import build_dataset, build_loader
from kiln.errors import ConfigError
from kiln.memory import apply_ac
from kiln.models import create_model
from kiln.train._chunked_loss import check_chunked_lm_loss
from kiln.train._tasks import Task, infer_kind, model_kind


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch so that a CPU run repeats bit for bit."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available; use train.device=cpu or auto")
    return torch.device(name)


def build_model(model_cfg: dict[str, Any]) -> nn.Module:
    """A model from the ``model`` namespace: a registered name or any ``_target_``."""
    node = dict(model_cfg)
    target = node.pop("_target_", None)
    if target is None:
        return create_model(node.pop("name"), **node)

    try:
        return instantiate({"_target_": target, **node})
    except Exception as exc:
        # an import inside the model's code failed for a reason outside kiln (a torchvision
        # built for another torch under transformers): the one line kiln doctor also gives
        found = import_diagnosis(exc)
        if found is None:
            raise
        raise ConfigError(f"building model._target_={target} failed: {found}") from exc


def check_model(cfg: Any, model: nn.Module | None = None) -> None:
    """What the model's structure must allow (activation checkpointing's blocks,
    ``train.chunked_lm_loss=true``'s output projection), as a ConfigError naming the key and the
    way out.

    ``model``: the built model; without it the model is built on the ``meta`` device (shapes
    only, no memory), so that ``kiln train --nproc N`` and ``kiln plan`` can check it before any
    process starts. A model that cannot be built on ``meta`` is checked by the run itself."""
    mode = cfg.train.activation_checkpointing
    if mode == "none" and cfg.train.chunked_lm_loss is not True:
        return

    if model is None:
        try:
            with torch.device("meta"):
                model = build_model(cfg.model)
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001  (the run builds it for real and checks it then)
            return
    check_chunked_lm_loss(cfg, model)
    if mode == "none":
        return
    try:
        apply_ac(model, "none", blocks=cfg.train.ac_blocks)  # finds the blocks, changes nothing
    except TypeError as exc:
        raise ConfigError(f"train.activation_checkpointing={mode} cannot be applied: {exc} "
                          "Or train without it: train.activation_checkpointing=none") from None


# --------------------------------------------------------------------------- data


@dataclass
class Data:
    """The loaders of a run and what the task needs to know about them."""

    train: torch.utils.data.DataLoader  # yields this rank's micro-batches of whole steps
    val: torch.utils.data.DataLoader
    task: str | None  # "classification", "lm", "mlm", or None (not known: only the loss is reported)


def build_data(data_cfg: Any, *, seed: int, accumulate: int, device: torch.device,
               rank: int = 0, world_size: int = 1) -> Data:
    """Train and validation loaders; ``rank``/``world_size``: this process's data-parallel
    rank and the number of them (tensor-parallel and pipeline ranks of one replica share its
    data), ``accumulate``: micro-batches per step per rank. ``data.batch_size`` is the global
    batch of one step: see :class:`kiln.data.StepSampler`."""

    train_set, val_set, task = _data_splits(data_cfg, seed)
    collate_fn = build_callable(data_cfg.collate_fn)
    pin = data_cfg.pin_memory
    pin = device.type == "cuda" if pin == "auto" else pin
    try:
        train = build_loader(
            train_set, data_cfg.batch_size, accumulate=accumulate,
            shuffle=not isinstance(train_set, torch.utils.data.IterableDataset),
            seed=seed, drop_last=data_cfg.drop_last, workers=data_cfg.workers, pin_memory=pin,
            persistent_workers=data_cfg.persistent_workers, prefetch_factor=data_cfg.prefetch_factor,
            rank=rank, world_size=world_size, collate_fn=collate_fn,
        )
    except ValueError as exc:  # the plan of steps does not fit the data set: name the keys
        raise ConfigError(
            f"data.batch_size={data_cfg.batch_size} with train.accumulate={accumulate} over {world_size} "
            f"data-parallel rank(s) does not fit the {len(train_set)} training samples: "
            f"{str(exc).split(': ', 1)[-1]}".replace("drop_last", "data.drop_last")
        ) from None
    # Every rank evaluates the whole validation set: metrics need no reduction across ranks.
    val = build_loader(val_set, data_cfg.eval_batch_size, shuffle=False, seed=seed, workers=0,
                       pin_memory=pin, rank=0, world_size=1, collate_fn=collate_fn)
    return Data(train=train, val=val, task=task)


def _data_splits(data_cfg: Any, seed: int) -> tuple[Any, Any, str | None]:
    """``(train, validation, task)``: a registered data set (``data.name``), or what the
    config's ``data._target_`` returns (``seed`` passed when it takes one)."""

    if "_target_" not in data_cfg:
        files = {key: data_cfg[key] for key in ("path", "val_path") if data_cfg.get(key) is not None}
        splits = build_dataset(data_cfg.name, seed=seed, **dict(data_cfg.args), **files)
        return splits.train, splits.val, data_cfg.task or splits.task
    import inspect

    node = {k: v for k, v in dict(data_cfg).items() if k not in DataConfig.loader_keys()}
    target = data_cfg["_target_"]
    fn = locate(target)
    try:
        takes_seed = "seed" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_seed = False
    made = instantiate({**node, **({"seed": seed} if takes_seed else {})})
    train, val = _two_splits(made, target)
    train, val = _torch_format(train), _torch_format(val)
    kind = data_cfg.task or infer_kind(train)
    for name, ds in (("train", train), ("validation", val)):
        if not isinstance(ds, (torch.utils.data.Dataset, torch.utils.data.IterableDataset)) and not (
                hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise ConfigError(f"data._target_={target} returned a {name} set of type {type(ds).__name__}, which "
                              "is not a dataset: return torch Datasets (map-style or iterable) or Hugging Face "
                              "datasets.Dataset objects")
    return train, val, kind


def _two_splits(made: Any, target: str) -> tuple[Any, Any]:
    """``(train, val)`` from a pair, a mapping with ``train`` and ``validation``/``val``/``test``
    (a ``DatasetDict``), or an object with ``.train`` and ``.val``."""

    if isinstance(made, (tuple, list)) and len(made) == 2:
        return made[0], made[1]
    if hasattr(made, "keys") and "train" in made.keys():
        for key in ("validation", "val", "test"):
            if key in made.keys():
                return made["train"], made[key]
    if hasattr(made, "train") and hasattr(made, "val"):
        return made.train, made.val
    raise ConfigError(f"data._target_={target} returned {type(made).__name__}; return (train, validation) "
                      "datasets, or a mapping with 'train' and 'validation' (a DatasetDict)")


def _torch_format(dataset: Any) -> Any:
    """A Hugging Face ``datasets.Dataset`` yields Python lists; with torch format, tensors."""
    with_format = getattr(dataset, "with_format", None)
    if callable(with_format) and getattr(dataset, "format", {}).get("type") is None:
        return with_format("torch")
    return dataset


def build_task(cfg: Any, data: "Data", model: nn.Module) -> Any:
    """The run's :class:`~kiln.train._tasks.Task`: its kind (``data.task`` when set, else what
    the model's class declares, else the data's), ``train.loss`` and ``train.metrics`` built
    from the config."""

    metrics = cfg.train.metrics
    return Task(kind=cfg.data.task or model_kind(model) or data.task, loss=build_callable(cfg.train.loss),
                metrics=None if metrics is None else {k: build_callable(v) for k, v in metrics.items()},
                pass_targets=cfg.train.pass_targets)


# --------------------------------------------------------------------------- optimizer


def param_groups(model: nn.Module, no_decay_1d: bool) -> list[dict[str, Any]]:
    """Trainable parameters, split so that biases and norm weights (ndim <= 1) get no decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not no_decay_1d:
        return [{"params": params}]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay}] if decay else []
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(optim_cfg: Any, model: nn.Module, contiguous: bool | None = None) -> torch.optim.Optimizer:
    """kiln's optimizer named by ``optim.name``, over the model's parameter groups
    (``contiguous`` overrides ``optim.contiguous``: FSDP2's DTensor shards need list mode);
    with ``optim.impl=torch-forloop|torch-foreach|torch-fused``, torch.optim's class instead."""

    name = optim_cfg.name
    cls = kiln.optim.OPTIMIZERS[name]
    # the keys the class takes (the config refused any other); None means "its default"
    kwargs = {k: optim_cfg[k] for k in cls.config_options if optim_cfg[k] is not None}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    groups = param_groups(model, optim_cfg.no_decay_1d)
    impl = optim_cfg.get("impl", "kiln")
    if impl != "kiln":  # torch.optim's own class (the config allowed adamw, adam, sgd only)
        flags = {"torch-forloop": dict(foreach=False), "torch-foreach": dict(foreach=True),
                 "torch-fused": dict(fused=True)}[impl]
        return kiln.optim.TORCH_OPTIMIZERS[name](groups, lr=optim_cfg.lr, **flags, **kwargs)
    contiguous = optim_cfg.contiguous if contiguous is None else contiguous
    return cls(groups, lr=optim_cfg.lr, contiguous=contiguous, **kwargs)


def build_scheduler(optim_cfg: Any, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """The learning-rate schedule, stepped once per optimizer step."""
    if optim_cfg.schedule == "onecycle":
        return lr_scheduler.OneCycleLR(optimizer, max_lr=optim_cfg.lr, total_steps=max(total_steps, 2))
    warmup, floor = optim_cfg.warmup_steps, optim_cfg.min_lr_ratio
    shape = optim_cfg.schedule

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if shape == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if shape == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return _Schedule(optimizer, factor, constant_from=warmup if shape == "constant" else None)


class _Schedule(lr_scheduler.LambdaLR):
    """torch's ``LambdaLR`` (its state dict too, so checkpoints keep their form) whose ``step()``
    does only its arithmetic after the first: torch's adds checks and a context manager, about the
    host time of a small model's whole optimizer step (docs/lab/facts.md, 'Host time').

    ``constant_from``: the step from which the factor is 1 for good (a constant schedule after
    its warm-up), or None. Once a step past it has written the rates (``base * 1.0``), later
    steps only count."""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Callable[[int], float],
                 constant_from: int | None = None) -> None:
        self._constant_from = constant_from
        self._settled = False  # the rates hold their constant values (set in this process: a
        # resumed run writes them once more, whatever the loaded optimizer held)
        super().__init__(optimizer, factor)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        for key in ("_constant_from", "_settled"):  # (this process's, not the schedule's progress)
            state.pop(key)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._settled = False  # the next step writes the rates of the loaded step

    def step(self, epoch: int | None = None) -> None:
        if epoch is not None or self._step_count < 2:  # torch's checks of the call order, once
            return super().step(epoch)
        self._step_count += 1
        self.last_epoch += 1
        if self._settled:
            return
        self._settled = self._constant_from is not None and self.last_epoch >= self._constant_from
        groups = self.optimizer.param_groups
        for group, base, factor in zip(groups, self.base_lrs, self.lr_lambdas, strict=True):
            lr = base * factor(self.last_epoch)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in groups]
