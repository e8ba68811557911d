"""The search behind ``kiln tune --memory-budget`` and ``parallel.auto=true``: the configurations of
a run over N processes, planned (:func:`kiln.plan.plan`), dropped when over the memory budget,
and ranked by the cost model (:mod:`kiln.plan._costmodel`) before any of them runs.

The axes (a key the user gave on the command line is pinned to its value, not searched):
    parallel.dp x tp x pp           every split of N; tp and pp where the model family has plans
    parallel.pp_schedule            where pp > 1: every schedule the stages and micro-batches allow
                                    (gpipe, 1f1b, interleaved-1f1b, interleaved-zb, zbv, dualpipev)
    parallel.zero                   0-3 where dp > 1
    train.accumulate                1, 2, 4 (the micro-batch is data.batch_size / (dp x accumulate))
    train.activation_checkpointing  none, selective, full
    train.precision                 fp32, bf16-mixed (kiln tune; parallel.auto keeps the run's)
    train.compile                   false, true (kiln tune --compile; parallel.auto keeps the run's)

Planning costs seconds a candidate (a pipeline's more), so not every candidate is planned. First
each layout's *probe* is planned (no ZeRO, no accumulation, no checkpointing, fp32, eager): its
FLOPs, operators and collectives give every candidate of the layout a *coarse* time, scaled by
what the other settings change (checkpointing recomputes the forward: 1/3 more FLOPs; each
micro-batch repeats the forward and backward's operators; ZeRO-1/2 double the collectives and
ZeRO-3 gathers each block's parameters). Then candidates are planned in order of coarse time, each
getting its exact time from its own plan, until ``want`` of them fit and no unplanned one's
coarse time beats the slowest of those. A candidate that shares its memory with a planned one
(the same but compiled) shares its plan. A candidate that needs at least the memory of one found
over budget (the same layout, ZeRO stage and precision, with no more accumulation or
checkpointing) is dropped unplanned. When nothing fits, each layout's *floor* (ZeRO-3 or the most ZeRO there is,
the most accumulation, full checkpointing) is planned: if none of them fits, no candidate can
(:class:`NoFit`, naming the smallest peak found and what would make the config fit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from kiln.config import load_config, parse_overrides
from kiln.errors import ConfigError
from kiln.parallel import PP_SCHEDULES, SPLIT_BACKWARD, check_parallel_config
from kiln.plan._costmodel import measure_speeds, pipeline_stretch, predict_seconds


__all__ = ["AXES", "Candidate", "NoFit", "Search", "search"]

AXES = ("parallel.dp", "parallel.tp", "parallel.pp", "parallel.pp_schedule", "parallel.zero", "train.accumulate",
        "train.activation_checkpointing", "train.precision", "train.compile")
AC_ORDER = {"none": 0, "selective": 1, "full": 2}  # less memory to the right
AC_FLOPS = {"none": 1.0, "selective": 1 + 1 / 6, "full": 1 + 1 / 3}  # the forward, recomputed
AC_OPS = {"none": 1.0, "selective": 1.13, "full": 1.27}
ZERO_BYTES = {0: 1.0, 1: 2.0, 2: 2.0, 3: 4.5}  # collective bytes and calls against ZeRO-0 (gpt_tiny, dp=2)
ZERO_CALLS = {0: 1.0, 1: 2.0, 2: 2.0, 3: 4.0}


class NoFit(ConfigError):
    """No candidate fits the budget (a ConfigError: one line, exit status 2)."""


@dataclass
class Candidate:
    """One configuration: ``settings`` maps each searched key to its value."""

    settings: dict[str, Any]
    plan: Any = None  # kiln.plan.Plan once planned
    predicted_s: float | None = None  # seconds per step from its own plan
    coarse_s: float | None = None  # from its layout's probe
    status: str = "unplanned"  # unplanned | fits | over budget | invalid | implied over budget
    note: str = ""  # why invalid, or which planned candidate implies it is over budget
    measured_peak_bytes: int | None = None
    samples_per_second: float | None = None
    trial_note: str = ""

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={_text(v)}" for k, v in self.settings.items()]

    @property
    def predicted_peak_bytes(self) -> int | None:
        return self.plan.peak_bytes if self.plan is not None else None

    def __getitem__(self, key: str) -> Any:
        return self.settings[key]

    def memory_key(self) -> tuple:
        """Candidates with the same key trace the same step (compile changes no plan)."""
        return tuple((k, v) for k, v in self.settings.items() if k != "train.compile")

    def as_json(self, samples_per_step: int) -> dict[str, Any]:
        predicted = None if self.predicted_s is None else samples_per_step / self.predicted_s
        return {"overrides": self.overrides, "predicted_peak_bytes": self.predicted_peak_bytes,
                "measured_peak_bytes": self.measured_peak_bytes, "samples_per_second": self.samples_per_second,
                "predicted_samples_per_second": predicted, "status": self.status,
                **({"note": self.note} if self.note else {}), **({"trial": self.trial_note} if self.trial_note else {})}


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass
class Search:
    """What :func:`search` found: ``candidates`` (all of them, planned or not) and ``ranked``
    (those that fit, fastest predicted first)."""

    candidates: list[Candidate]
    budget: int
    samples_per_step: int
    plan_seconds: float = 0.0
    plans: int = 0
    speeds: Any = None

    @property
    def ranked(self) -> list[Candidate]:
        return sorted((c for c in self.candidates if c.status == "fits"), key=lambda c: c.predicted_s)

    @property
    def planned(self) -> list[Candidate]:
        return [c for c in self.candidates if c.plan is not None]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def space(load: Callable[[list[str]], Any], nproc: int, pinned: dict[str, Any], *, precisions: Iterable[str],
          compiles: Iterable[bool]) -> list[Candidate]:
    """Every candidate whose layout the model and batch allow (checked without building anything);
    ``load(overrides)`` gives the validated config with ``overrides`` on top of the run's own."""

    base = load([])
    batch = base.data.batch_size
    out = []
    for tp in _divisors(nproc):
        for pp in _divisors(nproc // tp):
            dp = nproc // (tp * pp)
            layout = {"parallel.dp": dp, "parallel.tp": tp, "parallel.pp": pp}
            if any(k in pinned and pinned[k] != v for k, v in layout.items()):
                continue
            axes = {
                # one candidate a schedule: each holds its activations for as long as its order says
                "parallel.pp_schedule": list(PP_SCHEDULES) if pp > 1 else [None],
                "parallel.zero": [0, 1, 2, 3] if dp > 1 else [0],
                "train.accumulate": [a for a in (1, 2, 4) if batch % (dp * a) == 0],
                "train.activation_checkpointing": ["none", "selective", "full"],
                "train.precision": list(precisions),
                "train.compile": list(compiles),
            }
            for key in axes:
                if key in pinned and (key != "parallel.pp_schedule" or pp > 1):
                    axes[key] = [pinned[key]]
            for schedule in axes["parallel.pp_schedule"]:
                placed = {**layout, **({"parallel.pp_schedule": schedule} if schedule else {})}
                zeros = axes["parallel.zero"]
                try:  # the layout alone, at its least demanding micro-batch
                    check_parallel_config(load([f"{k}={v}" for k, v in placed.items()]
                                               + [f"train.accumulate={axes['train.accumulate'][0]}"]), nproc)
                except ConfigError:
                    continue  # a family without the plan, a depth that does not split, ...
                if schedule in SPLIT_BACKWARD:
                    zeros = [z for z in zeros if z != 3]  # (FSDP2 does not reduce their weight pass)
                for zero in zeros:
                    for acc in axes["train.accumulate"]:
                        for ac in axes["train.activation_checkpointing"]:
                            for prec in axes["train.precision"]:
                                for comp in axes["train.compile"]:
                                    out.append(Candidate({**placed, "parallel.zero": zero, "train.accumulate": acc,
                                                          "train.activation_checkpointing": ac,
                                                          "train.precision": prec, "train.compile": comp}))
    return out


def _needs_at_least(c: Candidate, over: Candidate) -> bool:
    """``c`` holds at least the memory of ``over``: the same layout, ZeRO stage and precision, and
    no more accumulation or checkpointing. (Not across ZeRO stages: ZeRO-2 can plan above ZeRO-1,
    its gradient buckets outliving the step's activations:
    docs/lab/facts.md, 'What kiln plan found about ZeRO stages')."""
    same = all(c.settings.get(k) == over.settings.get(k)
               for k in ("parallel.dp", "parallel.tp", "parallel.pp", "parallel.pp_schedule", "parallel.zero",
                         "train.precision"))
    return same and c["train.accumulate"] <= over["train.accumulate"] \
        and AC_ORDER[c["train.activation_checkpointing"]] <= AC_ORDER[over["train.activation_checkpointing"]]


def _coarse(c: Candidate, probe: Candidate, speeds: Any, microbatches: int) -> float:
    """``c``'s time from its layout's probe, scaled by what its settings change (see the module)."""
    ac, pac = c["train.activation_checkpointing"], probe["train.activation_checkpointing"]
    acc = c["train.accumulate"] / probe["train.accumulate"]
    z, pz = c["parallel.zero"], probe["parallel.zero"]
    dtype = "bf16" if str(c["train.precision"]).startswith("bf16") else "fp32"
    bubble = pipeline_stretch(c.settings.get("parallel.pp_schedule") or "1f1b", c["parallel.pp"], microbatches)
    # the probe's compute is its own schedule's: the bubble changes with the schedule, the work not
    return max(speeds.step_seconds(
        flops=r.flops * AC_FLOPS[ac] / AC_FLOPS[pac], ops=int(r.ops * acc * AC_OPS[ac] / AC_OPS[pac]),
        collectives=int(r.collectives * ZERO_CALLS[z] / ZERO_CALLS[pz] * (acc if z == 3 else 1)),
        collective_bytes=int(r.collective_bytes * ZERO_BYTES[z] / ZERO_BYTES[pz]),
        dtype=dtype, compiled=bool(c["train.compile"]), bubble=bubble) for r in probe.plan.ranks)


def search(load: Callable[[list[str]], Any], nproc: int, budget: int, *, pinned: dict[str, Any] | None = None,
           precisions: Iterable[str] = ("fp32", "bf16-mixed"), compiles: Iterable[bool] = (False,), want: int = 3,
           exhaustive: bool = False, say: Callable[[str], None] = lambda line: None) -> Search:
    """Plan and rank the candidates of ``load``'s config over ``nproc`` processes within ``budget``
    bytes a rank (see the module); ``want``: how many fitting candidates to plan before stopping
    (all of them with ``exhaustive``). Raises :class:`NoFit` when none fits."""
    from kiln.plan import plan

    pinned = dict(pinned or {})
    cands = space(load, nproc, pinned, precisions=precisions, compiles=compiles)
    if not cands:
        raise ConfigError(f"no layout of {nproc} process(es) suits this config and the keys given "
                          f"({', '.join(f'{k}={v}' for k, v in pinned.items()) or 'none'})")
    speeds = measure_speeds(nproc)
    base = load([])
    found = Search(cands, budget, base.data.batch_size, speeds=speeds)
    by_memory: dict[tuple, Any] = {}
    started = time.perf_counter()

    def micro(c: Candidate) -> int:
        return base.parallel.microbatches or 2 * c["parallel.pp"]

    def planned(c: Candidate) -> None:
        """Plan ``c`` (or take the plan of its memory twin), and judge it."""
        key = c.memory_key()
        if key not in by_memory:
            try:
                cfg = load(c.overrides)
                t = time.perf_counter()
                by_memory[key] = plan(cfg, nproc)
                found.plans += 1
                say(f"  planned {' '.join(c.overrides)}: peak {by_memory[key].peak_bytes / 2**20:,.1f} MB "
                    f"({time.perf_counter() - t:.1f} s)")
            except ConfigError as exc:
                by_memory[key] = exc
        result = by_memory[key]
        if isinstance(result, Exception):
            c.status, c.note = "invalid", str(result).splitlines()[0]
            return
        c.plan = result
        c.predicted_s = predict_seconds(result, speeds, precision=c["train.precision"],
                                        compiled=bool(c["train.compile"]), microbatches=micro(c),
                                        schedule=c.settings.get("parallel.pp_schedule") or "1f1b")
        c.status = "fits" if result.needs_bytes <= budget else "over budget"
        if c.status == "over budget":
            for other in cands:
                if other.status == "unplanned" and _needs_at_least(other, c):
                    other.status, other.note = "implied over budget", f"holds at least what {' '.join(c.overrides)} does"

    layouts = _probe_layouts(cands, planned, speeds, micro)  # 1. each layout's probe
    # 2. best-first: plan in order of coarse time until `want` fit and none unplanned can beat them
    floors_done = False
    while True:
        waiting = sorted((c for c in cands if c.status == "unplanned"), key=lambda c: c.coarse_s)
        fitting = found.ranked
        if not waiting:
            break
        if not exhaustive and len(fitting) >= want and waiting[0].coarse_s > fitting[want - 1].predicted_s:
            break
        if not fitting and not floors_done and found.plans >= len(layouts):
            floors_done = True
            if not _floors(cands, layouts, planned):
                break  # not even the least memory of each layout fits: nothing can
            continue
        planned(waiting[0])
    found.plan_seconds = time.perf_counter() - started
    if not found.ranked:
        raise NoFit(_no_fit_message(found, nproc))
    return found


def _probe_layouts(cands: list[Candidate], planned: Callable[[Candidate], None], speeds: Any,
                   micro: Callable[[Candidate], int]) -> dict[tuple, list[Candidate]]:
    """The search's first step: each layout's probe (its least settings) planned, so that the
    layout's other candidates get a coarse time scaled from it; returns the candidates by layout
    (dp, tp, pp)."""
    layouts: dict[tuple, list[Candidate]] = {}
    for c in cands:
        layouts.setdefault((c["parallel.dp"], c["parallel.tp"], c["parallel.pp"]), []).append(c)
    probes = {}
    for key, group in layouts.items():
        # (a pipeline's probe runs 1F1B where it may: the other schedules scale from its compute)
        probe = min(group, key=lambda c: (c.settings.get("parallel.pp_schedule") not in (None, "1f1b"),
                                          c["parallel.zero"], c["train.accumulate"],
                                          AC_ORDER[c["train.activation_checkpointing"]],
                                          c["train.precision"] != "fp32", bool(c["train.compile"])))
        planned(probe)
        if probe.plan is not None:
            probes[key] = probe
    for key, group in layouts.items():
        for c in group:
            if key in probes:
                c.coarse_s = _coarse(c, probes[key], speeds, micro(c))
            elif c.status == "unplanned":
                c.status, c.note = "invalid", probes.get(key, group[0]).note or "its layout's probe failed"
    return layouts


def _floors(cands: list[Candidate], layouts: dict[tuple, list[Candidate]], planned: Callable) -> bool:
    """Plan each layout's least-memory candidate (for each precision); whether any fits."""
    any_fits = False
    for group in layouts.values():
        for prec in dict.fromkeys(c["train.precision"] for c in group):
            least = max((c for c in group if c["train.precision"] == prec and c.status != "invalid"),
                        key=lambda c: (c["parallel.zero"], c["train.accumulate"],
                                       AC_ORDER[c["train.activation_checkpointing"]], not c["train.compile"]),
                        default=None)
            if least is None:
                continue
            if least.status in ("unplanned", "implied over budget"):
                least.status = "unplanned"
                planned(least)
            any_fits |= least.status == "fits"
    return any_fits


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MB"


def _no_fit_message(found: Search, nproc: int) -> str:
    """One line: the smallest peak planned, and what would make the config fit."""
    planned = [c for c in found.planned]
    if not planned:
        invalid = [c.note for c in found.candidates if c.note]
        return "no configuration could be planned" + (f": {invalid[0]}" if invalid else "")
    least = min(planned, key=lambda c: c.plan.needs_bytes)
    tried = {k: {c.settings.get(k) for c in found.candidates} for k in AXES}
    moves = []
    if 3 not in tried["parallel.zero"] and max(c["parallel.dp"] for c in found.candidates) > 1:
        moves.append("ZeRO-3 (parallel.zero=3)")
    if "full" not in tried["train.activation_checkpointing"]:
        moves.append("activation checkpointing (train.activation_checkpointing=full)")
    if max(tried["train.accumulate"]) < 4 or len(tried["train.accumulate"]) == 1:
        moves.append("a smaller micro-batch (a larger train.accumulate)")
    moves.append(f"more processes (--nproc {2 * nproc})")
    moves.append(f"a budget of at least {_mb(least.plan.needs_bytes)}")
    full = least.plan.ranks[least.plan.fullest_rank]
    states = full.parameters + full.gradients + full.optimizer_state
    return (f"no configuration fits {_mb(found.budget)} a process: the smallest predicted peak is "
            f"{_mb(least.plan.peak_bytes)} ({' '.join(least.overrides)}; model states {_mb(states)}, activations "
            f"and temporaries {_mb(full.activations + full.temporary)}"
            + (f", and {_mb(least.plan.reserve_bytes)} of cuBLAS workspaces" if least.plan.reserve_bytes else "")
            + f"); to fit, try {', '.join(moves)}")


# --------------------------------------------------------------------------- parallel.auto


def auto_overrides(config: Any, overrides: list[str], nproc: int,
                   say: Callable[[str], None] = print) -> list[str]:
    """``parallel.auto=true``: the overrides that lay out ``config`` (with the user's
    ``overrides``) over ``nproc`` processes, chosen by the plan and the cost model, with
    ``parallel.auto=false`` (so the run's config.yaml reruns the same layout without searching).
    Run once, by the launcher, before any process starts; says the choice in one line.
    The user's command-line overrides of searched keys are kept; precision and compile are the
    run's own (train.precision=auto decides in the run). Raises :class:`NoFit`."""
    from omegaconf import OmegaConf

    from kiln.plan import plan_device, run_budget

    cfg = load_config(config, overrides)
    tc = cfg.train
    given = {k for k, _ in parse_overrides(overrides)}
    pinned = {k: OmegaConf.select(cfg, k) for k in AXES if k in given}
    pinned["train.precision"], pinned["train.compile"] = tc.precision, tc.compile
    device = plan_device(tc.device)
    budget, where = run_budget(tc, device, nproc)
    if budget is None:
        raise ConfigError(f"parallel.auto=true: the memory of {device} is not known here; set "
                          "train.memory_budget (e.g. train.memory_budget=8GB)")

    def load(more: list[str]) -> Any:
        return load_config(config, [*overrides, "parallel.auto=false", *more])

    try:
        found = search(load, nproc, budget, pinned=pinned, want=1)
    except NoFit as exc:
        raise NoFit(f"parallel.auto=true: {exc} (budget: {where})") from None
    best = found.ranked[0]
    chosen = [o for o in best.overrides if o.split("=", 1)[0] not in ("train.precision", "train.compile")]
    say(f"kiln: parallel.auto -> {' '.join(chosen)}: predicted peak {_mb(best.predicted_peak_bytes)} of "
        f"{_mb(budget)} a process ({where}), {found.samples_per_step / best.predicted_s:,.0f} samples/s by the "
        f"cost model; {found.plans} of {len(found.candidates)} candidates planned in {found.plan_seconds:.0f} s")
    return [*chosen, "parallel.auto=false"]
