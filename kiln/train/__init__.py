"""Training: ``kiln.train.train(cfg)`` runs a validated config and writes a run directory.

The loop itself is ``kiln/train/loop.py``, one file to read top to bottom.
"""

from kiln.train._checkpoint import load_checkpoint
from kiln.train._run_dir import read_metrics
from kiln.train.loop import RunResult, train

__all__ = ["RunResult", "load_checkpoint", "read_metrics", "train"]
