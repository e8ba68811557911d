"""Numeric precision of training: autocast policy and dynamic loss scaling for fp16.

``train.precision``:

- ``auto`` (default): ``fp32`` or ``bf16-mixed``, whichever trains the run's model faster on
  this device (:mod:`kiln.precision.auto`). On a CPU with native bf16 (AVX-512-BF16 or AMX;
  :func:`kiln.hardware.native_low_precision`) kiln times a few forward + backward passes of the
  model on a real batch in both modes, because bf16 pays on some shapes and not on others; on
  a CPU that emulates bf16 it is ``fp32`` without measuring (bf16 is many times slower there:
  docs/lab/facts.md, 'bf16 on a CPU: where it pays'); on a GPU it is a rule: ``bf16-mixed`` where
  the GPU has bf16 units. Decided once, when the run is set up; ``config.yaml`` then holds the
  chosen mode and ``summary.json`` how it was chosen. :func:`resolve` gives the rule's answer,
  without a model (``fp32`` on a CPU where only a measurement can tell).
- ``fp32``: everything in float32.
- ``bf16-mixed``: forward under ``torch.autocast(dtype=bfloat16)``; parameters, gradients and
  optimizer state stay float32. bf16 has float32's exponent range, so no loss scaling is needed.
- ``fp16-mixed``: autocast to float16 plus dynamic loss scaling (:class:`LossScaler`): fp16
  gradients underflow without it.
- ``bf16-true``: parameters, activations and gradients in bfloat16 ("full low precision"),
  with float32 master weights and optimizer state in the optimizer's arena
  (:class:`MasterWeights`). Fastest and leanest on hardware with bf16 units; the caveat is
  accuracy: the forward and backward see weights rounded to 8 bits of mantissa, so a model
  usually ends a little below its fp32 or bf16-mixed accuracy (the master weights keep small
  updates from being lost, which pure bf16 training would not).
- ``fp8``: bf16-mixed, with the model's linear layers computing in float8 through torchao's
  rowwise recipe (:mod:`kiln.precision.fp8`; :meth:`Precision.convert` swaps them where the
  model is laid out). Needs an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper) and
  ``pip install 'kiln[fp8]'``; refused elsewhere before anything is built.
- ``fp64``: parameters and inputs in float64, for numerical equivalence checks.

Use it in your own loop::

    policy = Precision("auto", torch.device("cuda"))   # bf16-mixed on a GPU with bf16 units
    policy.convert(model)               # fp8 only: the linears become float8 ones
    with policy.autocast():
        loss = model(x).square().mean()
    policy.backward(loss)
    policy.grads_to_masters()           # bf16-true only: bf16 gradients -> fp32 masters
    # (average the gradients over data-parallel ranks here)
    policy.unscale(optimizer)           # fp16 only: gradients / scale, before any clipping
    if policy.step(optimizer):          # False: non-finite gradients, step skipped
        scheduler.step()
    policy.zero_grad(optimizer)
"""

from __future__ import annotations

import contextlib
import typing
import warnings
from typing import Any

import torch

from kiln import hardware
from kiln.config import TrainConfig
from kiln.errors import ConfigError, KilnWarning
from kiln.optim import Arena, KilnOptimizer, arena_missing, has_arena, local_tensor, no_arena_setting

# ("auto", "fp32", "bf16-mixed", ...): train.precision's modes as the config declares them, in its order
MODES = typing.get_args(typing.get_type_hints(TrainConfig)["precision"])
_LOW = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "fp16-mixed": torch.float16}


class PrecisionWarning(KilnWarning):
    """An explicit bf16/fp16 mode on a device that emulates it: training runs, several times slower."""


