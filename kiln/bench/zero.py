"""``kiln bench zero``: bytes each rank holds for parameters, gradients and optimizer state
under data parallel (zero 0), ZeRO stages 1 and 2 (kiln's arena) and stage 3 (FSDP2), at dp=2
and dp=4, and HSDP at dp=4 (stage 3 with ``parallel.replicate=2``: two replicas of two shards),
with AdamW in fp32.

Measured, not computed: after two training steps (between steps, after ``zero_grad``, where
the forward pass of the next step would run) each rank sums ``untyped_storage().nbytes()``
over the distinct storages it really holds: the arena's parameter buffer; the full flat
gradient (0 bytes when freed) and any separate shard gradient; every optimizer-state buffer
(the wrapped optimizer's and the shard's); for stage 3 the local shards of FSDP2's DTensor
parameters, gradients (zeroed in place, not freed, so that they count as the 4/N they are
during a step) and optimizer state. Next to them, the ZeRO paper's formulas
(Rajbhandari et al., arXiv 1910.02054, fp32 with Adam: 4 bytes/param of parameters, 4 of
gradients, 8 of state; stage 1 shards the state, stage 2 also the gradients, stage 3 also
the parameters), per parameter for P parameters and N ranks::
    stage 0: 4 + 4 + 8 = 16       stage 1: 4 + 4 + 8/N
    stage 2: 4 + 12/N              stage 3: 16/N   (FSDP2)
    HSDP, R replicas of S = N/R:   16/S            (stage 3 within a group, replicated across)

Target: at stage 2 a rank's gradient + optimizer-state bytes are at most (1/dp + 5%) of
stage 0's; HSDP's bytes follow 16/S (within 2%), not 16/N. Measured bytes exceed the formulas
only by the arena's alignment padding.

    python -c "from kiln.bench import run_benchmark; run_benchmark('zero')"
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from kiln.bench._harness import Bars, Col, Result, Table, benchmark, median, target
from kiln.bench._rss import held_bytes
from kiln.launch.testing import run_distributed
from kiln.parallel import Layout, ZeroOptimizer, broadcast_parameters, build_mesh, fsdp_mesh


WIDTH, DEPTH = 1024, 3            # 3 x (1024x1024 + 3 x 1024) = 3.16 M parameters
QUICK_WIDTH, QUICK_DEPTH = 128, 2
FORMULA = {0: lambda n: (4, 4, 8), 1: lambda n: (4, 4, 8 / n), 2: lambda n: (4, 4 / n, 8 / n),
           3: lambda n: (4 / n, 4 / n, 8 / n)}


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers)


def _train(model: nn.Module, step: Callable[[], None], rank: int, width: int, steps: int) -> float:
    """Median ms of ``steps`` training steps (the first one left out) on this rank's random batches."""
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        x = torch.randn(8, width, generator=g)
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        step()
        times.append(time.perf_counter() - t0)
    return median(times[1:] or times) * 1e3


def _row(stage: int, world: int, rank: int, model: nn.Module, grads: list, state: list, ms: float,
         replicate: int = 1) -> dict[str, Any]:
    params = list(model.parameters())
    return {"dp": world, "stage": stage, "replicate": replicate, "rank": rank,
            "n_params": sum(p.numel() for p in params),
            "param_bytes": held_bytes(params), "grad_bytes": held_bytes(grads), "state_bytes": held_bytes(state),
            "step_ms": ms}


def _worker(rank: int, world: int, width: int, depth: int, steps: int) -> list[dict[str, Any]]:
    import kiln.optim as ko

    rows = []
    for stage in (0, 1, 2):
        model = _model(width, depth)
        opt = ko.AdamW(model.parameters(), lr=1e-3, shard_multiple=world)
        broadcast_parameters(model)
        zero = ZeroOptimizer(opt, stage)
        ms = _train(model, lambda: (zero.step(), zero.zero_grad()), rank, width, steps)
        rows.append(_row(stage, world, rank, model, zero.grad_buffers(), zero.state_tensors(), ms))
        del zero, opt, model
    for replicate in HSDP.get(world, (1,)):
        rows.append(_fsdp_row(rank, world, width, depth, steps, replicate))
    return rows


HSDP = {4: (1, 2)}  # dp -> replicas of the stage 3 rows (1: FSDP2 over all dp ranks; 2: HSDP 2 x 2)


