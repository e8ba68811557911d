"""``kiln bench ddp``: data-parallel scaling on CPU, 2 processes x 1 thread against
1 process x 1 thread, on the digits ViT and on a small GPT-like causal transformer.

Both sides train the same global batch for the same number of steps, with kiln's AdamW
(arena) and the trainer's per-step order: forward, backward, ``all_reduce_gradients``,
step, zero_grad. Each process joins a gloo group on 127.0.0.1 with one intra-op thread
(``kiln.parallel.testing.run_distributed``); the 1-process side runs in the same harness,
where the all-reduce is a no-op. Reported:

- samples/s = global batch x timed steps / wall time between two barriers (rank 0's clock);
- scaling efficiency = samples/s with 2 / (2 x samples/s with 1): 1.0 is perfect scaling;
- gradient-communication ms/step: the median over steps of the ``all_reduce_gradients``
  call, timed on each rank (the slower of the two ranks' medians is reported). It includes
  the wait for the other rank to arrive, so it is an upper bound on the wire time.

The two sides alternate for ``ROUNDS`` rounds and the median round is kept, because other
work on a small shared machine makes one round drift. 2 processes need 2 free cores.

    kiln bench ddp            # or: kiln bench ddp --quick
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

# Shape legend: B batch (per rank), T sequence length, C width, V vocabulary.

VIT = dict(name="vit", image_size=8, patch_size=2, dim=64, depth=4, heads=4, pool="mean")  # configs/digits_vit.py
GPT = dict(vocab=256, seq_len=64, dim=128, depth=4, heads=4)
BATCH = {"vit": 64, "gpt": 32}  # global batch per optimizer step
STEPS, WARMUP, ROUNDS = 40, 5, 3
QUICK_STEPS, QUICK_WARMUP, QUICK_ROUNDS = 2, 1, 1


class TinyGPT(nn.Module):
    """A small decoder-only transformer: token + learned position embeddings, pre-LN
    ``nn.TransformerEncoder`` layers under a causal mask, and a linear head to the vocabulary."""

    def __init__(self, vocab: int, seq_len: int, dim: int, depth: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False).layers
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        T = ids.shape[1]
        x = self.tok(ids) + self.pos[:T]  # (B, T, C)
        for block in self.blocks:
            x = block(x, src_mask=self.mask[:T, :T], is_causal=True)
        return self.head(self.norm(x))


def _setup(model_name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any]:
    """Model (same initial weights on every rank), the train inputs/targets, and the loss."""
    from kiln.data import build_dataset

    torch.manual_seed(0)
    if model_name == "vit":
        from kiln.models import create_model

        model = create_model(**VIT)
        splits = build_dataset("digits", seed=0)
        return model, *splits.train.tensors, nn.functional.cross_entropy
    model = TinyGPT(**GPT)
    splits = build_dataset("synthetic_tokens", seed=0, seq_len=GPT["seq_len"], vocab_size=GPT["vocab"])

    def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B*T, V), (B*T,)

    return model, *splits.train.tensors, lm_loss


def _worker(rank: int, world: int, model_names: tuple[str, ...], steps: int, warmup: int) -> dict[str, Any]:
    # one process group for all models: starting processes costs more than a quick run's steps
    return {name: _train_steps(rank, world, name, steps, warmup) for name in model_names}


def _train_steps(rank: int, world: int, model_name: str, steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist

    import kiln.optim as ko
    from kiln.parallel import all_reduce_gradients, broadcast_parameters

    model, inputs, targets, loss_fn = _setup(model_name)
    opt = ko.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    broadcast_parameters(model)
    global_batch = BATCH[model_name]
    local = global_batch // world
    n = len(inputs) // global_batch
    comm: list[float] = []

    def step(i: int) -> None:
        lo = (i % n) * global_batch + rank * local  # this rank's slice of the global batch
        x, y = inputs[lo:lo + local], targets[lo:lo + local]
        loss_fn(model(x), y).backward()
        t0 = time.perf_counter()
        all_reduce_gradients(opt)
        comm.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad()

    for i in range(warmup):
        step(i)
    comm.clear()
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    dist.barrier()  # the step ends when the slower rank is done
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "comm_ms": statistics.median(comm) * 1e3,
            "n_params": sum(p.numel() for p in model.parameters())}


def _measure(names: tuple[str, ...], steps: int, warmup: int, rounds: int) -> list[dict[str, Any]]:
    from kiln.parallel.testing import run_distributed

    per_round: dict[str, dict[int, list[dict[str, Any]]]] = {name: {1: [], 2: []} for name in names}
    for _ in range(rounds):
        for world in (1, 2):  # alternate, so drift on the machine hits both sides alike
            ranks = run_distributed(_worker, world, names, steps, warmup, threads=1)
            for name in names:
                mine = [r[name] for r in ranks]
                per_round[name][world].append({"samples_per_s": BATCH[name] * steps / mine[0]["wall_s"],
                                               "comm_ms": max(r["comm_ms"] for r in mine),
                                               "n_params": mine[0]["n_params"]})
    rows = []
    for name in names:
        runs, batch = per_round[name], BATCH[name]
        one = statistics.median(r["samples_per_s"] for r in runs[1])
        two = statistics.median(r["samples_per_s"] for r in runs[2])
        rows.append({
            "model": name, "n_params": runs[1][0]["n_params"], "global_batch": batch, "steps": steps,
            "samples_per_s_1": one, "samples_per_s_2": two, "speedup": two / one, "efficiency": two / (2 * one),
            "comm_ms_per_step": statistics.median(r["comm_ms"] for r in runs[2]),
            "step_ms_1": batch / one * 1e3, "step_ms_2": batch / two * 1e3,
            "rounds": {str(w): rs for w, rs in runs.items()},
        })
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'model':>5} {'params':>8} {'batch':>5} | {'1x1 samples/s':>13} {'2x1 samples/s':>13} | "
            f"{'speedup':>7} {'efficiency':>10} | {'step ms 1/2':>11} {'allreduce ms':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:>5} {r['n_params'] / 1e6:>7.2f}M {r['global_batch']:>5} | "
                     f"{r['samples_per_s_1']:>13.0f} {r['samples_per_s_2']:>13.0f} | "
                     f"{r['speedup']:>7.2f} {r['efficiency']:>10.2f} | "
                     f"{r['step_ms_1']:>5.1f}/{r['step_ms_2']:<5.1f} {r['comm_ms_per_step']:>12.2f}")
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    from kiln._plotting import pyplot

    plt = pyplot()

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 4))
    names = [r["model"] for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["samples_per_s_1"] for r in rows], 0.4, label="1 process x 1 thread")
    ax.bar([x + 0.2 for x in xs], [r["samples_per_s_2"] for r in rows], 0.4, label="2 processes x 1 thread")
    ax.scatter([x + 0.2 for x in xs], [2 * r["samples_per_s_1"] for r in rows], color="k", marker="_", s=400,
               zorder=3, label="perfect scaling")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("samples/s")
    ax.legend(fontsize=8)
    ax.set_title("throughput, same global batch")
    comp = [r["step_ms_2"] - r["comm_ms_per_step"] for r in rows]
    ax2.bar(names, comp, label="compute + optimizer")
    ax2.bar(names, [r["comm_ms_per_step"] for r in rows], bottom=comp, label="all_reduce_gradients")
    ax2.set_ylabel("ms per step, 2 processes")
    ax2.legend(fontsize=8)
    ax2.set_title("where a 2-process step goes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out_dir: Path, quick: bool = False) -> dict[str, Any]:
    import os

    steps, warmup, rounds = (QUICK_STEPS, QUICK_WARMUP, QUICK_ROUNDS) if quick else (STEPS, WARMUP, ROUNDS)
    load_before = os.getloadavg()[0]
    rows = _measure(("vit", "gpt"), steps, warmup, rounds)
    # 2 processes x 1 thread only scale when 2 cores are free: a 1-minute load average above
    # (cores - 2) while measuring means other work took cores from the 2-process side.
    machine = {**machine_info(), "threads": 1,  # per process
               "cpus": len(os.sched_getaffinity(0)), "load_1min_before": load_before,
               "load_1min_after": os.getloadavg()[0]}
    report = {"setup": {"processes": [1, 2], "threads_per_process": 1, "backend": "gloo", "optimizer": "kiln AdamW",
                        "steps": steps, "warmup": warmup, "rounds": rounds, "vit": VIT, "gpt": GPT},
              "machine": machine, "rows": rows}
    table = _table(rows)
    print(f"kiln bench ddp on {machine_line(machine)} per process")
    print(table)
    print(f"machine: {machine['cpus']} cpus, 1-min load average {load_before:.1f} before, "
          f"{machine['load_1min_after']:.1f} after (other work competes with the 2 processes when it is high)")
    (out_dir / "ddp.json").write_text(json.dumps(report, indent=2))
    (out_dir / "ddp.txt").write_text(table + "\n")
    _plot(rows, out_dir / "ddp.png")
    return report
