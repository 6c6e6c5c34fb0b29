"""Pillow's bilinear resize of a box of a decoded RGB array, in C, straight into a CHW tensor.

The arithmetic is Pillow's (``libImaging/Resample.c``): the triangle filter widened by the
downscaling factor, centred at ``box0 + (i + 0.5) * scale``, 22-bit fixed-point weights, two
separable passes each rounded and clipped to uint8, a pass skipped when its axis does not
change. The vertical pass runs first (Pillow 13 does so when the height shrinks much more
than the width; earlier versions always ran the horizontal one first): the result is, to the
bit, ``Image.resize((W, out_h), BILINEAR, box=(0, top, W, bottom))`` followed by
``resize((out_w, out_h), BILINEAR, box=(left, 0, right, out_h))`` (tested), and within one
grey level of a direct ``Image.resize`` with the box. Any box works, fractional ones
included: the box of a DCT-scaled JPEG decode falls on half pixels, which torch's
antialiased resize cannot take, while Pillow itself needs the array copied into an image
first and takes about 4x this kernel's time for a 224 crop.

Both passes run as multiply-adds over whole contiguous rows (the intermediate is kept
transposed), which the compiler vectorizes; the output is written channel-first.

The kernel is compiled on first use (:mod:`modelzoo._native`); without a C compiler, or with
``MODELZOO_NATIVE_RESIZE=0``, :func:`available` is False and callers use Pillow or torch.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from modelzoo._native import load

__all__ = ["available", "resize_bilinear_chw"]

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define PRECISION_BITS (32 - 8 - 2)

static double bilinear_filter(double x) {
    if (x < 0.0) x = -x;
    if (x < 1.0) return 1.0 - x;
    return 0.0;
}

/* Pillow's precompute_coeffs + normalize_coeffs_8bpc (filter support 1: bilinear). */
static int coeffs(int in_size, float in0, float in1, int out_size, int** bounds_p, int32_t** kk_p) {
    double scale, filterscale, support, center, ww, ss;
    int xx, x, ksize, xmin, xmax;
    filterscale = scale = (double)(in1 - in0) / out_size;
    if (filterscale < 1.0) filterscale = 1.0;
    support = 1.0 * filterscale;
    ksize = (int)ceil(support) * 2 + 1;
    double* pre = (double*)malloc(sizeof(double) * out_size * ksize);
    int* bounds = (int*)malloc(sizeof(int) * out_size * 2);
    int32_t* kk = (int32_t*)malloc(sizeof(int32_t) * out_size * ksize);
    if (!pre || !bounds || !kk) { free(pre); free(bounds); free(kk); return -1; }
    for (xx = 0; xx < out_size; xx++) {
        double* k = &pre[xx * ksize];
        center = in0 + (xx + 0.5) * scale;
        ww = 0.0;
        ss = 1.0 / filterscale;
        xmin = (int)(center - support + 0.5);
        if (xmin < 0) xmin = 0;
        xmax = (int)(center + support + 0.5);
        if (xmax > in_size) xmax = in_size;
        xmax -= xmin;
        for (x = 0; x < xmax; x++) {
            double w = bilinear_filter((x + xmin - center + 0.5) * ss);
            k[x] = w;
            ww += w;
        }
        for (x = 0; x < xmax; x++) {
            if (ww != 0.0) k[x] /= ww;
        }
        for (; x < ksize; x++) k[x] = 0;
        bounds[xx * 2 + 0] = xmin;
        bounds[xx * 2 + 1] = xmax;
    }
    for (x = 0; x < out_size * ksize; x++) {
        if (pre[x] < 0) kk[x] = (int32_t)(-0.5 + pre[x] * (1 << PRECISION_BITS));
        else kk[x] = (int32_t)(0.5 + pre[x] * (1 << PRECISION_BITS));
    }
    free(pre);
    *bounds_p = bounds;
    *kk_p = kk;
    return ksize;
}

static inline uint8_t clip8(int32_t in) {
    if (in >= (1 << PRECISION_BITS << 8)) return 255;
    if (in <= 0) return 0;
    return (uint8_t)(in >> PRECISION_BITS);
}

/* acc[0:n] = rounding + sum_t rows[t][0:n] * k[t] (rows `stride` bytes apart), clipped. */
static void taps_row(const uint8_t* restrict src, int64_t stride, const int32_t* restrict k,
                     int taps, int n, int32_t* restrict acc, uint8_t* restrict dst) {
    for (int i = 0; i < n; i++) acc[i] = 1 << (PRECISION_BITS - 1);
    for (int t = 0; t < taps; t++) {
        const uint8_t* restrict row = src + (int64_t)t * stride;
        const int32_t kt = k[t];
        for (int i = 0; i < n; i++) acc[i] += row[i] * kt;
    }
    for (int i = 0; i < n; i++) dst[i] = clip8(acc[i]);
}

/* in: (in_h, in_w, 3) rows in_stride bytes apart; out: (3, out_h, out_w) contiguous.
   Returns 0, or -1 when memory ran out. */
int resize_bilinear_chw(const uint8_t* in, int in_h, int in_w, int64_t in_stride,
                        float box0, float box1, float box2, float box3,
                        uint8_t* out, int out_h, int out_w) {
    int need_h = out_w != in_w || box0 != 0 || box2 != out_w;
    int need_v = out_h != in_h || box1 != 0 || box3 != out_h;
    int *bh = NULL, *bv = NULL;
    int32_t *kh = NULL, *kv = NULL, *acc = NULL;
    uint8_t *mid = NULL, *midT = NULL, *outT = NULL;
    int status = -1;
    int ksh = coeffs(in_w, box0, box2, out_w, &bh, &kh);
    int ksv = coeffs(in_h, box1, box3, out_h, &bv, &kv);
    if (ksh < 0 || ksv < 0) goto done;
    int first = need_h ? bh[0] : 0;  /* the columns the horizontal pass reads */
    int cols = need_h ? bh[out_w * 2 - 2] + bh[out_w * 2 - 1] - first : in_w;
    int rows = need_v ? out_h : in_h;
    int n = (cols > out_w ? cols : out_w) * 3;
    if (rows * 3 > n) n = rows * 3;
    acc = (int32_t*)malloc(sizeof(int32_t) * (size_t)n);
    mid = (uint8_t*)malloc((size_t)rows * cols * 3);       /* (rows, cols, 3) */
    midT = (uint8_t*)malloc((size_t)cols * rows * 3);      /* (cols, rows, 3) */
    outT = (uint8_t*)malloc((size_t)out_w * rows * 3);     /* (out_w, rows, 3) */
    if (!acc || !mid || !midT || !outT) goto done;
    /* vertical pass over the used columns (or a copy of them) */
    for (int yy = 0; yy < rows; yy++) {
        const uint8_t* src = in + (int64_t)first * 3;
        uint8_t* dst = mid + (int64_t)yy * cols * 3;
        if (need_v) {
            taps_row(src + (int64_t)bv[yy * 2] * in_stride, in_stride, &kv[yy * ksv],
                     bv[yy * 2 + 1], cols * 3, acc, dst);
        } else {
            for (int i = 0; i < cols * 3; i++) dst[i] = src[(int64_t)yy * in_stride + i];
        }
    }
    /* transpose to (cols, rows, 3): the horizontal pass becomes row multiply-adds */
    for (int y = 0; y < rows; y++)
        for (int x = 0; x < cols; x++)
            for (int c = 0; c < 3; c++) midT[((int64_t)x * rows + y) * 3 + c] = mid[((int64_t)y * cols + x) * 3 + c];
    for (int xx = 0; xx < out_w; xx++) {
        uint8_t* dst = outT + (int64_t)xx * rows * 3;
        if (need_h) {
            taps_row(midT + (int64_t)(bh[xx * 2] - first) * rows * 3, (int64_t)rows * 3,
                     &kh[xx * ksh], bh[xx * 2 + 1], rows * 3, acc, dst);
        } else {
            for (int i = 0; i < rows * 3; i++) dst[i] = midT[(int64_t)xx * rows * 3 + i];
        }
    }
    /* (out_w, out_h, 3) -> (3, out_h, out_w) */
    for (int c = 0; c < 3; c++)
        for (int y = 0; y < out_h; y++)
            for (int x = 0; x < out_w; x++)
                out[((int64_t)c * out_h + y) * out_w + x] = outT[((int64_t)x * out_h + y) * 3 + c];
    status = 0;
done:
    free(acc); free(mid); free(midT); free(outT); free(bh); free(kh); free(bv); free(kv);
    return status;
}
"""