def _fsdp_row(rank: int, world: int, width: int, depth: int, steps: int, replicate: int) -> dict[str, Any]:
    """Stage 3: FSDP2 ``fully_shard`` on every Linear and the root, on kiln's mesh for
    ``replicate`` replicas (HSDP when > 1), kiln's AdamW stepping the local shards (multi-tensor mode)."""
    import kiln.optim as ko
    from torch.distributed.fsdp import fully_shard

    layout = Layout(dp=world, replicate=replicate)
    mesh = fsdp_mesh(build_mesh(layout), layout)
    model = _model(width, depth)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ko.AdamW(model.parameters(), lr=1e-3, contiguous=False)
    ms = _train(model, lambda: (opt.step(), opt.zero_grad(set_to_none=False)), rank, width, steps)
    return _row(3, world, rank, model, opt.grad_buffers(), opt.state_tensors(), ms, replicate)


def measure(quick: bool = False) -> Result:
    width, depth = (QUICK_WIDTH, QUICK_DEPTH) if quick else (WIDTH, DEPTH)
    steps = 2 if quick else 4
    rows: list[dict[str, Any]] = []
    for dp in (2, 4):
        per_rank = run_distributed(_worker, dp, width, depth, steps)
        for stage, replicate in [(0, 1), (1, 1), (2, 1), *((3, r) for r in HSDP.get(dp, (1,)))]:
            mine = [r for ranks in per_rank for r in ranks if (r["stage"], r["replicate"]) == (stage, replicate)]
            # the largest rank (all equal here: equal shards) is what must fit on a device
            row = max(mine, key=lambda r: r["param_bytes"] + r["grad_bytes"] + r["state_bytes"])
            rows.append({**{k: v for k, v in row.items() if k != "rank"}, "step_ms": median(r["step_ms"] for r in mine)})
    for r in rows:
        p, g, s = FORMULA[r["stage"]](r["dp"] // r["replicate"])  # (HSDP: sharded over one group's S ranks)
        r["paper_bytes_per_param"] = p + g + s
        r["paper_parts"] = [p, g, s]
        base = next(b for b in rows if b["dp"] == r["dp"] and b["stage"] == 0)
        r["bytes_per_param"] = (r["param_bytes"] + r["grad_bytes"] + r["state_bytes"]) / r["n_params"]
        r["gs_vs_stage0"] = (r["grad_bytes"] + r["state_bytes"]) / (base["grad_bytes"] + base["state_bytes"])
        r["target"] = 1 / r["dp"] + 0.05 if r["stage"] == 2 else None
    targets = {f"dp={r['dp']} stage 2: grads + state <= 1/dp + 5% of stage 0's": target(r["gs_vs_stage0"], r["target"])
               for r in rows if r["stage"] == 2}
    for r in rows:
        if r["replicate"] > 1:
            shards = r["dp"] // r["replicate"]
            targets[f"dp={r['dp']} HSDP {r['replicate']} x {shards}: bytes/param <= 16/{shards} + 2%"] = target(
                r["bytes_per_param"], 16 / shards * 1.02)
    mb = 2.0**-20
    cols = [Col("dp", "dp"), Col("stage", "stage"), Col("replicas", "replicate"),
            Col("params MB", lambda r: r["param_bytes"] * mb, ".2f"),
            Col("grads MB", lambda r: r["grad_bytes"] * mb, ".2f"), Col("state MB", lambda r: r["state_bytes"] * mb, ".2f"),
            Col("total MB", lambda r: (r["param_bytes"] + r["grad_bytes"] + r["state_bytes"]) * mb, ".2f"),
            Col("B/param", "bytes_per_param", ".2f"), Col("paper B/param", "paper_bytes_per_param", ".2f"),
            Col("(g+s)/stage0", "gs_vs_stage0", ".3f"), Col("target", "target", ".3f"), Col("step ms", "step_ms", ".1f")]
    per_param = {name: lambda r, k=key: r[k] / r["n_params"] for name, key in
                 (("parameters", "param_bytes"), ("gradients", "grad_bytes"), ("optimizer state", "state_bytes"))}
    chart = [Bars("bytes per parameter, per rank", rows, _label, per_param,
                  "bytes per parameter", stacked=True, marks={"ZeRO paper formula": "paper_bytes_per_param"})]
    report = {"model": {"width": width, "depth": depth, "n_params": rows[0]["n_params"], "optimizer": "AdamW fp32"},
              "rows": rows, "target_met": all(t["met"] for t in targets.values())}
    # each rank runs one thread (bytes do not depend on it)
    return Result(report, [Table(rows, cols)], f"per-rank memory, AdamW fp32, {rows[0]['n_params'] / 1e6:.2f} M "
                  "parameters", chart, targets, threads=1, processes=4)


def _label(r: dict[str, Any]) -> str:
    hsdp = f" HSDP {r['replicate']}x{r['dp'] // r['replicate']}" if r["replicate"] > 1 else ""
    return f"dp={r['dp']} zero {r['stage']}{hsdp}"


run = benchmark("zero", measure)
