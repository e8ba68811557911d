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

2 processes (``kiln.launch.testing.run_distributed``: gloo on 127.0.0.1; each row's
``kiln train`` run joins the group, as a worker of ``kiln train --nproc 2`` joins torchrun's)
x 1 intra-op thread (``train.threads=1``). On a CPU without native bf16 (see the
machine line above the table) bf16 is emulated through fp32 and the bf16 rows are slower, not
faster: the table reports what this machine gets. ``--quick`` is a smoke run of the plumbing
(a depth-1 model, 4 steps a row, torch.compile and kiln's optimizer kernels eager): its numbers
say nothing.

``--device cuda``: the article's own size, on one GPU. ViT-B/16 (``configs/vit_b16.py``: patch
16, width 768, depth 12, 12 heads, MLP 3072, 86.6 M parameters) on generated 3 x 224 x 224
images of 1000 classes (``synthetic_images``, no download), batch 128 (row 8: 256), 200 steps
a row, one process (the 77 MB batches of fp32 images are stacked by ``data.workers=auto``
worker processes, or by the training process where /dev/shm is too small for them: the notes say
so). One GPU is one data-parallel rank, so:

- row 1 is a single process, not DDP over two;
- row 3, FSDP, is **not applicable** and is not run: FSDP2 shards parameters, gradients and
  optimizer state over data-parallel ranks, and one rank has nothing to shard over (kiln's
  ``parallel.zero=3`` at dp=1 is the unsharded model, which would only repeat row 2 under
  FSDP's name). The table keeps the row, marked, and the rows after it run unsharded: row 4 is
  kiln's AdamW over its arena, row 9 bf16-true without ZeRO-2;
- peak MB is the GPU allocator's peak of the row (``torch.cuda.max_memory_allocated``, through
  ``summary.json``'s ``peak_memory_mb``) above what was allocated before it;
- accuracy is of the synthetic labels after a few hundred steps: a check that each row trained,
  not ImageNet's accuracy.

``--quick`` there is the GPU's quick form (``kiln bench gpu`` runs it): the same model and
batch, 16 steps a row (8 at batch 256) logged every 2, and ``torch.compile`` in its own row
only (each compile of ViT-B/16 takes 40-60 s cold; rows 8 and 9 would compile it twice more),
sized for 1-1.5 minutes on an H100 (not yet timed on one: no GPU has run it). ``--nproc 1``
runs the CPU table in one process the same way (FSDP row marked), as a test of that path on a
machine without a GPU.

    kiln bench vit            # or: kiln bench vit --quick
    kiln bench vit --device cuda
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from kiln.bench._harness import Bars, Col, Result, Table, benchmark, median
from kiln.bench._rss import Rss
from kiln.config import load_config
from kiln.data import resolve_workers
from kiln.launch.testing import run_distributed
from kiln.train import read_metrics, train


ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "digits_vit.py"
GPU_CONFIG = ROOT / "configs" / "vit_b16.py"
NPROC = 2  # on CPU: the article's data parallel, over gloo
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
FSDP_ROW = "+ FSDP"
COMPILE_ROW = "+ torch.compile"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the rows train on a kind of device: the config, the batch (row 8's larger one), the
    steps a row and how often they are logged (a full run and ``--quick``), the peak lr, the
    overrides that shrink the model for ``--quick``, and whether ``--quick`` compiles in the
    compile row alone (a GPU's: rows 8 and 9, a new batch and then bf16 weights, would compile
    ViT-B/16 twice more, at 40-60 s each)."""

    config: Path
    model: str
    batch: int
    steps: int
    log_every: int
    large_batch: int
    lr: float
    quick_steps: int
    quick_log_every: int
    quick_keys: dict[str, Any]
    compile_once: bool = False


SIZES = {
    "cpu": Sizes(CONFIG, "digits ViT (configs/digits_vit.py: dim 64, depth 4, 8x8 images, patch 2)", BATCH, STEPS,
                 LOG_EVERY, LARGE_BATCH, LR, QUICK_STEPS, QUICK_LOG_EVERY, QUICK_KEYS),
    # 25,600 images a row; --quick: 2,048, windows of 2 steps (the first, with the first step's
    # CUDA start-up and compiles, is left out of the speed)
    "cuda": Sizes(GPU_CONFIG, "ViT-B/16 (configs/vit_b16.py: 3x224x224 synthetic images, 1000 classes, 86.6 M "
                  "parameters)", 128, 200, 20, 256, 5e-4, 16, 2, {}, compile_once=True),
}


def default_nproc(device: str) -> int:
    """Processes a row runs in where ``--nproc`` is not given: the article's 2 data-parallel
    ranks on CPU (gloo), one on a GPU."""
    return NPROC if device == "cpu" else 1


def check_nproc(nproc: int, device: str = "cpu") -> int:
    """``nproc`` if the table runs in that many processes on ``device``; a ValueError otherwise."""
    if isinstance(nproc, bool) or nproc not in (1, 2):
        raise ValueError(f"--nproc {nproc!r}: kiln bench vit runs in 1 process or 2 (the article's data parallel, "
                         "on CPU over gloo)")
    if nproc > 1 and device != "cpu":
        raise ValueError(f"--nproc {nproc} --device {device}: kiln bench vit runs one process on one GPU (its FSDP "
                         "row is then marked not applicable); data parallel over GPUs is kiln bench ddp --device cuda")
    return nproc


def rows(quick: bool = False, device: str = "cpu", nproc: int | None = None,
         sizes: Sizes | None = None) -> list[dict[str, Any]]:
    """The table's rows: name, what the row adds, and its config overrides (cumulative: each
    row's overrides are the previous row's, updated); ``skip``: why a row does not run (FSDP on
    one process). ``sizes``: default the device's (:data:`SIZES`)."""
    sizes = sizes or SIZES[device]
    nproc = default_nproc(device) if nproc is None else nproc
    steps = sizes.quick_steps if quick else sizes.steps
    large, samples = sizes.large_batch, steps * sizes.batch
    one = nproc == 1
    base = {
        **(sizes.quick_keys if quick else {}),
        "train.precision": "fp32", "model.pool": "cls", "model.batch_first": True, "optim.impl": "torch-forloop",
        "parallel.zero": 0, "train.compile": False, "data.batch_size": sizes.batch, "train.max_steps": steps,
        "optim.lr": sizes.lr,
    }
    fsdp = ("FSDP2 shards parameters, gradients and optimizer state over data-parallel ranks; one process has none "
            "to shard over")
    adds = [
        ("baseline", "fp32, class token, batch-first, torch AdamW for-loop, "
         + ("one process" if one else f"DDP x{nproc}"), {}),
        ("+ AMP", "bf16-mixed autocast", {"train.precision": "bf16-mixed"}),
        (FSDP_ROW, f"not applicable on one device: {fsdp}" if one else f"ZeRO-3 over the {nproc} data-parallel ranks "
         "(FSDP2)", {} if one else {"parallel.zero": 3}),
        ("+ multi-tensor optimizer", "kiln's AdamW (one fused step over its arena)" if one else
         "kiln's AdamW (multi-tensor over the FSDP2 shards)", {"optim.impl": "kiln"}),
        ("+ pooled classifier", "mean of the patch tokens, no class token", {"model.pool": "mean"}),
        ("+ batch-second", "tokens (N, B, D): attention without transposes of the batch", {"model.batch_first": False}),
        (COMPILE_ROW, "train.compile=true", {"train.compile": True}),
        (f"+ batch {large}", f"{large // sizes.batch}x the batch, same samples (half the steps), peak lr {sizes.lr:g}",
         {"data.batch_size": large, "train.max_steps": samples // large, "optim.lr": sizes.lr}),
        ("+ bf16-true", "bf16 weights and activations, fp32 masters" + ("" if one else
         " (ZeRO-2: the arena cannot live under FSDP2)"),
         {"train.precision": "bf16-true", **({} if one else {"parallel.zero": 2})}),
    ]
    compile_once = quick and sizes.compile_once
    out, keys, before = [], dict(base), dict(base)
    for name, what, changes in adds:
        keys = {**keys, **changes}
        row = dict(keys)
        if compile_once:
            row["train.compile"] = name == COMPILE_ROW
            what += " (quick: not compiled)" if keys["train.compile"] and name != COMPILE_ROW else ""
        changed = sorted(k for k in row if row[k] != before[k])
        out.append({"name": name, "adds": what, "changed": changed, "keys": row,
                    **({"skip": f"not applicable on one device: {fsdp}"} if one and name == FSDP_ROW else {})})
        before = row
    return out


def loader_workers(device: str, sizes: Sizes) -> tuple[int | str, str]:
    """``data.workers`` of the rows, and why where it is not the config's. On CPU 0 (one thread a
    rank, loading in it). On a GPU the config's ``auto``: worker processes stack the batches (77 MB
    of fp32 images at batch 128) and hand them over through shared memory, while the training
    process only feeds the GPU; but where /dev/shm cannot hold the 2 batches each worker
    prefetches (a container's default is 64 MB), 0."""
    if device == "cpu":
        return 0, ""

    data = load_config(sizes.config).data
    args = dict(data.args)
    batch_bytes = 4 * args["channels"] * args["image_size"] ** 2 * sizes.large_batch
    needed = 2 * resolve_workers(data.workers) * batch_bytes
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:  # no /dev/shm: torch hands batches over otherwise
        return data.workers, ""
    if free >= needed:
        return data.workers, ""
    return 0, (f"data.workers=0: /dev/shm has {free / 2**20:.0f} MB free, less than the {needed / 2**20:.0f} MB the "
               "loader's workers would hold; the training process stacks the batches itself")


def _overrides(keys: dict[str, Any], quick: bool, output_dir: str, device: str = "cpu",
               sizes: Sizes | None = None, workers: int | str = 0) -> list[str]:
    def text(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    sizes = sizes or SIZES[device]
    log_every = sizes.quick_log_every if quick else sizes.log_every
    fixed = [f"train.log_every={log_every}", "train.eval_every=0", "train.progress=none", f"train.device={device}",
             "train.seed=0", f"train.output_dir={output_dir}", f"data.workers={workers}"]
    if device == "cpu":  # one thread a process (2 processes on 2 cores)
        fixed.append("train.threads=1")
    return fixed + [f"{k}={text(v)}" for k, v in keys.items()]


@contextlib.contextmanager
def _eager(on: bool) -> Iterator[None]:
    """With ``on``: torch.compile and kiln's optimizer kernels run eagerly inside (restored after)."""
    if not on:
        yield
        return
    old = os.environ.get("KILN_OPTIM_EAGER")  # (kiln.optim's switch to its eager update rules)
    os.environ["KILN_OPTIM_EAGER"] = "1"
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        if old is None:
            os.environ.pop("KILN_OPTIM_EAGER", None)
        else:
            os.environ["KILN_OPTIM_EAGER"] = old


class _Peak:
    """A row's peak memory above what was held before it: the process's resident set on CPU,
    the GPU allocator's on CUDA (``summary.json``'s ``peak_memory_mb``, reset as the run starts)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.rss = Rss() if device == "cpu" else None

    def start(self) -> int:
        if self.rss is not None:
            return self.rss.restart()
        gc.collect()  # the previous row's model and optimizer, where a cycle still holds them
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def bytes_above(self, before: int, summary: dict[str, Any] | None) -> int:
        if self.rss is not None:
            return self.rss.read()["VmHWM"] - before
        return int(summary["peak_memory_mb"] * 2**20) - before


# -- one rank ---------------------------------------------------------------------------------------
def _worker(rank: int, world: int, table: list[dict[str, Any]], quick: bool, device: str = "cpu",
            sizes: Sizes | None = None, workers: int | str = 0) -> list[dict[str, Any]]:
    """Rank ``rank`` of ``kiln.launch.testing.run_distributed``'s group (or the one process of
    a one-process table): every row in turn, each a whole ``kiln.train.train`` run in this
    process's group (a run leaves a group it did not make up), as a worker started by ``kiln
    train --nproc`` runs one."""

    sizes = sizes or SIZES[device]
    peak = _Peak(device)
    results = []
    # A CPU's smoke run of the table's plumbing: every row's config is built and trained, but
    # inductor's compiles (the model's, three times: a new batch size, then bf16; kiln's
    # optimizer kernels) take minutes on 2 cores, so --quick runs them eagerly there.
    with _eager(quick and device == "cpu"), tempfile.TemporaryDirectory() as runs:
        # a 2-step run of row 1 first: the imports a run makes (scikit-learn's digits, dynamo
        # through torch.optim, matplotlib, checkpointing), gloo's set-up and CUDA's happen once
        # per process and would count in row 1's peak memory
        if not quick:  # (--quick: row 1's memory includes them)
            train(load_config(sizes.config, [*_overrides(table[0]["keys"], quick, runs, device, sizes, workers),
                                             "train.max_steps=2"]), name="warmup")
        for row in table:
            if "skip" in row:
                results.append({"skipped": row["skip"]})
                continue
            cfg = load_config(sizes.config, _overrides(row["keys"], quick, runs, device, sizes, workers))
            before = peak.start()
            started = time.perf_counter()
            result = train(cfg, name="vit")
            out = {"peak_bytes": peak.bytes_above(before, result.summary), "wall_s": time.perf_counter() - started,
                   "load_1min_after": os.getloadavg()[0]}
            if rank == 0:
                metrics = read_metrics(result.run_dir)
                windows = [float(r["samples_per_second"]) for r in metrics if r.get("samples_per_second")]
                mfu = [float(r["mfu"]) for r in metrics if r.get("samples_per_second") and r.get("mfu")]
                s = result.summary
                out.update(windows=windows, mfu_windows=mfu, accuracy=float(s["eval"]["accuracy"]),
                           eval_loss=float(s["eval"]["loss"]), train_loss=float(s["final_train_loss"]),
                           steps=int(s["steps"]), compile_seconds=s.get("compile_seconds"), config=_plain(cfg))
            del result
            results.append(out)
    return results


def _plain(cfg: Any) -> dict[str, Any]:
    """The keys a row is about, read back from the config the run was built from."""
    return {"train.precision": cfg.train.precision, "model.pool": cfg.model.pool,
            "model.batch_first": bool(cfg.model.batch_first), "optim.impl": cfg.optim.impl,
            "optim.name": cfg.optim.name, "optim.lr": float(cfg.optim.lr),
            "parallel.zero": int(cfg.parallel.zero), "train.compile": bool(cfg.train.compile),
            "data.batch_size": int(cfg.data.batch_size), "train.max_steps": int(cfg.train.max_steps),
            "train.threads": cfg.train.threads, "train.device": cfg.train.device}


def _result_row(row: dict[str, Any], per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """A row of the table from what each rank recorded for it."""
    main = per_rank[0]
    if "skipped" in main:  # the keys it would have had, for the table's config columns
        return {"name": row["name"], "adds": row["adds"], "changed": row["changed"], "config": dict(row["keys"]),
                "skipped": main["skipped"], "samples_per_s": None, "peak_mb": None, "accuracy": None, "mfu": None}
    windows = main["windows"][1:] or main["windows"]  # the first window holds the warm-up
    mfu = main["mfu_windows"][1:] or main["mfu_windows"]
    return {
        "name": row["name"], "adds": row["adds"], "changed": row["changed"], "config": main["config"],
        "samples_per_s": median(windows), "windows_samples_per_s": main["windows"],
        "mfu": median(mfu) if mfu else None,
        "peak_mb": max(r["peak_bytes"] for r in per_rank) / 2**20,
        "peak_mb_per_rank": [r["peak_bytes"] / 2**20 for r in per_rank],
        "accuracy": main["accuracy"], "eval_loss": main["eval_loss"], "train_loss": main["train_loss"],
        "steps": main["steps"], "compile_seconds": main["compile_seconds"],
        "run_wall_s": max(r["wall_s"] for r in per_rank), "load_1min_after": main["load_1min_after"],
    }


def measure(quick: bool = False, device: str = "cpu", nproc: int | None = None, sizes: Sizes | None = None) -> Result:
    """The table on ``device`` in ``nproc`` processes (default :func:`default_nproc`);
    ``sizes``: what the rows train, default the device's (:data:`SIZES`; a test runs the GPU's
    table on a CPU with a smaller model)."""

    nproc = check_nproc(default_nproc(device) if nproc is None else nproc, device)
    sizes = sizes or SIZES[device]
    table = rows(quick, device, nproc, sizes)
    workers, why_workers = loader_workers(device, sizes)
    if nproc == 1:
        per_rank = [_worker(0, 1, table, quick, device, sizes, workers)]
    else:
        # a row's collectives wait for the other rank's compile (minutes on 2 busy cores)
        per_rank = run_distributed(_worker, nproc, table, quick, device, sizes, workers, threads=1, timeout_s=1800)
    result_rows = [_result_row(row, [r[i] for r in per_rank]) for i, row in enumerate(table)]
    ran = [r for r in result_rows if "skipped" not in r]
    first = ran[0]
    previous = first
    for i, r in enumerate(result_rows, 1):
        r["row"] = i
        if "skipped" in r:
            r.update(speedup=None, vs_previous=None, accuracy_delta=None)
            continue
        r["speedup"] = r["samples_per_s"] / first["samples_per_s"]
        # what this row's technique alone gave (over the last row that ran)
        r["vs_previous"] = r["samples_per_s"] / previous["samples_per_s"]
        r["accuracy_delta"] = r["accuracy"] - first["accuracy"]
        previous = r
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    quick_note = (f"smoke run: {sizes.quick_steps} steps a row, torch.compile disabled and kiln's optimizer kernels "
                  "eager; the numbers say nothing" if device == "cpu" else
                  f"the GPU's quick form: {sizes.quick_steps} steps a row, torch.compile in its own row only")
    model = sizes.model + (", --quick: " + ", ".join(f"{k}={v}" for k, v in sizes.quick_keys.items())
                           if quick and sizes.quick_keys else "")
    setup = {"model": model, "config": str(sizes.config.relative_to(ROOT)),
             "samples": (sizes.quick_steps if quick else sizes.steps) * sizes.batch, "processes": nproc,
             "device": device, **({"gpu": gpu} if gpu else {}),
             "threads_per_process": 1 if device == "cpu" else None, "backend": "gloo" if nproc > 1 else None,
             "data_workers": workers,
             "quick": quick, **({"quick_note": quick_note} if quick else {}),
             "speed": "median samples/s over kiln train's log windows after the first",
             "peak": "resident set (VmHWM) of the fullest rank" if device == "cpu" else
                     "the GPU allocator's peak (torch.cuda.max_memory_allocated)",
             "article": {"batch_560": 1.51, "batch_384_image_256": 1.86, "full_fp16": 2.18}}
    key = lambda k: lambda r: r["config"][k]  # noqa: E731
    cols = [Col("#", "row"), Col("row", "name"), Col("samples/s", "samples_per_s", ".0f"),
            Col("speedup", "speedup", ".2f"), Col("x prev", "vs_previous", ".2f"), Col("peak MB", "peak_mb", ".1f"),
            # (a GPU's MFU is against its datasheet's peak; a CPU's, against a measured matmul, says little here)
            *([Col("MFU", "mfu", ".1%")] if device != "cpu" else []),
            Col("accuracy", "accuracy", ".2%"),
            Col("vs 1", lambda r: None if r["accuracy_delta"] is None else 100 * r["accuracy_delta"], "+.1f"),
            Col("precision", key("train.precision")), Col("pool", key("model.pool")),
            Col("layout", lambda r: "B,N,D" if r["config"]["model.batch_first"] else "N,B,D"),
            Col("optimizer", key("optim.impl")), Col("zero", key("parallel.zero")),
            Col("compile", lambda r: "yes" if r["config"]["train.compile"] else "no"),
            Col("batch", key("data.batch_size"))]
    notes = [why_workers] if why_workers else []
    if len(ran) < len(result_rows):
        cols.append(Col("", lambda r: "not applicable on one device" if "skipped" in r else ""))
        notes += [f"row {r['row']} ({r['name']}) not run: {r['skipped']}; x prev of the row after it is over the row "
                  "before it" for r in result_rows if "skipped" in r]
    if device != "cpu":
        notes.append("accuracy: of synthetic labels (a linear teacher over 8x8 cells of each image, 1000 classes) "
                     "after a few hundred steps at most: it shows that each row trained, not ImageNet's accuracy")
    label = lambda r: f"{r['row']}. {r['name'].removeprefix('+ ')}"  # noqa: E731
    chart = [Bars("cumulative speedup over row 1 (samples/s)", ran, label, {"speedup": "speedup"},
                  "x row 1", lines={"row 1": 1.0}, color=lambda r: "gray" if r["row"] == 1 else
                  "tab:orange" if r["speedup"] >= 1 else "tab:red"),
             Bars("validation accuracy", ran, label, {"accuracy": "accuracy"}, "accuracy")]
    where = f"one GPU ({gpu})" if gpu else (f"{nproc} processes x 1 thread" if nproc > 1 else "one process x 1 thread")
    title = (f"{setup['model']}, {setup['samples']:,} training samples a row, {where} (Meta's faster-ViT table, "
             "cumulative)")
    return Result({"setup": setup, "rows": result_rows}, [Table(result_rows, cols)], title, chart, notes=notes,
                  threads=1 if device == "cpu" else None, processes=nproc)


run = benchmark("vit", measure)
