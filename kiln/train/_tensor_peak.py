"""The peak of live tensor memory over a run's first steps: ``summary.json``'s
``peak_tensor_memory_mb``, the allocator's figure, not the process's resident set.

On CUDA it is ``torch.cuda.max_memory_allocated``. On CPU there is no allocator statistic,
but ``torch.profiler.profile(profile_memory=True)`` records every allocation and free of the
CPU allocator as a ``[memory]`` event: the running sum of their sizes, in time order, on top
of the bytes already live when profiling starts (the model, its gradients and buffers, the
optimizer's state and buffers), peaks where the step's live tensors do. The first two steps
of a process are measured (the second is a steady one: the optimizer state exists), and then
no more: the profiler costs time, and those steps are left out of the run's speed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from kiln._profiling import profiled
from kiln.optim import KilnOptimizer, local_tensor


__all__ = ["TensorMemory", "live_tensor_bytes"]

STEPS = 2  # steps measured at the start of each process


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors a model or optimizer holds: a kiln optimizer's (wrapped by ZeRO or not)
    flat gradient, state and scratch buffers besides the views of them its parameters and
    state hold (a torch optimizer's parameters, gradients and state alone)."""
    if isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from obj.buffers()
        return
    for group in obj.param_groups:
        for p in group["params"]:
            yield p
            if p.grad is not None:
                yield p.grad
    for st in obj.state.values():
        yield from (v for v in st.values() if torch.is_tensor(v))
    if isinstance(obj, KilnOptimizer):
        yield from obj.grad_buffers()
        yield from obj.state_tensors()


def live_tensor_bytes(*holders: Any) -> int:
    """Bytes of the distinct storages behind the tensors of ``holders`` (models, optimizers;
    a DTensor: its local shard's)."""
    seen: dict[tuple[str, int], int] = {}
    for holder in holders:
        for t in _tensors(holder):
            t = local_tensor(t)
            st = t.untyped_storage()
            if t.device.type != "meta" and st.nbytes():
                seen[(str(t.device), st.data_ptr())] = st.nbytes()
    return sum(seen.values())


class TensorMemory:
    """Measures the peak of live tensor bytes over the first :data:`STEPS` steps it wraps."""

    def __init__(self, device: torch.device, holders: tuple[Any, ...], enabled: bool = True) -> None:
        self.device, self.holders, self.enabled = device, holders, enabled
        self.steps = 0
        self.peak_bytes: int | None = None

    @property
    def measuring(self) -> bool:
        """The next step is measured."""
        return self.enabled and self.steps < STEPS

    def step(self) -> contextlib.AbstractContextManager:
        """Around a step: measured while :attr:`measuring`, then nothing to enter."""
        return self._measured() if self.measuring else contextlib.nullcontext()

    @contextlib.contextmanager
    def _measured(self) -> Iterator[None]:
        if self.device.type == "cuda":
            if self.steps == 0:
                torch.cuda.reset_peak_memory_stats(self.device)
            yield
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            base = live_tensor_bytes(*self.holders)
            with profiled(profile_memory=True) as prof:
                yield
            peak = base + _running_peak(prof)
        self.steps += 1
        self.peak_bytes = max(self.peak_bytes or 0, peak)

    def peak_mb(self, world: int) -> float | None:
        """The fullest rank's peak, in MiB (a collective with several ranks); None unmeasured."""
        peak = torch.tensor(float(self.peak_bytes if self.peak_bytes is not None else -1), dtype=torch.float64)
        if world > 1:
            import torch.distributed as dist

            on = peak.to(self.device) if dist.get_backend() == "nccl" else peak
            dist.all_reduce(on, op=dist.ReduceOp.MAX)
            peak = on.cpu()
        return None if peak.item() < 0 else peak.item() / 2**20


def _running_peak(prof: Any) -> int:
    """The highest running sum of the profiled CPU allocations and frees, in time order."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
                     and e.device_type() == torch.autograd.DeviceType.CPU), key=lambda e: e.start_ns())
    total = peak = 0
    for e in events:
        total += e.nbytes()
        peak = max(peak, total)
    return peak
