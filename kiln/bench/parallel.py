"""``kiln bench parallel``: a LiBai-style table of ``dp x tp x pp`` layouts for GPT and BERT,
or, with ``--family llama``, for a Hugging Face Llama of the same size (6.4 M parameters:
width 256, 8 layers, 8 query and 4 key/value heads, SwiGLU width 768) split by its plan in
``kiln/models/hf_plans.py``; ``--family gpt,llama`` puts the two side by side.

One row per (model, layout) for the layouts 1x1x1, 2x1x1, 1x2x1, 1x1x2, 2x2x1, 2x1x2, 1x2x2
(dp x tp x pp), laid out by :func:`kiln.parallel.parallelize` and trained with kiln's
AdamW (fp32; arena when the layout allows it, multi-tensor over DTensor shards under tp) and
the trainer's order: forward + backward (the 1F1B schedule over ``MICROBATCHES`` micro-batches
when pp > 1), ``reduce_gradients`` over dp, ``step``, ``zero_grad``. Each layout runs in a
spawned gloo group of dp*tp*pp processes with one intra-op thread each
(``kiln.launch.testing.run_distributed``); layouts with the same number of ranks share one
group and run one after the other, both models each, every run on freshly built meshes and
from freed memory (starting processes and importing torch, DTensor and pipelining costs more
than a quick run's steps).
Every layout trains the same global batch of random token ids (the loss value is not the
point), each dp rank its slice of it, all tp ranks of a dp group the same slice. Per model:
``WARMUP`` steps (the first one with a pipeline also runs torch's shape inference), ``STEPS``
timed steps, then ``PROFILED`` steps under ``torch.profiler``. Columns, per row:

- samples/s: global batch x timed steps / wall time between two barriers (rank 0's clock).
- state MB: bytes of model state the rank really holds after a step, before ``zero_grad``:
  parameters + gradients + optimizer state (AdamW's two moments and step counts), summing the
  distinct storages behind the local tensors (a DTensor counts its ``to_local()``; the
  arena's flat buffers count once, alignment padding included). The largest rank is shown
  (with pp the stages differ: the first holds the embedding, the last the head). This is the
  column that shows sharding: tp=2 and pp=2 about halve it, dp replicates it.
- peak MB: the rank's peak RSS (``VmHWM``) above its RSS when the model run began (after
  imports and process-group setup, and after the previous model was freed and
  ``malloc_trim`` gave its pages back); it holds the whole model as every rank builds it
  before cutting (same seed everywhere), the state, and the activations. Largest rank.
- work MB: peak RSS during the timed steps above the RSS before them (state resident): what a
  step adds on top, i.e. activations, autograd's saved tensors, communication buffers and
  temporaries (and, in multi-tensor mode, the gradients that ``zero_grad`` frees each step).
  Largest rank. RSS is in pages touched: glibc may reuse freed memory without touching new
  pages, so treat it as a lower bound on what a step allocates.
- comm ms: communication time per step, from ``torch.profiler`` (CPU activities) over the
  profiled steps: on each rank, the union of the time intervals of every ``c10d::*``,
  ``gloo:*`` and ``_c10d_functional::*`` event, on any thread (the ops on the main thread and
  their execution on gloo's worker threads, waits for the peer included), divided by the
  profiled steps. A union, so overlapping events count once; asynchronous p2p sends of the
  pipeline count while in flight even where they overlap compute, so this is an upper bound
  on the time communication costs. The slowest rank is shown; "comm %" is that over the
  profiled step's wall time (the profiler slows steps a little).
- bubble: for pp > 1, the idle share of the pipeline's rank-time, from
  ``Pipeline.last_step_timing`` (built with ``timing=True``: ``compute_s`` is the time this
  rank spent in its stages' forward/backward, ``wall_s`` its schedule run). For each timed
  step and rank, ``1 - compute_s / W`` with ``W`` the longest ``wall_s`` among the ranks of
  that pipeline (the schedules start together; the last stage returns before the first one
  has drained, so a rank's own ``wall_s`` would hide part of its idle time); averaged over
  the timed steps, then over all ranks ("bubble"; the largest rank's value and every rank's
  are in the JSON). It is compared with two textbook numbers for p stages and m
  micro-batches of equal cost: ``(p-1)/m`` (GPipe/Megatron: bubble time relative to the
  *ideal* compute time m slots) and ``(p-1)/(m+p-1)`` (fill-drain: idle share of the *whole*
  step, which lasts m+p-1 slots of which each rank computes m). What is measured is the
  second kind, idle over wall, so ``(p-1)/(m+p-1)`` is the number to hold it against; it
  comes out higher by p2p waits, the loss, the schedule's own Python, and unequal stages
  (the first also embeds, the last also runs the head and the loss).

On a 2-core CPU machine the absolute numbers say little; the shape of the table, the state
column and the bubble column do. Layouts with 4 ranks share 2 cores: a stage computes at half
speed while every rank computes and at full speed while the other stage idles, which shortens
the idle slots against the compute ones and can pull the measured bubble of 1x2x2 and 2x1x2
below ``(p-1)/(m+p-1)``. Linux only (RSS from ``/proc/self``).

    kiln bench parallel            # or: kiln bench parallel --quick
"""

