"""``--grad-combine ef``: compressed gradient averaging with error feedback."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import register_combiner
from .compressed import CompressedCombiner, CompressorOptions, no_loss_scaling
from .flat import broadcast_, flat_grads

__all__ = ["ErrorFeedbackCombiner"]


@register_combiner("ef", CompressorOptions)
class ErrorFeedbackCombiner(CompressedCombiner):
    """Compressed gradient averaging with error feedback (Seide et al. 2014; Karimireddy et
    al. 2019).

    Per step, on each worker: ``p = g + e``; ``c = C(p)``; the workers' ``c`` are averaged
    into every ``p.grad``; ``e = p - c``. The optimizer then steps on the average, so the
    replicas stay identical (rank 0's buffers are broadcast after each step, as DDP does).
    Gradient clipping applies to the averaged gradient. Works with any compressor; the
    run seed seeds the per-step generators (random block offsets, QSGD rounding).
    """

    summary = "a --compressor with error feedback"

    def __init__(self, options: CompressorOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.residual: Tensor | None = None

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        no_loss_scaling(scaler, self.name)
        assert self.model is not None and self.env is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        with torch.no_grad():
            g = flat_grads(params)
            if self.residual is None:
                self.residual = torch.zeros_like(g)
            p = g + self.residual
            mean, own = self._reduce(p, self.compressor, salt=0)
            self.residual = p - own
            self.counter.step()
            offset = 0
            for param in params:
                n = param.numel()
                param.grad = mean[offset : offset + n].view_as(param).to(param.dtype).clone()
                offset += n

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        super().step(optimizer, scaler)
        self.steps += 1
        if self.env is not None and self.env.distributed:
            assert self.model is not None
            broadcast_(list(self.model.buffers()))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.residual is not None:
            state["residual"] = self.residual.clone()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        residual = state_dict.get("residual")
        self.residual = residual.clone() if residual is not None else None
