"""``kiln plan CONFIG``: what a config will build, and the peak memory of each rank's training
step, before spending any compute on it.

The model is built on the ``meta`` device (shapes only, no memory) for its counts. The memory
of a step is not computed from a formula: :func:`plan` builds each distinct rank of the
``dp x tp x pp`` layout through kiln train's own set-up stages (``kiln.train.parts.STAGES``:
the data, the model, its layout with activation checkpointing, pipeline stages, tensor
parallel and FSDP2, the optimizer's arena, master weights and ZeRO, the step context) and runs
two training steps (:func:`kiln.train.loop.train_step`) on fake tensors (``FakeTensorMode``: shapes, dtypes and storages, no memory) with a fake process
group (torch's ``fake`` backend: collectives do nothing). :class:`kiln.plan._memtrace.StorageTracker`
follows every storage and reports the second (steady) step's peak of live bytes by category;
``torch.utils.flop_counter`` counts its FLOPs. What is predicted is the code that runs, so a
feature is planned the day it lands, and the trace is a dry run: a layout, shape or config
error at 64 ranks shows up here, on one CPU, in seconds.

    >>> from kiln.config import load_config
    >>> p = plan(load_config("configs/gpt_tiny.py", ["train.precision=fp32"]), world=2)
    >>> p.fullest_rank, p.ranks[0].peak_bytes > p.ranks[0].parameters
    (0, True)

Ranks with the same pipeline stage hold the same shapes (data-parallel replicas and
tensor-parallel shards are equal), so one rank per stage is traced and stands for the others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kiln.config import DataConfig, parse_size
from kiln.errors import ConfigError, KilnWarning
from kiln.hardware import machine_line
from kiln.hf import deferred_weights, materialize, meta_parameters
from kiln.optim import KilnOptimizer, OPTIMIZERS, norms_as_row_views
from kiln.parallel import check_parallel_config
from kiln.plan._memtrace import StorageTracker
from kiln.precision import Precision, emulation_note, resolve
from kiln.precision.fp8 import fp8_memory, fp8_skips
from kiln.train import check_model
from kiln.train.parts import (
    Batches, Place, Step, build_data, build_model, lay_out, load_data, make_model, make_optimizer, step_context,
    train_step,
)


__all__ = ["CATEGORIES", "Plan", "PlanUnavailable", "RankPlan", "check_fits", "describe", "fit_problem",
           "machine_budget", "parse_size", "plan", "run_budget", "runtime_reserve"]


def _state_tensors(optim_cfg: Any) -> int:
    """Parameter-sized optimizer state tensors per parameter, as the optimizer class declares
    them for these options (SGD without momentum keeps none, AdamW two, amsgrad three)."""

    cls = OPTIMIZERS[optim_cfg.name]
    return len(cls.state_names_for(**{k: optim_cfg[k] for k in cls.config_options}))


def _data_line(dc: Any) -> str:
    """A registered data set and its arguments, or the config's data._target_ and its own."""
    if "_target_" in dc:
        args = {k: v for k, v in dc.items() if k not in DataConfig.loader_keys() and k != "_target_"}
        return f"{dc._target_}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
    files = "".join(f" {key}={dc[key]}" for key in ("path", "val_path") if dc.get(key) is not None)
    return f"{dc.name}{files} {dict(dc.args) or ''}".rstrip()


def _mb(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:,.1f} MB"


def _precision_lines(tc: Any) -> list[str]:
    """This machine (what its CPU computes natively) and the precision the config trains in here."""

    lines = [f"machine     {machine_line()}"]
    if tc.device == "cuda" and not torch.cuda.is_available():
        return lines + [f"precision   {tc.precision} (train.device=cuda: resolved on the GPU that trains)"]
    device = torch.device("cuda" if tc.device != "cpu" and torch.cuda.is_available() else "cpu")
    mode = resolve(tc.precision, device)
    if tc.precision == "auto":
        why = "bf16 is native here" if mode == "bf16-mixed" else "bf16 would be emulated here"
        return lines + [f"precision   auto: {mode} on {device.type} ({why})"]
    # the note itself is the run's warning (kiln: warning: ...), said once: not again here
    emulated = " (emulated here: slower than fp32)" if emulation_note(mode, device) is not None else ""
    return lines + [f"precision   {mode} on {device.type}{emulated}"]


