"""The ``kiln`` command: train | bench | plan | tune | report | export | doctor.

Errors in what the user typed (config, overrides, paths) print one clear line and exit with
status 2, with no Python traceback; bugs still show their traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

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
  kiln doctor                                           check this environment: devices, backends, extras
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
  kiln train configs/gpt_tiny.py --nproc 2 parallel.auto=true train.memory_budget=1GB
                                                             kiln chooses dp x tp x pp, ZeRO, the micro-batch
                                                             and checkpointing that fit (config.yaml keeps it)

Several machines: start the same command on each with torchrun, for example
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
      -m kiln train configs/digits_vit.py
Rank 0 alone writes the run directory. Set KILN_RUN_DIR to a shared path to name it; a
restarted group then resumes from its last checkpoint.
"""

_PLAN_HELP = """\
Validate a config and show what it would build, without training: the model's parameter count,
how each global batch is split into micro-batches, and the peak memory of a steady training step
on every rank of the dp x tp x pp layout, by category (parameters, gradients, optimizer state with
bf16-true's fp32 masters, activations saved for backward, temporaries, communication buffers).

The step is not estimated from a formula: kiln sets up each distinct rank as kiln train would and
runs two steps on fake tensors (torch's FakeTensorMode: shapes, no memory) with a fake process
group, following every tensor. A dry run: a shape or layout error at 64 ranks shows up here in
seconds. With --nproc N (or a config whose parallel.dp x tp x pp is more than one process) the
layout is checked as kiln train --nproc N would check it.

When the fullest rank's peak exceeds --memory-budget (default: the memory this machine has
available, shared by N processes, on CPU), one line names the peak and what would make it fit,
and the exit status is 2.

examples:
  kiln plan configs/digits_vit.py model.depth=8
  kiln plan configs/gpt2_medium.py --nproc 8 parallel.tp=4 parallel.pp=2 model.vocab_size=50304 \\
      model.tie_embeddings=false --json plan.json
  kiln plan configs/gpt_tiny.py --nproc 4 parallel.zero=2 --memory-budget 64MB
"""


