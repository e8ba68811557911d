"""``kiln bench memory``: measured activation memory and step time under activation checkpointing.

A 12-block transformer (kiln's :class:`~kiln.models.encoder.EncoderStack`: width 256, FFN
1024, 8 heads, sequence 256, batch 16, mean-pooled regression head, AdamW) is trained under
activation checkpointing ``none`` / ``selective`` (every 2nd block) / ``full`` and precision
``fp32`` / ``bf16-mixed`` (CPU autocast; the bf16 rows only where the CPU computes bf16
natively: where it is emulated they take many minutes and measure nothing a user would run,
and the JSON's notes say they were left out). Memory is measured, not estimated: each
configuration runs in a fresh ``python`` subprocess, so no allocator cache or earlier peak
leaks from one configuration into the next.

Activation memory = peak memory during the training steps minus the baseline, where the
baseline is the memory held after building the model and the optimizer, allocating the
gradients and the optimizer state (one zero-gradient step) and one forward under
``torch.no_grad`` — i.e. params + grads + optimizer state + runtime. On CPU the peak is the
process's high-water resident set (``VmHWM``), reset just before the training steps by
writing 5 to ``/proc/self/clear_refs`` (where that is not allowed, the process's whole peak,
which may include build-time transients; the JSON's ``peak_source`` says which). The
child sets ``MALLOC_MMAP_THRESHOLD_`` so glibc returns freed tensors to the OS and the
resident set follows live memory. On GPU it uses ``torch.cuda.max_memory_allocated``.

Step time is measured separately, in this process, on one model whose checkpointing and
precision are switched between steps (``apply_ac`` can be re-applied at any time), in
interleaved rounds: on a shared machine the load drifts over the minutes the subprocesses
take, and only times taken side by side compare fairly. (Each child's own median step time
is kept in the JSON as ``child_step_ms``.)

    python -m kiln bench memory        # or run(Path("out"), quick=True)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from kiln.bench._harness import Bars, Col, Result, Table, benchmark, interleaved, median, target
from kiln.bench._rss import Rss
from kiln.hardware import machine_info
from kiln.memory import apply_ac
from kiln.models.encoder import EncoderLayerConfig, EncoderStack


__all__ = ["run", "measure"]

AC_MODES = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16-mixed")
# dropout 0, as in most large-model pretraining; with dropout the recompute also redraws the masks.
FULL = dict(depth=12, hidden=256, ffn=1024, heads=8, seq=256, batch=16, steps=3, dropout=0.0)
QUICK = dict(depth=4, hidden=128, ffn=512, heads=8, seq=128, batch=8, steps=2, dropout=0.0)


def _setup(sizes: dict[str, Any], device: Any = "cpu") -> tuple[Any, Any, Any, Any]:
    """The model, its AdamW, an input batch and its regression targets, from seed 0."""
    import torch

    torch.manual_seed(0)
    cfg = EncoderLayerConfig(hidden=sizes["hidden"], ffn=sizes["ffn"], heads=sizes["heads"], dropout=sizes["dropout"])
    model = EncoderStack(cfg, depth=sizes["depth"], out_features=1).to(device)
    x = torch.randn(sizes["batch"], sizes["seq"], sizes["hidden"], device=device)  # (B, T, C)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), x, torch.randn(sizes["batch"], 1, device=device)


def _step(model: Any, optimizer: Any, x: Any, y: Any, precision: str) -> None:
    import torch

    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        out = model(x)  # (B, 1)
    torch.nn.functional.mse_loss(out.float(), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # keep the gradients allocated, as in the baseline


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process: build, take the baseline, train ``steps`` steps, report."""
    import time

    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model, optimizer, x, y = _setup(spec, device)
    apply_ac(model, spec["ac"], every=2)

    # Baseline: gradients and optimizer state exist (a step on zero gradients creates them
    # and leaves them allocated), and kernels have run once on a full-size batch.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["precision"] == "bf16-mixed"):
        model(x)
    static_bytes = 4 * sum(p.numel() * p.element_size() for p in model.parameters())  # params, grads, 2 moments
    rss = Rss()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline, peak_source = torch.cuda.memory_allocated(), "cuda.max_memory_allocated"
    else:
        baseline = rss.restart()
        peak_source = "VmHWM after clear_refs" if rss.peak_reset else "VmHWM (could not reset: the process's peak)"

    times = []
    for _ in range(spec["steps"] + 1):  # the first step is a warm-up
        start = time.perf_counter()
        _step(model, optimizer, x, y, spec["precision"])
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else rss.read()["VmHWM"]
    return {
        "ac": spec["ac"], "precision": spec["precision"],
        "activation_mb": (peak - baseline) / 2**20,
        "peak_mb": peak / 2**20, "baseline_mb": baseline / 2**20, "static_mb": static_bytes / 2**20,
        "child_step_ms": 1e3 * median(times[1:]), "peak_source": peak_source, "device": device.type,
    }


