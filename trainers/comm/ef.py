"""``--grad-combine ef``: compressed gradient averaging with error feedback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..dist import DistEnv
from .base import option, register_combiner
from .compressed import CompressedCombiner, CompressorOptions, no_loss_scaling
from .flat import broadcast_, flat_grads
from .overlap import BackwardBuckets

__all__ = ["EFOptions", "ErrorFeedbackCombiner"]


@dataclass(frozen=True)
class EFOptions(CompressorOptions):
    bucket_mb: float = option(
        0.0,
        "compress and send the gradient in buckets of this many MB, in backward order, each "
        "compressed on its own (0: the whole gradient as one vector, after the backward)",
        flag="--ef-bucket-mb",
    )
    overlap: bool = option(
        True,
        "with --ef-bucket-mb: send each bucket while the backward computes the rest; same "
        "results as --no-ef-overlap",
        flag="--ef-overlap",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.bucket_mb >= 0:
            raise ValueError(f"bucket_mb must be >= 0 (0: no buckets), got {self.bucket_mb}")


@register_combiner("ef", EFOptions)
class ErrorFeedbackCombiner(CompressedCombiner):
    """Compressed gradient averaging with error feedback (Seide et al. 2014; Karimireddy et
    al. 2019).

    Per step, on each worker: ``p = g + e``; ``c = C(p)``; the workers' ``c`` are averaged
    into every ``p.grad``; ``e = p - c``. The optimizer then steps on the average, so the
    replicas stay identical (rank 0's buffers are broadcast after each step, as DDP does).
    Gradient clipping applies to the averaged gradient. Works with any compressor; the
    run seed seeds the per-step generators (random block offsets, QSGD rounding).

    With ``bucket_mb > 0`` the vector is cut into buckets of parameters in backward order
    (:mod:`trainers.comm.overlap`: recorded in the first step, rank 0's order for all) and
    each bucket is compressed, sent and fed back on its own (``C`` per bucket: top-k keeps
    ``ratio`` of each bucket; bucket ``b`` draws from generators salted with ``b``), as
    Horovod and DDP's PowerSGD hook compress per tensor or per bucket. With ``overlap`` (the
    default) each bucket goes out while the backward computes the layers below; results
    equal ``overlap=False`` bit for bit. The residual keeps the flat layout of
    ``model.parameters()`` either way (checkpoints do not depend on the buckets).
    """

    summary = "a --compressor with error feedback"

    def __init__(self, options: EFOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.residual: Tensor | None = None
        self._buckets: BackwardBuckets | None = None
        self._views: dict[Tensor, slice] = {}  # parameter -> its span of the flat residual

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        model = super().prepare(model, optimizer, env)
        if self.options.bucket_mb > 0 and env.distributed:
            params = [p for p in model.parameters() if p.requires_grad]
            offset = 0
            for p in params:
                self._views[p] = slice(offset, offset + p.numel())
                offset += p.numel()
            cap = max(1, int(self.options.bucket_mb * 2**20))
            self._buckets = BackwardBuckets(params[::-1], cap, self._reduce_bucket)
        return model

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulation micro-steps: the overlap hooks launch nothing."""
        with self._buckets.paused() if self._buckets is not None else contextlib.nullcontext():
            yield

    @torch.no_grad()
    def _reduce_bucket(self, b: int, grads: list[Tensor]) -> None:
        """Bucket ``b``: ``p = g + e``, ``c = C(p)``, the mean of the ``c`` into the gradients,
        ``e = p - c`` (on the overlap worker, or in ``reduce_gradients``)."""
        assert self._buckets is not None and self.residual is not None
        params = [self._buckets.params[i] for i in self._buckets.buckets[b]]
        spans = [self._views[p] for p in params]
        residual = torch.cat([self.residual[s] for s in spans])
        x = flat_grads(params) + residual
        mean, own = self._reduce(x, self.compressor, salt=b, params=params)
        x -= own
        offset = 0
        for p, s, g in zip(params, spans, grads, strict=True):
            n = p.numel()
            self.residual[s] = x[offset : offset + n]
            g.copy_(mean[offset : offset + n].view_as(g))
            offset += n

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        no_loss_scaling(scaler, self.name)
        assert self.model is not None and self.env is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self._buckets is not None:
            if self.residual is None:
                self.residual = torch.zeros(sum(p.numel() for p in params))
            self._buckets.reduce_all()
            self._buckets.end_step(self.options.overlap)
            self.counter.step()
            return
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

    def close(self) -> None:
        """End of ``fit``: stop the overlap worker (a later step starts it again)."""
        if self._buckets is not None:
            self._buckets.close()

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        super().step(optimizer, scaler)
        self.steps += 1
        if self.env is not None and self.env.distributed:
            assert self.model is not None
            broadcast_(list(self.model.buffers()))

    def _model_params(self) -> list[Tensor]:
        assert self.model is not None
        return [p for p in self.model.parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.residual is not None:
            state["residual"] = self.residual.clone()
        if self._buckets is not None:  # the buckets' order: a resumed run cuts the same ones
            order = self._buckets.layout_state(self._model_params())
            if order is not None:
                state["bucket_order"] = order
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        residual = state_dict.get("residual")
        self.residual = residual.clone() if residual is not None else None
        order = state_dict.get("bucket_order")
        if order is not None and self._buckets is not None:
            self._buckets.load_layout(self._model_params(), order, self.options.overlap)