def _fp8_lines(cfg: Any, model: torch.nn.Module) -> list[str]:
    """train.precision=fp8: which linears compute in float8, and the memory of their casts
    (:func:`kiln.precision.fp8.fp8_memory`, at a micro-batch's tokens where the data says its
    sequence length). A traced plan on a CUDA torch holds them in its step peak as they run."""
    if cfg.train.precision != "fp8":
        return []

    skipped = fp8_skips(model)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    kept = "; ".join(f"{name}: {why}" for name, why in skipped.items())
    lines = [f"fp8         {linears - len(skipped)} of {linears} linear layers in float8 (rowwise)"
             + (f", in bf16: {kept}" if kept else "")]
    seq_len = cfg.data.get("args", {}).get("seq_len") or cfg.model.get("seq_len")
    if seq_len:
        tokens = cfg.data.batch_size // cfg.train.accumulate * seq_len
        mem = fp8_memory(model, tokens)
        lines.append(f"            float8 casts and scales {_mb(mem.casts)} at most at once ({mem.layer}'s backward, "
                     f"{tokens:,} tokens), none between steps; the bf16 weight copies bf16-mixed keeps for "
                     f"backward, {_mb(mem.saved)}, are not made")
    return lines


def describe(cfg: Any, world: int | None = None, planned: "Plan | None" = None) -> str:
    """What ``cfg`` builds; ``world``: the number of processes (default: the layout's dp x tp x
    pp); ``planned``: its :func:`plan`, shown rank by rank."""

    check_parallel_config(cfg)  # the layout's needs from the model, as kiln train checks them

    with torch.device("meta"):
        model = build_model(cfg.model)
    check_model(cfg, model)  # the errors kiln train would give, before it builds anything
    params = [p for p in model.parameters()]
    n_total = sum(p.numel() for p in params)
    n_train = sum(p.numel() for p in params if p.requires_grad)
    n_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    state = _state_tensors(cfg.optim)
    state_bytes = state * grad_bytes
    tc, dc = cfg.train, cfg.data
    micro = dc.batch_size // tc.accumulate
    model_name = cfg.model.get("name") or cfg.model.get("_target_")
    lines = [
        f"model       {model_name}: {n_total:,} parameters ({n_train:,} trainable), "
        f"{len(params)} tensors",
        f"memory      parameters {_mb(n_bytes)} + gradients {_mb(grad_bytes)} + "
        f"{cfg.optim.name} state {_mb(state_bytes)} = {_mb(n_bytes + grad_bytes + state_bytes)} (the whole model"
        + ("; each rank's step below)" if planned is not None else ")"),
        f"batch       {dc.batch_size} samples per step = {tc.accumulate} micro-batch(es) of {micro}",
        f"optimizer   {cfg.optim.name} lr {cfg.optim.lr:g}, schedule {cfg.optim.schedule}, "
        f"contiguous arena {'on' if cfg.optim.contiguous else 'off'}",
        f"data        {_data_line(dc)}",
        "length      " + (f"{tc.max_steps} steps" if tc.max_steps is not None else f"{tc.epochs} epochs"),
        *_precision_lines(tc),
        *_fp8_lines(cfg, model),
    ]
    if planned is not None:
        lines += _plan_lines(cfg, planned)
    return "\n".join(lines)


