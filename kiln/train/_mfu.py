"""The run's MFU (model FLOPs utilization): the FLOPs a step does, counted once, on the first
step of each process (:class:`kiln.hardware.flops.CountFlops`; docs/lab/facts.md, 'Host time'), against
the peak FLOP/s of the devices that run it (:func:`kiln.hardware.flops.peak_flops`: a GPU's
datasheet, a CPU's matmul measured once and cached), taken at setup, before the clock starts.

FLOPs are counted per sample, so a window of steps of any size (an epoch's short last step)
is scored right: ``mfu = flops_per_sample x samples/s / (peak x processes)``. Each rank counts
what it runs and the counts are summed over ranks; under tensor parallelism each rank sees its
operators with the whole tensors' shapes (DTensor), so the sum is divided by ``tp``.
Recomputation under activation checkpointing is counted: it is work the device does, which
makes this the hardware FLOPs utilization where checkpointing is on.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch

from kiln.hardware.flops import CountFlops, mfu, peak_flops

__all__ = ["Mfu"]


def _compute_dtype(precision: Any) -> torch.dtype:
    """The dtype the step's matmuls run in."""
    if precision.autocast_dtype is not None:
        return precision.autocast_dtype
    return torch.bfloat16 if precision.mode == "bf16-true" else precision.param_dtype


class Mfu:
    """``flops_per_step``, ``peak`` (FLOP/s of one device, None where unknown) and :meth:`of`."""

    def __init__(self, device: torch.device, precision: Any, world: int, tp: int, main: bool):
        self.world, self.tp = world, tp
        self.dtype = _compute_dtype(precision)
        # rank 0 alone reports it; measured before the run's clock starts (cached after once)
        self.peak, self.peak_source = peak_flops(device, self.dtype) if main else (None, "")
        self.flops_per_step: float | None = None
        self.flops_per_sample: float | None = None

    def count(self, samples: int, compiled: bool = False) -> contextlib.AbstractContextManager:
        """Count the FLOPs of the step run inside, the first time only (``samples``: the step's,
        over all ranks); a collective the first time, when there are several ranks.

        A compiled model's step is counted eagerly (``torch.compiler.set_stance("force_eager")``),
        and not on its first call (``compiled``: pass True then, and count a later step): dynamo
        meeting the counter's dispatch mode on a model's first call left that model eager for
        the whole run (kiln compile trained at eager speed on an H200: docs/lab/gpu.md)."""
        if self.flops_per_step is not None or compiled:
            return contextlib.nullcontext()
        return self._counted(samples)

    @contextlib.contextmanager
    def _counted(self, samples: int) -> Iterator[None]:
        # (without dynamo loaded nothing is compiled: no stance to set, and no seconds spent importing it)
        eager = torch.compiler.set_stance("force_eager") if "torch._dynamo" in sys.modules else contextlib.nullcontext()
        with eager, CountFlops() as counted:
            yield
        total = float(counted.total)
        if self.world > 1:
            import torch.distributed as dist

            summed = torch.tensor([total], dtype=torch.float64)
            if dist.get_backend() == "nccl":
                summed = summed.cuda()
            dist.all_reduce(summed)
            total = float(summed.item()) / self.tp
        self.flops_per_step, self.flops_per_sample = total, total / max(samples, 1)

    def of(self, samples_per_second: float | None) -> float | None:
        """The MFU at ``samples_per_second`` (all ranks together)."""
        if samples_per_second is None or self.flops_per_sample is None:
            return None
        return mfu(self.flops_per_sample * samples_per_second, 1.0, self.peak, self.world)

    def summary(self, samples_per_second: float | None) -> dict[str, Any]:
        """For summary.json: ``mfu`` where a peak is known, the FLOPs per step and the peak."""
        out: dict[str, Any] = {"flops_per_step": self.flops_per_step}
        if self.peak:
            value = self.of(samples_per_second)
            out.update(mfu=value, peak_flops=self.peak,
                       peak_flops_source=self.peak_source, peak_flops_devices=self.world)
        return out
