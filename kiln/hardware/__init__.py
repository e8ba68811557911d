"""What the machine computes natively, from torch's own capability queries.

kiln's speed claims depend on the hardware: bf16 is fast where the CPU has AVX-512-BF16 or
AMX (or the GPU has bf16 units) and several times slower than fp32 where it is emulated.
Benchmarks record :func:`machine_info` in their JSON and print :func:`machine_line` above
their tables, so that every figure says which machine it came from.

``KILN_BF16=native`` or ``KILN_BF16=emulated`` in the environment overrides what the CPU says
about bf16, so one machine can run the suite as the other kind would (CI does both); it changes
kiln's choices (``train.precision=auto``, the emulation warning), not what the hardware does.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
from typing import Any

import torch

from kiln.errors import ConfigError


@functools.cache
def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``'s model name), or the platform's guess."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _cpu_query(name: str) -> bool:
    query = getattr(torch.cpu, name, None)
    try:
        return bool(query()) if query is not None else False
    except RuntimeError:  # a build without the query's backend
        return False


BF16_OVERRIDE = "KILN_BF16"
_OVERRIDES = {"native": True, "emulated": False}


def bf16_override() -> bool | None:
    """What ``KILN_BF16`` says about the CPU's bf16 (True: native, False: emulated), or None
    where it is unset."""
    return _read_bf16_override()


def check_bf16_override() -> None:
    """Raise ``ConfigError`` where ``KILN_BF16`` holds a value kiln does not understand (without
    asking what it says: a config's check needs the form, not the answer)."""
    _read_bf16_override()


def _read_bf16_override() -> bool | None:
    value = os.environ.get(BF16_OVERRIDE, "").strip().lower()
    if not value:
        return None
    if value not in _OVERRIDES:
        raise ConfigError(f"{BF16_OVERRIDE}={os.environ[BF16_OVERRIDE]!r} is not understood: set it to "
                         f"'native' or 'emulated', or unset it to use what the CPU reports")
    return _OVERRIDES[value]


def cpu_capability() -> dict[str, Any]:
    """The CPU's vector units as torch sees them.

    ``capability`` is what torch's kernels were dispatched to (``DEFAULT``, ``AVX2``,
    ``AVX512``, ...); ``native_bf16`` is true where bf16 matrix multiplies run on hardware
    (AVX-512-BF16 or AMX), not emulated through fp32, unless ``KILN_BF16`` says otherwise
    (``bf16_overridden`` then says so).
    """
    caps = dict(_cpu_capability())
    override = bf16_override()
    if override is not None:
        caps["native_bf16"], caps["bf16_overridden"] = override, True
    return caps


@functools.cache
def _cpu_capability() -> dict[str, Any]:
    flags = {
        "avx2": _cpu_query("_is_avx2_supported"),
        "avx512": _cpu_query("_is_avx512_supported"),
        "avx512_bf16": _cpu_query("_is_avx512_bf16_supported"),
        "amx": _cpu_query("_is_amx_tile_supported"),
        "amx_fp16": _cpu_query("_is_amx_fp16_supported"),
    }
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        **flags,
        "native_bf16": flags["avx512_bf16"] or flags["amx"],
        "native_fp16": flags["amx_fp16"],
        "bf16_overridden": False,
    }


_FP8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))
# the low-precision types of matrix units, by the names kiln doctor shows
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16, **({"fp8": _FP8[0]} if _FP8 else {})}