def _plan_lines(cfg: Any, planned: "Plan") -> list[str]:
    """The layout, the fullest rank's memory between steps, and each distinct rank's step peak
    by category, in MB, one row per group of ranks that hold the same."""
    layout, par = planned.layout, cfg.parallel
    full = planned.ranks[planned.fullest_rank]
    held = full.between_steps
    kept = [held.get(c, 0) for c in ("parameters", "gradients", "optimizer_state")]
    lines = [
        f"layout      {layout} = {layout.world} process(es), zero={par.zero}"
        + (f", {par.pp_schedule} over {par.microbatches or 2 * layout.pp} micro-batches" if layout.pp > 1 else ""),
        f"per rank    parameters {_mb(kept[0])} + gradients {_mb(kept[1])} + {cfg.optim.name} state {_mb(kept[2])} = "
        f"{_mb(sum(kept))} between steps on the fullest rank"
        + (f" (fp32 masters {_mb(full.fp32_masters)} in the state)" if full.fp32_masters else ""),
        f"step peak   a steady step traced on fake tensors ({planned.precision}), in {planned.seconds:.1f} s; MB:",
    ]
    heads = ("peak", "params", "grads", "optim", "activ", "temp", "comm")
    groups: dict[int, list[int]] = {}
    for r in planned.ranks:
        groups.setdefault(r.traced_as, []).append(r.rank)
    rows = []
    for traced, members in groups.items():
        r = planned.ranks[traced]
        rows.append((_ranges(members), [r.peak_bytes, *(getattr(r, c) for c in CATEGORIES)]))
    width = max(7, *(len(name) for name, _ in rows))
    lines.append("  " + "ranks".ljust(width) + "".join(h.rjust(10) for h in heads))
    lines += ["  " + name.ljust(width) + "".join(f"{v / 2**20:10,.1f}" for v in values) for name, values in rows]
    lines.append(f"fullest     rank {full.rank}: {_mb(full.peak_bytes)} peak; "
                 f"{_flops(planned.flops_per_step)} per step over all ranks")
    if planned.reserve_bytes:
        lines.append(f"reserved    {_mb(planned.reserve_bytes)} a process beside the step's tensors "
                     f"(cuBLAS's workspaces): {_mb(planned.needs_bytes)} needed on the fullest rank")
    return lines


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, [*ranks[1:], None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ",".join(out)


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


# --------------------------------------------------------------------------- the traced plan

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporary", "communication")


@dataclass
class RankPlan:
    """One rank's step, in bytes: ``peak_bytes`` is the highest live tensor memory of a steady
    step (the second), split into :data:`CATEGORIES` as it stands at that moment. The fp32
    master weights of bf16-true count in ``optimizer_state`` (``fp32_masters`` says how
    much); their fp32 gradient in ``gradients``. ``between_steps``: the bytes live between
    steps, by category (the model states: parameters, gradients, optimizer state)."""

    rank: int
    coords: dict[str, int]
    peak_bytes: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    temporary: int
    communication: int
    fp32_masters: int
    between_steps: dict[str, int]
    flops: int  # this rank's FLOPs in the step (recomputation under checkpointing included)
    traced_as: int  # the rank whose trace this is (itself, or one of the same stage)
    ops: int = 0  # operators this rank dispatches in the step
    collectives: int = 0  # collectives it calls in the step, and the bytes it hands them
    collective_bytes: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "peak_bytes": self.peak_bytes, **{c: getattr(self, c) for c in CATEGORIES},
                "fp32_masters": self.fp32_masters, "between_steps": self.between_steps, "flops": self.flops,
                "coords": self.coords, "traced_as": self.traced_as, "ops": self.ops,
                "collectives": self.collectives, "collective_bytes": self.collective_bytes}


@dataclass
class Plan:
    """Every rank's step (``ranks``, rank order) in one layout; see :func:`plan`."""

    layout: Any
    precision: str
    ranks: list[RankPlan]
    seconds: float  # the time the traces took
    device: str = "cpu"  # the device type the run trains on

    @property
    def reserve_bytes(self) -> int:
        """What each process holds on the device beside the step's tensors (see :func:`runtime_reserve`)."""
        return runtime_reserve(self.device)

    @property
    def needs_bytes(self) -> int:
        """The memory the fullest process needs: its step's peak and the :attr:`reserve_bytes`."""
        return self.peak_bytes + self.reserve_bytes

    @property
    def fullest_rank(self) -> int:
        return max(self.ranks, key=lambda r: (r.peak_bytes, -r.rank)).rank

    @property
    def peak_bytes(self) -> int:
        return max(r.peak_bytes for r in self.ranks)

    @property
    def flops_per_step(self) -> int:
        """FLOPs of one optimizer step over all ranks (what runs: recomputation included)."""
        return sum(r.flops for r in self.ranks)

    def as_json(self) -> dict[str, Any]:
        layout = self.layout
        return {"ranks": [r.as_json() for r in self.ranks], "fullest_rank": self.fullest_rank,
                "peak_bytes": self.peak_bytes, "reserve_bytes": self.reserve_bytes,
                "flops_per_step": self.flops_per_step,
                "layout": layout.as_json(), "world": layout.world,
                "precision": self.precision, "device": self.device, "trace_seconds": round(self.seconds, 3)}


