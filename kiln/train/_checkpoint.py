"""Checkpoints that continue a run exactly, and finding the one to resume from.

A checkpoint holds the model, the optimizer (its arena state), the schedule, the loss scaler,
the step, the position in the data (epoch and micro-batches consumed in it), the early-stopping
state and the RNG states of Python, NumPy and torch, so that training N steps, being killed,
and resuming gives, on CPU, the same weights to the bit as training 2N steps in one go.

Files are written atomically (temporary name, fsync, rename), so a kill in the middle of a save
never damages the last good checkpoint, and they are read with ``weights_only=True``: loading
never executes code from the file.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Keys that may differ between a run's config and its checkpoint on resume: they change how long
# or how visibly the run goes on, never what it computes.
RESUMABLE_CHANGES = (
    "train.max_steps", "train.epochs", "train.log_every", "train.eval_every", "train.progress",
    "train.checkpoint_every", "train.keep_checkpoints", "train.output_dir", "train.run_name",
    "train.loggers", "train.early_stopping",
    # the layout: checkpoints hold full, unsharded state, and every layout computes the same step
    "parallel.dp", "parallel.zero", "parallel.timeout_s", "data.workers", "data.persistent_workers",
    "data.prefetch_factor", "data.pin_memory",
)

_STEP_FILE = re.compile(r"step-(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        # NumPy's key array as a tensor: weights_only loading accepts tensors, not ndarrays
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(x: Any) -> Any:
    # random.setstate needs tuples; a round trip through some formats turns them into lists
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def step_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the periodic checkpoints, oldest first."""
    found = []
    for path in (run_dir / "checkpoints").glob("step-*.pt"):
        match = _STEP_FILE.search(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Read a kiln checkpoint without executing code from it (``weights_only=True``); a
    damaged file is a CheckpointError naming it."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated zip, bad pickle, unsafe global: all mean "unusable"
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"{path} is not a kiln checkpoint (no model state or step)")
    return state


def latest(run_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint of a run that loads; if the newest is damaged, the error names
    it and the last good one."""
    candidates = [p for _, p in step_checkpoints(run_dir)]
    final = run_dir / "checkpoints" / "final.pt"
    if final.exists():
        candidates.append(final)
    if not candidates:
        raise CheckpointError(
            f"{run_dir} has no checkpoint to resume from (checkpoints/ is empty); the run stopped before "
            "its first save. Start it again with `kiln train {run_dir}/config.yaml`, and set "
            "train.checkpoint_every=N to save every N steps"
        )
    newest = candidates[-1]
    try:
        return newest, load_checkpoint(newest)
    except CheckpointError as exc:
        good = None
        for path in reversed(candidates[:-1]):
            try:
                load_checkpoint(path)
                good = path
                break
            except CheckpointError:
                continue
        fix = (f"the last good checkpoint is {good}; move {newest.name} out of the way to resume from it"
               if good else "no earlier checkpoint loads either")
        raise CheckpointError(f"{exc}; {fix}") from None


def config_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two config trees, ignoring RESUMABLE_CHANGES."""
    out: list[str] = []

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                walk(a.get(key), b.get(key), f"{prefix}{key}.")
            return
        key = prefix[:-1]
        if key.startswith(RESUMABLE_CHANGES):
            return
        if a != b:
            out.append(f"{key}: checkpoint {a!r}, config {b!r}")

    walk(saved, current, "")
    return out


def prune(run_dir: Path, keep: int) -> None:
    """Keep the newest ``keep`` periodic checkpoints; final.pt and best.pt are never removed."""
    found = step_checkpoints(run_dir)
    for _, path in found[: max(0, len(found) - keep)]:
        path.unlink(missing_ok=True)


def checkpoint_to_resume(run_dir: Path, cfg: Any) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to continue ``run_dir`` from, after checking it matches ``cfg``."""
    from kiln.config import ConfigError

    path, ckpt = latest(run_dir)
    mismatch = config_mismatch(ckpt.get("config") or {}, plain(cfg))
    if mismatch:
        raise ConfigError(
            f"{run_dir}/config.yaml does not match checkpoint {path.name}: " + "; ".join(mismatch)
            + ". Resume with the config the checkpoint was trained with, or start a new run"
        )
    return path, ckpt


def plain(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)
