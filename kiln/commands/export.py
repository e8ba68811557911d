"""``kiln export RUN_DIR --to hf DIR``: a run's model at one of its checkpoints, in the Hugging
Face layout, for ``from_pretrained``.

    >>> export_run("runs/hf_gpt2_tiny-20260101-120000", "/tmp/gpt2-step100", step=100)  # doctest: +SKIP
    PosixPath('/tmp/gpt2-step100')

A run's end writes its final model to ``RUN_DIR/hf/`` the same way
(:func:`kiln.hf.export_checkpoint`). This is a module of its own, not imported by ``kiln.hf``:
``kiln.train`` imports ``kiln.hf`` to build and load models, and this module reads a run
directory with ``kiln.train``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

from kiln.config import load_config
from kiln.errors import CheckpointError
from kiln.hf import describe, export_checkpoint
from kiln.train import Checkpoints, build_model

__all__ = ["export_run"]


def export_run(run_dir: Path | str, to: Path | str, *, step: int | None = None,
               say: Callable[[str], None] | None = None) -> Path:
    """Write the model of run ``run_dir`` at its checkpoint of step ``step`` (default: the
    newest) to ``to`` (replaced if it exists), in this process, whatever layout the run had: the
    model is built from the run's config.yaml and filled from the checkpoint. ``say`` gets a
    line before and after.

    CheckpointError: not a run directory, no checkpoint of that step (the message lists those
    there), a damaged checkpoint; ConfigError: the run's model is not a transformers one."""
    run_dir, to = Path(run_dir), Path(to)
    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(f"{run_dir} is not a kiln run directory (no config.yaml in it)")
    ckpts = Checkpoints(run_dir)
    if ckpts.latest() is None:
        raise CheckpointError(f"{run_dir} has no checkpoint (checkpoints/ holds none): nothing to export; "
                              "train with train.checkpoint_every=N to save every N steps")
    ckpt = ckpts.at(step) if step is not None else ckpts.latest()
    ckpt.read()  # complete, or a CheckpointError naming it
    cfg = load_config(run_dir / "config.yaml")
    if say is not None:
        say(f"kiln: exporting {run_dir} at step {ckpt.step} ({ckpt.path.name}) to {to} (Hugging Face layout)")
    written = export_checkpoint(partial(build_model, cfg.model), ckpt.path, to)
    if say is not None:
        say(f"kiln: wrote {written}: {describe(written)}; load it with from_pretrained({str(written)!r})")
    return written
