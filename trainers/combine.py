"""Gradient combiners: how the ranks' gradients (or updates) become one optimizer step.

The trainer's loop never talks to ``DistributedDataParallel`` or to any collective directly;
it calls a :class:`GradCombiner` at five fixed points of every optimizer step::

    model_fwd = combiner.prepare(model, env)        # once: wrap (DDP) or keep the module
    for each micro-batch of the step:
        with combiner.no_sync() if not last else nullcontext():
            loss = train_step(model_fwd, batch); backward(loss / n)
    combiner.reduce_gradients(scaler)               # grads still carry the fp16 loss scale
    scaler.unscale_(optimizer); clip_grad_norm_(...)   # trainer (if fp16 / clipping)
    set the learning rate                            # trainer
    combiner.step(optimizer, scaler)                # the (combined) optimizer step
    scaler.update(); optimizer.zero_grad()           # trainer
    combiner.metrics()                              # extra numbers for the step records

How later combiners fit without touching the loop:

* **Averaging** (:class:`AverageCombiner`, the default): ``prepare`` wraps the model in DDP,
  which all-reduces during the final backward; ``no_sync`` is DDP's; the other hooks are
  trivial.
* **Adasum, gradient mode**: ``prepare`` returns the bare module, ``no_sync`` is a null
  context (nothing syncs anyway), ``reduce_gradients`` Adasum-combines ``p.grad`` per tensor.
  Adasum is scale-equivariant, so combining scaled fp16 gradients is exact, and a
  non-finite gradient on any rank propagates to all so every rank skips the step together.
* **Adasum, delta mode** (adaptive optimizers): ``reduce_gradients`` does nothing;
  ``step`` snapshots the parameters, runs the local ``scaler.step(optimizer)`` /
  ``optimizer.step()``, Adasum-combines the deltas ``w_new - w_start`` and writes
  ``w_start + combined`` back. Clipping then applies to local gradients (as in Horovod).
* **Compression** (:mod:`trainers.compress`): PyTorch's DDP communication hooks (PowerSGD,
  fp16/bf16 casts) through ``prepare``; error feedback on the bare module in
  ``reduce_gradients`` (residuals are the combiner's state); CSER in ``step``.
* **Local SGD / SlowMo / Local AdaAlter** (:mod:`trainers.localsgd`): bare module; ``step``
  runs the local step and every H steps averages parameters, keeping its counters in
  ``state_dict``.

``synchronize()`` is called before every evaluation: combiners whose replicas drift apart
(CSER, the local-SGD family) make them equal there. ``metrics()`` reports ``bytes_sent`` (what
one worker sends per optimizer step), ``grad_bytes`` (the dense fp32 gradient) and
``compression_ratio`` when the world has more than one rank.

``state_dict()`` is saved **per rank** in checkpoints (residuals differ between ranks) and
given back to the same rank on resume when the world size is unchanged; after a world-size
change ``load_state_dict`` is not called and the combiner starts fresh.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .dist import DistEnv

__all__ = [
    "AverageCombiner",
    "CommCounter",
    "GradCombiner",
    "broadcast_",
    "flat_grads",
    "model_tensors",
    "restore_optimizer_state",
    "unwrap_model",
]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` (or ``torch.compile``) wrapper."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


class GradCombiner:
    """Base class: a world of independent ranks that each step on their own gradients.

    Subclasses override the hooks they need; see the module docstring for when the trainer
    calls each one. The base implementation does no communication at all (correct for a
    world of one).
    """

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.env: DistEnv | None = None

    def prepare(self, model: nn.Module, env: DistEnv) -> nn.Module:
        """Called once; returns the module the trainer calls ``train_step`` with."""
        self.model = model
        self.env = env
        return model

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context for the backward of a non-final micro-step (skip communication)."""
        yield

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        """After the final backward, before unscaling and clipping: combine ``p.grad``."""

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        """Perform the optimizer step (through ``scaler.step`` when a scaler is given)."""
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()

    def synchronize(self) -> None:
        """Before evaluation (a collective): make diverged replicas equal (no-op here)."""

    def metrics(self) -> dict[str, float]:
        """Extra numbers for the step records (e.g. bytes sent per step)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (saved per rank)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same rank."""


class AverageCombiner(GradCombiner):
    """Average gradients across ranks with ``DistributedDataParallel`` (the default).

    With one rank the model is used as is. DDP all-reduces (sums, then divides by the world
    size) bucket by bucket during the final micro-step's backward, overlapping communication
    with computation; :meth:`no_sync` skips it on the other micro-steps.

    Args:
        **ddp_kwargs: passed to ``DistributedDataParallel`` (e.g.
            ``find_unused_parameters=True``, ``gradient_as_bucket_view=True``).
    """

    def __init__(self, **ddp_kwargs: Any) -> None:
        super().__init__()
        self.ddp_kwargs = ddp_kwargs
        self.ddp: DistributedDataParallel | None = None
        self.counter = CommCounter()

    def prepare(self, model: nn.Module, env: DistEnv) -> nn.Module:
        super().prepare(model, env)
        if not env.distributed:
            return model
        self.counter.grad_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs)
        return self.ddp

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if self.ddp is None:
            yield
        else:
            with self.ddp.no_sync():
                yield

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        super().step(optimizer, scaler)
        if self.ddp is not None:
            self.counter.add(self.counter.grad_bytes)  # one dense all-reduce of the gradients
            self.counter.step()

    def metrics(self) -> dict[str, float]:
        return self.counter.metrics() if self.ddp is not None else {}


class CommCounter:
    """Bytes one worker sends, summed between two :meth:`metrics` calls (the log interval).

    ``grad_bytes`` is the size of the dense fp32 gradient; ``compression_ratio`` is
    ``grad_bytes / bytes_sent`` (1 for plain averaging; above 1 when sending less).
    """

    def __init__(self) -> None:
        self.grad_bytes = 0
        self.bytes = 0
        self.steps = 0
        self.total_bytes = 0  # since the start (or since the combiner was created)

    def add(self, nbytes: int) -> None:
        self.bytes += int(nbytes)
        self.total_bytes += int(nbytes)

    def step(self) -> None:
        self.steps += 1

    def metrics(self) -> dict[str, float]:
        if self.steps == 0:
            return {}
        per_step = self.bytes / self.steps
        out = {
            "bytes_sent": per_step,
            "grad_bytes": float(self.grad_bytes),
            "compression_ratio": self.grad_bytes / per_step if per_step else math.inf,
        }
        self.bytes, self.steps = 0, 0
        return out


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters then buffers (what DDP broadcasts from rank 0 at the start)."""
    return list(model.parameters()) + list(model.buffers())


def flat_grads(params: list[torch.Tensor]) -> torch.Tensor:
    """The gradients of ``params`` as one fp32 vector (zeros where a gradient is ``None``)."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
            for p in params
        ]
    )


def broadcast_(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Rank ``src``'s values of ``tensors`` on every rank; one message per dtype and device."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for group in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            dist.broadcast(flat, src=src)
            offset = 0
            for t in group:
                t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def restore_optimizer_state(optimizer: torch.optim.Optimizer, state: Any) -> None:
    """Put this rank's saved per-parameter optimizer state (momenta) back; ``None``: nothing."""
    if state is None:
        return
    full = optimizer.state_dict()  # keeps the current param groups (learning rates)
    full["state"] = state
    optimizer.load_state_dict(full)
