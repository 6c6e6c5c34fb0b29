"""BERTAdam: GluonNLP's Adam for BERT (decoupled weight decay, bias correction in the step).

GluonNLP's BERT scripts (``finetune_squad.py --optimizer bertadam``, pretraining) use
``gluonnlp.optimizer.BERTAdam``. Its update, as its code applies it (MXNet's
``adamw_update`` with ``eta`` = the bias-corrected step size), is::

    m = beta1 m + (1 - beta1) g
    v = beta2 v + (1 - beta2) g^2
    step = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
    w = w - step * (m / (sqrt(v) + eps) + wd * w)

It differs from ``torch.optim.AdamW`` in two ways: ``eps`` is added to ``sqrt(v)`` before
the bias correction (AdamW corrects ``v`` first), and the weight decay is scaled by the
bias-corrected step (AdamW by ``lr`` alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .factory import register_optimizer

__all__ = ["BertAdam"]


@register_optimizer("bertadam")
class BertAdam(torch.optim.Optimizer):
    """GluonNLP's BERTAdam (see the module docstring); GluonNLP's defaults.

    Args:
        params: parameters or param groups (``"no_wd"`` groups carry weight_decay 0).
        lr: learning rate.
        betas: ``(beta1, beta2)``.
        eps: added to ``sqrt(v)``.
        weight_decay: decoupled, scaled by the step size.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(
                f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}"
            )
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        super().__init__(
            params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("bertadam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                step = group["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                update = m / (v.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                p.add_(update, alpha=-step)
        return loss
