"""``--grad-combine cser``: Communication-efficient SGD with Error Reset (Xie et al., NeurIPS 2020).

Every step each worker runs its own optimizer step from its own model, giving the update
``u``; the compressed part ``C1(u)`` is averaged over the workers, the rest ``u - C1(u)`` is
applied locally and added to the residual ``e`` (the local models drift apart by their
residuals: ``x_i = xbar + e_i``). Every ``H`` steps the residuals are reset:
``x_i <- x_i - e_i + mean_j C2(e_j)``, ``e_i <- 0``, after which every replica is equal
(``C2 = none``: an exact reset). With ``C1 = none`` and ``H = 1`` it is synchronous SGD with
the same optimizer (momentum is linear in the gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..dist import DistEnv
from .base import option, register_combiner
from .compressed import CompressedCombiner, CompressorOptions, _compressor_names, no_loss_scaling
from .compressors import create_compressor
from .flat import average_buffers_, flatten, restore_optimizer_state, unflatten_

__all__ = ["CSERCombiner", "CSEROptions"]


@dataclass(frozen=True)
class CSEROptions(CompressorOptions):
    period: int = option(8, "error-reset period H (optimizer steps)", flag="--cser-period")
    reset_compressor: str = option(
        "none",
        "compressor C2 of the error reset (none: an exact reset)",
        flag="--cser-reset-compressor",
        choices=_compressor_names,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.period < 1:
            raise ValueError(f"period must be >= 1 (steps between error resets), got {self.period}")
        create_compressor(self.reset_compressor)


@register_combiner("cser", CSEROptions)
class CSERCombiner(CompressedCombiner):
    """CSER: partial synchronisation with ``C1`` every step, error reset with ``C2`` every H.

    See the module docstring for the rule. Each worker keeps its own optimizer state
    (momentum) and model ``x_i = xbar + e_i``: the synchronised part ``xbar`` (the same on
    every worker: it only ever changes by all-reduced amounts) plus its residual. Evaluation
    (:meth:`synchronize`) and every ``period``-th step reset the residuals, after which every
    replica is exactly ``xbar``. Floating-point buffers (BatchNorm statistics) stay local and
    are averaged at the resets.
    """

    summary = "compression with error reset"

    def __init__(self, options: CSEROptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.period = self.options.period
        self.reset_compressor = create_compressor(self.options.reset_compressor)
        self.synced: Tensor | None = None  # xbar, flat fp32
        self.residual: Tensor | None = None  # e_i, flat fp32

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        model = super().prepare(model, optimizer, env)
        self.reset_compressor.bind(env.world_size)
        self.synced = flatten(self._params())
        self.residual = torch.zeros_like(self.synced)
        return model

    def _params(self) -> list[Tensor]:
        assert self.model is not None
        return [p for p in self.model.parameters() if p.requires_grad]

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        no_loss_scaling(scaler, self.name)

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        assert self.synced is not None and self.residual is not None
        params = self._params()
        with torch.no_grad():
            start = flatten(params)
            super().step(optimizer, scaler)
            update = flatten(params) - start
            mean, own = self._reduce(update, self.compressor, salt=0)
            self.synced += mean  # the averaged compressed part
            self.residual += update - own  # the rest: applied locally, remembered
            unflatten_(params, self.synced + self.residual)
        self.counter.step()
        self.steps += 1
        if self.steps % self.period == 0:
            self._reset()

    def _reset(self) -> None:
        """``xbar += mean_j C2(e_j)``; ``e_i <- 0``; ``x_i <- xbar``; buffers averaged."""
        assert self.model is not None and self.env is not None
        assert self.synced is not None and self.residual is not None
        with torch.no_grad():
            mean, _ = self._reduce(self.residual, self.reset_compressor, salt=1)
            self.synced += mean
            self.residual.zero_()
            unflatten_(self._params(), self.synced)
        self.counter.add(average_buffers_(self.model, self.env))

    def synchronize(self) -> None:
        """An error reset (before evaluation), so the evaluated replicas are equal."""
        if self.env is not None and self.env.distributed:
            self._reset()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        assert self.synced is not None and self.residual is not None
        assert self.optimizer is not None
        state["synced"] = self.synced.clone()
        state["residual"] = self.residual.clone()
        state["params"] = [p.detach().clone() for p in self._params()]
        state["optimizer"] = self.optimizer.state_dict()["state"]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        assert self.optimizer is not None
        self.synced = state_dict["synced"].clone()
        self.residual = state_dict["residual"].clone()
        with torch.no_grad():
            for p, saved in zip(self._params(), state_dict["params"], strict=True):
                p.copy_(saved)
        restore_optimizer_state(self.optimizer, state_dict.get("optimizer"))