def plan(cfg: Any, world: int | None = None, *, device: str | torch.device | None = None) -> Plan:
    """The peak memory of a steady training step of ``cfg`` (a validated config) on each of
    ``world`` processes (default: the layout's dp x tp x pp), and its FLOPs, by tracing kiln's
    own set-up and step on fake tensors (see the module's docstring). Allocates no model
    memory; call it for many candidate configs in one process. ``device``: what the run
    trains on (default: ``train.device``'s choice here). Raises ``ConfigError`` for a config
    that kiln train would refuse, and the step's own error (a shape mismatch) as the run would
    raise it. Needs no process group, and refuses to run inside one."""
    import time

    import torch.distributed as dist

    started = time.perf_counter()
    pc = cfg.parallel
    if world is None:
        world = (pc.dp or 1) * pc.tp * pc.pp
    layout = check_parallel_config(cfg, world)
    if world > 1 and dist.is_available() and dist.is_initialized():
        raise RuntimeError("kiln.plan.plan traces each rank with a fake process group: call it outside "
                           "torch.distributed (before init_process_group), e.g. on rank 0 before training")
    device = torch.device(device) if device is not None else plan_device(cfg.train.device)
    if device.type == "cuda" and not torch.backends.cuda.is_built():
        raise ConfigError(f"kiln plan of a run on CUDA traces its step on fake CUDA tensors, which needs a CUDA "
                          f"build of torch (this is {torch.__version__}): plan it where torch has CUDA (a GPU need "
                          "not be present), or plan train.device=cpu here")
    # one rank per pipeline stage, in stage order (the pipeline's shapes flow from stage to stage)
    stage_ranks = {}
    for rank in range(world):
        stage_ranks.setdefault(layout.coords(rank)["pp"], rank)
    mailbox: dict[Any, Any] = {}
    traced: dict[int, tuple[RankPlan, str]] = {}
    waiting = sorted(stage_ranks.values())
    while waiting:  # an interleaved or V stage waits for the shapes of a later rank's stage
        deferred, known = [], len(mailbox)
        for rank in waiting:
            try:
                traced[rank] = _trace_rank(cfg, layout, rank, device, mailbox)
            except _NeedsShapes:
                deferred.append(rank)
            except (ConfigError, KilnWarning):  # (a warning a filter made an error: -W error)
                raise
            except Exception as exc:  # noqa: BLE001  (what the run would raise, in one line)
                raise _trace_error(exc, rank, layout) from exc
        # (a round in which only shapes moved is progress: with two stages a rank, rank 0 waits
        # for rank 1's first stage, which waits for rank 0's second, and each try sends what it can)
        if deferred == waiting and len(mailbox) == known:
            raise RuntimeError(f"kiln plan: the pipeline stages of ranks {deferred} wait for each other's shapes")
        waiting = deferred
    ranks = []
    for rank in range(world):
        source, mode = traced[stage_ranks[layout.coords(rank)["pp"]]]
        ranks.append(RankPlan(**{**source.__dict__, "rank": rank, "coords": layout.coords(rank),
                                 "traced_as": source.rank}))
    return Plan(layout=layout, precision=mode, ranks=ranks, seconds=time.perf_counter() - started, device=device.type)


def plan_device(name: str) -> torch.device:
    """The device a run of ``train.device=name`` trains on, as kiln plan traces it."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")  # fake CUDA tensors need no GPU
    return torch.device(name if name != "auto" else "cpu")


_DATA: dict[str, Any] = {}  # the loaders of the last few configs planned (tune plans many alike)


def _cached_data(data_cfg: Any, *, seed: int, accumulate: int, device: torch.device, rank: int,
                 world_size: int) -> Any:
    """``build_data``'s loaders, built once for the configs that share them (a data set may
    take seconds to make): what the data stage (``load_data``) builds with in a dry run."""

    key = f"{data_cfg!r}|{seed}|{accumulate}|{device}|{rank}|{world_size}"
    if key not in _DATA:
        if len(_DATA) >= 4:
            del _DATA[next(iter(_DATA))]
        _DATA[key] = build_data(data_cfg, seed=seed, accumulate=accumulate, device=device, rank=rank,
                                world_size=world_size)
    return _DATA[key]


@contextlib.contextmanager
def _unpacked_as_run(step: Any) -> Iterator[None]:
    """transformers' masks as the run builds them. A Hugging Face model given neither a mask nor
    a cache (a cached model under activation checkpointing runs without its cache) reads the
    position ids it made itself, an ``arange``, to find sequences packed into one row; it cannot
    read a fake tensor's values and takes it for packed. It then builds a mask, and the trace
    planned attention over that mask and repeated key/value heads where the run takes SDPA's
    causal path with grouped-query heads: +4% of the tiny Llama's step with checkpointing on
    CPU, -5% on CUDA (another kernel). Where the batch gives no ``position_ids``, the answer
    is known, nothing is packed, and the trace is given it."""
    import sys
    from collections.abc import Mapping

    masking = sys.modules.get("transformers.masking_utils")  # (imported by a transformers model)
    given = any(isinstance(b, Mapping) and "position_ids" in b for b in step.micro)
    if masking is None or given or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    real = masking.find_packed_sequence_indices

    def as_run(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if hasattr(position_ids, "fake_mode") else real(position_ids)

    masking.find_packed_sequence_indices = as_run
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = real


class PlanUnavailable(RuntimeError):
    """The step cannot be traced on fake tensors (the model reads its tensors' values, or uses
    an operator without a fake kernel); nothing is wrong with the config."""


def _trace_error(exc: BaseException, rank: int, layout: Any) -> Exception:
    """What a failed trace means: a config error that kiln train would meet too (a shape that
    does not fit, a layout a module refuses), or :class:`PlanUnavailable`."""
    from torch._subclasses import fake_tensor

    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    limits = (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
              fake_tensor.UnsupportedOperatorException, fake_tensor.UnsupportedFakeTensorException)
    if isinstance(exc, limits):
        return PlanUnavailable(f"the step cannot be traced on fake tensors ({type(exc).__name__}: {first}); "
                               "its memory is known only by running it")
    where = f"rank {rank} ({', '.join(f'{k}={v}' for k, v in layout.coords(rank).items())})" \
        if layout.world > 1 else "the step"
    return ConfigError(f"the dry run of {where} failed as kiln train would: {type(exc).__name__}: {first}")


class _NeedsShapes(Exception):
    """A pipeline stage's input shapes come from a stage not traced yet."""