def resolve(mode: str, device: torch.device | str) -> str:
    """The mode ``mode`` trains in on ``device`` as far as it is known without a model: every
    mode but ``auto`` is itself; ``auto`` is the rule's answer (``bf16-mixed`` on a GPU with
    bf16 units, ``fp32`` where bf16 is emulated), and ``fp32`` on a CPU with native bf16 until
    the trainer has measured the model (:meth:`Precision.settle`).

    >>> resolve("fp16-mixed", "cpu"), resolve("auto", "cpu") in ("fp32", "bf16-mixed")
    ('fp16-mixed', True)
    """
    if mode not in MODES:
        raise ValueError(f"unknown precision {mode!r}; choose one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    from kiln.precision.auto import rule

    ruled = rule(device)
    return ruled.mode if ruled is not None else "fp32"


_warned: set[tuple[str, str]] = set()  # (dtype, device type) already warned about in this process


def emulation_note(mode: str, device: torch.device | str) -> str | None:
    """One line saying that ``mode`` is emulated on ``device`` and what to expect, or None
    where its low-precision type is native (or it has none: fp32, fp64)."""
    dtype = _LOW.get(mode)
    device = torch.device(device)
    if dtype is None or hardware.native_low_precision(device, dtype):
        return None
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    if device.type == "cuda":
        where = f"this GPU ({torch.cuda.get_device_name(device)})"
    else:
        where = f"this CPU ({hardware.cpu_model()}, {hardware.cpu_capability()['capability']})"
    # (how much slower, measured: docs/lab/facts.md, 'bf16 on a CPU: where it pays')
    return (f"train.precision={mode}: {name} is emulated on {where}: expect training several times slower "
            f"than fp32; use train.precision=auto ({resolve('auto', device)} here)")


def warn_if_emulated(mode: str, device: torch.device | str) -> None:
    """Warn, once per process for each type and device kind, that ``mode`` is emulated here."""
    note = emulation_note(mode, device)
    key = (str(_LOW.get(mode)), torch.device(device).type)
    if note is not None and key not in _warned:
        _warned.add(key)
        warnings.warn(note, PrecisionWarning, stacklevel=3)


def gradient_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors that hold ``optimizer``'s gradients: a kiln optimizer's
    :meth:`~kiln.optim.KilnOptimizer.flat_grads` (the arena's flat buffers, so a check over all
    gradients is one reduction per buffer), else every parameter's ``.grad``. DTensor gradients
    (FSDP2, tensor parallel) as their local shards, checked and unscaled in place; the
    non-finite flag is then OR-ed over all ranks (LossScaler.unscale_)."""
    if isinstance(optimizer, KilnOptimizer):
        return optimizer.flat_grads()
    return [local_tensor(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


class LossScaler:
    """Dynamic loss scaling for fp16: multiply the loss by ``scale`` before backward, then
    divide the gradients by it. On non-finite gradients the step is skipped (parameters and
    optimizer state untouched) and the scale halves; after ``growth_interval`` clean steps it
    doubles. Falling below ``min_scale`` means gradients are non-finite at every scale: the
    run has diverged, and that is an error rather than an endless string of skipped steps.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.clean_steps = 0
        self.skipped_steps = 0
        self._unscaled = False
        self._found_inf: torch.Tensor | None = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Divide the gradients by the scale and return a 0-d tensor, 1.0 if any is non-finite.
        Idempotent within a step (clipping calls it before ``step`` does)."""
        if self._unscaled:
            return self._found_inf
        grads = gradient_tensors(optimizer)
        device = grads[0].device if grads else torch.device("cpu")
        found_inf = torch.zeros(1, device=device)
        inv_scale = torch.full((1,), 1.0 / self.scale, device=device)
        if grads:
            # One fused pass per buffer: checks for inf/nan and multiplies by 1/scale.
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Under ZeRO each rank sees only its shard: every rank must skip the same steps.
            torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)
        self._found_inf, self._unscaled = found_inf, True
        return found_inf

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale if not done yet, step unless gradients are non-finite, update the scale.
        Returns whether the optimizer stepped."""
        found_inf = self.unscale_(optimizer)
        # note: .item() syncs with the device; the skip decision needs the answer on the host
        overflow = bool(found_inf.item())
        if not overflow:
            optimizer.step()
        self.update(overflow)
        return not overflow

    def update(self, overflow: bool) -> None:
        self._unscaled, self._found_inf = False, None
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            self.scale *= self.backoff_factor
            if self.scale < self.min_scale:
                raise FloatingPointError(
                    f"fp16 loss scale fell below its floor {self.min_scale:g}: the gradients are inf/nan at "
                    "every scale, so training has diverged. Lower optim.lr, set train.clip_grad_norm, "
                    "or use train.precision=bf16-mixed (no loss scaling needed)"
                )
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])


