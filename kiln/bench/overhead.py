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

The step time is the wall time from the step after the warm-up (the first tenth of the steps:
allocator warm-up, kiln's profiled and FLOP-counted first steps) to the last step before the
final evaluation, divided by the steps: kiln's from ``metrics.csv``'s ``wall_seconds``, so that
its logging is counted at its rate. Setup and the final checkpoint are left out of both.

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

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits_mlp.yaml"
HIDDEN, BATCH, LR = 96, 8, 3e-3


def _plain_us(steps: int, warmup: int, device: str) -> float:
    """Microseconds per step of the loop users write (steps ``warmup``..``steps - 1`` timed)."""
    from kiln.data import build_dataset
    from kiln.models import create_model

    torch.manual_seed(0)
    data = build_dataset("digits", seed=0).train
    model = create_model("mlp", in_features=64, hidden=[HIDDEN], num_classes=10).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
    batches = (batch for _ in iter(int, 1) for batch in loader)  # epoch after epoch
    for step in range(steps):
        if step == warmup:
            sync()
            t0 = time.perf_counter()
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # note: waits for the device, as a loop that logs its loss does
    return (time.perf_counter() - t0) / (steps - warmup) * 1e6


def _kiln_us(steps: int, warmup: int, device: str) -> float:
    """Microseconds per step of ``kiln train``, from its metrics rows (see the module)."""
    from kiln.config import load_config
    from kiln.train import read_metrics, train

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(CONFIG, [f"model.hidden=[{HIDDEN}]", f"data.batch_size={BATCH}", f"optim.lr={LR}",
                                   "optim.schedule=constant", f"train.max_steps={steps}", "train.log_every=10",
                                   "train.eval_every=0", "train.precision=fp32", "train.threads=1",
                                   "train.progress=none", f"train.device={device}", f"train.output_dir={out}"])
        rows = read_metrics(train(cfg, name="overhead").run_dir)
    wall = {int(r["step"]): float(r["wall_seconds"]) for r in rows}
    last = max(s for s in wall if s < steps)  # the last row holds the final evaluation too
    return (wall[last] - wall[warmup]) / (last - warmup) * 1e6


def measure(quick: bool = False, device: str = "cpu") -> Result:
    steps, rounds = (200, 1) if quick else (1000, 3)
    warmup = steps // 10
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain, kiln = [], []
        for _ in range(rounds):
            plain.append({"us": _plain_us(steps, warmup, device)})
            kiln.append({"us": _kiln_us(steps, warmup, device)})
    finally:
        torch.set_num_threads(threads)
    ratio, per_round = paired(kiln, plain, "us")
    rows = [{"run": "plain loop", "us": median(r["us"] for r in plain), "x": 1.0, "rounds": [r["us"] for r in plain]},
            {"run": "kiln train", "us": median(r["us"] for r in kiln), "x": ratio, "rounds": [r["us"] for r in kiln]}]
    cols = [Col("run", "run"), Col("us/step", "us", ".0f"), Col("x plain", "x", ".2f"),
            Col("each round", lambda r: ", ".join(f"{u:.0f}" for u in r["rounds"]))]
    where = "CPU" if device == "cpu" else f"GPU {torch.cuda.get_device_name(0)}"
    title = (f"host time per step, MLP of 7,210 parameters, batch {BATCH}, fp32, 1 thread, on the {where}: "
             f"{steps} steps a row ({warmup} warm-up left out), {rounds} alternating round(s)")
    report = {"device": device, "steps": steps, "warmup": warmup, "rounds": rounds, "batch": BATCH,
              "us_per_step": {r["run"]: r["us"] for r in rows}, "kiln_vs_plain": ratio, "per_round": per_round}
    chart = [Bars(f"host time per step ({where})", rows, "run", {"us/step": "us"}, "microseconds per step",
                  color=lambda r: "gray" if r["run"] == "plain loop" else "tab:orange")]
    return Result(report, [Table(rows, cols)], title, chart, targets={"kiln_vs_plain": target(ratio, 1.1)},
                  threads=1)


run = benchmark("overhead", measure)
