"""``train.precision=auto``: fp32 or bf16-mixed, whichever trains this model faster here.

A capability flag cannot say it: on a CPU with native bf16 (AVX-512-BF16), bf16 autocast made
some models several times faster and others slower
(docs/lab/facts.md, 'bf16 on a CPU: where it pays'). So where bf16 could win, kiln measures:

- **CPU with native bf16** (AVX-512-BF16 or AMX, or ``KILN_BF16=native``): a few forward +
  backward passes of the run's own model on a real micro-batch, in both modes, interleaved
  (fp32, bf16, bf16, fp32, ...), after one untimed pass of each; the median of each. bf16-mixed
  is chosen if its median is at least ``MARGIN`` (5%) below fp32's: a gain inside the noise of
  a shared machine is not worth bf16's rounding. A mode over 4x the other in the untimed first
  pass, or over 1.5x after the first round, cannot win and is not timed further. The measurement stops after ``MAX_ROUNDS`` rounds,
  or after ``BUDGET_S`` seconds once ``MIN_ROUNDS`` are done.
- **CPU that emulates bf16** (AVX2 only, or ``KILN_BF16=emulated``): fp32, not measured. bf16
  cannot win there (a bf16 matmul takes many times the fp32 one), so the measurement would only
  cost seconds (docs/lab/facts.md, 'bf16 on a CPU: where it pays').
- **GPU with bf16 units** (Ampere and later), where the run holds the whole model on each GPU
  (no FSDP, tensor or pipeline parallelism): measured as on a CPU with native bf16. bf16 matmuls
  run on tensor cores at 2-16x fp32's peak, but a model whose step is bound by kernel launches
  only pays autocast's casts: Hugging Face's tiny GPT-2 trained 1.11x the transformers Trainer in
  fp32 on an H200 and 0.88x in bf16-mixed (docs/lab/gpu.md). A mode that runs out of GPU memory
  in its first pass has lost. Where the model is sharded, or on a GPU before Ampere: a rule,
  bf16-mixed (fp32 before Ampere), for one GPU cannot hold the whole model to time it.

The passes run the model eagerly and without activation checkpointing, also where the run
compiles or checkpoints (compiling both modes would cost more than most runs could gain): a
relative measure, not the run's speed.

The choice is made once, on rank 0 (the others receive it), before the model is laid out, and
restores everything the passes touched (gradients, buffers such as BatchNorm's statistics, the
random number generators), so that the run is bitwise the run of the chosen mode named
explicitly. The run directory records it: ``config.yaml`` holds the chosen mode (a rerun from it
does not measure), ``summary.json`` holds ``precision`` and ``precision_auto`` (how it was
chosen and the timings), and a resumed run keeps its checkpoint's mode. Timings are cached per
(model and batch shapes, machine, threads, torch) in ``~/.cache/kiln/auto_precision.json``
(:mod:`kiln._cache`), so a second run of the same model on the same machine does not measure.

    >>> model = torch.nn.Linear(64, 64)
    >>> x = torch.randn(256, 64)
    >>> choice = choose_for_model(model, lambda: model(x).square().mean(), "cpu", cache=False)
    >>> choice.mode in ("fp32", "bf16-mixed")
    True
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch

from kiln import _cache, hardware

__all__ = ["AutoChoice", "CANDIDATES", "choose", "choose_for_model", "decide", "measure", "rule", "same_random",
           "untouched"]

CANDIDATES = ("fp32", "bf16-mixed")  # same parameters, inputs and optimizer: only autocast differs
MARGIN = 0.05  # bf16-mixed must be this much faster than fp32 to be chosen
MIN_ROUNDS, MAX_ROUNDS, BUDGET_S = 3, 7, 2.0
HOPELESS = 1.5  # after the first round, a mode this much slower than the other is not timed further
WARMUP_HOPELESS = 4.0  # the same for the untimed first passes, which also build kernels
CACHE = "auto_precision"


@dataclass
class AutoChoice:
    """What ``train.precision=auto`` became, and why."""

    mode: str  # fp32 or bf16-mixed
    how: str  # measured | cached | rule | checkpoint
    reason: str = ""  # the rule's, or what the measurement found, in words
    ms: dict[str, float] = field(default_factory=dict)  # median forward + backward per mode
    rounds: int = 0

    def line(self) -> str:
        """One line for the run's output."""
        timed = ", ".join(f"{m} {v:.1f} ms" for m, v in self.ms.items())
        if self.how in ("measured", "cached"):
            what = f"forward+backward of this model on one micro-batch: {timed}"
            if self.how == "cached":
                what += f" (cached in {_cache.cache_dir()})"
            elif self.rounds == 1:
                what += " (one pass: one mode was over 1.5x the other, not timed further)"
            else:
                what += f" (median of {self.rounds})"
        else:
            what = self.reason
        return f"train.precision=auto -> {self.mode}: {what}"

    def record(self) -> dict[str, Any]:
        """For summary.json."""
        return {k: v for k, v in asdict(self).items() if v not in ("", {}, 0)}


