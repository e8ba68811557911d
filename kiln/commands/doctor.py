"""``kiln doctor``: what kiln finds in this environment, on one screen, and what is broken there.

In the manner of ``accelerate env``, DeepSpeed's ``ds_report`` and ``python -m
torch.utils.collect_env``, but each line is a check that ran, not a version read from metadata:

- kiln, Python, torch and its build (CPU, or CUDA and its version);
- the CPU (model, vector units, cores) and each GPU (name, memory, compute capability);
- what computes natively (bf16, fp16, fp8), what ``train.precision=auto`` chooses, and whether
  ``train.precision=fp8`` can train here (a GPU of compute capability 8.9+ and torchao);
- the distributed backends that work (gloo, nccl: a one-process group and an all-reduce);
- ``torch.compile`` (a tiny function compiled and timed) and kiln's native optimizer kernels;
- the optional packages (transformers and its models, safetensors, datasets, tensorboard,
  wandb, mlflow, torchao), installed and importing, or not.

Where something kiln needs is broken (a CUDA torch with no working driver, a torchvision built
for another torch, transformers that cannot import its models, gloo that does not start), the
report names the problem and the fix, and ``kiln doctor`` exits 1. What only makes an optional
feature unavailable (compile, the native kernels) is a warning. The import problems are
diagnosed by ``kiln._environment.import_diagnosis``, the same line ``kiln train`` prints.

    >>> report = collect(compile=False)          # compile=False: skip the compile check (seconds)
    >>> sorted(report)[:3], report["torch"]["version"] == __import__("torch").__version__
    (['auto_precision', 'compile', 'cpu'], True)
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import platform
import sys
import time
from typing import Any, Iterator

import torch

from kiln import hardware
from kiln._environment import Diagnosis, EXTRAS, import_diagnosis, package_version
from kiln._version import __version__
from kiln.optim import native_kernels_build
from kiln.precision import resolve
from kiln.precision.auto import rule


__all__ = ["CHECKED", "collect", "main", "render", "to_json"]

# the optional packages kiln doctor checks (kiln._environment.EXTRAS says what installs each)
CHECKED = ("transformers", "safetensors", "datasets", "tensorboard", "wandb", "mlflow", "torchao")
# a model class that transformers imports lazily: importing it is what fails in a broken environment
HF_MODEL = "GPT2LMHeadModel"


class _Findings:
    def __init__(self) -> None:
        self.problems: list[Diagnosis] = []  # kiln cannot work as configured: exit 1
        self.warnings: list[Diagnosis] = []  # an optional feature is not available


def collect(*, compile: bool = True) -> dict[str, Any]:
    """The report as a dict (what ``kiln doctor --json`` prints); ``problems`` and ``warnings``
    are lists of ``{"problem", "fix"}``. ``compile=False`` skips compiling (``compile`` is then
    ``{"ran": false}``)."""
    found = _Findings()
    with _bf16_override_checked(found):
        return _collect(found, compile)


@contextlib.contextmanager
def _bf16_override_checked(found: _Findings) -> Iterator[None]:
    """A ``KILN_BF16`` that kiln does not understand is a problem; the rest of the report is
    then what the CPU itself says (the variable is set aside while it is collected)."""
    saved = None
    try:
        hardware.bf16_override()
    except ValueError as exc:
        found.problems.append(Diagnosis(str(exc).split(": set it to")[0],
                                        "set KILN_BF16 to 'native' or 'emulated', or unset it"))
        saved = os.environ.pop(hardware.BF16_OVERRIDE)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[hardware.BF16_OVERRIDE] = saved


def _collect(found: _Findings, compile: bool) -> dict[str, Any]:
    report: dict[str, Any] = {
        "kiln": __version__, "python": platform.python_version(), "platform": platform.platform(),
        "torch": _torch_build(found),
        "cpu": _cpu(),
    }
    report["gpus"] = hardware.gpus() if report["torch"]["cuda_works"] else []
    report["native"] = {"cpu": {name: hardware.native_low_precision("cpu", dtype)
                                for name, dtype in hardware.LOW_PRECISION.items()},
                        **{f"cuda:{g['index']}": g["native"] for g in report["gpus"]}}
    report["auto_precision"] = _auto_precision("cuda" if report["gpus"] else "cpu")
    report["fp8"] = _fp8(report["gpus"])
    report["distributed"] = {"gloo": _backend("gloo", found), "nccl": _backend("nccl", found)}
    devices = ["cpu"] + (["cuda"] if report["gpus"] else [])
    report["compile"] = {d: _compile(d, found) for d in devices} if compile else {"ran": False}
    report["native_kernels"] = _native_kernels(found)
    report["extras"] = {name: _extra(name, found) for name in CHECKED}
    if package_version("torchvision") is not None:  # kiln does not use it, but transformers imports it
        report["extras"]["torchvision"] = _extra("torchvision", found)
    report["problems"] = [vars(d) for d in found.problems]
    report["warnings"] = [vars(d) for d in found.warnings]
    return report


# ----------------------------------------------------------------------------- the checks


def _torch_build(found: _Findings) -> dict[str, Any]:
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    info: dict[str, Any] = {"version": torch.__version__, "build": "CUDA" if cuda else "ROCm" if hip else "CPU",
                            "cuda": cuda, "hip": hip, "cudnn": None, "cuda_works": False}
    if not (cuda or hip):
        return info
    try:
        torch.cuda.init()  # raises, saying why, where is_available() would only say False
        info["cuda_works"] = torch.cuda.is_available()
        error = None if info["cuda_works"] else "no CUDA device is visible"
    except Exception as exc:  # noqa: BLE001  (the driver's answer, whatever it is)
        error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if info["cuda_works"]:
        info["cudnn"] = torch.backends.cudnn.version()
        return info
    info["cuda_error"] = error
    base = torch.__version__.split("+")[0]
    found.problems.append(Diagnosis(
        f"torch {torch.__version__} is a {info['build']} {cuda or hip} build, but CUDA does not work here ({error})",
        "install or repair the NVIDIA driver (nvidia-smi must list the GPU, with a driver recent enough for "
        f"CUDA {cuda}; CUDA_VISIBLE_DEVICES must not hide it), or, on a machine without a GPU, install torch's "
        f"CPU build: pip install torch=={base} --index-url https://download.pytorch.org/whl/cpu"))
    return info


def _cpu() -> dict[str, Any]:
    caps = hardware.cpu_capability()
    return {"model": hardware.cpu_model(), "capability": caps["capability"],
            **{k: caps[k] for k in ("avx2", "avx512", "avx512_bf16", "amx", "amx_fp16")},
            "bf16_overridden": caps["bf16_overridden"], **hardware.cpu_cores()}


def _auto_precision(device: str) -> dict[str, Any]:
    """``mode``: auto's choice where a rule gives it (``how`` is then ``rule``); where it is
    timed on each run's model (a CPU with native bf16, a GPU with bf16 units holding the whole
    model, as one process does), ``how`` is ``measured`` and ``mode`` what it stands at until then."""

    return {"device": device, "mode": resolve("auto", device), "how": "rule" if rule(device, whole_model=True) else "measured"}


def _fp8(gpus: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether ``train.precision=fp8`` can train here: ``ok`` and the device, or why not (the
    line a config asking for it is refused with). Not a problem: an optional mode."""
    device = f"cuda:{gpus[0]['index']}" if gpus else "cpu"
    lacks = hardware.fp8_lacks(device)
    return {"ok": not lacks, "device": device, **({"lacks": lacks, "why": hardware.fp8_problem(device)} if lacks else {})}