from __future__ import annotations

import gc
import itertools
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import kiln.optim
from kiln._profiling import profiled
from kiln.bench._harness import Bars, Col, Result, Table, benchmark
from kiln.bench._profile import comm_seconds
from kiln.bench._rss import Rss, held_bytes
from kiln.launch.testing import run_distributed
from kiln.models import create_model
from kiln.parallel import Layout, parallelize


# Shape legend: B batch (global unless said), T sequence length, V vocabulary.

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2)]  # (dp, tp, pp)
MODELS = ("gpt", "bert")
FAMILIES = ("gpt", "bert", "llama")  # --family: kiln's own GPT and BERT, transformers' Llama
MODEL = dict(vocab_size=256, seq_len=128, dim=256, depth=8, heads=8)  # 6.5 M parameters (GPT), 6.4 M (Llama)
BATCH, MICROBATCHES = 16, 4           # global batch per step; micro-batches per dp rank's batch (pp > 1)
STEPS, WARMUP, PROFILED = 5, 2, 2  # warm-up: the first step of a pipeline also infers shapes
QUICK_MODEL = dict(MODEL, seq_len=32, depth=4)  # 3.3 M parameters (GPT), far fewer tokens per step
QUICK_BATCH = 8
QUICK_STEPS, QUICK_WARMUP, QUICK_PROFILED = 2, 1, 1


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())  # (B*T, V), (B*T,)


def _state_bytes(params: list[torch.Tensor], opt: Any) -> dict[str, int]:
    """Parameters, gradients and optimizer state this rank holds, in bytes (kiln optimizer in
    arena or multi-tensor mode: arena buffers counted once, padding included)."""
    return {"param_bytes": held_bytes(params), "grad_bytes": held_bytes(opt.grad_buffers()),
            "optim_bytes": opt.state_bytes()}


# -- one model on one rank --------------------------------------------------------------------------
def _worker(rank: int, world: int, layouts: list[tuple[int, int, int]], models: tuple[str, ...],
            settings: dict[str, Any]) -> dict[tuple[int, int, int], dict[str, Any]]:
    rss = Rss()
    # gc.freeze: the full collections that free each model (cycles) then skip the hundreds of
    # thousands of objects the imports made (0.3 s a collection otherwise)
    gc.collect()
    gc.freeze()
    # A tiny run of each layout first: imports (DTensor, pipelining), kernel set-up and the
    # profiler's start happen once per process and would count in the first measured run's
    # setup and peak memory.
    for layout in layouts:
        _run_model(rank, layout, models[0], _tiny(settings), rss)
    gc.collect()
    gc.freeze()
    return {layout: {name: _run_model(rank, layout, name, settings, rss) for name in models} for layout in layouts}


