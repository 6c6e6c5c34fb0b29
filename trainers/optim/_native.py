"""LAMB's and LANS's element-wise passes in C: the moments in one pass, the update in another.

The torch path of :mod:`._multi_tensor` runs about a dozen ``torch._foreach_*`` passes over
the parameters per step (the clip, the two moments, the denominator in four, the update in
two); each reads and writes whole parameter-sized tensors, so on CPU the step costs the
memory traffic of those passes. Here the same arithmetic runs in two passes:

* ``moments``: ``g' = c_k g`` (the clip or LANS's per-tensor normalisation, optionally kept),
  ``m = lerp(m, g', 1 - beta1)``, ``v = beta2 v + (1 - beta2) g'^2``;
* ``update``: with ``s = sqrt(v)`` already in the work buffer, ``d = 1 / (s + eps')``,
  ``u_m = d m + a_m w`` into the work buffer and, for LANS, ``u_c = d g' + a_c w`` over ``g'``.

The square root stays torch's (``torch.sqrt``): on CPU it is MKL's vector square root, which
is not always the correctly rounded one, and the point of these kernels is to compute the
bits the torch path computes. Every other operation is written as torch's CPU kernels compute
it: ``lerp`` as ``fma(w, end - x, x)`` (``fma(w - 1, end - x, end)`` for ``w >= 0.5``),
``addcmul`` as ``fma(value * a, b, x)``, ``add(..., alpha)`` as ``fma(b, alpha, x)``,
division, reciprocal and products rounded once each. The library is built without FMA
contraction, so only the written ``fmaf`` calls fuse, on every machine
(tests/trainers/test_optim_native.py checks the bits against the torch path on tensors of
many sizes). The norms stay torch's; LANS's two final ``w += r u`` terms run in one pass
(``apply``: two FMAs, as torch's two ``addcmul_`` compute them).

Work is split over ``torch.get_num_threads()`` POSIX threads by element ranges across the
tensors of a bucket: an element's arithmetic does not depend on the split. Only CPU float32
tensors whose operands share one dense layout take this path, where torch's kernels run at
the AVX2 or AVX-512 level (at its "DEFAULT" level torch does not fuse the multiply-adds); ``MODELZOO_OPTIM_NATIVE=0``
or a missing C compiler leaves the torch path (warned once).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from modelzoo._native import load

__all__ = ["apply_", "available", "moments_", "one_dense_layout", "update_"]

_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#define MAX_THREADS 64

typedef void (*span_fn)(const void* args, int64_t k, int64_t i0, int64_t i1);
typedef struct { span_fn fn; const void* args; const int64_t* n; int64_t K, lo, hi; } part;

/* Elements [lo, hi) of the tensors laid end to end, as spans of each tensor. */
static void* run_part(void* arg) {
    const part* p = (const part*)arg;
    int64_t off = 0;
    for (int64_t k = 0; k < p->K && off < p->hi; ++k) {
        int64_t a = off, b = off + p->n[k];
        int64_t s = a > p->lo ? a : p->lo, e = b < p->hi ? b : p->hi;
        if (s < e) p->fn(p->args, k, s - a, e - a);
        off = b;
    }
    return 0;
}

static void parallel(span_fn fn, const void* args, const int64_t* n, int64_t K, int threads) {
    int64_t total = 0;
    for (int64_t k = 0; k < K; ++k) total += n[k];
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > total / 32768) threads = (int)(total / 32768); /* >= 32 Ki elements each */
    if (threads < 1) threads = 1;
    part parts[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; ++t) {
        part q = {fn, args, n, K, total * t / threads, total * (t + 1) / threads};
        parts[t] = q;
    }
    for (int t = 1; t < threads; ++t)
        started[t] = pthread_create(&tid[t], 0, run_part, &parts[t]) == 0;
    run_part(&parts[0]);
    for (int t = 1; t < threads; ++t) {
        if (started[t]) pthread_join(tid[t], 0); else run_part(&parts[t]);
    }
}

/* ---- moments: g' = c g; m = lerp(m, g', w1); v = fma(s2 g', g', v b2) ---------------- */
typedef struct {
    float* const* g; float* const* gout; float* const* m; float* const* v;
    const float* scale; int64_t scale_stride; float w1, b2, s2; int scaled;
} moments_args;

static void moments_span(const void* a_, int64_t k, int64_t i0, int64_t i1) {
    const moments_args* a = (const moments_args*)a_;
    const float* g = a->g[k];
    float* go = a->gout ? a->gout[k] : 0;
    float* m = a->m[k];
    float* v = a->v[k];
    const float c = a->scale[k * a->scale_stride], w1 = a->w1, b2 = a->b2, s2 = a->s2;
    const int small = fabsf(w1) < 0.5f;
    const float coeff = small ? w1 : w1 - 1.0f;
    const int scaled = a->scaled;
    for (int64_t i = i0; i < i1; ++i) {
        float gi = scaled ? g[i] * c : g[i];
        if (go) go[i] = gi;
        float mi = m[i];
        m[i] = fmaf(coeff, gi - mi, small ? mi : gi);
        v[i] = fmaf(s2 * gi, gi, v[i] * b2);
    }
}

void moments(float* const* g, float* const* gout, float* const* m, float* const* v,
             const int64_t* n, int64_t K, const float* scale, int64_t scale_stride, int scaled,
             float w1, float b2, float s2, int threads) {
    moments_args a = {g, gout, m, v, scale, scale_stride, w1, b2, s2, scaled};
    parallel(moments_span, &a, n, K, threads);
}

/* ---- update: d = 1 / (s + eps); s = fma(w, am, d m); gc = fma(w, ac, gc d) -------------- */
typedef struct {
    float* const* s; const float* const* m; const float* const* w; float* const* gc;
    float eps, am, ac; int add_m, add_c;
} update_args;

static void update_span(const void* a_, int64_t k, int64_t i0, int64_t i1) {
    const update_args* a = (const update_args*)a_;
    float* s = a->s[k];
    const float* m = a->m[k];
    const float* w = a->w[k];
    float* gc = a->gc ? a->gc[k] : 0;
    const float eps = a->eps, am = a->am, ac = a->ac;
    const int add_m = a->add_m, add_c = a->add_c;
    for (int64_t i = i0; i < i1; ++i) {
        float d = 1.0f / (s[i] + eps);
        if (gc) {
            float uc = gc[i] * d;
            gc[i] = add_c ? fmaf(w[i], ac, uc) : uc;
        }
        float um = d * m[i];
        s[i] = add_m ? fmaf(w[i], am, um) : um;
    }
}

void update(float* const* s, const float* const* m, const float* const* w, float* const* gc,
            const int64_t* n, int64_t K, float eps, float am, int add_m, float ac, int add_c,
            int threads) {
    update_args a = {s, m, w, gc, eps, am, ac, add_m, add_c};
    parallel(update_span, &a, n, K, threads);
}

/* ---- apply: w = fma(b, cb[k], fma(a, ca[k], w)) (torch's addcmul_ with 0-d tensors, twice) -- */
typedef struct { float* const* w; const float* const* a; const float* const* b;
                 const float* ca; const float* cb; } apply_args;

static void apply_span(const void* a_, int64_t k, int64_t i0, int64_t i1) {
    const apply_args* p = (const apply_args*)a_;
    float* w = p->w[k];
    const float* a = p->a[k];
    const float ca = p->ca[k];
    if (p->b) {
        const float* b = p->b[k];
        const float cb = p->cb[k];
        for (int64_t i = i0; i < i1; ++i) w[i] = fmaf(b[i], cb, fmaf(a[i], ca, w[i]));
    } else {
        for (int64_t i = i0; i < i1; ++i) w[i] = fmaf(a[i], ca, w[i]);
    }
}

void apply(float* const* w, const float* const* a, const float* const* b, const int64_t* n,
           int64_t K, const float* ca, const float* cb, int threads) {
    apply_args p = {w, a, b, ca, cb};
    parallel(apply_span, &p, n, K, threads);
}
"""

