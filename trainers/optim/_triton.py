"""LAMB's and LANS's step on CUDA in two Triton launches over all tensors of a bucket.

On CUDA the torch path of :mod:`._multi_tensor` runs about a dozen ``torch._foreach_*``
passes, and its last one, ``w += r_k u`` with a per-tensor trust ratio ``r_k`` held on the
device, takes torch's slow path (``torch._foreach_addcmul_`` with 0-d coefficients of other
shapes than the tensors): one launch per tensor. Here (tiles as in :mod:`modelzoo._triton`):

* :func:`moments_` reads ``g, m, v, w``, writes the new ``m`` and ``v``, and sums per tile
  ``w^2``, ``u_m^2`` and, for LANS, ``u_c^2``, where ``g' = c_k g`` (the clip, or LANS's
  per-tensor ``1 / ||g||``), ``m = lerp(m, g', 1 - beta1)``, ``v = beta2 v + (1 - beta2) g'^2``,
  ``d = 1 / (sqrt(v) + eps)``, ``u_m = d m + a_m w`` and ``u_c = d g' + a_c w``. The tile sums
  are added per tensor by one ``segment_reduce`` (a fixed order: the same bits every run).
* :func:`apply_` reads ``m, v, w`` (and ``g``), computes ``u_m`` (``u_c``) again with the same
  arithmetic, and writes ``w + r_m u_m (+ r_c u_c)``.

So the update is never stored: the step reads the parameters and state twice and writes them
once, with no work buffer and no host synchronisation. The arithmetic is the torch path's, in
fp32, but not its bits (Triton may fuse multiply-adds that torch's CUDA kernels round apart);
``tests/trainers/test_optim_triton.py`` checks it against the torch path in Triton's
interpreter, and ``benchmarks/gpu_check.py`` on a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import SimpleNamespace

import torch
from torch import Tensor

from modelzoo import _triton

from ._native import one_dense_layout

__all__ = ["BLOCK", "apply_", "available", "moments_"]

BLOCK = 2048  # elements per tile (a program)
WHAT = "LAMB's and LANS's fused passes"


def available(*lists: Sequence[Tensor]) -> bool:
    """True when the parallel lists of tensors can go through these kernels: float32 on CUDA
    (CPU under ``MODELZOO_TRITON=interpret``), each tensor's operands one dense layout."""
    first = lists[0]
    if not first or first[0].dtype != torch.float32:
        return False
    device = first[0].device
    if not _triton.usable(device, WHAT):  # first: off the GPU it answers at once
        return False
    return one_dense_layout(lists)


@functools.cache
def _kernels(mode: str) -> SimpleNamespace:
    """The two kernels, built for ``mode`` (``MODELZOO_TRITON``) on first use."""
    from . import _triton_kernels as k

    return SimpleNamespace(moments=_triton.jit(k.moments), apply=_triton.jit(k.apply))


_UNSCALED: dict[torch.device, Tensor] = {}  # a placeholder the kernels do not read


def _scale(scale: Tensor | None, n: int, device: torch.device) -> tuple[Tensor, int, bool]:
    if scale is None:
        if device not in _UNSCALED:
            _UNSCALED[device] = torch.ones(1, device=device)
        return _UNSCALED[device], 0, False
    scale = scale.detach().to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    if scale.numel() not in (1, n):
        raise ValueError(f"scale has {scale.numel()} values for {n} tensors")
    return scale, int(scale.numel() != 1), True


def moments_(
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    weights: Sequence[Tensor],
    *,
    beta1: float,
    beta2: float,
    eps: float,
    alpha_m: float,
    scale: Tensor | None = None,
    lans: bool = False,
    alpha_c: float = 0.0,
    norms: bool = True,
    block: int | None = None,
) -> Tensor | None:
    """Update the moments in place (``g' = scale_k g``; ``g`` is not written) and, with
    ``norms``, return the float32 ``(N, 3)`` per-tensor sums ``(|w|^2, |u_m|^2, |u_c|^2)``
    (the third 0 unless ``lans``). ``scale``: one value or one per tensor, on the device.

    Raises:
        modelzoo._triton.Unavailable: the kernel could not be built (warned once; nothing
            was written, and the caller takes the torch path from then on).
    """
    n = len(grads)
    device = grads[0].device
    block = block or BLOCK
    table = _triton.tiles([t.numel() for t in grads], block, device)
    scale_t, stride, scaled = _scale(scale, n, device)
    partial = torch.zeros(table.n, 3, dtype=torch.float32, device=device)
    try:  # the first pass of a step: a kernel that cannot be built leaves the state as it was
        _kernels(_triton.mode()).moments[(table.n,)](
            _triton.addresses(grads), _triton.addresses(exp_avgs),
            _triton.addresses(exp_avg_sqs), _triton.addresses(weights), table.sizes,
            table.tensor, table.start, scale_t, stride, partial,
            1.0 - beta1, beta2, 1.0 - beta2, eps, alpha_m, alpha_c,
            SCALED=scaled, NORMS=norms, LANS=lans, BLOCK=block,
        )  # fmt: skip
    except Exception as err:  # noqa: BLE001 - whatever the compiler lacks: the torch path
        raise _triton.disable(WHAT, err) from err
    if not norms:
        return None
    # unsafe: the lengths are the tile table's own (checking them would wait for the device)
    return torch.segment_reduce(partial, "sum", lengths=table.count, axis=0, unsafe=True)


def apply_(
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    weights: Sequence[Tensor],
    coef_m: Tensor,
    *,
    eps: float,
    alpha_m: float,
    scale: Tensor | None = None,
    coef_c: Tensor | None = None,
    alpha_c: float = 0.0,
    block: int | None = None,
) -> None:
    """``w += coef_m[k] u_m (+ coef_c[k] u_c)``, the updates computed again from the moments
    :func:`moments_` wrote (LANS's ``u_c`` when ``coef_c`` is given). The coefficients: one
    value or one per tensor, on the device."""
    n = len(weights)
    device = weights[0].device
    block = block or BLOCK
    table = _triton.tiles([t.numel() for t in weights], block, device)
    scale_t, stride, scaled = _scale(scale, n, device)
    cm = coef_m.detach().to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    cc = cm if coef_c is None else coef_c.detach().to(device=device, dtype=torch.float32)
    cc = cc.reshape(-1).contiguous()
    if cm.numel() not in (1, n) or cc.numel() != cm.numel():
        raise ValueError(f"coefficients of {cm.numel()} and {cc.numel()} values for {n} tensors")
    _kernels(_triton.mode()).apply[(table.n,)](
        _triton.addresses(grads), _triton.addresses(exp_avgs), _triton.addresses(exp_avg_sqs),
        _triton.addresses(weights), table.sizes, table.tensor, table.start,
        scale_t, stride, cm, cc, int(cm.numel() != 1),
        eps, alpha_m, alpha_c,
        SCALED=scaled, LANS=coef_c is not None, BLOCK=block,
    )  # fmt: skip
