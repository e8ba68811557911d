"""Hand-written CPU kernels for LAMB and LARS: the passes torch.compile does not fuse.

LAMB's trust ratio needs ``||w||`` and ``||u||`` per tensor before any weight can move. On the
arena, viewed as (B, blk) rows that never straddle two tensors (see ``_segments``),
those norms are sums over rows. Inductor compiles the elementwise rule well, but given the rule
and the row sums in one function it emits three loops (the sums of w, the rule, then the sums of
u read back from memory), slower than the rule plus two eager row norms; and over the whole
arena any schedule makes at least 10 element passes (the rule, then the update once every norm
is known) against AdamW's 7. The LAMB kernel here takes the tensors in groups that fit in
cache and does the whole step per group: m and v updated, u kept in a small buffer, the row
sums accumulated in registers, the group's ratios, then w moved while the group is still in
cache. Memory sees AdamW's 7 passes; u is computed once. The LARS kernels: the row sums of
w and d = g + wd*w (2 passes, nothing written), then the update (d recomputed).

Built on first use with the C++ toolchain torch.compile uses on CPU (inductor's code cache and its
vector headers: seconds, once, then cached on disk by torch;
docs/lab/facts.md, 'What an import costs'), called through inductor's Python binding. Where no
kernel can be built (no compiler, another torch) the callers fall back to the compiled and eager
kernels, with one warning.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Callable

import torch

from kiln.errors import KilnWarning

log = logging.getLogger(__name__)

_CTYPES = {torch.float32: "float", torch.float64: "double"}

_HEAD = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
using T = {T};
using V = at::vec::Vectorized<T>;
static inline T sum_of(const V& x) {{
    return at::vec::vec_reduce_all<T>([](V& a, V& b) {{ return a + b; }}, x);
}}
"""

_LAMB_U = r"""
static inline V lamb_u(const V& p, const V& m, const V& v, T wd, T rbc1, T rbc2, T eps) {{
    return at::vec::fmadd(p, V(wd), V(rbc1) * (m / ((v * V(rbc2)).sqrt() + V(eps))));
}}
"""

