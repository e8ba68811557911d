"""``kiln bench checkpoint``: the time one checkpoint save takes out of training, a save that
writes before training goes on (``train.async_checkpoint=false``) against one written in the
background (``true``).

The model is kiln's GPT at dim 768, depth 8 (57 M parameters) with kiln's AdamW: 654 MiB of
parameters and optimizer state, fp32, trained on batches of one sequence of 32 tokens (a short
step, so that the steps after a save outlast its write, and so that the noise of a shared
machine stays small beside the stall), written by :func:`kiln.parallel.save_sharded` and
:class:`kiln.parallel.AsyncSaver` into a folder under the benchmark's output folder (the disk
a run's checkpoints go to). A round times, in this order:

- ``base``: ``steps`` training steps without a save; its median step time is the round's step;
- ``sync``: a save, then ``steps`` steps;
- ``async``: a save (the copy into host memory), then ``steps`` steps, then the wait for the
  background write to end (nothing, when the steps outlast it: the write is hidden).
- ``write``, a reference: a plain thread writes as many bytes as the state holds into one file
  (``write`` and ``fsync``, no DCP, the GIL released while the kernel copies) during ``steps``
  steps: what any write in the background costs the steps on this machine, the floor under
  ``async``'s stall where the cores have no time to spare.

A mode's stall is its window's wall time less ``steps`` of the round's step: what the save
added to training. The rounds alternate which mode goes first, and the figures are medians over
rounds, with the ratio async / sync taken within each round (a busier minute moves both).
``steps`` is chosen so that the steps after a save outlast its background write, as the steps
between two saves of a run do. Beside the stall, each mode's CPU time: the process's (every
thread: the steps, the save, DCP's writing thread) over the window, less that of as many steps
without a save.

Training runs on one thread (``threads``) so that the background write can have a core of its
own: the case of a GPU run, whose host threads mostly wait for the device. Whether it had one
is measured, not assumed: the report gives the share of a core the training thread got between
saves (``core_share``, its CPU time over its wall time). Below 1, other work held the cores
(a shared machine; a CPU run whose threads fill every core), and the background write's CPU
time comes out of the steps' time: the async stall then follows its CPU time (``CPU s added``;
in docs/lab/facts.md's two runs 1.7-1.9 s, over the training thread's 0.49-0.55 of a core 3.4-3.5
s, against stalls of 3.7 and 5.4 s),
whether the writer is a thread or a process (measured: as long a stall with DCP's write in a
process of its own, fed from shared memory), and cannot approach 20% of a save that stops
training, which costs as much CPU time plus the wait for the disk.

    kiln bench checkpoint --quick      # a 3 M-parameter GPT (38 MiB of state), one round
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kiln.bench._harness import Bars, Col, Result, Table, benchmark, median, sync, target
from kiln.models import create_model
from kiln.optim import AdamW
from kiln.parallel import AsyncSaver, save_sharded


FULL = {"dim": 768, "depth": 8, "heads": 12}
QUICK = {"dim": 256, "depth": 4, "heads": 4}
MODES = ("sync", "async", "write")
SEQ, BATCH, VOCAB = 32, 1, 256  # a short step: the steps after a save outlast its write, and noise stays small


def _build(shape: dict[str, int], device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = create_model("gpt", vocab_size=VOCAB, seq_len=SEQ, **shape).to(device)
    return model, AdamW(model.parameters(), lr=1e-4)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: str) -> None:
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device=device)
    logits = model(x[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad()
    sync()


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, device: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        _step(model, opt, device)
        times.append(time.perf_counter() - t0)
    return times


def _write(blob: torch.Tensor, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "blob", "wb") as f:
        f.write(memoryview(blob.numpy()))  # (the GIL is released while the kernel copies)
        f.flush()
        os.fsync(f.fileno())


def _window(mode: str, model: torch.nn.Module, opt: torch.optim.Optimizer, device: str, steps: int,
            saver: Any, path: Path, blob: torch.Tensor | None = None) -> dict[str, float]:
    """Seconds of a save and the ``steps`` after it (and, async, the wait for the write), with
    the save's own call and the background write's length."""

    shutil.rmtree(path, ignore_errors=True)
    sync()
    cpu0, t0 = time.process_time(), time.perf_counter()
    writer = None
    if mode == "sync":
        save_sharded(path, model, opt, extra={"step": 0})
    elif mode == "async":
        saver.save(path, model, opt, extra={"step": 0})
    else:  # the reference: a plain thread writing as many bytes, no DCP, no GIL held
        writer = threading.Thread(target=_write, args=(blob, path))
        writer.start()
    call = time.perf_counter() - t0
    written = call  # when the files were on disk, seen after a step (async)
    for _ in range(steps):
        _step(model, opt, device)
        if written == call and (saver.done() if mode == "async" else writer is not None and not writer.is_alive()):
            written = time.perf_counter() - t0
    after_steps = time.perf_counter()
    if mode == "async":
        saver.wait()
    elif writer is not None:
        writer.join()
    end = time.perf_counter()
    if mode != "sync" and written == call:
        written = end - t0
    cpu = time.process_time() - cpu0  # every thread of this process: the steps, the save's own, DCP's writer
    assert (path / ("blob" if writer else "kiln_meta.json")).is_file()
    return {"window": end - t0, "call": call, "written": written, "waited": end - after_steps, "cpu": cpu}


def measure(quick: bool = False, device: str = "cpu", out: Path | None = None, threads: int = 1) -> Result:
    shape, rounds, steps = (QUICK, 1, 4) if quick else (FULL, 7, 10)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    folder = Path(tempfile.mkdtemp(prefix="checkpoint-bench-", dir=out))
    try:
        model, opt = _build(shape, device)
        params = sum(p.numel() for p in model.parameters())
        _steps(model, opt, device, 2)  # warm-up: first allocations, the optimizer's state
        state_bytes = sum(t.numel() * t.element_size() for t in [*model.state_dict().values(),
                                                                 *(v for s in opt.state.values() for v in s.values()
                                                                   if torch.is_tensor(v))])
        saver = AsyncSaver()
        blob = torch.empty(state_bytes, dtype=torch.uint8).fill_(7)
        # each mode's first save (imports, DCP's first plan; async: the host copy's allocation) untimed
        for mode in MODES:
            _window(mode, model, opt, device, 1, saver, folder / mode, blob)
        per_round: list[dict[str, Any]] = []
        for r in range(rounds):
            cpu0 = time.process_time()
            times = _steps(model, opt, device, steps)
            step, step_cpu = median(times), (time.process_time() - cpu0) / steps
            order = MODES if r % 2 == 0 else MODES[::-1]
            got = {mode: _window(mode, model, opt, device, steps, saver, folder / mode, blob) for mode in order}
            # the share of a core the training thread got between saves: below 1, no core was idle
            # for a background write, whose CPU time then comes out of the steps' time
            per_round.append({"step": step, "step_cpu": step_cpu, "core_share": step_cpu * steps / sum(times),
                              **{mode: {**w, "stall": w["window"] - steps * step,
                                        "cpu_added": w["cpu"] - steps * step_cpu} for mode, w in got.items()}})
    finally:
        torch.set_num_threads(old_threads)
        shutil.rmtree(folder, ignore_errors=True)
    ratios = {mode: [r[mode]["stall"] / r["sync"]["stall"] for r in per_round] for mode in MODES}
    rows = []
    for mode in MODES:
        rows.append({"mode": mode, "stall": median(r[mode]["stall"] for r in per_round),
                     "call": median(r[mode]["call"] for r in per_round),
                     "waited": median(r[mode]["waited"] for r in per_round),
                     "written": median(r[mode]["written"] for r in per_round),
                     "step": median(r["step"] for r in per_round),
                     "cpu_added": median(r[mode]["cpu_added"] for r in per_round),
                     "x_sync": median(ratios[mode]),
                     "rounds": [r[mode]["stall"] for r in per_round]})
    cols = [Col("save", "mode"), Col("stall s", "stall", ".3f"), Col("x sync", "x_sync", ".2f"),
            Col("save call s", "call", ".3f"), Col("on disk after s", "written", ".2f"),
            Col("wait at end s", "waited", ".3f"), Col("CPU s added", "cpu_added", ".2f"),
            Col("step s", "step", ".3f"),
            Col("stall s, each round", lambda r: ", ".join(f"{s:.3f}" for s in r["rounds"]))]
    where = "CPU" if device == "cpu" else f"GPU {torch.cuda.get_device_name(0)}"
    title = (f"the stall one checkpoint save puts into training, GPT dim {shape['dim']} depth {shape['depth']} "
             f"({params / 1e6:.0f} M parameters, AdamW: {state_bytes / 2**20:.0f} MiB of state) on the {where}, "
             f"{threads} training thread(s): a save and {steps} steps over {steps} steps without one, "
             f"{rounds} alternating round(s)")
    report = {"device": device, "params": params, "state_bytes": state_bytes, "steps": steps, "rounds": rounds,
              "threads": threads, "stall_seconds": {r["mode"]: r["stall"] for r in rows},
              "cpu_seconds_added": {r["mode"]: r["cpu_added"] for r in rows},
              "core_share": median(r["core_share"] for r in per_round),
              "async_vs_sync": median(ratios["async"]), "write_vs_sync": median(ratios["write"]),
              "per_round": per_round}
    chart = [Bars(f"stall of one save ({where})", rows, "mode", {"stall s": "stall"}, "seconds")]
    notes = ["write: a plain thread writing as many bytes (no DCP), a reference for what a background write costs here",
             "stall: the wall time of a save and the steps after it (async: and the wait for its background "
             "write) less as many steps without a save; a negative figure is noise smaller than the stall",
             "on disk after: from the save's call to its files renamed into place (async: seen after a step, "
             "or at the wait)",
             "CPU s added: the process's CPU time over the window (every thread: the steps, the save, DCP's writer) "
             "less as many steps' without a save",
             f"the training thread got {report['core_share']:.0%} of a core between saves (median): "
             + ("a core was its own, the other free for a background write" if report["core_share"] >= 0.9 else
                "the cores were shared, so no core was free for a background write: its CPU time (CPU s added) "
                "came out of the steps' share")]
    return Result(report, [Table(rows, cols)], title, chart, targets={"async_vs_sync_stall": target(median(ratios["async"]), 0.2)},
                  notes=notes, threads=threads)


run = benchmark("checkpoint", measure)
