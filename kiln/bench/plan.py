"""``kiln bench plan``: ``kiln plan``'s predicted peak memory against the measured one, over a
grid of models, precisions, activation checkpointing, micro-batches and layouts.

Each row is planned (:func:`kiln.plan.plan`: kiln's set-up and two steps traced on fake tensors
with a fake process group) and then run for real: kiln's own set-up (``kiln.train.setup``) and
two training steps, in this process (one rank) or in N gloo processes
(:func:`kiln.launch.testing.run_distributed`). The measured figure is the allocator's: the
bytes of every tensor live as the second (steady) step starts (every CPU tensor the collector
finds, less the data sets' own), plus the highest running sum of the CPU allocations and frees
that ``torch.profiler.profile(profile_memory=True)`` records during the step. ``summary.json``'s
``peak_tensor_memory_mb`` (:class:`kiln.train._tensor_peak.TensorMemory`) takes as its baseline only
what the model and optimizer hold; it is shown beside ("summary MB"): it leaves out a
pipeline's receive buffers and the batch, which the plan counts. Every rank is compared; the
table shows the fullest rank of each row, and the error of the worst rank.

The models are small (a step takes milliseconds to a second on 2 cores) so the whole grid runs
in minutes: kiln's ViT, GPT and BERT, and Hugging Face GPT-2 and Llama (``transformers``,
random weights, no download).

``--device cuda`` plans each row for CUDA (fake CUDA tensors) and trains it on the GPU
(``train.device=cuda``); the measured figure is then ``torch.cuda.max_memory_allocated()``
over the second step, less what was allocated before the row was set up and less the data
sets' own tensors. cuBLAS's workspaces, which the CUDA caching allocator holds for the life
of the process once a first matrix product has run, are allocated before any row (fp32 and
bf16 products, forward and backward: autograd's CUDA thread has a cuBLAS handle, and a
workspace, of its own) and reported as a note: they are the process's, not the step's (on an
H100, 32 MiB a thread; the plan does not count them). Only the one-process rows run there
(the layouts need a GPU per rank).

    python -m kiln bench plan          # or run(Path("out"), quick=True)
    python -m kiln bench plan --device cuda
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

from kiln._profiling import profiled
from kiln.bench._harness import Bars, Col, Result, Table, benchmark, target
from kiln.config import load_config
from kiln.launch.testing import run_distributed
from kiln.optim import local_tensor
from kiln.plan import plan, runtime_reserve
from kiln.train.parts import live_tensor_bytes, running_peak, setup, train_step


__all__ = ["run", "measure", "measured_peaks", "compare", "config_of", "row", "GRID", "QUICK_GRID"]

TOLERANCE = 0.05  # every row within 5% of the measured peak

_DIR = "configs"
_CONFIGS = {  # family -> (config file, overrides that make it small)
    "vit": ("digits_vit.py", ["model.depth=2"]),
    "gpt": ("gpt_tiny.py", ["model.depth=4"]),
    "bert": ("bert_tiny.py", []),
    "hf-gpt2": ("hf_gpt2_tiny.py", []),
    "hf-llama": ("hf_llama_tiny.py", []),
}


_SMALL = {  # family -> overrides for a model of one block a stage, and short sequences
    "gpt": lambda pp: [f"model.depth={pp}", "model.seq_len=32", "data.args.seq_len=32"],
    "bert": lambda pp: [f"model.depth={pp}", "model.seq_len=32", "data.args.seq_len=32"],
    "vit": lambda pp: [f"model.depth={pp}"],
}


def row(family: str, precision: str = "fp32", ac: str = "none", micro: int = 4, world: int = 1, *,
        small: bool = False, overrides: tuple[str, ...] = (), **parallel: Any) -> dict[str, Any]:
    """One configuration of the grid: ``micro`` samples per micro-batch on each data-parallel
    rank, ``parallel`` keys (``zero``, ``replicate``, ``tp``, ``pp``, ``pp_schedule``); ``small``: one or two
    blocks and short sequences (the fast tier's test); ``overrides``: further config keys."""
    layout = ", ".join(f"{k}={v}" for k, v in parallel.items()) or "-"
    label = f"{family} {precision} ac={ac} micro={micro}" + (f" x{world} {layout}" if world > 1 else "")
    label += "".join(f" {o.rpartition('.')[2]}" for o in overrides)
    return {"family": family, "precision": precision, "ac": ac, "micro": micro, "world": world,
            "parallel": parallel, "layout": layout, "small": small, "overrides": overrides, "label": label}


# the grid of the issue: families x precision x AC x micro-batch, and the layouts at --nproc 2/4
GRID: list[dict[str, Any]] = [
    *[row(f, p) for f in _CONFIGS for p in ("fp32", "bf16-mixed", "bf16-true")],
    *[row(f, "fp32", ac) for f in ("vit", "gpt", "bert", "hf-llama") for ac in ("full", "selective")],
    *[row(f, "fp32", "none", m) for f in ("gpt", "vit") for m in (1, 16)],
    *[row("gpt", "fp32", "none", 4, 2, zero=z) for z in (0, 1, 2, 3)],
    row("gpt", "fp32", "none", 4, 2, tp=2),
    row("gpt", "fp32", "none", 4, 2, pp=2, pp_schedule="gpipe"),
    row("gpt", "fp32", "none", 4, 2, pp=2, pp_schedule="1f1b"),
    # two stages a rank, looped and in a V; the zero-bubble ones keep each micro-batch's
    # activations until its weight pass
    *[row("gpt", "fp32", "none", 4, 2, pp=2, pp_schedule=s) for s in ("interleaved-1f1b", "interleaved-zb", "zbv",
                                                                       "dualpipev")],
    row("gpt", "fp32", "none", 4, 4, tp=2, pp=2),
    row("gpt", "fp32", "none", 4, 4, zero=3, replicate=2),  # HSDP: 2 replicas of 2 shards
    row("hf-llama", "fp32", "none", 4, 2, zero=2),
    row("hf-llama", "fp32", "none", 4, 2, tp=2),
    row("bert", "bf16-mixed", "full", 4, 2, zero=3),
    # logits that dominate the step (vocabulary 16384), whole and in chunks (train.chunked_lm_loss)
    *[row("gpt", "fp32", "none", 8, overrides=("model.vocab_size=16384", f"train.chunked_lm_loss={v}"))
      for v in ("false", "true")],
]
# a few seconds: the fast tier's test
QUICK_GRID: list[dict[str, Any]] = [
    row("gpt", "fp32", small=True),
    row("gpt", "bf16-true", "full", small=True),
    row("gpt", "fp32", "none", 4, 2, zero=2, small=True),
]


def config_of(case: dict[str, Any], device: str = "cpu") -> Any:
    """The config of a row of the grid: the family's bundled config, small, with the row's
    settings, training on ``device``."""
    from pathlib import Path

    path, small = _CONFIGS[case["family"]]
    root = Path(__file__).resolve().parents[2] / _DIR
    batch = case["micro"] * (case["world"] // _model_ranks(case))
    keys = [*small, f"train.precision={case['precision']}", f"train.activation_checkpointing={case['ac']}",
            f"data.batch_size={batch}", "train.accumulate=1", "train.max_steps=4", "train.eval_every=0",
            "train.log_every=1", "train.progress=none", "data.workers=0", "train.checkpoint_every=0",
            f"train.device={device}", *(f"parallel.{k}={v}" for k, v in case["parallel"].items())]
    if case["parallel"].get("pp", 1) > 1:
        keys.append("model.tie_embeddings=false")
    if case["small"]:
        keys += _SMALL[case["family"]](case["parallel"].get("pp", 1))
    return load_config(root / path, [*keys, *case.get("overrides", ())])


def _model_ranks(case: dict[str, Any]) -> int:
    return case["parallel"].get("tp", 1) * case["parallel"].get("pp", 1)


def _measure_rank(rank: int, world: int, cfg: Any) -> dict[str, int]:
    """Set up ``cfg`` as kiln train does, train one step, and measure the second (with several
    processes the least of the second to fourth, below): the peak of live tensor bytes, on top
    of what the model and optimizer hold (``TensorMemory``, as ``summary.json`` measures it)
    and on top of every tensor live as the step starts."""
    import gc

    import torch

    # what this process held before (another row's plan, its cached data): kept alive, so
    # that no new tensor takes one of their addresses
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (isinstance on some deprecated module objects warns)
        before = [t.untyped_storage() for t in gc.get_objects() if isinstance(t, torch.Tensor)
                  and t.device.type == "cpu" and not t.is_meta and not hasattr(t, "fake_mode")]
    with tempfile.TemporaryDirectory() as out:
        run = setup(cfg, run_dir=f"{out}/run") if rank == 0 else setup(cfg)
        try:
            run.model.train()
            train_step(run, next(run.batches))
            gc.collect()
            held = live_tensor_bytes(run.par.model, run.optimizer)
            everything = _live_bytes(run, {st.data_ptr() for st in before})
            # with gloo, a collective's tensors are often freed by its worker thread, which the
            # profiler does not follow: their frees go unrecorded and the sum stays high (the
            # step's sum ended 0-400 KB above where it began, and the row's peak varied by up to
            # 9% from run to run). A missed free only ever adds, so the least of a few steps is
            # the one that missed the fewest.
            steps = []
            for _ in range(3 if world > 1 else 1):
                with profiled(profile_memory=True) as prof:
                    train_step(run, next(run.batches))
                steps.append(running_peak(prof))
            step = min(steps)
            return {"model_and_optimizer": held + step, "every_tensor": everything + step,
                    "live_at_start": everything, "step_rise": step}
        finally:
            run.progress.close()
            run.out.close()


def _measure_cuda(cfg: Any) -> dict[str, int]:
    """:func:`_measure_rank` on the GPU: ``torch.cuda.max_memory_allocated()`` over the second
    step, less what was allocated before the set-up and the data sets' own tensors."""
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with tempfile.TemporaryDirectory() as out:
        run = setup(cfg, run_dir=f"{out}/run")
        try:
            run.model.train()
            train_step(run, next(run.batches))
            torch.cuda.synchronize()
            gc.collect()
            held = live_tensor_bytes(run.par.model, run.optimizer)
            data = _storage_bytes(_tensors_under([run.data.train, run.data.val, run.batches]), "cuda")
            start = torch.cuda.memory_allocated() - base - sum(data.values())
            torch.cuda.reset_peak_memory_stats()
            train_step(run, next(run.batches))
            torch.cuda.synchronize()
            step = torch.cuda.max_memory_allocated() - base - sum(data.values()) - start
            return {"model_and_optimizer": held + step, "every_tensor": start + step, "live_at_start": start,
                    "step_rise": step}
        finally:
            run.progress.close()
            run.out.close()
            del run
            gc.collect()
            torch.cuda.empty_cache()


def cublas_workspace_bytes() -> int:
    """Allocate cuBLAS's workspaces and return the bytes the CUDA caching allocator holds for
    them from now on: fp32 and bf16 products with and without a bias, forward and backward (the
    backward runs on autograd's own CUDA thread, whose cuBLAS handle has a workspace of its own)."""
    import torch
    import torch.nn.functional as F

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.ones(64, 64, device="cuda", dtype=dtype, requires_grad=True)
        b = torch.ones(64, device="cuda", dtype=dtype, requires_grad=True)
        (F.linear(w, w, b) + w @ w).float().sum().backward()
        del w, b
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def _storage_bytes(tensors: Any, device: str) -> dict[int, int]:
    """Bytes of the distinct storages of ``tensors`` on ``device`` (the local shards of DTensors)."""
    import torch

    out: dict[int, int] = {}
    for t in tensors:
        t = local_tensor(t)
        if isinstance(t, torch.Tensor) and t.device.type == device and not t.is_meta and not hasattr(t, "fake_mode"):
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


def _live_bytes(run: Any, before: set[int]) -> int:
    """Bytes of every CPU tensor storage live now but the data sets' and those at the
    addresses ``before`` (what ``TensorMemory``'s baseline leaves out: a pipeline's receive
    buffers, the batch)."""
    import gc

    import torch

    # the data sets, and the loaders' own (a sampler's permutation, in its generator's frame)
    data = _storage_bytes(_tensors_under([run.data.train, run.data.val, run.batches]), "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (isinstance on some deprecated module objects warns)
        live = _storage_bytes((o for o in gc.get_objects() if isinstance(o, torch.Tensor)), "cpu")
    return sum(n for ptr, n in live.items() if ptr not in data and ptr not in before)


def _tensors_under(roots: list[Any], depth: int = 6) -> list[Any]:
    """Tensors reachable from ``roots`` through attributes, lists, dicts and suspended
    generators' frames (a data set's, a loader's)."""
    import types

    import torch

    found, seen, stack = [], set(), [(r, 0) for r in roots]
    while stack:
        obj, d = stack.pop()
        if id(obj) in seen or d > depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend((x, d + 1) for x in obj)
        elif isinstance(obj, dict):
            stack.extend((x, d + 1) for x in obj.values())
        elif isinstance(obj, types.GeneratorType):
            if obj.gi_frame is not None:
                stack.extend((x, d + 1) for x in obj.gi_frame.f_locals.values())
        elif isinstance(obj, torch.nn.Module):
            continue
        elif hasattr(obj, "__dict__"):
            stack.extend((x, d + 1) for x in vars(obj).values())
    return found


def measured_peaks(cfg: Any, world: int, device: str = "cpu") -> list[dict[str, int]]:
    """The steady step's peak of live tensor bytes on each of ``world`` ranks, run for real:
    ``model_and_optimizer`` (``summary.json``'s baseline) and ``every_tensor``."""
    if device == "cuda":
        if world != 1:
            raise ValueError("kiln bench plan --device cuda measures one-process rows only")
        return [_measure_cuda(cfg)]
    if world == 1:
        return [_measure_rank(0, 1, cfg)]

    return run_distributed(_measure_rank, world, cfg, timeout_s=600)


def compare(case: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    """Plan and measure one row of the grid on ``device``; the row with both peaks and the
    errors (against every live tensor; ``summary_error``: against summary.json's
    model-and-optimizer baseline)."""

    cfg = config_of(case, device)
    planned = plan(cfg, case["world"], device=device)
    runs = measured_peaks(cfg, case["world"], device)
    measured = [m["every_tensor"] for m in runs]
    errors = [p.peak_bytes / m - 1 for p, m in zip(planned.ranks, measured)]
    worst = max(range(len(errors)), key=lambda i: abs(errors[i]))
    fullest = max(range(len(measured)), key=lambda i: measured[i])
    r = planned.ranks[fullest]
    return {**case, "predicted_mb": r.peak_bytes / 2**20, "measured_mb": measured[fullest] / 2**20,
            "summary_mb": runs[fullest]["model_and_optimizer"] / 2**20,
            "error": errors[fullest], "worst_error": errors[worst], "worst_rank": worst,
            "summary_error": r.peak_bytes / runs[fullest]["model_and_optimizer"] - 1,
            "plan_s": planned.seconds, "precision_ran": planned.precision,
            **{f"{c}_mb": getattr(r, c) / 2**20 for c in ("parameters", "gradients", "optimizer_state",
                                                             "activations", "temporary", "communication")},
            "ranks": [{"rank": i, "predicted_bytes": p.peak_bytes, **m}
                      for i, (p, m) in enumerate(zip(planned.ranks, runs))]}


def measure(quick: bool = False, device: str = "cpu") -> Result:
    grid = QUICK_GRID if quick else GRID
    notes, extra = [], {}
    if device == "cuda":
        import torch

        skipped = [c["label"] for c in grid if c["world"] > 1]
        grid = [c for c in grid if c["world"] == 1]
        workspace = cublas_workspace_bytes()
        extra = {"cublas_workspace_bytes": workspace, "reserve_bytes": runtime_reserve("cuda")}
        notes = [f"measured on {torch.cuda.get_device_name()}: torch.cuda.max_memory_allocated() over the second "
                 "step, less what was allocated before the row and the data sets' tensors; cuBLAS's workspaces, "
                 f"{workspace / 2**20:.1f} MB held by the allocator for the process from its first matrix product, "
                 "were allocated before the first row and are not counted; kiln plan reserves "
                 f"{extra['reserve_bytes'] / 2**20:.1f} MB a process for them beside the step's peak",
                 f"not run on one GPU (a GPU per rank): {len(skipped)} layout rows"]
    rows = [compare(case, device) for case in grid]
    worst = max(rows, key=lambda r: abs(r["worst_error"]))
    cols = [Col("model", "family", group=True), Col("precision", "precision"), Col("AC", "ac"),
            Col("micro", "micro"), Col("ranks", "world"), Col("layout", "layout"),
            Col("predicted MB", "predicted_mb", ".2f"), Col("measured MB", "measured_mb", ".2f"),
            Col("summary MB", "summary_mb", ".2f"),
            Col("error", "error", "+.1%"), Col("worst rank", "worst_error", "+.1%"),
            Col("params", "parameters_mb", ".2f"), Col("grads", "gradients_mb", ".2f"),
            Col("optim", "optimizer_state_mb", ".2f"), Col("activ", "activations_mb", ".2f"),
            Col("temp", "temporary_mb", ".2f"), Col("comm", "communication_mb", ".2f"),
            Col("plan s", "plan_s", ".1f")]
    return Result(
        report={"rows": rows, "worst": {"row": worst["label"], "error": worst["worst_error"]}, **extra},
        tables=[Table(rows, cols, title="kiln plan's predicted peak of a steady step against the allocator's record "
                                        "(fullest rank; 'worst rank': the largest error over the row's ranks)")],
        title="kiln plan: predicted vs measured peak tensor memory" + (" on the GPU" if device == "cuda" else ""),
        chart=[Bars("peak tensor memory (MB)", rows, "label", {"measured": "measured_mb"},
                    marks={"predicted": "predicted_mb"}, horizontal=True, label="MB")],
        targets={"worst_error": target(abs(worst["worst_error"]), TOLERANCE, row=worst["label"])},
        notes=[*notes, "measured: every tensor live as the second step starts (data sets excepted) plus the highest running "
               "sum of the profiler's CPU allocations and frees during it (with several processes the least of steps "
               "2-4: gloo's worker thread frees some of a collective's tensors, and the profiler records no free "
               "there, which only ever adds); summary MB: the same on top of what the model "
               "and optimizer hold (summary.json's peak_tensor_memory_mb); predicted: kiln plan's trace of the same "
               "set-up and step on fake tensors",
               "categories are the predicted peak's: the fp32 master weights of bf16-true count as optimizer state"],
        processes=max(r["world"] for r in rows),
    )


run = benchmark("plan", measure)