def _time_interleaved(sizes: dict[str, Any], grid: list[tuple[str, str]], rounds: int) -> dict[tuple[str, str], float]:
    """Median step time (ms) of each (ac, precision) on one model, one step of each in turn per round."""

    model, optimizer, x, y = _setup(sizes)

    def step(ac: str, precision: str) -> None:
        apply_ac(model, ac, every=2)
        _step(model, optimizer, x, y, precision)

    steps = {key: lambda key=key: step(*key) for key in grid}
    interleaved(steps, 1)  # warms every configuration up
    return {key: 1e3 * median(t) for key, t in interleaved(steps, rounds).items()}


def _spawn(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    # Fixed thresholds stop glibc from raising them dynamically after large frees, so freed
    # tensors go back to the OS and the resident set tracks live memory.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    env.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")
    code = "import json, sys; from kiln.bench.memory import _child; print(json.dumps(_child(json.loads(sys.argv[1]))))"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"memory benchmark child {spec['ac']}/{spec['precision']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(quick: bool = False) -> Result:
    """Measure every (AC mode, precision): memory in a fresh process each, time side by side here."""
    sizes = QUICK if quick else FULL
    precisions, notes = PRECISIONS, []
    if not machine_info()["native_bf16"]:
        precisions = tuple(p for p in PRECISIONS if not p.startswith("bf16"))
        notes.append("bf16 is emulated on this CPU: the bf16-mixed rows are left out (several times slower than fp32)")
    # The smoke run measures the two ends only; each child costs a torch import.
    grid = [(ac, "fp32") for ac in ("none", "full")] if quick else [(ac, p) for p in precisions for ac in AC_MODES]
    rows = [_spawn({**sizes, "ac": ac, "precision": precision}) for ac, precision in grid]
    step_ms = _time_interleaved(sizes, grid, rounds=sizes["steps"])
    by_key = {(r["ac"], r["precision"]): r for r in rows}
    for r in rows:
        ref = by_key[("none", r["precision"])]
        r["step_ms"] = step_ms[(r["ac"], r["precision"])]
        r["activation_vs_none"] = r["activation_mb"] / ref["activation_mb"]
        r["time_vs_none"] = r["step_ms"] / step_ms[("none", r["precision"])]
    full = by_key[("full", "fp32")]
    targets = {"full_activation_le_40pct": target(full["activation_vs_none"], 0.40),
               "full_time_le_1.4x": target(full["time_vs_none"], 1.4)}
    cols = [Col("ac", "ac"), Col("precision", "precision"), Col("activation MB", "activation_mb", ".1f"),
            Col("vs none", "activation_vs_none", ".2f"), Col("step ms", "step_ms", ".1f"),
            Col("vs none", "time_vs_none", ".2f"), Col("peak MB", "peak_mb", ".1f"), Col("base MB", "baseline_mb", ".1f")]
    label = lambda r: f"{r['ac']} {r['precision']}"  # noqa: E731
    color = lambda r: "#4c72b0" if r["precision"] == "fp32" else "#dd8452"  # noqa: E731
    chart = [Bars("activation memory", rows, label, {"MB": "activation_mb"}, "MB", color=color),
             Bars("step time", rows, label, {"ms": "step_ms"}, "ms", color=color)]
    report = {"setup": {**sizes, "quick": quick, "selective_every": 2, "optimizer": "torch.optim.AdamW"}, "rows": rows}
    return Result(report, [Table(rows, cols)], f"activation checkpointing, {sizes['depth']} blocks of width "
                  f"{sizes['hidden']}, batch {sizes['batch']} x {sizes['seq']}", chart, targets, notes)


run = benchmark("memory", measure)
