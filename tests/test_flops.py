"""FLOPs per step, the device's peak and MFU (kiln/hardware/flops.py, kiln/train/_mfu.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kiln.hardware.flops as fl
from kiln.commands import main
from kiln.train import read_metrics

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")


def _mlp_flops(batch: int, widths=(64, 256, 256, 10)) -> int:
    """Forward (2 x in x out per sample and layer), the weights' gradients (the same again) and
    the inputs' gradients of every layer but the first (whose input needs none)."""
    layers = list(zip(widths, widths[1:]))
    per_sample = 2 * sum(a * b for a, b in layers) * 2 + 2 * sum(a * b for a, b in layers[1:])
    return batch * per_sample


def test_count_flops_forward_and_backward():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    with fl.CountFlops() as counted:
        model(torch.randn(32, 64)).sum().backward()
    assert counted.total == _mlp_flops(32)


def test_cpu_attention_is_counted_as_torch_counts_it_on_gpus():
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))  # (B, H, T, Dh)
    with fl.CountFlops() as counted:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    shape = q.shape
    assert counted.total == sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)


@pytest.mark.parametrize("kind", ["efficient_attention", "flash_attention", "cudnn_attention"])
def test_gpu_attention_with_grouped_query_heads_counts_the_query_heads(kind):
    """A GPU's fused attention with fewer key/value heads than query heads (Llama's GQA): the
    kernel broadcasts them, so both matrix products run over the query's 4 heads. (torch before
    2.13 refused to count these shapes: kiln plan of a Hugging Face Llama on CUDA failed.)"""
    from torch.utils.flop_counter import sdpa_backward_flop_count

    b, h, kv_heads, t, d = 2, 4, 2, 8, 16
    q = torch.empty(b, h, t, d, device="meta")
    k = v = torch.empty(b, kv_heads, t, d, device="meta")
    aten = torch.ops.aten
    forward = getattr(aten, f"_scaled_dot_product_{kind}").default
    backward = getattr(aten, f"_scaled_dot_product_{kind}_backward").default
    assert fl.op_flops(forward, (q, k, v), {}, None) == 2 * (2 * b * h * t * t * d)  # q k^T, then p v
    # backward: as torch counts it where every tensor has the query's heads (5 products: the scores
    # recomputed, then the gradients of p, v, q and k)
    assert fl.op_flops(backward, (q, q, k, v), {}, None) == sdpa_backward_flop_count(*[q.shape] * 4) \
        == 5 * (2 * b * h * t * t * d)


