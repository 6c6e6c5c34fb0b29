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

    momentum: float = option(
        0.0,
        "momentum applied before compression, as the DEF authors run their error-feedback "
        "baseline: m = mu m + g + wd w, each tensor compressed on its own as C(m + e "
        "lr_prev / lr); the optimizer's momentum must be 0 (its weight decay is applied here) "
        "(0: momentum in the optimizer, after the averaged compressed gradient)",
        flag="--ef-momentum",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.bucket_mb >= 0:
            raise ValueError(f"bucket_mb must be >= 0 (0: no buckets), got {self.bucket_mb}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1) (0: off), got {self.momentum}")
        if self.momentum > 0 and self.bucket_mb > 0:
            raise ValueError(
                "momentum (--ef-momentum) compresses each tensor on its own after the backward; "
                "drop bucket_mb (--ef-bucket-mb)"
            )


@register_combiner("ef", EFOptions)
class ErrorFeedbackCombiner(CompressedCombiner):
    """Compressed gradient averaging with error feedback (Seide et al. 2014; Karimireddy et
    al. 2019).

    Per step, on each worker: ``p = g + e``; ``c = C(p)``; the workers' ``c`` are averaged
    into every ``p.grad``; ``e = p - c``. The optimizer then steps on the average, so the
    replicas stay identical (rank 0's buffers are broadcast after each step, as DDP does).
    Gradient clipping applies to the averaged gradient. Works with any compressor; the
    run seed seeds the per-step generators (random block offsets, QSGD rounding).

    With ``momentum > 0`` (``--ef-momentum``; the error-feedback baseline of the DEF
    authors, ``anxuthu/DEF`` ``optimizers/ef.py``) momentum comes **before** compression: at
    each optimizer step (in :meth:`step`, where the step's lr is known) every worker forms
    ``m = mu m + g + wd w`` (``wd``: the optimizer group's weight decay, which the optimizer
    then skips), ``p = m + (lr_prev / lr) e``, compresses each parameter tensor on its own
    (tensor ``i`` draws from generators salted with ``i``), sends it, ``e = p - C(p)``, and the
    optimizer (momentum 0) steps ``w -= lr mean_j C(p_j)``. The error is kept in units of the
    update divided by the lr, rescaled when the lr changes, as the authors' code does; the
    released residual is not amplified by the optimizer's momentum. Gradient clipping, which
    runs before the step, then clips each worker's own gradient.

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
        self.momentum_buffer: Tensor | None = None  # momentum > 0: m (flat)
        self.last_lrs: list[float] | None = None  # momentum > 0: each group's previous lr

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        model = super().prepare(model, optimizer, env)
        if self.options.momentum > 0:
            for group in optimizer.param_groups:
                if "momentum" not in group or group["momentum"] != 0 or group.get("nesterov"):
                    raise ValueError(
                        "--ef-momentum applies momentum before compression: the optimizer must "
                        "be SGD with momentum 0 (pass --momentum 0; now "
                        f"{group.get('momentum', 'an optimizer without momentum')!r})"
                    )
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
        if self.options.momentum > 0:  # compressed in step(), where the lr is known
            return
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

    @torch.no_grad()
    def _momentum_first(self, optimizer: torch.optim.Optimizer) -> list[float]:
        """``momentum > 0``: momentum, error feedback and the per-tensor compressed average
        into every ``p.grad``; returns each group's weight decay (the step runs without)."""
        mu = self.options.momentum
        groups = optimizer.param_groups
        lrs = [float(g["lr"]) for g in groups]
        last = self.last_lrs if self.last_lrs is not None else lrs
        params: list[tuple[Tensor, float, float]] = []  # (parameter, wd, lr_prev / lr)
        for group, lr, prev in zip(groups, lrs, last, strict=True):
            scale = prev / lr if lr > 0 and prev > 0 else 1.0
            params += [(p, float(group["weight_decay"]), scale) for p in group["params"]
                       if p.requires_grad]  # fmt: skip
        n = sum(p.numel() for p, _, _ in params)
        if self.residual is None:
            self.residual = torch.zeros(n)
            self.momentum_buffer = torch.zeros(n)
        assert self.momentum_buffer is not None
        offset = 0
        sent = torch.empty(n)
        for p, wd, scale in params:
            span = slice(offset, offset + p.numel())
            offset += p.numel()
            g = p.grad.reshape(-1).float() if p.grad is not None else torch.zeros(p.numel())
            if wd:
                g = g + wd * p.detach().reshape(-1).float()
            m = self.momentum_buffer[span]
            m.mul_(mu).add_(g)
            sent[span] = m + scale * self.residual[span]
        tensors = [p for p, _, _ in params]
        mean, own = self._reduce_per_tensor(sent, self.compressor, tensors)
        self.residual = sent - own
        for p, piece in zip(tensors, mean.split([p.numel() for p in tensors]), strict=True):
            p.grad = piece.view_as(p).to(p.dtype).clone()
        self.last_lrs = lrs
        self.counter.step()
        decays = [g["weight_decay"] for g in groups]
        for g in groups:
            g["weight_decay"] = 0.0
        return decays

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        if self.options.momentum > 0:
            decays = self._momentum_first(optimizer)
            try:
                super().step(optimizer, scaler)
            finally:
                for g, wd in zip(optimizer.param_groups, decays, strict=True):
                    g["weight_decay"] = wd
        else:
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
        if self.momentum_buffer is not None:
            state["momentum_buffer"] = self.momentum_buffer.clone()
            state["last_lrs"] = list(self.last_lrs or [])
        if self._buckets is not None:  # the buckets' order: a resumed run cuts the same ones
            order = self._buckets.layout_state(self._model_params())
            if order is not None:
                state["bucket_order"] = order
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        residual = state_dict.get("residual")
        self.residual = residual.clone() if residual is not None else None
        buffer = state_dict.get("momentum_buffer")
        self.momentum_buffer = buffer.clone() if buffer is not None else None
        self.last_lrs = list(state_dict["last_lrs"]) if "last_lrs" in state_dict else None
        order = state_dict.get("bucket_order")
        if order is not None and self._buckets is not None:
            self._buckets.load_layout(self._model_params(), order, self.options.overlap)
