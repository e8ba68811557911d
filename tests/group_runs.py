"""Several ``kiln train`` runs in one group of gloo processes, started once.

``kiln train --nproc 2`` starts a launcher and a fork server, each importing torch and kiln's
trainer, and forks two ranks from the server: ~11 s of CPU for a 2-step MLP run on the 2-core
test machine, nearly all of it start-up. A test that compares several multi-process runs with one
process starts the group once here and runs each config in it in turn, as a worker that
``kiln train --nproc N`` starts runs its one config (``kiln.train.train`` in a process group it
did not make up, which it leaves as it found it; ``kiln bench vit`` runs its rows this way).
What the launcher itself does (the run directory's lock, a dead rank, restarts, signals) is
tested through the CLI, in tests/test_distributed_train.py and tests/test_run_safety.py.
"""

from __future__ import annotations

from pathlib import Path


def _train_each(rank: int, world: int, runs: list[tuple[str, list[str]]]) -> list[str]:
    from kiln.config import load_config
    from kiln.train import train

    return [str(train(load_config(config, overrides)).run_dir) for config, overrides in runs]


def train_in_one_group(world: int, runs: list[tuple[str, list[str]]], timeout_s: float = 300) -> list[Path]:
    """Train each ``(config, overrides)`` of ``runs``, in turn, in ``world`` gloo processes
    started once; return each run's directory (each override list names its own
    ``train.output_dir``)."""
    from kiln.launch.testing import run_distributed

    return [Path(p) for p in run_distributed(_train_each, world, runs, timeout_s=timeout_s)[0]]
