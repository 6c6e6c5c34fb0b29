"""``--grad-combine sgp``: Stochastic Gradient Push (Assran, Loizou, Ballas, Rabbat, ICML 2019).

Gossip instead of all-reduce: every step each rank sends its model to **one** peer and
receives one model, on the one-peer time-varying directed exponential graph. Rank ``i`` at
step ``k`` keeps half of its push-sum numerator ``x_i`` and weight ``w_i`` and sends the
other half to ``(i + 2^(k mod L)) mod n`` (``L = floor(log2(n - 1)) + 1``), adding what
arrives from ``(i - 2^(k mod L)) mod n``::

    z_i = x_i / w_i                          # the model the forward/backward sees
    x_i <- x_i - lr * update(grad F(z_i))    # the optimizer's step (momentum stays local)
    x_i <- x_i / 2 + x_in / 2,  w_i <- w_i / 2 + w_in / 2

The model's parameters hold ``z_i`` between steps (what evaluation and checkpoints see).
The optimizer steps them from ``z_i``, so everything it computes from the parameters
(weight decay, a LARS/LAMB trust ratio) sees the de-biased model, as in the paper's
Algorithm 1 where the gradient of a loss with an L2 term is taken at ``z_i``; its update
``u = z_i' - z_i`` is then added to the numerator, ``x_i <- w_i z_i + u``. (The authors'
code instead runs ``torch.optim.SGD`` on the numerators when overlapping, which decays
``x_i`` rather than ``z_i``; without overlap ``w_i = 1`` and the two agree.) Floating-point
buffers (BatchNorm running statistics) are gossiped like the parameters (push-sum on
``w_i b_i``); the integer ``num_batches_tracked`` stays local (it counts the same steps on
every rank). On this graph every rank has one in- and one out-neighbour, so
with messages applied at once the mixing is doubly stochastic and ``w_i`` stays 1; with
``n = 2^m`` ranks and no gradient, ``m`` consecutive rounds give every rank the exact
average (the product of the mixing matrices is ``11^T / n``); with ``n = 2`` every step is
exact averaging.

**Overlap** (``overlap = tau > 0``, the paper's OSGP): the message sent at step ``k`` is
applied at step ``k + tau``, so communication runs behind ``tau`` steps of computation.
Then ``w_i`` departs from 1 (about ``2 / (2 + tau)`` in the steady state) and the push-sum
de-biasing ``z = x / w`` is what keeps the models right; ``sum_i x_i`` plus the messages in
flight, and ``sum_i w_i`` plus theirs (``= n``), are conserved. The schedule is fixed, so a
run is deterministic and resumes bit for bit (messages in flight are checkpointed).

:meth:`synchronize` (before evaluation) applies the messages in flight and all-reduces
``(x, w)``: every rank then holds the exact average ``sum x / sum w`` with ``w = 1``. After
an elastic membership change the new world starts from that same average of the saved
replicas. Bytes per step: one model (plus a weight) to one peer, against ``2 (n - 1) / n``
models for a ring all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..dist import DistEnv
from .base import CountingCombiner, option, refuse_loss_scaling, register_combiner
from .cost import message_time
from .flat import (
    exchange,
    flatten,
    replica_tensors,
    restore_optimizer_state,
    unflatten_,
)

__all__ = ["SGPCombiner", "SGPOptions", "exponential_peers"]

_TAG = 7_000  # tags of SGP's messages: _TAG + step mod _TAG_SPAN
_TAG_SPAN = 1 << 20


def exponential_peers(rank: int, world_size: int, step: int) -> tuple[int, int]:
    """``(send to, receive from)`` of ``rank`` at ``step`` on the one-peer exponential graph."""
    if world_size < 2:
        return rank, rank
    hops = int(math.floor(math.log2(world_size - 1))) + 1
    shift = 2 ** (step % hops)
    return (rank + shift) % world_size, (rank - shift) % world_size


@dataclass(frozen=True)
class SGPOptions:
    overlap: int = option(
        0,
        "OSGP: apply each gossip message this many steps after it is sent (0: SGP, at once)",
        flag="--sgp-overlap",
    )

    def __post_init__(self) -> None:
        if self.overlap < 0:
            raise ValueError(f"overlap must be >= 0 steps, got {self.overlap}")


class _InFlight:
    """One gossip message: the step it was sent at, its buffers and requests."""

    def __init__(self, step: int, sent: Tensor, received: Tensor, requests: list[Any]) -> None:
        self.step = step
        self.sent = sent  # private copy, kept alive until the send completes
        self.received = received
        self.requests = requests

    def wait(self) -> Tensor:
        for r in self.requests:
            r.wait()
        self.requests = []
        return self.received


@register_combiner("sgp", SGPOptions)
class SGPCombiner(CountingCombiner):
    """Stochastic Gradient Push on the one-peer exponential graph (see the module docstring)."""

    summary = "gossip: push-sum to one peer per step (exponential graph)"

    def comm_time(self, grad_bytes: float, workers: int, gbps: float, latency_s: float) -> float:
        """One model to one peer a step: ``S / B + a``."""
        return message_time(grad_bytes, gbps, latency_s)

    def step_time(
        self, compute: float, comm: float, *, straggler: float = 1.0, overlap: float = 0.0
    ) -> tuple[float, float]:
        """Lockstep gossip: ``s T_c + T_m``; with ``overlap`` ``tau >= 1`` messages in flight
        the sends hide behind the computation, ``max(s T_c, T_m / tau)``."""
        slow = straggler * compute
        tau = self.options.overlap
        t = max(slow, comm / tau) if tau >= 1 else slow + comm
        return t, t

    def __init__(self, options: SGPOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.overlap = self.options.overlap
        self.steps = 0
        self.weight = 1.0  # the push-sum weight w_i
        self.in_flight: list[_InFlight] = []

    # -- the tensors gossiped: parameters and floating-point buffers ---------------------------
    def _tensors(self) -> list[Tensor]:
        assert self.model is not None
        return replica_tensors(self.model)

    def _numerator(self) -> Tensor:
        """``x = z w`` as one fp32 vector with ``w`` appended (the message layout)."""
        flat = flatten(self._tensors())
        if self.weight != 1.0:
            flat.mul_(self.weight)
        return torch.cat([flat, flat.new_tensor([self.weight])])

    def _set(self, message: Tensor) -> None:
        """Parameters and buffers <- ``x / w`` of a message-layout vector."""
        weight = float(message[-1])
        x = message[:-1]
        unflatten_(self._tensors(), x if weight == 1.0 else x / weight)
        self.weight = weight

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        super().prepare(model, optimizer, env)
        self.start_replicas(model, env)
        self.counter.peers = 0
        return model

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        refuse_loss_scaling(scaler, self.name, "steps local models whose loss scales would differ")

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        """The optimizer's update, computed at ``z`` (its weight decay acts on ``z``, as the
        paper's ``grad F_i(z_i)`` of a loss with an L2 term), added to ``x = w z``; then gossip."""
        assert self.env is not None
        tensors = self._tensors()
        z = flatten(tensors) if self.weight != 1.0 else None  # w = 1 (no overlap): x is z
        super().step(optimizer, scaler)  # z + u: the parameters held z
        flat = flatten(tensors)
        if z is not None:  # x + u = w z + (z + u - z)
            flat.add_(z, alpha=self.weight - 1.0)
        message = torch.cat([flat, flat.new_tensor([self.weight])])
        if self.env.distributed:
            self._gossip(message)
        self._set(message)  # z = x / w
        self.steps += 1
        self.counter.step()

    def _gossip(self, message: Tensor) -> None:
        """``message`` (x, w) <- half of it plus the messages due at this step."""
        env = self.env
        assert env is not None
        message.mul_(0.5)  # keep half, send half
        dst, src = exponential_peers(env.rank, env.world_size, self.steps)
        sent = message.clone()
        received = torch.empty_like(message)
        tag = _TAG + self.steps % _TAG_SPAN
        self.in_flight.append(
            _InFlight(self.steps, sent, received, exchange(sent, dst, received, src, tag=tag))
        )
        self.counter.add(sent.numel() * sent.element_size())
        self.counter.add_peers(1)
        while self.in_flight and self.in_flight[0].step <= self.steps - self.overlap:
            message += self.in_flight.pop(0).wait()

    def _drain(self) -> Tensor:
        """``(x, w)`` with every message in flight applied."""
        total = self._numerator()
        for msg in self.in_flight:
            total += msg.wait()
        self.in_flight = []
        return total

    @torch.no_grad()
    def synchronize(self) -> None:
        """Apply the messages in flight, then every rank takes ``sum x / sum w`` with ``w = 1``."""
        env = self.env
        if env is None or not env.distributed:
            return
        total = self._drain()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        self.counter.add(total.numel() * total.element_size())
        self._set(torch.cat([total[:-1] / total[-1], total.new_ones(1)]))

    def metrics(self) -> dict[str, float]:
        return self.counter.metrics() if self.env is not None and self.env.distributed else {}

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        assert self.model is not None and self.optimizer is not None
        pending = [(m.step, m.wait().clone()) for m in self.in_flight]
        return {
            "steps": self.steps,
            "weight": self.weight,
            "tensors": [t.detach().clone() for t in self._tensors()],
            "pending": pending,
            "optimizer": self.optimizer.state_dict()["state"],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = int(state_dict["steps"])
        self.weight = float(state_dict["weight"])
        with torch.no_grad():
            for t, saved in zip(self._tensors(), state_dict["tensors"], strict=True):
                t.copy_(saved)
        self.in_flight = [_InFlight(int(step), msg, msg, []) for step, msg in state_dict["pending"]]
        assert self.optimizer is not None
        restore_optimizer_state(self.optimizer, state_dict.get("optimizer"))

    @torch.no_grad()
    def load_other_world(self, states: list[dict[str, Any]]) -> None:
        """The exact average ``sum x / sum w`` of the old replicas (messages in flight
        included); ``w = 1``, nothing in flight."""
        total: Tensor | None = None
        for state in states:
            x = torch.cat([t.reshape(-1).float() for t in state["tensors"]]) * state["weight"]
            part = torch.cat([x, x.new_tensor([state["weight"]])])
            for _, msg in state["pending"]:
                part += msg
            total = part if total is None else total + part
        assert total is not None
        self.steps, self.in_flight = 0, []
        self._set(torch.cat([total[:-1] / total[-1], total.new_ones(1)]))