def _backend(name: str, found: _Findings) -> dict[str, Any]:
    """A one-process group of backend ``name`` (an in-memory store, no port) and one
    all-reduce on its device."""
    import torch.distributed as dist

    if not dist.is_available():
        found.problems.append(Diagnosis("this torch was built without torch.distributed",
                                        "install a standard torch build (pip install torch)"))
        return {"ok": False, "error": "torch.distributed is not available"}
    if name == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        why = "no CUDA device" if dist.is_nccl_available() else "not in this torch build"
        return {"ok": None, "error": why}  # not applicable here: no problem
    if dist.is_initialized():
        return {"ok": None, "error": "a process group is already running in this process"}
    device = torch.device("cuda", torch.cuda.current_device()) if name == "nccl" else torch.device("cpu")
    started = time.perf_counter()
    try:
        dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60),
                                **({"device_id": device} if name == "nccl" else {}))
        try:
            value = torch.ones(4, device=device)
            dist.all_reduce(value)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ok = bool(value.eq(1).all())
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        fix = ("kiln trains on CPU over gloo; reinstall torch (pip install --force-reinstall torch)" if name == "gloo"
               else "NCCL ships inside torch's CUDA wheels: reinstall torch, and check that NCCL_* environment "
                    "variables (NCCL_SOCKET_IFNAME, NCCL_P2P_DISABLE) name what this machine has")
        found.problems.append(Diagnosis(f"the {name} backend does not start a one-process group ({error})", fix))
        return {"ok": False, "error": error}
    if not ok:
        found.problems.append(Diagnosis(f"an all-reduce over {name} gave a wrong sum",
                                        "reinstall torch; with NCCL, check the driver"))
    return {"ok": ok, "seconds": round(time.perf_counter() - started, 3)}


