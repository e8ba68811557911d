"""The device tier (``pytest -m gpu``): what kiln does on each device present, CPU always and
CUDA where there is a GPU (tests/conftest.py's ``device`` fixture; without CUDA its cases skip
in one -ra line). Two GPUs add NCCL data parallel, ZeRO and FSDP2. Small models, few steps: the
CPU cases run in the normal suite.

Covered: kiln's arena optimizers against torch's fused kernels (parity, and the state dict both
ways), LAMB/LARS against fp64 on the CPU, each precision mode (fp16's loss scaling included),
activation checkpointing and compile, ``kiln train`` with each ZeRO stage at world size 1, a
checkpoint moving between CUDA and CPU, the loader's pinned memory, ``peak_memory_mb``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import kiln.optim as ko
from kiln.config import load_config
from kiln.precision import Precision
from kiln.train import train

# one intra-op thread: on tiny tensors on a shared 2-core machine two threads wait on each other
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")
TINY = ["model.hidden=[32]", "train.log_every=1", "train.progress=none", "train.precision=fp32",
        "train.measure_memory=false", "train.threads=1"]


def _model(device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4)).to(device, dtype)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    p = next(model.parameters())
    for _ in range(n):
        x = torch.randn(8, 16, generator=g).to(p.device, p.dtype)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _close(a: nn.Module, b: nn.Module, rtol: float) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach().cpu().double(), q.detach().cpu().double(), rtol=rtol, atol=rtol / 10,
                                   msg=lambda m: f"{name}: {m}")


# torch's fused kernels and kiln's (the same kernel over the arena) round differently at the
# vector tails: tests/test_optim_torch.py measures 1.3e-7 relative on CPU after up to 20 steps
FUSED_RTOL = 1e-5


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_arena_optimizers_match_torch_fused(device, name):
    kw = {"adamw": dict(lr=1e-2, weight_decay=0.1), "adam": dict(lr=1e-2), "sgd": dict(lr=0.1, momentum=0.9)}[name]
    ours, theirs = _model(device), _model(device)
    kiln_opt = ko.OPTIMIZERS[name](ours.parameters(), **kw)
    torch_opt = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name](
        theirs.parameters(), fused=True, **kw)
    _steps(ours, kiln_opt, 6)
    _steps(theirs, torch_opt, 6)
    _close(ours, theirs, FUSED_RTOL)


def test_the_state_dict_moves_between_torch_fused_and_kiln_both_ways(device):
    a, b = _model(device), _model(device)
    torch_opt = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    _steps(a, torch_opt, 3)
    b.load_state_dict(a.state_dict())
    kiln_opt = ko.AdamW(b.parameters(), lr=1e-2)
    kiln_opt.load_state_dict(torch_opt.state_dict())  # torch -> kiln, then both go on
    _steps(a, torch_opt, 3, seed=2)
    _steps(b, kiln_opt, 3, seed=2)
    _close(a, b, FUSED_RTOL)
    c = _model(device)
    c.load_state_dict(b.state_dict())
    back = torch.optim.AdamW(c.parameters(), lr=1e-2, fused=True)
    back.load_state_dict(kiln_opt.state_dict())  # kiln -> torch
    state = back.state_dict()["state"][0]
    assert state["exp_avg"].device.type == device.type and float(state["step"]) == 6
    _steps(b, kiln_opt, 3, seed=3)
    _steps(c, back, 3, seed=3)
    _close(b, c, FUSED_RTOL)


@pytest.mark.parametrize("contiguous", [True, False], ids=["arena", "lists"])
@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_lamb_and_lars_on_the_device_match_fp64(device, name, contiguous):
    """No torch kernel to match: the device's fp32 run (its default kernels; over the arena or
    per tensor) against kiln's eager rule in fp64 on the CPU."""
    kw = {"lamb": dict(lr=1e-2, weight_decay=0.01), "lars": dict(lr=0.5, weight_decay=1e-4)}[name]
    ours, ref = _model(device), _model(torch.device("cpu"), torch.float64)
    # arena: on CPU the native kernels, on CUDA compiled rules
    _steps(ours, ko.OPTIMIZERS[name](ours.parameters(), **kw, contiguous=contiguous), 6)
    _steps(ref, ko.OPTIMIZERS[name](ref.parameters(), **kw, compile=False), 6)
    _close(ours, ref, 1e-4)  # fp32 against fp64 over 6 steps


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-true"])
def test_each_precision_mode_trains_on_the_device(device, mode):
    model = _model(device)
    opt = ko.AdamW(model.parameters(), lr=3e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated bf16/fp16 on this CPU: said once, not a failure
        precision = Precision(mode, device)
    precision.attach(model, opt)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g).to(device, precision.input_dtype)
    y = torch.randn(64, 4, generator=g).to(device)
    losses = []

    def step(overflow: bool = False) -> bool:
        with precision.autocast():
            out = model(x)
        loss = (out.float() - y).square().mean()
        precision.backward(loss)
        if overflow:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        precision.grads_to_masters()
        precision.unscale(opt)
        stepped = precision.step(opt)
        precision.zero_grad(opt)
        losses.append(loss.item())
        return stepped

    for _ in range(8):
        assert step()
    assert losses[-1] < 0.8 * losses[0], losses
    want = torch.bfloat16 if mode == "bf16-true" else torch.float32
    assert {p.dtype for p in model.parameters()} == {want}
    if mode == "bf16-true":  # fp32 master weights in the optimizer's arena
        assert {p.dtype for g in opt.param_groups for p in g["params"]} == {torch.float32}
    if mode == "fp16-mixed":  # loss scaling: an inf gradient skips the step and halves the scale
        scale = precision.scaler.scale
        before = [p.detach().clone() for p in model.parameters()]
        assert not step(overflow=True)
        assert precision.scaler.scale == scale / 2 and precision.scaler.skipped_steps == 1
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert step()