def rule(device: torch.device | str, whole_model: bool = False) -> AutoChoice | None:
    """The mode where no measurement is needed to know it, or None where it must be measured
    (a CPU with native bf16; a GPU with bf16 units where each GPU holds the ``whole_model``)."""
    device = torch.device(device)
    native = hardware.native_low_precision(device, torch.bfloat16)
    if device.type == "cpu":
        if native:
            return None
        caps = hardware.cpu_capability()
        by = f" ({hardware.BF16_OVERRIDE}=emulated)" if caps.get("bf16_overridden") else f" ({caps['capability']})"
        return AutoChoice("fp32", "rule", f"bf16 is emulated on this CPU{by}, several times slower than fp32; "
                                          "not measured")
    if device.type == "cuda":
        if native and whole_model:
            return None
        if native:
            return AutoChoice("bf16-mixed", "rule", "this GPU has bf16 tensor cores, and the model is sharded over "
                                                    "GPUs (not measured)")
        return AutoChoice("fp32", "rule", "this GPU has no bf16 tensor cores (before Ampere)")
    return AutoChoice("bf16-mixed" if native else "fp32", "rule", f"rule for {device.type}")


def decide(ms: dict[str, float]) -> str:
    """bf16-mixed if it measured at least MARGIN faster than fp32, else fp32."""
    return "bf16-mixed" if ms["bf16-mixed"] < (1 - MARGIN) * ms["fp32"] else "fp32"


def _autocast(mode: str, device: torch.device) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "bf16-mixed")


def measure(forward: Callable[[], Any], device: torch.device | str, modes: tuple[str, ...] = CANDIDATES,
            *, after: Callable[[], None] | None = None, min_rounds: int = MIN_ROUNDS,
            max_rounds: int = MAX_ROUNDS, budget_s: float = BUDGET_S) -> dict[str, list[float]]:
    """Milliseconds of ``forward()`` under each mode's autocast and the backward of the loss it
    returns (outside autocast, as the trainer runs it; nothing for a non-tensor), then
    ``after()`` (untimed), interleaved in rounds after one untimed pass of each. A mode
    WARMUP_HOPELESS-ly slower in that first pass, or HOPELESS-ly slower in the first round, is
    not run again: its one time is its figure."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(mode: str) -> float:
        sync()
        start = time.perf_counter()
        with _autocast(mode, device):
            loss = forward()
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
        sync()  # note: waits for the device's kernels, so that the time is theirs
        elapsed = (time.perf_counter() - start) * 1e3
        if after is not None:
            after()
        return elapsed

    # first calls allocate, and oneDNN builds its kernels for the shapes: untimed, except that
    # a mode WARMUP_HOPELESS x slower than the other already is not run again (emulated bf16)
    first = {mode: _or_out_of_memory(timed, mode, after) for mode in modes}
    if all(math.isinf(t) for t in first.values()):
        raise torch.OutOfMemoryError(f"train.precision=auto: the model ran out of device memory in every mode "
                                     f"({', '.join(modes)}) while timing them")
    times: dict[str, list[float]] = {m: [] for m in modes}
    live = [m for m in modes if first[m] <= WARMUP_HOPELESS * min(first.values())]
    if len(live) < 2:  # decided: the first passes' times are the figures
        return {m: [first[m]] for m in modes}
    started = time.perf_counter()
    for r in range(max_rounds):
        for mode in (live if r % 2 == 0 else live[::-1]):  # neither mode always runs first
            times[mode].append(timed(mode))
        if r == 0:
            best = min(times[m][0] for m in live)
            live = [m for m in live if times[m][0] <= HOPELESS * best]
        if len(live) < 2 or (r + 1 >= min_rounds and time.perf_counter() - started > budget_s):
            break
    return times


def _or_out_of_memory(timed: Callable[[str], float], mode: str, after: Callable[[], None] | None) -> float:
    """``timed(mode)``, or infinity where the mode runs out of device memory (a model sized to fit
    in bf16 may not fit in fp32): that mode has lost, and its pass's memory is given back."""
    try:
        return timed(mode)
    except torch.OutOfMemoryError:
        if after is not None:
            after()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return math.inf


