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
   a loss plateau for its first ~100 steps): batch 64 kept the accuracy, batch 128 and 256
   (lr 2.8e-3 to 4e-3) ended at 25-65%. Hence x2, not the article's x3-4;
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
- accuracy: validation accuracy after the row's last step (rank 0), and its difference from
  row 1, in points. At this budget the model is far from converged and runs that differ only
  in rounding drift apart through bf16's rounding over 400 steps: read a few points as noise,
  not as a technique's effect.

The other columns name the row's config: precision, pool, token layout, optimizer
(``optim.impl``), ZeRO stage, compile, global batch.

2 processes (``kiln.parallel.testing.run_distributed``: gloo on 127.0.0.1; each row's
``kiln train`` run joins the group, as a worker of ``kiln train --nproc 2`` joins torchrun's)
x 1 intra-op thread (``train.threads=1``). On a CPU without native bf16 (see the
machine line above the table) bf16 is emulated through fp32 and the bf16 rows are slower, not
faster: the table reports what this machine gets. ``--quick`` is a smoke run of the plumbing
(a depth-1 model, 4 steps a row, torch.compile and kiln's optimizer kernels eager): its numbers
say nothing.

    kiln bench vit            # or: kiln bench vit --quick
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from kiln.bench._harness import Bars, Col, Result, Table, benchmark, median
from kiln.bench._rss import Rss

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "digits_vit.py"
NPROC = 2
# 12,800 samples a row (8.5 epochs of the 1,500 training digits): batch 32 for 400 steps, and
# row 8 batch 64 for 200 steps (configs/digits_vit.py's own 64,000 samples would take an hour
# on 2 cores without native bf16); configs/digits_vit.py's peak lr and weight decay.
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
def _worker(rank: int, world: int, table: list[dict[str, Any]], quick: bool) -> list[dict[str, Any]]:
    """Rank ``rank`` of ``kiln.parallel.testing.run_distributed``'s group: every row in turn, each
    a whole ``kiln.train.train`` run in this process's group (a run leaves a group it did not
    make up), as a worker started by ``kiln train --nproc`` runs one."""
    from kiln.config import load_config
    from kiln.train import read_metrics, train

    if quick:
        # A smoke run of the table's plumbing: every row's config is built and trained, but
        # inductor's compiles (the model's, three times: a new batch size, then bf16; kiln's
        # optimizer kernels) take minutes on 2 cores, so --quick runs them eagerly.
        from torch._dynamo import config as dynamo_config

        dynamo_config.disable = True
        os.environ["KILN_OPTIM_EAGER"] = "1"
    rss = Rss()
    results = []
    with tempfile.TemporaryDirectory() as runs:
        # a 2-step run of row 1 first: the imports a run makes (scikit-learn's digits, dynamo
        # through torch.optim, matplotlib, checkpointing) and gloo's set-up happen once per
        # process and would count in row 1's peak memory
        if not quick:  # (--quick: row 1's memory includes them)
            train(load_config(CONFIG, [*_overrides(table[0]["keys"], quick, runs), "train.max_steps=2"]),
                  name="warmup")
        for row in table:
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
    return results


def _plain(cfg: Any) -> dict[str, Any]:
    """The keys a row is about, read back from the config the run was built from."""
    return {"train.precision": cfg.train.precision, "model.pool": cfg.model.pool,
            "model.batch_first": bool(cfg.model.batch_first), "optim.impl": cfg.optim.impl,
            "optim.name": cfg.optim.name, "optim.lr": float(cfg.optim.lr),
            "parallel.zero": int(cfg.parallel.zero), "train.compile": bool(cfg.train.compile),
            "data.batch_size": int(cfg.data.batch_size), "train.max_steps": int(cfg.train.max_steps),
            "train.threads": cfg.train.threads}


def measure(quick: bool = False) -> Result:
    from kiln.parallel.testing import run_distributed

    table = rows(quick)
    # a row's collectives wait for the other rank's compile (minutes on 2 busy cores)
    per_rank = run_distributed(_worker, NPROC, table, quick, threads=1, timeout_s=1800)
    result_rows = []
    for i, row in enumerate(table):
        main = per_rank[0][i]
        windows = main["windows"][1:] or main["windows"]  # the first window holds the warm-up
        result_rows.append({
            "name": row["name"], "adds": row["adds"], "changed": row["changed"], "config": main["config"],
            "samples_per_s": median(windows), "windows_samples_per_s": main["windows"],
            "peak_mb": max(r[i]["peak_bytes"] for r in per_rank) / 2**20,
            "peak_mb_per_rank": [r[i]["peak_bytes"] / 2**20 for r in per_rank],
            "accuracy": main["accuracy"], "eval_loss": main["eval_loss"], "train_loss": main["train_loss"],
            "steps": main["steps"], "compile_seconds": main["compile_seconds"],
            "run_wall_s": max(r[i]["wall_s"] for r in per_rank), "load_1min_after": main["load_1min_after"],
        })
    first = result_rows[0]
    for i, (prev, r) in enumerate(zip([first, *result_rows], result_rows), 1):
        r["row"] = i
        r["speedup"] = r["samples_per_s"] / first["samples_per_s"]
        r["vs_previous"] = r["samples_per_s"] / prev["samples_per_s"]  # what this row's technique alone gave
        r["accuracy_delta"] = r["accuracy"] - first["accuracy"]
    setup = {"model": "digits ViT (configs/digits_vit.py: dim 64, depth 4, 8x8 images, patch 2)" if not quick
             else "digits ViT, --quick: " + ", ".join(f"{k}={v}" for k, v in QUICK_KEYS.items()),
             "samples": (QUICK_STEPS if quick else STEPS) * BATCH, "processes": NPROC,
             "threads_per_process": 1, "backend": "gloo", "quick": quick,
             **({"quick_note": "smoke run: a depth-1 model, 4 steps a row, torch.compile disabled and kiln's "
                               "optimizer kernels eager; the numbers say nothing"} if quick else {}),
             "speed": "median samples/s over kiln train's log windows after the first",
             "article": {"batch_560": 1.51, "batch_384_image_256": 1.86, "full_fp16": 2.18}}
    key = lambda k: lambda r: r["config"][k]  # noqa: E731
    cols = [Col("#", "row"), Col("row", "name"), Col("samples/s", "samples_per_s", ".0f"),
            Col("speedup", "speedup", ".2f"), Col("x prev", "vs_previous", ".2f"), Col("peak MB", "peak_mb", ".1f"),
            Col("accuracy", "accuracy", ".2%"), Col("vs 1", lambda r: 100 * r["accuracy_delta"], "+.1f"),
            Col("precision", key("train.precision")), Col("pool", key("model.pool")),
            Col("layout", lambda r: "B,N,D" if r["config"]["model.batch_first"] else "N,B,D"),
            Col("optimizer", key("optim.impl")), Col("zero", key("parallel.zero")),
            Col("compile", lambda r: "yes" if r["config"]["train.compile"] else "no"),
            Col("batch", key("data.batch_size"))]
    label = lambda r: f"{r['row']}. {r['name'].removeprefix('+ ')}"  # noqa: E731
    chart = [Bars("cumulative speedup over row 1 (samples/s)", result_rows, label, {"speedup": "speedup"},
                  "x row 1", lines={"row 1": 1.0}, color=lambda r: "gray" if r["row"] == 1 else
                  "tab:orange" if r["speedup"] >= 1 else "tab:red"),
             Bars("validation accuracy", result_rows, label, {"accuracy": "accuracy"}, "accuracy")]
    title = (f"{setup['model']}, {setup['samples']:,} training samples a row, {NPROC} processes x 1 thread "
             "(Meta's faster-ViT table, cumulative)")
    return Result({"setup": setup, "rows": result_rows}, [Table(result_rows, cols)], title, chart, threads=1,
                  processes=NPROC)


run = benchmark("vit", measure)
