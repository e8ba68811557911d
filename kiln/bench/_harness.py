"""The one harness every benchmark runs through (STYLE rule 16).

A benchmark only measures. Its ``measure(quick, **options)`` (and ``out=``, the output folder,
where it takes one: files of its own) returns a :class:`Result`: the
JSON it wants to keep, its rows with the columns to show them in (:class:`Table`,
:class:`Col`), the panels of its chart (:class:`Bars`), targets and notes.
:func:`benchmark` turns that into the module's ``run(out_dir, quick=False, **options)``,
which owns everything else, written once here:

- the machine the figures came from (:func:`kiln.hardware.machine_info`, printed as
  :func:`kiln.hardware.machine_line`), the load average before and after, a note where other
  work shared the cores, and the time the run took;
- the printed report: ``kiln bench NAME: TITLE``, ``machine: ...``, the tables, the targets
  and the notes; the same text in ``NAME.txt``, the JSON in ``NAME.json``, the chart in
  ``NAME.png``;
- with ``docs=PATH`` (a full run of ``kiln bench NAME``): the report as the benchmark's own
  section of ``docs/lab/benchmarks.md`` (``kiln bench gpu``'s: of ``docs/lab/gpu.md``), replacing the one
  an earlier run wrote and keeping the rest of the page.

Timing helpers for the benchmarks: :func:`time_ms` (median of repeats), :func:`interleaved`
(the methods take turns, so that drifting load hits all alike; each call timed to the end of
its GPU work, :func:`sync`), :func:`paired` (medians of ratios taken within one round),
:func:`children_cpu_s`. A benchmark that takes ``device`` (``kiln bench NAME --device cuda``)
gets a section of its own in ``docs/lab/benchmarks.md``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from kiln._plotting import log_scale, subplots
from kiln.hardware import machine_info, machine_line


DOCS = Path(__file__).resolve().parents[2] / "docs" / "lab" / "benchmarks.md"
Key = str | Callable[[dict[str, Any]], Any]  # a row's field, or a function of the row


def _get(row: dict[str, Any], key: Key) -> Any:
    return key(row) if callable(key) else row[key]


# -- timing ---------------------------------------------------------------------------------------
median = statistics.median


def time_ms(fn: Callable[[], Any], warmup: int = 0, repeats: int = 1) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (0.0 if
    ``repeats`` is 0)."""
    for _ in range(warmup):
        fn()
    times = interleaved({"fn": fn}, repeats)["fn"]
    return 1e3 * median(times) if times else 0.0


def interleaved(steps: dict[str, Callable[[], Any]], rounds: int, repeats: int | dict[str, int] = 1,
                untimed: int = 0) -> dict[str, list[float]]:
    """Seconds of every timed call of every step, the steps taking turns: in each of ``rounds``
    rounds each step is called ``untimed`` times, then ``repeats`` times timed (a number per
    step where they differ). Absolute times on a shared machine drift by 30% and more over
    minutes; times taken side by side drift together, so their ratios hold."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            for _ in range(untimed):
                step()
            for _ in range(repeats if isinstance(repeats, int) else repeats[name]):
                sync()
                t0 = time.perf_counter()
                step()
                sync()
                times[name].append(time.perf_counter() - t0)
    return times


def sync() -> None:
    """Wait for the GPU's queued work, where this process has used CUDA: a step that only
    queues kernels would otherwise be timed as the launches alone."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def paired(runs: list[dict[str, Any]], refs: list[dict[str, Any]], key: str) -> tuple[float, list[float]]:
    """The median over rounds of ``run[key] / ref[key]``, where run and ref ran back to back in the
    same round (a busier minute moves both sides of its ratio), and the ratio of each round."""
    ratios = [a[key] / b[key] for a, b in zip(runs, refs)]
    return median(ratios), ratios