_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "moments": (_P, _P, _P, _P, _P, _I64, _P, _I64, _I, _F, _F, _F, _I),
    "update": (_P, _P, _P, _P, _P, _I64, _F, _F, _I, _F, _I, _I),
    "apply": (_P, _P, _P, _P, _I64, _P, _P, _I),
}


# torch's vectorized CPU kernels fuse lerp, addcmul and add-alpha into FMAs at the AVX2 and
# AVX-512 levels; at the "DEFAULT" level (no SIMD) they round the product and the sum
# separately, which these kernels do not reproduce: there the torch path runs.
_TORCH_FMA = torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512"))


def _lib() -> ctypes.CDLL | None:
    return load(
        "optim",
        _SOURCE,
        _SIGNATURES,
        switch="MODELZOO_OPTIM_NATIVE",
        what="LAMB's and LANS's fused passes",
    )


def available(*lists: Sequence[Tensor]) -> bool:
    """True when the parallel lists of tensors can go through these kernels: CPU float32,
    each tensor's operands one dense layout (same shape and strides), and the library built."""
    first = lists[0]
    if (
        not _TORCH_FMA
        or not first
        or first[0].device.type != "cpu"
        or first[0].dtype != torch.float32
    ):
        return False
    return one_dense_layout(lists) and _lib() is not None


