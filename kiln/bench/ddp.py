"""``kiln bench ddp``: data parallel on 2 processes x 1 thread (gloo), torch DDP against kiln's
ways of averaging gradients, on the digits ViT, a small GPT and a GPT of 25 M parameters whose
gradient (100 MB in fp32) makes communication a large part of a step.

Methods, each trained on the same initial weights, the same global batch (each rank its
half) and the same steps, with AdamW at the same lr, betas, eps and weight decay:

- ``torch_ddp``: ``torch.nn.parallel.DistributedDataParallel`` with its defaults (25 MB
  buckets, 1 MB first bucket, all-reduced during backward; buffers broadcast from rank 0 at
  each forward, which for the GPTs is their constant causal mask) and
  ``torch.optim.AdamW(fused=True)``: the plain PyTorch way.
- ``kiln_sync``: kiln's AdamW (arena) and :func:`kiln.parallel.all_reduce_gradients` after
  backward: one all-reduce per arena, nothing overlapped.
- ``kiln_overlap``: ``ZeroOptimizer(stage=0, overlap=True)`` (25 MB buckets): each bucket
  all-reduced as soon as backward has completed it.
- ``kiln_zero2``: ``ZeroOptimizer(stage=2, overlap=True)`` with ``overlap_param_gather``
  (the trainer's defaults): each bucket summed during backward for the rank owning its
  shard (on gloo by all-reduce, cheaper there than its reduce), the shard stepped, then each
  owner's parameters broadcast in 4 MiB chunks that the next forward waits for module by
  module (gloo's all-gather costs about 4.7x as much as the broadcasts); the full gradient
  freed between steps.

The kiln methods follow the trainer's per-step order (``kiln/train/loop.py``): forward,
backward inside ``sync_gradients(optimizer, last=True)``, ``all_reduce_gradients`` (for a
``ZeroOptimizer`` its ``reduce_gradients``: waiting for the buckets), step, zero_grad; DDP's
reducer reduces inside backward, so its step is forward, backward, step, zero_grad. A
1-process run of ``kiln_sync`` on the whole global batch is the baseline of scaling. Every
process has one intra-op thread (``kiln.launch.testing.run_distributed``); per model:
warm-up steps, timed steps, then profiled steps under ``torch.profiler`` (CPU activities).

Columns, per model and method:

- samples/s = global batch x timed steps / wall time between two barriers (rank 0's clock);
- vs DDP: samples/s over ``torch_ddp``'s; efficiency: samples/s over 2 x the 1-process run's
  (1.0 is perfect scaling);
- comm ms/step: over the profiled steps, the union of the time intervals of every
  communication event on any thread (``kiln.bench._profile.COMM_PREFIXES``: on gloo the
  ``c10d::*`` op on the calling thread and its ``gloo:*`` execution on gloo's worker thread,
  waits for the peer included), per step; the slower rank's;
- hidden: the share of that communication time that runs while the model computes,
  ``|comm ∩ compute| / |comm|``. Compute is backward, the interval from the start of
  ``loss.backward()`` (a ``record_function("backward")``) to the end of autograd's last node
  (``autograd::engine::evaluate_function: ...``), and the forward's operators: the ``aten::``
  events of the calling thread inside a ``record_function("forward")``, not the time it
  waits there (ZeRO-2's waits for parameters, DDP's broadcast of buffers). DDP's wait for
  its last bucket (and its copies from the buckets into ``.grad``) sit inside
  ``loss.backward()`` but after the last node, so they count as exposed, as kiln's wait in
  ``reduce_gradients`` does. Both ranks' hidden time over both ranks' communication time;
- exposed ms/step: comm ms x (1 - hidden), the communication left outside compute;
- ZeRO-2 / stage 0: ``kiln_zero2``'s samples/s over ``kiln_overlap``'s (goal: at least 0.95).

Every number is the median over ``ROUNDS`` rounds; the 1- and 2-process runs alternate, and
the methods' order rotates from round to round, so that drift on a shared machine hits all
alike. The ratios between methods (vs DDP, ZeRO-2 / stage 0) are medians of the ratios within
each round, whose methods ran back to back in the same two processes: a slower round (the
machine busier for a minute) moves both sides of its ratio. On 2 cores, gloo's worker thread
competes with the other rank's compute for a core:
communication "overlapped" with backward still takes cycles from it, so a high hidden share
buys less here than on NCCL, where the same buckets run on the GPU's copy engines and network
while the CPU and SMs compute. The JSON holds every round, the seconds per communication
event name, the classes each method really ran and each method's losses (the methods train
the same thing: the same losses to float32 rounding).

``--device cuda`` runs the same methods on two GPUs over NCCL (rank r on GPU r; one CPU
thread each), every step timed to the end of its kernels. There communication runs on the
GPU's streams, which a CPU profile does not see: the comm, hidden and exposed columns are left
empty, and samples/s, vs DDP and efficiency are measured as on the CPU.

    kiln bench ddp            # or: kiln bench ddp --quick
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from torch import nn

from kiln._profiling import profiled
from kiln.bench._harness import Bars, Col, Result, Table, benchmark, median, paired, sync
from kiln.bench._profile import comm_spans, intersection_seconds, span, union_seconds
from kiln.data import build_dataset
from kiln.launch.testing import run_distributed
from kiln.models import create_model
from kiln.optim import KilnOptimizer
from kiln.parallel import ZeroOptimizer, all_reduce_gradients, broadcast_parameters, sync_gradients


# Shape legend: B batch (per rank), T sequence length, C width, V vocabulary.

VIT = dict(name="vit", image_size=8, patch_size=2, dim=64, depth=4, heads=4, pool="mean")  # configs/digits_vit.py
GPT = dict(vocab=256, seq_len=64, dim=128, depth=4, heads=4)  # 0.87 M parameters
GPT_LARGE = dict(vocab=256, seq_len=64, dim=512, depth=8, heads=8)  # 25.5 M parameters: 100 MB of gradient
MODELS = {"vit": VIT, "gpt": GPT, "gpt_large": GPT_LARGE}
# global batch per optimizer step; the large GPT's is small so that its 100 MB all-reduce is a
# large part of a step (B=2 x T=64 tokens per rank)
BATCH = {"vit": 64, "gpt": 32, "gpt_large": 4}
# (warm-up, timed, profiled) steps per model
STEPS = {"vit": (5, 40, 3), "gpt": (5, 30, 3), "gpt_large": (2, 8, 2)}  # a full run: about 5 minutes on 2 cores
ROUNDS = 3
QUICK_MODELS = {"gpt_large": dict(GPT_LARGE, dim=64, depth=2, heads=4)}  # the others are tiny already
QUICK_STEPS, QUICK_ROUNDS = (1, 2, 1), 1
METHODS = ("torch_ddp", "kiln_sync", "kiln_overlap", "kiln_zero2")
BASELINE = "kiln_sync"  # the method the 1-process run uses
LR, WEIGHT_DECAY = 1e-3, 0.05  # both optimizers; betas and eps at their (equal) defaults


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


def model_config(name: str, quick: bool) -> dict[str, Any]:
    return QUICK_MODELS.get(name, MODELS[name]) if quick else MODELS[name]


def build_model(name: str, quick: bool = False) -> nn.Module:
    """Model ``name`` (on the current default device: ``torch.device("meta")`` counts parameters
    without allocating them)."""
    cfg = model_config(name, quick)
    if name == "vit":
        return create_model(**cfg)
    return TinyGPT(**cfg)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B*T, V), (B*T,)


def _setup(name: str, quick: bool, device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any]:
    """Model (the same initial weights on every rank and for every method), the train
    inputs/targets, and the loss, on ``device``."""

    torch.manual_seed(0)
    model = build_model(name, quick).to(device)
    if name == "vit":
        inputs, targets = build_dataset("digits", seed=0).train.tensors
        return model, inputs.to(device), targets.to(device), nn.functional.cross_entropy
    cfg = model_config(name, quick)
    splits = build_dataset("synthetic_tokens", seed=0, seq_len=cfg["seq_len"], vocab_size=cfg["vocab"])
    inputs, targets = splits.train.tensors
    return model, inputs.to(device), targets.to(device), _lm_loss


def _wrap(method: str, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The module to call and the optimizer to step, as ``method`` trains."""
    import kiln.optim as ko

    if method == "torch_ddp":
        on_gpu = next(model.parameters()).is_cuda
        # broadcasts rank 0's weights itself
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if on_gpu else None)
        return ddp, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    opt = ko.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    broadcast_parameters(model)
    if method == "kiln_sync":
        return model, opt
    zero = ZeroOptimizer(opt, stage=2 if method == "kiln_zero2" else 0, overlap=True)
    zero.overlap_param_gather(model)  # (nothing to gather at stage 0)
    return model, zero


