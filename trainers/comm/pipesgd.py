"""``--grad-combine pipesgd``: Pipe-SGD (Li, Yu, Ghazi, Fu, Li, Bhattacharyya, NeurIPS 2018).

Hide the all-reduce behind the next step's computation: with pipeline width 2 one
all-reduce is in flight while the next gradient is computed, and every step applies the
average of the **previous** step's gradients (gradient delay 1)::

    step t: g_t = grad F(w_t) on each rank;  start all-reduce(g_t)
            wait for all-reduce(g_{t-1});    w_{t+1} = w_t - lr_t * update(mean_i g_{t-1,i})

Every replica applies the same average, so the replicas never diverge (only BatchNorm
statistics, local to each rank, are averaged at :meth:`synchronize`). Step 0 has nothing
to apply and skips the optimizer (its learning rate is used by no gradient); the gradient
of the last step is still in flight when training ends. The step time is about
``max(T_compute, T_comm)`` instead of their sum, so pipelining alone gains at most 2x; the
paper's larger speed-ups also compress the messages, which ``compressor`` does here with
the all-reduce-compatible compressors of :mod:`trainers.comm.compressors` (``fp16`` /
``bf16`` truncation, ``qsgd`` 8-bit levels, ``randblock``), without error feedback, as in
the paper.

Delay changes the dynamics: on ``f(w) = a w^2 / 2`` delayed gradient descent
``w_{t+1} = w_t - lr a w_{t-1}`` is stable only for ``0 < lr a < 1`` (plain GD: ``< 2``),
so learning rates tuned for synchronous SGD near their stability limit must be lowered.

The gradient in flight is a private copy (never a view of ``.grad``). fp16 loss scaling is
refused: the scale in force when a gradient was computed is not the one of the step that
applies it. Checkpoints wait for the all-reduce in flight and save its result, so a resume
(or an elastic membership change, whose new world applies the old world's averaged
gradient) continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..data import derive_seed
from ..dist import DistEnv
from .base import CountingCombiner, option, refuse_loss_scaling, register_combiner
from .compressors import COMPRESSORS, Context, create_compressor
from .flat import average_buffers_, flat_grads, unflatten_

__all__ = ["PipeSGDCombiner", "PipeSGDOptions"]

_SALT = 0x919E


def _pipeline_compressors() -> list[str]:
    """The compressors whose encoded vectors a plain (asynchronous) all-reduce can sum."""
    return [
        name for name, c in COMPRESSORS.items() if c.allreduce_compatible and not c.shares_selection
    ]


@dataclass(frozen=True)
class PipeSGDOptions:
    compressor: str = option(
        "none",
        "compress the gradient inside the pipeline (all-reduce-compatible compressors)",
        flag="--pipesgd-compressor",
        choices=_pipeline_compressors,
    )

    def __post_init__(self) -> None:
        if self.compressor not in _pipeline_compressors():
            raise ValueError(
                f"compressor {self.compressor!r} cannot be summed by an asynchronous "
                f"all-reduce; choose one of {', '.join(_pipeline_compressors())}"
            )


class _InFlight:
    """One step's all-reduce: its payload, requests and the decoding context."""

    def __init__(self, payload: list[Tensor], ctx: Context | None, requests: list[Any]) -> None:
        self.payload, self.ctx, self.requests = payload, ctx, requests


@register_combiner("pipesgd", PipeSGDOptions)
class PipeSGDCombiner(CountingCombiner):
    """Pipe-SGD, width 2: apply the previous step's averaged gradient (see the module
    docstring)."""

    summary = "pipelined all-reduce: apply last step's averaged gradient (delay 1)"

    def step_time(
        self, compute: float, comm: float, *, straggler: float = 1.0, overlap: float = 0.0
    ) -> tuple[float, float]:
        """Width 2: step ``t - 1``'s all-reduce runs during step ``t``'s computation, so a
        step takes ``max(s T_c, T_m)`` on every rank (the ring all-reduce, :meth:`comm_time`)."""
        t = max(straggler * compute, comm)
        return t, t

    def __init__(self, options: PipeSGDOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.compressor = create_compressor(self.options.compressor)
        self.steps = 0
        self.in_flight: _InFlight | None = None
        self.ready: Tensor | None = None  # a completed average not yet applied (after resume)
        self.apply_now = False  # set by reduce_gradients: step() applies a gradient

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        super().prepare(model, optimizer, env)
        self.compressor.bind(env.world_size)
        self.start_replicas(model, env)
        return model

    def _params(self) -> list[Tensor]:
        assert self.model is not None
        return [p for p in self.model.parameters() if p.requires_grad]

    def _start(self, grad: Tensor) -> _InFlight:
        """Encode this step's gradient and start its all-reduce (asynchronous)."""
        env = self.env
        assert env is not None
        stats = self.compressor.shared_stats(grad)
        if stats is not None and env.distributed:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # small, synchronous
        shared = torch.Generator().manual_seed(derive_seed(self.seed, self.steps, _SALT))
        local = torch.Generator().manual_seed(
            derive_seed(self.seed, self.steps, _SALT, 1 + env.rank)
        )
        payload, ctx = self.compressor.compress(grad, stats, shared=shared, local=local)
        if self.compressor.name == "none":
            payload = [payload[0].clone()]  # a private copy, never a view of .grad
        requests = []
        if env.distributed:
            requests = [dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True) for t in payload]
            self.counter.add(self.compressor.payload_bytes(grad.numel()))
        return _InFlight(list(payload), ctx, requests)

    def _finish(self, flight: _InFlight) -> Tensor:
        """Wait for an all-reduce; the decoded mean gradient (fp32)."""
        assert self.env is not None
        for r in flight.requests:
            r.wait()
        flight.requests = []
        mean = self.compressor.decompress(flight.payload, flight.ctx)
        if mean.dtype != torch.float64:
            mean = mean.float()
        return mean.div_(self.env.world_size)

    @torch.no_grad()
    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        refuse_loss_scaling(
            scaler, self.name, "applies each gradient one step later, under another scale"
        )
        params = self._params()
        wide = all(p.dtype == torch.float64 for p in params)  # else the fp32 wire format
        grad = flat_grads(params, torch.float64 if wide else torch.float32)
        previous, self.in_flight = self.in_flight, self._start(grad)
        if previous is not None:
            mean = self._finish(previous)
        else:
            mean, self.ready = self.ready, None
        self.apply_now = mean is not None
        if mean is not None:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            unflatten_([p.grad for p in params], mean)

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        if self.apply_now:
            super().step(optimizer, scaler)
        self.apply_now = False
        self.steps += 1
        self.counter.step()

    def synchronize(self) -> None:
        """The models are equal; average the BatchNorm statistics (local to each rank)."""
        if self.env is not None and self.env.distributed and self.model is not None:
            self.counter.add(average_buffers_(self.model, self.env))

    def metrics(self) -> dict[str, float]:
        return self.counter.metrics() if self.env is not None and self.env.distributed else {}

    # -- checkpoints: the gradient in flight is saved (its average, the same on every rank) ----
    def _pending(self) -> Tensor | None:
        if self.in_flight is not None:
            self.ready, self.in_flight = self._finish(self.in_flight), None
        return None if self.ready is None else self.ready.clone()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "pending": self._pending()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = int(state_dict["steps"])
        self.in_flight = None
        pending = state_dict["pending"]
        self.ready = None if pending is None else pending.clone()

    def load_other_world(self, states: list[dict[str, Any]]) -> None:
        """The old world's averaged gradient in flight is applied by the new world's first
        step (every old rank saved the same average)."""
        self.load_state_dict(states[0])
