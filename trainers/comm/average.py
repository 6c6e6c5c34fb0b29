"""``--grad-combine average``: gradient averaging with ``DistributedDataParallel`` (the default)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._dtensor import is_dtensor, is_pipeline_parallel, local_tensor
from ..dist import DistEnv
from .base import CountingCombiner, option, register_combiner
from .flat import allreduce_mean_

__all__ = ["AverageCombiner", "AverageOptions", "DDPCombiner"]


@dataclass(frozen=True)
class AverageOptions:
    find_unused_parameters: bool = option(
        False,
        "let DDP find parameters that get no gradient in a step (slower; needed "
        "when part of the model is unused)",
        flag="--ddp-find-unused-parameters",
    )
    bucket_cap_mb: float | None = option(
        None,
        "DDP's gradient bucket size in MB (default: DDP's, 25)",
        flag="--ddp-bucket-cap-mb",
    )

    def __post_init__(self) -> None:
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")

    def ddp_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"find_unused_parameters": self.find_unused_parameters}
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        return kwargs


class DDPCombiner(CountingCombiner):
    """What the modes built on ``DistributedDataParallel`` share: the wrapper, its
    ``no_sync`` for non-final micro-steps, and a byte counter."""

    def __init__(self, options: Any = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.ddp: DistributedDataParallel | None = None

    def _wrap(self, model: nn.Module, env: DistEnv, **ddp_kwargs: Any) -> DistributedDataParallel:
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)
        return self.ddp

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if self.ddp is None:
            yield
        else:
            with self.ddp.no_sync():
                yield


@register_combiner("average", AverageOptions)
class AverageCombiner(DDPCombiner):
    """Average gradients across ranks with ``DistributedDataParallel``.

    With one rank the model is used as is. DDP all-reduces (sums, then divides by the world
    size) bucket by bucket during the final micro-step's backward, overlapping communication
    with computation; :meth:`no_sync` skips it on the other micro-steps.
    """

    summary = "gradients averaged by DistributedDataParallel"
    supports_tensor_parallel = True
    regroups_in_process = True

    def __init__(self, options: Any = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self._average_after_backward = False  # DTensor parameters: averaged without DDP

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        super().prepare(model, optimizer, env)
        if not env.distributed:
            return model
        if is_pipeline_parallel(model) or any(is_dtensor(p) for p in model.parameters()):
            # Tensor-parallel: DDP would swap the DTensor parameters for local ones, which the
            # optimizer (holding the DTensors) would no longer see; a pipeline stage's backward
            # runs inside the schedule, not through DDP's forward. Average the (local)
            # gradients over the data-parallel group after the backward instead.
            self._average_after_backward = True
            self.counter.grad_bytes = sum(
                local_tensor(p).numel() * local_tensor(p).element_size() for p in model.parameters()
            )
            return model
        self.start_replicas(model, env, broadcast=False)  # DDP broadcasts rank 0's model
        return self._wrap(model, env, **self.options.ddp_kwargs())

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        if not self._average_after_backward or self.model is None or self.env is None:
            return
        with torch.no_grad():  # to_local() is then the shard itself, not an autograd view
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in self.model.parameters():
                if p.grad is not None:
                    g = local_tensor(p.grad)
                    by_dtype.setdefault(g.dtype, []).append(g)
        for same in by_dtype.values():  # over env.group: the data-parallel replicas
            allreduce_mean_(same, self.env, dtype=None)

    @property
    def _communicates(self) -> bool:
        return self.ddp is not None or self._average_after_backward

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        super().step(optimizer, scaler)
        if self._communicates:
            self.counter.add(self.counter.grad_bytes)  # one dense all-reduce of the gradients
            self.counter.step()

    def metrics(self) -> dict[str, float]:
        return self.counter.metrics() if self._communicates else {}
