"""The small pieces the loop calls at fixed points, in this order after each evaluation:

1. loggers (``Loggers.log``, kiln/train/_loggers.py): metrics.csv always, and TensorBoard,
   Weights & Biases and MLflow where ``train.loggers`` names them;
2. early stopping (``EarlyStopping.update``): records the best value and says when to stop;
3. the best checkpoint is written when early stopping says the metric improved.

No hooks fire in an order you have to memorise: ``loop.py`` calls each of these by name.
"""

from __future__ import annotations

import math
from typing import Any


class EarlyStopping:
    """Stop when ``metric`` has not improved by more than ``min_delta`` for ``patience``
    evaluations in a row. ``mode="min"`` for losses, ``"max"`` for accuracies."""

    def __init__(self, metric: str, mode: str = "min", patience: int = 5, min_delta: float = 0.0):
        self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, min_delta
        self.best = math.inf if mode == "min" else -math.inf
        self.best_step: int | None = None
        self.bad_evals = 0
        self.stopped_step: int | None = None
        self.reason: str | None = None

    def improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def update(self, step: int, metrics: dict[str, float]) -> tuple[bool, bool]:
        """Returns ``(improved, stop)`` after an evaluation at ``step``."""
        value = metrics[self.metric]
        if self.improved(value):
            self.best, self.best_step, self.bad_evals = value, step, 0
            return True, False
        self.bad_evals += 1
        if self.bad_evals >= self.patience:
            self.stopped_step = step
            self.reason = (
                f"{self.metric} did not improve by more than {self.min_delta:g} for {self.patience} "
                f"evaluations (best {self.best:.6g} at step {self.best_step})"
            )
            return False, True
        return False, False

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step, self.bad_evals = state["best"], state["best_step"], state["bad_evals"]