def _compile(device: str, found: _Findings) -> dict[str, Any]:
    """Compile a tiny function for ``device`` and time its first call (which compiles);
    its answer must equal eager's."""
    def tiny(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x * 2.0 + 1.0).sum()

    x = torch.linspace(-2, 2, 64, device=device)
    started = time.perf_counter()
    try:
        value = torch.compile(tiny)(x)
        seconds = time.perf_counter() - started
        ok = torch.allclose(value, tiny(x), rtol=1e-5)
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        fix = ("install a C++ compiler (gcc/g++ on PATH), which inductor needs on CPU" if device == "cpu"
               else "install the triton that pairs with this torch (it comes with torch's CUDA wheels)")
        found.warnings.append(Diagnosis(f"torch.compile fails on {device} ({error}); train.compile=true will fail",
                                        fix))
        return {"ok": False, "error": error}
    if not ok:
        found.warnings.append(Diagnosis(f"torch.compile on {device} computes a tiny function differently from eager",
                                        "train with train.compile=false, and report it to PyTorch"))
    return {"ok": ok, "seconds": round(seconds, 2)}


def _native_kernels(found: _Findings) -> dict[str, Any]:
    error = native_kernels_build()
    if error is None:
        return {"ok": True}
    found.warnings.append(Diagnosis(
        f"kiln's native LAMB/LARS kernels for CPU do not build ({error}); LAMB and LARS fall back to slower kernels",
        "install a C++ compiler (gcc/g++ on PATH), as torch.compile needs on CPU"))
    return {"ok": False, "error": error}


def _extra(name: str, found: _Findings) -> dict[str, Any]:
    """``name`` installed (its version), importing, and, for transformers, importing a model."""
    version = package_version(name)
    if version is None:
        return {"installed": False, "imports": False, "install": f"pip install '{EXTRAS.get(name, name)}'"}
    info: dict[str, Any] = {"installed": True, "version": version}
    try:
        module = importlib.import_module(name)
        if name == "transformers":
            getattr(module, HF_MODEL)  # the lazy import of a model's module: what fails when torchvision is broken
    except Exception as exc:  # noqa: BLE001  (a broken install: say how)
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        diagnosis = import_diagnosis(exc)
        if name == "transformers" and diagnosis is not None and "cannot import" not in diagnosis.problem:
            diagnosis = Diagnosis(f"transformers cannot import its models ({HF_MODEL}): {diagnosis.problem}",
                                  diagnosis.fix)
        found.problems.append(diagnosis or Diagnosis(
            f"{name} {version} is installed but does not import ({error})",
            f"pip install --force-reinstall {name} (or pip uninstall {name} if you do not use it)"))
        return {**info, "imports": False, "error": error}
    return {**info, "imports": True}


# ----------------------------------------------------------------------------- the screen


def _yes(flag: bool | None) -> str:
    return "yes" if flag else "no"