def one_dense_layout(lists: Sequence[Sequence[Tensor]]) -> bool:
    """Whether the parallel lists hold float32 tensors on one device with, per position, one
    shape and strides that fill a block of memory: what a kernel walking every operand of a
    tensor by the same offsets needs."""
    device = lists[0][0].device
    for ts in zip(*lists, strict=True):
        t0 = ts[0]
        if not _dense(t0):
            return False
        for t in ts:
            if (
                t.dtype != torch.float32
                or t.device != device
                or t.shape != t0.shape
                or t.stride() != t0.stride()
            ):
                return False
    return True


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory with no gaps or overlaps (contiguous
    in some order of its dimensions, e.g. channels-last)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted(
        (st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _ptrs(tensors: Sequence[Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


def _sizes(tensors: Sequence[Tensor]) -> ctypes.Array:
    return (ctypes.c_int64 * len(tensors))(*(t.numel() for t in tensors))


def moments_(
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    beta1: float,
    beta2: float,
    scale: Tensor | None = None,
    out: Sequence[Tensor] | None = None,
) -> None:
    """``g' = scale_k g`` (written to ``out`` when given), then in place
    ``torch._foreach_lerp_(m, g', 1 - beta1)``, ``torch._foreach_mul_(v, beta2)``,
    ``torch._foreach_addcmul_(v, g', g', value=1 - beta2)``, bit for bit.

    ``scale``: a float32 tensor of one value (broadcast) or one per tensor; its values are
    read by the kernel, not on the host.
    """
    if scale is not None:
        scale = scale.detach().to(torch.float32).contiguous()
        stride = 0 if scale.numel() == 1 else 1
        assert scale.numel() in (1, len(grads))
        scale_ptr, scaled = scale.data_ptr(), 1
    else:
        one = torch.ones(1)
        scale, stride, scale_ptr, scaled = one, 0, one.data_ptr(), 0
    _lib().moments(
        _ptrs(grads),
        _ptrs(out) if out is not None else None,
        _ptrs(exp_avgs),
        _ptrs(exp_avg_sqs),
        _sizes(grads),
        len(grads),
        scale_ptr,
        stride,
        scaled,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        torch.get_num_threads(),
    )


def update_(
    sqrt_v: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    weights: Sequence[Tensor],
    *,
    eps: float,
    alpha_m: float,
    grads: Sequence[Tensor] | None = None,
    alpha_c: float = 0.0,
) -> None:
    """With ``sqrt_v`` holding ``sqrt(v)``: ``d = 1 / (sqrt_v + eps)``, then in place
    ``sqrt_v = d * m + alpha_m * w`` and, when ``grads`` is given, ``grads = grads * d +
    alpha_c * w``; an ``alpha`` of 0 adds nothing (as the torch path skips the add)."""
    _lib().update(
        _ptrs(sqrt_v),
        _ptrs(exp_avgs),
        _ptrs(weights),
        _ptrs(grads) if grads is not None else None,
        _sizes(sqrt_v),
        len(sqrt_v),
        eps,
        alpha_m,
        int(alpha_m != 0.0),
        alpha_c,
        int(alpha_c != 0.0),
        torch.get_num_threads(),
    )


def apply_(
    weights: Sequence[Tensor],
    a: Sequence[Tensor],
    coef_a: Tensor,
    b: Sequence[Tensor] | None = None,
    coef_b: Tensor | None = None,
) -> None:
    """``torch._foreach_addcmul_(w, a, coef_a.unbind(0))`` and then, when ``b`` is given,
    ``torch._foreach_addcmul_(w, b, coef_b.unbind(0))``, in one pass: per-tensor float32
    coefficients, read by the kernel (not on the host)."""
    coef_a = coef_a.detach().to(torch.float32).contiguous()
    assert coef_a.numel() == len(weights)
    if b is not None:
        assert coef_b is not None
        coef_b = coef_b.detach().to(torch.float32).contiguous()
        assert coef_b.numel() == len(weights)
    _lib().apply(
        _ptrs(weights),
        _ptrs(a),
        _ptrs(b) if b is not None else None,
        _sizes(weights),
        len(weights),
        coef_a.data_ptr(),
        coef_b.data_ptr() if coef_b is not None else None,
        torch.get_num_threads(),
    )
