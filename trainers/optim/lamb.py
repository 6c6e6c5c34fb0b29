"""LAMB: layer-wise adaptive moments for large-batch training.

Paper: Yang You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", ICLR 2020, https://arxiv.org/abs/1904.00962. Defaults follow NVIDIA's apex
``FusedLAMB`` (``csrc/multi_tensor_lamb.cu``, the recipe NVIDIA's BERT pretraining uses) and
``timm.optim.Lamb``; options reproduce apex's ``use_nvlamb``, DeepSpeed's ``FusedLamb`` and
MXNet's ``LAMB`` (see :class:`Lamb`; tests/trainers/test_faithful_optim.py checks each against
a transcription of its code).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch

from modelzoo._triton import Unavailable

from . import _native, _triton
from ._multi_tensor import (
    Bucket,
    LayerwiseAdaptiveOptimizer,
    common_defaults,
    trust_ratio,
)
from .factory import register_optimizer

__all__ = ["Lamb", "LambVariant"]

LambVariant = Literal["apex", "deepspeed"]
_VARIANTS = ("apex", "deepspeed")


@register_optimizer("lamb")
class Lamb(LayerwiseAdaptiveOptimizer):
    r"""LAMB, multi-tensor, with no host synchronisation in :meth:`step`.

    For each parameter tensor :math:`w` with gradient :math:`g` at step :math:`t`, the
    default rule (``variant="apex"``, NVIDIA apex ``FusedLAMB``):

    .. math::
        g &\leftarrow g / \max(1, \lVert g_{\text{all}} \rVert / \text{max\_grad\_norm}) \\
        m &\leftarrow \beta_1 m + (1 - \beta_1) g, \qquad
        v \leftarrow \beta_2 v + (1 - \beta_2) g^2 \\
        u &= \frac{m / (1 - \beta_1^t)}{\sqrt{v / (1 - \beta_2^t)} + \epsilon} + \lambda w \\
        r &= \phi(\lVert w \rVert) / \lVert u \rVert \quad (1 \text{ if either is } 0),
        \qquad w \leftarrow w - \eta\, \operatorname{clamp}(r)\, u

    where :math:`\lVert g_{\text{all}} \rVert` is the norm of all gradients of the optimizer
    together, :math:`\phi` clamps to ``weight_norm_clamp`` and ``clamp`` to
    ``trust_clamp`` (both identities by default; ``clamp`` does not touch the fallback 1).
    The trust ratio is skipped (:math:`r = 1`) where :math:`\lambda = 0` unless
    ``always_adapt``, and on ``no_wd`` groups unless ``adapt_no_wd``.

    ``variant="deepspeed"`` is DeepSpeed's ``FusedLamb``: the trust ratio is computed on the
    update *before* bias correction, and the bias correction scales the step instead:

    .. math::
        u &= m / (\sqrt{v} + \epsilon) + \lambda w, \qquad
        w \leftarrow w - \eta \frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t}\,
        \operatorname{clamp}(r)\, u

    so :math:`\epsilon` and :math:`\lambda` are not bias-corrected and the first steps are
    :math:`\sqrt{1 - \beta_2^t} / (1 - \beta_1^t)` times ours (0.32 at t = 1, 0.15 at t = 10).
    Every tensor is adapted (DeepSpeed has no exception for :math:`\lambda = 0`), and
    ``max_grad_norm`` clips each param group by its own gradient norm :math:`G`, dividing by
    :math:`(G + 10^{-6}) / \text{max\_grad\_norm}` when that is above 1 (what ``FusedLamb``
    does with the per-group norms DeepSpeed's fp16 optimizer passes it).

    How the published implementations map to the options (measured agreement in
    docs/optimizers.md):

    =============================  ===========================================================
    NVIDIA apex FusedLAMB / timm   the defaults
    apex ``use_nvlamb=True``       ``use_nvlamb=True`` (= ``always_adapt=True,
                                   adapt_no_wd=True``)
    DeepSpeed FusedLamb            ``variant="deepspeed", eps=1e-8, weight_decay=0,
                                   max_grad_norm=None, trust_clamp=(0.01, 10)`` (its
                                   defaults; its ``max_grad_norm > 0`` is ours)
    MXNet ``LAMB``                 ``max_grad_norm=None, use_nvlamb=True,
                                   weight_norm_clamp=(lower_bound, upper_bound)``, and
                                   ``bias_correction`` as in MXNet
    =============================  ===========================================================

    Param groups with ``"no_wd": True`` (see :func:`trainers.optim.param_groups`) get no
    weight decay and, as in apex (their weight decay is 0) and NVIDIA's BERT recipe, no
    trust ratio; ``use_nvlamb=True`` adapts them too (MXNet and DeepSpeed adapt every tensor).

    bf16/fp16 parameters keep fp32 moments and an fp32 master weight in the state.

    Args:
        params: parameters or param groups.
        lr: learning rate :math:`\eta`.
        betas: :math:`(\beta_1, \beta_2)`.
        eps: :math:`\epsilon`, added to :math:`\sqrt{\hat v}` (DeepSpeed: to :math:`\sqrt v`).
        weight_decay: :math:`\lambda`, decoupled (added to the update, inside the trust ratio).
        bias_correction: divide the moments by :math:`1 - \beta^t` (MXNet's option).
        max_grad_norm: clip the gradient norm to this before the moments (``None``: no
            clipping). apex: one global clip, every group must carry the same value;
            DeepSpeed: per group.
        trust_clamp: ``(low, high)`` bounds of the trust ratio (DeepSpeed's ``(min_coeff,
            max_coeff)``, ``(0.01, 10)``; either may be ``None``).
        weight_norm_clamp: ``(low, high)`` bounds of :math:`\lVert w \rVert` before the
            division (MXNet's ``lower_bound``/``upper_bound``).
        always_adapt: apply the trust ratio even where the weight decay is 0 (timm's
            ``always_adapt``); by default a group with weight decay 0 takes plain Adam steps.
        adapt_no_wd: apply the trust ratio to ``no_wd`` groups too (needs ``always_adapt``
            since their weight decay is 0).
        use_nvlamb: apex's switch: the trust ratio on every tensor, i.e. ``always_adapt``
            and ``adapt_no_wd`` together.
        variant: ``"apex"`` (NVIDIA apex ``FusedLAMB``) or ``"deepspeed"`` (DeepSpeed
            ``FusedLamb``), see above.

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
        use_nvlamb: bool = False,
        variant: LambVariant = "apex",
    ) -> None:
        if variant not in _VARIANTS:
            raise ValueError(
                f"variant must be 'apex' (NVIDIA apex FusedLAMB, the default) or 'deepspeed' "
                f"(DeepSpeed FusedLamb), got {variant!r}"
            )
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
            always_adapt=bool(always_adapt or use_nvlamb),
            adapt_no_wd=bool(adapt_no_wd or use_nvlamb),
            variant=variant,
        )
        super().__init__(params, defaults)

    def _clips_per_group(self, group: dict[str, Any]) -> bool:
        return group["variant"] == "deepspeed"

    def _clip_eps(self, group: dict[str, Any]) -> float:
        # DeepSpeed: clip = (grad_norm + 1e-6) / max_grad_norm; apex: global / max_grad_norm
        return 1e-6 if group["variant"] == "deepspeed" else 0.0

    def _update(self, group: dict[str, Any], bucket: Bucket, clip: torch.Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        wd = self._weight_decay(group)
        deepspeed = group["variant"] == "deepspeed"
        w, m, v = bucket.weights, bucket.exp_avgs, bucket.exp_avg_sqs
        g = bucket.grads
        # Bias correction folded into two scalars: with bc_i = 1 - beta_i ** t,
        #   m^ / (sqrt(v^) + eps) = s * m / (sqrt(v) + eps * sqrt(bc2)),  s = sqrt(bc2) / bc1,
        # so u = s * (m / denom + (wd / s) * w) and the s cancels in the trust ratio.
        # DeepSpeed: u = m / (sqrt(v) + eps) + wd * w, and the step is lr * s * r * u.
        if group["bias_correction"]:
            bc1, bc2_sqrt = 1.0 - beta1**bucket.step, math.sqrt(1.0 - beta2**bucket.step)
        else:
            bc1, bc2_sqrt = 1.0, 1.0
        s = bc2_sqrt / bc1
        eps_denom = eps if deepspeed else eps * bc2_sqrt
        alpha = 0.0 if wd == 0.0 else (wd if deepspeed else wd / s)
        adapts = deepspeed or self._adapts(group, decays=wd != 0.0 or group["always_adapt"])

        if bucket.group is None and _triton.available(g, w, m, v):  # CUDA: two launches
            scale = None if clip is None else torch.reciprocal(clip)
            passes = dict(eps=eps_denom, alpha_m=alpha, scale=scale)
            try:
                sums = _triton.moments_(
                    g, m, v, w, beta1=beta1, beta2=beta2, norms=adapts, **passes
                )
            except Unavailable:  # warned once; the torch path below, on the untouched state
                pass
            else:
                if sums is None:
                    coef = torch.full((1,), -lr * s, device=w[0].device)
                else:
                    coef = self._step_sizes(group, sums[:, 0].sqrt(), sums[:, 1].sqrt(), s)
                _triton.apply_(g, m, v, w, coef, **passes)
                return
        work = self._scratch(bucket, 0)
        update = work  # u = m / denom + alpha * w, built in the work buffer
        if _native.available(g, w, m, v, work):  # the same bits in two passes (see _native)
            scale = None if clip is None else torch.reciprocal(clip)
            _native.moments_(g, m, v, beta1=beta1, beta2=beta2, scale=scale)
            for vi, ui in zip(v, update, strict=True):
                torch.sqrt(vi, out=ui)
            _native.update_(update, m, w, eps=eps_denom, alpha_m=alpha)
        else:
            if clip is not None:
                if not bucket.grads_owned:  # the caller's .grad stays unclipped
                    torch._foreach_copy_(work, g)
                    g = work
                torch._foreach_mul_(g, torch.reciprocal(clip))
            torch._foreach_lerp_(m, g, 1.0 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)
            # the clipped gradient is not needed any more: the work buffer takes the update
            torch._foreach_copy_(update, v)
            torch._foreach_sqrt_(update)
            torch._foreach_add_(update, eps_denom)
            torch._foreach_reciprocal_(update)
            torch._foreach_mul_(update, m)  # m / denom
            if alpha != 0.0:
                torch._foreach_add_(update, w, alpha=alpha)

        if adapts:
            coef = self._step_sizes(group, bucket.norms(w), bucket.norms(update), s)
            torch._foreach_addcmul_(w, update, coef.unbind(0))
        else:
            torch._foreach_add_(w, update, alpha=-lr * s)

    @staticmethod
    def _step_sizes(
        group: dict[str, Any], weight_norm: torch.Tensor, update_norm: torch.Tensor, s: float
    ) -> torch.Tensor:
        """Per tensor ``-lr s r``, ``r`` the trust ratio of ``||w||`` and ``||u||`` (apex: of
        the bias-corrected update, ``s ||u||``; DeepSpeed: of ``u`` as it is)."""
        if group["variant"] != "deepspeed":
            update_norm = update_norm.mul_(s)
        ratio = trust_ratio(
            weight_norm,
            update_norm,
            weight_norm_clamp=group["weight_norm_clamp"],
            trust_clamp=group["trust_clamp"],
        )
        return ratio.mul_(-group["lr"] * s)
