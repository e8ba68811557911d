"""``kiln bench overhead``: the host time kiln adds to a training step, on a model whose compute
is negligible, against the loop users write.

A launch-bound model (a small model on a GPU) trains only as fast as the host issues its steps:
whatever the trainer does in Python each step (meters, guards, config lookups, progress, reading
the loss) is paid in full. Here the arithmetic is a few microseconds, so the step time is almost
all host time. The model is an MLP of 7,210 parameters (64 -> 96 -> 10, GELU) on scikit-learn's
digits at batch 8, fp32, one thread, constant learning rate; both rows train the same number of
steps, and the rounds alternate (plain, kiln, plain, kiln, ...):

- ``plain loop``: ``DataLoader(shuffle=True, drop_last=True)``, ``torch.optim.AdamW(fused=True)``,
  ``zero_grad(set_to_none=True)``, ``loss.item()`` every step (what a loop that prints or
  logs its loss does);
- ``kiln train``: ``configs/digits_mlp.yaml`` at the same model, batch and learning rate, run by
  ``kiln.train`` in this process with its defaults (kiln's arena AdamW, a log row every
  ``train.log_every`` = 10 steps, the final checkpoint), without the progress display.

Two figures a row, each per step:

- CPU: the host's own time, what this benchmark is about and what its target holds on a CPU:
  the main thread's CPU time (``time.thread_time``), which other work on a shared machine does
  not stretch as it stretches wall time. The plain loop's over its steps after the warm-up
  (the first tenth); kiln's as the difference between a run of 2N steps and a run of N, so
  that set-up, the first steps (profiled, FLOP-counted) and the final checkpoint cancel out and
  its logging counts at its rate;
- wall: the wall time over the same steps (kiln's from ``metrics.csv``'s ``wall_seconds``,
  between the row after the warm-up and the last row before the final evaluation), the figure
  the target holds on a GPU, where the host's time is what keeps the device waiting.

``--device cuda`` runs both on the GPU, where the same figures are the launch-bound case itself.

    kiln bench overhead            # --quick: 200 steps, one round
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kiln.bench._harness import Bars, Col, Result, Table, benchmark, median, paired, sync, target
from kiln.config import load_config
from kiln.data import build_dataset
from kiln.models import create_model
from kiln.train import read_metrics, train


CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits_mlp.yaml"
HIDDEN, BATCH, LR = 96, 8, 3e-3


def _plain(steps: int, warmup: int, device: str) -> dict[str, float]:
    """The loop users write: wall and CPU microseconds per step over steps ``warmup``.. ."""

    torch.manual_seed(0)
    data = build_dataset("digits", seed=0).train
    model = create_model("mlp", in_features=64, hidden=[HIDDEN], num_classes=10).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
    batches = (batch for _ in iter(int, 1) for batch in loader)  # epoch after epoch
    for step in range(steps):
        if step == warmup:
            sync()
            t0, c0 = time.perf_counter(), time.thread_time()
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # note: waits for the device, as a loop that logs its loss does
    timed = steps - warmup
    return {"wall": (time.perf_counter() - t0) / timed * 1e6, "cpu": (time.thread_time() - c0) / timed * 1e6}


def _kiln_run(steps: int, device: str) -> tuple[float, dict[int, float]]:
    """``kiln train`` of ``steps`` steps in this process: its CPU seconds, and its metrics
    rows' wall seconds by step."""

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(CONFIG, [f"model.hidden=[{HIDDEN}]", f"data.batch_size={BATCH}", f"optim.lr={LR}",
                                   "optim.schedule=constant", f"train.max_steps={steps}", "train.log_every=10",
                                   "train.eval_every=0", "train.precision=fp32", "train.threads=1",
                                   "train.progress=none", f"train.device={device}", f"train.output_dir={out}"])
        c0 = time.thread_time()
        run_dir = train(cfg, name="overhead").run_dir
        cpu = time.thread_time() - c0
        return cpu, {int(r["step"]): float(r["wall_seconds"]) for r in read_metrics(run_dir)}


def _kiln(steps: int, warmup: int, device: str) -> dict[str, float]:
    """``kiln train``: CPU microseconds per step from runs of ``steps`` and ``2 * steps`` steps,
    wall microseconds from the longer run's rows (see the module)."""
    short, _ = _kiln_run(steps, device)
    long, wall = _kiln_run(2 * steps, device)
    last = max(s for s in wall if s < 2 * steps)  # the last row holds the final evaluation too
    return {"wall": (wall[last] - wall[warmup]) / (last - warmup) * 1e6, "cpu": (long - short) / steps * 1e6}


def measure(quick: bool = False, device: str = "cpu") -> Result:
    steps, rounds = (200, 1) if quick else (1000, 3)
    warmup = steps // 10
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _kiln_run(warmup, device)  # first-time costs (imports, the CPU's peak FLOP/s, first save) out of the rounds
        plain, kiln = [], []
        for _ in range(rounds):
            plain.append(_plain(steps, warmup, device))
            kiln.append(_kiln(steps, warmup, device))
    finally:
        torch.set_num_threads(threads)
    ratios = {k: paired(kiln, plain, k) for k in ("cpu", "wall")}
    rows = [{"run": name, **{k: median(r[k] for r in runs) for k in ("cpu", "wall")},
             **{f"x_{k}": 1.0 if name == "plain loop" else ratios[k][0] for k in ("cpu", "wall")},
             "rounds": [r["cpu"] for r in runs]}
            for name, runs in (("plain loop", plain), ("kiln train", kiln))]
    cols = [Col("run", "run"), Col("CPU us/step", "cpu", ".0f"), Col("x plain", "x_cpu", ".2f"),
            Col("wall us/step", "wall", ".0f"), Col("x plain", "x_wall", ".2f"),
            Col("CPU us, each round", lambda r: ", ".join(f"{u:.0f}" for u in r["rounds"]))]
    where = "CPU" if device == "cpu" else f"GPU {torch.cuda.get_device_name(0)}"
    held = "cpu" if device == "cpu" else "wall"  # the host's own time; on a GPU, what the device waits on
    title = (f"host time per step, MLP of 7,210 parameters, batch {BATCH}, fp32, 1 thread, on the {where}: "
             f"{steps} steps a row ({warmup} warm-up left out), {rounds} alternating round(s)")
    report = {"device": device, "steps": steps, "warmup": warmup, "rounds": rounds, "batch": BATCH,
              "us_per_step": {r["run"]: {"cpu": r["cpu"], "wall": r["wall"]} for r in rows},
              "kiln_vs_plain": {k: v[0] for k, v in ratios.items()}, "per_round": {k: v[1] for k, v in ratios.items()},
              "target_on": held}
    chart = [Bars(f"host time per step ({where})", rows, "run", {"CPU us": "cpu", "wall us": "wall"},
                  "microseconds per step")]
    return Result(report, [Table(rows, cols)], title, chart,
                  targets={f"kiln_vs_plain_{held}": target(ratios[held][0], 1.1)}, threads=1)


run = benchmark("overhead", measure)
