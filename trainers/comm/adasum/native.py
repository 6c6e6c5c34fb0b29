"""Adasum's CPU kernels in C: per-span dot products and the rule, one call per run of spans.

Per call, a compiled TorchInductor kernel costs about 50 us of Python and dispatch besides its
arithmetic, and a slice of ResNet-50's gradients holds dozens of tensors per rank and level.
These kernels take a whole run of consecutive spans (one memory segment) per call through
``ctypes``, about 2 us, and do the arithmetic in one pass:

* ``seg_dots``: per span, ``out[s] += (x.y, x.x, y.y)``. fp32 values are widened to float64
  before multiplying (exact products), fp64 ones multiplied as they are; the sums run in 16
  independent float64 lanes (element ``i`` of a span in lane ``i % 16``), added up in a fixed
  order at the end. Built without fast-math and without FMA contraction, so the result does
  not depend on the instruction set the compiler picks (AVX2, AVX-512, NEON): the same bits
  on every machine, for any span lengths.
* ``seg_axpby``: per span, ``x = p[s] x + q[s] y``, computed in float64 and rounded once
  (Horovod's choice).

The library is compiled on first use with the system C compiler (:mod:`modelzoo._native`),
a fraction of a second. Without a compiler, or with ``MODELZOO_ADASUM_NATIVE=0``, it is
unavailable (warned once) and the callers use the torch kernels in :mod:`.kernels`. Only
float32 and float64 tensors on CPU take this path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from modelzoo._native import load

__all__ = ["available", "seg_axpby_", "seg_dots_"]

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* GCC/Clang vector extensions: 8 lanes, whatever instructions the target has. */
typedef double vd __attribute__((vector_size(64)));
typedef float vf __attribute__((vector_size(32)));

static inline vd load_f32(const float* p) { vf v; memcpy(&v, p, sizeof v); return __builtin_convertvector(v, vd); }
static inline vd load_f64(const double* p) { vd v; memcpy(&v, p, sizeof v); return v; }
static inline void store_f32(float* p, vd v) { vf w = __builtin_convertvector(v, vf); memcpy(p, &w, sizeof w); }
static inline void store_f64(double* p, vd v) { memcpy(p, &v, sizeof v); }

/* out += (x.y, x.x, y.y): element i of the span in lane i % 16, lanes added in order. */
#define DOTS(NAME, T, LOAD)                                                                    \
static void NAME##_one(const T* x, const T* y, int64_t n, double* out) {                      \
    vd d0 = {0}, d1 = {0}, a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0};                             \
    int64_t i = 0;                                                                             \
    for (; i + 16 <= n; i += 16) {                                                             \
        vd u0 = LOAD(x + i), u1 = LOAD(x + i + 8), v0 = LOAD(y + i), v1 = LOAD(y + i + 8);     \
        d0 += u0 * v0; d1 += u1 * v1; a0 += u0 * u0; a1 += u1 * u1; b0 += v0 * v0; b1 += v1 * v1; \
    }                                                                                          \
    double d[16], a[16], b[16];                                                                \
    memcpy(d, &d0, 64); memcpy(d + 8, &d1, 64); memcpy(a, &a0, 64); memcpy(a + 8, &a1, 64);    \
    memcpy(b, &b0, 64); memcpy(b + 8, &b1, 64);                                                \
    for (int j = 0; i + j < n; ++j) {                                                          \
        double u = (double)x[i + j], v = (double)y[i + j];                                     \
        d[j] += u * v; a[j] += u * u; b[j] += v * v;                                           \
    }                                                                                          \
    double sd = 0.0, sa = 0.0, sb = 0.0;                                                       \
    for (int j = 0; j < 16; ++j) { sd += d[j]; sa += a[j]; sb += b[j]; }                       \
    out[0] += sd; out[1] += sa; out[2] += sb;                                                  \
}                                                                                              \
void NAME(const T* x, const T* y, const int64_t* offs, int64_t k, double* out) {               \
    for (int64_t s = 0; s < k; ++s)                                                            \
        NAME##_one(x + offs[s], y + offs[s], offs[s + 1] - offs[s], out + 3 * s);              \
}

/* x = p x + q y in float64, rounded once. */
#define AXPBY(NAME, T, LOAD, STORE)                                                            \
void NAME(T* x, const T* y, const int64_t* offs, int64_t k, const double* p, const double* q) { \
    for (int64_t s = 0; s < k; ++s) {                                                          \
        const double ps = p[s], qs = q[s];                                                     \
        const vd pv = {ps, ps, ps, ps, ps, ps, ps, ps}, qv = {qs, qs, qs, qs, qs, qs, qs, qs};  \
        int64_t i = offs[s];                                                                   \
        for (; i + 8 <= offs[s + 1]; i += 8) STORE(x + i, pv * LOAD(x + i) + qv * LOAD(y + i)); \
        for (; i < offs[s + 1]; ++i) x[i] = (T)(ps * (double)x[i] + qs * (double)y[i]);        \
    }                                                                                          \
}

DOTS(seg_dots_f32, float, load_f32)
DOTS(seg_dots_f64, double, load_f64)
AXPBY(seg_axpby_f32, float, load_f32, store_f32)
AXPBY(seg_axpby_f64, double, load_f64, store_f64)
"""

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    **{f"seg_dots_{s}": (_P, _P, _P, _I64, _P) for s in _SUFFIX.values()},
    **{f"seg_axpby_{s}": (_P, _P, _P, _I64, _P, _P) for s in _SUFFIX.values()},
}


def _lib() -> ctypes.CDLL | None:
    return load(
        "adasum", _SOURCE, _SIGNATURES, switch="MODELZOO_ADASUM_NATIVE", what="Adasum's dots"
    )


def available(x: Tensor) -> bool:
    """True when ``x`` (and its partner of the same kind) can go through these kernels."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX and _lib() is not None


def seg_dots_(x: Tensor, y: Tensor, offs: Sequence[int], out: Tensor) -> None:
    """``out[s] += (x.y, x.x, y.y)`` over ``[offs[s], offs[s + 1])`` of the 1-D contiguous
    ``x`` and ``y``; ``out`` is a contiguous (len(offs) - 1, 3) float64 tensor (it may be
    rows of a bigger one). Empty spans add nothing."""
    assert x.is_contiguous() and y.is_contiguous() and out.is_contiguous()
    assert out.dtype == torch.float64 and x.dtype == y.dtype and out.shape[0] == len(offs) - 1
    assert offs[0] >= 0 and offs[-1] <= min(x.numel(), y.numel())
    fn = getattr(_lib(), f"seg_dots_{_SUFFIX[x.dtype]}")
    fn(x.data_ptr(), y.data_ptr(), (ctypes.c_int64 * len(offs))(*offs), len(offs) - 1,
       out.data_ptr())  # fmt: skip


def seg_axpby_(
    x: Tensor, y: Tensor, offs: Sequence[int], p: Sequence[float], q: Sequence[float]
) -> None:
    """``x = p[s] x + q[s] y`` over ``[offs[s], offs[s + 1])`` (float64 arithmetic, rounded
    once)."""
    assert x.is_contiguous() and y.is_contiguous() and x.dtype == y.dtype
    k = len(offs) - 1
    assert len(p) == len(q) == k and offs[0] >= 0 and offs[-1] <= min(x.numel(), y.numel())
    fn = getattr(_lib(), f"seg_axpby_{_SUFFIX[x.dtype]}")
    doubles = ctypes.c_double * k
    fn(x.data_ptr(), y.data_ptr(), (ctypes.c_int64 * (k + 1))(*offs), k, doubles(*p), doubles(*q))
