"""Benchmarks that back kiln's speed and memory claims: ``kiln bench NAME``.

Each benchmark measures kiln against the plain PyTorch way *in the same process run*
and reports ratios, because absolute times on a shared machine drift by 30% or more.

A benchmark is a module ``kiln.bench.<module>`` whose ``measure(quick)`` returns its rows, the
columns to show them in and its JSON (:class:`kiln.bench._harness.Result`); the harness makes
that its ``run(out_dir, quick=False)``, which prints the table with the machine line and
writes ``out_dir/<name>.json``, ``.txt`` and ``.png``. ``quick=True`` shrinks the work to a
smoke run (used by tests); a full run through :func:`run_benchmark` (``kiln bench NAME``) also
replaces the benchmark's section of ``docs/lab/benchmarks.md``.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Callable

from kiln.errors import did_you_mean

# name on the command line -> (module, one-line description)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "optimizer": ("kiln.bench.optimizer", "optimizer step time: torch for-loop/foreach/fused vs kiln's arena"),
    "encoder-layer": ("kiln.bench.encoder_layer", "one pre-LN encoder layer: forward/backward/step, torch vs kiln (article setup)"),
    "memory": ("kiln.bench.memory", "activation memory and step time under activation checkpointing x precision"),
    "dataloader": ("kiln.bench.dataloader", "samples/s and time to first batch of CPU-heavy augmentation: workers=0 vs workers='auto'"),
    "zero": ("kiln.bench.zero", "per-rank bytes of parameters/gradients/optimizer state: data parallel vs ZeRO-1/2/3 at dp=2, 4"),
    "ddp": ("kiln.bench.ddp", "data parallel, 2 processes x 1 thread: torch DDP + fused AdamW vs kiln sync, overlapped and ZeRO-2 (ViT, small GPT, 25 M GPT): samples/s, comm ms/step, share hidden by compute"),
    "hf": ("kiln.bench.hf", "a Hugging Face GPT-2 trained by kiln train (fp32, compile, bf16-mixed) vs the transformers Trainer: samples/s"),
    "parallel": ("kiln.bench.parallel", "dp x tp x pp layouts for GPT and BERT, or --family llama (LiBai-style): samples/s, per-rank state and peak memory, comm ms, pipeline bubble"),
    "vit": ("kiln.bench.vit", "Meta's faster-ViT table, cumulative: AMP, FSDP, multi-tensor optimizer, pooling, batch-second, "
            "compile, batch, bf16-true (digits ViT on CPU, ViT-B/16 at 224 pixels with --device cuda)"),
    "plan": ("kiln.bench.plan", "kiln plan's predicted peak memory of a training step against the allocator's record: "
             "5 model families x precision x activation checkpointing x micro-batch x layouts (ZeRO 0-3, tp, pp under each schedule, tp x pp)"),
    "lm": ("kiln.bench.lm", "GPT-2 small (124 M) trained by kiln train (default, compile) vs the loop nanoGPT writes: "
           "tokens/s, MFU, tensor and process peak memory, loss difference"),
    "overhead": ("kiln.bench.overhead", "host time per step on a model whose compute is negligible (7 K-parameter MLP, batch 8): "
                 "kiln train vs the plain loop, microseconds"),
    "pp-schedules": ("kiln.bench.pp_schedules", "every pipeline schedule (gpipe, 1f1b, interleaved-1f1b and the zero-bubble "
                     "interleaved-zb, zbv, dualpipev) at pp=2, same stages and micro-batches: each rank's measured idle "
                     "share beside the schedule's theoretical bubble, step time"),
    "pipeline": ("kiln.bench.pipeline", "the six ways to a faster pipeline, stacked (Lightning): time to a target accuracy, naive to all six"),
    "checkpoint": ("kiln.bench.checkpoint", "the stall one checkpoint save puts into training (GPT, 57 M parameters, AdamW: "
                   "654 MiB of state): a save that writes before training goes on vs one written in the background "
                   "(train.async_checkpoint)"),
    "gpu": ("kiln.bench.gpu", "what to run when a GPU is lent: lm, vit, encoder-layer --hidden 1024, hf, optimizer and plan "
            "in their quick forms on one GPU, in at most 8 minutes, into docs/lab/gpu.md "
            "(--device cpu: a test of it)"),
}

# what a benchmark needs beyond kiln's own dependencies, and the extra that installs it
NEEDS: dict[str, tuple[tuple[str, ...], str]] = {"hf": (("transformers", "accelerate"), "bench")}
# the benchmarks that take --device (their measure(quick, device=...)), and how many devices
# of that kind each needs
ON_DEVICE: dict[str, int] = {"optimizer": 1, "overhead": 1, "lm": 1, "encoder-layer": 1, "hf": 1, "ddp": 2, "plan": 1,
                             "vit": 1, "gpu": 1, "checkpoint": 1}
# the device of those whose --device does not default to cpu
DEFAULT_DEVICE: dict[str, str] = {"gpu": "cuda"}
# the page a full run writes its section of, where not docs/lab/benchmarks.md (a page beside it)
DOCS_PAGE: dict[str, str] = {"gpu": "gpu.md"}


def get_benchmark(name: str) -> Callable[..., dict[str, Any]]:
    """Return the ``run`` function of the benchmark called ``name``."""
    if name not in BENCHMARKS:
        hint = did_you_mean(name, BENCHMARKS)
        raise KeyError(f"unknown benchmark {name!r}{hint or '.'} Available: {', '.join(sorted(BENCHMARKS))}")
    return importlib.import_module(BENCHMARKS[name][0]).run


def check_device(device: str, count: int = 1) -> str:
    """``device`` (``cpu``, ``cuda``) if torch can run ``count`` processes or streams of work
    there; a ValueError that names what is missing and the fix otherwise."""
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device torch knows: use cpu or cuda") from None
    if kind not in ("cpu", "cuda") or torch.device(device).index is not None:
        raise ValueError(f"--device {device!r}: the benchmarks run on cpu or cuda (all of its devices "
                         "they need, from cuda:0; choose others with CUDA_VISIBLE_DEVICES)")
    if kind == "cuda":
        if not torch.cuda.is_available():
            build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU build"
            raise ValueError(f"--device cuda: torch {torch.__version__} ({build}) sees no CUDA device here; "
                             "run on a GPU machine with a CUDA build of torch (kiln doctor says what is missing)")
        if torch.cuda.device_count() < count:
            raise ValueError(f"--device cuda: this benchmark needs {count} GPUs and torch sees "
                             f"{torch.cuda.device_count()} here")
    return kind


def _takes(run: Callable[..., Any], option: str) -> list[str]:
    """The benchmarks whose ``run`` takes ``option``, if ``run`` does not (for the refusal)."""
    import inspect

    if option in inspect.signature(run).parameters:
        return []
    return [n for n in BENCHMARKS if option in inspect.signature(get_benchmark(n)).parameters]


def check_benchmark(name: str, family: str | None = None, device: str | None = None, hidden: int | None = None,
                    nproc: int | None = None) -> dict[str, Any]:
    """The options ``run`` of benchmark ``name`` takes besides ``quick``, checked: KeyError for
    an unknown name, ValueError for an option it does not take or a bad value. ``family``: the
    model families of a benchmark that takes them (``parallel``); ``device``: where the
    benchmarks of :data:`ON_DEVICE` run (default cpu; :data:`DEFAULT_DEVICE` for ``gpu``);
    ``hidden``: the encoder layer's width (``encoder-layer``); ``nproc``: processes, one device
    each (``vit``)."""
    run = get_benchmark(name)
    modules, extra = NEEDS.get(name, ((), ""))
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"kiln bench {name} needs {' and '.join(missing)}, not installed here: "
                         f"pip install 'kiln[{extra}]'")
    options: dict[str, Any] = {}
    for option, value in (("family", family), ("hidden", hidden), ("nproc", nproc)):
        others = _takes(run, option) if value is not None else []
        if others:
            raise ValueError(f"kiln bench {name} takes no --{option} (only: {', '.join(others)})")
    if family is not None:
        from kiln.bench.parallel import check_family

        check_family(family)
        options["family"] = family
    if hidden is not None:
        from kiln.bench.encoder_layer import check_hidden

        options["hidden"] = check_hidden(hidden)
    if device is None:
        device = DEFAULT_DEVICE.get(name)
    if device is not None:
        if name not in ON_DEVICE:
            raise ValueError(f"kiln bench {name} takes no --device (only: {', '.join(ON_DEVICE)}); it runs on the CPU")
        try:
            options["device"] = check_device(device, ON_DEVICE[name])
        except ValueError as exc:
            if name != "gpu":
                raise
            raise ValueError(f"{exc.args[0]}; kiln bench gpu --device cpu tests the script on a CPU") from None
    if nproc is not None:
        from kiln.bench.vit import check_nproc

        options["nproc"] = check_nproc(nproc, options.get("device", "cpu"))
    return options


def run_benchmark(name: str, out_dir: str | Path | None = None, quick: bool = False,
                  family: str | None = None, device: str | None = None, hidden: int | None = None,
                  nproc: int | None = None) -> dict[str, Any]:
    """Run benchmark ``name`` into ``out_dir`` (default ``bench_results/NAME``); a bad name or
    option, or a missing package, is refused (:func:`check_benchmark`) before the folder is made.
    A full run (not ``quick``) also writes its section of ``docs/lab/benchmarks.md`` (a section of
    its own per device: ``kiln bench NAME --device cuda``; ``kiln bench gpu``'s is in
    ``docs/lab/gpu.md``, and only a run on a GPU writes it)."""
    from kiln.bench._harness import DOCS

    options = check_benchmark(name, family, device, hidden, nproc)
    out = Path(out_dir) if out_dir is not None else Path("bench_results") / name
    page = DOCS.with_name(DOCS_PAGE.get(name, DOCS.name))
    # (no docs/ beside an installed kiln; kiln bench gpu on a CPU is a test of its script, and docs/lab/gpu.md
    # holds what GPUs measured)
    gpu_test = name == "gpu" and options.get("device") == "cpu"
    docs = page if not quick and page.parent.is_dir() and not gpu_test else None
    return get_benchmark(name)(out, quick=quick, docs=docs, **options)