def children_cpu_s() -> float:
    """CPU seconds (user + system) of every child process this one has waited for."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def target(value: float, limit: float, higher: bool = False, **extra: Any) -> dict[str, Any]:
    """A goal a figure should meet: at most ``limit`` (at least, with ``higher``)."""
    return {"value": value, "limit": limit, "higher_is_better": higher,
            "met": value >= limit if higher else value <= limit, **extra}


# -- what a benchmark returns -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Col:
    """A table column: its heading, the row's value, a format spec for numbers (``".2f"``,
    ``".0%"``; None prints as ``-``). ``group`` columns are printed only where they change from
    the row above (the model of several method rows)."""

    head: str
    key: Key
    fmt: str = ""
    group: bool = False


@dataclasses.dataclass
class Table:
    rows: list[dict[str, Any]]
    cols: list[Col]
    title: str = ""

    def text(self) -> str:
        values = [[_get(r, c.key) for c in self.cols] for r in self.rows]
        cells = [["-" if v is None else format(v, c.fmt) for v, c in zip(row, self.cols)] for row in values]
        groups = [i for i, c in enumerate(self.cols) if c.group]
        keys = [[row[i] for i in groups] for row in cells]
        for above, key, row in zip([None, *keys], keys, cells):
            if groups and key == above:  # the same model as the row above: left blank
                for i in groups:
                    row[i] = ""
        # numbers align right, words left
        right = [any(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in values)
                 for i in range(len(self.cols))]
        widths = [max([len(c.head), *(len(row[i]) for row in cells)]) for i, c in enumerate(self.cols)]

        def line(row: list[str]) -> str:
            return "  ".join(s.rjust(w) if r else s.ljust(w) for s, w, r in zip(row, widths, right)).rstrip()

        head = line([c.head for c in self.cols])
        return "\n".join([*([self.title] if self.title else []), head, "-" * len(head), *map(line, cells)])


@dataclasses.dataclass
class Bars:
    """A panel of bars, one group a row (labelled ``x``), one bar a series of ``y`` (side by
    side, or ``stacked``); ``marks``: a tick per row at a value to compare with (a formula);
    ``lines``: labelled reference values; ``color``: a colour per row (one series)."""

    title: str
    rows: list[dict[str, Any]]
    x: Key
    y: dict[str, Key]
    label: str = ""
    stacked: bool = False
    horizontal: bool = False
    log: bool = False
    marks: dict[str, Key] = dataclasses.field(default_factory=dict)
    lines: dict[str, float] = dataclasses.field(default_factory=dict)
    color: Callable[[dict[str, Any]], str] | None = None

    def draw(self, ax: Any) -> None:
        at = list(range(len(self.rows)))
        n = 1 if self.stacked else len(self.y)
        width, base = 0.8 / n, [0.0] * len(at)
        bar = ax.barh if self.horizontal else ax.bar
        for i, (name, key) in enumerate(self.y.items()):
            values = [_get(r, key) or 0.0 for r in self.rows]
            where = [x + (0 if self.stacked else (i - (n - 1) / 2) * width) for x in at]
            colors = [self.color(r) for r in self.rows] if self.color else None
            bar(where, values, width, base if self.stacked else 0.0, label=name, color=colors)
            base = [b + v for b, v in zip(base, values)] if self.stacked else base
        for (name, key), color in zip(self.marks.items(), ("k", "r", "g")):
            points = [(x, _get(r, key)) for x, r in zip(at, self.rows) if _get(r, key) is not None]
            xs, ys = zip(*points) if points else ((), ())
            ax.scatter(ys if self.horizontal else xs, xs if self.horizontal else ys,
                       marker="|" if self.horizontal else "_", s=600, color=color, zorder=3, label=name)
        for (name, value), style in zip(self.lines.items(), ("--", "-", ":")):
            (ax.axvline if self.horizontal else ax.axhline)(value, color="k", lw=0.8, ls=style, label=name)
        labels = [str(_get(r, self.x)) for r in self.rows]
        if self.horizontal:
            ax.set_yticks(at, labels, fontsize=8)
            ax.invert_yaxis()
        else:
            ax.set_xticks(at, labels, fontsize=8, rotation=30 if max(map(len, labels), default=0) > 8 else 0,
                          ha="right" if max(map(len, labels), default=0) > 8 else "center")
        if self.log:
            log_scale(ax.xaxis if self.horizontal else ax.yaxis)
        (ax.set_xlabel if self.horizontal else ax.set_ylabel)(self.label, fontsize=8)
        ax.set_title(self.title, fontsize=9)
        if len(self.y) > 1 or self.marks or self.lines:
            ax.legend(fontsize=7)


@dataclasses.dataclass
class Result:
    """What ``measure`` returns. ``report``: the JSON's own keys (the harness adds ``machine``,
    ``load_average``, ``seconds``, ``measured_at``, ``notes`` and ``targets``). ``threads``: torch's
    intra-op threads per process, where the benchmark sets them (its processes, its loaders);
    ``processes``: how many cores it keeps busy, for the load note. ``texts``: reports made
    elsewhere, printed as they are after the tables (``kiln bench gpu``: those of the
    benchmarks it ran)."""

    report: dict[str, Any]
    tables: list[Table]
    title: str
    chart: list[Bars]
    targets: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    threads: int | None = None
    processes: int = 1
    texts: list[str] = dataclasses.field(default_factory=list)  # printed as they are after the tables


# -- the run --------------------------------------------------------------------------------------
def benchmark(name: str, measure: Callable[..., Result]) -> Callable[..., dict[str, Any]]:
    """``run(out_dir, quick=False, *, docs=None, **options)`` for benchmark ``name``: measure,
    then print and write its report (see the module docstring); returns the JSON as written."""

    @functools.wraps(measure)
    def run(out_dir: str | Path, quick: bool = False, *, docs: Path | None = None, **options: Any) -> dict[str, Any]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if os.environ.get("KILN_BENCH_THREADS"):  # e.g. 1 on a machine shared with other jobs
            torch.set_num_threads(int(os.environ["KILN_BENCH_THREADS"]))
        if "out" in inspect.signature(measure).parameters:  # a benchmark that writes files of its own
            options["out"] = out
        before, t0 = os.getloadavg(), time.perf_counter()
        result = measure(quick, **options)
        # a run on a GPU is its own section of the docs, beside the CPU's
        section = name if options.get("device", "cpu") == "cpu" else f"{name} --device {options['device']}"
        return _publish(name, out, result, docs, load=(before, os.getloadavg()), seconds=time.perf_counter() - t0,
                        section=section)

    return run


def _publish(name: str, out: Path, result: Result, docs: Path | None, load: tuple[tuple[float, ...], ...],
             seconds: float, section: str | None = None) -> dict[str, Any]:
    machine = {**machine_info(), **({"threads": result.threads} if result.threads else {})}
    notes = [*result.notes, *_load_note(load, machine["cpu_count"] or 1, result.processes)]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report = {"benchmark": name, **result.report, "targets": result.targets, "notes": notes, "machine": machine,
              "load_average": {"before": list(load[0]), "after": list(load[1])}, "seconds": seconds,
              "measured_at": when}
    section = section or name
    text = "\n\n".join([f"kiln bench {section}: {result.title}\nmachine: {machine_line(machine)}",
                        *(t.text() for t in result.tables), *result.texts,
                        "\n".join([*(f"target {k}: {t['value']:.3g} ({'at least' if t['higher_is_better'] else 'at most'}"
                                     f" {t['limit']:g}): {'met' if t['met'] else 'MISSED'}"
                                     for k, t in result.targets.items()),
                                   *(f"note: {n}" for n in notes)])]).rstrip()
    print(text)
    (out / f"{name}.txt").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    _draw(result.chart, out / f"{name}.png", f"kiln bench {name}: {result.title}\n{machine_line(machine)}")
    if docs is not None:
        _write_docs(Path(docs), section, text, f"Measured {when} in {seconds / 60:.1f} minutes.")
        print(f"(the report replaces the section 'kiln bench {section}' of {docs})")
    return report


def _load_note(load: tuple[tuple[float, ...], ...], cpus: int, processes: int) -> list[str]:
    before, after = load[0][0], load[1][0]
    # others' load before, and everyone's (this benchmark's processes included) at the end
    if before <= max(cpus - processes, 0) + 0.5 and after <= cpus + 0.5:
        return []
    return [f"1-min load average {before:.1f} before and {after:.1f} after on {cpus} cores, where this benchmark "
            f"keeps {processes} busy: other work shared the cores, so times and ratios are noisier than on an "
            "idle machine"]


def _draw(panels: list[Bars], path: Path, title: str) -> None:
    fig, axes = subplots(1, len(panels), figsize=(5.5 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        panel.draw(ax)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


_DOCS_HEAD = """# Measured benchmarks

