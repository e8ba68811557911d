"""The stream of optimizer steps a run consumes, resumable at any step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.data import StepSampler


@dataclass
class Step:
    """One optimizer step's data on this rank."""

    epoch: int
    micro: list[Any]  # this rank's micro-batches, train.accumulate of them
    samples: int  # samples in the whole step, over every rank and micro-batch


class Batches:
    """``next()`` gives the next :class:`Step` forever; an epoch is a whole number of steps.

    With a :class:`kiln.data.StepSampler` (every map-style data set) the loader's epoch already
    ends on a step boundary and says how many samples each step holds. A stream (an iterable
    data set) ends where it ends: the micro-batches of a step it cuts short are dropped, as
    ``drop_last`` drops a short batch, so no step mixes two epochs.

    Built at ``(epoch, step)`` it replays the first ``step`` steps of that epoch (loading and
    discarding them, so that loader workers' random streams advance as in an uninterrupted
    run); the order depends only on the seed and the epoch, so the resumed run sees exactly
    the steps it would have seen, in any layout.
    """

    def __init__(self, loader: Any, accumulate: int, batch_size: int, epoch: int = 0, step: int = 0):
        self.loader, self.accumulate, self.batch_size = loader, accumulate, batch_size
        self.plan = step_plan(loader)
        self.steps_per_epoch = steps_per_epoch(loader, accumulate)
        if self.steps_per_epoch and step >= self.steps_per_epoch:  # saved at the very end of an epoch
            epoch, step = epoch + 1, 0
        self.epoch, self.step = epoch, 0
        self._it = self._start()
        for _ in range(step):
            next(self)

    def _start(self) -> Any:
        set_epoch = getattr(self.loader, "set_epoch", None) or getattr(self.loader.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        return iter(self.loader)

    def __next__(self) -> Step:
        micro: list[Any] = []
        restarts = 0
        while len(micro) < self.accumulate:
            try:
                micro.append(next(self._it))
            except StopIteration:
                restarts += 1
                if restarts > 1:
                    raise ValueError("the training data yielded no whole step in an epoch: fewer than "
                                     f"train.accumulate={self.accumulate} micro-batches") from None
                self.epoch, self.step, micro = self.epoch + 1, 0, []
                self._it = self._start()
        samples = self.plan.step_samples(self.step) if self.plan else self.batch_size
        self.step += 1
        return Step(self.epoch, micro, samples)

    @property
    def epochs_done(self) -> float:
        """Epochs completed, fractional (for logs)."""
        return self.epoch + (self.step / self.steps_per_epoch if self.steps_per_epoch else 0.0)


def step_plan(loader: Any) -> Any:
    """The loader's :class:`kiln.data.StepSampler`, or None (a stream)."""

    plan = getattr(loader, "batch_sampler", None)
    return plan if isinstance(plan, StepSampler) else None


def steps_per_epoch(loader: Any, accumulate: int) -> int:
    """Whole optimizer steps in one epoch of ``loader`` (0: a stream of unknown length)."""
    plan = step_plan(loader)
    if plan is not None:
        return plan.steps_per_epoch
    try:
        return len(loader) // accumulate
    except TypeError:  # a stream without a length
        return 0
