"""``kiln bench lm``: GPT-2 small (124 M parameters) trained by kiln against the loop users
write, on the same model, data, batch and steps.

One model (``configs/gpt2_small.py``: kiln's GPT at GPT-2 small's shape, its generated token
stream), one batch, one number of steps, three rows:

- ``plain loop``: the loop as nanoGPT writes it: the same model (plain PyTorch, SDPA attention),
  ``torch.optim.AdamW(fused=True)`` over nanoGPT's two groups (weight decay on matrices only),
  ``F.cross_entropy`` on the logits, ``clip_grad_norm_(1.0)``, ``zero_grad(set_to_none=True)``,
  the learning rate set by hand each step (the config's warm-up and cosine), and at the end
  ``torch.save`` of the model's and the optimizer's state dicts; on a GPU under
  ``torch.autocast(bfloat16)`` and ``torch.compile``, on a CPU in fp32 and eager. It reads the
  same batches as kiln (kiln's loader over the same data set, same seed);
- ``kiln``: ``kiln train`` with the config's defaults (``train.precision=auto``);
- ``kiln compile``: the same with ``train.compile=true``;
- ``kiln fp8`` and ``kiln fp8 compile``: ``train.precision=fp8`` (the linears in float8 through
  torchao, :mod:`kiln.precision.fp8`), eager and compiled: against ``kiln`` and ``kiln compile``
  in bf16-mixed, what float8 gains. Only on a GPU of compute capability 8.9+ with torchao; elsewhere
  each is a row that says why it did not run (its figures blank).

Every row runs in a process of its own, so that each has its own peak resident set; the rows
take turns, round after round, and the medians over rounds are reported. Columns:

- tokens/s: training tokens per second of wall time over the steps after the first log window
  (which holds the first step's warm-up: compiling, kiln's profiled and FLOP-counted first steps)
  up to the last window (the final evaluation is left out), kiln's logging included;
- MFU: those tokens/s times the FLOPs of a token (counted by kiln on the first step, the same
  for every row) over the device's peak (a GPU's datasheet, this CPU's measured matmul rate);
- tensor peak: the peak of live tensor bytes over the first two steps (the CUDA allocator's, or
  on a CPU the profiler's record of every allocation and free), the figure ``kiln plan`` predicts;
- process peak: the process's peak resident set (``ru_maxrss``), the final checkpoint included;
- loss diff: the mean loss of the first log window against the plain loop's (the same
  training: the same initial weights, batches and learning rates).

Sizes: on a CPU, B x T = 4 x 128 (a step takes seconds on two cores); on a GPU, B x T = 16 x
1024 in bf16. ``--quick``: on a CPU, a 1-layer model of width 64 (a smoke run of the plumbing,
figures that say nothing); on a GPU, the full size with fewer steps and one round.

    kiln bench lm                  # --device cuda on a GPU; --quick for the short form
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kiln.bench._harness import Bars, Col, Result, Table, benchmark, median, sync, target
from kiln.config import instantiate, load_config
from kiln.hardware import fp8_problem
from kiln.hardware.flops import peak_flops
from kiln.train import read_metrics, train
from kiln.train.parts import TensorMemory, build_data


CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gpt2_small.py"
ROWS = ("plain loop", "kiln", "kiln compile", "kiln fp8", "kiln fp8 compile")
FP8_ROWS = ("kiln fp8", "kiln fp8 compile")
ROW_OVERRIDES = {"kiln compile": ["train.compile=true"], "kiln fp8": ["train.precision=fp8"],
                 "kiln fp8 compile": ["train.precision=fp8", "train.compile=true"]}
# --quick on a CPU: one block (a second adds nothing to the plumbing it smoke-tests, and its tracing and
# lowering a quarter of the compile row's CPU: 54 s against 71 s, cold inductor cache, 2 cores)
TINY = ["model.dim=64", "model.depth=1", "model.heads=2", "model.vocab_size=512", "model.seq_len=64"]


def _size(quick: bool, device: str) -> dict[str, Any]:
    """The run's shape: batch, sequence, steps, log window, rounds, and the model overrides."""
    if device == "cuda":
        return dict(batch=16, seq=1024, steps=30 if quick else 60, window=10, rounds=1 if quick else 2, model=[])
    if quick:
        return dict(batch=4, seq=64, steps=6, window=2, rounds=1, model=TINY)
    return dict(batch=4, seq=128, steps=12, window=2, rounds=2, model=[])