def native_low_precision(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``device`` computes ``dtype`` (bf16, fp16, or an fp8 type) matrix multiplies natively."""
    device = torch.device(device)
    if dtype in _FP8:
        # fp8 tensor cores from Ada and Hopper on (sm_89); no CPU has fp8 matrix units torch uses
        return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    if device.type == "cuda":
        if dtype == torch.bfloat16:
            if getattr(torch.version, "hip", None):
                return torch.cuda.is_bf16_supported(including_emulation=False)
            # bf16 tensor cores from Ampere on; before it torch runs bf16, but emulated and slow
            # (this device's capability: is_bf16_supported asks about the current device only)
            return torch.cuda.get_device_capability(device) >= (8, 0)
        return torch.cuda.get_device_capability(device)[0] >= 7  # tensor cores from Volta on
    if device.type == "cpu":
        caps = cpu_capability()
        return caps["native_bf16"] if dtype == torch.bfloat16 else caps["native_fp16"]
    return dtype == torch.bfloat16  # other accelerators (mps, xpu): assume native


FP8_NEEDS = ("train.precision=fp8 needs an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper) and "
             "torchao (pip install 'kiln[fp8]')")


def fp8_problem(device: torch.device | str) -> str | None:
    """Why ``train.precision=fp8`` cannot train on ``device`` here, in one line that names what it
    needs, what this machine has and the way out; None where it can. The config's check, the
    precision policy's and ``kiln doctor`` all ask this one function.

    A CUDA device this machine does not have is taken on trust for its capability (``kiln plan``
    traces a GPU's run on fake tensors where there is none; the run itself checks the GPU it
    trains on): only torchao is asked about then."""
    has = fp8_lacks(device)
    return f"{FP8_NEEDS}; this machine has {' and '.join(has)}; use train.precision=bf16-mixed" if has else None


def fp8_lacks(device: torch.device | str) -> list[str]:
    """What this machine has in place of what ``train.precision=fp8`` needs on ``device``, in
    words (``["no CUDA GPU", "no torchao"]``); empty where fp8 can train (see :func:`fp8_problem`)."""
    device = torch.device(device)
    has = []
    if device.type != "cuda":
        has.append(f"a GPU, but train.device={device.type}" if torch.cuda.is_available() else "no CUDA GPU")
    elif torch.cuda.is_available() and not (_FP8 and native_low_precision(device, _FP8[0])):
        major, minor = torch.cuda.get_device_capability(device)
        has.append(f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})")
    if importlib.util.find_spec("torchao") is None:  # (looked up, not imported: importing it takes seconds)
        has.append("no torchao")
    return has


def cpu_cores() -> dict[str, int]:
    """``logical``: the machine's logical CPUs; ``usable``: those this process may run on
    (a container's or ``taskset``'s limit); ``threads``: torch's intra-op threads."""
    logical = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    return {"logical": logical, "usable": usable, "threads": torch.get_num_threads()}


def gpus() -> list[dict[str, Any]]:
    """Each visible CUDA device: index, name, memory (GiB), compute capability, and the
    low-precision types its matrix units compute natively; empty where CUDA is not available."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append({
            "index": i, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
            "native": {name: native_low_precision(f"cuda:{i}", dtype) for name, dtype in LOW_PRECISION.items()},
        })
    return out


def machine_info() -> dict[str, Any]:
    """The facts a benchmark's JSON records about where it ran."""
    caps = cpu_capability()
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_capability": caps["capability"],
        "native_bf16": caps["native_bf16"],
        **({"bf16_overridden": True} if caps.get("bf16_overridden") else {}),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_bf16"] = torch.cuda.is_bf16_supported(including_emulation=False)
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_capability"] = f"{props.major}.{props.minor}"
        info["cuda"] = torch.version.cuda
    return info


def machine_line(info: dict[str, Any] | None = None) -> str:
    """One line for a table header: CPU, capability, bf16, threads, torch."""
    info = info or machine_info()
    bf16 = "native bf16" if info["native_bf16"] else "bf16 emulated"
    if info.get("bf16_overridden"):
        bf16 += f" by {BF16_OVERRIDE}"
    gpu = (f", {info.get('gpu_count', 1)} x GPU {info['gpu']} ({info.get('gpu_memory_gib', '?')} GiB, "
           f"CUDA {info.get('cuda')})") if "gpu" in info else ""
    return (f"{info['cpu']} ({info['cpu_capability']}, {bf16}), {info['threads']} thread(s) of "
            f"{info['cpu_count']} cores, torch {info['torch']}{gpu}")
