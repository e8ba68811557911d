"""Training: ``kiln.train.train(cfg)`` runs a validated config and writes a run directory.

The loop itself is ``kiln/train/loop.py``, one file to read top to bottom; what a run is built
from is ``kiln/train/_setup.py``. How ``kiln train`` starts its processes and how they end is
:mod:`kiln.launch`, which reads the run directory (:mod:`kiln.train.run_dir`) and each rank's
sign of life (:mod:`kiln.train.heartbeat`).
"""

from kiln.train._build import build_model, check_model
from kiln.train._checkpoint import Checkpoint, Checkpoints, has_checkpoint, load_checkpoint
from kiln.train._loggers import check_loggers
from kiln.train._ranks import check_layout
from kiln.train._setup import check_resume
from kiln.train.run_dir import RunDir, read_metrics
from kiln.train.loop import RunResult, train

__all__ = ["Checkpoint", "Checkpoints", "RunDir", "RunResult", "build_model", "check_layout", "check_loggers",
           "check_model", "check_resume", "has_checkpoint", "load_checkpoint", "read_metrics", "train"]
