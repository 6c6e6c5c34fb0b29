"""LANS: LAMB with per-tensor gradient normalisation and a Nesterov-style update.

Paper: Shuai Zheng, Haibin Lin, Sheng Zha, Mu Li, "Accelerated Large Batch Optimization of
BERT Pretraining in 54 Minutes", 2020, https://arxiv.org/abs/2006.13484. The default rule is
the authors' ``FusedLANS`` (``csrc/multi_tensor_lans.cu`` of szhengac/apex, the same kernel as
dmlc/gluon-nlp ``src/gluonnlp/torch/clib/multi_tensor_lans.cu``), which their BERT recipe
(gluon-nlp ``scripts/pretraining/torch/bert/run_pretraining.py``) runs; options reproduce
MXNet's fused ``multi_lans_update`` and its sequential ``lans.py`` step (see :class:`Lans`;
tests/trainers/test_faithful_optim.py checks each against a transcription of its code).
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

__all__ = ["Lans", "LansVariant"]

LansVariant = Literal["gluonnlp", "mxnet", "mxnet-sequential"]
_VARIANTS = ("gluonnlp", "mxnet", "mxnet-sequential")

# torch.nn.utils.clip_grad_norm_, which the authors' recipe calls before FusedLANS.step(),
# scales by max_norm / (total_norm + 1e-6).
_CLIP_EPS = 1e-6


@register_optimizer("lans")
class Lans(LayerwiseAdaptiveOptimizer):
    r"""LANS, multi-tensor, with no host synchronisation in :meth:`step`.

    For each parameter tensor :math:`w` with gradient :math:`g` at step :math:`t`
    (``variant="gluonnlp"``, the authors' ``FusedLANS``):

    .. math::
        \hat g &= g / (\lVert g \rVert + \epsilon) \quad (0 \text{ where } g = 0) \\
        m &\leftarrow \beta_1 m + (1 - \beta_1) \hat g, \qquad
        v \leftarrow \beta_2 v + (1 - \beta_2) \hat g^2, \qquad
        \hat m = \frac{m}{1 - \beta_1^t}, \quad \hat v = \frac{v}{1 - \beta_2^t} \\
        u_m &= \hat m / (\sqrt{\hat v} + \epsilon) + \lambda w, \qquad
        u_c = \hat g / (\sqrt{\hat v} + \epsilon) + \lambda w \\
        r_m &= \lVert w \rVert / \lVert u_m \rVert, \qquad
        r_c = \lVert w \rVert / \lVert u_c \rVert \qquad (1 \text{ when a norm is } 0) \\
        w &\leftarrow w - \eta \beta_1 r_m u_m - \eta (1 - \beta_1) r_c u_c

    Both :math:`u_m` and :math:`u_c` use the weight from before the update, and every tensor
    gets both trust ratios, including those without weight decay (``FusedLANS`` adapts every
    tensor; its weight-decay-0 groups only drop :math:`\lambda w`). The step is invariant to
    scaling :math:`g` by any :math:`c > 0` (up to :math:`\epsilon`), and with
    :math:`\beta_1 = 0` it is a LAMB step on the normalised gradient.

    ``max_grad_norm`` is the authors' recipe's ``torch.nn.utils.clip_grad_norm_(params, 1.0)``
    before ``FusedLANS.step()``: with :math:`c = \max(1, (G + 10^{-6}) / \text{max\_grad\_norm})`,
    :math:`G` the norm of all gradients, the clip only matters through :math:`\epsilon`
    (:math:`\hat g = g / (\lVert g \rVert + c \epsilon)`), which is how it is computed here.

    **MXNet** (``variant="mxnet"``): ``mxnet.optimizer.LANS``'s default fused step, the
    ``multi_lans_update`` operator (``src/operator/contrib/multi_lans.cc``), is the rule above
    with :math:`\hat g = g / \lVert g \rVert` (no :math:`\epsilon`; we keep :math:`\hat g = 0`
    where MXNet gives NaN for an all-zero gradient). MXNet tests that operator against its
    sequential ``lans.py`` step (``use_fused_step=False``, ``variant="mxnet-sequential"``),
    which applies the two terms one after the other: the weight decay in :math:`u_c` uses
    the weight already moved by the :math:`u_m` term, :math:`\lambda (w - \eta \beta_1 r_m
    u_m)`, while :math:`r_c`'s numerator keeps the old :math:`\lVert w \rVert`; the two
    differ by :math:`O(\eta^2 \lambda)` per step. MXNet's LANS always bias-corrects (it has
    no ``bias_correction`` argument; ``FusedLANS`` has one), and a global clip does nothing
    to either MXNet variant (:math:`g / \lVert g \rVert` is exactly scale-free).

    bf16/fp16 parameters keep fp32 moments and an fp32 master weight.

    Args:
        params: parameters or param groups.
        lr: learning rate :math:`\eta` (the authors' BERT phase 1: 0.005 at batch 96K).
        betas: :math:`(\beta_1, \beta_2)`.
        eps: :math:`\epsilon` of the gradient normalisation and of the denominators.
        weight_decay: :math:`\lambda`.
        bias_correction: divide the moments by :math:`1 - \beta^t` (``FusedLANS``'s option).
        max_grad_norm: global gradient-norm clip before the normalisation (``None``: off).
        trust_clamp: ``(low, high)`` bounds of both trust ratios.
        weight_norm_clamp: ``(low, high)`` bounds of :math:`\lVert w \rVert` (MXNet's
            ``lower_bound``/``upper_bound``).
        adapt_no_wd: apply the trust ratios to ``no_wd`` groups too (the default, as the
            authors' kernel and MXNet do); ``False`` gives them plain normalised-Adam steps,
            as NVIDIA's LAMB recipe does for LAMB.
        variant: ``"gluonnlp"`` (the authors' ``FusedLANS``), ``"mxnet"`` (MXNet's fused
            operator) or ``"mxnet-sequential"`` (MXNet's ``lans.py`` step), see above.

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
        adapt_no_wd: bool = True,
        variant: LansVariant = "gluonnlp",
    ) -> None:
        if variant not in _VARIANTS:
            raise ValueError(
                f"variant must be 'gluonnlp' (the authors' FusedLANS, the default), 'mxnet' "
                f"(MXNet's multi_lans_update) or 'mxnet-sequential' (MXNet's lans.py step), "
                f"got {variant!r}"
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
        defaults.update(adapt_no_wd=bool(adapt_no_wd), variant=variant)
        super().__init__(params, defaults)

    def _clip_eps(self, group: dict[str, Any]) -> float:
        return _CLIP_EPS

    def _update(self, group: dict[str, Any], bucket: Bucket, clip: torch.Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        wd = self._weight_decay(group)
        mxnet = group["variant"] != "gluonnlp"
        sequential = group["variant"] == "mxnet-sequential"
        w, m, v = bucket.weights, bucket.exp_avgs, bucket.exp_avg_sqs

        # g^ = g / (||g|| + eps), with a global clip by c folded in: (g/c) / (||g||/c + eps);
        # MXNet: g / ||g||, on which a clip has no effect. 0 where the gradient is all zero.
        grad_norm = bucket.grad_norms()
        denom = grad_norm if mxnet else grad_norm + (eps if clip is None else clip * eps)
        inv_norm = torch.where(grad_norm > 0, torch.reciprocal(denom), 0.0)
        # With bc_i = 1 - beta_i ** t and denom = sqrt(v) + eps * sqrt(bc2):
        #   u_m = sm * (m / denom + (wd / sm) * w),  sm = sqrt(bc2) / bc1
        #   u_c = sc * (g^ / denom + (wd / sc) * w), sc = sqrt(bc2)
        if group["bias_correction"]:
            bc1, bc2_sqrt = 1.0 - beta1**bucket.step, math.sqrt(1.0 - beta2**bucket.step)
        else:
            bc1, bc2_sqrt = 1.0, 1.0
        sm, sc = bc2_sqrt / bc1, bc2_sqrt
        alpha_m = 0.0 if wd == 0.0 else wd / sm
        alpha_c = 0.0 if wd == 0.0 else wd / sc
        # MXNet's lans.py (sequential) adds u_c's weight decay after w has moved by u_m
        alpha_c_now = 0.0 if sequential else alpha_c
        adapts = self._adapts(group, decays=True)
        bounds = dict(
            weight_norm_clamp=group["weight_norm_clamp"], trust_clamp=group["trust_clamp"]
        )
        like = dict(device=grad_norm.device, dtype=grad_norm.dtype)  # fp64 for fp64 params
        coef_m = torch.full((len(w),), -lr * beta1 * sm, **like)
        coef_c = torch.full((len(w),), -lr * (1.0 - beta1) * sc, **like)

        if not sequential and bucket.group is None and _triton.available(bucket.grads, w, m, v):
            passes = dict(eps=eps * bc2_sqrt, alpha_m=alpha_m, scale=inv_norm, alpha_c=alpha_c)
            try:  # CUDA: two launches (see _triton)
                sums = _triton.moments_(
                    bucket.grads, m, v, w, beta1=beta1, beta2=beta2, lans=True, norms=adapts,
                    **passes,
                )  # fmt: skip
            except Unavailable:  # warned once; the torch path below, on the untouched state
                pass
            else:
                if sums is not None:
                    weight_norm = sums[:, 0].sqrt()
                    coef_m.mul_(trust_ratio(weight_norm, sums[:, 1].sqrt().mul_(sm), **bounds))
                    coef_c.mul_(trust_ratio(weight_norm, sums[:, 2].sqrt().mul_(sc), **bounds))
                _triton.apply_(bucket.grads, m, v, w, coef_m, coef_c=coef_c, **passes)
                return
        # g^ in place when the gradients are the optimizer's own copies, else in a work buffer
        g = bucket.grads if bucket.grads_owned else self._scratch(bucket, 0)
        update_m = self._scratch(bucket, 1)
        update_c = g  # g^ is not needed after u_c

        native = _native.available(bucket.grads, g, w, m, v, update_m)
        if native:  # the same bits in fewer passes (see _native)
            _native.moments_(bucket.grads, m, v, beta1=beta1, beta2=beta2, scale=inv_norm, out=g)
            for vi, ui in zip(v, update_m, strict=True):
                torch.sqrt(vi, out=ui)
            _native.update_(
                update_m, m, w, eps=eps * bc2_sqrt, alpha_m=alpha_m, grads=g, alpha_c=alpha_c_now
            )
        else:
            if g is not bucket.grads:  # the caller's .grad stays as it is
                torch._foreach_copy_(g, bucket.grads)
            torch._foreach_mul_(g, inv_norm.unbind(0))
            torch._foreach_lerp_(m, g, 1.0 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)
            torch._foreach_copy_(update_m, v)
            torch._foreach_sqrt_(update_m)
            torch._foreach_add_(update_m, eps * bc2_sqrt)
            torch._foreach_reciprocal_(update_m)  # 1 / denom
            torch._foreach_mul_(update_c, update_m)
            torch._foreach_mul_(update_m, m)
            if alpha_m != 0.0:
                torch._foreach_add_(update_m, w, alpha=alpha_m)
            if alpha_c_now != 0.0:
                torch._foreach_add_(update_c, w, alpha=alpha_c_now)

        weight_norm = bucket.norms(w) if adapts else None  # ||w|| before the step, for both terms
        if adapts:
            coef_m.mul_(trust_ratio(weight_norm, bucket.norms(update_m).mul_(sm), **bounds))
        if sequential:  # MXNet's lans.py: u_c's weight decay sees the weight moved by u_m
            torch._foreach_addcmul_(w, update_m, coef_m.unbind(0))
        if sequential and alpha_c != 0.0:
            torch._foreach_add_(update_c, w, alpha=alpha_c)
        if adapts:
            coef_c.mul_(trust_ratio(weight_norm, bucket.norms(update_c).mul_(sc), **bounds))
        if native and not sequential:  # both terms in one pass, the same bits
            _native.apply_(w, update_m, coef_m, update_c, coef_c)
            return
        if not sequential:
            torch._foreach_addcmul_(w, update_m, coef_m.unbind(0))
        torch._foreach_addcmul_(w, update_c, coef_c.unbind(0))