def _build(name: str, m: dict[str, Any]) -> torch.nn.Module:
    """Model ``name`` of the sizes ``m``: kiln's registry, or a transformers Llama (grouped-query
    attention with half as many key/value heads, SwiGLU of width 3 x dim; untied, as pp needs)."""
    if name != "llama":
        return create_model(name, **m)
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = m["heads"]
    cfg = LlamaConfig(vocab_size=m["vocab_size"], max_position_embeddings=m["seq_len"], hidden_size=m["dim"],
                      intermediate_size=3 * m["dim"], num_hidden_layers=m["depth"], num_attention_heads=heads,
                      num_key_value_heads=heads // 2 if heads >= 4 else heads, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(cfg)


def _logits(outputs: Any) -> torch.Tensor:
    return outputs.logits if hasattr(outputs, "logits") else outputs  # transformers' ModelOutput


def _tiny(settings: dict[str, Any]) -> dict[str, Any]:
    model = dict(settings["model"], seq_len=8, dim=32, depth=2, heads=2)  # tp=2 and pp=2 still fit
    return dict(settings, model=model, warmup=1, steps=1, profiled=1)


def _run_model(rank: int, layout_dims: tuple[int, int, int], name: str, s: dict[str, Any], rss: Rss) -> dict[str, Any]:
    """Build ``name``, lay it out, train warm-up, timed and profiled steps; this rank's numbers."""
    rss_start = rss.restart()
    clock = [time.perf_counter()]
    layout = Layout(*layout_dims)
    torch.manual_seed(0)  # the same whole model on every rank; parallelize keeps this rank's part
    model = _build(name, s["model"])
    n_params = sum(p.numel() for p in model.parameters())
    par = parallelize(model, layout, zero=0, pp_schedule="1f1b", microbatches=s["microbatches"], loss_fn=_loss,
                      timing=True)
    del model
    params = list({id(p): p for p in par.model.parameters()}.values())
    # as the trainer: the data-parallel reduction chosen by the layout (here: stage 0, after backward)
    opt = par.data_parallel(kiln.optim.AdamW(params, lr=1e-4, weight_decay=0.01, contiguous=par.arena))
    pipe, where = par.pipeline, layout.coords(rank)
    gen = torch.Generator().manual_seed(1)  # the same global batch on every rank
    B, T, V = s["batch"], s["model"]["seq_len"], s["model"]["vocab_size"]
    local = B // layout.dp

    def step() -> None:
        ids, targets = torch.randint(V, (B, T), generator=gen), torch.randint(V, (B, T), generator=gen)  # (B, T)
        lo = where["dp"] * local  # this dp rank's slice; every tp rank of the dp group takes the same
        ids, targets = ids[lo:lo + local], targets[lo:lo + local]
        if pipe is not None:
            pipe.step(ids, targets)  # forward + backward of every micro-batch
        else:
            with par.loss_context():  # tp: the cross-entropy runs on vocabulary-sharded logits
                _loss(_logits(par.model(ids)), targets).backward()
        par.reduce_gradients()
        opt.step()

    clock.append(time.perf_counter())
    for _ in range(s["warmup"]):
        step()
        state = _state_bytes(params, opt)  # after a step, before zero_grad: gradients still held
        opt.zero_grad()
    peak_setup = rss.read()["VmHWM"]
    rss_before_steps = rss.restart()
    clock.append(time.perf_counter())

    pipe_steps = []  # (wall_s, compute_s) of each timed pipeline step on this rank
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(s["steps"]):
        step()
        opt.zero_grad()
        if pipe is not None:
            pipe_steps.append((pipe.last_step_timing["wall_s"], pipe.last_step_timing["compute_s"]))
    dist.barrier()  # the step ends when the slowest rank is done
    wall = time.perf_counter() - t0
    peak_steps = rss.read()["VmHWM"]
    clock.append(time.perf_counter())

    with profiled() as prof:
        t1 = time.perf_counter()
        for _ in range(s["profiled"]):
            step()
            opt.zero_grad()
        profiled_wall = time.perf_counter() - t1
    comm, comm_by_name = comm_seconds(prof)
    dist.barrier()
    clock.append(time.perf_counter())

    return {
        "rank": rank, "coords": where, "n_params": n_params,
        "n_params_local": sum(kiln.optim.local_tensor(p).numel() for p in params),
        **state, "state_bytes": sum(state.values()),
        "wall_s": wall,
        "peak_rss_bytes": max(peak_setup, peak_steps) - rss_start,
        "work_rss_bytes": peak_steps - rss_before_steps,
        "comm_ms_per_step": comm / s["profiled"] * 1e3,
        "comm_share": comm / profiled_wall,
        "comm_ms_by_event": {k: v / s["profiled"] * 1e3 for k, v in sorted(comm_by_name.items())},
        "pipeline_steps": pipe_steps,
        # where this rank's run went: build + parallelize, warm-up, timed steps, profiled steps
        "phase_s": dict(zip(("setup", "warmup", "timed", "profiled"), [b - a for a, b in itertools.pairwise(clock)])),
    }


# -- rows, table, chart -------------------------------------------------------------------------------
def _row(name: str, layout: tuple[int, int, int], ranks: list[dict[str, Any]], s: dict[str, Any]) -> dict[str, Any]:
    dp, tp, pp = layout
    m = s["microbatches"]
    big = max(ranks, key=lambda r: r["state_bytes"])  # the rank that must fit on a device
    row = {
        "model": name, "layout": f"{dp}x{tp}x{pp}", "dp": dp, "tp": tp, "pp": pp, "ranks": dp * tp * pp,
        "n_params": ranks[0]["n_params"], "n_params_local_max": max(r["n_params_local"] for r in ranks),
        "global_batch": s["batch"], "steps": s["steps"],
        "samples_per_s": s["batch"] * s["steps"] / ranks[0]["wall_s"],
        "step_ms": ranks[0]["wall_s"] / s["steps"] * 1e3,
        "state_bytes": big["state_bytes"],
        "state_parts": {k: big[k] for k in ("param_bytes", "grad_bytes", "optim_bytes")},
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "work_rss_bytes": max(r["work_rss_bytes"] for r in ranks),
        "comm_ms_per_step": max(r["comm_ms_per_step"] for r in ranks),
        "comm_share": max(r["comm_share"] for r in ranks),
        "microbatches": m if pp > 1 else None,
        "bubble": None, "bubble_max": None, "bubble_gpipe": None, "bubble_fill_drain": None,
        "per_rank": ranks,
    }
    if pp > 1:
        bubbles = _bubbles(ranks)
        for r, b in zip(ranks, bubbles):
            r["bubble"] = b
        row["bubble"] = sum(bubbles) / len(bubbles)
        row["bubble_max"] = max(bubbles)
        row["bubble_gpipe"] = (pp - 1) / m
        row["bubble_fill_drain"] = (pp - 1) / (m + pp - 1)
    return row


def _bubbles(ranks: list[dict[str, Any]]) -> list[float]:
    """Per rank, the mean over timed steps of ``1 - compute_s / pipeline wall``, where the
    pipeline wall of a step is the longest ``wall_s`` among the ranks of that pipeline (same dp
    and tp coordinates). Each rank's own ``wall_s`` would not do: the schedules start together
    (``Pipeline.step`` agrees on the batch shape first) but the last stage returns as soon as
    its last backward is done, while the first stage still drains, so its own wall leaves out
    the idle drain."""
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in ranks:
        groups.setdefault((r["coords"]["dp"], r["coords"]["tp"]), []).append(r)
    out = []
    for r in ranks:
        group = groups[r["coords"]["dp"], r["coords"]["tp"]]
        walls = [max(g["pipeline_steps"][i][0] for g in group) for i in range(len(r["pipeline_steps"]))]
        out.append(sum(1 - c / w for (_, c), w in zip(r["pipeline_steps"], walls)) / len(walls))
    return out


def _measure(models: tuple[str, ...], layouts: list[tuple[int, int, int]], settings: dict[str, Any]) -> list[dict[str, Any]]:
    # One spawned group per number of ranks, running its layouts one after the other: starting
    # processes and importing torch, DTensor and pipelining there costs more than a quick run's
    # steps, and each model run starts from freed memory (see Rss.restart) in any case.
    worlds: dict[int, list[tuple[int, int, int]]] = {}
    for lay in layouts:
        worlds.setdefault(lay[0] * lay[1] * lay[2], []).append(lay)
    by_layout: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for world, lays in worlds.items():
        ranks = run_distributed(_worker, world, lays, models, settings, threads=1, timeout_s=300)
        for lay in lays:
            by_layout[lay] = [r[lay] for r in ranks]
    rows = []
    for name in models:
        for lay in layouts:
            rows.append(_row(name, lay, [r[name] for r in by_layout[lay]], settings))
        base = next((r for r in rows if r["model"] == name and r["ranks"] == 1), None)
        for r in rows:
            if r["model"] == name:
                r["state_vs_1x1x1"] = r["state_bytes"] / base["state_bytes"] if base else None
    return rows


def settings_for(quick: bool) -> dict[str, Any]:
    """Model, batch and step counts of a full or a ``--quick`` run."""
    if quick:
        return {"model": QUICK_MODEL, "batch": QUICK_BATCH, "microbatches": MICROBATCHES,
                "steps": QUICK_STEPS, "warmup": QUICK_WARMUP, "profiled": QUICK_PROFILED}
    return {"model": MODEL, "batch": BATCH, "microbatches": MICROBATCHES,
            "steps": STEPS, "warmup": WARMUP, "profiled": PROFILED}


def check_family(family: str | None) -> tuple[str, ...]:
    """The models of ``--family`` (comma-separated; default: kiln's GPT and BERT)."""
    if not family:
        return MODELS
    names = tuple(dict.fromkeys(f.strip() for f in family.split(",") if f.strip()))
    bad = [f for f in names if f not in FAMILIES]
    if bad or not names:
        raise ValueError(f"kiln bench parallel --family {family}: unknown family {bad[0] if bad else family!r}; "
                         f"choose from {', '.join(FAMILIES)} (comma-separated, e.g. --family gpt,llama)")
    if "llama" in names:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ValueError("kiln bench parallel --family llama needs Hugging Face transformers: "
                             "pip install 'kiln[hf]'") from None
    return names


def measure(quick: bool = False, *, family: str | None = None, models: tuple[str, ...] | None = None,
            layouts: list[tuple[int, int, int]] | None = None, settings: dict[str, Any] | None = None) -> Result:
    """Every layout for every model. ``family``: ``--family``, e.g. ``"llama"`` or ``"gpt,llama"``
    (default: GPT and BERT). ``models``, ``layouts`` and ``settings`` (see :func:`settings_for`)
    narrow the run (tests)."""
    models = models or check_family(family)
    settings = settings or settings_for(quick)
    layouts = [tuple(lay) for lay in (layouts or LAYOUTS)]
    rows = _measure(tuple(models), layouts, settings)
    mb = 2.0**-20
    cols = [Col("model", "model"), Col("dp x tp x pp", "layout"), Col("samples/s", "samples_per_s", ".1f"),
            Col("state MB", lambda r: r["state_bytes"] * mb, ".1f"), Col("vs 1x1x1", "state_vs_1x1x1", ".3f"),
            Col("peak MB", lambda r: r["peak_rss_bytes"] * mb, ".0f"),
            Col("work MB", lambda r: r["work_rss_bytes"] * mb, ".0f"), Col("comm ms", "comm_ms_per_step", ".1f"),
            Col("comm %", "comm_share", ".1%"), Col("bubble", "bubble", ".3f"), Col("(p-1)/m", "bubble_gpipe", ".3f"),
            Col("(p-1)/(m+p-1)", "bubble_fill_drain", ".3f")]
    # one group of bars a layout, one bar a model
    by = {(r["layout"], r["model"]): r for r in rows}
    names = list(dict.fromkeys(r["layout"] for r in rows))

    def panel(title: str, value: Any, piped: bool = False, **kw: Any) -> Bars:
        lays = [lay for lay in names if not piped or by[lay, models[0]]["bubble"] is not None]
        return Bars(title, [{"layout": lay, **{m: by[lay, m] for m in models}} for lay in lays], "layout",
                    {m: lambda g, m=m: value(g[m]) for m in models}, **kw)

    chart = [panel("samples/s (same global batch)", lambda r: r["samples_per_s"]),
             panel("model state per rank, MB (largest rank)", lambda r: r["state_bytes"] * mb),
             panel("pipeline bubble: idle share of a step", lambda r: r["bubble"], piped=True,
                   marks={"(p-1)/(m+p-1)": lambda g: g[models[0]]["bubble_fill_drain"],
                          "(p-1)/m": lambda g: g[models[0]]["bubble_gpipe"]})]
    report = {"setup": {**settings, "models": list(models), "layouts": [list(lay) for lay in layouts],
                        "threads_per_process": 1, "backend": "gloo", "optimizer": "kiln AdamW fp32",
                        "pp_schedule": "1f1b", "quick": quick}, "rows": rows}
    title = (f"dp x tp x pp layouts, m = {settings['microbatches']} micro-batches per dp rank's batch; global batch "
             f"{settings['batch']} x seq {settings['model']['seq_len']}; 1 thread per process (layouts with more "
             "ranks than free cores share them)")
    return Result(report, [Table(rows, cols)], title, chart, threads=1, processes=max(d * t * p for d, t, p in layouts))


run = benchmark("parallel", measure)
