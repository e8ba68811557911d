"""``kiln bench gpu``: what to run first when a GPU is lent, in one command.

A lent GPU has 15 minutes in all, start-up included, so the runs that back kiln's GPU claims are
one command, fixed in advance and tested on a CPU before a GPU is at hand. It runs, one after
another, the quick forms (``--quick``) of

1. ``lm``: GPT-2 small against the plain loop users write (tokens/s, MFU, peak memory);
2. ``vit --nproc 1``: Meta's faster-ViT table at ViT-B/16, 224-pixel images, on one GPU;
3. ``encoder-layer --hidden 1024``: seed 000's Transformer-big layer, torch against kiln;
4. ``hf``: a Hugging Face GPT-2 by ``kiln train`` against the transformers Trainer;
5. ``optimizer``: kiln's arena AdamW against torch's fused one;
6. ``plan``: ``kiln plan``'s predicted peak against ``torch.cuda.max_memory_allocated``;

on the device (``--device cuda``, the default here), within :data:`BUDGET_S` (8 minutes on a
GPU), and writes its report, with every benchmark's own tables, as the section ``kiln bench gpu
--device cuda`` of docs/lab/gpu.md (a later run replaces it; the page's prose stays).

Each benchmark runs as ``python -m kiln bench NAME --quick --device D ... --out OUT/NAME`` in a
process of its own, in a session of its own: an error, a CUDA fault that leaves a process's
context unusable, an out-of-memory or a hang costs that benchmark's row and nothing else, and
what the others measured is kept. Each has a time limit (:data:`RUNS`), cut to what is left of
the budget; at its limit its processes are ended (SIGTERM, then SIGKILL) and its row says
``timeout``, with the last lines it printed. A benchmark this build does not have (``lm`` before
it lands) is a row that says so; one refused before it starts (a package not installed) is a
row with the one-line reason. Every line a benchmark prints is printed as it comes, indented
under a line that names it and the time spent so far: a lease is short and someone is watching.

``--device cpu`` runs the same script at the CPU's quick sizes (the digits ViT in one process,
an encoder layer of hidden 64): a test of the script on a machine without a GPU (2.5-4 minutes
on 2 shared cores), whose report goes to ``OUT/gpu.txt`` and never into docs/lab/gpu.md.
``--quick`` runs the same benchmarks and leaves the docs alone.

    kiln bench gpu                      # on a GPU machine, first
    kiln bench gpu --device cpu         # the script's test, here
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kiln.bench._harness import Bars, Col, Result, Table, benchmark, target

# the whole run's time, on a GPU: 8 of a lease's 15 minutes, the rest for the machine's
# start-up, the install and a rerun of one benchmark; on a CPU, a ceiling for a test
BUDGET_S = {"cuda": 480.0, "cpu": 900.0}
CPU_SLOWER = 4  # on a CPU each benchmark's limit is this many times its GPU one
LAST_LINES = 12  # of a benchmark that failed or ran out of time, in the report
MIN_START_S = 10.0  # a benchmark is not started with less of the budget left


@dataclasses.dataclass(frozen=True)
class Run:
    """One benchmark of the run: its name, its limit on a GPU, its options on every device and
    those on a GPU or a CPU alone (``kiln bench NAME --OPTION VALUE``)."""

    name: str
    limit_s: float
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    gpu_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    cpu_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def options_on(self, device: str) -> dict[str, Any]:
        return {**self.options, **(self.cpu_options if device == "cpu" else self.gpu_options)}


# in order of what a lease must not miss; the limits add up to the GPU's budget
RUNS = (
    # GPT-2 small at 16 x 1024: three processes, two of them compile it (~60 s each on an H100)
    Run("lm", 200),
    # ViT-B/16: 8 kiln train runs of 16 steps, each 5-10 s of set-up (data, model, loader
    # workers, the final checkpoint), and one compile of 40-60 s
    Run("vit", 130, {"nproc": 1}),
    # Transformer-big's layer; on a CPU, where this is a test of the script, a tiny one
    Run("encoder-layer", 40, gpu_options={"hidden": 1024}, cpu_options={"hidden": 64}),
    Run("hf", 30),
    Run("optimizer", 40),
    Run("plan", 40),
)


def arguments(run: Run, device: str) -> list[str]:
    """``kiln``'s arguments that run ``run`` in its quick form on ``device``."""
    options = [f"--{k}={v}" for k, v in run.options_on(device).items()]
    return ["bench", run.name, "--quick", f"--device={device}", *options]


def command(run: Run, device: str, out: Path) -> list[str]:
    """The command line that runs ``run`` in its quick form on ``device``, into ``out/NAME``."""
    return [sys.executable, "-m", "kiln", *arguments(run, device), f"--out={out / run.name}"]


def run_process(argv: list[str], limit_s: float, prefix: str = "  | ") -> dict[str, Any]:
    """Run ``argv`` in a session of its own for at most ``limit_s`` seconds, printing each line
    it writes (stdout and stderr) as it comes, after ``prefix``. Returns ``status`` (``ok``,
    ``failed``, ``timeout``), ``exit`` (its exit status; None where it was ended), ``seconds`` and
    its ``last_lines``."""
    last: collections.deque[str] = collections.deque(maxlen=LAST_LINES)

    def pump(stream: Any) -> None:
        for line in stream:
            line = line.rstrip("\n")
            last.append(line)
            print(prefix + line, flush=True)

    # Its session does not get this one's signals: a SIGTERM or SIGHUP here (a lease ending, a
    # closed terminal) must end it too, or it would hold the GPU with no one to read its report.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    started = time.perf_counter()
    proc = None
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        reader = threading.Thread(target=pump, args=(proc.stdout,), daemon=True)
        reader.start()
        try:
            code: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
    finally:
        if proc is not None and proc.poll() is None:  # at its limit, or this process was told to end
            _end(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    reader.join(timeout=10)
    status = "timeout" if code is None else "ok" if code == 0 else "failed"
    return {"status": status, "exit": code, "seconds": time.perf_counter() - started, "last_lines": list(last)}


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"kiln bench gpu: {signal.Signals(signum).name}")


