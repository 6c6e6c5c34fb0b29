"""The CSR product of the linear models in C: ``X W^T`` and its backward ``G^T X``.

The torch form (:class:`modelzoo.linear.models._SparseMargins` without this module) gathers
an ``(nnz, C)`` block of products and scatter-adds it (``index_add_``), with a row index
built per call: three passes over ``nnz x C`` values and two temporaries of that size. These
kernels walk the CSR arrays once and accumulate in place, in the same order: every output
element is ``0 + p_1 + p_2 + ...`` over its non-zeros in CSR order, each product rounded
once, so the result is the torch form's bit for bit (tests/modelzoo/test_linear_native.py).
The library is built without FMA contraction (:mod:`modelzoo._native`). The forward splits
its rows over ``torch.get_num_threads()`` threads and, for one output, runs four rows'
sums side by side (rows are independent: each sum keeps its order); the backward, which
scatters into columns, runs on one thread.

Only CPU CSR matrices with int64 indices whose values have the weights' dtype (float32 or
float64) take this path; ``MODELZOO_LINEAR_NATIVE=0`` or a missing C compiler leaves the
torch form (warned once).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from modelzoo._native import load

__all__ = ["available", "csr_margins", "csr_margins_backward"]

_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 64

#define FORWARD(NAME, T)                                                                       \
typedef struct { const int64_t* crow; const int64_t* col; const T* val; const T* W;            \
                 T* out; int64_t C, F, lo, hi; } NAME##_job;                                   \
static void* NAME##_rows(void* arg) {                                                          \
    const NAME##_job* a = (const NAME##_job*)arg;                                              \
    const int64_t C = a->C, F = a->F;                                                          \
    int64_t i = a->lo;                                                                         \
    if (C == 1) { /* four rows at a time: independent sums, each in its own order */           \
        const int64_t* crow = a->crow; const int64_t* col = a->col;                            \
        const T* val = a->val; const T* W = a->W;                                              \
        for (; i + 4 <= a->hi; i += 4) {                                                       \
            int64_t j0 = crow[i], j1 = crow[i + 1], j2 = crow[i + 2], j3 = crow[i + 3];        \
            const int64_t e0 = j1, e1 = j2, e2 = j3, e3 = crow[i + 4];                         \
            T s0 = 0, s1 = 0, s2 = 0, s3 = 0;                                                  \
            while (j0 < e0 && j1 < e1 && j2 < e2 && j3 < e3) {                                 \
                T p0 = val[j0] * W[col[j0]], p1 = val[j1] * W[col[j1]];                        \
                T p2 = val[j2] * W[col[j2]], p3 = val[j3] * W[col[j3]];                        \
                s0 = s0 + p0; s1 = s1 + p1; s2 = s2 + p2; s3 = s3 + p3;                        \
                ++j0; ++j1; ++j2; ++j3;                                                        \
            }                                                                                  \
            for (; j0 < e0; ++j0) { T p = val[j0] * W[col[j0]]; s0 = s0 + p; }                 \
            for (; j1 < e1; ++j1) { T p = val[j1] * W[col[j1]]; s1 = s1 + p; }                 \
            for (; j2 < e2; ++j2) { T p = val[j2] * W[col[j2]]; s2 = s2 + p; }                 \
            for (; j3 < e3; ++j3) { T p = val[j3] * W[col[j3]]; s3 = s3 + p; }                 \
            a->out[i] = s0; a->out[i + 1] = s1; a->out[i + 2] = s2; a->out[i + 3] = s3;        \
        }                                                                                      \
    }                                                                                          \
    for (; i < a->hi; ++i) {                                                                   \
        T* o = a->out + i * C;                                                                 \
        for (int64_t k = 0; k < C; ++k) o[k] = 0;                                              \
        for (int64_t j = a->crow[i]; j < a->crow[i + 1]; ++j) {                                \
            const T v = a->val[j];                                                             \
            const T* w = a->W + a->col[j];                                                     \
            for (int64_t k = 0; k < C; ++k) { T p = v * w[k * F]; o[k] = o[k] + p; }           \
        }                                                                                      \
    }                                                                                          \
    return 0;                                                                                  \
}                                                                                              \
void NAME(const int64_t* crow, const int64_t* col, const T* val, const T* W, T* out,          \
          int64_t n, int64_t C, int64_t F, int threads) {                                      \
    int64_t nnz = crow[n] - crow[0];                                                           \
    if (threads > MAX_THREADS) threads = MAX_THREADS;                                          \
    if (threads > nnz / 16384) threads = (int)(nnz / 16384);                                   \
    if (threads < 1) threads = 1;                                                              \
    NAME##_job jobs[MAX_THREADS];                                                              \
    pthread_t tid[MAX_THREADS];                                                                \
    int started[MAX_THREADS] = {0};                                                            \
    for (int t = 0; t < threads; ++t) {                                                        \
        NAME##_job q = {crow, col, val, W, out, C, F, n * t / threads, n * (t + 1) / threads}; \
        jobs[t] = q;                                                                           \
    }                                                                                          \
    for (int t = 1; t < threads; ++t)                                                          \
        started[t] = pthread_create(&tid[t], 0, NAME##_rows, &jobs[t]) == 0;                   \
    NAME##_rows(&jobs[0]);                                                                     \
    for (int t = 1; t < threads; ++t) {                                                        \
        if (started[t]) pthread_join(tid[t], 0); else NAME##_rows(&jobs[t]);                   \
    }                                                                                          \
}

/* out (F, C) = G^T X: out[col[j], k] += val[j] * G[i, k], the non-zeros in CSR order. */
#define BACKWARD(NAME, T)                                                                      \
void NAME(const int64_t* crow, const int64_t* col, const T* val, const T* G, T* out,          \
          int64_t n, int64_t C, int64_t F) {                                                   \
    memset(out, 0, sizeof(T) * (size_t)(F * C));                                               \
    if (C == 1) {                                                                              \
        for (int64_t i = 0; i < n; ++i) {                                                      \
            const T g = G[i];                                                                  \
            for (int64_t j = crow[i]; j < crow[i + 1]; ++j) {                                  \
                T p = val[j] * g; out[col[j]] = out[col[j]] + p;                               \
            }                                                                                  \
        }                                                                                      \
        return;                                                                                \
    }                                                                                          \
    for (int64_t i = 0; i < n; ++i) {                                                          \
        const T* g = G + i * C;                                                                \
        for (int64_t j = crow[i]; j < crow[i + 1]; ++j) {                                      \
            T* o = out + col[j] * C;                                                           \
            const T v = val[j];                                                                \
            for (int64_t k = 0; k < C; ++k) { T p = v * g[k]; o[k] = o[k] + p; }               \
        }                                                                                      \
    }                                                                                          \
}

FORWARD(csr_margins_f32, float)
FORWARD(csr_margins_f64, double)
BACKWARD(csr_margins_backward_f32, float)
BACKWARD(csr_margins_backward_f64, double)
"""

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    **{f"csr_margins_{s}": (_P, _P, _P, _P, _P, _I64, _I64, _I64, _I) for s in _SUFFIX.values()},
    **{
        f"csr_margins_backward_{s}": (_P, _P, _P, _P, _P, _I64, _I64, _I64)
        for s in _SUFFIX.values()
    },
}