def _cast_floating(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)``, tensor by tensor, for the floating tensors not in ``dtype`` yet
    (``Module._apply`` would re-wrap every parameter, which kiln plan's fake tensors refuse)."""
    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
            for name, b in module._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    module._buffers[name] = b.to(dtype)


class MasterWeights:
    """bf16-true training: the model's parameters become bfloat16 copies packed into bf16
    arenas laid out exactly like the optimizer's float32 arenas, which stay the master weights.

    Per step: one cast-copy of each flat bf16 gradient into the fp32 master gradient, the
    optimizer update in fp32, one cast-copy of the fp32 master parameters back into bf16.

        >>> opt = kiln.optim.AdamW(model.parameters(), lr=1e-3)
        >>> masters = MasterWeights(model, opt)       # model is now bf16
        >>> model(x.bfloat16()).float().mean().backward()
        >>> masters.step()                            # grads -> fp32, update, params -> bf16
        >>> masters.zero_grad()
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype = torch.bfloat16):
        if not has_arena(optimizer):
            raise ValueError(arena_missing("bf16-true", *no_arena_setting(optimizer)))
        self.optimizer: KilnOptimizer = optimizer  # holds the fp32 master arenas
        self.stepper: KilnOptimizer = optimizer  # steps them: the optimizer, or ZeRO around it
        self.pairs: list[tuple[Any, Any]] = []  # (fp32 master arena, bf16 model arena)
        replace: dict[int, torch.nn.Parameter] = {}
        with torch.no_grad():
            for master, params in optimizer.packed_params():
                low = [torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad) for p in params]
                # Same alignment in elements as the master arena, so both share one layout and a
                # whole-buffer copy moves every parameter at once.
                align = 64 * dtype.itemsize // master.dtype.itemsize
                arena = Arena(low, shard_multiple=master.shard_multiple, align_bytes=align)
                assert arena.numel == master.numel and arena.offsets.equal(master.offsets)
                for q, g in zip(low, arena.gviews):
                    if q.requires_grad:
                        q.grad = g
                replace.update({id(p): q for p, q in zip(params, low)})
                self.pairs.append((master, arena))
        # The model's modules now hold the bf16 parameters; the optimizer keeps the fp32 ones.
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in replace:
                    module._parameters[name] = replace[id(p)]
        _cast_floating(model, dtype)  # frozen parameters and buffers; the bf16 parameters stay where they are

    def grads_to_master(self) -> None:
        self.stepper.materialize_grads()  # ZeRO-2 frees the full master gradient between steps
        for master, low in self.pairs:
            master.grad.copy_(low.grad)  # one cast-copy per arena
        self.stepper.mark_grads_ready()

    def step(self) -> None:
        self.stepper.step()
        with torch.no_grad():
            for master, low in self.pairs:
                low.param.copy_(master.param)

    def zero_grad(self) -> None:
        self.stepper.zero_grad()
        for _, low in self.pairs:
            low.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [master.param.clone() for master, _ in self.pairs]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for (master, low), saved in zip(self.pairs, state["masters"]):
                master.param.copy_(saved)
                low.param.copy_(master.param)


class Precision:
    """The precision policy of a run: what to autocast to, and whether to scale the loss."""

    def __init__(self, mode: str = "auto", device: torch.device | str = "cpu", **scaler_kwargs: Any):
        self.requested = mode  # as configured; ``mode`` is what it resolved to on this device
        mode = resolve(mode, device)
        if mode == "fp8" and (problem := hardware.fp8_problem(device)) is not None:
            raise ConfigError(problem)  # (a rank's own GPU; the config's check saw the launcher's)
        if self.requested != "auto":
            warn_if_emulated(mode, device)
        self.mode = mode
        self.device = torch.device(device)
        # fp8: the linears compute in float8 and everything else as bf16-mixed does
        self.autocast_dtype = {"bf16-mixed": torch.bfloat16, "fp8": torch.bfloat16,
                               "fp16-mixed": torch.float16}.get(mode)
        self.param_dtype = torch.float64 if mode == "fp64" else torch.float32  # as the model is built
        self.input_dtype = {"fp64": torch.float64, "bf16-true": torch.bfloat16}.get(mode, torch.float32)
        self.scaler = LossScaler(**scaler_kwargs) if mode == "fp16-mixed" else None
        self.masters: MasterWeights | None = None

    def settle(self, choice: Any) -> None:
        """``auto``'s final answer (a :class:`kiln.precision.auto.AutoChoice`), once the model
        is built: fp32 or bf16-mixed, which build the model, its inputs and the optimizer alike
        and differ only in autocast, so the policy can change mode up to here."""
        if self.requested != "auto" or choice.mode not in ("fp32", "bf16-mixed"):
            raise ValueError(f"only train.precision=auto settles, on fp32 or bf16-mixed (got {choice.mode!r})")
        self.mode, self.auto = choice.mode, choice
        self.autocast_dtype = torch.bfloat16 if choice.mode == "bf16-mixed" else None

    auto: Any = None  # the AutoChoice that settled train.precision=auto, or None
    fp8: Any = None  # fp8: the kiln.precision.fp8.Fp8Layers that convert() made, or None

    def convert(self, model: torch.nn.Module) -> None:
        """Called where the model is laid out, before it is split, sharded or compiled: fp8 swaps
        its linear layers for float8 ones here (:func:`kiln.precision.fp8.apply_fp8`; names
        unchanged). A no-op in the other modes."""
        if self.mode == "fp8":
            from kiln.precision.fp8 import apply_fp8  # (imports torchao: seconds)

            self.fp8 = apply_fp8(model)

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Called once the optimizer is built: bf16-true turns the model into bf16 here."""
        if self.mode == "bf16-true":
            self.masters = MasterWeights(model, optimizer)

    def wrap(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer was wrapped (ZeRO-1/2 around the fp32 master optimizer): bf16-true then
        steps and zeroes the masters through the wrapper, which reduce-scatters their gradients,
        steps this rank's shard and all-gathers the master weights."""
        if self.masters is not None:
            self.masters.stepper = optimizer

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast (nothing to enter outside the mixed modes)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale_loss(loss) if self.scaler else loss).backward()

    def grads_to_masters(self) -> None:
        """bf16-true: cast-copy the model's bf16 gradients into the fp32 master gradients, which
        the optimizer (and the data-parallel reduction after this) works on. A no-op otherwise."""
        if self.masters:
            self.masters.grads_to_master()
            self._copied = True

    def unscale(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """fp16: divide the (reduced) gradients by the loss scale and return the non-finite flag,
        agreed by every rank, as a 0-d tensor (no host sync here). None in other modes."""
        return self.scaler.unscale_(optimizer) if self.scaler else None

    _copied = False

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer, or skip it on fp16 overflow (parameters and state untouched, the
        scale halves); returns whether it stepped."""
        if self.scaler:
            return self.scaler.step(optimizer)
        if self.masters:
            if not self._copied:  # a loop that did not call grads_to_masters
                self.masters.grads_to_master()
            self.masters.step()
            self._copied = False
            return True
        optimizer.step()
        return True

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        (self.masters or optimizer).zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "scaler": self.scaler.state_dict() if self.scaler else None,
                "masters": self.masters.state_dict() if self.masters else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.masters and state.get("masters"):
            self.masters.load_state_dict(state["masters"])
