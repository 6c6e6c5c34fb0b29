"""Communicate less often: local SGD (post-local SGD), SlowMo and Local AdaAlter.

Every worker steps its own model on its own data and the models are averaged every ``H``
optimizer steps (``H = 1``: after every step, which for SGD with or without momentum is
synchronous data-parallel SGD, momentum being linear in the gradient). Evaluation
(:meth:`~trainers.combine.GradCombiner.synchronize`) averages the models first, so every
rank evaluates the same model.

* :class:`LocalSGDCombiner` — post-local SGD (Lin et al., ICLR 2020): the first
  ``warmup_steps`` steps average gradients like DDP, then models are averaged every
  ``period`` steps by PyTorch's
  :class:`~torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager`.
* :class:`SlowMoCombiner` — SlowMo (Wang et al., ICLR 2020; fairscale's defaults: base
  local SGD averaging every 3 steps, slow momentum ``b = 0.5`` and slow lr ``alpha = 1``
  every 48 steps). At a slow step the models are averaged exactly, then with ``x0`` the
  model of the previous slow step and ``lr`` the current learning rate::

      buf = b * buf + (x0 - avg) / lr
      x0 = x0 - lr * alpha * buf          # every replica takes x0

  With ``b = 0`` and ``alpha = 1`` this is plain periodic averaging.
* :class:`LocalAdaAlterCombiner` — Local AdaAlter (Xie, Koyejo, Gupta, Lin 2019,
  arXiv:1911.09030): local SGD whose step is AdaGrad's with a lagging denominator. Each
  worker accumulates ``A_i += g_i^2`` locally; the denominator uses only the accumulator
  of the last synchronisation ``D`` (identical on every worker) plus ``eps^2`` per local
  step since then::

      x_i <- x_i - lr * g_i / sqrt(D + s * eps^2)     # s = 1, 2, ..., H since the last sync
      every H steps: x_i <- mean_j x_j;  A_i <- mean_j A_j;  D <- A_i

  It replaces the optimizer's update: use ``--optimizer sgd --momentum 0`` (its learning
  rate and weight decay are used).

Floating-point buffers (BatchNorm statistics) are averaged together with the models.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from .combine import CommCounter, GradCombiner, broadcast_, model_tensors, restore_optimizer_state
from .compress import average_buffers_
from .dist import DistEnv

__all__ = ["LocalAdaAlterCombiner", "LocalSGDCombiner", "SlowMoCombiner", "average_models_"]


def average_models_(model: nn.Module, env: DistEnv) -> int:
    """Exactly average parameters and floating buffers over the workers; returns bytes sent."""
    if not env.distributed:
        return 0
    params = [p for p in model.parameters()]
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).float() for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= env.world_size
        offset = 0
        for p in params:
            p.detach().copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    return 4 * flat.numel() + average_buffers_(model, env)


def _check_period(value: int, flag: str) -> int:
    if value < 1:
        raise ValueError(f"{flag} must be >= 1 (optimizer steps between averagings), got {value}")
    return int(value)


class _LocalCombiner(GradCombiner, abc.ABC):
    """Bare module, rank 0's start, per-rank state in checkpoints, byte counting."""

    mode = "local"

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.counter = CommCounter()
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending: Any = None

    def prepare(self, model: nn.Module, env: DistEnv) -> nn.Module:
        super().prepare(model, env)
        self.counter.grad_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
        if env.distributed:
            broadcast_(model_tensors(model))
        return model

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        if scaler is not None:
            raise ValueError(
                f"--grad-combine {self.mode} steps local models whose fp16 loss scales would "
                "differ between workers; train with --dtype bfloat16 or float32"
            )

    def _local_step(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ) -> None:
        super().step(optimizer, scaler)

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        self._optimizer = optimizer
        restore_optimizer_state(optimizer, self._pending)
        self._pending = None
        self._local_step(optimizer, scaler)
        self.steps += 1
        self._communicate(optimizer)
        self.counter.step()

    @abc.abstractmethod
    def _communicate(self, optimizer: torch.optim.Optimizer) -> None:
        """After the local step ``self.steps`` (1-based): average when due."""

    def _average(self) -> None:
        assert self.model is not None and self.env is not None
        self.counter.add(average_models_(self.model, self.env))

    def synchronize(self) -> None:
        """Average the models (before evaluation)."""
        if self.env is not None and self.env.distributed:
            self._average()

    def metrics(self) -> dict[str, float]:
        return self.counter.metrics()

    def state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        state: dict[str, Any] = {
            "steps": self.steps,
            "params": [p.detach().clone() for p in self.model.parameters()],
            "buffers": [b.detach().clone() for b in self.model.buffers()],
        }
        if self._optimizer is not None:
            state["optimizer"] = self._optimizer.state_dict()["state"]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = int(state_dict["steps"])
        assert self.model is not None
        with torch.no_grad():
            for t, saved in zip(self.model.parameters(), state_dict["params"], strict=True):
                t.copy_(saved)
            for t, saved in zip(self.model.buffers(), state_dict["buffers"], strict=True):
                t.copy_(saved)
        self._pending = state_dict.get("optimizer")