Each section below is the report of the latest full run of `kiln bench NAME` (not `--quick`),
written by that run: its tables, targets and notes as printed, the machine they came from (CPU,
vector units, whether bf16 is native, threads, torch) and when. A new run replaces its own
section and leaves the others. Figures are ratios against the plain PyTorch way taken within
one process run; absolute times depend on the machine and on what else ran on it (a note says
so where the load average shows other work). What each benchmark measures, and how, is the
docstring of its module, `kiln/bench/NAME.py` (with `_` for `-`).
"""


def _write_docs(path: Path, name: str, text: str, when: str) -> None:
    """Write the report as the section ``kiln bench NAME`` of ``path``: in place of the one an
    earlier run wrote, else after the rest of the page; what lies outside the sections (a page's
    own prose, docs/lab/gpu.md's) is kept as it is."""
    marks = f"<!-- kiln bench {name} -->\n", f"<!-- /kiln bench {name} -->\n"
    section = f"{marks[0]}## kiln bench {name}\n\n{when}\n\n```text\n{text}\n```\n{marks[1]}"
    old = path.read_text() if path.exists() else _DOCS_HEAD
    start, end = old.find(marks[0]), old.find(marks[1])
    if start >= 0 and end > start:
        new = old[:start] + section + old[end + len(marks[1]):]
    else:
        new = old.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
