"""``kiln bench optimizer``: time one optimizer ``step()`` on transformer-shaped parameters.

Compares, in one process: torch.optim.AdamW as a for-loop (the CPU default), foreach and
fused; torch's fused kernel called on one flat tensor (what the arena enables); the
contiguous-params package with torch's Adam; torch-optimizer's Lamb; and kiln's AdamW, LAMB
and LARS (contiguous and ``contiguous=False``). Also reports the memory-bandwidth floor of an
AdamW step: 7 x 4 bytes per parameter (read p, g, m, v; write p, m, v) over the copy
bandwidth measured in the same run.

Two timings on the small layout: ``ms`` steps every optimizer in turn, one step each per round
(interleaved: each step finds its buffers evicted by the others', cold caches, and load from
other processes drifts over every method alike), and ``ms_hot`` steps each optimizer
repeatedly on its own (its buffers stay in cache as far as they fit). On the large layout
(1.2 GB per AdamW) every step streams from memory, so the two are the same and only one is
taken.

Layouts: 12 layers of width 128 (192 tensors, 2.4 M parameters) and 24 layers of width 512
(384 tensors, 76 M). Each layer has q, k, v, o (d x d) with biases, two LayerNorms, and an
MLP d -> 4d -> d: 16 tensors, 12 d^2 + 13 d parameters.

``--device cuda`` runs the same methods with parameters, gradients and state on the GPU (each
call timed to the end of its kernels). There torch's fused AdamW is one multi-tensor launch
over the list, and the goal is at least its speed; torch's fused kernel on one flat tensor is
the limit.

    python -c "from kiln.bench import run_benchmark; run_benchmark('optimizer')"
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from kiln.bench._harness import Bars, Col, Result, Table, benchmark, interleaved, median, target, time_ms


LAYOUTS = {"small": (12, 128), "large": (24, 512)}
QUICK_LAYOUTS = {"small": (2, 32), "large": (2, 64)}


def _layer_shapes(width: int) -> list[tuple[int, ...]]:
    d = width
    shapes: list[tuple[int, ...]] = []
    for _ in range(4):  # q, k, v, o projections
        shapes += [(d, d), (d,)]
    shapes += [(d,), (d,), (d,), (d,)]  # two LayerNorms
    shapes += [(4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # MLP
    return shapes


def _make_params(layers: int, width: int, seed: int = 0, device: str = "cpu") -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)  # the same values on every device
    params = []
    for shape in _layer_shapes(width) * layers:
        p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).to(device))
        p.grad = (torch.randn(shape, generator=g) * 1e-3).to(device)
        params.append(p)
    return params


def _copy_bandwidth(quick: bool, device: str = "cpu") -> float:
    """GB/s of y.copy_(x) (bytes read + bytes written) on tensors far larger than the caches."""
    n = 2**22 if quick else 2**26  # 16 MiB / 256 MiB of fp32
    x, y = torch.randn(n, device=device), torch.empty(n, device=device)
    ms = time_ms(lambda: y.copy_(x), 2, 5 if quick else 10)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def _methods(notes: list[str]) -> dict[str, Callable[[list[torch.nn.Parameter]], Callable[[], None]]]:
    """name -> builder(params) -> step function. Builders that need a missing package are left out."""
    import kiln.optim as ko

    def torch_adamw(**kw):
        return lambda ps: torch.optim.AdamW(ps, lr=1e-3, **kw).step

    def fused_flat(ps):
        flat_p = torch.cat([p.detach().reshape(-1) for p in ps])
        flat_g = torch.cat([p.grad.reshape(-1) for p in ps])
        m, v, step = torch.zeros_like(flat_p), torch.zeros_like(flat_p), torch.zeros((), device=flat_p.device)

        def run():
            step.add_(1)
            torch._fused_adamw_([flat_p], [flat_g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                                weight_decay=1e-2, eps=1e-8, amsgrad=False, maximize=False)
        return run

    def kiln_opt(cls, **kw):
        return lambda ps: cls(ps, lr=1e-3, **kw).step

    methods: dict[str, Callable] = {
        "torch_forloop": torch_adamw(foreach=False),
        "torch_foreach": torch_adamw(foreach=True),
        "torch_fused": torch_adamw(fused=True),
        "torch_fused_one_flat_tensor": fused_flat,
    }
    try:
        from contiguous_params import ContiguousParams

        def cp_adam(ps):
            grads = [p.grad.clone() for p in ps]
            for p in ps:
                p.grad = None
            cp = ContiguousParams(ps)
            for p, g in zip(cp.original(), grads):
                p.grad.copy_(g)  # gradients live in the package's flat buffer
            return torch.optim.Adam(cp.contiguous(), lr=1e-3).step
        methods["contiguous_params_adam"] = cp_adam
    except ImportError:
        notes.append("contiguous-params not installed: skipped (pip install contiguous-params)")
    methods["kiln_adamw"] = kiln_opt(ko.AdamW)
    methods["kiln_adamw_foreach"] = kiln_opt(ko.AdamW, contiguous=False)
    try:
        import torch_optimizer

        # like for like with kiln.optim.LAMB(trust_clip=10): torch-optimizer clamps ||w|| at
        # clamp_value=10 and only bias-corrects with debias=True
        methods["torch_optimizer_lamb"] = lambda ps: torch_optimizer.Lamb(ps, lr=1e-3, debias=True).step
    except ImportError:
        notes.append("torch-optimizer not installed: skipped (pip install --no-deps torch-optimizer pytorch_ranger)")
    methods["kiln_lamb"] = kiln_opt(ko.LAMB, trust_clip=10.0)
    methods["kiln_lamb_foreach"] = kiln_opt(ko.LAMB, trust_clip=10.0, contiguous=False)
    methods["kiln_lars"] = kiln_opt(ko.LARS, weight_decay=1e-4)
    methods["kiln_lars_foreach"] = kiln_opt(ko.LARS, weight_decay=1e-4, contiguous=False)
    return methods


# slow per-parameter variants left out of the large layout (a step of several seconds each)
_SMALL_ONLY = ("kiln_lamb_foreach", "kiln_lars_foreach", "torch_optimizer_lamb")
_COMPILED = ("kiln_lamb", "kiln_lars")  # their first steps compile kernels


def _time_layout(name: str, layers: int, width: int, methods: dict[str, Callable], bandwidth: float,
                 quick: bool, device: str = "cpu") -> dict[str, Any]:
    """Median step time of every method on one layout, and the ratios against torch's."""
    big = name == "large" and not quick
    warmup, repeats = (1, 3) if quick else ((2, 7) if big else (5, 40))
    n_params = sum(torch.Size(s).numel() for s in _layer_shapes(width)) * layers
    ms: dict[str, float] = {}
    ms_hot: dict[str, float] = {}
    with torch.no_grad():
        if not big:
            # small: all optimizers alive at once, timed in interleaved rounds, one step each per
            # round (cold caches), then in bursts (hot; the first step of a burst pays for the
            # others' evictions and is not timed)
            steps = {method: build(_make_params(layers, width, device=device)) for method, build in methods.items()}
            for method, step in steps.items():
                time_ms(step, warmup + (3 if method in _COMPILED else 0), 0)  # first calls compile
            ms = {m: 1e3 * median(t) for m, t in interleaved(steps, repeats).items()}
            hot = interleaved(steps, 8 if repeats >= 8 else 1, max(1, repeats // 8), untimed=1)
            ms_hot = {m: 1e3 * median(t) for m, t in hot.items()}
            del steps
        else:  # large: 1.2 GB per optimizer, one at a time
            for method, build in methods.items():
                if method not in _SMALL_ONLY:
                    ms[method] = time_ms(build(_make_params(layers, width, device=device)),
                                         warmup + (method in _COMPILED), repeats)
    return {
        "layers": layers, "width": width, "tensors": 16 * layers, "parameters": n_params, "ms": ms,
        **({"ms_hot": ms_hot} if ms_hot else {}),
        "vs_torch_forloop": {k: ms["torch_forloop"] / v for k, v in ms.items()},
        "vs_torch_fused": {k: ms["torch_fused"] / v for k, v in ms.items()},
        "adamw_bandwidth_floor_ms": 7 * 4 * n_params / (bandwidth * 1e9) * 1e3,
    }


def measure(quick: bool = False, device: str = "cpu") -> Result:
    notes: list[str] = []
    bandwidth = _copy_bandwidth(quick, device)
    methods = _methods(notes)
    with warnings.catch_warnings():
        # every method steps again and again on gradients set once, as benchmarks of torch.optim
        # do; kiln's optimizers warn (once each) that no new gradient arrived between steps
        warnings.filterwarnings("ignore", message=r"kiln.optim: step\(\) found no new gradient")
        layouts = {name: _time_layout(name, layers, width, methods, bandwidth, quick, device)
                   for name, (layers, width) in (QUICK_LAYOUTS if quick else LAYOUTS).items()}
    tables, chart = [], []
    for name, r in layouts.items():
        rows = [{"method": m, "ms": v, "hot": r.get("ms_hot", {}).get(m), "loop": r["vs_torch_forloop"][m],
                 "fused": r["vs_torch_fused"][m]} for m, v in r["ms"].items()]
        cols = [Col("method", "method"), Col("ms (cold)" if "ms_hot" in r else "ms", "ms", ".3f"),
                *([Col("ms (hot)", "hot", ".3f")] if "ms_hot" in r else []),
                Col("x vs for-loop", "loop", ".2f"), Col("x vs fused", "fused", ".2f")]
        tables.append(Table(rows, cols, f"{name}: {r['layers']} layers x width {r['width']} = {r['tensors']} "
                                        f"tensors, {r['parameters'] / 1e6:.2f} M parameters; AdamW bandwidth floor "
                                        f"{r['adamw_bandwidth_floor_ms']:.2f} ms"))
        chart.append(Bars(f"{name}: {r['tensors']} tensors, {r['parameters'] / 1e6:.1f} M params", rows, "method",
                          {"ms": "ms"}, "ms per step (log)", horizontal=True, log=True,
                          lines={"AdamW bandwidth floor": r["adamw_bandwidth_floor_ms"]},
                          color=lambda row: "tab:orange" if row["method"].startswith("kiln") else "tab:blue"))
    where = "CPU" if device == "cpu" else f"GPU {torch.cuda.get_device_name(0)}"
    return Result({"torch_version": torch.__version__, "threads": torch.get_num_threads(), "device": device,
                   "copy_bandwidth_gbps": bandwidth, "layouts": layouts},
                  tables, f"optimizer step on the {where}, ms (median); copy bandwidth {bandwidth:.1f} GB/s", chart,
                  targets=_cuda_targets(layouts) if device == "cuda" else _targets(layouts), notes=notes)


def _cuda_targets(layouts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """On a GPU: at least the speed of torch's fused AdamW (one multi-tensor launch), at most
    1.1x its kernel on one flat tensor, and near the bandwidth floor on the large layout."""
    t = {}
    for name, lay in layouts.items():
        ms = lay["ms"]
        t[f"{name}: kiln AdamW <= 1.0x torch fused"] = target(ms["kiln_adamw"] / ms["torch_fused"], 1.0)
        t[f"{name}: kiln AdamW <= 1.1x torch's fused kernel on one flat tensor"] = target(
            ms["kiln_adamw"] / ms["torch_fused_one_flat_tensor"], 1.1)
    t["large: kiln AdamW <= 1.2x bandwidth floor"] = target(
        layouts["large"]["ms"]["kiln_adamw"] / layouts["large"]["adamw_bandwidth_floor_ms"], 1.2)
    return t


def _targets(layouts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    small, large = layouts["small"]["ms"], layouts["large"]["ms"]
    floor = layouts["large"]["adamw_bandwidth_floor_ms"]
    t = {
        "small: kiln AdamW <= 0.5x torch fused": target(small["kiln_adamw"] / small["torch_fused"], 0.5),
        "large: kiln AdamW <= 1.05x torch fused": target(large["kiln_adamw"] / large["torch_fused"], 1.05),
        "small: kiln AdamW >= 10x faster than for-loop": target(small["torch_forloop"] / small["kiln_adamw"], 10.0,
                                                                higher=True),
        "large: kiln AdamW <= 1.2x bandwidth floor": target(large["kiln_adamw"] / floor, 1.2),
    }
    for name, lay in (("small", small), ("large", large)):
        t[f"{name}: kiln AdamW contiguous=False <= 1.2x torch fused"] = target(
            lay["kiln_adamw_foreach"] / lay["torch_fused"], 1.2)
    # issue 16: the arena's checks cost O(1), and LAMB / LARS cost little more than AdamW
    timings = [("small, cold", small), ("large", large)]
    if "ms_hot" in layouts["small"]:
        timings.insert(1, ("small, hot", layouts["small"]["ms_hot"]))
    for name, lay in timings:
        t[f"{name}: kiln AdamW <= 1.1x torch's fused kernel on one flat tensor"] = target(
            lay["kiln_adamw"] / lay["torch_fused_one_flat_tensor"], 1.1)
        for opt in ("lamb", "lars"):
            if f"kiln_{opt}" in lay:
                t[f"{name}: kiln {opt.upper()} <= 1.6x kiln AdamW"] = target(lay[f"kiln_{opt}"] / lay["kiln_adamw"], 1.6)
    if "torch_optimizer_lamb" in small:
        t["small: kiln LAMB >= 10x faster than torch-optimizer Lamb"] = target(
            small["torch_optimizer_lamb"] / small["kiln_lamb"], 10.0, higher=True)
    return t


run = benchmark("optimizer", measure)
