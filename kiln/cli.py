"""The ``kiln`` command: train | bench | plan | tune | report | export.

Errors in what the user typed (config, overrides, paths) print one clear line and exit with
status 2, with no Python traceback; bugs still show their traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
from pathlib import Path
from typing import Sequence

EXIT_USAGE = 2

_MAIN_HELP = """\
kiln makes PyTorch training faster and leaner by changing a config rather than the model.

examples:
  kiln train configs/digits_vit.py                      train the bundled digits ViT
  kiln train configs/digits_vit.py train.max_steps=100 optim.lr=1e-3
  kiln train runs/digits_vit-20260101-120000/config.yaml  rerun a saved experiment
  kiln plan configs/digits_vit.py                       what a config will build, without training
  kiln tune configs/digits_vit.py                       measure speed settings, recommend the fastest
  kiln report runs/A runs/B                             compare runs: curves and a summary table
  kiln export RUN_DIR --to hf DIR                       a run's model for Hugging Face from_pretrained
  kiln bench optimizer                                  measure kiln against plain PyTorch
"""

_TRAIN_HELP = """\
Train the model a config describes and write a run directory:
  RUN_DIR/config.yaml   the resolved config; `kiln train RUN_DIR/config.yaml` reruns it
  RUN_DIR/metrics.csv   step, train loss, lr, samples/s, eval metrics
  RUN_DIR/summary.json  steps, final_train_loss, eval, samples_per_second, peak_memory_mb,
                        wall_seconds, and status (running | completed | failed | interrupted)
  RUN_DIR/loss.png      train and eval loss against step
  RUN_DIR/checkpoints/  final/, best/, step-N/: sharded checkpoints (torch.distributed.checkpoint)
                        that resume in any layout; read one with kiln.train.load_checkpoint

A config is a Python file (LazyCall nodes, see configs/digits_vit.py) or YAML with the
namespaces model, data, optim, train and parallel. Override any key on the command line
with key=value (dotted keys; values are typed: 5, 0.1, true, null, [1,2], 'text').
Unknown keys and wrong types are rejected, with a suggestion, before anything is built.

examples:
  kiln train configs/digits_vit.py
  kiln train configs/digits_vit.py train.max_steps=200 data.batch_size=128 optim.name=lamb
  kiln train configs/digits_mlp.yaml train.seed=1 train.output_dir=/tmp/runs
  kiln train configs/digits_vit.py train.checkpoint_every=100
  kiln train --resume runs/digits_vit-20260101-120000      continue after a crash or kill
  kiln train configs/digits_vit.py --nproc 2                 data parallel over 2 processes
  kiln train configs/digits_vit.py --nproc 4 parallel.zero=3 ZeRO-3 (FSDP2) over 4 processes
  kiln train configs/gpt_tiny.py --nproc 4 parallel.tp=2 parallel.pp=2 parallel.microbatches=4
                                                             tensor x pipeline parallel (dp x tp x pp
                                                             must equal the processes; see parallel.*)

Several machines: start the same command on each with torchrun, for example
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
      -m kiln train configs/digits_vit.py
Rank 0 alone writes the run directory. Set KILN_RUN_DIR to a shared path to name it; a
restarted group then resumes from its last checkpoint.
"""

_PLAN_HELP = """\
Validate a config and show what it would build, without training: the model's parameter
count, the memory that parameters, gradients and optimizer state take, and how each global
batch is split into micro-batches. With --nproc N (or a config whose parallel.dp x tp x pp is
more than one process): the layout, checked as kiln train would check it, and the memory of
the fullest rank.

examples:
  kiln plan configs/digits_vit.py model.depth=8
  kiln plan configs/gpt2_medium.py --nproc 8 parallel.tp=4 parallel.pp=2 model.vocab_size=50304
"""


_EXPORT_HELP = """\
Write a run's model, at one of its checkpoints, in another layout. --to hf DIR writes the
Hugging Face layout (config.json and safetensors, with save_pretrained) that transformers'
from_pretrained loads in one process, whatever layout the run trained in (processes, ZeRO,
FSDP2, tensor and pipeline parallel). Only runs of transformers models export to hf.