_TUNE_HELP = """\
Without --memory-budget: train the config for a few steps under each combination of speed
settings (train.precision fp32/bf16-mixed, optim.contiguous true/false, data.workers 0/auto, and
with --compile train.compile false/true), print samples/s for each, fastest first, and the
overrides to use. Measured here, not estimated.

With --memory-budget SIZE: the fastest configuration whose peak tensor memory fits SIZE in each
of --nproc N processes. It searches dp x tp x pp (tp and pp where the model family has plans),
parallel.zero, train.accumulate (the micro-batch; data.batch_size stays the global batch),
train.activation_checkpointing, train.precision (fp32, bf16-mixed) and with --compile
train.compile. Candidates are planned on fake tensors (as kiln plan does), those over the budget
dropped without running, the rest ranked by a cost model (the plan's FLOPs, operators and
collective bytes against this machine's measured matmul, operator and all-reduce speeds, measured
once and cached), and the --trials best timed with kiln train --nproc N for --steps steps. It
prints the pick with its predicted and measured peak and speed, and the kiln train line to use.
A searched key given as KEY=VALUE is kept, not searched. When nothing fits: one line naming the
smallest predicted peak and what would make it fit, exit status 2.

examples:
  kiln tune configs/digits_vit.py --steps 50
  kiln tune configs/gpt_tiny.py --nproc 2 --memory-budget 20MB --json tune.json
  kiln tune configs/gpt_tiny.py --nproc 2 --memory-budget 1GB train.precision=fp32
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
    _add_train(sub)
    _add_bench(sub)
    _add_plan(sub)
    _add_tune(sub)
    _add_report(sub)
    _add_export(sub)
    _add_doctor(sub)
    return parser


def _add_train(sub: Any) -> None:
    """``kiln train``: a config, its overrides, --resume, --nproc, --max-restarts."""
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


def _add_bench(sub: Any) -> None:
    """``kiln bench``: a benchmark by name and the options some of them take."""
    bench = sub.add_parser(
        "bench", help="run a benchmark against plain PyTorch",
        description="Run a benchmark that measures a kiln claim against the plain PyTorch way "
        "in the same process, print a table of ratios, and write JSON and a PNG chart.\n\n"
        "example:\n  kiln bench optimizer\n  kiln bench optimizer --quick --out /tmp/bench\n"
        "  kiln bench encoder-layer --device cuda --hidden 1024\n"
        "  kiln bench gpu                   # on a GPU machine: what to run first (docs/lab/gpu.md)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("name", metavar="NAME", nargs="?", help="benchmark name (see --list)")
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds")
    bench.add_argument("--out", metavar="DIR", help="output folder (default: bench_results/NAME)")
    bench.add_argument("--family", metavar="F[,F]", help="parallel only: model families to lay out, among gpt, "
                       "bert and llama (a Hugging Face Llama of the GPT's size); default gpt,bert")
    bench.add_argument("--device", metavar="D", help="lm, overhead, optimizer, encoder-layer, hf, plan, vit, ddp and gpu: run on D, "
                       "cpu (default; gpu: cuda) or cuda (ddp: two GPUs); the JSON records the GPU")
    bench.add_argument("--hidden", type=int, metavar="N", help="encoder-layer only: the layer's width, FFN 4N, 16 heads "
                       "(default 128, the article's; 1024: Transformer-big)")
    bench.add_argument("--nproc", type=int, metavar="N", help="vit only: processes, 1 or 2 (default 2 on cpu, the "
                       "article's data parallel; 1 on cuda)")
    bench.set_defaults(func=_cmd_bench)


def _add_plan(sub: Any) -> None:
    """``kiln plan``: what a config builds and every rank's memory, without training."""
    plan = sub.add_parser(
        "plan", help="show what a config builds, without training", description=_PLAN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("config", metavar="CONFIG", help="config file: .py or .yaml")
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    plan.add_argument("--nproc", type=int, default=None, metavar="N",
                      help="plan for N processes: the dp x tp x pp layout is checked as kiln train --nproc N "
                           "would, and every rank's step traced")
    plan.add_argument("--json", metavar="FILE", help="also write the plan as JSON: ranks[] (rank, peak_bytes and "
                      "the categories in bytes), fullest_rank, flops_per_step")
    plan.add_argument("--memory-budget", metavar="SIZE", help="memory a rank may use, e.g. 8GB (default on CPU: "
                      "this machine's available memory divided among the processes)")
    plan.set_defaults(func=_cmd_plan)


def _add_tune(sub: Any) -> None:
    """``kiln tune``: time candidate settings, or search layouts under a memory budget."""
    tune = sub.add_parser(
        "tune", help="find the fastest settings on this machine (with --memory-budget: the fastest layout that fits)",
        description=_TUNE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune.add_argument("config", metavar="CONFIG", help="config file: .py or .yaml")
    tune.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                      help="config overrides kept in every trial; with --memory-budget a searched key given here "
                      "is pinned to its value")
    tune.add_argument("--steps", type=int, default=None,
                      help="training steps per trial (default: 30; with --memory-budget 12)")
    tune.add_argument("--compile", action="store_true", help="also try train.compile=true (slow to compile)")
    tune.add_argument("--memory-budget", metavar="SIZE",
                      help="peak tensor memory a process may use, e.g. 8GB, 512MB, 1.5GiB: search the layout, ZeRO "
                      "stage, micro-batch, activation checkpointing and precision for the fastest that fits")
    tune.add_argument("--nproc", type=int, default=1, metavar="N", help="with --memory-budget: the processes the run "
                      "will train with (kiln train --nproc N); the layouts searched are the splits of N")
    tune.add_argument("--trials", type=int, default=3, metavar="K",
                      help="with --memory-budget: how many of the best predicted configurations to time (default 3)")
    tune.add_argument("--plan-all", action="store_true",
                      help="with --memory-budget: plan every candidate, not only those the cost model ranks first")
    tune.add_argument("--json", metavar="FILE", help="with --memory-budget: write pick and candidates (overrides, "
                      "predicted_peak_bytes, measured_peak_bytes, samples_per_second) as JSON")
    tune.set_defaults(func=_cmd_tune)


def _add_report(sub: Any) -> None:
    """``kiln report``: several runs' curves in one picture and their summaries in one table."""
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


def _add_export(sub: Any) -> None:
    """``kiln export``: a run's model at a checkpoint for Hugging Face."""
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


def _add_doctor(sub: Any) -> None:
    """``kiln doctor``: what kiln finds in this environment."""
    doctor = sub.add_parser(
        "doctor", help="check this environment: versions, devices, backends, compile, extras",
        description="Check what kiln finds here, on one screen: kiln's and torch's versions and build (CPU or "
        "CUDA), the CPU's vector units and cores, each GPU (name, memory, compute capability), what computes "
        "natively (bf16, fp16, fp8), what train.precision=auto chooses and whether train.precision=fp8 can "
        "train here, the distributed backends that work (gloo, nccl), whether torch.compile works (a tiny function, compiled and timed) and kiln's native "
        "optimizer kernels build, and which optional packages are installed and import. Where something kiln "
        "needs is broken it names the problem and the fix, and exits 1.\n\nexamples:\n  kiln doctor\n"
        "  kiln doctor --json > env.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    doctor.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile check (a first compile takes 2-20 s on a small CPU, and "
                        "50 s was seen on a 16-core GPU machine)")
    doctor.set_defaults(func=_cmd_doctor)


def _version() -> str:
    from kiln._version import __version__

    return __version__


def _cmd_train(args: argparse.Namespace) -> int:
    from kiln.launch import train_command

    if args.nproc < 1:
        raise _UsageError(f"--nproc {args.nproc} must be at least 1")
    if args.max_restarts < 0:
        raise _UsageError(f"--max-restarts {args.max_restarts} must be 0 (no restarts) or positive")
    if args.resume:
        if args.config is not None and "=" not in args.config:
            raise _UsageError("give either CONFIG or --resume RUN_DIR, not both")
        overrides = ([args.config] if args.config else []) + args.overrides  # CONFIG was an override
        return train_command(None, overrides, resume=args.resume, nproc=args.nproc, max_restarts=args.max_restarts)
    if args.config is None:
        raise _UsageError("kiln train needs a CONFIG file or --resume RUN_DIR (see kiln train --help)")
    return train_command(args.config, args.overrides, nproc=args.nproc, max_restarts=args.max_restarts)


def _cmd_bench(args: argparse.Namespace) -> int:
    from kiln.bench import BENCHMARKS, check_benchmark, run_benchmark

    if args.list or not args.name:
        for name, (_, text) in sorted(BENCHMARKS.items()):
            print(f"{name:16s} {text}")
        return 0 if args.list else EXIT_USAGE
    try:
        check_benchmark(args.name, family=args.family, device=args.device, hidden=args.hidden, nproc=args.nproc)
    except (KeyError, ValueError) as exc:
        raise _UsageError(exc.args[0]) from None
    run_benchmark(args.name, args.out, quick=args.quick, family=args.family, device=args.device, hidden=args.hidden,
                  nproc=args.nproc)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from kiln.config import load_config
    from kiln.plan import PlanUnavailable, describe, fit_problem, machine_budget, parse_size, plan

    budget = None
    if args.memory_budget is not None:
        try:
            budget = parse_size(args.memory_budget)
        except ValueError as exc:
            raise _UsageError(f"--memory-budget: {exc}") from None
    cfg = load_config(args.config, args.overrides)
    if args.nproc is not None:
        if args.nproc < 1:
            raise _UsageError(f"--nproc {args.nproc} must be at least 1")
        from kiln.train import check_layout

        check_layout(cfg, args.nproc)  # the same checks as kiln train --nproc N
    describe(cfg, args.nproc)  # the model's own checks, before anything is traced
    try:
        planned = plan(cfg, args.nproc)
    except PlanUnavailable as exc:
        print(describe(cfg, args.nproc))
        print(f"step peak   not traced: {exc}")
        return 0
    print(describe(cfg, args.nproc, planned))
    if args.json:
        Path(args.json).write_text(json.dumps(planned.as_json(), indent=1) + "\n")
    where = f"--memory-budget {args.memory_budget}"
    if budget is None:
        budget = machine_budget(planned.device, planned.layout.world)
        where = f"this machine's available memory shared by {planned.layout.world} process(es)"
    problem = fit_problem(planned, budget, where) if budget is not None else None
    if problem:
        raise _UsageError(problem)
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from kiln.hardware import machine_line

    if args.steps is not None and args.steps < 2:
        raise _UsageError(f"--steps {args.steps}: give at least 2 steps per trial")
    if args.memory_budget is None:
        for flag, given in (("--nproc", args.nproc != 1), ("--json", args.json), ("--plan-all", args.plan_all)):
            if given:
                raise _UsageError(f"{flag} goes with --memory-budget SIZE (the layout search)")
        from kiln.commands.tune import table, tune

        # what is fastest depends on the hardware: bf16 pays only where it is native
        print(f"machine: {machine_line()}", flush=True)
        rows = tune(args.config, args.overrides, steps=args.steps or 30, compile=args.compile)
        print(table(rows))
        print(f"fastest: kiln train {args.config} {' '.join([*args.overrides, *rows[0]['overrides']])}")
        return 0
    import json

    from kiln.plan import parse_size
    from kiln.commands.tune import budget_json, budget_report, tune_within

    try:
        budget = parse_size(args.memory_budget)
    except ValueError as exc:
        raise _UsageError(f"--memory-budget: {exc}") from None
    if args.nproc < 1:
        raise _UsageError(f"--nproc {args.nproc} must be at least 1")
    if args.trials < 1:
        raise _UsageError(f"--trials {args.trials} must be at least 1")
    print(f"machine: {machine_line()}", flush=True)
    found = tune_within(args.config, args.overrides, nproc=args.nproc, budget=budget, trials=args.trials,
                        steps=args.steps or 12, compile=args.compile, exhaustive=args.plan_all,
                        say=lambda line: print(line, flush=True))
    print(budget_report(found, args.config, args.overrides, args.nproc, args.memory_budget))
    if args.json:
        Path(args.json).write_text(json.dumps(budget_json(found), indent=1) + "\n")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from kiln.commands.report import check_runs, plot, table

    try:
        runs = check_runs(args.runs)
    except FileNotFoundError as exc:
        raise _UsageError(str(exc)) from None
    print(table(runs))
    print(f"curves: {plot(runs, Path(args.out))}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from kiln.commands.export import export_run

    fmt, out = args.to[0], Path(args.to[1])
    if fmt != "hf":
        raise _UsageError(f"--to {fmt}: the only export format is hf (the Hugging Face layout): --to hf DIR")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise _UsageError(f"{out} exists and is not an empty directory; kiln export writes only a new or empty "
                          "one: give another DIR, or remove it yourself")
    export_run(args.run_dir, out, step=args.step, say=lambda line: print(line, flush=True))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from kiln.commands.doctor import main as doctor

    return doctor(as_json=args.json, compile=not args.no_compile)


class _UsageError(Exception):
    pass


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
    from kiln.launch import exit_status

    # one line and exit 2 for what the user can fix, 1 for a full disk, 128 + N after signal N
    return exit_status(lambda: args.func(args), user_errors=(_UsageError,))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
