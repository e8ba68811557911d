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
writing 5 to ``/proc/self/clear_refs``; where that is not allowed it falls back to
``ru_maxrss`` (which then may include build-time transients; the JSON says which). The
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
import time
from pathlib import Path
from typing import Any

from kiln.hardware import machine_info, machine_line

__all__ = ["run"]

AC_MODES = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16-mixed")
# dropout 0, as in most large-model pretraining; with dropout the recompute also redraws the masks.
FULL = dict(depth=12, hidden=256, ffn=1024, heads=8, seq=256, batch=16, steps=3, dropout=0.0)
QUICK = dict(depth=4, hidden=128, ffn=512, heads=8, seq=128, batch=8, steps=2, dropout=0.0)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "reset the peak resident set size" (proc(5))
        return True
    except OSError:
        return False


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process: build, take the baseline, train ``steps`` steps, report."""
    import resource

    import torch

    from kiln.memory import apply_ac
    from kiln.models.encoder import EncoderLayerConfig, EncoderStack

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    cfg = EncoderLayerConfig(hidden=spec["hidden"], ffn=spec["ffn"], heads=spec["heads"], dropout=spec["dropout"])
    model = EncoderStack(cfg, depth=spec["depth"], out_features=1).to(device)
    apply_ac(model, spec["ac"], every=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(spec["batch"], spec["seq"], spec["hidden"], device=device)  # (B, T, C)
    target = torch.randn(spec["batch"], 1, device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["precision"] == "bf16-mixed")

    # Baseline: gradients and optimizer state exist (a step on zero gradients creates them
    # and leaves them allocated), and kernels have run once on a full-size batch.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad(), autocast:
        model(x)
    static_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    static_bytes *= 4  # params + grads + AdamW's exp_avg and exp_avg_sq
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        peak_source = "cuda.max_memory_allocated"
    else:
        baseline = _rss_bytes()
        peak_source = "VmHWM after clear_refs" if _reset_hwm() else "ru_maxrss (could not reset)"

    times = []
    for _ in range(spec["steps"] + 1):  # the first step is a warm-up
        start = time.perf_counter()
        with autocast:
            out = model(x)  # (B, 1)
        loss = torch.nn.functional.mse_loss(out.float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradients allocated, as in the baseline
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)

    if cuda:
        peak = torch.cuda.max_memory_allocated()
    elif peak_source.startswith("VmHWM"):
        peak = _hwm_bytes()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    steady = sorted(times[1:])
    return {
        "ac": spec["ac"], "precision": spec["precision"],
        "activation_mb": (peak - baseline) / 2**20,
        "peak_mb": peak / 2**20, "baseline_mb": baseline / 2**20, "static_mb": static_bytes / 2**20,
        "child_step_ms": 1e3 * steady[len(steady) // 2], "peak_source": peak_source, "device": device.type,
    }


def _time_interleaved(sizes: dict[str, Any], grid: list[tuple[str, str]], rounds: int) -> dict[tuple[str, str], float]:
    """Median step time (ms) of each (ac, precision), one step of each in turn per round."""
    import torch

    from kiln.memory import apply_ac
    from kiln.models.encoder import EncoderLayerConfig, EncoderStack

    torch.manual_seed(0)
    cfg = EncoderLayerConfig(hidden=sizes["hidden"], ffn=sizes["ffn"], heads=sizes["heads"], dropout=sizes["dropout"])
    model = EncoderStack(cfg, depth=sizes["depth"], out_features=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(sizes["batch"], sizes["seq"], sizes["hidden"])  # (B, T, C)
    target = torch.randn(sizes["batch"], 1)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in grid}
    for r in range(rounds + 1):  # round 0 warms up every configuration
        for ac, precision in grid:
            apply_ac(model, ac, every=2)
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                out = model(x)  # (B, 1)
            torch.nn.functional.mse_loss(out.float(), target).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            if r:
                times[(ac, precision)].append(time.perf_counter() - start)
    return {key: 1e3 * sorted(v)[len(v) // 2] for key, v in times.items()}


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


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    from kiln._plotting import pyplot

    plt = pyplot()

    labels = [f"{r['ac']}\n{r['precision']}" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["#4c72b0" if r["precision"] == "fp32" else "#dd8452" for r in rows]
    ax1.bar(labels, [r["activation_mb"] for r in rows], color=colors)
    ax1.set_ylabel("activation memory (MB)")
    ax2.bar(labels, [r["step_ms"] for r in rows], color=colors)
    ax2.set_ylabel("step time (ms)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("activation checkpointing: measured memory and time (blue fp32, orange bf16-mixed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out_dir: Path, quick: bool = False) -> dict[str, Any]:
    """Measure every (AC mode, precision); print the table, write ``memory.json`` and ``memory.png``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = QUICK if quick else FULL
    machine, notes = machine_info(), []
    precisions = PRECISIONS
    if not machine["native_bf16"]:
        precisions = tuple(p for p in PRECISIONS if not p.startswith("bf16"))
        notes.append("bf16 is emulated on this CPU: the bf16-mixed rows are left out (several times slower than fp32)")
    # The smoke run measures the two ends only; each child costs a torch import.
    grid = [(ac, "fp32") for ac in ("none", "full")] if quick else [(ac, p) for p in precisions for ac in AC_MODES]
    rows = [_spawn({**sizes, "ac": ac, "precision": precision}) for ac, precision in grid]
    step_ms = _time_interleaved(sizes, grid, rounds=sizes["steps"])
    for r in rows:
        r["step_ms"] = step_ms[(r["ac"], r["precision"])]

    by_key = {(r["ac"], r["precision"]): r for r in rows}
    for r in rows:
        ref = by_key[("none", r["precision"])]
        r["activation_vs_none"] = r["activation_mb"] / ref["activation_mb"]
        r["time_vs_none"] = r["step_ms"] / ref["step_ms"]
    full = by_key[("full", "fp32")]
    targets = {"full_activation_le_40pct": {"value": full["activation_vs_none"], "target": 0.40,
                                            "met": full["activation_vs_none"] <= 0.40},
               "full_time_le_1.4x": {"value": full["time_vs_none"], "target": 1.4,
                                     "met": full["time_vs_none"] <= 1.4}}

    print(f"kiln bench memory on {machine_line(machine)}")
    print(f"{'ac':10} {'precision':11} {'activation MB':>13} {'vs none':>8} {'step ms':>9} {'vs none':>8} "
          f"{'peak MB':>9} {'base MB':>9}")
    for r in rows:
        print(f"{r['ac']:10} {r['precision']:11} {r['activation_mb']:13.1f} {r['activation_vs_none']:8.2f} "
              f"{r['step_ms']:9.1f} {r['time_vs_none']:7.2f}x {r['peak_mb']:9.1f} {r['baseline_mb']:9.1f}")
    for name, t in targets.items():
        print(f"target {name}: {t['value']:.2f} ({'met' if t['met'] else 'MISSED'})")
    for note in notes:
        print("note:", note)
    report = {"benchmark": "memory", "machine": machine,
              "setup": {**sizes, "quick": quick, "selective_every": 2, "optimizer": "torch.optim.AdamW"},
              "rows": rows, "targets": targets, "notes": notes}
    (out_dir / "memory.json").write_text(json.dumps(report, indent=2))
    _plot(rows, out_dir / "memory.png")
    return report
