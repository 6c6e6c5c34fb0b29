"""The Triton kernels of :mod:`.gpu` (imported on first use: it imports triton).

Plain functions: :func:`modelzoo._triton.jit` makes them kernels, compiled or interpreted.
Sums are ``tl.reduce(x, 0, _sum_combine)``, what ``tl.sum`` runs (see
trainers/optim/_triton_kernels.py for why).
"""

import triton.language as tl
from triton.language.standard import _sum_combine


def seg_dots(x, y, base, sizes, tile_tensor, tile_start, partial, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    t = tl.load(tile_tensor + i)
    offs = tl.load(tile_start + i) + tl.arange(0, BLOCK)
    mask = offs < tl.load(sizes + t)
    at = tl.load(base + t) + offs
    a = tl.load(x + at, mask=mask, other=0.0).to(tl.float64)
    b = tl.load(y + at, mask=mask, other=0.0).to(tl.float64)
    tl.store(partial + i * 3, tl.reduce(a * b, 0, _sum_combine))
    tl.store(partial + i * 3 + 1, tl.reduce(a * a, 0, _sum_combine))
    tl.store(partial + i * 3 + 2, tl.reduce(b * b, 0, _sum_combine))


def seg_axpby(x, y, base, sizes, tile_tensor, tile_start, p, q, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    t = tl.load(tile_tensor + i)
    offs = tl.load(tile_start + i) + tl.arange(0, BLOCK)
    mask = offs < tl.load(sizes + t)
    at = tl.load(base + t) + offs
    a = tl.load(x + at, mask=mask, other=0.0)
    b = tl.load(y + at, mask=mask, other=0.0).to(tl.float64)
    out = tl.load(p + t) * a.to(tl.float64) + tl.load(q + t) * b
    if a.dtype != tl.float64:  # through float32, as torch rounds a double to fp16 / bf16
        out = out.to(tl.float32)
    if a.dtype == tl.bfloat16:
        # torch's (c10) round to nearest even on the bits: the same in Triton's interpreter,
        # whose own float32 -> bfloat16 cast does not carry a rounded-up mantissa
        bits = out.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        half = tl.where(out != out, 0x7FC0, bits >> 16).to(tl.uint16)
        tl.store(x + at, half.to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(x + at, out.to(a.dtype), mask=mask)
