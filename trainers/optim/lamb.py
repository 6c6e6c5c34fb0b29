"""LAMB: layer-wise adaptive moments for large-batch training.

Paper: Yang You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", ICLR 2020, https://arxiv.org/abs/1904.00962. Defaults follow NVIDIA's apex
``FusedLAMB`` and ``timm.optim.Lamb`` (the recipe NVIDIA's BERT pretraining uses); options
reproduce DeepSpeed's ``FusedLamb`` and MXNet's ``LAMB`` (see :class:`Lamb`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ._multi_tensor import (
    Bucket,
    LayerwiseAdaptiveOptimizer,
    common_defaults,
    norms,
    trust_ratio,
)
from .factory import register_optimizer

__all__ = ["Lamb"]


@register_optimizer("lamb")
class Lamb(LayerwiseAdaptiveOptimizer):
    r"""LAMB, multi-tensor, with no host synchronisation in :meth:`step`.

    For each parameter tensor :math:`w` with gradient :math:`g` at step :math:`t`:

    .. math::
        g &\leftarrow g / \max(1, \lVert g_{\text{all}} \rVert / \text{max\_grad\_norm}) \\
        m &\leftarrow \beta_1 m + (1 - \beta_1) g, \qquad
        v \leftarrow \beta_2 v + (1 - \beta_2) g^2 \\
        u &= \frac{m / (1 - \beta_1^t)}{\sqrt{v / (1 - \beta_2^t)} + \epsilon} + \lambda w \\
        r &= \phi(\lVert w \rVert) / \lVert u \rVert \quad (1 \text{ if either is } 0),
        \qquad w \leftarrow w - \eta\, \operatorname{clamp}(r)\, u

    where :math:`\lVert g_{\text{all}} \rVert` is the norm of all gradients of the optimizer
    together, :math:`\phi` clamps to ``weight_norm_clamp`` and ``clamp`` to
    ``trust_clamp`` (both identities by default).

    How the published implementations map to the options:

    =============================  ===========================================================
    NVIDIA apex FusedLAMB / timm   the defaults
    DeepSpeed FusedLamb            ``eps=1e-8, weight_decay=0, max_grad_norm=None,
                                   trust_clamp=(0.01, 10), always_adapt=True`` (DeepSpeed
                                   folds the bias correction into the step size, which moves
                                   ``eps`` by a factor ``sqrt(1 - beta2**t)``; not reproduced)
    MXNet ``LAMB``                 ``max_grad_norm=None, always_adapt=True,
                                   weight_norm_clamp=(lower_bound, upper_bound)``, and
                                   ``bias_correction`` as in MXNet
    =============================  ===========================================================

    Param groups with ``"no_wd": True`` (see :func:`trainers.optim.param_groups`) get no
    weight decay and, as in NVIDIA's BERT recipe, no trust ratio; ``adapt_no_wd=True``
    applies the trust ratio to them too (MXNet adapts every tensor).

    bf16/fp16 parameters keep fp32 moments and an fp32 master weight in the state.

    Args:
        params: parameters or param groups.
        lr: learning rate :math:`\eta`.
        betas: :math:`(\beta_1, \beta_2)`.
        eps: :math:`\epsilon`, added to :math:`\sqrt{\hat v}`.
        weight_decay: :math:`\lambda`, decoupled (added to the update, inside the trust ratio).
        bias_correction: divide the moments by :math:`1 - \beta^t` (MXNet's option).
        max_grad_norm: clip the global gradient norm to this before the moments
            (``None``: no clipping). One clip over all groups: every group must carry the
            same value.
        trust_clamp: ``(low, high)`` bounds of the trust ratio (DeepSpeed: ``(0.01, 10)``;
            either may be ``None``).
        weight_norm_clamp: ``(low, high)`` bounds of :math:`\lVert w \rVert` before the
            division (MXNet's ``lower_bound``/``upper_bound``).
        always_adapt: apply the trust ratio even where the weight decay is 0 (NVIDIA's
            ``use_nvlamb``); by default a group with weight decay 0 takes plain Adam steps.
        adapt_no_wd: apply the trust ratio to ``no_wd`` groups too (needs ``always_adapt``
            since their weight decay is 0).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Lamb(model.parameters(), lr=1e-2, weight_decay=0.01)
        >>> model(torch.randn(8, 4)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        max_grad_norm: float | None = 1.0,
        trust_clamp: tuple[float | None, float | None] | None = None,
        weight_norm_clamp: tuple[float | None, float | None] | None = None,
        always_adapt: bool = False,
        adapt_no_wd: bool = False,
    ) -> None:
        defaults = common_defaults(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_grad_norm=max_grad_norm,
            trust_clamp=trust_clamp,
            weight_norm_clamp=weight_norm_clamp,
        )
        defaults.update(
            always_adapt=bool(always_adapt),
            adapt_no_wd=bool(adapt_no_wd),
        )
        super().__init__(params, defaults)

    def _update(self, group: dict[str, Any], bucket: Bucket, clip: torch.Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        wd = self._weight_decay(group)
        w, m, v = bucket.weights, bucket.exp_avgs, bucket.exp_avg_sqs
        work = self._scratch(bucket, 0)
        g = bucket.grads
        if clip is not None:
            if not bucket.grads_owned:  # the caller's .grad stays unclipped
                torch._foreach_copy_(work, g)
                g = work
            torch._foreach_mul_(g, torch.reciprocal(clip))

        torch._foreach_lerp_(m, g, 1.0 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)

        # Bias correction folded into two scalars: with bc_i = 1 - beta_i ** t,
        #   m^ / (sqrt(v^) + eps) = s * m / (sqrt(v) + eps * sqrt(bc2)),  s = sqrt(bc2) / bc1,
        # so u = s * (m / denom + (wd / s) * w) and the s cancels in the trust ratio.
        if group["bias_correction"]:
            bc1, bc2_sqrt = 1.0 - beta1**bucket.step, math.sqrt(1.0 - beta2**bucket.step)
        else:
            bc1, bc2_sqrt = 1.0, 1.0
        s = bc2_sqrt / bc1
        update = work  # the clipped gradient is not needed any more
        torch._foreach_copy_(update, v)
        torch._foreach_sqrt_(update)
        torch._foreach_add_(update, eps * bc2_sqrt)
        torch._foreach_reciprocal_(update)
        torch._foreach_mul_(update, m)  # m / denom
        if wd != 0.0:
            torch._foreach_add_(update, w, alpha=wd / s)

        if self._adapts(group, decays=wd != 0.0 or group["always_adapt"]):
            weight_norm = norms(w)
            update_norm = norms(update).mul_(s)
            ratio = trust_ratio(
                weight_norm,
                update_norm,
                weight_norm_clamp=group["weight_norm_clamp"],
                trust_clamp=group["trust_clamp"],
            )
            torch._foreach_addcmul_(w, update, ratio.mul_(-lr * s).unbind(0))
        else:
            torch._foreach_add_(w, update, alpha=-lr * s)
