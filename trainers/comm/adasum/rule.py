"""The pairwise Adasum rule on two tensors (the reference every kernel is tested against).

.. math::
    \\operatorname{adasum}(a, b) = \\Big(1 - \\frac{a \\cdot b}{2\\lVert a\\rVert^2}\\Big) a
                              + \\Big(1 - \\frac{a \\cdot b}{2\\lVert b\\rVert^2}\\Big) b

Example:
    >>> a = torch.tensor([1.0, 0.0]); b = torch.tensor([0.0, 2.0])
    >>> adasum_pair(a, b)  # orthogonal: the sum
    tensor([1., 2.])
    >>> adasum_pair(a, -3 * a)  # parallel: the mean
    tensor([-1.,  0.])
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor

__all__ = ["EPS", "adasum_pair"]

# Horovod's guard on the squared norms: sqrt(DBL_MIN) ~ 1.49e-154
# (horovod/common/ops/adasum/adasum.h, FusedPairwiseReduceWithComm).
EPS = math.sqrt(sys.float_info.min)


def _coefficients(dot: Tensor, na: Tensor, nb: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Horovod's coefficients of ``a`` and ``b`` (float64); 1 where a squared norm is < eps
    or 0 (``eps=0``: a zero side, which would otherwise divide 0 by 0)."""
    one = torch.ones_like(dot)
    ca = torch.where((na >= eps) & (na > 0), 1.0 - dot / na * 0.5, one)
    cb = torch.where((nb >= eps) & (nb > 0), 1.0 - dot / nb * 0.5, one)
    return ca, cb


def _coefficient_pair(dot: float, na: float, nb: float, eps: float) -> tuple[float, float]:
    """:func:`_coefficients` of one tensor in Python floats: the same IEEE float64 operations
    in the same order, so the same bits, without a tensor operation's overhead."""
    ca = 1.0 - dot / na * 0.5 if na >= eps and na > 0.0 else 1.0
    cb = 1.0 - dot / nb * 0.5 if nb >= eps and nb > 0.0 else 1.0
    return ca, cb


def adasum_pair(a: Tensor, b: Tensor, *, eps: float = EPS) -> Tensor:
    """The Adasum of two tensors (one "layer"): ``(1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b``.

    Args:
        a: a floating-point tensor.
        b: a tensor of the same shape and dtype.
        eps: a side whose squared norm is below ``eps`` gets coefficient 1 (Horovod:
            ``sqrt(DBL_MIN)``, about 1.5e-154, so in practice only an exactly zero side). The
            rule is scale-equivariant except through this guard; ``eps=0`` makes it exact at
            every magnitude (coefficient 1 only for an exactly zero side).

    Returns:
        A new tensor of ``a``'s dtype. Dot product, norms and the linear combination are
        computed in float64 and rounded once.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"adasum_pair needs tensors of one shape and dtype, got {tuple(a.shape)} {a.dtype} "
            f"and {tuple(b.shape)} {b.dtype}"
        )
    if not a.is_floating_point():
        raise TypeError(f"adasum_pair needs floating-point tensors, got {a.dtype}")
    a64, b64 = a.detach().reshape(-1).double(), b.detach().reshape(-1).double()
    ca, cb = _coefficients(a64 @ b64, a64 @ a64, b64 @ b64, eps)
    return (ca * a64 + cb * b64).to(a.dtype).reshape(a.shape)