_I, _F, _P = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {"resize_bilinear_chw": (_P, _I, _I, ctypes.c_int64, _F, _F, _F, _F, _P, _I, _I)}


def _lib() -> ctypes.CDLL | None:
    return load(
        "resample", _SOURCE, _SIGNATURES, switch="MODELZOO_NATIVE_RESIZE", what="image resize"
    )


def available() -> bool:
    """True when the C kernel is built (it is compiled on the first call)."""
    return _lib() is not None


def resize_bilinear_chw(
    arr: np.ndarray, box: tuple[float, float, float, float], size: tuple[int, int]
) -> torch.Tensor:
    """The ``box`` of an RGB array resized to ``size`` with Pillow's bilinear filter.

    Args:
        arr: ``(H, W, 3)`` uint8 with contiguous rows (a row slice of a bigger array works).
        box: ``(left, top, right, bottom)`` in ``arr``'s pixels, fractions allowed, inside it.
        size: ``(width, height)`` of the result.

    Returns:
        A new contiguous ``(3, height, width)`` uint8 tensor.

    Raises:
        ValueError: a wrong array layout, an empty or outside box, a non-positive size.
        RuntimeError: the kernel is not available (check :func:`available`).
    """
    lib = _lib()
    if lib is None:
        raise RuntimeError("the C resize kernel is not available (see modelzoo._native)")
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"resize_bilinear_chw needs an (H, W, 3) uint8 array, got {arr.dtype} {arr.shape}")  # fmt: skip
    if arr.strides[1:] != (3, 1):
        raise ValueError(f"resize_bilinear_chw needs contiguous rows, got strides {arr.strides}")
    height, width = arr.shape[:2]
    left, top, right, bottom = (float(v) for v in box)
    if not (0 <= left < right <= width and 0 <= top < bottom <= height):
        raise ValueError(f"box {box} is empty or outside the {width}x{height} array")
    out_w, out_h = (int(v) for v in size)
    if out_w <= 0 or out_h <= 0:
        raise ValueError(f"size must be positive, got {size}")
    out = torch.empty((3, out_h, out_w), dtype=torch.uint8)
    err = lib.resize_bilinear_chw(arr.ctypes.data, height, width, arr.strides[0],
                                  left, top, right, bottom, out.data_ptr(), out_h, out_w)  # fmt: skip
    if err:
        raise MemoryError("resize_bilinear_chw: out of memory")
    return out
