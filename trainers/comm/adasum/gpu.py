"""Adasum's CUDA kernels in Triton: per-span dot products and the rule, one launch each.

The torch path on CUDA (:mod:`.kernels`) computes each long span's dots with a widened copy
and three ``torch.dot`` calls, and its ``a x + b y`` per span: a few launches per tensor, so
ResNet-50's 161 tensors cost about 1,000 launches per level. Here the same two operations
the C kernels (:mod:`.native`) do on CPU, with the same signatures, run as one Triton launch
over all spans of a slice (tiles as in :mod:`modelzoo._triton`):

* :func:`seg_dots_`: per span, ``out[s] += (x.y, x.x, y.y)``, every value widened to float64
  before multiplying (exact products); the tile sums are added per span by one
  ``segment_reduce`` (a fixed order: the same bits every run, not the C kernels' bits).
* :func:`seg_axpby_`: per span, ``x = p[s] x + q[s] y``, in float64 and rounded once to
  ``x``'s dtype (as the C kernels and Horovod do).

float32, float64, float16 and bfloat16 on CUDA (CPU under ``MODELZOO_TRITON=interpret``).
A kernel that cannot be built raises :class:`modelzoo._triton.Unavailable` (warned once,
nothing written) and the callers use the torch kernels from then on.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import SimpleNamespace

import torch
from torch import Tensor

from modelzoo import _triton

__all__ = ["BLOCK", "available", "seg_axpby_", "seg_dots_"]

BLOCK = 4096  # elements per tile (a program)
WHAT = "Adasum's fused kernels"
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def available(x: Tensor) -> bool:
    """True when ``x`` (and its partner of the same kind) can go through these kernels."""
    return x.dtype in _DTYPES and _triton.usable(x.device, WHAT)


@functools.cache
def _kernels(mode: str) -> SimpleNamespace:
    from . import _gpu_kernels as k

    return SimpleNamespace(dots=_triton.jit(k.seg_dots), axpby=_triton.jit(k.seg_axpby))


def _spans(offs: Sequence[int], device: torch.device) -> tuple[_triton.Tiles, Tensor]:
    """The tiles of the spans ``[offs[s], offs[s + 1])`` and each span's first element."""
    sizes = [b - a for a, b in zip(offs[:-1], offs[1:], strict=True)]
    return _triton.tiles(sizes, BLOCK, device), _triton.int64_table(offs[:-1], device)


def seg_dots_(x: Tensor, y: Tensor, offs: Sequence[int], out: Tensor) -> None:
    """``out[s] += (x.y, x.x, y.y)`` over ``[offs[s], offs[s + 1])`` of the 1-D contiguous
    ``x`` and ``y``; ``out`` is a contiguous (len(offs) - 1, 3) float64 tensor (it may be
    rows of a bigger one). Empty spans add nothing."""
    assert x.is_contiguous() and y.is_contiguous() and out.is_contiguous()
    assert out.dtype == torch.float64 and x.dtype == y.dtype and out.shape[0] == len(offs) - 1
    assert offs[0] >= 0 and offs[-1] <= min(x.numel(), y.numel())
    if len(offs) < 2:
        return
    table, base = _spans(offs, x.device)
    partial = torch.empty(table.n, 3, dtype=torch.float64, device=x.device)
    try:
        _kernels(_triton.mode()).dots[(table.n,)](
            x, y, base, table.sizes, table.tensor, table.start, partial, BLOCK=BLOCK
        )
    except Exception as err:  # noqa: BLE001 - a kernel that cannot be built: the torch path
        raise _triton.disable(WHAT, err) from err
    # unsafe: the lengths are the tile table's own (checking them would wait for the device)
    out.add_(torch.segment_reduce(partial, "sum", lengths=table.count, axis=0, unsafe=True))


def seg_axpby_(
    x: Tensor, y: Tensor, offs: Sequence[int], p: Sequence[float], q: Sequence[float]
) -> None:
    """``x = p[s] x + q[s] y`` over ``[offs[s], offs[s + 1])`` (float64 arithmetic, rounded
    once)."""
    assert x.is_contiguous() and y.is_contiguous() and x.dtype == y.dtype
    k = len(offs) - 1
    assert len(p) == len(q) == k and offs[0] >= 0 and offs[-1] <= min(x.numel(), y.numel())
    if k < 1:
        return
    table, base = _spans(offs, x.device)
    coef = _triton.to_device([*p, *q], torch.float64, x.device)
    try:
        _kernels(_triton.mode()).axpby[(table.n,)](
            x, y, base, table.sizes, table.tensor, table.start, coef[:k], coef[k:], BLOCK=BLOCK
        )
    except Exception as err:  # noqa: BLE001 - a kernel that cannot be built: the torch path
        raise _triton.disable(WHAT, err) from err
