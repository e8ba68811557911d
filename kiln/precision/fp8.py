"""``train.precision=fp8``: the model's linear layers trained in float8, through torchao.

Everything of bf16-mixed stays (the forward under ``torch.autocast(bfloat16)``; parameters,
gradients and optimizer state in float32); on top of it :func:`apply_fp8` swaps the model's
``nn.Linear`` modules for torchao's ``Float8Linear`` with the ``rowwise`` recipe
(``Float8LinearConfig.from_recipe_name("rowwise")``): each matmul of the forward and backward
casts its two operands to float8 (e4m3) with one scale per row, computed from the row's largest
magnitude and rounded down to a power of two, and multiplies them with ``torch._scaled_mm``
(CUTLASS's rowwise kernel on the GPU) into bf16. The float32 weights stay the parameters: what
backward saves is the bf16 input and the float32 parameter itself (no bf16 copy of the weight, as
autocast makes), and the float8 copies and their scales live only for the matmul that reads them.
Under FSDP2 and tensor parallelism the weights travel in high precision and are cast where they
are multiplied, as torchtitan's rowwise float8 does (not yet run on GPUs with kiln's layouts).

It needs a GPU with float8 tensor cores (compute capability 8.9: Ada, Hopper, Blackwell) and
torchao (``pip install 'kiln[fp8]'``); elsewhere the config is refused before anything is built
(:func:`kiln.hardware.fp8_problem`).

Which linears stay in bf16, as torchtitan's float8 converter leaves them:

- a dimension not divisible by 16: ``torch._scaled_mm`` multiplies only multiples of 16 (the
  tokens of a micro-batch, the inner dimension of the weight gradient's matmul, must be one
  too: B x T of a language model almost always is);
- the model's output projection (the family plan's ``output``, ``get_output_embeddings()``, or a
  linear whose weight is an embedding's): its logits go straight into the loss, and torchtitan
  keeps it out (``filter_fqns=["output"]``);
- the paths given as ``skip``.

What fp8 holds in memory (:func:`fp8_memory`, the figure ``kiln plan`` adds to its model): no
state between steps (the scales are computed afresh from each tensor, no amax history), and during
a step the float8 operands of the matmul that runs: the largest is a layer's backward, of K -> N
features over M tokens, holding the gradient of its output twice (scaled by row, then by column:
2MN bytes), the weight (KN) and the input (MK) in float8, and one float32 scale per row of each
(4(M + N + 2K) bytes). Eager, a cast also makes up to two high-precision temporaries of the tensor
it casts (|x| for the scale, x times the scale); compiled, they fuse away. Against bf16-mixed it
also saves memory: autocast casts each weight to a bf16 copy that the matmul keeps for backward,
while a float8 linear keeps the float32 parameter itself (2 bytes a weight less, each forward).

Module and parameter names do not change (``Float8Linear`` subclasses ``nn.Linear`` and keeps
the very ``weight`` and ``bias`` parameters), so a checkpoint loads into either model.

At small widths float8 may not pay: each matmul adds the casts (a pass over the input and the
weight), and torchao measured rowwise float8 slower than bf16 on an H100 below about
K = 1024 and N = 2048 (``torchao.float8._auto_filter_for_recipe``). ``train.compile=true``
fuses the casts into neighbouring kernels, as torchtitan runs float8.

    >>> import torch
    >>> from kiln.models import create_model
    >>> with torch.device("meta"):
    ...     model = create_model("gpt", vocab_size=512, dim=64, depth=1, heads=2, seq_len=32)
    >>> layers = apply_fp8(model)
    >>> layers.converted
    ['blocks.0.attn.wq', 'blocks.0.attn.wk', 'blocks.0.attn.wv', 'blocks.0.attn.wo', 'blocks.0.mlp.fc1', 'blocks.0.mlp.fc2']
    >>> layers.skipped
    {'head.out': 'the output projection'}
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from kiln.errors import KilnWarning
from kiln.models import find_plan

__all__ = ["Fp8Layers", "Fp8Memory", "apply_fp8", "fp8_memory", "fp8_skips"]

RECIPE = "rowwise"
ALIGN = 16  # torch._scaled_mm multiplies matrices whose dimensions are multiples of 16


@dataclass
class Fp8Layers:
    """What :func:`apply_fp8` did: the linears now in float8, and each one left in bf16 with why."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def record(self) -> dict[str, object]:
        """For summary.json's ``precision_fp8``: how many linears are float8, and each bf16 one with why."""
        return {"recipe": RECIPE, "float8_linears": len(self.converted), "bf16_linears": self.skipped}