class LocalSGDCombiner(_LocalCombiner):
    """(Post-)local SGD: average gradients for ``warmup_steps``, then models every ``period``.

    Args:
        period: ``H``, optimizer steps between model averagings.
        warmup_steps: steps of synchronous gradient averaging first (post-local SGD; 0: local
            SGD from the start).
    """

    mode = "localsgd"

    def __init__(self, *, period: int = 8, warmup_steps: int = 0) -> None:
        super().__init__()
        self.period = _check_period(period, "--local-steps")
        if warmup_steps < 0:
            raise ValueError(f"--localsgd-warmup-steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = int(warmup_steps)
        self.averager: PeriodicModelAverager | None = None  # needs the process group
        self._averager_step = 0

    def prepare(self, model: nn.Module, env: DistEnv) -> nn.Module:
        model = super().prepare(model, env)
        if env.distributed:
            # PyTorch's averager averages at its calls warmup, warmup + period, ...; shifting
            # its warm-up by period - 1 averages after the steps warmup + period, + 2 period...
            self.averager = PeriodicModelAverager(
                period=self.period, warmup_steps=self.warmup_steps + self.period - 1
            )
            self.averager.step = self._averager_step
        return model

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        super().reduce_gradients(scaler)
        env = self.env
        if env is None or not env.distributed or self.steps >= self.warmup_steps:
            return
        assert self.model is not None
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        with torch.no_grad():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat /= env.world_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self.counter.add(4 * flat.numel())

    def _local_step(self, optimizer, scaler) -> None:
        super()._local_step(optimizer, scaler)
        if self.env is not None and self.env.distributed and self.steps < self.warmup_steps:
            assert self.model is not None
            broadcast_(list(self.model.buffers()))  # DDP's behaviour while synchronous

    def _communicate(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.model is not None and self.env is not None
        averager = self.averager
        if averager is None:
            return
        due = (
            averager.step >= averager.warmup_steps
            and (averager.step - averager.warmup_steps) % averager.period == 0
        )
        params = list(self.model.parameters())
        averager.average_parameters(params)  # PyTorch's: parameters only
        if due:
            self.counter.add(4 * sum(p.numel() for p in params))
            self.counter.add(average_buffers_(self.model, self.env))

    def state_dict(self) -> dict[str, Any]:
        step = self.averager.step if self.averager is not None else self._averager_step
        return {**super().state_dict(), "averager_step": step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._averager_step = int(state_dict["averager_step"])
        if self.averager is not None:
            self.averager.step = self._averager_step


class SlowMoCombiner(_LocalCombiner):
    """SlowMo: local SGD averaging every ``period`` steps, a slow momentum step every
    ``slow_period`` steps (see the module docstring).

    Args:
        period: base local-SGD averaging period (fairscale: 3).
        slow_period: steps between slow momentum updates (fairscale: 48).
        slow_momentum: ``b`` (fairscale: 0.5).
        slow_lr: ``alpha`` (fairscale: 1.0).
    """

    mode = "slowmo"

    def __init__(
        self,
        *,
        period: int = 3,
        slow_period: int = 48,
        slow_momentum: float = 0.5,
        slow_lr: float = 1.0,
    ) -> None:
        super().__init__()
        self.period = _check_period(period, "--local-steps")
        self.slow_period = _check_period(slow_period, "--slowmo-period")
        if not 0.0 <= slow_momentum < 1.0:
            raise ValueError(f"--slowmo-momentum must be in [0, 1), got {slow_momentum}")
        if slow_lr <= 0:
            raise ValueError(f"--slowmo-lr must be > 0, got {slow_lr}")
        self.slow_momentum = float(slow_momentum)
        self.slow_lr = float(slow_lr)
        self.anchor: list[Tensor] | None = None  # x0: the model of the last slow step
        self.buffer: list[Tensor] | None = None

    def prepare(self, model: nn.Module, env: DistEnv) -> nn.Module:
        model = super().prepare(model, env)
        self.anchor = [p.detach().clone() for p in model.parameters()]
        self.buffer = [torch.zeros_like(p) for p in self.anchor]
        return model

    def _communicate(self, optimizer: torch.optim.Optimizer) -> None:
        if self.steps % self.slow_period == 0:
            self._average()
            self._slow_step(optimizer)
        elif self.steps % self.period == 0:
            self._average()

    @torch.no_grad()
    def _slow_step(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.model is not None and self.anchor is not None and self.buffer is not None
        lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
        for p, x0, buf in zip(self.model.parameters(), self.anchor, self.buffer, strict=True):
            lr = float(lr_of.get(id(p), 0.0))
            if lr <= 0:  # no step to scale by: keep the average
                x0.copy_(p)
                continue
            buf.mul_(self.slow_momentum).add_((x0 - p) / lr)
            x0.sub_(buf, alpha=lr * self.slow_lr)
            p.copy_(x0)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        assert self.anchor is not None and self.buffer is not None
        state["anchor"] = [t.clone() for t in self.anchor]
        state["slow_buffer"] = [t.clone() for t in self.buffer]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.anchor = [t.clone() for t in state_dict["anchor"]]
        self.buffer = [t.clone() for t in state_dict["slow_buffer"]]


class LocalAdaAlterCombiner(_LocalCombiner):
    """Local AdaAlter (see the module docstring); needs ``torch.optim.SGD`` with momentum 0,
    whose groups' ``lr`` and ``weight_decay`` it uses.

    Args:
        period: ``H``, steps between synchronisations of models and accumulators.
        eps: ``eps`` of the denominator (added as ``s * eps^2``).
        initial_accumulator: the starting value of ``A`` and ``D``.
    """

    mode = "local-adaalter"

    def __init__(self, *, period: int = 8, eps: float = 1.0, initial_accumulator: float = 0.0):
        super().__init__()
        self.period = _check_period(period, "--local-steps")
        if eps <= 0:
            raise ValueError(f"--adaalter-eps must be > 0, got {eps}")
        self.eps = float(eps)
        self.initial_accumulator = float(initial_accumulator)
        self.acc: list[Tensor] | None = None  # A_i
        self.den: list[Tensor] | None = None  # D (the accumulator at the last sync)
        self.since_sync = 0

    def prepare(self, model: nn.Module, env: DistEnv) -> nn.Module:
        model = super().prepare(model, env)
        self.acc = [torch.full_like(p, self.initial_accumulator) for p in model.parameters()]
        self.den = [a.clone() for a in self.acc]
        return model

    @torch.no_grad()
    def _local_step(self, optimizer, scaler) -> None:
        if not isinstance(optimizer, torch.optim.SGD) or any(
            g.get("momentum", 0) or g.get("nesterov", False) for g in optimizer.param_groups
        ):
            raise ValueError(
                "--grad-combine local-adaalter applies AdaAlter's own update with the "
                "optimizer's lr and weight decay; build plain SGD: --optimizer sgd --momentum 0"
            )
        assert self.model is not None and self.acc is not None and self.den is not None
        slot = {id(p): i for i, p in enumerate(self.model.parameters())}
        s = self.since_sync + 1
        for group in optimizer.param_groups:
            lr, wd = group["lr"], group.get("weight_decay", 0.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                i = slot[id(p)]
                g = p.grad if not wd else p.grad.add(p, alpha=wd)
                denom = (self.den[i] + s * self.eps**2).sqrt_()
                p.addcdiv_(g, denom, value=-lr)
                self.acc[i].addcmul_(g, g)
        self.since_sync = s

    def _communicate(self, optimizer: torch.optim.Optimizer) -> None:
        if self.steps % self.period == 0:
            self._sync()

    def _sync(self) -> None:
        assert self.env is not None and self.acc is not None and self.den is not None
        self._average()
        with torch.no_grad():
            flat = torch.cat([a.reshape(-1) for a in self.acc])
            if self.env.distributed:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                flat /= self.env.world_size
                self.counter.add(4 * flat.numel())
            offset = 0
            for a, d in zip(self.acc, self.den, strict=True):
                a.copy_(flat[offset : offset + a.numel()].view_as(a))
                d.copy_(a)
                offset += a.numel()
        self.since_sync = 0

    def synchronize(self) -> None:
        if self.env is not None and self.env.distributed and self.since_sync:
            self._sync()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        assert self.acc is not None and self.den is not None
        state.update(
            acc=[a.clone() for a in self.acc],
            den=[d.clone() for d in self.den],
            since_sync=self.since_sync,
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.acc = [a.clone() for a in state_dict["acc"]]
        self.den = [d.clone() for d in state_dict["den"]]
        self.since_sync = int(state_dict["since_sync"])