def _gpt(device: torch.device) -> nn.Module:
    from kiln.models import create_model

    torch.manual_seed(0)
    return create_model("gpt", vocab_size=64, dim=32, depth=2, heads=4, seq_len=16).to(device)


def _grads(model: nn.Module, device: torch.device) -> list[torch.Tensor]:
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0)).to(device)
    model(ids).float().square().mean().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def test_activation_checkpointing_gives_the_same_gradients(device):
    from kiln.memory import apply_ac

    plain = _grads(_gpt(device), device)
    model = _gpt(device)
    assert apply_ac(model, "full") == [0, 1]
    for a, b in zip(plain, _grads(model, device)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # the same ops, recomputed


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.e2e), "cuda"], indirect=True)
def test_compile_gives_eager_gradients_and_trains_like_eager(device):
    """Inductor on the device (Triton on CUDA, C++ on CPU: slow there, 15-35 s of CPU for a cold
    compile, so the CPU case is in the slow tier), compiled once: the first step's gradients
    equal eager's, and 20 AdamW steps on one batch (memorised, so the loss visibly falls) keep
    each loss within 1e-5 of eager's (relative). lr 1e-3: rounding differences of fused kernels
    (~1e-7) grow with the step size when one batch is memorised."""
    from kiln.compile import apply_compile, timed_first_call

    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0)).to(device)
    targets = ids.roll(-1, dims=1)

    def train(compiled: bool) -> tuple[list[torch.Tensor], list[float], float]:
        model = _gpt(device)
        run = apply_compile(model) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        first_grads, losses, seconds = [], [], 0.0
        for i in range(20):
            def step() -> float:
                loss = nn.functional.cross_entropy(run(ids).float().flatten(0, 1), targets.flatten())
                opt.zero_grad()
                loss.backward()
                if i == 0:
                    first_grads.extend(p.grad.detach().clone() for p in model.parameters())
                opt.step()
                return loss.item()
            if i == 0:
                loss, seconds = timed_first_call(step)
            else:
                loss = step()
            losses.append(loss)
        return first_grads, losses, seconds

    eager_grads, eager, _ = train(False)
    grads, compiled, compile_seconds = train(True)
    assert compile_seconds > 0
    for a, b in zip(eager_grads, grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert eager[-1] < 0.8 * eager[0]  # it trains
    for i, (a, b) in enumerate(zip(eager, compiled)):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {i}: eager {a} vs compiled {b}"


def _run(tmp_path: Path, *overrides: str, resume: Path | None = None) -> dict:
    if resume is not None:
        cfg = load_config(resume / "config.yaml", list(overrides))
        return train(cfg, resume=resume).summary
    cfg = load_config(MLP, [f"train.output_dir={tmp_path}", *TINY, *overrides])
    return train(cfg).summary


def test_kiln_train_with_each_zero_stage_at_world_size_1(device, tmp_path):
    losses = {}
    for zero in (0, 1, 2, 3):
        summary = _run(tmp_path / str(zero), "train.max_steps=2", f"train.device={device.type}", f"parallel.zero={zero}")
        assert summary["status"] == "completed" and summary["device"].startswith(device.type)
        losses[zero] = summary["final_train_loss"]
    # one rank: each stage is the whole model on one device, stepping the same numbers
    assert [losses[z] for z in (1, 2, 3)] == pytest.approx([losses[0]] * 3, rel=1e-6), losses
    if device.type == "cuda":  # the allocator's peak, not the process's resident set
        assert 0 < summary["peak_memory_mb"] <= torch.cuda.max_memory_allocated(device) / 2**20


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_nccl_data_parallel_zero_and_fsdp2_on_two_gpus(two_gpus, zero, tmp_path):
    """kiln train --nproc 2 on two GPUs (NCCL), against one GPU training the same global batch."""
    one = _run(tmp_path / "one", "train.max_steps=4", "train.device=cuda")
    run = subprocess.run([sys.executable, "-m", "kiln", "train", MLP, "--nproc", "2", *TINY, "train.max_steps=4",
                          "train.device=cuda", f"parallel.zero={zero}", f"train.output_dir={tmp_path / 'two'}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (run_dir,) = (tmp_path / "two").iterdir()
    two = json.loads((run_dir / "summary.json").read_text())
    assert two["processes"] == 2 and two["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-4)


@pytest.mark.parametrize("first, then", [("cuda", "cpu"), ("cpu", "cuda"), ("cpu", "cpu")])
def test_a_checkpoint_moves_between_cuda_and_cpu(first, then, tmp_path, request):
    if "cuda" in (first, then):
        request.getfixturevalue("cuda")  # skips without CUDA
    # a constant rate: the 3-step run's schedule would otherwise be another than the 6-step run's
    # (its cosine ends at step 3), and the resumed run could not equal the whole one
    whole = _run(tmp_path / "whole", "train.max_steps=6", f"train.device={then}", "optim.schedule=constant")
    part = _run(tmp_path / "part", "train.max_steps=3", f"train.device={first}", "optim.schedule=constant")
    (run_dir,) = (tmp_path / "part").iterdir()
    resumed = _run(tmp_path, "train.max_steps=6", f"train.device={then}", resume=run_dir)
    assert part["device"].startswith(first) and resumed["device"].startswith(then) and resumed["steps"] == 6
    # the same run, but for 3 steps on the other device's kernels
    assert resumed["final_train_loss"] == pytest.approx(whole["final_train_loss"], rel=1e-4)


def test_the_loader_pins_memory_for_cuda(device):
    from kiln.train._build import build_data

    cfg = load_config(MLP, [])
    data = build_data(cfg.data, seed=0, accumulate=1, device=device)
    assert data.train.pin_memory is (device.type == "cuda")  # data.pin_memory=auto
    inputs, targets = next(iter(data.train))
    assert inputs.is_pinned() is (device.type == "cuda") and targets.is_pinned() is (device.type == "cuda")


def test_peak_memory_mb_is_the_cuda_allocators_peak(device):
    from kiln.train.loop import peak_memory_mb

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) / 2**20  # what earlier tests left allocated
    block = torch.ones(16 * 2**20, device=device)  # 64 MiB, touched
    peak = peak_memory_mb(device)
    if device.type == "cuda":
        assert peak == torch.cuda.max_memory_allocated(device) / 2**20 and before + 64 <= peak < before + 64 + 8
    else:  # the process's peak resident set: at least the block
        assert peak >= 64
    del block