def _overrides(size: dict[str, Any], device: str, out: str) -> list[str]:
    return [*size["model"], f"data.batch_size={size['batch']}", f"data.args.seq_len={size['seq']}",
            f"data.eval_batch_size={size['batch']}", f"data.args.val_samples={size['batch']}",  # (a final eval of one batch)
            f"train.max_steps={size['steps']}", f"train.log_every={size['window']}", "train.eval_every=0",
            "train.progress=none", f"train.device={device}", f"train.output_dir={out}"]


# -- the rows, each in a process of its own -----------------------------------------------------------
def _kiln_row(cfg: Any, size: dict[str, Any]) -> dict[str, Any]:
    result = train(cfg, name="bench-lm")
    rows = read_metrics(result.run_dir)
    wall = {int(r["step"]): float(r["wall_seconds"]) for r in rows}
    first, last = size["window"], size["steps"] - size["window"]
    s = result.summary
    return {"seconds_per_step": (wall[last] - wall[first]) / (last - first), "first_loss": float(rows[0]["train_loss"]),
            "tensor_peak_mb": s["peak_tensor_memory_mb"], "flops_per_step": s["flops_per_step"],
            "precision": s["precision"]}


def _lr_factor(optim: Any, total: int):
    """The config's schedule as nanoGPT's loop writes it: linear warm-up, then cosine."""
    warmup, floor = optim.warmup_steps, optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _plain_row(cfg: Any, size: dict[str, Any], device: torch.device, out: str) -> dict[str, Any]:
    tc, oc = cfg.train, cfg.optim
    if tc.threads:
        torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    data = build_data(cfg.data, seed=tc.seed, accumulate=1, device=device)  # kiln's loader: the same batches
    model = instantiate(cfg.model).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = 0.01 if oc.weight_decay is None else oc.weight_decay  # (kiln's AdamW default, as torch's)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=oc.lr, betas=tuple(oc.betas or (0.9, 0.999)), eps=oc.eps or 1e-8, fused=True)
    gpu = device.type == "cuda"
    step_model = torch.compile(model) if gpu else model
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if gpu else contextlib.nullcontext
    factor = _lr_factor(oc, size["steps"])
    memory = TensorMemory(device, (model, opt))
    batches = (b for _ in iter(int, 1) for b in data.train)  # epoch after epoch
    losses, times = [], {}
    for step in range(size["steps"]):
        for g in opt.param_groups:
            g["lr"] = oc.lr * factor(step)
        with memory.step():
            x, y = (t.to(device, non_blocking=True) for t in next(batches))
            with autocast():
                logits = step_model(x)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, tc.clip_grad_norm or 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if (step + 1) % size["window"] == 0:
            loss.item()  # note: nanoGPT reads the loss every log interval, a wait for the device
            sync()
            times[step + 1] = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": size["steps"]},
               Path(out) / "ckpt.pt")
    first, last = size["window"], size["steps"] - size["window"]
    return {"seconds_per_step": (times[last] - times[first]) / (last - first),
            "first_loss": torch.stack(losses[:size["window"]]).double().mean().item(),
            "tensor_peak_mb": memory.peak_mb(1), "precision": "bf16-mixed" if gpu else "fp32"}


def _row_main(name: str, quick: bool, device: str) -> None:
    """In the row's own process: train it, print its figures as a JSON line."""

    size = _size(quick, device)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(CONFIG, _overrides(size, device, out) + ROW_OVERRIDES.get(name, []))
        t0 = time.perf_counter()
        row = _plain_row(cfg, size, torch.device(device), out) if name == "plain loop" else _kiln_row(cfg, size)
        row.update(process_peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   wall_seconds=time.perf_counter() - t0)
    print(json.dumps(row))


