"""Checks of a config's parallel settings against its model and batch, before anything is
built: :func:`check_parallel_config`. What a layout needs from a model is a capability of the
family's registered parallel plan (``kiln.models.ParallelPlan``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln.config import instantiate
from kiln.errors import ConfigError
from kiln.models import families_with, find_plan, model_config_class, model_plan
from kiln.parallel._mesh import Layout, resolve_layout
from kiln.parallel._pp import SPLIT_BACKWARD, check_pipeline


__all__ = ["check_parallel_config"]


def check_parallel_config(cfg: Any, world: int | None = None) -> Layout | None:
    """Check the parallel settings of ``cfg`` (a validated config tree, dict or DictConfig)
    against its model and batch, before anything is built; raises ConfigError naming the
    numbers and the fix. With ``world`` (the number of processes) also resolve and return the
    dp x tp x pp layout, checked against the batch each data-parallel rank gets."""
    _check_settings(cfg)
    if world is None:
        return None
    layout = resolve_layout(cfg["parallel"], world)
    per_rank = layout.dp * cfg["train"]["accumulate"]
    batch = cfg["data"]["batch_size"]
    if batch % per_rank:
        raise ConfigError(
            f"data.batch_size={batch} is not divisible by parallel.dp={layout.dp} x "
            f"train.accumulate={cfg['train']['accumulate']}; each data-parallel rank needs a whole micro-batch")
    if layout.pp > 1:
        _check_settings(cfg, micro_batch=batch // per_rank)  # the pipeline's split of the real micro-batch
    return layout


def _check_settings(cfg: Any, micro_batch: int | None = None) -> None:
    """``micro_batch``: the samples each data-parallel rank gets per micro-step, when known."""
    par, train, model = cfg["parallel"], cfg["train"], cfg["model"]
    tp, pp = par["tp"], par["pp"]
    for key in ("tp", "pp"):
        if par[key] < 1:
            raise ConfigError(f"parallel.{key}={par[key]} must be at least 1")
    if tp == 1 and par["sequence_parallel"]:
        raise ConfigError("parallel.sequence_parallel=true shards along the sequence between tensor-parallel "
                          "ranks; it needs parallel.tp > 1")
    if tp == 1 and pp == 1:
        return

    name = model.get("name")  # set only for registry models (see _validate_model)
    if name:
        plan, model_cfg = model_plan(name), _model_options(model)
    else:
        plan, model_cfg = _target_plan(model)
    # what a layout needs is a capability of the family's registered parallel plan
    for key, size, cap, what in (("tp", tp, "tp", "a tensor-parallel"), ("pp", pp, "pp", "a pipeline")):
        if size > 1 and (plan is None or cap not in plan.capabilities):
            model_is = f"model {name!r}" if name else f"model._target_={model.get('_target_')!r}"
            raise ConfigError(f"parallel.{key}={size} needs a model family with {what} plan "
                              f"({', '.join(families_with(cap)) or 'none is registered'}); {model_is} has none. Use "
                              f"one of those, or parallel.{key}=1 (data parallel, ZeRO and FSDP2 work with any model)")
    # (what tp > 1 leaves out, ZeRO-1/2 and bf16-true on kiln's arena, the config's validation
    # refused already, from kiln.optim.ARENA_FEATURES)
    if pp > 1 and train["precision"] == "fp16-mixed":
        raise ConfigError("train.precision=fp16-mixed scales the loss before backward, which a pipeline schedule "
                          f"runs itself; with parallel.pp={pp} use train.precision=bf16-mixed (no loss scaling needed)")
    if pp > 1 and train["precision"] == "bf16-true":
        raise ConfigError(f"train.precision=bf16-true keeps fp32 master weights mirroring kiln's flat arena, which "
                          f"parallel.pp={pp} runs do not use for all of the model; use train.precision=bf16-mixed")
    if pp > 1 and par["zero"] == 3 and par["pp_schedule"] in SPLIT_BACKWARD:
        raise ConfigError(f"parallel.pp_schedule={par['pp_schedule']} computes the weight gradients in a pass of "
                          "their own, after FSDP2 (parallel.zero=3) has already reduce-scattered what the input "
                          "pass left: the gradients would be wrong. Use parallel.zero=1 or 2 (ZeRO on kiln's "
                          "arena), or a schedule without the split: 1f1b, interleaved-1f1b or gpipe")
    if pp > 1 and train["compile"]:
        raise ConfigError(f"train.compile=true with parallel.pp={pp} is not supported: pipeline stages run their "
                          "own forward; set train.compile=false")
    if tp > 1:
        from kiln.parallel._tp import check_tp  # (DTensor: a second to import, for tp > 1 only)

        try:
            check_tp(model_cfg, tp, sequence_parallel=par["sequence_parallel"])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if pp > 1:
        # kiln's option, a transformers config built in the config file, or one read from a directory
        where = "model" if name else "model.config" if "config" in model else "the model's config"
        if plan.pp.ties(model_cfg):
            tie = plan.pp.tied_by
            raise ConfigError(f"{where}.{tie}=true ties a weight of the first pipeline stage to one of the last "
                              f"(the input embedding to the output layer), which parallel.pp={pp} puts on different "
                              f"ranks; set {where}.{tie}=false")
        if par["sequence_parallel"] and not plan.pp.sequence_shards:
            raise ConfigError(f"parallel.sequence_parallel=true with parallel.pp={pp}: this model's stages read the "
                              "sequence length from their input, so they cannot pass sequence shards; set "
                              "parallel.sequence_parallel=false, or parallel.pp=1")
        microbatches = par["microbatches"] or 2 * pp
        try:
            # before the world size is known, only what does not depend on the batch per rank
            check_pipeline(plan.pp.depth(model_cfg), pp, par["pp_schedule"], microbatches,
                           micro_batch if micro_batch is not None else microbatches, sizes=par["pp_stages"],
                           depth_name=f"{where}.{plan.pp.depth_option}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _target_plan(model: Any) -> tuple[Any, Any]:
    """The parallel plan and the options its checks read (a Hugging Face model's ``config``) of
    a ``_target_`` model, built on the ``meta`` device (shapes only, no memory, no weights)."""
    import torch

    from kiln.parallel._tp import model_options

    node = {k: v for k, v in dict(model).items()}
    try:
        with torch.device("meta"):
            built = instantiate(node)
    except Exception as exc:  # noqa: BLE001  (a user's model: say which and why)
        raise ConfigError(f"model._target_={model.get('_target_')!r} could not be built to check its parallel "
                          f"layout: {type(exc).__name__}: {exc}") from None
    return find_plan(built), model_options(built)


def _model_options(model: Any) -> Any:
    """The model's dataclass config, from the validated ``model`` namespace."""

    cls = model_config_class(model["name"])
    return cls(**{f.name: model[f.name] for f in dataclasses.fields(cls) if f.name in model})
