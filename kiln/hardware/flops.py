"""FLOPs of a step and the device's peak FLOP/s: MFU (model FLOPs utilization).

- :class:`CountFlops` counts the FLOPs of the operators run inside it (matmuls, convolutions,
  attention: ``torch.utils.flop_counter``'s formulas, plus CPU's fused attention kernels, which
  its registry leaves out). It is a bare ``TorchDispatchMode``: ``FlopCounterMode`` itself
  tracks modules with global hooks whose first call imports ``torch._dynamo``
  (docs/lab/facts.md, 'What an import costs').
  It also counts under ``FakeTensorMode`` (``kiln plan``'s trace): only shapes are read.
- :func:`peak_flops` is the device's peak in a dtype: on a GPU the datasheet's dense figure
  (a table by name); on a CPU a matmul measured once per (CPU, threads, dtype, torch) and
  cached in ``~/.cache/kiln/peak_flops.json`` (:mod:`kiln._cache`).
- :func:`mfu` is achieved FLOP/s over the peak of the devices that ran them.

    >>> with CountFlops() as counted:
    ...     torch.randn(64, 32) @ torch.randn(32, 16)
    >>> counted.total
    65536
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln import _cache, hardware

__all__ = ["CountFlops", "GPU_PEAKS", "matmul_flops", "mfu", "op_flops", "peak_flops"]


def op_flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """FLOPs of one operator call (0 for operators that do no matrix work)."""
    from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

    packet = func._overloadpacket
    aten = torch.ops.aten
    # fused attention, forward (q, k, v, ...) and backward (grad_out, q, k, v, ...), all (B, H, T, Dh):
    # counted here, with grouped-query attention's key/value heads taken as the query's (the kernel
    # broadcasts them; torch before 2.13 refuses to count such shapes)
    name = packet.__name__
    if name in _SDPA:
        q, k, v = (a.shape for a in args[:3])
        return int(sdpa_flop_count(q, *_as_query_heads(q, k, v)))
    if name in _SDPA_BACKWARD:
        g, q, k, v = (a.shape for a in args[:4])
        return int(sdpa_backward_flop_count(g, q, *_as_query_heads(q, k, v)))
    count = flop_registry.get(packet)
    if count is None and name.endswith("_") and hasattr(aten, name[:-1]):
        # an in-place product (addmm_, baddbmm_: the chunked LM loss sums its weight gradient with
        # addmm_) does the out-of-place one's arithmetic; torch's registry names only the latter
        count = flop_registry.get(getattr(aten, name[:-1]))
    return int(count(*args, **kwargs, out_val=out)) if count is not None else 0


_SDPA = {f"_scaled_dot_product_{kind}" for kind in ("efficient_attention", "flash_attention", "cudnn_attention",
                                                     "flash_attention_for_cpu")}
_SDPA_BACKWARD = {f"{n}_backward" for n in _SDPA}


def _as_query_heads(q: torch.Size, *kv: torch.Size) -> list[torch.Size]:
    return [torch.Size((s[0], q[1], *s[2:])) for s in kv]


class CountFlops(TorchDispatchMode):
    """``total``: the FLOPs of every operator run inside (forward and backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # (True wraps __torch_dispatch__ in torch._dynamo.disable: its first call imports dynamo)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.total += op_flops(func, args, kwargs, out)
        return out


# Dense (no sparsity) peak TFLOP/s from the vendors' datasheets, by a substring of
# torch.cuda.get_device_name(); "bf16" is the tensor-core figure (fp16 is the same on these),
# "fp32" the non-tensor-core one (torch's default matmul precision does not use TF32).
GPU_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.5, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp32": 66.9},  # SXM
    "GH200": {"bf16": 989.4, "fp32": 66.9},
    "B200": {"bf16": 2250.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "A10G": {"bf16": 70.0, "fp32": 35.0},  # (before "A10": the longer name first)
    "A10": {"bf16": 125.0, "fp32": 31.2},
    "L40S": {"bf16": 362.1, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp32": 30.3},
    "RTX 4090": {"bf16": 165.2, "fp32": 82.6},
    "V100": {"bf16": 125.0, "fp32": 15.7},  # fp16 tensor cores (V100 has no bf16 units)
    "T4": {"bf16": 65.0, "fp32": 8.1},  # fp16
}


def _kind(dtype: torch.dtype) -> str:
    return "fp32" if dtype in (torch.float32, torch.float64) else "bf16"


def gpu_peak(name: str, dtype: torch.dtype) -> float | None:
    """The datasheet's dense peak FLOP/s of the GPU called ``name`` in ``dtype``, or None."""
    if dtype == torch.float64:  # (fp64 peaks are another table, and fp64 runs are for checking)
        return None
    for key, peaks in GPU_PEAKS.items():
        if key in name:
            return peaks[_kind(dtype)] * 1e12
    return None


MATMUL_N = 1024  # the CPU peak's square matmul; a quarter where a product that size would be slow
SIZE_BUDGET_S = 0.25  # the most one MATMUL_N product may take (predicted from a quarter-size one)
PEAK_CACHE = "peak_flops"
_RETIMED: set[str] = set()  # the keys whose cached peak this process timed again


def matmul_flops(dtype: torch.dtype, n: int, repeats: int, budget_s: float) -> float:
    """FLOP/s of the fastest of ``repeats`` ``n`` x ``n`` matmuls (after an untimed one)."""
    # its own generator: a measurement at setup must not move the run's random stream (a run
    # that found the peak cached would otherwise draw other dropout masks than one that measured)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
    a @ b  # the first call allocates and, for bf16, builds oneDNN's kernel
    best = float("inf")
    started = time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() - started > budget_s:
            break
    return 2 * n**3 / best


def matmul_size(dtype: torch.dtype) -> int:
    """The side of the CPU peak's square matmul in ``dtype``: ``MATMUL_N``, or a quarter of it
    where one product that size would take over ``SIZE_BUDGET_S``, as timed on the quarter. The
    time decides, not a capability flag: a dtype emulated here (bf16 without AVX-512-BF16)
    measured at 1024 costs seconds at a run's start, also where ``KILN_BF16=native`` claims
    otherwise (docs/lab/facts.md, 'bf16 on a CPU: where it pays')."""
    small = MATMUL_N // 4
    # the best of up to 3 within 20 ms: one product preempted on a busy machine (a test suite's
    # three processes on two cores) read fp32 as slow; a slow dtype's first product ends it
    seconds = 2 * small**3 / matmul_flops(dtype, small, repeats=3, budget_s=0.02)
    return MATMUL_N if seconds * (MATMUL_N // small) ** 3 <= SIZE_BUDGET_S else small


def cpu_peak(dtype: torch.dtype, *, cache: bool = True) -> float:
    """This CPU's matmul FLOP/s in ``dtype`` with torch's current threads.

    Measured once (the best of up to 5 square matmuls, 0.1-0.5 s) and cached. A machine that
    other jobs share measures low, and a low peak would inflate every MFU after it, so the first
    call in each later process times one more matmul (~50 ms) and keeps the best figure ever
    seen (a process that runs many trainings, a sweep's or a test suite's, times it once)."""
    threads = torch.get_num_threads()
    key = f"{hardware.cpu_model()}|{hardware.cpu_capability()['capability']}|{threads}|{dtype}|{torch.__version__}"
    hit = _cache.get(PEAK_CACHE, key) if cache else None
    if hit is not None and key in _RETIMED:
        return float(hit["flops"])
    _RETIMED.add(key)
    if hit is None:
        n = matmul_size(dtype)
        flops = matmul_flops(dtype, n, repeats=5, budget_s=0.5)
    else:
        n = int(hit.get("n", MATMUL_N))
        flops = max(float(hit["flops"]), matmul_flops(dtype, n, repeats=1, budget_s=0.0))
        if flops == float(hit["flops"]):
            return flops
    if cache:
        _cache.put(PEAK_CACHE, key, {"flops": flops, "n": n, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return flops


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> tuple[float | None, str]:
    """``(peak FLOP/s of one device, where the figure comes from)``; None where unknown (a GPU
    not in the table)."""
    device = torch.device(device)
    name = "bf16" if dtype == torch.bfloat16 else "fp16" if dtype == torch.float16 else str(dtype).split(".")[-1]
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        peak = gpu_peak(gpu, dtype)
        return peak, f"{gpu} datasheet, dense {name}" if peak else f"{gpu}: not in kiln.hardware.flops.GPU_PEAKS"
    if device.type == "cpu":
        return cpu_peak(dtype), f"{name} matmul measured on this CPU, {torch.get_num_threads()} thread(s)"
    return None, f"no peak known for {device.type}"


def mfu(flops_per_step: float, steps_per_second: float, peak: float | None, devices: int = 1) -> float | None:
    """Model FLOPs utilization: the FLOP/s the steps achieved over ``devices`` x the peak."""
    if not peak or not flops_per_step or steps_per_second <= 0:
        return None
    return flops_per_step * steps_per_second / (peak * devices)