def test_counting_does_not_import_dynamo():
    """FlopCounterMode's hooks import torch._dynamo on first use (1-10 s); kiln's counter does not."""
    code = ("import sys, torch; from kiln.hardware.flops import CountFlops\n"
            "m = torch.nn.Linear(8, 8)\n"
            "with CountFlops() as c: m(torch.randn(2, 8)).sum().backward()\n"
            "print(c.total, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(3 * 2 * 2 * 64 - 2 * 2 * 64), "False"]  # no input gradient for the first layer


def test_gpu_peaks_by_name():
    assert fl.gpu_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(989.4e12)
    assert fl.gpu_peak("NVIDIA H100 PCIe", torch.bfloat16) == pytest.approx(756e12)
    assert fl.gpu_peak("NVIDIA H200", torch.float32) == pytest.approx(66.9e12)
    assert fl.gpu_peak("NVIDIA A100-SXM4-80GB", torch.float16) == pytest.approx(312e12)
    assert fl.gpu_peak("NVIDIA A10G", torch.bfloat16) == pytest.approx(70e12)
    assert fl.gpu_peak("Some Future GPU", torch.bfloat16) is None
    assert fl.gpu_peak("NVIDIA H100 80GB HBM3", torch.float64) is None


def test_cpu_peak_is_measured_once_and_keeps_the_best(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    timed = iter([40e9, 30e9, 50e9])  # a loaded machine measures low; the best figure stays
    calls = []

    def fake(dtype, n, repeats, budget_s):
        calls.append(repeats)
        return next(timed)

    monkeypatch.setattr(fl, "matmul_flops", fake)
    monkeypatch.setattr(fl, "matmul_size", lambda dtype: 1024)
    monkeypatch.setattr(fl, "_RETIMED", set())  # (a process that has timed nothing yet)
    assert fl.cpu_peak(torch.float32) == 40e9
    assert fl.cpu_peak(torch.float32) == 40e9 and calls == [5]  # this process measured it: no matmul
    fl._RETIMED.clear()  # the next process
    assert fl.cpu_peak(torch.float32) == 40e9  # one more matmul, slower: the cached figure
    assert fl.cpu_peak(torch.float32) == 40e9 and calls == [5, 1]
    fl._RETIMED.clear()
    assert fl.cpu_peak(torch.float32) == 50e9
    assert calls == [5, 1, 1]


@pytest.mark.parametrize("gflops, size", [(50.0, 1024), (1.0, 256)])
def test_the_peaks_matmul_is_as_large_as_this_cpu_computes_it_quickly(monkeypatch, gflops, size):
    """The peak's matmul is 1024 square where one takes at most 0.25 s (at 50 GFLOP/s: 43 ms),
    256 where it would not (at 1 GFLOP/s, emulated bf16's speed here: 2.1 s), timed, whatever
    the CPU claims (KILN_BF16=native made a 1024 bf16 product cost 4.6 s a run start here)."""
    seen = []

    def fake(dtype, n, repeats, budget_s):
        seen.append(n)
        return gflops * 1e9

    monkeypatch.setattr(fl, "matmul_flops", fake)
    assert fl.matmul_size(torch.bfloat16) == size and seen == [256]


@pytest.mark.skipif(__import__("kiln.hardware").hardware._cpu_capability()["native_bf16"],
                    reason="this CPU computes bf16 natively")
def test_an_emulated_dtype_is_timed_on_the_small_matmul_even_when_claimed_native(monkeypatch, one_thread):
    monkeypatch.setenv("KILN_BF16", "native")
    assert fl.matmul_size(torch.float32) == 1024 and fl.matmul_size(torch.bfloat16) == 256


def test_cpu_peak_really_measures(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    peak, source = fl.peak_flops("cpu", torch.float32)
    assert 1e9 < peak < 1e13 and "measured on this CPU, 1 thread(s)" in source  # 1-10,000 GFLOP/s


def test_mfu_arithmetic():
    assert fl.mfu(1e9, 10.0, 100e9) == pytest.approx(0.1)
    assert fl.mfu(1e9, 10.0, 100e9, devices=2) == pytest.approx(0.05)
    assert fl.mfu(1e9, 10.0, None) is None


def test_a_run_records_flops_and_mfu(tmp_path, monkeypatch):
    monkeypatch.setattr(fl, "cpu_peak", lambda dtype, cache=True: 20e9)  # 20 GFLOP/s, say
    assert main(["train", MLP, f"train.output_dir={tmp_path}", "train.precision=fp32", "train.max_steps=4",
                 "train.log_every=2", "train.eval_every=0", "train.progress=none"]) == 0
    (run,) = tmp_path.iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["flops_per_step"] == _mlp_flops(64)
    assert summary["peak_flops"] == 20e9 and "float32 matmul measured" in summary["peak_flops_source"]
    expected = summary["flops_per_step"] / 64 * summary["samples_per_second"] / 20e9
    assert summary["mfu"] == pytest.approx(expected, rel=1e-5)
    assert summary["first_step_seconds"] > 0  # warm-up (the FLOP count among it), left out of samples/s
    rows = read_metrics(run)
    assert [int(r["step"]) for r in rows] == [2, 4]
    for r in rows:
        speed = float(r["samples_per_second"])
        assert float(r["mfu"]) == pytest.approx(_mlp_flops(64) / 64 * speed / 20e9, rel=1e-3)


def test_measuring_the_peaks_leaves_the_runs_random_stream_alone():
    """The peak is measured at setup, after the seed, and only where the cache has none: a run
    that measured it and one that found it cached must draw the same dropout masks (a kill -9
    resume differed from the uninterrupted run when the measurement drew from the global stream)."""
    from kiln.plan import _costmodel

    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    fl.matmul_flops(torch.float32, 32, 1, 1.0)
    _costmodel._matmul(torch.float32, 32)
    _costmodel._op_seconds()
    assert torch.equal(torch.rand(4), expected)