# LAMB's step over rows of blk elements (seg_rows[s] rows per tensor s), in one of three modes:
#   0: the whole step. Tensors are taken in groups of about `group` elements; per group, pass A
#      updates m and v, keeps u in the scratch buffer ub (cache-sized: a group longer than `cap`
#      recomputes u instead) and sums the squares of w and u per row; then each tensor's trust
#      ratio (as _rules.trust_ratio, eta 1) and pass B, w += -lr * ratio * u, while the group's
#      w, m, v and u are still in cache. Memory traffic is AdamW's (read w, g, m, v, write w,
#      m, v) and u is computed once.
#   1: pass A alone over every row, u not kept (a shard: its sums are completed across ranks
#      before any ratio is known).
#   2: pass B alone over every row with coefficient sq[b] (-lr * ratio) per row, u recomputed
#      from the new m, v and w.
# hp = (b1, b2, c1, c2, eps, wd, bc1, bc2, lr, clip), c = 1 - b, clip < 0: none. m's update is
# torch's lerp (both of its branches); lamb_u is the u of LAMB's chain (scale_by_adam, then
# add_decayed_weights) with the divisions by the bias corrections as products by reciprocals.
# sq: (2B,) per-row sums of squares of w then u.
# row_valid: (B,) the real elements of each row (blk but in the last row of a padded segment).
_LAMB = _HEAD + _LAMB_U + r"""
extern "C" void kernel(T* p, const T* g, T* m, T* v, T* sq, T* ub, const T* hp, const int64_t* seg_rows,
                       const int64_t* row_valid, int64_t S, int64_t B, int64_t blk, int64_t group, int64_t cap,
                       int64_t mode, int64_t nt) {{
    const T b2 = hp[1], c1 = hp[2], c2 = hp[3], eps = hp[4], wd = hp[5];
    const T rbc1 = T(1) / hp[6], rbc2 = T(1) / hp[7], lr = hp[8], clip = hp[9];
    const bool low = c1 < T(0.5);
    const int64_t W = V::size();
    auto pass_a = [&](int64_t b, T* u) {{  // u: where row b's u goes, or nullptr
        V sp(0), su(0);
        // the row's real elements: its segment's alignment padding never takes part (with
        // eps = 0 its u would be 0/0), and stays zero
        for (int64_t k = b * blk, end = k + row_valid[b]; k < end; k += W) {{
            const int64_t n = std::min(W, end - k);  // a short tail loads zeros: adds 0 to both sums
            V vg = V::loadu(g + k, n), vm = V::loadu(m + k, n), vv = V::loadu(v + k, n);
            V vp = V::loadu(p + k, n);
            vm = low ? at::vec::fmadd(V(c1), vg - vm, vm) : vg - (vg - vm) * V(T(1) - c1);
            vv = vv * V(b2) + V(c2) * (vg * vg);
            V vu = lamb_u(vp, vm, vv, wd, rbc1, rbc2, eps);
            vm.store(m + k, n);
            vv.store(v + k, n);
            if (u) vu.store(u + (k - b * blk), n);
            sp = at::vec::fmadd(vp, vp, sp);
            su = at::vec::fmadd(vu, vu, su);
        }}
        sq[b] = sum_of(sp);
        sq[B + b] = sum_of(su);
    }};
    auto pass_b = [&](int64_t b, T coef, const T* u) {{  // u: row b's kept u, or nullptr: recompute
        const V c(coef);
        for (int64_t k = b * blk, end = k + row_valid[b]; k < end; k += W) {{
            const int64_t n = std::min(W, end - k);
            V vp = V::loadu(p + k, n);
            V vu = u ? V::loadu(u + (k - b * blk), n)
                     : lamb_u(vp, V::loadu(m + k, n), V::loadu(v + k, n), wd, rbc1, rbc2, eps);
            at::vec::fmadd(c, vu, vp).store(p + k, n);
        }}
    }};
    if (mode == 1) {{
        #pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t b = 0; b < B; ++b) pass_a(b, nullptr);
        return;
    }}
    if (mode == 2) {{
        #pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t b = 0; b < B; ++b) pass_b(b, sq[b], nullptr);
        return;
    }}
    #pragma omp parallel num_threads(nt)
    {{
        for (int64_t s0 = 0, r0 = 0; s0 < S;) {{
            int64_t s1 = s0, r1 = r0;  // the group: tensors s0..s1-1, rows r0..r1-1
            do {{ r1 += seg_rows[s1++]; }} while (s1 < S && (r1 - r0 + seg_rows[s1]) * blk <= group);
            T* u = (r1 - r0) * blk <= cap ? ub : nullptr;
            #pragma omp for schedule(static)
            for (int64_t b = r0; b < r1; ++b) pass_a(b, u ? u + (b - r0) * blk : nullptr);
            #pragma omp single
            for (int64_t s = s0, r = r0; s < s1; r += seg_rows[s++]) {{
                // a tensor of tens of millions of elements has 10^5-10^6 rows: their sum in
                // double, or the norm loses digits (7e-3 at 76 M in one fp32 reduction)
                double wsum = 0, usum = 0;
                for (int64_t b = r; b < r + seg_rows[s]; ++b) {{ wsum += sq[b]; usum += sq[B + b]; }}
                T wn = T(std::sqrt(wsum));
                const T un = T(std::sqrt(usum));
                if (clip >= 0) wn = std::min(wn, clip);
                const T coef = -lr * (std::min(wn, un) > 0 ? wn / un : T(1));
                for (int64_t b = r; b < r + seg_rows[s]; ++b) sq[b] = coef;
            }}
            // the same rows per thread as in pass A (static schedule): still in its cache
            #pragma omp for schedule(static)
            for (int64_t b = r0; b < r1; ++b) pass_b(b, sq[b], u ? u + (b - r0) * blk : nullptr);
            s0 = s1;
            r0 = r1;
        }}
    }}
}}
"""

# wd: (B,) the weight decay of each row (0 for the rows of tensors LARS leaves undecayed)
_LARS = _HEAD + r"""
extern "C" void kernel(const T* p, const T* g, const T* wd, T* sq, int64_t B, int64_t blk, int64_t nt) {{
    const int64_t W = V::size();
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < B; ++b) {{
        V sp(0), sd(0);
        const V w(wd[b]);
        for (int64_t k = b * blk, end = k + blk; k < end; k += W) {{
            const int64_t n = std::min(W, end - k);
            V vp = V::loadu(p + k, n);
            V vd = at::vec::fmadd(vp, w, V::loadu(g + k, n));
            sp = at::vec::fmadd(vp, vp, sp);
            sd = at::vec::fmadd(vd, vd, sd);
        }}
        sq[b] = sum_of(sp);
        sq[B + b] = sum_of(sd);
    }}
}}
"""

