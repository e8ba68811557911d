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

A family that can be split over tensor- or pipeline-parallel ranks registers its
:class:`~kiln.models._parallel_plan.ParallelPlan` with it (``register_model("gpt", GPTConfig,
plan=GPT_PLAN)``); ``kiln.parallel`` finds it with :func:`find_plan`, and config checks ask
:func:`model_plan` and :func:`models_with` for capabilities rather than for names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from kiln.errors import did_you_mean
from kiln.models._parallel_plan import ParallelPlan

__all__ = ["register_model", "register_plan", "create_model", "list_models", "model_config_class", "example_input",
           "model_plan", "find_plan", "models_with", "repeated_blocks"]

_Builder = TypeVar("_Builder", bound=Callable[..., nn.Module])

# name -> (builder, config dataclass)
_MODELS: dict[str, tuple[Callable[[Any], nn.Module], type]] = {}
# name -> its family's parallel plan; model class or config class -> the same plan
_PLANS: dict[str, ParallelPlan] = {}
_PLANS_BY_TYPE: dict[type, ParallelPlan] = {}


def _did_you_mean(word: str, choices: list[str]) -> str:
    return did_you_mean(word, choices) or "."


def register_model(name: str, config_cls: type, *, plan: ParallelPlan | None = None) -> Callable[[_Builder], _Builder]:
    """Register ``builder(config) -> nn.Module`` under ``name``; returns the builder unchanged.

    ``config_cls`` must be a dataclass whose every field has a default, so that
    ``create_model(name)`` builds the model with its defaults. ``plan``: how the family splits
    over tensor- and pipeline-parallel ranks (see :mod:`kiln.models._parallel_plan`); without one the
    model trains with every layout that needs no plan (data parallel, ZeRO, FSDP2).
    """
    if plan is not None and not isinstance(plan, ParallelPlan):
        raise TypeError(f"register_model({name!r}): plan must be a ParallelPlan, got {plan!r}")
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
        if plan is not None:
            _PLANS[name] = plan
            register_plan(config_cls, plan)
            if isinstance(builder, type):
                register_plan(builder, plan)
        return builder

    return decorator


def register_plan(cls: type, plan: ParallelPlan) -> None:
    """Declare ``plan`` for instances of the model class (or model config class) ``cls`` and its
    subclasses: for a family whose builder is a function, or a user's model outside the
    registry. The first class registered for a type keeps it."""
    if not isinstance(cls, type) or not isinstance(plan, ParallelPlan):
        raise TypeError(f"register_plan(cls, plan) takes a class and a ParallelPlan, got {cls!r}, {plan!r}")
    _PLANS_BY_TYPE.setdefault(cls, plan)


def model_plan(name: str) -> ParallelPlan | None:
    """The parallel plan registered with model ``name`` (None: the family has none)."""
    _lookup(name)
    return _PLANS.get(name)


def find_plan(obj: Any) -> ParallelPlan | None:
    """The parallel plan for a model (or a model config) object, by its class or the nearest
    base class with one, else a Hugging Face family's (:mod:`kiln.models.hf_plans`); None if
    there is none."""
    for cls in type(obj).__mro__:
        if cls in _PLANS_BY_TYPE:
            return _PLANS_BY_TYPE[cls]
    from kiln.models.hf_plans import hf_plan

    return hf_plan(obj)


def models_with(capability: str) -> list[str]:
    """Registered models whose plan has ``capability`` (``"tp"`` or ``"pp"``), sorted; for
    messages, :func:`families_with` also lists the Hugging Face families."""
    return sorted(name for name, plan in _PLANS.items() if capability in plan.capabilities)


def families_with(capability: str) -> list[str]:
    """kiln's registered models and the Hugging Face families whose plan has ``capability``."""
    from kiln.models.hf_plans import hf_families

    return models_with(capability) + hf_families(capability)


def repeated_blocks(model: nn.Module, path: str | None = None) -> nn.ModuleList | nn.Sequential:
    """``model``'s repeated blocks (the layers activation checkpointing and FSDP2 wrap one by one):

    - at ``path`` (dotted, e.g. ``transformer.h``) when given;
    - else where its family's pipeline plan says, or at kiln's convention, ``model.blocks``;
    - else the largest ``nn.ModuleList`` or ``nn.Sequential`` whose children are all of one
      type (an HF GPT-2's ``transformer.h``, a Llama's ``model.layers``, a timm ViT's ``blocks``),
      the one holding the most parameters among equally long ones.

    Raises TypeError saying what was found and how to name the blocks."""
    if path is not None:
        try:
            blocks = model.get_submodule(path)
        except AttributeError:
            raise TypeError(f"{type(model).__name__} has no submodule {path!r}") from None
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or not len(blocks):
            raise TypeError(f"{type(model).__name__}.{path} is a {type(blocks).__name__}, not an nn.ModuleList or "
                            "nn.Sequential of blocks")
        return blocks
    plan = find_plan(model)
    conventional = plan.pp.repeated if plan is not None and plan.pp is not None else "blocks"
    try:
        blocks = model.get_submodule(conventional)
    except AttributeError:
        blocks = None
    if isinstance(blocks, nn.ModuleList):
        return blocks
    found = _largest_uniform_container(model)
    if found is None:
        raise TypeError(f"{type(model).__name__} has no repeated blocks: no nn.ModuleList or nn.Sequential whose "
                        "children are all of one type")
    return found


def _largest_uniform_container(model: nn.Module) -> nn.ModuleList | nn.Sequential | None:
    best, best_key = None, (0, 0)
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or not len(module):
            continue
        children = list(module.children())
        if len({type(c) for c in children}) != 1:
            continue
        key = (len(children), sum(p.numel() for p in module.parameters()))
        if key > best_key:  # strictly larger: the first found (the outermost) wins a tie
            best, best_key = module, key
    return best


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
