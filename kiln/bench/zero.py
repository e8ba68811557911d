"""``kiln bench zero``: bytes each rank holds for parameters, gradients and optimizer state
under data parallel (zero 0), ZeRO stages 1 and 2 (kiln's arena) and stage 3 (FSDP2), at dp=2
and dp=4, with AdamW in fp32.

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

Target: at stage 2 a rank's gradient + optimizer-state bytes are at most (1/dp + 5%) of
stage 0's. Measured bytes exceed the formulas only by the arena's alignment padding.

    python -c "from kiln.bench import run_benchmark; run_benchmark('zero')"
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.hardware import machine_info, machine_line

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


def _held(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct, allocated storages behind tensors (a DTensor's local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = getattr(t, "_local_tensor", t).untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _worker(rank: int, world: int, width: int, depth: int, steps: int) -> list[dict[str, Any]]:
    import kiln.optim as ko
    from kiln.parallel import ZeroOptimizer, broadcast_parameters

    rows = []
    for stage in (0, 1, 2):
        model = _model(width, depth)
        opt = ko.AdamW(model.parameters(), lr=1e-3, shard_multiple=world)
        broadcast_parameters(model)
        zero = ZeroOptimizer(opt, stage)
        g = torch.Generator().manual_seed(rank)
        times = []
        for _ in range(steps):
            x = torch.randn(8, width, generator=g)
            t0 = time.perf_counter()
            model(x).square().mean().backward()
            zero.step()
            zero.zero_grad()
            times.append(time.perf_counter() - t0)
        grads = [a.grad for a in opt.arenas] + [s.grad for s in zero.shards]
        state = [v for st in opt.state.values() for k, v in st.items() if k != "step"]  # views of flat buffers
        n_params = sum(p.numel() for p in model.parameters())
        rows.append({
            "dp": world, "stage": stage, "rank": rank, "n_params": n_params,
            "param_bytes": _held([p for p in model.parameters()]),
            "grad_bytes": _held(grads),
            "state_bytes": _held(state),
            "step_ms": statistics.median(times[1:] or times) * 1e3,
        })
        del zero, opt, model
    rows.append(_fsdp_row(rank, world, width, depth, steps))
    return rows


def _fsdp_row(rank: int, world: int, width: int, depth: int, steps: int) -> dict[str, Any]:
    """Stage 3: FSDP2 ``fully_shard`` on every Linear and the root, kiln's AdamW stepping the
    local shards (multi-tensor mode)."""
    import kiln.optim as ko
    from torch.distributed.fsdp import fully_shard

    model = _model(width, depth)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = ko.AdamW(model.parameters(), lr=1e-3, contiguous=False)
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        x = torch.randn(8, width, generator=g)
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
    params = list(model.parameters())
    return {
        "dp": world, "stage": 3, "rank": rank, "n_params": sum(p.numel() for p in params),
        "param_bytes": _held(params),
        "grad_bytes": _held([p.grad for p in params if p.grad is not None]),
        "state_bytes": _held([t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]),
        "step_ms": statistics.median(times[1:] or times) * 1e3,
    }


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'dp':>3} {'stage':>5} | {'params MB':>9} {'grads MB':>9} {'state MB':>9} {'total MB':>9} | "
            f"{'B/param':>7} {'paper B/param':>13} | {'(g+s)/stage0':>12} {'target':>7} | {'step ms':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mb = [r[k] / 2**20 for k in ("param_bytes", "grad_bytes", "state_bytes")]
        lines.append(f"{r['dp']:>3} {r['stage']:>5} | {mb[0]:>9.2f} {mb[1]:>9.2f} {mb[2]:>9.2f} {sum(mb):>9.2f} | "
                     f"{r['bytes_per_param']:>7.2f} {r['paper_bytes_per_param']:>13.2f} | "
                     f"{r['gs_vs_stage0']:>12.3f} {'-' if r['target'] is None else format(r['target'], '.3f'):>7} | "
                     f"{r['step_ms']:>7.1f}")
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    from kiln._plotting import pyplot

    plt = pyplot()

    labels = [f"dp={r['dp']}\nzero {r['stage']}" for r in rows]
    parts = [("param_bytes", "parameters"), ("grad_bytes", "gradients"), ("state_bytes", "optimizer state")]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(rows)
    for key, label in parts:
        vals = [r[key] / r["n_params"] for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(labels, [r["paper_bytes_per_param"] for r in rows], color="k", marker="_", s=600,
               zorder=3, label="ZeRO paper formula")
    ax.set_ylabel("bytes per parameter, per rank")
    ax.set_title(f"ZeRO: per-rank memory (AdamW fp32, {rows[0]['n_params'] / 1e6:.2f} M params)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out_dir: Path, quick: bool = False) -> dict[str, Any]:
    from kiln.parallel.testing import run_distributed

    width, depth = (QUICK_WIDTH, QUICK_DEPTH) if quick else (WIDTH, DEPTH)
    steps = 2 if quick else 4
    rows: list[dict[str, Any]] = []
    for dp in (2, 4):
        per_rank = run_distributed(_worker, dp, width, depth, steps)
        for stage in (0, 1, 2, 3):
            mine = [r for ranks in per_rank for r in ranks if r["stage"] == stage]
            # the largest rank (all equal here: equal shards) is what must fit on a device
            row = max(mine, key=lambda r: r["param_bytes"] + r["grad_bytes"] + r["state_bytes"])
            row = {k: v for k, v in row.items() if k != "rank"}
            row["step_ms"] = statistics.median(r["step_ms"] for r in mine)
            rows.append(row)
    for r in rows:
        p, g, s = FORMULA[r["stage"]](r["dp"])
        r["paper_bytes_per_param"] = p + g + s
        r["paper_parts"] = [p, g, s]
        base = next(b for b in rows if b["dp"] == r["dp"] and b["stage"] == 0)
        r["bytes_per_param"] = (r["param_bytes"] + r["grad_bytes"] + r["state_bytes"]) / r["n_params"]
        r["gs_vs_stage0"] = (r["grad_bytes"] + r["state_bytes"]) / (base["grad_bytes"] + base["state_bytes"])
        r["target"] = 1 / r["dp"] + 0.05 if r["stage"] == 2 else None
    stage2 = [r for r in rows if r["stage"] == 2]
    machine = {**machine_info(), "threads": 1}  # each rank runs one thread (bytes do not depend on it)
    report = {
        "machine": machine,
        "model": {"width": width, "depth": depth, "n_params": rows[0]["n_params"], "optimizer": "AdamW fp32"},
        "rows": rows,
        "target_met": all(r["gs_vs_stage0"] <= r["target"] for r in stage2),
    }
    table = _table(rows)
    print(f"kiln bench zero on {machine_line(machine)} per rank")
    print(table)
    print(f"target (stage 2 grads+state <= 1/dp + 5% of stage 0's): {'met' if report['target_met'] else 'MISSED'}")
    (out_dir / "zero.json").write_text(json.dumps(report, indent=2))
    (out_dir / "zero.txt").write_text(table + "\n")
    _plot(rows, out_dir / "zero.png")
    return report
