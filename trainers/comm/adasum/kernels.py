"""Adasum's kernels on one rank's slice of a fused buffer: per-tensor dots and a*x + b*y.

A slice goes through the C kernels on CPU (:mod:`.native`) and the Triton kernels on CUDA
(:mod:`.gpu`), one call for all its spans; the torch kernels below are the fallback. Dots
and norms accumulate in float64 (products of the widened values, so exact for fp32, fp16
and bf16): on CPU, long spans in one fused pass (a kernel TorchInductor compiles on first
use), others chunk by chunk (cache-sized) with BLAS, the short segments of many small
tensors together in vectorized runs.
"""

from __future__ import annotations

import bisect
import os
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from modelzoo._triton import Unavailable

from . import gpu, native

_SMALL = 4096  # segments shorter than this are reduced together, vectorized
_RUN = 1 << 18  # at most this many elements of small segments per vectorized pass
_CHUNK = 1 << 17  # CPU: elements per dot-product chunk (two float64 rows: 2 MB, in cache)
_AXPBY_CHUNK = 1 << 19  # CPU: elements of fp16/bf16 widened to fp32 at once
_WIDE = 1e30  # coefficients beyond this would overflow fp32 products: use fp64


_FUSED_MIN = 1 << 14  # CPU: spans at least this long go to the fused (compiled) dot kernel
_FUSED: list[Callable[[Tensor, Tensor, Tensor], None] | None] = []  # made on first use

_BUFFERS: dict[tuple[str, torch.device, torch.dtype], Tensor] = {}


def _workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A persistent buffer of at least ``numel`` elements (fusion / receive / widening).

    Kept between calls, like Horovod's fusion buffer: allocating (and first touching) tens
    of megabytes per step costs as much as the arithmetic.
    """
    key = (name, device, dtype)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _BUFFERS[key] = buf
    return buf[:numel]


def _dots_graph(x: Tensor, y: Tensor, out: Tensor) -> None:
    """``out = (x.y, x.x, y.y)`` of the float64-widened values: the fused kernel's source."""
    xd, yd = x.double(), y.double()
    out.copy_(torch.stack([(xd * yd).sum(), (xd * xd).sum(), (yd * yd).sum()]))


