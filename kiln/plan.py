"""``kiln plan CONFIG``: what a config will build, before spending any compute on it.

The model is built on the ``meta`` device (shapes only, no memory), so planning a model far
larger than this machine's memory is instant.
"""

from __future__ import annotations

from typing import Any

import torch


def _state_tensors(optim_cfg: Any) -> int:
    """Parameter-sized optimizer state tensors per parameter, as the optimizer class declares
    them for these options (SGD without momentum keeps none, AdamW two, amsgrad three)."""
    from kiln.optim import OPTIMIZERS

    cls = OPTIMIZERS[optim_cfg.name]
    return len(cls.state_names_for(**{k: optim_cfg[k] for k in cls.config_options}))


def _data_line(dc: Any) -> str:
    """A registered data set and its arguments, or the config's data._target_ and its own."""
    if "_target_" in dc:
        from dataclasses import fields

        from kiln.config import DataConfig

        loader = {f.name for f in fields(DataConfig)}
        args = {k: v for k, v in dc.items() if k not in loader and k != "_target_"}
        return f"{dc._target_}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
    return f"{dc.name} {dict(dc.args) or ''}".rstrip()


def _mb(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:,.1f} MB"


def _per_rank(model: torch.nn.Module, cfg: Any, world: int) -> list[str]:
    """The largest share of parameters, gradients and optimizer state any rank holds in the
    config's dp x tp x pp layout (ZeRO dividing over dp), from parameter names alone."""
    from kiln.parallel import check_parallel_config, stage_elements

    layout = check_parallel_config(cfg, world)
    par = cfg.parallel
    params = list(model.named_parameters())
    # the family's plans say which parameters split over tp and which stage holds each
    stages = stage_elements(model, layout, sequence_parallel=par.sequence_parallel, pp_schedule=par.pp_schedule,
                            pp_stages=par.pp_stages)
    elems = max(stages)
    size = params[0][1].element_size() if params else 4
    state = _state_tensors(cfg.optim)
    dp, zero = layout.dp, par.zero
    p_b = elems * size / (dp if zero == 3 else 1)
    g_b = elems * size / (dp if zero >= 2 else 1)
    s_b = state * elems * size / (dp if zero >= 1 else 1)
    return [
        f"layout      {layout} = {layout.world} process(es), zero={zero}"
        + (f", {par.pp_schedule} over {par.microbatches or 2 * layout.pp} micro-batches" if layout.pp > 1 else ""),
        f"per rank    parameters {_mb(p_b)} + gradients {_mb(g_b)} + {cfg.optim.name} state {_mb(s_b)} = "
        f"{_mb(p_b + g_b + s_b)} on the fullest rank",
    ]


def _precision_lines(tc: Any) -> list[str]:
    """This machine (what its CPU computes natively) and the precision the config trains in here."""
    from kiln.hardware import machine_line
    from kiln.precision import emulation_note, resolve

    lines = [f"machine     {machine_line()}"]
    if tc.device == "cuda" and not torch.cuda.is_available():
        return lines + [f"precision   {tc.precision} (train.device=cuda: resolved on the GPU that trains)"]
    device = torch.device("cuda" if tc.device != "cpu" and torch.cuda.is_available() else "cpu")
    mode = resolve(tc.precision, device)
    if tc.precision == "auto":
        why = "bf16 is native here" if mode == "bf16-mixed" else "bf16 would be emulated here"
        return lines + [f"precision   auto: {mode} on {device.type} ({why})"]
    note = emulation_note(mode, device)
    return lines + [f"precision   {mode} on {device.type}" + (f" (warning: {note})" if note else "")]


def describe(cfg: Any, world: int | None = None) -> str:
    """What ``cfg`` builds; ``world``: the number of processes (default: the layout's dp x tp x pp)."""
    from kiln.parallel import check_parallel_config
    from kiln.train import build_model, check_model

    check_parallel_config(cfg)  # the layout's needs from the model, as kiln train checks them

    with torch.device("meta"):
        model = build_model(cfg.model)
    check_model(cfg, model)  # the errors kiln train would give, before it builds anything
    params = [p for p in model.parameters()]
    n_total = sum(p.numel() for p in params)
    n_train = sum(p.numel() for p in params if p.requires_grad)
    n_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    state = _state_tensors(cfg.optim)
    state_bytes = state * grad_bytes
    tc, dc = cfg.train, cfg.data
    micro = dc.batch_size // tc.accumulate
    model_name = cfg.model.get("name") or cfg.model.get("_target_")
    lines = [
        f"model       {model_name}: {n_total:,} parameters ({n_train:,} trainable), "
        f"{len(params)} tensors",
        f"memory      parameters {_mb(n_bytes)} + gradients {_mb(grad_bytes)} + "
        f"{cfg.optim.name} state {_mb(state_bytes)} = {_mb(n_bytes + grad_bytes + state_bytes)}"
        " (activations not included)",
        f"batch       {dc.batch_size} samples per step = {tc.accumulate} micro-batch(es) of {micro}",
        f"optimizer   {cfg.optim.name} lr {cfg.optim.lr:g}, schedule {cfg.optim.schedule}, "
        f"contiguous arena {'on' if cfg.optim.contiguous else 'off'}",
        f"data        {_data_line(dc)}",
        "length      " + (f"{tc.max_steps} steps" if tc.max_steps is not None else f"{tc.epochs} epochs"),
        *_precision_lines(tc),
    ]
    pc = cfg.parallel
    if world is None:
        world = (pc.dp or 1) * pc.tp * pc.pp
    if world > 1:
        lines += _per_rank(model, cfg, world)
    return "\n".join(lines)
