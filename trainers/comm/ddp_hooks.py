"""``--grad-combine powersgd / fp16 / bf16``: DDP with one of PyTorch's communication hooks.

* ``powersgd``: :func:`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.
  powerSGD_hook` (Vogels et al. 2019) with a :class:`PowerSGDState` (rank ``rank``, plain
  all-reduce for the first ``start_iter`` steps, error feedback and warm start on). Matrices
  whose compression saves less than ``min_compression_rate`` — and all 1-D tensors — travel
  uncompressed, by PyTorch's own rule.
* ``fp16`` / ``bf16``: ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``.

The hooks are PyTorch's, not rewritten here. ``bytes_sent`` counts, per bucket, what the hook
sends: the P and Q factors of each compressed matrix plus the uncompressed tensors
(PowerSGD), half the bytes (casts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from ..dist import DistEnv
from .average import DDPCombiner
from .base import option, register_combiner

__all__ = ["BF16Combiner", "FP16Combiner", "PowerSGDCombiner", "PowerSGDOptions"]


class _DDPHookCombiner(DDPCombiner):
    """DistributedDataParallel with the communication hook :meth:`_hook` returns."""

    regroups_in_process = True  # prepare() wraps again with a fresh hook state

    def __init__(self, options: Any = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.state: Any = None

    def _hook(self) -> tuple[Any, Callable[..., Any]]:
        """``(state, hook)`` for ``register_comm_hook``."""
        raise NotImplementedError

    def _bucket_bytes(self, bucket: dist.GradBucket) -> int:
        return 2 * bucket.buffer().numel()  # the casts: half of fp32

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        super().prepare(model, optimizer, env)
        self.start_replicas(model, env, broadcast=False)  # DDP broadcasts rank 0's model
        if not env.distributed:
            return model
        ddp = self._wrap(model, env)
        self.state, inner = self._hook()
        ddp.register_comm_hook(self.state, self._counting(inner))
        return ddp

    def _counting(self, inner: Any) -> Any:
        # No annotations: DDP checks them, and this module's are strings (PEP 563).
        def hook(state, bucket):  # noqa: ANN001, ANN202
            self.counter.add(self._bucket_bytes(bucket))
            return self._finish(inner(state, bucket))

        return hook

    def _finish(self, future: Any) -> Any:
        return future

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        super().step(optimizer, scaler)
        self.counter.step()

    def metrics(self) -> dict[str, float]:
        return self.counter.metrics()


@register_combiner("fp16")
class FP16Combiner(_DDPHookCombiner):
    """DDP whose buckets travel as fp16 (``default_hooks.fp16_compress_hook``)."""

    summary = "gradients cast to fp16 (PyTorch's DDP hook)"

    def _hook(self) -> tuple[Any, Callable[..., Any]]:
        return None, default_hooks.fp16_compress_hook


@register_combiner("bf16")
class BF16Combiner(_DDPHookCombiner):
    """DDP whose buckets travel as bf16 (``default_hooks.bf16_compress_hook``)."""

    summary = "gradients cast to bf16 (PyTorch's DDP hook)"

    def _hook(self) -> tuple[Any, Callable[..., Any]]:
        return None, default_hooks.bf16_compress_hook


@dataclass(frozen=True)
class PowerSGDOptions:
    rank: int = option(2, "rank of the low-rank approximation", flag="--powersgd-rank")
    start_iter: int = option(
        10, "plain all-reduce before this step (>= 2)", flag="--powersgd-start-iter"
    )
    min_compression_rate: float = option(
        2.0,
        "matrices whose compression saves less travel uncompressed",
        flag="--powersgd-min-compression-rate",
    )

    def __post_init__(self) -> None:
        if self.rank < 1 or self.start_iter < 2:
            raise ValueError(
                f"powersgd needs rank >= 1 and start_iter >= 2 (PyTorch's minimum with error "
                f"feedback), got rank={self.rank} and start_iter={self.start_iter}"
            )


@register_combiner("powersgd", PowerSGDOptions)
class PowerSGDCombiner(_DDPHookCombiner):
    """DDP with PyTorch's PowerSGD hook; the run seed seeds its random matrices."""

    summary = "low-rank gradients (PyTorch's DDP hook)"

    def _hook(self) -> tuple[Any, Callable[..., Any]]:
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=self.options.rank,
            start_powerSGD_iter=self.options.start_iter,
            min_compression_rate=self.options.min_compression_rate,
            random_seed=self.seed,
        )
        return state, powerSGD_hook.powerSGD_hook

    def _finish(self, future: Any) -> Any:
        # PowerSGD chains its second all-reduce in a callback thread; with gloo the buckets'
        # collectives can then interleave differently on different ranks (a mismatch).
        # Finishing each bucket before the next one starts keeps them in order.
        done: torch.futures.Future[Tensor] = torch.futures.Future()
        done.set_result(future.wait())
        return done

    def _bucket_bytes(self, bucket: dist.GradBucket) -> int:
        if self.state.iter < self.state.start_powerSGD_iter:
            return 4 * bucket.buffer().numel()
        sent = 0
        r_max = self.options.rank
        for g in bucket.gradients():
            if g.ndim > 1:
                rows, cols = g.shape[0], g.numel() // g.shape[0]
                r = min(rows, cols, r_max)
                if powerSGD_hook._should_compress(rows, cols, r, self.options.min_compression_rate)[
                    0
                ]:
                    sent += 4 * (rows + cols) * r
                    continue
            sent += 4 * g.numel()
        return sent
