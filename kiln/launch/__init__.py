"""How a ``kiln train`` process starts and ends: in one process, as the launcher of N local
processes, or as one rank of them; and how every ``kiln`` command ends, as an exit status.

    train_command(config, overrides, resume=None, nproc=1)
        started by torchrun (LOCAL_RANK set)   one rank of the run: kiln's launcher started
                                               it, or the user's torchrun on several machines
        else: the checks (resume, layout, whether the plan fits the machine, and the model
                                               for N > 1), before any process starts
        nproc == 1                             the whole run, in this process
        nproc > 1                              the launcher: the run directory made or opened,
                                               and locked; N processes under torchrun's elastic
                                               agent, forked from a fork server that imported
                                               torch and the trainer once; how they ended,
                                               recorded and said
    exit_status(command)                       stop signals, and the exit status of an error

Exit status: 0, the run completed; 1, it failed (or a disk filled up: one line, naming the last
good checkpoint); 2, an error the user can fix (a config, a checkpoint, a run directory that
another process writes: one line, no traceback); 128 + N, stopped by signal N (SIGINT: Ctrl-C,
130; SIGTERM, what schedulers send before they kill, 143), its checkpoints intact.

The launcher's workers learn where the run is from ``KILN_RUN_DIR`` (what a user sets to name a
run under their own torchrun), and that the launcher holds the run directory's lock for them
from the lock itself: it names their parent (``RunLock``). Once the directory holds a checkpoint,
a restarted worker continues from it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from kiln.config import load_config
from kiln.errors import (SHOWN_WARNINGS_ENV, CheckpointError, ConfigError, KilnWarning, one_line_warnings,
                         shown_warnings)
from kiln.train import Checkpoints, check_layout, check_loggers, check_model, check_resume, has_checkpoint, train
from kiln.train.heartbeat import EVERY_S, HEARTBEAT_DIR_ENV, beat, read_beats, silent_ranks
from kiln.train.run_dir import (
    CONFIG,
    RunDir,
    RunDirBusy,
    disk_full_in,
    held_by_parent,
    mark_stopped,
    parent_pid,
    stop_signals,
    stopped_by,
)

__all__ = ["EXIT_USAGE", "RUN_DIR_ENV", "exit_status", "train_command"]

EXIT_USAGE = 2
RUN_DIR_ENV = "KILN_RUN_DIR"


def train_command(config: str | None, overrides: list[str], *, resume: str | Path | None = None, nproc: int = 1,
                  max_restarts: int = 0, rank_logs: Path | None = None) -> int:
    """``kiln train CONFIG [key=value ...]`` (or ``--resume RUN_DIR``), this process's part of it;
    returns the exit status: 0 if the run completed, 1 if it did not. ``rank_logs``: this
    process is the launcher even of one process, whose ranks write their output under that
    folder, not to this process's (``kiln tune``'s trials: each in processes of its own, forked
    from the fork server the trials share, not a new interpreter each)."""
    run_dir = Path(resume) if resume is not None else None
    if run_dir is not None and not (run_dir / CONFIG).is_file():
        raise CheckpointError(f"{run_dir} is not a kiln run directory (no {CONFIG} in it)")
    cfg = load_config(run_dir / CONFIG if run_dir is not None else config, overrides)  # checked here, first
    name = _run_name(Path(config)) if run_dir is None else "run"
    chosen = cfg.parallel.auto
    if chosen:
        if "LOCAL_RANK" in os.environ or run_dir is not None:
            raise ConfigError("parallel.auto=true is chosen once, by kiln train --nproc N before any process "
                              "starts (not by each rank under torchrun, nor on --resume): run kiln tune CONFIG "
                              "--nproc N --memory-budget SIZE and pass its overrides, or set parallel.auto=false")
        from kiln.plan.search import auto_overrides

        # the layout, ZeRO, micro-batch and checkpointing, chosen here: the ranks, config.yaml and a
        # rerun from it get the chosen values and parallel.auto=false
        overrides = [*overrides, *auto_overrides(config, overrides, nproc)]
        cfg = load_config(config, overrides)
    if "LOCAL_RANK" in os.environ:  # one rank under torchrun: kiln's launcher checked, and setup checks
        return _train_here(cfg, run_dir, name, worker=True)
    if run_dir is not None:
        # a run another process writes, a checkpoint that does not match, a finished run
        # (refused with how to extend it)
        check_resume(run_dir, cfg)
    check_layout(cfg, nproc)  # dp x tp x pp against the processes
    check_loggers(cfg.train.loggers)  # W&B's key, MLflow's server: before the plan, the processes, the model
    if not chosen:  # (parallel.auto's choice was planned to fit already)
        from kiln.plan import check_fits

        check_fits(cfg, nproc)  # a config whose plan exceeds the machine, refused before it allocates
    if nproc == 1 and rank_logs is None:
        return _train_here(cfg, run_dir, name, worker=False)
    check_model(cfg)  # on the meta device: what the model allows
    rank = (None, overrides, str(run_dir)) if run_dir is not None else (config, overrides, None)
    if run_dir is None and os.environ.get(RUN_DIR_ENV):
        run_dir = Path(os.environ[RUN_DIR_ENV])  # the user named the run directory: the launcher opens it
    return _launch(rank, nproc, max_restarts, run_dir, cfg.train.output_dir, cfg.train.run_name or name, rank_logs,
                   timeout_s=cfg.parallel.timeout_s)


def _run_name(config: Path) -> str:
    if config.stem == "config":  # RUN_DIR/config.yaml: name the rerun after the run directory
        return re.sub(r"-\d{8}-\d{6}(-\d+)?$", "", config.resolve().parent.name) or "run"
    return config.stem


def _train_here(cfg: Any, run_dir: Path | None, name: str, *, worker: bool) -> int:
    """The run in this process, or this rank's part of it (``worker``: started by torchrun).
    ``KILN_RUN_DIR`` names a new run's directory; once it holds a checkpoint (an elastic
    restart), the run continues from it."""
    run = train
    if worker:
        # record the error, so that torchrun's agent (kiln's launcher) can say what failed and where
        from torch.distributed.elastic.multiprocessing.errors import record

        run = record(train)
    shared = os.environ.get(RUN_DIR_ENV)
    if run_dir is None and shared and has_checkpoint(Path(shared)):
        run_dir = Path(shared)
    if run_dir is not None:
        result = run(cfg, resume=run_dir)
    else:
        result = run(cfg, name=name, run_dir=Path(shared) if shared else None)
    return 0 if result.summary.get("status") == "completed" else 1


def _launch(rank: tuple[str | None, list[str], str | None], nproc: int, max_restarts: int, run_dir: Path | None,
            output_dir: str, name: str, rank_logs: Path | None = None, *, timeout_s: float = 600.0) -> int:
    """Run ``train_command(*rank)`` (config, overrides, resume) in ``nproc`` local processes
    under torchrun's elastic agent.

    This process, the launcher, creates (or reopens) the run directory and holds its lock
    for the whole run: rank 0 may die and be restarted by the agent without ever meeting its
    own lock, and a second ``kiln train --resume`` of the directory is refused while the run
    lives. When rank 0 could not record how the run ended, the launcher marks it; when a rank
    failed, the launcher's line names the rank that died or stopped answering (its heartbeat:
    ``timeout_s``, parallel.timeout_s, is how long the others waited for it)."""
    import logging
    import shutil
    import tempfile

    import torch.distributed.launcher.api  # noqa: F401  (first: importing torchrun's agent sets its logger's level)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    out = RunDir.open(run_dir) if run_dir is not None else RunDir.create(output_dir, name)  # locked
    run_dir = out.path
    beats = Path(tempfile.mkdtemp(prefix="kiln-heartbeats-"))  # each rank's sign of life (_heartbeat.py)
    resume = f"kiln train --resume {run_dir} --nproc {nproc}"
    # the agent's notes on a stop ("Received 2 death signal", "Sending process .. closing
    # signal") would bury the one line that says what happened and how to continue
    quiet = [logging.getLogger(f"torch.distributed.elastic.{m}") for m in ("agent.server.api", "multiprocessing.api")]
    levels = [log.level for log in quiet]
    # with rank_logs the ranks' output, tracebacks included, goes to files there: the agent's
    # ERROR copy of a failed rank's traceback is left out too (the one line still names the error)
    quiet_level = logging.CRITICAL if rank_logs is not None else logging.ERROR
    try:
        for log in quiet:
            log.setLevel(quiet_level)
        # named here, so that every restart finds them; a warning this process showed (the plan's)
        # is not shown again by rank 0
        named = {RUN_DIR_ENV: str(run_dir), HEARTBEAT_DIR_ENV: str(beats), SHOWN_WARNINGS_ENV: shown_warnings()}
        with _environ(**named):
            _torchrun(nproc, max_restarts, rank, rank_logs)
    except ChildFailedError as exc:
        # a rank stopped answering is silent for parallel.timeout_s when the first waiting rank fails;
        # the others beat every second
        failures, blamed = _failures(exc.failures, read_beats(beats), silent_after_s=max(3.0, timeout_s / 2))
        # over rank 0's own error where the line names a rank that died or stopped: rank 0's names
        # what it saw, not the rank that failed first
        mark_stopped(run_dir, "failed", f"training failed ({failures})", over_ended=blamed)
        print(f"kiln: error: training failed ({failures}). {run_dir} keeps its checkpoints; continue with "
              f"{resume}", file=sys.stderr)
        return 1
    except SignalException as exc:  # Ctrl-C or SIGTERM to the launcher: the agent stopped the workers
        sig = signal.Signals(exc.sigval)
        mark_stopped(run_dir, "interrupted", f"stopped by {sig.name}")
        print(f"kiln: interrupted ({sig.name}); {run_dir} keeps its checkpoints; continue with {resume}",
              file=sys.stderr)
        return 128 + sig.value
    except KeyboardInterrupt as exc:  # before the agent took over the signals
        mark_stopped(run_dir, "interrupted", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
        shutil.rmtree(beats, ignore_errors=True)
        out.close()  # releases the lock
    return 0


# What the fork server that starts the ranks imports once, before it forks them: torch, kiln's
# trainer, torch.distributed.checkpoint (every run writes a checkpoint, through DCP's fsspec
# module), matplotlib's figure and Agg canvas (rank 0 draws loss.png), and what every run
# imports on first use (kiln's models and data sets, the FLOP counter, the profiler that
# measures tensor memory on CPU). A rank forked from it starts in a fraction of a second; a new
# interpreter spent seconds of CPU importing these, for every rank of every launch and restart
# (docs/lab/facts.md, 'What an import costs').
# kiln.launch._gc_freeze comes last: it freezes what the others imported (see there).
WORKER_PRELOAD = ["kiln.launch", "kiln.parallel._checkpoint", "torch.distributed.checkpoint._fsspec_filesystem",
                  "matplotlib.figure", "matplotlib.backends.backend_agg", "kiln.models", "kiln.data",
                  "torch.utils.flop_counter", "torch.profiler", "kiln.launch._gc_freeze"]


def _torchrun(nproc: int, max_restarts: int, rank: tuple[str | None, list[str], str | None],
              rank_logs: Path | None = None) -> None:
    """What ``torchrun --standalone --nproc-per-node NPROC --max-restarts MAX_RESTARTS -m kiln
    train ...`` does, in this process, each rank forked from a fork server (``WORKER_PRELOAD``)
    rather than started as a new interpreter; raises what torchrun's agent raises. With
    ``rank_logs``, as ``--log-dir RANK_LOGS --redirects 3``: each rank's output to files there."""
    import multiprocessing
    import uuid

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    logs = ["--log-dir", str(rank_logs), "--redirects", "3"] if rank_logs is not None else []
    args = parse_args(["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
                       "--start-method", "forkserver", *logs, "-m", "kiln", "train"])
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())  # --standalone
    config, _, _ = config_from_args(args)
    multiprocessing.set_forkserver_preload(WORKER_PRELOAD)  # (read when the server first starts)
    elastic_launch(config=config, entrypoint=_rank)(*rank, dict(os.environ), os.getcwd())