def _lib() -> ctypes.CDLL | None:
    return load(
        "linear",
        _SOURCE,
        _SIGNATURES,
        switch="MODELZOO_LINEAR_NATIVE",
        what="the linear models' CSR product",
    )


def available(X: Tensor, W: Tensor) -> bool:
    """Whether ``X W^T`` (``X`` CSR, ``W`` dense ``(C, F)``) can go through these kernels."""
    return (
        X.layout == torch.sparse_csr
        and X.device.type == "cpu"
        and W.device.type == "cpu"
        and W.dtype in _SUFFIX
        and X.dtype == W.dtype
        and X.crow_indices().dtype == torch.int64
        and X.col_indices().dtype == torch.int64
        and _lib() is not None
    )


def _parts(X: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return (
        X.crow_indices().contiguous(),
        X.col_indices().contiguous(),
        X.values().contiguous(),
    )


def csr_margins(X: Tensor, W: Tensor) -> Tensor:
    """``X W^T``: ``(n, C)`` from CSR ``X`` ``(n, F)`` and ``W`` ``(C, F)``."""
    crow, col, val = _parts(X)
    W = W.detach().contiguous()
    n, (C, F) = X.shape[0], W.shape
    out = torch.empty(n, C, dtype=W.dtype)
    fn = getattr(_lib(), f"csr_margins_{_SUFFIX[W.dtype]}")
    fn(crow.data_ptr(), col.data_ptr(), val.data_ptr(), W.data_ptr(), out.data_ptr(),
       n, C, F, torch.get_num_threads())  # fmt: skip
    return out


def csr_margins_backward(X: Tensor, G: Tensor) -> Tensor:
    """``X^T G``: ``(F, C)`` from CSR ``X`` ``(n, F)`` and ``G`` ``(n, C)``."""
    crow, col, val = _parts(X)
    G = G.detach().contiguous()
    n, F, C = X.shape[0], X.shape[1], G.shape[1]
    out = torch.empty(F, C, dtype=G.dtype)
    fn = getattr(_lib(), f"csr_margins_backward_{_SUFFIX[G.dtype]}")
    fn(crow.data_ptr(), col.data_ptr(), val.data_ptr(), G.data_ptr(), out.data_ptr(), n, C, F)
    return out
