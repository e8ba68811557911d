"""``kiln bench pp-schedules``: every pipeline schedule (``parallel.pp_schedule``) on the same
stages and micro-batches: each rank's measured idle share beside the schedule's textbook
bubble, and the step time.

A kiln GPT (``MODEL``) is cut into pipeline stages over ``PP`` gloo processes of one intra-op
thread each (``kiln.launch.testing.run_distributed``), once per schedule (the V-shaped and the
looped ones into ``2 x PP`` stages, the others into ``PP``), all of them built in the same
processes. A round runs one training step of each schedule in turn (``Pipeline.step`` over
``MICROBATCHES`` micro-batches, kiln's AdamW step, ``zero_grad``), so that the drifting load
of a shared machine falls on all alike; ``WARMUP`` rounds (the first step of a schedule also
infers the stages' shapes), then ``ROUNDS`` timed ones. Columns, per schedule:

- stages: pipeline stages in all (two a rank for the interleaved and V-shaped ones).
- bubble (theory): the idle share of each rank in :func:`kiln.parallel._pp.schedule_bubble`,
  torch's own order of the schedule run with every forward, input-gradient and
  weight-gradient pass of a stage taking one unit of time (a whole backward two) and
  communication none: ``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(v m+p-1)`` for
  interleaved 1F1B, and what the weight work leaves of it for the zero-bubble ones.
- rank r idle: that rank's measured share, ``1 - compute_s / W`` per step (``compute_s``: the
  time the rank spent in its stages' forward, backward and weight passes,
  ``Pipeline.last_step_timing`` with ``timing=True``; ``W``: the longest ``wall_s`` of the
  ranks in that step, since the ranks start the schedule together and the last to finish
  ends it), the median over the timed rounds. It includes what the unit-cost model leaves
  out: the point-to-point waits, the loss, the schedule's own Python, stages of unequal cost
  (the first also embeds, the last also runs the head), and a weight pass that costs more
  or less than the input pass.
- mean idle: the ranks' mean; step ms: the median wall time of the pipeline step (the slowest
  rank's ``Pipeline.step``), and of the whole training step with the optimizer, rank 0's
  clock between barriers; vs 1f1b: the step time over 1F1B's, each round's ratio, median.
- bubble (costs): the idle share :func:`~kiln.parallel._pp.schedule_bubble` gives when each
  ``(stage, pass)`` of torch's order takes the CPU time it took here (the median over the timed
  steps, ``Pipeline.last_step_timing["pass_cpu_s"]``) instead of one unit, communication still
  none; ranks' mean, each rank's in the JSON. Unlike the measured idle it does not depend on
  what else runs on the machine, and unlike the unit theory it has the real passes: the
  first stage's input pass empty and its weight pass a whole backward (torch's way), the
  input/weight split costing more than a whole backward, stages of unequal cost. cpu ms: the
  step that order takes at those costs.
- descheduled: the share of the pipeline step the ranks were ready to run but waiting for a
  core (``run_delay`` of ``/proc/thread-self/schedstat``, Linux; ranks' mean). Above a few
  percent, other processes set the measured idle more than the schedule does: a rank's pass
  is stretched while another process has its core, and its peer waits for it.

Two ranks of one thread each on a 2-core machine have a core each only while no other work
runs (the load is in the report's machine line).

    kiln bench pp-schedules        # or --quick for a smoke run
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

import kiln.optim
from kiln.bench._harness import Bars, Col, Result, Table, benchmark, target
from kiln.launch.testing import run_distributed
from kiln.models import create_model
from kiln.parallel import PP_SCHEDULES, SPLIT_BACKWARD, build_pipeline, check_pipeline, schedule_bubble, stage_ranks


# Shape legend: B batch per step, T sequence length, V vocabulary.
MODEL = dict(vocab_size=256, seq_len=128, dim=256, depth=8, heads=8, dropout=0.0)  # 6.5 M parameters
PP, MICROBATCHES, BATCH = 2, 8, 16  # a micro-batch of 2 sequences
WARMUP, ROUNDS = 2, 8
QUICK_MODEL = dict(MODEL, seq_len=16, dim=32, depth=4, heads=4)
QUICK_MICROBATCHES, QUICK_BATCH, QUICK_WARMUP, QUICK_ROUNDS = 4, 8, 1, 2


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())  # (B*T, V), (B*T,)


def _run_delay_s() -> float | None:
    """Seconds this thread has been ready to run but waiting for a core (Linux's schedstat;
    None where there is none)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _worker(rank: int, world: int, schedules: list[str], s: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    runs = {}
    for name in schedules:
        torch.manual_seed(0)  # the same whole model on every rank, and for every schedule
        pipe = build_pipeline(create_model("gpt", **s["model"]), None, schedule=name, microbatches=s["microbatches"],
                              loss_fn=_loss, timing=True)
        runs[name] = (pipe, kiln.optim.AdamW(list(pipe.parameters()), lr=1e-4))
    gen = torch.Generator().manual_seed(1)
    B, T, V = s["batch"], s["model"]["seq_len"], s["model"]["vocab_size"]
    out: dict[str, list[dict[str, float]]] = {name: [] for name in schedules}
    for round_ in range(s["warmup"] + s["rounds"]):
        ids, targets = torch.randint(V, (B, T), generator=gen), torch.randint(V, (B, T), generator=gen)  # (B, T)
        for name in schedules:
            pipe, opt = runs[name]
            dist.barrier()
            t0, delay0 = time.perf_counter(), _run_delay_s()
            pipe.step(ids, targets)
            delay = None if delay0 is None else _run_delay_s() - delay0
            opt.step()
            opt.zero_grad()
            dist.barrier()
            step_s = time.perf_counter() - t0
            if round_ >= s["warmup"]:
                out[name].append({"step_s": step_s, "delay_s": delay, **pipe.last_step_timing})
    return {"rank": rank, "steps": out}


def _row(name: str, ranks: list[dict[str, Any]], s: dict[str, Any]) -> dict[str, Any]:
    pp, m = len(ranks), s["microbatches"]
    steps = [r["steps"][name] for r in ranks]
    walls = [max(rank[i]["wall_s"] for rank in steps) for i in range(len(steps[0]))]  # the pipeline's step
    idle = [statistics.median(1 - st["compute_s"] / w for st, w in zip(rank, walls)) for rank in steps]
    theory = schedule_bubble(name, pp, m)
    # each (stage, pass)'s median CPU seconds over the timed steps (a stage lives on one rank)
    costs = {key: statistics.median(t for st in rank for t in st["pass_cpu_s"].get(key, ()))
             for rank in steps for key in rank[0]["pass_cpu_s"]}
    with_costs = schedule_bubble(name, pp, m, costs=costs)
    # one step's CPU seconds of compute on rank 0 at those costs, over its busy share: the step's length
    busy0 = sum(costs[key] * len(times) for key, times in steps[0][0]["pass_cpu_s"].items())
    delays = None if steps[0][0]["delay_s"] is None else [
        statistics.median(st["delay_s"] / st["wall_s"] for st in rank) for rank in steps]
    return {"schedule": name, "stages": len(stage_ranks(pp, name)),
            "pp": pp, "microbatches": m, "zero_bubble": name in SPLIT_BACKWARD,
            "bubble_theory": sum(theory) / pp, "bubble_theory_per_rank": theory,
            "bubble_costs": sum(with_costs) / pp, "bubble_costs_per_rank": with_costs,
            "pass_cpu_ms": {f"{kind}{stage}": c * 1e3 for (stage, kind), c in sorted(costs.items())},
            "cpu_step_ms": busy0 / (1 - with_costs[0]) * 1e3,
            "descheduled_per_rank": delays, "descheduled": None if delays is None else sum(delays) / pp,
            "idle_per_rank": idle,
            "idle_mean": sum(idle) / pp, "pipeline_ms": statistics.median(walls) * 1e3,
            "step_ms": statistics.median(st["step_s"] for st in steps[0]) * 1e3,
            "step_s_rounds": [st["step_s"] for st in steps[0]]}


def _split_cost(rows: list[dict[str, Any]]) -> float | None:
    """``(I + W) / B`` of the same stage, interleaved-zb's passes over interleaved-1f1b's (the
    same loop placement and cut), mean over the stages but the first (whose input pass torch
    leaves empty); None unless both ran."""
    by = {r["schedule"]: r["pass_cpu_ms"] for r in rows}
    if "interleaved-zb" not in by or "interleaved-1f1b" not in by:
        return None
    zb, whole = by["interleaved-zb"], by["interleaved-1f1b"]
    ratios = [(zb[f"I{s}"] + zb[f"W{s}"]) / whole[f"B{s}"] for s in range(1, 2 * PP)]
    return sum(ratios) / len(ratios)


def settings_for(quick: bool) -> dict[str, Any]:
    """Model, batch and rounds of a full or a ``--quick`` run."""
    if quick:
        return {"model": QUICK_MODEL, "batch": QUICK_BATCH, "microbatches": QUICK_MICROBATCHES,
                "warmup": QUICK_WARMUP, "rounds": QUICK_ROUNDS}
    return {"model": MODEL, "batch": BATCH, "microbatches": MICROBATCHES, "warmup": WARMUP, "rounds": ROUNDS}


def measure(quick: bool = False, *, settings: dict[str, Any] | None = None,
            schedules: tuple[str, ...] | None = None) -> Result:
    """Every schedule at ``PP`` ranks. ``settings`` (see :func:`settings_for`) and ``schedules``
    narrow the run (tests)."""

    s = settings or settings_for(quick)
    names = list(schedules or PP_SCHEDULES)
    for name in names:  # refused here, in one line, rather than in a spawned rank
        check_pipeline(s["model"]["depth"], PP, name, s["microbatches"], s["batch"])
    ranks = run_distributed(_worker, PP, names, s, threads=1, timeout_s=600)
    rows = [_row(name, ranks, s) for name in names]
    base = next((r for r in rows if r["schedule"] == "1f1b"), None)
    for r in rows:
        r["step_vs_1f1b"] = (statistics.median(a / b for a, b in zip(r["step_s_rounds"], base["step_s_rounds"]))
                             if base else None)
    cols = [Col("schedule", "schedule"), Col("stages", "stages"), Col("bubble (theory)", "bubble_theory", ".3f"),
            *[Col(f"rank {i} idle", lambda r, i=i: r["idle_per_rank"][i], ".3f") for i in range(PP)],
            Col("mean idle", "idle_mean", ".3f"), Col("pipeline ms", "pipeline_ms", ".1f"),
            Col("step ms", "step_ms", ".1f"), Col("vs 1f1b", "step_vs_1f1b", ".2f"),
            Col("bubble (costs)", "bubble_costs", ".3f"), Col("cpu ms", "cpu_step_ms", ".1f"),
            Col("descheduled", "descheduled", ".2f")]
    chart = [Bars("idle share of a step: measured per rank, and the schedule's theory", rows, "schedule",
                  {**{f"rank {i}": (lambda r, i=i: r["idle_per_rank"][i]) for i in range(PP)},
                   "theory": "bubble_theory", "at measured costs": "bubble_costs"}, "idle share"),
             Bars("step time, ms", rows, "schedule", {"pipeline": "pipeline_ms", "with optimizer": "step_ms"}, "ms")]
    targets, notes = {}, []
    if base is not None:
        for r in rows:
            if r["zero_bubble"]:
                # the goal: a zero-bubble schedule idles less than 1F1B at the same stages and micro-batches
                targets[f"{r['schedule']}_idle_vs_1f1b"] = target(r["idle_mean"], base["idle_mean"], row=r["schedule"])
        for r in rows:
            if r["zero_bubble"]:
                notes.append(f"{r['schedule']} at the passes' measured CPU costs: bubble {r['bubble_costs']:.3f} "
                             f"against 1f1b's {base['bubble_costs']:.3f}, a step of {r['cpu_step_ms']:.0f} ms "
                             f"against {base['cpu_step_ms']:.0f}")
        best = min((r for r in rows if r["zero_bubble"]), key=lambda r: r["idle_mean"], default=None)
        if best is not None:
            notes.append(f"lowest measured idle of the zero-bubble schedules: {best['schedule']} "
                         f"{best['idle_mean']:.3f} against 1f1b's {base['idle_mean']:.3f} "
                         f"(theory {best['bubble_theory']:.3f} against {base['bubble_theory']:.3f}); "
                         f"its step x{best['step_vs_1f1b']:.2f} of 1f1b's")
    split = _split_cost(rows)
    if split is not None:
        notes.append(f"a stage's input and weight passes (interleaved-zb) cost x{split:.2f} the CPU time of its "
                     "whole backward (interleaved-1f1b, the same 4 stages), mean over the stages but the first")
    report = {"setup": {**s, "pp": PP, "threads_per_process": 1, "backend": "gloo", "optimizer": "kiln AdamW fp32",
                        "quick": quick}, "rows": rows}
    title = (f"pipeline schedules at pp={PP}, m={s['microbatches']} micro-batches of {s['batch'] // s['microbatches']} "
             f"x seq {s['model']['seq_len']}; GPT depth {s['model']['depth']} width {s['model']['dim']}; "
             "1 thread per process")
    return Result(report, [Table(rows, cols)], title, chart, targets=targets, notes=notes, threads=1, processes=PP)


run = benchmark("pp-schedules", measure)