def _run_row(name: str, quick: bool, device: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kiln.bench.lm", name, "--quick" if quick else "--full", device]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode:
        raise RuntimeError(f"kiln bench lm: the {name!r} row failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(quick: bool = False, device: str = "cpu") -> Result:

    size = _size(quick, device)
    tokens = size["batch"] * size["seq"]
    # the float8 rows where float8 trains: elsewhere, why not (the line its config is refused with)
    not_run = dict.fromkeys(FP8_ROWS, fp8_problem(device)) if fp8_problem(device) else {}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ROWS if name not in not_run}
    for _ in range(size["rounds"]):
        for name in runs:
            runs[name].append(_run_row(name, quick, device))
    flops = next(r["flops_per_step"] for r in runs["kiln"] if r.get("flops_per_step"))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    peak, peak_source = peak_flops(device, dtype)
    plain_speed = median(tokens / r["seconds_per_step"] for r in runs["plain loop"])
    rows = []
    for name, rs in runs.items():
        speed = median(tokens / r["seconds_per_step"] for r in rs)
        rows.append({"run": name, "precision": rs[0]["precision"], "tokens_per_s": speed, "x_plain": speed / plain_speed,
                     "mfu": speed / tokens * flops / peak if peak else None,
                     "tensor_peak_mb": median(r["tensor_peak_mb"] for r in rs),
                     "process_peak_mb": median(r["process_peak_mb"] for r in rs),
                     "loss_diff": median(r["first_loss"] - runs["plain loop"][i]["first_loss"] for i, r in enumerate(rs)),
                     "rounds": [round(tokens / r["seconds_per_step"]) for r in rs], "not_run": None})
    rows += [{"run": name, "precision": "fp8", "tokens_per_s": None, "x_plain": None, "mfu": None,
              "tensor_peak_mb": None, "process_peak_mb": None, "loss_diff": None, "rounds": [], "not_run": why}
             for name, why in not_run.items()]
    by = {r["run"]: r for r in rows}
    rss = by["kiln"]["process_peak_mb"] / by["plain loop"]["process_peak_mb"]
    cols = [Col("run", "run"), Col("precision", "precision"), Col("tokens/s", "tokens_per_s", ".0f"),
            Col("x plain", "x_plain", ".2f"), Col("MFU", "mfu", ".1%"), Col("tensor peak MB", "tensor_peak_mb", ".0f"),
            Col("process peak MB", "process_peak_mb", ".0f"), Col("loss diff", "loss_diff", ".1e"),
            Col("each round", lambda r: ", ".join(map(str, r["rounds"])) or f"not run: {r['not_run']}")]
    where = "CPU" if device == "cpu" else f"GPU {torch.cuda.get_device_name(0)}"
    model = "a 1-layer GPT of width 64 (--quick)" if size["model"] else "GPT-2 small (124 M)"
    title = (f"{model}, B x T = {size['batch']} x {size['seq']}, on the {where}: {size['steps']} steps a row, "
             f"{size['rounds']} round(s), each row a process of its own")
    targets = {"kiln_vs_plain_tokens_per_s": target(by["kiln"]["x_plain"], 1.0, higher=True),
               "kiln_vs_plain_process_peak": target(rss, 1.05)}
    if device == "cuda":
        targets["kiln_mfu"] = target(by["kiln"]["mfu"] or 0.0, 0.40, higher=True)
    report = {"device": device, "size": size, "flops_per_step": flops, "peak_flops": peak,
              "peak_flops_source": peak_source, "rows": rows, "runs": runs, "process_peak_ratio": rss,
              # float8 against bf16-mixed, eager and compiled: tokens/s of kiln fp8 over kiln's
              "fp8_speedup": {name: by[name]["tokens_per_s"] / by[base]["tokens_per_s"]
                              for name, base in zip(FP8_ROWS, ("kiln", "kiln compile")) if name not in not_run},
              "fp8_not_run": next(iter(not_run.values()), None)}
    ran = [r for r in rows if not r["not_run"]]
    chart = [Bars(f"tokens/s ({where})", ran, "run", {"x plain": "x_plain"}, "tokens/s, x the plain loop",
                  lines={"plain": 1.0}),
             Bars("peak memory", ran, "run", {"tensor MB": "tensor_peak_mb", "process MB": "process_peak_mb"}, "MB")]
    return Result(report, [Table(rows, cols)], title, chart, targets=targets)


run = benchmark("lm", measure)

if __name__ == "__main__":  # one row, in its own process (see _run_row)
    _row_main(sys.argv[1], sys.argv[2] == "--quick", sys.argv[3])