# LARS's update over row b: d = g + wd[b]*w scaled by the row's trust ratio q[b], then the
# heavy-ball step of LARS's chain; hp = (lr, momentum). d is recomputed, not read.
_LARS_APPLY = _HEAD + r"""
extern "C" void kernel(T* p, const T* g, T* buf, const T* wd, const T* q, const T* hp, int64_t nesterov,
                       int64_t B, int64_t blk, int64_t nt) {{
    const V lr(hp[0]), mom(hp[1]);
    const int64_t W = V::size();
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < B; ++b) {{
        const V w(wd[b]), r(q[b]);
        for (int64_t k = b * blk, end = k + blk; k < end; k += W) {{
            const int64_t n = std::min(W, end - k);
            V vp = V::loadu(p + k, n);
            V d = at::vec::fmadd(vp, w, V::loadu(g + k, n)) * r;
            V vb = at::vec::fmadd(V::loadu(buf + k, n), mom, d);
            vb.store(buf + k, n);
            V step = nesterov ? at::vec::fmadd(vb, mom, d) : vb;
            (vp - step * lr).store(p + k, n);
        }}
    }}
}}
"""

_ARGS = {
    "lamb": lambda t: ([f"{t}*", f"const {t}*"] + [f"{t}*"] * 4 + [f"const {t}*", "const int64_t*", "const int64_t*"]
                       + ["int64_t"] * 7),
    "lars": lambda t: [f"const {t}*"] * 3 + [f"{t}*"] + ["int64_t"] * 3,
    "lars_apply": lambda t: [f"{t}*", f"const {t}*", f"{t}*"] + [f"const {t}*"] * 3 + ["int64_t"] * 4,
}
_SOURCES = {"lamb": _LAMB, "lars": _LARS, "lars_apply": _LARS_APPLY}
_BUILT: dict[tuple[str, torch.dtype], Callable | None] = {}


def kernel(name: str, like: torch.Tensor) -> Callable | None:
    """The native kernel ``name`` ('lamb', 'lars' or 'lars_apply') for buffers like ``like``, built once per
    process; None where there is none (not a CPU fp32/fp64 buffer, or it cannot be built). For
    a fake tensor (``kiln plan``'s trace), a kernel that does nothing."""
    key = (name, like.dtype)
    if like.device.type != "cpu" or like.dtype not in _CTYPES:
        return None
    if _is_fake(like):
        # a fake tensor's data pointer is 0: the C++ kernel would write there and crash the
        # process. It writes its buffers in place and allocates no tensor, so the traced step
        # holds the same memory without it
        return _does_nothing
    if key not in _BUILT:
        _BUILT[key] = _build(name, _CTYPES[like.dtype])
    return _BUILT[key]


def _is_fake(t: torch.Tensor) -> bool:
    # no FakeTensor exists before torch._subclasses.fake_tensor is imported (kiln plan does)
    module = sys.modules.get("torch._subclasses.fake_tensor")
    return module is not None and isinstance(t, module.FakeTensor)


def _does_nothing(*args: object) -> None:
    return None


def kernels(like: torch.Tensor, *names: str) -> tuple[Callable, ...] | None:
    """The native kernels ``names`` for buffers like ``like``, or None unless every one of them
    is there (an optimizer runs all of its passes natively, or none)."""
    found = []
    for name in names:  # (stops at the first that cannot be built: one warning, not one each)
        k = kernel(name, like)
        if k is None:
            return None
        found.append(k)
    return tuple(found)


def native_kernels_build() -> str | None:
    """Build (or find built) every native kernel for fp32 here; None where they all build, else
    why the first one does not (``kiln doctor`` asks; the optimizers build on first use)."""
    for name in _SOURCES:
        try:
            _build_or_raise(name, "float")
        except Exception as e:  # noqa: BLE001  (reported, as _build warns)
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _build_or_raise(name: str, ctype: str) -> Callable:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(_ARGS[name](ctype), _SOURCES[name].format(T=ctype))


def _build(name: str, ctype: str) -> Callable | None:
    try:
        return _build_or_raise(name, ctype)
    except Exception as e:  # no compiler, or an inductor without this entry point
        log.debug("native %s kernel build failed", name, exc_info=True)
        warnings.warn(f"kiln.optim: could not build the native {name} kernel for CPU "
                      f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); using the "
                      "torch.compile / eager kernels instead (slower). A C++ compiler on PATH (as "
                      "torch.compile needs) fixes this.", KilnWarning, stacklevel=4)
        return None
