"""LANS: LAMB with per-tensor gradient normalisation and a Nesterov-style update.

Paper: Shuai Zheng, Haibin Lin, Sheng Zha, Mu Li, "Accelerated Large Batch Optimization of
BERT Pretraining in 54 Minutes", 2020, https://arxiv.org/abs/2006.13484. The rule is the
reference the authors' fused MXNet kernel is tested against; see :class:`Lans` for how
MXNet's Python ``lans.py`` differs.
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

__all__ = ["Lans"]


@register_optimizer("lans")
class Lans(LayerwiseAdaptiveOptimizer):
    r"""LANS, multi-tensor, with no host synchronisation in :meth:`step`.

    For each parameter tensor :math:`w` with gradient :math:`g` at step :math:`t`:

    .. math::
        \hat g &= g / (\lVert g \rVert + \epsilon) \\
        m &\leftarrow \beta_1 m + (1 - \beta_1) \hat g, \qquad
        v \leftarrow \beta_2 v + (1 - \beta_2) \hat g^2, \qquad
        \hat m = \frac{m}{1 - \beta_1^t}, \quad \hat v = \frac{v}{1 - \beta_2^t} \\
        u_m &= \hat m / (\sqrt{\hat v} + \epsilon) + \lambda w, \qquad
        u_c = \hat g / (\sqrt{\hat v} + \epsilon) + \lambda w \\
        r_m &= \lVert w \rVert / \lVert u_m \rVert, \qquad
        r_c = \lVert w \rVert / \lVert u_c \rVert \qquad (1 \text{ when a norm is } 0) \\
        w &\leftarrow w - \eta \beta_1 r_m u_m - \eta (1 - \beta_1) r_c u_c

    Both :math:`u_m` and :math:`u_c` use the weight from before the update. The step is
    invariant to scaling :math:`g` by any :math:`c > 0` (up to :math:`\epsilon`), and with
    :math:`\beta_1 = 0` it is a LAMB step on the normalised gradient.

    ``max_grad_norm`` (the authors' recipe clips the global norm to 1.0 first) only matters
    through :math:`\epsilon`: clipping by :math:`c` turns the normalisation into
    :math:`g / (\lVert g \rVert + c \epsilon)`, which is how it is computed here.

    **MXNet's** ``mxnet.optimizer.LANS`` (``lans.py``) differs from this reference in two
    ways: it normalises by :math:`\lVert g \rVert` without :math:`\epsilon`, and it applies
    the two terms one after the other, so the weight decay of :math:`u_c` uses the weight
    already moved by the :math:`u_m` term (:math:`\lambda (w - \eta \beta_1 r_m u_m)`) while
    :math:`r_c`'s numerator still uses the old :math:`\lVert w \rVert`. We follow the
    reference rule the authors' fused kernel (``multi_lans_update``) is tested against: it is
    what the paper writes, both terms of the Nesterov combination see the same point, and it
    needs one pass over the weights instead of two. The difference is
    :math:`O(\eta^2 \lambda)` per step.

    Param groups with ``"no_wd": True`` get no weight decay and no trust ratio (as LAMB's
    NVIDIA recipe); ``adapt_no_wd=True`` adapts them too, as MXNet and the authors' recipe
    do. bf16/fp16 parameters keep fp32 moments and an fp32 master weight.

    Args:
        params: parameters or param groups.
        lr: learning rate :math:`\eta` (the authors' BERT phase 1: 0.005 at batch 96K).
        betas: :math:`(\beta_1, \beta_2)`.
        eps: :math:`\epsilon` of the gradient normalisation and of the denominators.
        weight_decay: :math:`\lambda`.
        bias_correction: divide the moments by :math:`1 - \beta^t` (MXNet's option).
        max_grad_norm: global gradient-norm clip before the normalisation (``None``: off).
        trust_clamp: ``(low, high)`` bounds of both trust ratios.
        weight_norm_clamp: ``(low, high)`` bounds of :math:`\lVert w \rVert` (MXNet's
            ``lower_bound``/``upper_bound``).
        adapt_no_wd: apply the trust ratios to ``no_wd`` groups too.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Lans(model.parameters(), lr=5e-3)
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
            adapt_no_wd=bool(adapt_no_wd),
        )
        super().__init__(params, defaults)

    def _update(self, group: dict[str, Any], bucket: Bucket, clip: torch.Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        wd = self._weight_decay(group)
        w, m, v = bucket.weights, bucket.exp_avgs, bucket.exp_avg_sqs

        # g^ = g / (||g|| + eps), with a global clip by c folded in: (g/c) / (||g||/c + eps).
        grad_norm = bucket.grad_norms() + (eps if clip is None else clip * eps)
        g = bucket.grads
        if not bucket.grads_owned:  # the caller's .grad stays as it is
            g = self._scratch(bucket, 0)
            torch._foreach_copy_(g, bucket.grads)
        torch._foreach_mul_(g, torch.reciprocal(grad_norm).unbind(0))

        torch._foreach_lerp_(m, g, 1.0 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)

        # With bc_i = 1 - beta_i ** t and denom = sqrt(v) + eps * sqrt(bc2):
        #   u_m = sm * (m / denom + (wd / sm) * w),  sm = sqrt(bc2) / bc1
        #   u_c = sc * (g^ / denom + (wd / sc) * w), sc = sqrt(bc2)
        if group["bias_correction"]:
            bc1, bc2_sqrt = 1.0 - beta1**bucket.step, math.sqrt(1.0 - beta2**bucket.step)
        else:
            bc1, bc2_sqrt = 1.0, 1.0
        sm, sc = bc2_sqrt / bc1, bc2_sqrt
        update_m = self._scratch(bucket, 1)
        torch._foreach_copy_(update_m, v)
        torch._foreach_sqrt_(update_m)
        torch._foreach_add_(update_m, eps * bc2_sqrt)
        torch._foreach_reciprocal_(update_m)  # 1 / denom
        update_c = g  # g^ is not needed any more
        torch._foreach_mul_(update_c, update_m)
        torch._foreach_mul_(update_m, m)
        if wd != 0.0:
            torch._foreach_add_(update_m, w, alpha=wd / sm)
            torch._foreach_add_(update_c, w, alpha=wd / sc)

        coef_m = torch.full((len(w),), -lr * beta1 * sm, device=grad_norm.device)
        coef_c = torch.full((len(w),), -lr * (1.0 - beta1) * sc, device=grad_norm.device)
        if self._adapts(group, decays=True):
            weight_norm = norms(w)
            bounds = dict(
                weight_norm_clamp=group["weight_norm_clamp"], trust_clamp=group["trust_clamp"]
            )
            norm_m = norms(update_m).mul_(sm)
            norm_c = norms(update_c).mul_(sc)
            coef_m.mul_(trust_ratio(weight_norm, norm_m, **bounds))
            coef_c.mul_(trust_ratio(weight_norm, norm_c, **bounds))
        torch._foreach_addcmul_(w, update_m, coef_m.unbind(0))
        torch._foreach_addcmul_(w, update_c, coef_c.unbind(0))