# the fork server's environment, recorded as it imports this module (WORKER_PRELOAD): what a
# rank's environment has besides it, torchrun's agent set for that rank
_SERVER_ENVIRON = dict(os.environ)


def _rank(config: str | None, overrides: list[str], resume: str | None, environ: dict[str, str], cwd: str) -> None:
    """One rank of ``kiln train``, forked from the launcher's fork server: with the launcher's
    environment and working directory (the server's may be an earlier launch's), the variables
    torchrun's agent set for this rank over them; exits as ``kiln train`` would."""
    agent = {k: v for k, v in os.environ.items() if _SERVER_ENVIRON.get(k) != v}
    os.environ.clear()
    os.environ.update({**environ, **agent})
    os.chdir(cwd)
    _name_process(f"kiln rank {os.environ.get('RANK', '?')}")
    _stop_with_the_launcher()
    if os.environ.get(HEARTBEAT_DIR_ENV):
        beat.start(Path(os.environ[HEARTBEAT_DIR_ENV]), int(os.environ["RANK"]))
    try:
        status = exit_status(lambda: train_command(config, overrides, resume=resume))
    finally:
        beat.end()  # (a rank killed outright never gets here)
    if status:
        sys.exit(status)  # (a return is exit status 0 to the agent)


def _stop_with_the_launcher(every_s: float = 1.0) -> None:
    """A rank whose launcher died (kill -9: no agent is left to stop it, and the run directory's
    lock went with the launcher) stops as on SIGTERM: rank 0 marks the run interrupted and the
    checkpoints stay, for ``kiln train --resume``. The fork server outlives the launcher while
    ranks live (they hold its pipe), so a thread watches the server's parent change."""
    import threading
    import time

    server = os.getppid()
    launcher = parent_pid(server)
    if launcher is None:
        return

    def watch() -> None:
        while parent_pid(server) == launcher:
            time.sleep(every_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="kiln-launcher-watch", daemon=True).start()


