"""summary.json's peak_tensor_memory_mb: the peak of live tensor bytes over a run's first
steps, from the CPU allocator's record (kiln/train/_tensor_peak.py), not the process's RSS."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import kiln.optim
from kiln.commands import main
from kiln.train._tensor_peak import STEPS, TensorMemory, live_tensor_bytes

MB = 2**20


def test_the_peak_is_the_live_bytes_plus_the_steps_highest_allocation():
    torch.manual_seed(0)
    model = nn.Linear(1000, 1000)  # 4 MB of weight
    opt = kiln.optim.AdamW(model.parameters(), lr=1e-3)
    before = live_tensor_bytes(model, opt)
    arena = opt.arenas[0]
    assert before == 2 * arena.numel * 4  # the arena's parameters and gradients, each counted once
    memory = TensorMemory(torch.device("cpu"), (model, opt))
    x = torch.randn(8, 1000)
    with memory.step():
        model(x).sum().backward()
        opt.step()  # AdamW's two state buffers appear here
        scratch = torch.empty(25 * MB // 4)  # 25 MB on top of everything, then freed
        del scratch
        opt.zero_grad()
    state = 2 * arena.numel * 4
    expected = before + state + 25 * MB
    assert expected <= memory.peak_bytes < expected + 1 * MB  # + the step's activations (8 x 1000 floats)
    with memory.step():  # the second step: the state exists, nothing as large
        model(x).sum().backward()
        opt.step()
    assert memory.peak_bytes < expected + 1 * MB and not memory.measuring  # only the first steps
    with memory.step():
        torch.empty(100 * MB // 4)  # not measured
    assert memory.peak_bytes < expected + 1 * MB and STEPS == 2
    assert memory.peak_mb(1) == pytest.approx(memory.peak_bytes / MB)


def test_a_run_reports_its_peak_of_tensor_memory(tmp_path):
    out = tmp_path / "runs"
    assert main(["train", "configs/digits_mlp.yaml", f"train.output_dir={out}", "train.max_steps=4",
                 "train.precision=fp32", "train.progress=none", "train.eval_every=0"]) == 0
    (run,) = out.iterdir()
    summary = json.loads((run / "summary.json").read_text())
    from kiln.train import load_checkpoint

    weights = load_checkpoint(run / "checkpoints" / "final")["model"]
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    # parameters, gradients and AdamW's two moments at least; far below the process's RSS
    assert 4 * model_bytes / MB < summary["peak_tensor_memory_mb"] < summary["peak_memory_mb"]
    out2 = tmp_path / "off"
    assert main(["train", "configs/digits_mlp.yaml", f"train.output_dir={out2}", "train.max_steps=2",
                 "train.precision=fp32", "train.progress=none", "train.measure_memory=false"]) == 0
    (run2,) = out2.iterdir()
    assert json.loads((run2 / "summary.json").read_text())["peak_tensor_memory_mb"] is None