def _end(proc: subprocess.Popen) -> None:
    """End ``proc`` and every process it started (its session's group): SIGTERM, then SIGKILL
    to what is left after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _check(run: Run, device: str) -> tuple[str, str] | None:
    """The status and the reason where ``run`` cannot start in this build, or None."""
    from kiln.bench import BENCHMARKS, check_benchmark

    if run.name not in BENCHMARKS:
        return "not available", "not available in this build"
    try:
        check_benchmark(run.name, device=device, **run.options_on(device))
    except (KeyError, ValueError) as exc:
        return "refused", exc.args[0]
    return None


def _targets(report: dict[str, Any]) -> str:
    targets = report.get("targets") or {}
    return f"{sum(bool(t.get('met')) for t in targets.values())}/{len(targets)} met" if targets else ""


def _failure(run: dict[str, Any]) -> str:
    """A row's note where a benchmark did not finish: its last words."""
    lines = [line for line in run["last_lines"] if line.strip()]
    said = lines[-1].strip() if lines else "(it printed nothing)"
    if run["status"] == "timeout":
        return f"ended at its limit of {run['limit_s']:.0f} s; last line: {said}"
    return f"exit {run['exit']}: {said}"


def measure(quick: bool = False, device: str = "cuda", out: Path | None = None) -> Result:
    """Run :data:`RUNS` one after another on ``device``, each in its own process, into ``out``."""
    out = Path(out if out is not None else tempfile.mkdtemp(prefix="kiln-bench-gpu-")).resolve()
    budget = BUDGET_S["cpu" if device == "cpu" else "cuda"]
    scale = CPU_SLOWER if device == "cpu" else 1
    started = time.perf_counter()
    rows, texts = [], []
    for i, run in enumerate(RUNS, 1):
        spent = time.perf_counter() - started
        left = budget - spent
        head = f"[gpu {i}/{len(RUNS)}, {spent:.0f} s of {budget:.0f}] {run.name}"
        row = {"benchmark": run.name, "command": " ".join(["kiln", *arguments(run, device)]), "seconds": None,
               "limit_s": None, "targets": "", "note": ""}
        why = _check(run, device)
        if why is None and left < MIN_START_S:
            why = "not run", f"{left:.0f} s of the {budget:.0f} s budget left"
        if why is not None:
            row.update(status=why[0], note=why[1])
            print(f"{head}: {why[0]}: {why[1]}", flush=True)
            rows.append(row)
            continue
        limit = min(run.limit_s * scale, left)
        print(f"{head}: {row['command']} (limit {limit:.0f} s)", flush=True)
        saved = out / run.name / f"{run.name}.json"
        saved.unlink(missing_ok=True)  # an earlier run's report is not this one's
        done = run_process(command(run, device, out), limit)
        done["limit_s"] = limit
        row.update(status=done["status"], seconds=done["seconds"], limit_s=limit)
        if done["status"] == "ok" and saved.exists():
            row["report"] = json.loads(saved.read_text())
            row["targets"] = _targets(row["report"])
            texts.append((out / run.name / f"{run.name}.txt").read_text().rstrip())
        else:
            if done["status"] == "ok":  # it exited 0 and wrote no report
                done.update(status="failed", last_lines=[*done["last_lines"], f"no report at {saved}"])
                row["status"] = "failed"
            row["note"] = _failure(done)
            row["last_lines"] = done["last_lines"]
            texts.append(f"kiln bench {run.name}: {done['status']} after {done['seconds']:.0f} s; its last lines:\n"
                         + "\n".join(done["last_lines"]))
        print(f"{head}: {row['status']} in {done['seconds']:.0f} s" + (f" ({row['note']})" if row["note"] else ""),
              flush=True)
        rows.append(row)
    total = time.perf_counter() - started
    ran = sum(r["status"] == "ok" for r in rows)
    cols = [Col("benchmark", "benchmark"), Col("status", "status"), Col("seconds", "seconds", ".0f"),
            Col("limit s", "limit_s", ".0f"), Col("targets", "targets"), Col("note", "note")]
    where = "the CPU (a test of the script)" if device == "cpu" else "one GPU"
    title = (f"the quick forms of {len(RUNS)} benchmarks on {where}: {ran} finished, {total:.0f} s of a "
             f"{budget:.0f} s budget")
    notes = [f"each benchmark ran as `kiln bench NAME --quick --device {device} ...` in a process of its own, its "
             "report below; what a row's own benchmark measures is the docstring of kiln/bench/NAME.py"]
    targets = {} if device == "cpu" else {"minutes": target(total / 60, budget / 60)}
    report = {"device": device, "budget_s": budget, "total_s": total, "out": str(out), "runs": rows}
    chart = [Bars("seconds each benchmark took (tick: its limit)", rows, "benchmark", {"seconds": "seconds"}, "seconds",
                  marks={"limit": "limit_s"}, horizontal=True,
                  color=lambda r: {"ok": "tab:green", "timeout": "tab:orange"}.get(r["status"], "tab:red"))]
    return Result(report, [Table(rows, cols)], title, chart, targets=targets, notes=notes, texts=texts)


run = benchmark("gpu", measure)