The model is built in this process from RUN_DIR/config.yaml and filled from the checkpoint
(step-N/ or final/; nothing in it is executed). DIR must not exist or be empty: kiln never
writes over files it did not make. A finished run already holds its final model in RUN_DIR/hf/.

examples:
  kiln export runs/hf_gpt2_tiny-20260101-120000 --to hf /tmp/gpt2-final
  kiln export runs/hf_gpt2_tiny-20260101-120000 --step 100 --to hf /tmp/gpt2-step100
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln", description=_MAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kiln {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    train = sub.add_parser(
        "train", help="train from a config", description=_TRAIN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", metavar="CONFIG", nargs="?", help="config file: .py (LazyCall) or .yaml")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="config overrides, e.g. train.max_steps=100 optim.lr=3e-3")
    train.add_argument("--resume", metavar="RUN_DIR",
                       help="continue RUN_DIR from its newest checkpoint, in place (appends to metrics.csv); "
                       "overrides may only change how long it runs, e.g. train.max_steps=2000")
    train.add_argument("--nproc", type=int, default=1, metavar="N",
                       help="train with N local processes started by torchrun (torch.distributed.run): "
                       "gloo on CPU, nccl on GPU; data.batch_size stays the global batch")
    train.add_argument("--max-restarts", type=int, default=0, metavar="R",
                       help="with --nproc: let torchrun's elastic agent restart the processes up to R times "
                       "after a failure; training resumes from the run's last checkpoint")
    train.set_defaults(func=_cmd_train)

    bench = sub.add_parser(
        "bench", help="run a benchmark against plain PyTorch",
        description="Run a benchmark that measures a kiln claim against the plain PyTorch way "
        "in the same process, print a table of ratios, and write JSON and a PNG chart.\n\n"
        "example:\n  kiln bench optimizer\n  kiln bench optimizer --quick --out /tmp/bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("name", metavar="NAME", nargs="?", help="benchmark name (see --list)")
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds")
    bench.add_argument("--out", metavar="DIR", help="output folder (default: bench_results/NAME)")
    bench.add_argument("--family", metavar="F[,F]", help="parallel only: model families to lay out, among gpt, "
                       "bert and llama (a Hugging Face Llama of the GPT's size); default gpt,bert")
    bench.set_defaults(func=_cmd_bench)

    plan = sub.add_parser(
        "plan", help="show what a config builds, without training", description=_PLAN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("config", metavar="CONFIG", help="config file: .py or .yaml")
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    plan.add_argument("--nproc", type=int, default=None, metavar="N",
                      help="plan for N processes: the dp x tp x pp layout is checked as kiln train --nproc N "
                           "would, and the fullest rank's parameter, gradient and optimizer-state memory shown")
    plan.set_defaults(func=_cmd_plan)

    tune = sub.add_parser(
        "tune", help="measure speed settings on this machine and recommend the fastest",
        description="Train the config for a few steps under each combination of speed settings "
        "(train.precision fp32/bf16-mixed, optim.contiguous true/false, data.workers 0/auto, and with "
        "--compile train.compile false/true), print samples/s for each, fastest first, and the "
        "overrides to use. Measured here, not estimated.\n\nexample:\n"
        "  kiln tune configs/digits_vit.py --steps 50",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune.add_argument("config", metavar="CONFIG", help="config file: .py or .yaml")
    tune.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides kept in every trial")
    tune.add_argument("--steps", type=int, default=30, help="training steps per trial (default: 30)")
    tune.add_argument("--compile", action="store_true", help="also try train.compile=true (slow to compile)")
    tune.set_defaults(func=_cmd_tune)

    report = sub.add_parser(
        "report", help="compare runs: curves in one picture, summaries in one table",
        description="Plot the train loss, eval loss and eval accuracy of several runs in one "
        "picture and print a table of their summaries.\n\nexample:\n"
        "  kiln report runs/digits_vit-20260101-120000 runs/digits_vit-20260101-130000 --out cmp.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    report.add_argument("--out", metavar="PNG", default="report.png", help="picture to write (default: report.png)")
    report.set_defaults(func=_cmd_report)

    export = sub.add_parser(
        "export", help="write a run's model at a checkpoint for Hugging Face from_pretrained",
        description=_EXPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="a kiln run directory (config.yaml, checkpoints/)")
    export.add_argument("--step", type=int, default=None, metavar="N",
                        help="the checkpoint of step N (checkpoints/step-N, or final/ if it is at step N); "
                        "default: the newest")
    export.add_argument("--to", nargs=2, required=True, metavar=("FORMAT", "DIR"),
                        help="FORMAT hf: the Hugging Face layout, written to DIR (new or empty)")
    export.set_defaults(func=_cmd_export)
    return parser


def _version() -> str:
    from kiln import __version__

    return __version__


def _run_name(config: Path) -> str:
    if config.stem == "config":  # RUN_DIR/config.yaml: name the rerun after the run directory
        return re.sub(r"-\d{8}-\d{6}(-\d+)?$", "", config.resolve().parent.name) or "run"
    return config.stem


def _cmd_train(args: argparse.Namespace) -> int:
    from kiln.config import load_config
    from kiln.train import train

    if args.nproc < 1:
        raise _UsageError(f"--nproc {args.nproc} must be at least 1")
    if args.max_restarts < 0:
        raise _UsageError(f"--max-restarts {args.max_restarts} must be 0 (no restarts) or positive")
    if args.resume:
        if args.config is not None and "=" not in args.config:
            raise _UsageError("give either CONFIG or --resume RUN_DIR, not both")
        overrides = ([args.config] if args.config else []) + args.overrides
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").is_file():
            raise _UsageError(f"{run_dir} is not a kiln run directory (no config.yaml in it)")
        cfg = load_config(run_dir / "config.yaml", overrides)
        if "LOCAL_RANK" not in os.environ:
            from kiln.train.loop import check_resume

            # before any process starts: a run another process writes, a checkpoint that does
            # not match, a finished run (refused with how to extend it)
            check_resume(run_dir, cfg)
        command = ["--resume", str(run_dir), *overrides]
    elif args.config is None:
        raise _UsageError("kiln train needs a CONFIG file or --resume RUN_DIR (see kiln train --help)")
    else:
        run_dir = None
        cfg = load_config(args.config, args.overrides)  # checked here, before any process starts
        command = [args.config, *args.overrides]
    if "LOCAL_RANK" not in os.environ:
        from kiln.train import check_layout

        check_layout(cfg, args.nproc)  # dp x tp x pp against --nproc, before any process starts
        if args.nproc > 1:
            from kiln.train import check_model

            check_model(cfg)  # on the meta device: what the model allows, before any process starts
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        name = cfg.train.run_name or _run_name(Path(args.config or run_dir / "config.yaml"))
        if run_dir is None and os.environ.get("KILN_RUN_DIR"):
            run_dir = Path(os.environ["KILN_RUN_DIR"])  # the user named the run directory: the launcher opens it
        return _launch(command, args.nproc, args.max_restarts, run_dir, cfg.train.output_dir, name)
    # Under torchrun the launcher names the run directory; once it holds a checkpoint (an
    # elastic restart), the restarted processes continue from it.
    shared = os.environ.get("KILN_RUN_DIR")
    if run_dir is None and shared:
        from kiln.train import has_checkpoint

        run_dir = Path(shared) if has_checkpoint(Path(shared)) else None
    if "LOCAL_RANK" in os.environ:
        # A worker of torchrun: record the error, so the launcher can say what failed and where.
        from torch.distributed.elastic.multiprocessing.errors import record

        train = record(train)
    if run_dir is not None:
        result = train(cfg, resume=run_dir)
    else:
        result = train(cfg, name=_run_name(Path(args.config)), run_dir=Path(shared) if shared else None)
    return 0 if result.summary.get("status") == "completed" else 1


def _failure_text(failure: object) -> str:
    """The error a torchrun worker recorded, or how it died."""
    message = getattr(failure, "message", None)
    if isinstance(message, dict):
        message = message.get("message", "")
    if message and "To enable traceback" not in str(message):
        return str(message).strip().splitlines()[0][:300]
    code = getattr(failure, "exitcode", None)
    if isinstance(code, int) and code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _launch(command: list[str], nproc: int, max_restarts: int, run_dir: Path | None, output_dir: str,
            name: str) -> int:
    """Run ``kiln train COMMAND`` in ``nproc`` local processes under torchrun's elastic agent.

    This process, the launcher, creates (or reopens) the run directory and holds its lock
    for the whole run: rank 0 may die and be restarted by the agent without ever meeting its
    own lock, and a second ``kiln train --resume`` of the directory is refused while the run
    lives. When rank 0 could not record how the run ended, the launcher marks it."""
    import logging
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from kiln.train import RunDir
    from kiln.train.loop import LOCK_HELD_ENV, mark_stopped

    out = RunDir.open(run_dir) if run_dir is not None else RunDir.create(output_dir, name)  # locked
    run_dir = out.path
    resume = f"kiln train --resume {run_dir} --nproc {nproc}"
    saved_env = {k: os.environ.get(k) for k in ("KILN_RUN_DIR", LOCK_HELD_ENV)}
    # the agent's notes on a stop ("Received 2 death signal", "Sending process .. closing
    # signal") would bury the one line that says what happened and how to continue
    quiet = [logging.getLogger(f"torch.distributed.elastic.{m}") for m in ("agent.server.api", "multiprocessing.api")]
    levels = [log.level for log in quiet]
    try:
        os.environ["KILN_RUN_DIR"] = str(run_dir)  # named here, so every restart finds it
        os.environ[LOCK_HELD_ENV] = str(os.getpid())
        for log in quiet:
            log.setLevel(logging.ERROR)
        torchrun(["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
                  "-m", "kiln", "train", *command])
    except ChildFailedError as exc:
        failures = "; ".join(f"rank {r}: {_failure_text(f)}" for r, f in sorted(exc.failures.items()))
        mark_stopped(run_dir, "failed", f"training failed ({failures})")
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
        out.close()  # releases the lock
        for key, value in saved_env.items():  # main() may run again in this process
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from kiln.bench import BENCHMARKS, check_benchmark, run_benchmark

    if args.list or not args.name:
        for name, (_, text) in sorted(BENCHMARKS.items()):
            print(f"{name:16s} {text}")
        return 0 if args.list else EXIT_USAGE
    try:
        check_benchmark(args.name, family=args.family)
    except (KeyError, ValueError) as exc:
        raise _UsageError(exc.args[0]) from None
    run_benchmark(args.name, args.out, quick=args.quick, family=args.family)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from kiln.config import load_config
    from kiln.plan import describe

    cfg = load_config(args.config, args.overrides)
    if args.nproc is not None:
        if args.nproc < 1:
            raise _UsageError(f"--nproc {args.nproc} must be at least 1")
        from kiln.train import check_layout

        check_layout(cfg, args.nproc)  # the same checks as kiln train --nproc N
    print(describe(cfg, args.nproc))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from kiln.tune import table, tune

    if args.steps < 2:
        raise _UsageError(f"--steps {args.steps}: give at least 2 steps per trial")
    from kiln.hardware import machine_line

    # what is fastest depends on the hardware: bf16 pays only where it is native
    print(f"machine: {machine_line()}", flush=True)
    rows = tune(args.config, args.overrides, steps=args.steps, compile=args.compile)
    print(table(rows))
    print(f"fastest: kiln train {args.config} {' '.join([*args.overrides, *rows[0]['overrides']])}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from kiln.train.report import check_runs, plot, table

    try:
        runs = check_runs(args.runs)
    except FileNotFoundError as exc:
        raise _UsageError(str(exc)) from None
    print(table(runs))
    print(f"curves: {plot(runs, Path(args.out))}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from kiln.hf import describe
    from kiln.train.loop import export_hf

    fmt, out = args.to[0], Path(args.to[1])
    if fmt != "hf":
        raise _UsageError(f"--to {fmt}: the only export format is hf (the Hugging Face layout): --to hf DIR")
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise _UsageError(f"{run_dir} is not a kiln run directory (no config.yaml in it)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise _UsageError(f"{out} exists and is not an empty directory; kiln export writes only a new or empty "
                          "one: give another DIR, or remove it yourself")
    written = export_hf(run_dir, out, step=args.step, say=lambda line: print(line, flush=True))
    print(f"kiln: wrote {written}: {describe(written)}; load it with from_pretrained({str(written)!r})")
    return 0


class _UsageError(Exception):
    pass


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _disk_full_in(exc: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT OSError behind ``exc``, also where a checkpoint save wrapped it; None
    if there is none."""
    from kiln.train.loop import find_cause

    return find_cause(exc, lambda e: isinstance(e, OSError) and e.errno in _DISK_FULL)  # type: ignore[return-value]


def _disk_full_message(exc: BaseException, full: OSError) -> str:
    """One line: what could not be written, and the checkpoint to resume from."""
    import inspect

    from kiln.parallel import save_sharded

    path = Path(full.filename) if full.filename else None
    code = inspect.unwrap(save_sharded).__code__  # (under its no_grad decorator)
    tb = exc.__traceback__
    while tb is not None and path is None:  # a write() names no file: the checkpoint being saved does
        if tb.tb_frame.f_code is code:
            path = Path(tb.tb_frame.f_locals["directory"])
        tb = tb.tb_next
    problem = f"{os.strerror(full.errno).lower()} while writing {path or 'the run directory'}"
    run_dir = next((p for p in ([path, *path.parents] if path else []) if (p / "config.yaml").is_file()), None)
    if run_dir is None:
        return f"{problem}; free some space (or write elsewhere: train.output_dir) and run again"
    good = _last_good_checkpoint(run_dir)
    if good is None:
        return (f"{problem}; {run_dir} has no checkpoint to resume from: free some space and start again "
                f"with kiln train {run_dir}/config.yaml")
    return (f"{problem}; the last good checkpoint is {good}: free some space, then continue with "
            f"kiln train --resume {run_dir}")


def _last_good_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint of ``run_dir`` with the most steps (final before a periodic one of
    the same step), as ``kiln train --resume`` picks it; None if there is none."""
    from kiln.parallel import check_sharded

    found = []
    for path in (run_dir / "checkpoints").glob("*"):
        if path.name == "final" or re.fullmatch(r"step-\d+", path.name):
            try:
                found.append((check_sharded(path)["extra"]["step"], path.name == "final", path))
            except (ValueError, KeyError, TypeError):
                continue  # cut short by the failed save, or damaged: not one to resume from
    return max(found)[2] if found else None


def _call(args: argparse.Namespace) -> int:
    """``args.func(args)``, with a full disk turned into one line and exit status 1."""
    try:
        return args.func(args)
    except BaseException as exc:
        full = _disk_full_in(exc)
        if full is None:
            raise
        print(f"kiln: error: {_disk_full_message(exc, full)}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    # Overrides may come after options (kiln train CONFIG --nproc 2 train.max_steps=9): argparse
    # leaves them over, and every leftover that looks like key=value is an override.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    from kiln.errors import ConfigError
    from kiln.errors import CheckpointError
    from kiln.train.loop import LOCK_HELD_ENV, RunDirBusy, stop_signals, stopped_by

    import signal

    # SIGTERM, what schedulers send before they kill, stops a run as Ctrl-C does: the loop
    # marks it interrupted and its checkpoints stay as they are
    with stop_signals():
        try:
            return _call(args)  # a full disk: one line, exit 1
        except (ConfigError, CheckpointError, RunDirBusy, _UsageError) as exc:
            print(f"kiln: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except BaseException as exc:
            stop = stopped_by(exc)  # an interrupt, also inside another error, or one after a stop signal
            if stop is None or isinstance(exc, SystemExit):
                raise
            if LOCK_HELD_ENV not in os.environ:  # a worker of kiln's launcher leaves the line to it
                print("kiln: terminated (SIGTERM)" if stop == signal.SIGTERM else "kiln: interrupted",
                      file=sys.stderr)
            return 128 + stop


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