def _fused_dots(x: Tensor, y: Tensor, out: Tensor) -> bool:
    """:func:`_dots_graph` compiled by TorchInductor (on first use, once per dtype; seconds)
    into one pass that widens, multiplies and sums without float64 copies in memory: on CPU
    about 3x faster than widening chunks and calling BLAS. False when it is off
    (``MODELZOO_ADASUM_FUSED=0``) or unavailable (no C++ compiler, ...: warned once); the
    caller then computes the same sums eagerly."""
    if not _FUSED:
        enabled = os.environ.get("MODELZOO_ADASUM_FUSED", "1") != "0"
        _FUSED.append(torch.compile(_dots_graph, dynamic=True, fullgraph=True) if enabled else None)
    fused = _FUSED[0]
    if fused is None:
        return False
    try:
        fused(x, y, out)
    except Exception as err:  # noqa: BLE001 - whatever the compiler lacks: fall back, once
        _FUSED[0] = None
        warnings.warn(
            f"Adasum's fused dot-product kernel is unavailable ({type(err).__name__}: "
            f"{str(err)[:200]}); computing the dots with BLAS instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def _dots(x: Tensor, y: Tensor, out: Tensor) -> None:
    """``out = (x.y, x.x, y.y)`` accumulated in float64.

    On CPU, long spans go to the fused kernel (:func:`_fused_dots`). Otherwise chunk by
    chunk: fp32/fp16/bf16 chunks are widened once into a cache-sized float64 buffer (two
    rows, ``x`` and ``y``) and read by three BLAS dot products there; float64 chunks are read
    in place. (MKL's 2x2 Gram product ``W @ W.T`` is slower than three dots on this kind of
    CPU.) The chunk sums add up in Python floats (float64), which costs no tensor operation
    per chunk. Elsewhere: one widened copy and three dots, no host sync.
    """
    if x.device.type != "cpu":
        xd, yd = x.double(), y.double()
        out.copy_(torch.stack([torch.dot(xd, yd), torch.dot(xd, xd), torch.dot(yd, yd)]))
        return
    if x.numel() >= _FUSED_MIN and _fused_dots(x, y, out):
        return
    step = min(_CHUNK, x.numel())
    dot, xx, yy = 0.0, 0.0, 0.0
    if x.dtype == torch.float64:
        for xc, yc in zip(x.split(step), y.split(step), strict=True):
            dot += torch.dot(xc, yc).item()
            xx += torch.dot(xc, xc).item()
            yy += torch.dot(yc, yc).item()
    else:
        wide = _workspace("wide", 2 * step, torch.float64, x.device).view(2, step)
        w0, w1 = wide[0], wide[1]  # views made once: at this grain they cost like arithmetic
        for xc, yc in zip(x.split(step), y.split(step), strict=True):
            if xc.numel() != step:
                w0, w1 = w0[: xc.numel()], w1[: xc.numel()]
            w0.copy_(xc)
            w1.copy_(yc)
            dot += torch.dot(w0, w1).item()
            xx += torch.dot(w0, w0).item()
            yy += torch.dot(w1, w1).item()
    out[0], out[1], out[2] = dot, xx, yy


def _segment_dots(a: Tensor, b: Tensor, spans: list[tuple[int, int]]) -> Tensor:
    """Per span ``(start, end)`` of ``a``/``b``: ``(a.b, a.a, b.b)`` in float64, shape (k, 3).

    Spans are consecutive. Long ones are reduced one by one; runs of short ones in one
    vectorized pass (``segment_reduce``), so thousands of small tensors stay cheap.
    """
    out = torch.zeros(len(spans), 3, dtype=torch.float64, device=a.device)
    i = 0
    while i < len(spans):
        j = _run_end(spans, i)
        start, end = spans[i][0], spans[j - 1][1]
        if j - i == 1:
            _dots(a[start:end], b[start:end], out[i])
        else:
            lengths = torch.tensor([e - s for s, e in spans[i:j]], device=a.device)
            ad, bd = a[start:end].double(), b[start:end].double()
            for col, prod in enumerate((ad * bd, ad * ad, bd * bd)):
                out[i:j, col] = torch.segment_reduce(prod, "sum", lengths=lengths)
        i = j
    return out


def _run_end(spans: list[tuple[int, int]], i: int) -> int:
    """End (exclusive) of the run of short spans starting at ``i`` (``i + 1`` for a long one)."""
    if spans[i][1] - spans[i][0] >= _SMALL:
        return i + 1
    j, total = i, 0
    while j < len(spans) and spans[j][1] - spans[j][0] < _SMALL and total < _RUN:
        total += spans[j][1] - spans[j][0]
        j += 1
    return j


def _axpby_(x: Tensor, y: Tensor, p: float, q: float) -> None:
    """``x = p x + q y`` in place; fp32 arithmetic for fp32/fp16/bf16, fp64 when needed."""
    wide = x.dtype == torch.float64 or max(abs(p), abs(q)) > _WIDE
    compute = torch.float64 if wide else torch.float32
    if x.dtype == compute:
        x.mul_(p).add_(y, alpha=q)
        return
    step = _AXPBY_CHUNK if x.device.type == "cpu" else 1 << 62
    for k in range(0, x.numel(), step):
        xk, yk = x[k : k + step], y[k : k + step]
        xk.copy_(xk.to(compute).mul_(p).add_(yk.to(compute), alpha=q))


def _segment_axpby_(
    a: Tensor, b: Tensor, spans: list[tuple[int, int]], p: list[float], q: list[float]
) -> None:
    """Per span: ``a = p[i] a + q[i] b`` (the same runs as :func:`_segment_dots`)."""
    i = 0
    while i < len(spans):
        j = _run_end(spans, i)
        start, end = spans[i][0], spans[j - 1][1]
        wide = a.dtype == torch.float64 or max(map(abs, p[i:j] + q[i:j])) > _WIDE
        if j - i == 1 or wide:
            for k in range(i, j):
                s, e = spans[k]
                _axpby_(a[s:e], b[s:e], p[k], q[k])
        else:
            lengths = torch.tensor([e - s for s, e in spans[i:j]], device=a.device)
            pe = torch.tensor(p[i:j], dtype=torch.float32, device=a.device)
            qe = torch.tensor(q[i:j], dtype=torch.float32, device=a.device)
            pe = torch.repeat_interleave(pe, lengths)
            qe = torch.repeat_interleave(qe, lengths)
            x, y = a[start:end], b[start:end]
            if x.dtype == torch.float32:
                x.mul_(pe).addcmul_(y, qe)
            else:
                x.copy_(x.float().mul_(pe).addcmul_(y.float(), qe))
        i = j


def _spans(bounds: Sequence[int], lo: int, hi: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Tensors (ids) meeting the global range [lo, hi) and their spans relative to ``lo``."""
    ids, spans = [], []
    i = max(bisect.bisect_right(bounds, lo) - 1, 0)
    while i < len(bounds) - 1 and bounds[i] < hi:
        s, e = max(bounds[i], lo), min(bounds[i + 1], hi)
        if e > s:
            ids.append(i)
            spans.append((s - lo, e - lo))
        i += 1
    return ids, spans


def _offsets(bounds: Sequence[int], lo: int, hi: int) -> tuple[int, list[int]]:
    """The tensors ``t0, t0 + 1, ...`` whose ranges meet the global range [lo, hi) (empty
    ones between them included), as their boundaries relative to ``lo`` clipped to it."""
    hi = min(hi, bounds[-1])  # a hierarchical shard may end in padding past the tensors
    if hi <= lo:
        return 0, [0]
    t0 = bisect.bisect_right(bounds, lo) - 1  # bounds[t0] <= lo < bounds[t0 + 1]
    t1 = bisect.bisect_left(bounds, hi)  # the first boundary at or past hi
    return t0, [0] + [b - lo for b in bounds[t0 + 1 : t1]] + [hi - lo]


def _accumulate_dots(
    a: Tensor, b: Tensor, lo: int, bounds: Sequence[int], left: bool, part: Tensor
) -> None:
    """Add this slice's per-tensor ``(a.b, |left|^2, |right|^2)`` into ``part`` (T, 3).

    ``a`` is this rank's data on the global range [lo, lo + len(a)), ``b`` the partner's;
    ``left``: ``a`` belongs to the lower-numbered side of the pair.
    """
    fused = native if native.available(a) else gpu if gpu.available(a) else None
    if fused is not None:  # one call (C on CPU, a Triton launch on CUDA); right swaps x, y
        t0, offs = _offsets(bounds, lo, lo + a.numel())
        x, y = (a, b) if left else (b, a)
        try:
            fused.seg_dots_(x, y, offs, part[t0 : t0 + len(offs) - 1])
            return
        except Unavailable:  # warned once; the torch kernels below
            pass
    ids, spans = _spans(bounds, lo, lo + a.numel())
    if spans:
        dots = _segment_dots(a, b, spans)  # (a.b, a.a, b.b)
        if not left:
            dots = dots[:, [0, 2, 1]]
        part.index_add_(0, torch.tensor(ids, device=a.device), dots)


def _apply_(
    a: Tensor, b: Tensor, lo: int, bounds: Sequence[int], mine: list[float], other: list[float]
) -> None:
    """``a = mine[t] a + other[t] b`` for every tensor ``t`` meeting [lo, lo + len(a))."""
    fused = native if native.available(a) else gpu if gpu.available(a) else None
    if fused is not None:
        t0, offs = _offsets(bounds, lo, lo + a.numel())
        t1 = t0 + len(offs) - 1
        try:
            fused.seg_axpby_(a, b, offs, mine[t0:t1], other[t0:t1])
            return
        except Unavailable:  # warned once; the torch kernels below
            pass
    ids, spans = _spans(bounds, lo, lo + a.numel())
    if spans:
        _segment_axpby_(a, b, spans, [mine[i] for i in ids], [other[i] for i in ids])