def _name_process(name: str) -> None:
    """This process's name as ps and top show it (Linux: at most 15 bytes), where it can be set:
    every rank is otherwise a "python -c from multiprocessing.forkserver import main"."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (AttributeError, OSError):
        pass


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set (torchrun gives its workers this process's
    environment), as it was again after: main() may run again in this process."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _failures(failures: dict[int, Any], beats: dict[int, dict[str, Any]], silent_after_s: float) -> tuple[str, bool]:
    """``rank R: what happened; ...``, the ranks that caused the failure first, then the failed
    ranks torchrun reports (at most two, in the order they failed, and how many more); and
    whether it names a rank that died or stopped answering.

    torchrun's agent reports the first rank whose process ended, often one that noticed: a rank
    killed outright (kill -9, the OOM killer) breaks its peers' connections, a rank that stopped
    answering makes their collectives time out. So, besides a rank a signal killed, the ranks to
    name come from their heartbeats (kiln/train/heartbeat.py), set against the time the first
    rank recorded its error: a rank silent for more than ``silent_after_s`` seconds then had
    stopped answering; a rank whose beats stopped by then, without the ``ended`` mark of a rank
    that exits on its own, was killed. Only a recorded error is dated when it happened (from the
    rank's error file); torchrun dates another failure after stopping the other ranks."""
    recorded = [r for r in failures if _killed_by(failures[r]) is None
                and os.path.isfile(getattr(failures[r], "error_file", ""))]
    first = min(recorded, key=lambda r: failures[r].timestamp, default=None)
    at = failures[first].timestamp if first is not None else None
    silent = [] if at is None else [r for r in silent_ranks(beats, at, silent_after_s) if r not in failures]
    # (the first failure's time is cut to whole seconds, and the dead rank's last beat came up to a beat earlier)
    gone = [] if at is None else [r for r, b in sorted(beats.items()) if r not in failures and r not in silent
                                  and not b.get("ended") and b["time"] <= at + 1 + EVERY_S]
    died = [r for r in sorted(failures) if _killed_by(failures[r]) is not None]
    rest = sorted((r for r in failures if r not in died), key=lambda r: failures[r].timestamp)
    said = [f"rank {r}: {_failure_text(failures[r])}{_where(beats.get(r))}" for r in died]
    said += [f"rank {r}: stopped answering{_where(beats[r])}: no sign of life for {at - beats[r]['time']:.0f} s "
             f"when rank {first} failed" for r in silent]
    said += [f"rank {r}: killed{_where(beats[r])} before rank {first} failed, with no exit of its own (kill -9, "
             "the OOM killer)" for r in gone]
    said += [f"rank {r}: {_failure_text(failures[r])}" for r in rest[:2]]
    if len(rest) > 2:
        said.append(f"{len(rest) - 2} more ranks failed after them")
    return "; ".join(said), bool(died or silent or gone)


def _where(beat: dict[str, Any] | None) -> str:
    """Where a rank was, from its last heartbeat: `` in step 21 (pid 4242 on HOST, cuda:1)``."""
    if not beat:
        return ""
    step = f" in step {beat['step']}" if beat.get("step") is not None else " before its first step"
    device = f", {beat['device']}" if beat.get("device") else ""
    return f"{step} (pid {beat['pid']} on {beat['host']}{device})"


def _killed_by(failure: Any) -> int | None:
    """The signal that killed a torchrun worker (kill -9, the OOM killer, a crash), or None."""
    code = getattr(failure, "exitcode", None)
    return -code if isinstance(code, int) and code < 0 else None


def _failure_text(failure: Any) -> str:
    """The error a torchrun worker recorded, or how it died."""
    sig = _killed_by(failure)
    if sig is not None:
        try:
            return f"killed by signal {sig} ({signal.Signals(sig).name})"
        except ValueError:  # (a real-time signal)
            return f"killed by signal {sig}"
    message = getattr(failure, "message", None)
    if isinstance(message, dict):
        message = message.get("message", "")
    if message and "To enable traceback" not in str(message):
        return str(message).strip().splitlines()[0][:300]
    return f"exit code {getattr(failure, 'exitcode', None)}"


# ----------------------------------------------------------------------------- how it ends


def exit_status(command: Callable[[], int], user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run ``command`` (one ``kiln`` command, returning its exit status), with SIGTERM stopping
    it as Ctrl-C does, and turn how it ended into an exit status and at most one line on
    stderr (see the module's docstring); ``user_errors`` are more errors the user can fix.
    Bugs still raise, with their traceback."""
    # SIGTERM, what schedulers send before they kill, stops a run as Ctrl-C does: the loop
    # marks it interrupted and its checkpoints stay as they are; kiln's warnings read as its errors do
    with stop_signals(), one_line_warnings():
        try:
            return command()
        except BaseException as exc:
            full = disk_full_in(exc)
            if full is not None:
                print(f"kiln: error: {_disk_full_message(full)}", file=sys.stderr)
                return 1
            # (a KilnWarning raised: the user's filter made kiln's warnings errors, -W error)
            if isinstance(exc, (ConfigError, CheckpointError, RunDirBusy, KilnWarning, *user_errors)):
                print(f"kiln: error: {exc}", file=sys.stderr)
                return EXIT_USAGE
            stop = stopped_by(exc)  # an interrupt, also inside another error, or one after a stop signal
            if stop is None or isinstance(exc, SystemExit):
                raise
            if not _launchers_worker():  # a worker of kiln's launcher leaves the line to it
                print("kiln: terminated (SIGTERM)" if stop == signal.SIGTERM else "kiln: interrupted",
                      file=sys.stderr)
            return 128 + stop


def _launchers_worker() -> bool:
    """Whether this process is a rank that kiln's launcher started: its parent holds the lock."""
    shared = os.environ.get(RUN_DIR_ENV)
    return "LOCAL_RANK" in os.environ and bool(shared) and held_by_parent(Path(shared))


def _disk_full_message(full: OSError) -> str:
    """One line: what could not be written, and the checkpoint to resume from."""
    path = Path(full.filename) if full.filename else None  # a checkpoint's save names itself
    problem = f"{os.strerror(full.errno).lower()} while writing {path or 'the run directory'}"
    run_dir = next((p for p in ([path, *path.parents] if path else []) if (p / CONFIG).is_file()), None)
    if run_dir is None:
        return f"{problem}; free some space (or write elsewhere: train.output_dir) and run again"
    good = Checkpoints(run_dir).latest_good()
    if good is None:
        return (f"{problem}; {run_dir} has no checkpoint to resume from: free some space and start again "
                f"with kiln train {run_dir}/config.yaml")
    return (f"{problem}; the last good checkpoint is {good.path}: free some space, then continue with "
            f"kiln train --resume {run_dir}")
