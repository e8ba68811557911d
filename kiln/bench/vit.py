"""``kiln bench vit``: Meta AI's "significantly faster ViT training" table (pycls), cumulative.

Meta's article added one technique at a time to a ViT baseline and reported the cumulative
throughput: 1.51x at batch 560, 1.86x with batch 384 at image size 256, 2.18x in full fp16
(with an accuracy drop). Here each row is ``kiln train`` on the digits ViT
(``configs/digits_vit.py``), switched by config keys only, each row adding one key to the
previous row's:

1. baseline: fp32, class token (``model.pool=cls``), batch-first tokens (``model.batch_first=true``),
   ``torch.optim.AdamW`` with its for-loop (``optim.impl=torch-forloop``, what the article's
   baseline ran), data parallel over 2 processes (kiln's all-reduce of the gradients);
2. automatic mixed precision: ``train.precision=bf16-mixed`` (bf16 autocast; fp16 on GPUs);
3. FSDP: ``parallel.zero=3`` (FSDP2 shards parameters, gradients and optimizer state over the
   2 data-parallel ranks);
4. multi-tensor optimizer: ``optim.impl=kiln``, kiln's AdamW. Its flat arena cannot hold
   FSDP2's per-parameter DTensor shards, so under ZeRO-3 it steps them with multi-tensor
   (``torch._foreach``/fused) kernels: the article's ContiguousParams + Apex multi-tensor Adam
   become "one kernel over the list" here;
5. pooled classifier: ``model.pool=mean`` (average the patch tokens, no class token);
6. batch-second tokens: ``model.batch_first=false`` ((N, B, D) between embedding and head,
   the layout ``nn.MultiheadAttention`` computes in; same function, tests/test_models.py);
7. ``train.compile=true`` (torch.compile of the model; compile time left out of samples/s);
8. a larger batch: ``data.batch_size`` 32 -> 64 for the same number of samples (half the
   steps), same peak lr. On this small data set the budget is short in steps (the ViT sits on
   a loss plateau for its first ~100 steps), so a larger batch costs accuracy unless the run
   is longer; single-process fp32 runs of the mean-pooled model at 19,200 samples: batch 32 /
   lr 2e-3 95.6%, batch 32 / 1.4e-3 94.3%, batch 64 / 2e-3 94.3%, batch 64 / 2.8e-3 93.9%;
   batch 128 and 256 (lr 2.8e-3 to 4e-3) ended at 25-65%. Hence x2, not the article's x3-4;
9. full low precision: ``train.precision=bf16-true`` (bf16 weights and activations, fp32
   master weights and AdamW state in kiln's arena). The arena cannot live under FSDP2, so this
   row shards with ZeRO-2 (``parallel.zero=2``) instead of ZeRO-3: the one row that also
   changes a second key, and the table says so.

Every row trains the same number of samples (``BATCH x STEPS``) from the same seed (same
initial weights, same data order) with the config's onecycle schedule, and evaluates on the
297 validation digits at the end. Columns:

- samples/s: training samples per second of wall time (both ranks together), the median over
  the log windows of ``kiln train``'s metrics after the first window (which holds the first
  steps: the compile of ``train.compile`` and of kiln's optimizer kernels, allocator warm-up);
  evaluation and checkpointing are not training time;
- speedup: samples/s over row 1's (cumulative); x prev: over the previous row's (what the
  row's technique alone gave on top of the others);
- peak MB: the largest rank's peak resident memory during the row (``VmHWM``) above its
  resident memory before the row began (both ranks run every row in one process each, one
  after the other; freed heap pages are given back and the peak reset between rows);
- accuracy: validation accuracy after the row's last step (rank 0; every rank evaluates the
  whole set), and its difference from row 1, in points. At this budget the model is still
  far from converged and two runs that differ only in rounding (torch's for-loop AdamW and
  kiln's fused one agree to 5 decimals of the loss over 60 fp32 steps) drift apart through
  bf16's rounding over 400 steps: read differences of a few points as noise, not as a
  technique's effect (FSDP's row came out bit-identical to DDP's; the optimizer's row 5.7
  points lower on one run).

The other columns name the row's config: precision, pool, token layout, optimizer
(``optim.impl``), ZeRO stage, compile, global batch. A 1-min load average above the bench's
own 2 processes (by more than 0.5) is reported under the table: other work then shared the cores.

2 processes (``--nproc 2``: gloo on 127.0.0.1, each joining from the environment as torchrun's
workers do) x 1 intra-op thread (``train.threads=1``). On a CPU without native bf16 (see the
machine line above the table) bf16 is emulated through fp32 and the bf16 rows are slower, not
faster: the table reports what this machine gets. ``--quick`` is a smoke run of the plumbing
(a depth-1 model, 4 steps a row, torch.compile and kiln's optimizer kernels eager): its numbers
say nothing.

    kiln bench vit            # or: kiln bench vit --quick
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

from kiln.bench._rss import Rss

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "digits_vit.py"
NPROC = 2
# 12,800 samples a row (8.5 epochs of the 1,500 training digits): batch 32 for 400 steps, and
# row 8 batch 64 for 200 steps; configs/digits_vit.py's peak lr (onecycle schedule) and weight
# decay. (The bf16 rows run at 120-290 samples/s on 2 cores without native bf16: the whole table
# took 10 minutes on an idle AVX2 EPYC; configs/digits_vit.py's own 64,000 samples would take an hour.)
BATCH, STEPS, LOG_EVERY = 32, 400, 50
LARGE_BATCH = 64
LR = 2e-3  # configs/digits_vit.py's optim.lr
LARGE_LR = LR  # row 8's peak lr (see the module docstring for what was tried)
QUICK_STEPS, QUICK_LOG_EVERY = 4, 1
# --quick: a smaller model (less to run), the lr at its peak from the first of its few steps
QUICK_KEYS = {"model.depth": 1, "model.dim": 32, "model.heads": 2, "optim.schedule": "constant"}


def rows(quick: bool = False) -> list[dict[str, Any]]:
    """The table's rows: name, what the row adds, and its config overrides (cumulative: each
    row's overrides are the previous row's, updated)."""
    steps = QUICK_STEPS if quick else STEPS
    large, samples = LARGE_BATCH, steps * BATCH
    base = {
        **(QUICK_KEYS if quick else {}),
        "train.precision": "fp32", "model.pool": "cls", "model.batch_first": True, "optim.impl": "torch-forloop",
        "parallel.zero": 0, "train.compile": False, "data.batch_size": BATCH, "train.max_steps": steps,
        "optim.lr": LR,
    }
    adds = [
        ("baseline", "fp32, class token, batch-first, torch AdamW for-loop, DDP x2", {}),
        ("+ AMP", "bf16-mixed autocast", {"train.precision": "bf16-mixed"}),
        ("+ FSDP", "ZeRO-3 over the 2 data-parallel ranks (FSDP2)", {"parallel.zero": 3}),
        ("+ multi-tensor optimizer", "kiln's AdamW (multi-tensor over the FSDP2 shards)", {"optim.impl": "kiln"}),
        ("+ pooled classifier", "mean of the patch tokens, no class token", {"model.pool": "mean"}),
        ("+ batch-second", "tokens (N, B, D): attention without transposes of the batch", {"model.batch_first": False}),
        ("+ torch.compile", "train.compile=true", {"train.compile": True}),
        (f"+ batch {large}", f"{large // BATCH}x the batch, same samples (half the steps), peak lr {LARGE_LR:g}",
         {"data.batch_size": large, "train.max_steps": samples // large, "optim.lr": LARGE_LR}),
        ("+ bf16-true", "bf16 weights and activations, fp32 masters (ZeRO-2: the arena cannot live under FSDP2)",
         {"train.precision": "bf16-true", "parallel.zero": 2}),
    ]
    out, keys = [], dict(base)
    for name, what, changes in adds:
        changed = sorted(k for k, v in changes.items() if keys[k] != v)
        keys = {**keys, **changes}
        out.append({"name": name, "adds": what, "changed": changed, "keys": dict(keys)})
    return out


def _overrides(keys: dict[str, Any], quick: bool, output_dir: str) -> list[str]:
    def text(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    log_every = QUICK_LOG_EVERY if quick else LOG_EVERY
    fixed = [f"train.log_every={log_every}", "train.eval_every=0", "train.threads=1", "train.progress=none",
             "train.device=cpu", "train.seed=0", f"train.output_dir={output_dir}", "data.workers=0"]
    return fixed + [f"{k}={text(v)}" for k, v in keys.items()]


# -- one rank ---------------------------------------------------------------------------------------
def _worker(rank: int, world: int, table: list[dict[str, Any]], ports: list[int], quick: bool,
            out_dir: str) -> None:
    """Rank ``rank``: every row in turn, each a whole ``kiln.train.train`` run that joins its
    process group from the environment (a fresh port per row: a run ends by destroying its
    group), as a worker started by ``kiln train --nproc`` does."""
    from kiln.config import load_config
    from kiln.train import read_metrics, train

    torch.set_num_threads(1)
    if quick:
        # A smoke run of the table's plumbing: every row's config is built and trained, but
        # inductor's compiles (the model's, three times: a new batch size, then bf16; kiln's
        # optimizer kernels) take minutes on 2 cores, so --quick runs them eagerly.
        from torch._dynamo import config as dynamo_config

        dynamo_config.disable = True
        os.environ["KILN_OPTIM_EAGER"] = "1"
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    rss = Rss()
    results = []
    with tempfile.TemporaryDirectory() as runs:
        # a 2-step run of row 1 first: the imports a run makes (scikit-learn's digits, dynamo
        # through torch.optim, matplotlib, checkpointing) and gloo's set-up happen once per
        # process and would count in row 1's peak memory
        if not quick:  # (--quick: row 1's memory includes them)
            os.environ["MASTER_PORT"] = str(ports[-1])
            train(load_config(CONFIG, [*_overrides(table[0]["keys"], quick, runs), "train.max_steps=2"]),
                  name="warmup")
        for row, port in zip(table, ports):
            os.environ["MASTER_PORT"] = str(port)
            cfg = load_config(CONFIG, _overrides(row["keys"], quick, runs))
            before = rss.restart()
            started = time.perf_counter()
            result = train(cfg, name="vit")
            out = {"peak_bytes": rss.read()["VmHWM"] - before, "wall_s": time.perf_counter() - started,
                   "load_1min_after": os.getloadavg()[0]}
            if rank == 0:
                metrics = read_metrics(result.run_dir)
                windows = [float(r["samples_per_second"]) for r in metrics if r.get("samples_per_second")]
                s = result.summary
                out.update(windows=windows, accuracy=float(s["eval"]["accuracy"]), eval_loss=float(s["eval"]["loss"]),
                           train_loss=float(s["final_train_loss"]), steps=int(s["steps"]),
                           compile_seconds=s.get("compile_seconds"), config=_plain(cfg))
            results.append(out)
    torch.save(results, os.path.join(out_dir, f"{rank}.pt"))


def _plain(cfg: Any) -> dict[str, Any]:
    """The keys a row is about, read back from the config the run was built from."""
    return {"train.precision": cfg.train.precision, "model.pool": cfg.model.pool,
            "model.batch_first": bool(cfg.model.batch_first), "optim.impl": cfg.optim.impl,
            "optim.name": cfg.optim.name, "optim.lr": float(cfg.optim.lr),
            "parallel.zero": int(cfg.parallel.zero), "train.compile": bool(cfg.train.compile),
            "data.batch_size": int(cfg.data.batch_size), "train.max_steps": int(cfg.train.max_steps),
            "train.threads": cfg.train.threads}


def _measure(table: list[dict[str, Any]], quick: bool) -> list[list[dict[str, Any]]]:
    import torch.multiprocessing as mp

    from kiln.parallel.testing import free_port

    ports = [free_port() for _ in range(len(table) + 1)]  # one a row, one for the warm-up
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(NPROC, table, ports, quick, out_dir), nprocs=NPROC, join=True)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=True) for r in range(NPROC)]


# -- the report ---------------------------------------------------------------------------------
def _table_text(report: dict[str, Any]) -> str:
    head = (f"{'#':>2} {'row':<26} {'samples/s':>9} {'speedup':>7} {'x prev':>6} {'peak MB':>8} {'accuracy':>8} {'vs 1':>6}  "
            f"{'precision':<10} {'pool':<4} {'layout':<6} {'optimizer':<13} {'zero':>4} {'compile':>7} {'batch':>5}")
    lines = [f"kiln bench vit: {report['setup']['model']}, {report['setup']['samples']:,} training samples a row, "
             f"{report['setup']['processes']} processes x {report['setup']['threads_per_process']} thread",
             f"machine: {report['machine_line']}", head, "-" * len(head)]
    for i, r in enumerate(report["rows"], 1):
        k = r["config"]
        lines.append(
            f"{i:>2} {r['name']:<26} {r['samples_per_s']:>9.0f} {r['speedup']:>6.2f}x {r['vs_previous']:>6.2f} {r['peak_mb']:>8.1f} "
            f"{100 * r['accuracy']:>7.2f}% {100 * r['accuracy_delta']:>+5.1f}  {k['train.precision']:<10} "
            f"{k['model.pool']:<4} {'B,N,D' if k['model.batch_first'] else 'N,B,D':<6} {k['optim.impl']:<13} "
            f"{k['parallel.zero']:>4} {'yes' if k['train.compile'] else 'no':>7} {k['data.batch_size']:>5}")
    load = [report["machine"]["load_1min_before"], *(r["load_1min_after"] for r in report["rows"])]
    # the bench's own NPROC processes make a load of about NPROC; more means other work
    if max(load) > min(NPROC, report["machine"]["cpu_count"]) + 0.5:
        lines.append(f"note: 1-min load average {min(load):.1f}-{max(load):.1f} during the rows on "
                     f"{report['machine']['cpu_count']} cores: other work shared the cores, so the samples/s "
                     "ratios are noisy; rerun on an idle machine")
    return "\n".join(lines)


def _plot(report: dict[str, Any], path: Path) -> None:
    from kiln._plotting import pyplot

    plt = pyplot()
    rows_ = report["rows"]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    xs = list(range(len(rows_)))
    colors = ["gray"] + ["tab:orange" if r["speedup"] >= 1 else "tab:red" for r in rows_[1:]]
    ax.bar(xs, [r["speedup"] for r in rows_], color=colors)
    for x, r in zip(xs, rows_):
        ax.text(x, r["speedup"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(xs, [f"{i}\n" + textwrap.fill(r["name"], 12, break_long_words=False) for i, r in enumerate(rows_, 1)], fontsize=7)
    ax.set_ylabel("cumulative speedup over row 1 (samples/s)")
    ax2 = ax.twinx()
    ax2.plot(xs, [100 * r["accuracy"] for r in rows_], "o-", color="tab:blue", label="validation accuracy")
    ax2.set_ylabel("validation accuracy, %", color="tab:blue")
    low = min(100 * r["accuracy"] for r in rows_)
    ax2.set_ylim(max(0.0, low - 5), 100.5)
    ax.set_title(f"faster ViT training, cumulative (digits ViT, 2 processes x 1 thread)\n{report['machine_line']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out_dir: Path, quick: bool = False) -> dict[str, Any]:
    from kiln.hardware import machine_info, machine_line

    out_dir = Path(out_dir)
    table = rows(quick)
    load_before = os.getloadavg()[0]
    per_rank = _measure(table, quick)
    result_rows = []
    for i, row in enumerate(table):
        main = per_rank[0][i]
        windows = main["windows"][1:] or main["windows"]  # the first window holds the warm-up
        result_rows.append({
            "name": row["name"], "adds": row["adds"], "changed": row["changed"], "config": main["config"],
            "samples_per_s": statistics.median(windows), "windows_samples_per_s": main["windows"],
            "peak_mb": max(r[i]["peak_bytes"] for r in per_rank) / 2**20,
            "peak_mb_per_rank": [r[i]["peak_bytes"] / 2**20 for r in per_rank],
            "accuracy": main["accuracy"], "eval_loss": main["eval_loss"], "train_loss": main["train_loss"],
            "steps": main["steps"], "compile_seconds": main["compile_seconds"],
            "run_wall_s": max(r[i]["wall_s"] for r in per_rank), "load_1min_after": main["load_1min_after"],
        })
    first = result_rows[0]
    for prev, r in zip([first, *result_rows], result_rows):
        r["speedup"] = r["samples_per_s"] / first["samples_per_s"]
        r["vs_previous"] = r["samples_per_s"] / prev["samples_per_s"]  # what this row's technique alone gave
        r["accuracy_delta"] = r["accuracy"] - first["accuracy"]
    info = machine_info()
    info["threads"] = 1  # per process (train.threads=1); the table's processes run side by side
    report = {
        "setup": {"model": "digits ViT (configs/digits_vit.py: dim 64, depth 4, 8x8 images, patch 2)" if not quick
                  else "digits ViT, --quick: " + ", ".join(f"{k}={v}" for k, v in QUICK_KEYS.items()),
                  "samples": (QUICK_STEPS if quick else STEPS) * BATCH, "processes": NPROC,
                  "threads_per_process": 1, "backend": "gloo", "quick": quick,
                  **({"quick_note": "smoke run: a depth-1 model, 4 steps a row, torch.compile disabled and kiln's "
                                    "optimizer kernels eager; the numbers say nothing"} if quick else {}),
                  "speed": "median samples/s over kiln train's log windows after the first",
                  "article": {"batch_560": 1.51, "batch_384_image_256": 1.86, "full_fp16": 2.18}},
        "machine": {**info, "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0]},
        "machine_line": machine_line(info),
        "rows": result_rows,
    }
    text = _table_text(report)
    print(text)
    (out_dir / "vit.json").write_text(json.dumps(report, indent=2))
    (out_dir / "vit.txt").write_text(text + "\n")
    _plot(report, out_dir / "vit.png")
    return report

