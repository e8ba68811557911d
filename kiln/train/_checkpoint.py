"""Checkpoints that continue a run exactly, in any layout, and finding the one to resume from.

A checkpoint is a directory ``RUN_DIR/checkpoints/<name>/`` (``step-XXXXXXXX``, ``best``,
``final``) that every rank writes with ``torch.distributed.checkpoint``
(:func:`kiln.parallel.save_sharded`)::

    .metadata, __<rank>_0.distcp  tensors by name: model.<fqn>, optim.state.<fqn>.<state>,
                                  master.<fqn> (bf16-true's fp32 weights); each rank writes
                                  what it holds (its ZeRO or FSDP shard, its pipeline stage),
                                  tensors that ranks hold alike once
    kiln_meta.json                parameter groups, non-tensor optimizer state, and under
                                  "extra" the trainer's state: step, data position (epoch,
                                  micro-batches into it), scheduler, loss scaler, best-tracker,
                                  loss window, totals, config, kiln version
    rng-00000.pt, rng-00001.pt..  each rank's RNG states (Python, NumPy, torch, CUDA)

so that training N steps, being killed, and resuming gives, on CPU, the same weights to the
bit as training 2N steps in one go; and a run saved in one layout (processes, ZeRO stage,
FSDP, pipeline stages, tensor parallel) resumes in another with the same weights: DCP reads
each tensor by name into however the resuming run shards it. A resume with the same number of
processes restores every rank's RNG; with another, every rank takes rank 0's.

Writing is atomic (a ``.tmp`` directory renamed into place after its last file), so a kill in
the middle of a save never leaves a directory that looks complete and never damages the last
good checkpoint; with ``train.async_checkpoint`` the same directory is written in the
background (:class:`CheckpointWriter`), renamed into place once its last file is written.
Reading never executes code from the files: JSON, ``torch.load`` with ``weights_only=True``,
and DCP's metadata through an unpickler that admits only its own metadata classes.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from kiln.errors import CheckpointError, ConfigError
from kiln.train.run_dir import CHECKPOINTS, disk_full_in, interrupt_in

# Keys that may differ between a run's config and its checkpoint on resume: they change how long
# or how visibly the run goes on, or how it is laid out over processes, never what it computes.
RESUMABLE_CHANGES = (
    "train.max_steps", "train.epochs", "train.log_every", "train.eval_every", "train.progress",
    "train.checkpoint_every", "train.keep_checkpoints", "train.output_dir", "train.run_name",
    "train.loggers", "train.early_stopping", "train.async_checkpoint",
    # a step is data.batch_size samples however it is split: the data position counts steps
    "train.accumulate",
    # the layout: checkpoints are keyed by parameter name and reshard on load
    "parallel.", "data.workers", "data.persistent_workers", "data.prefetch_factor", "data.pin_memory",
    # the device: a checkpoint's tensors load onto any (written on CUDA, resumed on CPU, or back)
    "train.device",
)

_STEP_DIR = re.compile(r"step-(\d+)")


def _rng_file(rank: int) -> str:
    return f"rng-{rank:05d}.pt"


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


# ---------------------------------------------------------------------------------- writing


def named_masters(model: torch.nn.Module, precision: Any) -> dict[str, torch.Tensor] | None:
    """bf16-true: parameter name -> the fp32 master weight the optimizer steps in its place
    (the model holds bf16 copies, views into bf16 arenas laid out like the fp32 ones)."""
    masters = precision.masters
    if masters is None:
        return None
    name_of = {p.data_ptr(): n for n, p in model.named_parameters()}
    out = {}
    for (_, low), (_, params) in zip(masters.pairs, masters.optimizer.packed_params()):
        for view, p in zip(low.pviews, params):
            out[name_of[view.data_ptr()]] = p
    return out


def save_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: Any,
                    state: dict[str, Any]) -> Path:
    """Write checkpoint directory ``path``: a collective, every rank calls it. ``state`` (the
    trainer's non-tensor state, JSON) is rank 0's; every rank adds its own RNG states."""
    from kiln.parallel import save_sharded  # DCP: imported at the first save

    with _failed_save(path):
        return save_sharded(path, model, optimizer, extra=state, masters=named_masters(model, precision),
                            files={_rng_file(_rank()): rng_state()})


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def _failed_save(path: Path) -> Iterator[None]:
    """Around a save of ``path`` (or the wait for it): a Ctrl-C stays a Ctrl-C, and a full disk
    names the checkpoint it was writing."""
    try:
        yield
    except BaseException as exc:
        interrupt = interrupt_in(exc)
        if interrupt is not None and interrupt is not exc:
            # DCP wraps a Ctrl-C in its CheckpointException: a stop, not a failed save
            raise interrupt from None
        full = disk_full_in(exc)
        if full is not None and full.filename is None:
            full.filename = str(path)  # a write() names no file: the checkpoint being saved does
        raise


class CheckpointWriter:
    """Writes a run's checkpoints ``checkpoints/<name>/``, and keeps the newest ``keep``
    periodic ones. ``background=False``: each save is written before :meth:`save` returns.
    ``background=True`` (``train.async_checkpoint``): :meth:`save` copies the state to host
    memory and returns, the files are written while the next steps run
    (:class:`kiln.parallel.AsyncSaver`), and a save waits for the one in flight. The loop calls
    :meth:`poll` after each step (a finished save: its error raised, the old ones pruned) and
    :meth:`wait` before it ends; the final save is written at once, there being no step left to
    hide it behind. Collectives, except :meth:`poll`."""

    def __init__(self, run_dir: Path, keep: int, main: bool, background: bool):
        self.checkpoints, self.keep, self.main = Checkpoints(run_dir), keep, main
        self.background = None
        if background:
            from kiln.parallel import AsyncSaver

            self.background = AsyncSaver()
        self.writing: tuple[Path, bool] | None = None  # the save in flight, and whether to prune after it

    def save(self, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: Any,
             state: dict[str, Any], prune: bool = False, now: bool = False) -> None:
        """Save ``checkpoints/<name>``; with ``prune``, keep the newest ``keep`` periodic ones once
        it is written. ``now``: written before this returns, in the background mode too."""
        path = self.checkpoints.dir / name
        if self.background is None or now:
            self.wait()
            save_checkpoint(path, model, optimizer, precision, state)
            self._written(prune)
            return
        self.wait()
        with _failed_save(path):
            self.background.save(path, model, optimizer, extra=state, masters=named_masters(model, precision),
                                 files={_rng_file(_rank()): rng_state()})
        self.writing = (path, prune)

    def poll(self) -> None:
        """After a step: the background save, if it has ended, checked and followed up."""
        if self.background is not None and self.background.done():
            self.wait()

    def wait(self) -> None:
        """The save in flight written (its error, naming it, raised here) and followed up."""
        if self.writing is None:
            return
        (path, prune), self.writing = self.writing, None
        with _failed_save(path):
            self.background.wait()
        self._written(prune)

    def abandon(self) -> None:
        """When the run stops on an error or a signal: the save in flight let end (its own error
        dropped: the run's is the one reported), complete or left as ``.tmp`` debris, before the
        process group it writes with is closed."""
        if self.writing is not None:
            self.writing = None
            try:
                self.background.wait()
            except Exception:
                pass

    def _written(self, prune: bool) -> None:
        if prune and self.main:  # (no save is under way: pruning clears the .tmp debris too)
            self.checkpoints.prune(self.keep)


def load_into(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: Any) -> None:
    """Load a checkpoint's model, optimizer and master weights into this run, whatever its
    layout: a collective; each rank reads the parts it holds."""
    from kiln.parallel import load_sharded

    load_sharded(path, model, optimizer, masters=named_masters(model, precision))


# ---------------------------------------------------------------------------------- reading


def read_state(path: Path) -> dict[str, Any]:
    """The trainer's state in checkpoint ``path`` (step, data position, scheduler, ..., and
    ``rng``: every rank's RNG states, in rank order), after checking that the directory is
    complete; a CheckpointError naming it otherwise. Reads no tensor data."""
    from kiln.parallel import check_sharded

    try:
        meta = check_sharded(path)
        rng = [torch.load(path / _rng_file(r), map_location="cpu", weights_only=True)
               for r in range(meta["world_size"])]
        state = dict(meta["extra"])
        if "step" not in state:
            raise ValueError("no trainer state in it")
    except Exception as exc:  # missing file, cut short, bad pickle, unsafe global: all "unusable"
        reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({reason})") from None
    return {**state, "rng": rng}


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Read a kiln checkpoint in one process, whatever layout wrote it, without executing code
    from it: ``{"model": {name: tensor}, "optimizer": torch.optim-layout state dict,
    "masters": {name: fp32 tensor} (bf16-true) or None, "step", "scheduler", "rng", ...}``,
    every tensor whole. A damaged checkpoint is a CheckpointError naming it.

        >>> ckpt = load_checkpoint("runs/digits_vit-20260101-120000/checkpoints/final")  # doctest: +SKIP
        >>> model.load_state_dict(ckpt["model"])                                         # doctest: +SKIP
    """
    path = Path(path)
    if path.is_file():  # a single-file checkpoint of kiln before sharded checkpoints
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({type(exc).__name__}: {exc})") from exc
        if not isinstance(state, dict) or "model" not in state or "step" not in state:
            raise CheckpointError(f"{path} is not a kiln checkpoint (no model state or step)")
        return state
    state = read_state(path)
    from kiln.parallel import read_sharded

    try:
        tensors, meta = read_sharded(path)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({type(exc).__name__}: {exc})") from None
    if map_location not in (None, "cpu"):
        tensors = {k: v.to(map_location) for k, v in tensors.items()}

    def under(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    # torch.optim's layout: parameters numbered through the groups in order
    opt_state: dict[int, dict[str, Any]] = {}
    groups, index = [], 0
    for group in meta["param_groups"]:
        ids = list(range(index, index + len(group["params"])))
        for i, fqn in zip(ids, group["params"]):
            entry = meta["state"].get(fqn)
            if entry is not None:
                opt_state[i] = {**{k: tensors[f"optim.state.{fqn}.{k}"] for k in entry["tensors"]}, **entry["other"]}
        groups.append({**group["hyper"], "params": ids})
        index += len(ids)
    masters = under("master.")
    return {**state, "model": under("model."), "optimizer": {"state": opt_state, "param_groups": groups},
            "masters": masters or None}


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a run to continue from or export: ``checkpoints/step-N/`` or ``final/``."""

    path: Path
    step: int | float  # saved at; a final/ whose step cannot be read: inf, the newest (reading it says why)

    @property
    def final(self) -> bool:
        return self.path.name == "final"

    def read(self) -> dict[str, Any]:
        """Its trainer state (:func:`read_state`): a CheckpointError naming it if it is incomplete."""
        return read_state(self.path)


class Checkpoints:
    """The checkpoints of run directory ``run_dir`` that a run continues from or exports: the
    periodic ``step-N/`` and ``final/`` (``best/`` is read by name only). The one place that says
    which is the newest, which is the newest good one, which is at step N and which go: resume,
    ``kiln export``, pruning and every message that names a checkpoint ask it.

        >>> ckpts = Checkpoints("runs/digits_vit-20260101-120000")   # doctest: +SKIP
        >>> ckpts.latest_good().path                                 # doctest: +SKIP
        PosixPath('runs/digits_vit-20260101-120000/checkpoints/step-00000300')
    """

    def __init__(self, run_dir: Path | str):
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / CHECKPOINTS

    def __iter__(self) -> Iterator[Checkpoint]:
        """Oldest first, by step; final/ after a periodic one of its step (it holds the finished
        run's state). final/ goes by the step it was saved at: a run resumed past its end saves
        later periodic checkpoints, which a crash must not lose to the old final one."""
        found = [Checkpoint(path, int(match.group(1))) for path in self.dir.glob("step-*")
                 if (match := _STEP_DIR.fullmatch(path.name)) and path.is_dir()]
        final = self.dir / "final"
        if final.is_dir():
            try:
                from kiln.parallel import META_FILE

                step = int(json.loads((final / META_FILE).read_text())["extra"]["step"])
            except Exception:
                step = math.inf
            found.append(Checkpoint(final, step))
        return iter(sorted(found, key=lambda c: (c.step, c.final)))

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint, complete or not (read it to know); None if there is none."""
        return next(reversed(list(self)), None)

    def latest_good(self) -> Checkpoint | None:
        """The newest checkpoint that reads complete; None if there is none."""
        for ckpt in reversed(list(self)):
            try:
                ckpt.read()
            except CheckpointError:
                continue  # cut short by a save that died, or damaged since
            return ckpt
        return None

    def at(self, step: int) -> Checkpoint:
        """The checkpoint of step ``step`` (final/, if a periodic one has its step too); a
        CheckpointError listing the steps there if none has it."""
        found = {c.step: c for c in self}
        if step not in found:
            have = ", ".join(f"{c.step}{' (final)' if c.final else ''}" for c in found.values())
            raise CheckpointError(f"{self.run_dir} has no checkpoint of step {step}; it has steps {have}: "
                                  "pick one with --step, or leave it out for the newest")
        return found[step]

    def prune(self, keep: int) -> None:
        """Keep the newest ``keep`` periodic checkpoints (final/ and best/ are never removed), and
        clear the debris of saves that died. Call it when no save is under way."""
        periodic = [c.path for c in self if not c.final]
        for path in periodic[: max(0, len(periodic) - keep)]:
            # renamed first, so that a kill in the middle of the removal leaves debris, never a
            # half-deleted directory that looks like a checkpoint
            path.rename(path.with_name(path.name + ".tmp"))
        for pattern in ("*.tmp", "*.old"):
            for path in self.dir.glob(pattern):
                shutil.rmtree(path, ignore_errors=True)


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a checkpoint to continue from (complete or not)."""
    return Checkpoints(run_dir).latest() is not None


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
        if key == "train.precision" and b == "auto" and a in ("fp32", "bf16-mixed"):
            return  # what auto chose when the run started (the resumed run keeps it)
        if a != b:
            out.append(f"{key}: checkpoint {a!r}, config {b!r}")

    walk(saved, current, "")
    return out


def checkpoint_to_resume(run_dir: Path, cfg: Any) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to continue ``run_dir`` from, the newest, and its trainer state, after
    checking that it matches ``cfg``; if it is damaged, the error names it and the last good one."""
    ckpts = Checkpoints(run_dir)
    newest = ckpts.latest()
    if newest is None:
        raise CheckpointError(
            f"{run_dir} has no checkpoint to resume from (checkpoints/ is empty); the run stopped before "
            f"its first save. Start it again with `kiln train {run_dir}/config.yaml`, and set "
            "train.checkpoint_every=N to save every N steps"
        )
    try:
        state = newest.read()
    except CheckpointError as exc:
        good = ckpts.latest_good()
        fix = (f"the last good checkpoint is {good.path}; move {newest.path.name} out of the way to resume from it"
               if good else "no earlier checkpoint loads either")
        raise CheckpointError(f"{exc}; {fix}") from None
    mismatch = config_mismatch(state.get("config") or {}, plain(cfg))
    if mismatch:
        raise ConfigError(
            f"{run_dir}/config.yaml does not match checkpoint {newest.path.name}: " + "; ".join(mismatch)
            + ". Resume with the config the checkpoint was trained with, or start a new run"
        )
    return newest.path, state


def plain(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)