def choose(forward: Callable[[], Any], device: torch.device | str, *, after: Callable[[], None] | None = None,
           key: str | None = None, cache: bool = True) -> AutoChoice:
    """The rule's choice where there is one; else the measured one (cached under ``key``)."""
    ruled = rule(device, whole_model=True)
    if ruled is not None:
        return ruled
    if cache and key is not None:
        hit = _cache.get(CACHE, key)
        if hit is not None and set(hit.get("ms", {})) == set(CANDIDATES):
            return AutoChoice(decide(hit["ms"]), "cached", ms=hit["ms"])
    times = measure(forward, device, after=after)
    ms = {m: statistics.median(v) for m, v in times.items()}
    choice = AutoChoice(decide(ms), "measured", ms={m: round(v, 3) for m, v in ms.items()},
                        rounds=min(len(v) for v in times.values()))
    if cache and key is not None:
        _cache.put(CACHE, key, {"ms": choice.ms, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return choice


def signature(model: torch.nn.Module, batch: Any, device: torch.device | str, extra: str = "") -> str:
    """A key for the cache: the model's modules and parameter shapes, the batch's shapes, the
    device, the machine, torch's threads and version."""
    parts = [type(model).__qualname__, extra, str(torch.device(device)), torch.__version__,
             str(torch.get_num_threads()), hardware.cpu_model(), hardware.cpu_capability()["capability"],
             str(hardware.native_low_precision(device, torch.bfloat16))]
    if torch.device(device).type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    for name, m in model.named_modules():
        parts.append(f"{name}:{type(m).__name__}")
    for name, p in model.named_parameters():
        parts.append(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}")

    def shapes(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            parts.append(f"{tuple(x.shape)}:{x.dtype}")
        elif isinstance(x, dict):
            for k in sorted(x):
                parts.append(str(k))
                shapes(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                shapes(v)

    shapes(batch)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


@contextlib.contextmanager
def same_random() -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU and CUDA) random states are as they were on exit:
    dropout in the passes, or a loader's seed, draws nothing from the run's streams."""
    import numpy as np

    saved = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
             random.getstate(), np.random.get_state())
    try:
        yield
    finally:
        cpu, cuda, py, np_state = saved
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)
        np.random.set_state(np_state)


@contextlib.contextmanager
def untouched(model: torch.nn.Module) -> Iterator[None]:
    """Forward + backward passes inside leave no trace: the parameters' gradients, the buffers
    (BatchNorm's running statistics) and the random states are as they were on exit."""
    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = None  # fresh gradients, not accumulated into (an arena's views stay as they are)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with same_random():
            yield
    finally:
        with torch.no_grad():
            for p, g in grads:
                p.grad = g
            for b, saved in buffers:
                b.copy_(saved)


def choose_for_model(model: torch.nn.Module, loss: Callable[[], torch.Tensor], device: torch.device | str,
                     *, batch: Any = None, extra: str = "", cache: bool = True) -> AutoChoice:
    """fp32 or bf16-mixed for training ``model``, where ``loss()`` runs its forward on a real
    batch (``batch``, for the cache's key) and returns the loss; the passes leave the model,
    its gradients and the random state as they were."""
    ruled = rule(device, whole_model=True)
    if ruled is not None:
        return ruled
    was_training = model.training
    model.train()

    def fresh_grads() -> None:  # each pass writes new gradients, none accumulates into the last
        for p in model.parameters():
            p.grad = None

    try:
        with untouched(model):
            key = signature(model, batch, device, extra) if cache else None
            return choose(loss, device, after=fresh_grads, key=key, cache=cache)
    finally:
        model.train(was_training)