def _output_projections(model: nn.Module) -> set[str]:
    """The paths of the output projections in ``model``: the family plan's ``output`` of it or of
    any module inside it (a user's module around kiln's GPT), what ``get_output_embeddings()``
    returns (transformers models), and any linear whose weight is an embedding's (tied)."""
    found = set()
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        plan = find_plan(module)
        if plan is not None and plan.output:
            found.add(prefix + plan.output)
        get = getattr(module, "get_output_embeddings", None)
        out = get() if callable(get) else None
        if isinstance(out, nn.Linear):
            found.update(f"{prefix}{name}".rstrip(".") for name, m in module.named_modules() if m is out)
        if isinstance(module, nn.Linear) and id(module.weight) in embedded:
            found.add(path)
    return found


def fp8_skips(model: nn.Module, skip: Iterable[str] = ()) -> dict[str, str]:
    """Each ``nn.Linear`` of ``model`` that stays in bf16 under fp8, with why (see the module's
    docstring); every other linear is converted."""
    outputs, skip = _output_projections(model), set(skip)
    reasons = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name in skip:
            reasons[name] = "skipped by name"
        elif name in outputs:
            reasons[name] = "the output projection"
        elif module.in_features % ALIGN or module.out_features % ALIGN:
            reasons[name] = (f"{module.in_features} -> {module.out_features} features: float8 matmuls need "
                             f"multiples of {ALIGN}")
    return reasons


@dataclass
class Fp8Memory:
    """What fp8 adds to a step's memory and what it saves, in bytes (see the module's docstring)."""

    casts: int  # the float8 operands and scales the largest layer's backward holds at once
    layer: str  # that layer
    saved: int  # the bf16 weight copies bf16-mixed keeps for backward and fp8 does not
    tokens: int  # M: the rows a linear multiplies (the micro-batch's tokens)


def fp8_memory(model: nn.Module, tokens: int, skip: Iterable[str] = ()) -> Fp8Memory:
    """The float8 casts and scales of ``model``'s converted linears (before or after
    :func:`apply_fp8`; on the meta device too) when they multiply ``tokens`` rows, against
    bf16-mixed: the most held at once (the largest layer's backward: 2MN + KN + MK bytes of float8
    and 4(M + N + 2K) of float32 scales), and the bf16 weight copies not kept. Compiled, this is
    the whole of it; eager, a cast's temporaries come on top while it runs.

    >>> fp8_memory(nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64)), tokens=2048).casts
    1205760
    """
    skipped = fp8_skips(model, skip)
    casts, layer, saved, m = 0, "", 0, tokens
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name in skipped:
            continue
        k, n = module.in_features, module.out_features
        held = 2 * m * n + k * n + m * k + 4 * (m + n + 2 * k)
        if held > casts:
            casts, layer = held, name
        saved += 2 * k * n
    return Fp8Memory(casts, layer, saved, tokens)


def apply_fp8(model: nn.Module, *, skip: Iterable[str] = ()) -> Fp8Layers:
    """Swap ``model``'s linear layers for torchao's ``Float8Linear`` (rowwise recipe), in place;
    the output projection, linears with a dimension not divisible by 16 and the paths in ``skip``
    stay ``nn.Linear``. Apply it before the model is split into pipeline stages, sharded or
    compiled (kiln applies it where the model is laid out), on any device, ``meta`` included.
    Returns which linears were converted and which were not, with why."""
    import torch._inductor.config

    # torchao's import logs a warning for each of its compiled kernels that does not load into this
    # torch (mxfp8, CUTLASS sm90a): float8 training uses none of them (its matmul is torch._scaled_mm)
    torchao_log = logging.getLogger("torchao")
    level = torchao_log.level
    torchao_log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # (seconds to import)
    finally:
        torchao_log.setLevel(level)

    skipped = fp8_skips(model, skip)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if "" in linears:
        raise ValueError("apply_fp8 converts the linear layers inside a model in place; the model itself is an "
                         "nn.Linear: wrap it in a module")
    # Compiled rowwise float8 under activation checkpointing recomputed its scales with other
    # roundings than the forward had (pytorch/pytorch#150859); torchtitan sets this for rowwise too.
    torch._inductor.config.emulate_precision_casts = True
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(RECIPE),
                               module_filter_fn=lambda module, fqn: fqn not in skipped)
    layers = Fp8Layers([name for name in linears if name not in skipped], skipped)
    if not layers.converted:
        warnings.warn(f"train.precision=fp8 found no linear layer to train in float8 among {len(linears)} "
                      f"({'; '.join(f'{n}: {r}' for n, r in list(skipped.items())[:3]) or 'no nn.Linear'}): the "
                      "run is bf16-mixed; use train.precision=bf16-mixed", KilnWarning, stacklevel=2)
    return layers
