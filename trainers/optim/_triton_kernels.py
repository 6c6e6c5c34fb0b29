"""The Triton kernels of :mod:`._triton` (imported on first use: it imports triton).

Plain functions: :func:`modelzoo._triton.jit` makes them kernels, compiled or interpreted.
Sums are ``tl.reduce(x, 0, _sum_combine)``, what ``tl.sum`` runs for float32: Triton's
interpreter runs that builtin but not the ``tl.sum`` wrapper unless ``TRITON_INTERPRET`` was
set before triton was first imported.
"""

import triton.language as tl
from triton.language.standard import _sum_combine


def moments(
    g_addr, m_addr, v_addr, w_addr, sizes, tile_tensor, tile_start,
    scale, scale_stride, partial,
    one_minus_beta1, beta2, one_minus_beta2, eps, alpha_m, alpha_c,
    SCALED: tl.constexpr, NORMS: tl.constexpr, LANS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    t = tl.load(tile_tensor + i)
    offs = tl.load(tile_start + i) + tl.arange(0, BLOCK)
    mask = offs < tl.load(sizes + t)
    g_ptr = tl.load(g_addr + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(m_addr + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_addr + t).to(tl.pointer_type(tl.float32))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    if SCALED:
        g = g * tl.load(scale + t * scale_stride)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    # torch's lerp: x + w (e - x) for w < 0.5, else e - (e - x)(1 - w)
    m = tl.where(
        one_minus_beta1 < 0.5,
        m + one_minus_beta1 * (g - m),
        g - (g - m) * (1.0 - one_minus_beta1),
    )
    v = v * beta2 + one_minus_beta2 * g * g
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if NORMS:
        w_ptr = tl.load(w_addr + t).to(tl.pointer_type(tl.float32))
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        d = 1.0 / (tl.sqrt_rn(v) + eps)
        u_m = d * m
        if alpha_m != 0.0:
            u_m = u_m + alpha_m * w
        u_m = tl.where(mask, u_m, 0.0)
        tl.store(partial + i * 3, tl.reduce(w * w, 0, _sum_combine))
        tl.store(partial + i * 3 + 1, tl.reduce(u_m * u_m, 0, _sum_combine))
        if LANS:
            u_c = d * g
            if alpha_c != 0.0:
                u_c = u_c + alpha_c * w
            u_c = tl.where(mask, u_c, 0.0)
            tl.store(partial + i * 3 + 2, tl.reduce(u_c * u_c, 0, _sum_combine))


def apply(
    g_addr, m_addr, v_addr, w_addr, sizes, tile_tensor, tile_start,
    scale, scale_stride, coef_m, coef_c, coef_stride,
    eps, alpha_m, alpha_c,
    SCALED: tl.constexpr, LANS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    t = tl.load(tile_tensor + i)
    offs = tl.load(tile_start + i) + tl.arange(0, BLOCK)
    mask = offs < tl.load(sizes + t)
    m_ptr = tl.load(m_addr + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_addr + t).to(tl.pointer_type(tl.float32))
    w_ptr = tl.load(w_addr + t).to(tl.pointer_type(tl.float32))
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    d = 1.0 / (tl.sqrt_rn(v) + eps)
    u_m = d * m
    if alpha_m != 0.0:
        u_m = u_m + alpha_m * w
    out = w + u_m * tl.load(coef_m + t * coef_stride)
    if LANS:
        g_ptr = tl.load(g_addr + t).to(tl.pointer_type(tl.float32))
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        if SCALED:
            g = g * tl.load(scale + t * scale_stride)
        u_c = d * g
        if alpha_c != 0.0:
            u_c = u_c + alpha_c * w
        out = out + u_c * tl.load(coef_c + t * coef_stride)
    tl.store(w_ptr + offs, out, mask=mask)