def _classes(net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What a method really ran, for the JSON (and the test that reads it)."""

    def name(obj: Any) -> str:
        return f"{type(obj).__module__}.{type(obj).__qualname__}"

    zero = opt if isinstance(opt, ZeroOptimizer) else None
    inner = zero.optimizer if zero is not None else opt
    return {"module": name(net), "optimizer": name(opt), "inner_optimizer": name(inner),
            "fused": inner.defaults.get("fused"), "stage": zero.stage if zero is not None else None}


# -- one method on one rank -------------------------------------------------------------------------
def _worker(rank: int, world: int, names: tuple[str, ...], methods: tuple[str, ...], quick: bool,
            device: str = "cpu") -> dict[str, Any]:
    # one process group for every model and method: starting processes costs more than a quick run
    out: dict[str, Any] = {}
    for name in names:
        out[name] = {}
        for method in methods:
            out[name][method] = _train(rank, world, name, method, quick, device)
            gc.collect()  # the last method's model, gradients and state, before the next one is built
    return out


def _train(rank: int, world: int, name: str, method: str, quick: bool, device: str = "cpu") -> dict[str, Any]:
    import torch.distributed as dist
    from torch.profiler import record_function

    warmup, steps, n_profiled = QUICK_STEPS if quick else STEPS[name]
    on = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    model, inputs, targets, loss_fn = _setup(name, quick, on)
    n_params = sum(p.numel() for p in model.parameters())
    net, opt = _wrap(method, model)
    global_batch = BATCH[name]
    local = global_batch // world
    n = len(inputs) // global_batch
    losses: list[torch.Tensor] = []

    def step(i: int) -> None:
        lo = (i % n) * global_batch + rank * local  # this rank's slice of the global batch
        with record_function("forward"):
            loss = loss_fn(net(inputs[lo:lo + local]), targets[lo:lo + local])
        # sync_gradients: with a ZeroOptimizer(overlap=True), buckets are reduced during this backward
        with sync_gradients(opt, last=True), record_function("backward"):
            loss.backward()
        if method != "torch_ddp":  # DDP's reducer has averaged the gradients inside backward
            all_reduce_gradients(opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())

    # ZeRO-2's parameter exchange runs into the next forward: the last one is waited for inside
    # the timed (and the profiled) steps, and none is in flight when they start
    done = opt.wait_parameters if isinstance(opt, KilnOptimizer) else lambda: None
    for i in range(warmup):
        step(i)
    done()
    sync()  # (on a GPU: the queued kernels too)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    done()
    sync()
    dist.barrier()  # the step ends when the slower rank is done
    wall = time.perf_counter() - t0

    comm = {}
    if world > 1 and device == "cpu":  # NCCL's work is on the GPU's streams, out of a CPU profile's sight
        with profiled() as prof:
            for i in range(warmup + steps, warmup + steps + n_profiled):
                step(i)
            done()
        dist.barrier()
        comm = _comm(prof, n_profiled)
    return {"wall_s": wall, "n_params": n_params, "steps": steps, "classes": _classes(net, opt),
            "losses": torch.stack(losses).tolist(), **comm}


def _comm(prof: Any, steps: int) -> dict[str, Any]:
    """This rank's communication per profiled step, and how much of it ran while forward or
    backward computed."""

    events = prof.events()
    comm, by_name = comm_spans(prof)
    backward = [span(e) for e in events if e.name == "backward"]
    nodes = [span(e) for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    # each backward's compute: from its start to the end of the last autograd node inside it
    windows = [(a, max((e for s, e in nodes if a <= s <= b), default=a)) for a, b in backward]
    # each forward's compute: its thread's operators (not its waits for communication)
    ops = [(e.thread, span(e)) for e in events if e.name.startswith("aten::")]
    forward = [(e.thread, *span(e)) for e in events if e.name == "forward"]
    ops = [(s, e) for thread, (s, e) in ops if any(t == thread and a <= s and e <= b for t, a, b in forward)]
    return {"comm_ms_per_step": union_seconds(comm) / steps * 1e3,
            "hidden_comm_ms_per_step": intersection_seconds(comm, windows + ops) / steps * 1e3,
            "backward_ms_per_step": sum(b - a for a, b in windows) / steps * 1e3,
            "comm_ms_by_event": {k: v / steps * 1e3 for k, v in sorted(by_name.items())}}


# -- rows, table, chart -------------------------------------------------------------------------------
def _measure(names: tuple[str, ...], quick: bool, rounds: int, device: str = "cpu") -> list[dict[str, Any]]:
    backend = "nccl" if device == "cuda" else "gloo"
    one: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    two: dict[str, dict[str, list[dict[str, Any]]]] = {name: {m: [] for m in METHODS} for name in names}
    for r in range(rounds):
        # alternate 1 and 2 processes, and rotate the methods, so drift on the machine hits all alike
        for name, res in run_distributed(_worker, 1, names, (BASELINE,), quick, device, threads=1,
                                         backend=backend)[0].items():
            one[name].append(_per_round(name, [res[BASELINE]]))
        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
        ranks = run_distributed(_worker, 2, names, order, quick, device, threads=1, backend=backend)
        for name in names:
            for m in METHODS:
                two[name][m].append(_per_round(name, [rk[name][m] for rk in ranks]))
    return [_row(name, one[name], two[name]) for name in names]


def _per_round(name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One round of one method on one model, from its ranks' results."""
    r0 = ranks[0]
    out = {"samples_per_s": BATCH[name] * r0["steps"] / r0["wall_s"], "n_params": r0["n_params"],
           "steps": r0["steps"], "classes": r0["classes"], "losses": r0["losses"]}
    if "comm_ms_per_step" in r0:
        comm = [r["comm_ms_per_step"] for r in ranks]
        hidden = [r["hidden_comm_ms_per_step"] for r in ranks]
        out.update(comm_ms_per_step=max(comm), hidden_share=sum(hidden) / sum(comm) if sum(comm) else 0.0,
                   backward_ms_per_step=max(r["backward_ms_per_step"] for r in ranks),
                   comm_ms_by_rank=comm, hidden_comm_ms_by_rank=hidden,
                   comm_ms_by_event=r0["comm_ms_by_event"])
    return out


def _row(name: str, one: list[dict[str, Any]], two: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    batch = BATCH[name]
    base = median(r["samples_per_s"] for r in one)
    methods = {}
    for m, runs in two.items():
        # (no comm figures on a GPU: see the module docstring)
        sps, comm, hidden, backward = (median(r[k] for r in runs) if k in runs[0] else None for k in
                                       ("samples_per_s", "comm_ms_per_step", "hidden_share", "backward_ms_per_step"))
        methods[m] = {
            "samples_per_s": sps, "step_ms": batch / sps * 1e3,
            "speedup": sps / base, "efficiency": sps / (2 * base),
            "comm_ms_per_step": comm, "hidden_share": hidden,
            "exposed_comm_ms_per_step": None if comm is None else comm * (1 - hidden),
            "backward_ms_per_step": backward, "vs_torch_ddp": paired(runs, two["torch_ddp"], "samples_per_s")[0],
            "classes": runs[0]["classes"], "losses": runs[0]["losses"], "rounds": runs,
        }
    zero2, by_round = paired(two["kiln_zero2"], two["kiln_overlap"], "samples_per_s")
    return {"model": name, "n_params": one[0]["n_params"], "global_batch": batch, "steps": one[0]["steps"],
            "samples_per_s_1": base, "step_ms_1": batch / base * 1e3, "losses_1": one[0]["losses"],
            "rounds_1": one, "methods": methods, "zero2_vs_overlap": zero2, "zero2_vs_overlap_by_round": by_round}


def measure(quick: bool = False, device: str = "cpu") -> Result:
    rounds = QUICK_ROUNDS if quick else ROUNDS
    rows = _measure(tuple(MODELS), quick, rounds, device)
    where = "2 GPUs on NCCL" if device == "cuda" else "2 processes x 1 thread on gloo"
    lines = []  # the table's: a model's 1-process run, then its methods
    for r in rows:
        model = {"model": r["model"], "params": f"{r['n_params'] / 1e6:.2f}M", "batch": r["global_batch"]}
        lines.append({**model, "method": "1 process", "samples_per_s": r["samples_per_s_1"], "step_ms": r["step_ms_1"]})
        lines += [{**model, "method": name, **m} for name, m in r["methods"].items()]
    get = lambda key: lambda line: line.get(key)  # noqa: E731 (the 1-process line has no comm)
    cols = [Col("model", "model", group=True), Col("params", "params", group=True),
            Col("batch", "batch", group=True), Col("method", "method"), Col("samples/s", "samples_per_s", ".1f"),
            Col("vs DDP", get("vs_torch_ddp"), ".2f"), Col("effic.", get("efficiency"), ".2f"),
            Col("step ms", "step_ms", ".1f"), Col("comm ms", get("comm_ms_per_step"), ".1f"),
            Col("hidden", get("hidden_share"), ".0%"), Col("exposed ms", get("exposed_comm_ms_per_step"), ".1f")]
    notes = [f"{r['model']}: ZeRO-2 / stage 0 = {r['zero2_vs_overlap']:.2f} (goal >= 0.95)" for r in rows]
    chart = [Bars(f"{r['model']} ({r['n_params'] / 1e6:.1f} M params, batch {r['global_batch']})",
                  [{"method": m, **v} for m, v in r["methods"].items()], "method", {"samples/s": "samples_per_s"},
                  f"samples/s, {where}", color=lambda _: "C1",
                  lines={"perfect scaling of 1 process": 2 * r["samples_per_s_1"], "1 process": r["samples_per_s_1"]})
             for r in rows]
    report = {"setup": {"processes": [1, 2], "threads_per_process": 1, "device": device,
                        "backend": "nccl" if device == "cuda" else "gloo", "methods": list(METHODS),
                        "baseline_1_process": BASELINE, "lr": LR, "weight_decay": WEIGHT_DECAY, "rounds": rounds,
                        "steps": {name: dict(zip(("warmup", "timed", "profiled"),
                                                 QUICK_STEPS if quick else STEPS[name])) for name in MODELS},
                        "batch": BATCH, "models": {name: model_config(name, quick) for name in MODELS}},
              "rows": rows}
    return Result(report, [Table(lines, cols)], f"data parallel, {where}, torch DDP against kiln", chart, notes=notes,
                  threads=1, processes=2)


run = benchmark("ddp", measure)