def _trace_rank(cfg: Any, layout: Any, rank: int, device: torch.device,
                mailbox: dict[Any, Any]) -> tuple[RankPlan, str]:
    """Build ``rank`` through kiln train's own stages (:func:`kiln.train.parts.setup`'s), on fake
    tensors with a fake process group, run two steps, and read the second one's peak. The dry
    run adds its fake tensors and its tracker, and calls none of the stages that have no
    meaning in it: joining a real process group, measuring train.precision=auto's speed,
    restoring a checkpoint, the run directory and its loggers (and compile: the eager step is
    traced)."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    tc = cfg.train
    with _fake_group(rank, layout.world), warnings.catch_warnings(), _collecting_only_new_objects():
        # kiln's arena guard reads data_ptr(), which a fake tensor answers with 0, warning
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")
        place = Place(rank, layout.world, layout, device)
        precision = Precision(tc.precision, device)
        data, total_steps = load_data(cfg, place, build=_cached_data)
        step = next(Batches(data.train, tc.accumulate, cfg.data.batch_size))  # the run's first step
        built = make_model(cfg, place, precision, data, dry=True)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        tracker = StorageTracker(fake)
        with fake, tracker, tracker.patched():
            _make_fake(built.model, fake, device)
            tracker.follow(list(built.model.parameters()), list(built.model.buffers()))
        with fake, tracker, tracker.patched(), _one_mode():
            par = lay_out(cfg, place, built, precision)  # (built.model is now this rank's part, as in kiln train)
            optimizer = make_optimizer(cfg, place, precision, par)
        dry_pipeline = _dry_pipeline(mailbox) if layout.pp > 1 else contextlib.nullcontext()
        with fake, tracker, tracker.patched(), dry_pipeline, norms_as_row_views(), _unpacked_as_run(step):
            ctx = step_context(cfg, place, precision, built, par, optimizer, total_steps)
            start, end, grads = _two_steps(ctx, step, tracker)
            roles = _roles(tracker, ctx, step, grads)
        peak, live = tracker.peak(start, end)
        base = tracker.peak(start, start)[1]  # what is live as the step starts
        result = RankPlan(
            rank=rank, coords=place.coords, peak_bytes=peak, **_split(live, roles, tracker),
            fp32_masters=sum(b for k, b in live.items() if k in roles["masters"]),
            between_steps={c: v for c, v in _split(base, roles, tracker).items() if v},
            flops=tracker.flops, traced_as=rank, ops=tracker.ops, collectives=tracker.collectives,
            collective_bytes=tracker.collective_bytes)
        return result, precision.mode


@contextlib.contextmanager
def _fake_group(rank: int, world: int) -> Iterator[None]:
    """Inside it, this process is ``rank`` of a process group of ``world`` whose collectives do
    nothing (torch's ``fake`` backend); one process has none."""
    if world == 1:
        yield
        return
    import torch.distributed as dist
    import torch.distributed._tools.fake_collectives  # noqa: F401  (fake kernels of c10d's ops)
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
            _forget_meshes()


def _make_fake(model: Any, fake: Any, device: torch.device) -> None:
    """The model's parameters (on ``meta``) as fake tensors on ``device``, and its buffers
    (computed for real) as fake copies."""

    materialize(model, device)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and not buf.is_meta:
                module._buffers[name] = fake.from_tensor(buf)


def _two_steps(ctx: Any, step: Any, tracker: Any) -> tuple[int, int, set[int]]:
    """The first step (:func:`_first_step`), then the second, traced: the tracker's positions
    where the second starts and ends, and the gradients as autograd produced them."""
    import gc

    ctx.par.model.train()
    grads: set[int] = set()
    hooks = [p.register_post_accumulate_grad_hook(lambda p: grads.update(tracker.follow(p.grad)))
             for p in ctx.par.model.parameters() if p.requires_grad]
    with tracker.saved_for_backward():
        tracker.follow(step.micro)
        _first_step(ctx, step)
        # what reference cycles still hold (a pipeline's first step leaves some) is garbage, not
        # the steady step's: collected, as the real run's collector would
        gc.collect()
        start = tracker.position()
        tracker.count_flops = True
        train_step(ctx, step)
        tracker.count_flops = False
        end = tracker.position()
    for h in hooks:
        h.remove()
    return start, end, grads


@contextlib.contextmanager
def _collecting_only_new_objects() -> Iterator[None]:
    """Inside it, ``gc.collect()`` walks only the objects made inside it: those that existed
    before (the imports and the caller's, up to millions in a test process) are frozen, and
    unfrozen at its end. A trace collects once, after its first step; a full collection of such
    a heap took as long as the rest of a small model's trace (docs/lab/facts.md, 'Host time'). A
    heap frozen already (a rank forked from kiln's fork server) stays as it is: its collections
    walk only its own."""
    import gc

    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions: a ``DeviceMesh`` compares equal to the one
    of the previous trace (same ranks, same names) although its process groups are gone, and a
    cached output spec would hand the next trace that dead mesh."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()


def _first_step(ctx: Any, step: Any) -> None:
    """What the first training step leaves for the steady ones: the optimizer's state (and
    ZeRO's and the precision's), made by a step on zero gradients, which runs the optimizer's
    whole side of train_step without the forward and backward (half the trace's time); with a
    pipeline the whole first step, whose schedule learns the stages' shapes in it."""

    if ctx.par.pipeline is not None:
        train_step(ctx, step)
        return
    params = [p for p in ctx.par.model.parameters() if p.requires_grad]
    # zero gradients through autograd, so that every gradient hook fires as in a backward
    # (kiln's optimizers step only parameters whose gradient is new since the last step)
    torch.autograd.backward(params, [torch.zeros_like(p) for p in params])
    train_step(ctx, Step(epoch=step.epoch, micro=[], samples=step.samples))


def _roles(tracker: Any, ctx: Any, step: Any, grads: set[int]) -> dict[str, set[int]]:
    """The storages of each category, by what holds them after the step (and what the step
    marked: gradients as autograd produced them, saved activations, collective buffers)."""
    follow, optimizer, precision = tracker.follow, ctx.optimizer, ctx.precision
    model = ctx.par.model
    params = set(follow(list(model.parameters()), list(model.buffers())))
    masters = set()
    if precision.masters is not None:
        masters = set(follow([m.param for m, _ in precision.masters.pairs]))
        grads = grads | set(follow([m.grad for m, _ in precision.masters.pairs]))
    grads = grads | set(follow([p.grad for p in model.parameters() if p.grad is not None]))
    state: set[int] = set(masters)
    # (ZeRO's wrapper shares its param_groups and state with the optimizer it wraps)
    for group in optimizer.param_groups:
        for p in group["params"]:
            state.update(k for k in follow(p) if k not in params)  # (bf16-true: fp32 masters)
            if p.grad is not None:
                grads.update(follow(p.grad))
    for st in optimizer.state.values():
        state.update(follow([v for v in st.values() if torch.is_tensor(v)]))
    if isinstance(optimizer, KilnOptimizer):  # the arenas' flat gradients and state, this rank's shards'
        grads.update(follow(optimizer.grad_buffers()))
        state.update(follow(optimizer.state_tensors()))
    return {"parameters": params, "gradients": grads, "optimizer_state": state, "masters": masters,
            "activations": tracker.marks["saved"] | set(follow(step.micro)),
            "communication": tracker.marks["collective"]}


def _split(live: dict[int, int], roles: dict[str, set[int]], tracker: Any) -> dict[str, int]:
    """Bytes of the ``live`` storages (key -> bytes) by category; a storage in several takes
    the first of: parameters, gradients, optimizer state, activations, communication."""
    out = dict.fromkeys(CATEGORIES, 0)
    order = ("parameters", "gradients", "optimizer_state", "activations", "communication")
    for key, nbytes in live.items():
        out[next((c for c in order if key in roles[c]), "temporary")] += nbytes
    return out


@contextlib.contextmanager
def _one_mode() -> Iterator[None]:
    """Copies of fake tensors stay in the trace's mode: ``copy.deepcopy`` (a pipeline stage is
    a deep copy of its part of the model) would copy the ``FakeTensorMode`` with them, and the
    trace's mode would then see the stage's parameters as foreign tensors and convert them,
    a second copy of every parameter each step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    had = "__deepcopy__" in FakeTensorMode.__dict__
    saved = FakeTensorMode.__dict__.get("__deepcopy__")
    FakeTensorMode.__deepcopy__ = lambda self, memo: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            FakeTensorMode.__deepcopy__ = saved  # type: ignore[method-assign]
        else:
            del FakeTensorMode.__deepcopy__


@contextlib.contextmanager
def _dry_pipeline(mailbox: dict[Any, Any]) -> Iterator[None]:
    """torch's pipeline stages learn each other's shapes by exchanging them (a vote, then
    metadata sent stage to stage), which a fake process group cannot carry. In the dry run
    every stage infers its shapes (DYNAMIC mode, as without a fake group), sends them into
    ``mailbox`` and receives those of the stage before it from there, written when that
    stage's rank was traced; the gradients a stage receives have its outputs' shapes."""
    import pickle

    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.pipelining import stage as stage_module

    try:
        from torch.distributed.pipelining._utils import _derive_grad_metas, _StageBackwardMeta
    except ImportError:  # (torch before 2.13: its stages exchange shapes otherwise)

        raise ConfigError(f"kiln plan of a pipeline-parallel layout needs torch 2.13 or later (this is "
                          f"{torch.__version__}): plan it without parallel.pp, or upgrade torch") from None

    cls = stage_module.PipelineStage

    def vote(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        with unset_fake_temporarily():
            return torch.zeros(1, dtype=torch.int32)  # 0: every stage infers its shapes

    def send_meta(self: Any, meta: Any, dst_stage: int) -> None:
        # a copy, as send_object_list pickles it: the object itself keeps this stage's outputs
        # (and their autograd graph) alive
        mailbox[(self.stage_index, dst_stage)] = pickle.loads(pickle.dumps(meta))

    def recv_meta(self: Any, src_stage: int) -> Any:
        if (src_stage, self.stage_index) in mailbox:
            return mailbox[(src_stage, self.stage_index)]
        if src_stage > self.stage_index:  # the gradients of this stage's outputs
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))
        raise _NeedsShapes(src_stage)

    saved = {name: getattr(cls, name) for name in
             ("_warmup_forward_vote", "_warmup_backward_result", "_send_meta", "_recv_meta")}
    cls._warmup_forward_vote = cls._warmup_backward_result = vote
    cls._send_meta, cls._recv_meta = send_meta, recv_meta
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(cls, name, fn)


# --------------------------------------------------------------------------- budgets

# what a CUDA process holds outside the caching allocator: its context and the kernels it has
# loaded (docs/lab/facts.md, 'A CUDA process beside its tensors'); more load as a run uses
# more kernels, so 1 GiB is kept back from the GPU's memory
CUDA_CONTEXT = 2**30
CUBLAS_LT_WORKSPACE = 2**20  # cuBLASLt's own workspace (docs/lab/facts.md, 'A CUDA process beside its tensors')


def cublas_workspace(capability: tuple[int, int], config: str | None = None) -> int:
    """The bytes of one cuBLAS handle's workspace as torch sizes it: ``CUBLAS_WORKSPACE_CONFIG``
    (``:SIZE_KiB:COUNT`` pairs) where set, else 32 MiB on compute capability 9 and later
    (Hopper, Blackwell) and 8 MiB + 128 KiB (``:4096:2:16:8``) before."""
    if config:
        numbers = [int(n) for n in config.split(":") if n.strip()]
        if len(numbers) % 2 == 0 and numbers:
            return sum(size * count for size, count in zip(numbers[::2], numbers[1::2])) * 1024
    return 32 * 2**20 if capability >= (9, 0) else (4096 * 2 + 16 * 8) * 1024


def runtime_reserve(device: torch.device | str) -> int:
    """Bytes a training process holds on ``device`` beside its step's tensors, which the trace
    cannot see: on CUDA, one cuBLAS workspace for each thread that runs matrix products (the
    training loop's and autograd's backward thread, each with its own handle) and cuBLASLt's.
    As measured on an H100 (``kiln bench plan --device cuda``;
    docs/lab/facts.md, 'A CUDA process beside its tensors'). 0 elsewhere.
    Where no GPU is here to ask, compute capability 9 (the larger workspace) is assumed."""
    import os

    if torch.device(device).type != "cuda":
        return 0
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
    return 2 * cublas_workspace(capability, os.environ.get("CUBLAS_WORKSPACE_CONFIG")) + CUBLAS_LT_WORKSPACE


def machine_budget(device: torch.device | str, processes: int) -> int | None:
    """The memory each of ``processes`` local processes can have here: on CPU the memory
    available now (``MemAvailable``) divided among them, on CUDA the GPU's total; None where
    it is not known (a device this machine does not have). On CUDA the GPU's total less
    :data:`CUDA_CONTEXT`, read from the device's properties: asking the driver for its free
    memory (``mem_get_info``) would make a CUDA context here, which kiln train's launcher would
    then hold on GPU 0 for the whole run (docs/lab/facts.md, 'A CUDA process beside its tensors')."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_properties(device.index or 0).total_memory - CUDA_CONTEXT
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib * 1024 // max(1, processes)


def run_budget(tc: Any, device: torch.device, world: int) -> tuple[int | None, str]:
    """``(bytes a process may use, what that budget is)`` for a run of ``world`` local
    processes on ``device``: ``train.memory_budget`` where set, else :func:`machine_budget`
    (None where the device's memory is not known here)."""
    if tc.memory_budget is not None:
        return parse_size(tc.memory_budget), f"train.memory_budget={tc.memory_budget}"
    where = ("the memory available" + (f" shared by {world} processes" if world > 1 else "")
             if device.type == "cpu" else f"the memory of {device.type}")
    return machine_budget(device, world), where


def fit_problem(planned: Plan, budget: int, where: str) -> str | None:
    """None when the fullest rank's peak, with the device's :func:`runtime_reserve`, fits
    ``budget`` bytes; else one line naming the peak and what would bring it under (``where``:
    what the budget is, e.g. "--memory-budget 8GB")."""
    full = planned.ranks[planned.fullest_rank]
    if planned.needs_bytes <= budget:
        return None
    layout = planned.layout
    states = full.parameters + full.gradients + full.optimizer_state
    moves = []
    if full.activations + full.temporary > states:  # the step's own tensors dominate
        moves += ["activation checkpointing (train.activation_checkpointing=full)",
                  "a smaller micro-batch (a larger train.accumulate keeps the global batch)"]
    if layout.dp > 1 and planned.ranks and states > budget / 4:
        moves.append("ZeRO-3 (parallel.zero=3)")
    moves.append(f"more processes (--nproc {2 * layout.world}, with ZeRO or tensor/pipeline parallel)")
    if full.activations + full.temporary <= states:
        moves.append("activation checkpointing or a smaller micro-batch")
    reserve = f" + {_mb(planned.reserve_bytes)} of cuBLAS workspaces" if planned.reserve_bytes else ""
    return (f"the plan's fullest rank {full.rank} peaks at {_mb(full.peak_bytes)} (model states {_mb(states)}, "
            f"activations and temporaries {_mb(full.activations + full.temporary)}){reserve}, over {where} "
            f"({_mb(budget)} a rank); to fit, try {', '.join(moves[:3])}")


# kiln train plans a config before it starts when the model's states alone could take this share
# of a process's memory: below it a plan's seconds would be spent on runs that fit by far (the
# test suite's hundreds of small ones among them); above it the seconds are nothing beside the run
PREFLIGHT_SHARE = 1 / 8


def check_fits(cfg: Any, world: int) -> None:
    """``kiln train``'s check before any process starts or any weight is allocated: a config
    whose plan exceeds the machine (``train.memory_budget`` where set, else the memory available
    to each of the ``world`` local processes, or the GPU's) raises ``ConfigError``, one line
    naming the fullest rank's predicted peak and what would make it fit. Planned only when the
    model's parameters, gradients and optimizer state (counted on the meta device) could take
    :data:`PREFLIGHT_SHARE` of the budget; a model that cannot be built on meta, or traced, is
    left to the run."""

    device = plan_device(cfg.train.device)
    budget, where = run_budget(cfg.train, device, world)
    if budget is None:
        return
    try:
        with deferred_weights(), meta_parameters():
            params = sum(p.numel() for p in build_model(cfg.model).parameters())
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001  (the run builds it for real, and says what is wrong then)
        return
    layout, pc = check_parallel_config(cfg, world), cfg.parallel
    per_rank = params / (layout.tp * layout.pp * (layout.shard if pc.zero == 3 else 1))  # (HSDP: one group's ranks)
    states = per_rank * 4 * (2 + _state_tensors(cfg.optim))  # fp32 weight, gradient, each state tensor
    if states < budget * PREFLIGHT_SHARE:
        return
    try:
        planned = plan(cfg, world, device=device)
    except PlanUnavailable:
        return
    problem = fit_problem(planned, budget, where)
    if problem:
        raise ConfigError(f"{problem} (kiln plan shows the whole plan; train.memory_budget=SIZE sets the budget)")
