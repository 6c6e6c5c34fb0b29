"""Flatten -> collective -> unflatten, written once for every combiner.

A combiner that communicates a list of tensors (gradients, parameters, buffers, optimizer
accumulators) packs them into one flat vector, runs one collective on it and copies the
result back. These helpers are the only place that does it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..dist import DistEnv

__all__ = [
    "allreduce_mean_",
    "average_buffers_",
    "average_models_",
    "broadcast_",
    "exchange",
    "flat_grads",
    "flatten",
    "model_tensors",
    "replica_tensors",
    "restore_optimizer_state",
    "unflatten_",
]


def model_tensors(model: nn.Module) -> list[Tensor]:
    """Parameters then buffers (what DDP broadcasts from rank 0 at the start)."""
    return list(model.parameters()) + list(model.buffers())


def replica_tensors(model: nn.Module) -> list[Tensor]:
    """Parameters then floating-point buffers: what model-averaging modes mix."""
    return list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]


def flatten(tensors: Sequence[Tensor], dtype: torch.dtype | None = torch.float32) -> Tensor:
    """The tensors' values as one new vector, in ``dtype`` (``None``: their own dtype)."""
    if dtype is None:
        return torch.cat([t.detach().reshape(-1) for t in tensors])
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])


def unflatten_(tensors: Sequence[Tensor], flat: Tensor) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (cast to each tensor's dtype)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.detach().copy_(flat[offset : offset + n].view_as(t))
            offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} elements, the tensors {offset}")


def flat_grads(params: Sequence[Tensor], dtype: torch.dtype = torch.float32) -> Tensor:
    """The gradients of ``params`` as one vector in ``dtype`` (zeros where a gradient is
    ``None``)."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype)
            for p in params
        ]
    )


def broadcast_(tensors: Sequence[Tensor], src: int = 0, *, group: Any = None) -> None:
    """Rank ``src``'s values of ``tensors`` on every rank of ``group`` (default: the world;
    ``src`` is a world rank); one message per dtype and device."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    for same in by_kind.values():
        flat = flatten(same, dtype=None)
        dist.broadcast(flat, src=src, group=group)
        unflatten_(same, flat)


def exchange(
    send: Tensor, dst: int, recv: Tensor, src: int, *, group: Any = None, tag: int = 0
) -> list[Any]:
    """Post a send of ``send`` to rank ``dst`` and a receive from rank ``src`` into ``recv``.

    Point-to-point, non-blocking (``isend``/``irecv``; not ``batch_isend_irecv``, which can
    hang on gloo): returns the two requests, wait on them before touching either buffer.
    ``send`` must be a private copy that nothing writes to until then. Ranks are global.
    """
    return [
        dist.isend(send, dst, group=group, tag=tag),
        dist.irecv(recv, src, group=group, tag=tag),
    ]


def allreduce_mean_(
    tensors: Sequence[Tensor], env: DistEnv, *, dtype: torch.dtype | None = torch.float32
) -> int:
    """Average ``tensors`` over the ranks of ``env`` (its ``group``: the world, or the
    replicas of a data-parallel view) in place, one all-reduce; returns the bytes sent.

    The values travel in ``dtype`` (``None``: the tensors' own). Nothing happens (0 bytes)
    in a world of one or for an empty list.
    """
    if not tensors or not env.distributed:
        return 0
    with torch.no_grad():
        flat = flatten(tensors, dtype)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=env.group)
        flat /= env.world_size
        unflatten_(tensors, flat)
    return flat.element_size() * flat.numel()


def average_buffers_(model: nn.Module, env: DistEnv) -> int:
    """Average the floating-point buffers (BatchNorm statistics) over the workers; bytes sent."""
    return allreduce_mean_([b for b in model.buffers() if b.is_floating_point()], env)


def average_models_(model: nn.Module, env: DistEnv) -> int:
    """Exactly average parameters and floating buffers over the workers; returns bytes sent."""
    if not env.distributed:
        return 0
    return allreduce_mean_(list(model.parameters()), env) + average_buffers_(model, env)


def restore_optimizer_state(optimizer: torch.optim.Optimizer, state: Any) -> None:
    """Put this rank's saved per-parameter optimizer state (momenta) back; ``None``: nothing."""
    if state is None:
        return
    full = optimizer.state_dict()  # keeps the current param groups (learning rates)
    full["state"] = state
    optimizer.load_state_dict(full)