def render(report: dict[str, Any]) -> str:
    """The report as text, one screen."""
    t, cpu = report["torch"], report["cpu"]
    build = {"CPU": "CPU build", "CUDA": f"CUDA {t['cuda']} build", "ROCm": f"ROCm {t['hip']} build"}[t["build"]]
    if t.get("cudnn"):
        build += f", cuDNN {t['cudnn']}"
    units = ", ".join(f"{name} {_yes(cpu[key])}" for name, key in (
        ("AVX2", "avx2"), ("AVX-512", "avx512"), ("AVX-512-BF16", "avx512_bf16"), ("AMX", "amx")))
    lines = [
        ("kiln", f"{report['kiln']}, Python {report['python']}, {report['platform']}"),
        ("torch", f"{t['version']} ({build})" + (f": CUDA does not work ({t['cuda_error']})" if t.get("cuda_error") else "")),
        ("CPU", f"{cpu['model']}: {cpu['capability']} kernels ({units}); {cpu['logical']} logical cores, "
                f"{cpu['usable']} usable, {cpu['threads']} torch threads"),
    ]
    for g in report["gpus"]:
        lines.append((f"GPU {g['index']}", f"{g['name']}: {g['memory_gib']} GiB, compute capability {g['capability']}, "
                                           f"{g['multiprocessors']} SMs"))
    if not report["gpus"]:
        lines.append(("GPU", "none" + (" (a CPU build of torch)" if t["build"] == "CPU" else "")))
    lines.append(("native", "; ".join(f"{dev}: " + ", ".join(f"{k} {_yes(v)}" for k, v in kinds.items())
                                      for dev, kinds in report["native"].items())
                  + (" (bf16 set by KILN_BF16)" if cpu["bf16_overridden"] else "")))
    auto = report["auto_precision"]
    lines.append(("auto", f"train.precision=auto trains in {auto['mode']} on {auto['device']}" if auto["how"] == "rule"
                  else f"train.precision=auto times fp32 and bf16-mixed on each run's model ({auto['device']})"))
    fp8 = report["fp8"]
    lines.append(("fp8", f"train.precision=fp8 trains on {fp8['device']}" if fp8["ok"] else
                  f"train.precision=fp8 cannot train here: {' and '.join(fp8['lacks'])} (it needs a GPU of "
                  "compute capability 8.9+ and torchao: pip install 'kiln[fp8]')"))
    lines.append(("distributed", ", ".join(f"{name} {_state(r)}" for name, r in report["distributed"].items())))
    comp = report["compile"]
    lines.append(("compile", "not checked (--no-compile)" if comp.get("ran") is False else ", ".join(
        f"{dev} {_state(r)}" + (f" (first call {r['seconds']} s)" if r.get("ok") else "") for dev, r in comp.items())))
    lines.append(("kernels", f"kiln's native LAMB/LARS CPU kernels {_state(report['native_kernels'], 'build')}"))
    lines.append(("extras", ", ".join(_extra_text(n, e) for n, e in report["extras"].items())))
    width = max(len(k) for k, _ in lines)
    out = [f"{k:<{width}}  {v}" for k, v in lines]
    out.append("")
    for kind in ("problems", "warnings"):
        for d in report[kind]:
            out.append(f"{kind[:-1]}: {d['problem']}")
            out.append(f"  fix: {d['fix']}")
    if not report["problems"]:
        out.append("no problems found" + (f" ({len(report['warnings'])} warning(s))" if report["warnings"] else ""))
    return "\n".join(out)


def _state(result: dict[str, Any], works: str = "works") -> str:
    if result.get("ok") is None:
        return f"n/a ({result.get('error')})"
    return works if result["ok"] else f"FAILS ({result.get('error', 'wrong result')})"


def _extra_text(name: str, e: dict[str, Any]) -> str:
    if not e["installed"]:
        return f"{name} not installed"
    return f"{name} {e['version']}" + ("" if e["imports"] else " BROKEN")


def to_json(report: dict[str, Any]) -> str:
    """The report as JSON, one top-level key a line: one screen, and still one ``json.loads``."""
    return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in report.items()) + "\n}"


def main(*, as_json: bool = False, compile: bool = True) -> int:
    """``kiln doctor``: print the report (text, or JSON with ``as_json``); 1 if it found a problem."""
    if compile:  # the one slow check: say so while it runs (on stderr: --json's stdout stays JSON)
        print("kiln doctor: checking torch.compile (a first compile can take a minute; --no-compile skips it)...",
              file=sys.stderr, flush=True)
    report = collect(compile=compile)
    print(to_json(report) if as_json else render(report))
    return 1 if report["problems"] else 0
