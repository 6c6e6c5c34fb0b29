"""Communicate less often: local SGD (post-local SGD), SlowMo and Local AdaAlter.

Every worker steps its own model on its own data and the models are averaged every ``H``
optimizer steps (``H = 1``: after every step, which for SGD with or without momentum is
synchronous data-parallel SGD, momentum being linear in the gradient). Evaluation
(:meth:`~trainers.comm.GradCombiner.synchronize`) averages the models first, so every
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
  arXiv:1911.09030): local SGD whose step is AdaGrad's with a lagging denominator, as the
  authors' code runs it (xcgoner/AISTATS2020-AdaAlter-GluonNLP: the optimizer
  ``src/gluonnlp/optimizer/local_adaalter.py``, the trainer
  ``scripts/language_model/distributed_hvd_local_sgd.py``, the driver
  ``scripts/language_model/large_word_language_model_local_hvd.py``). The first
  ``warmup_steps`` steps are fully synchronous AdaAlter: gradients averaged, every worker
  updates with the average and ``D += g_avg^2`` after the step. Then each worker
  accumulates ``A_i += g_i^2`` locally, its denominator uses only ``D``, the accumulator of
  the last synchronisation (identical on every worker)::

      x_i <- x_i - lr * (g_i / sqrt(D + eps) + wd * x_i);   A_i <- A_i + g_i^2
      every H local steps: x_i <- mean_j x_j;  A_i <- mean_j A_j;  D <- A_i

  Weight decay ``wd`` is applied apart from the gradient and never accumulated, ``eps`` is a
  constant (the authors' script default 1.0; their optimizer class's own default is 1e-7).
  This library's earlier rule stays available: ``eps_mode="per_step"`` (``sqrt(D + s eps^2)``,
  ``s`` = local steps since the last synchronisation) and ``weight_decay_mode="in_gradient"``
  (``g_i += wd x_i`` before the step and the accumulator); ``warmup_steps=0`` has no
  synchronous phase. It replaces the optimizer's update: use ``--optimizer sgd --momentum 0``
  (its learning rate and weight decay are used). Departures from the authors' trainer: with
  gradient clipping the synchronous phase clips the averaged gradient (they clip each
  worker's before averaging); ``H = 1`` synchronises every step (their trainer's
  ``interval > 1`` check never synchronises at 1); their ``--warmup-steps`` also ramps the
  learning rate linearly over the same steps, which here is the lr schedule's job
  (``--warmup-epochs``).

Floating-point buffers (BatchNorm statistics) are averaged together with the models.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from ..dist import DistEnv
from .base import CountingCombiner, option, register_combiner
from .cost import ring_allreduce_time
from .flat import (
    allreduce_mean_,
    average_buffers_,
    average_models_,
    broadcast_,
    restore_optimizer_state,
)

__all__ = [
    "ADAALTER_EPS_MODES",
    "ADAALTER_WEIGHT_DECAY_MODES",
    "LocalAdaAlterCombiner",
    "LocalAdaAlterOptions",
    "LocalSGDCombiner",
    "LocalSGDOptions",
    "SlowMoCombiner",
    "SlowMoOptions",
]


def _wire_dtype(tensors: list[Tensor]) -> torch.dtype:
    """float64 when any tensor is float64 (an fp64 run stays exact), else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_period(value: int, name: str) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1 (optimizer steps between averagings), got {value}")


class _LocalCombiner(CountingCombiner, abc.ABC):
    """Bare module, rank 0's start, per-rank state in checkpoints, byte counting."""

    def __init__(self, options: Any = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.steps = 0

    #: How many model-sized tensors a synchronisation all-reduces (local AdaAlter: the
    #: models and the accumulators).
    synced_copies = 1

    def comm_time(self, grad_bytes: float, workers: int, gbps: float, latency_s: float) -> float:
        """One ring all-reduce of the model (:attr:`synced_copies` of it) every ``period``
        steps, per step: ``ring(S) / H`` (the steady state after any synchronous warm-up)."""
        ring = ring_allreduce_time(self.synced_copies * grad_bytes, workers, gbps, latency_s)
        return ring / self.options.period

    def step_time(
        self, compute: float, comm: float, *, straggler: float = 1.0, overlap: float = 0.0
    ) -> tuple[float, float]:
        """The averaging blocks every rank (nothing hides it): ``s T_c + T_m`` a step on
        average, with ``T_m`` the amortized :meth:`comm_time`."""
        t = straggler * compute + comm
        return t, t

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        super().prepare(model, optimizer, env)
        self.start_replicas(model, env)
        return model

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        if scaler is not None:
            raise ValueError(
                f"combiner {self.name!r} steps local models whose fp16 loss scales would "
                "differ between workers; train in bfloat16 or float32 precision"
            )

    def _local_step(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ) -> None:
        super().step(optimizer, scaler)

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        self._local_step(optimizer, scaler)
        self.steps += 1
        self._communicate(optimizer)
        self.counter.step()

    @abc.abstractmethod
    def _communicate(self, optimizer: torch.optim.Optimizer) -> None:
        """After the local step ``self.steps`` (1-based): average when due."""

    def _average(self) -> None:
        assert self.model is not None and self.env is not None
        params = list(self.model.parameters())
        if _wire_dtype(params) is torch.float32:
            self.counter.add(average_models_(self.model, self.env))
        else:  # a float64 model averages in float64 (exact as the float32 path is for fp32)
            self.counter.add(allreduce_mean_(params, self.env, dtype=torch.float64))
            self.counter.add(average_buffers_(self.model, self.env))

    def synchronize(self) -> None:
        """Average the models (before evaluation)."""
        if self.env is not None and self.env.distributed:
            self._average()

    def metrics(self) -> dict[str, float]:
        return self.counter.metrics()

    def state_dict(self) -> dict[str, Any]:
        assert self.model is not None and self.optimizer is not None
        return {
            "steps": self.steps,
            "params": [p.detach().clone() for p in self.model.parameters()],
            "buffers": [b.detach().clone() for b in self.model.buffers()],
            "optimizer": self.optimizer.state_dict()["state"],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = int(state_dict["steps"])
        assert self.model is not None and self.optimizer is not None
        with torch.no_grad():
            for t, saved in zip(self.model.parameters(), state_dict["params"], strict=True):
                t.copy_(saved)
            for t, saved in zip(self.model.buffers(), state_dict["buffers"], strict=True):
                t.copy_(saved)
        restore_optimizer_state(self.optimizer, state_dict.get("optimizer"))


@dataclass(frozen=True)
class LocalSGDOptions:
    period: int = option(8, "steps between model averagings H", flag="--local-steps")
    warmup_steps: int = option(
        0,
        "synchronous gradient averaging for the first N steps (post-local SGD)",
        flag="--localsgd-warmup-steps",
    )

    def __post_init__(self) -> None:
        _check_period(self.period, "period")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")


@register_combiner("localsgd", LocalSGDOptions)
class LocalSGDCombiner(_LocalCombiner):
    """(Post-)local SGD: average gradients for ``warmup_steps``, then models every ``period``."""

    summary = "(post-)local SGD: models averaged every --local-steps"

    def __init__(self, options: LocalSGDOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.period = self.options.period
        self.warmup_steps = self.options.warmup_steps
        self.averager: PeriodicModelAverager | None = None  # needs the process group
        self._averager_step = 0

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        model = super().prepare(model, optimizer, env)
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
        self.counter.add(allreduce_mean_(grads, env, dtype=None))

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


@dataclass(frozen=True)
class SlowMoOptions:
    period: int = option(3, "base local-SGD averaging period (fairscale)", flag="--local-steps")
    slow_period: int = option(
        48, "steps between slow momentum updates (fairscale)", flag="--slowmo-period"
    )
    slow_momentum: float = option(0.5, "slow momentum b (fairscale)", flag="--slowmo-momentum")
    slow_lr: float = option(1.0, "slow learning rate alpha (fairscale)", flag="--slowmo-lr")

    def __post_init__(self) -> None:
        _check_period(self.period, "period")
        _check_period(self.slow_period, "slow_period")
        if not 0.0 <= self.slow_momentum < 1.0:
            raise ValueError(f"slow_momentum must be in [0, 1), got {self.slow_momentum}")
        if self.slow_lr <= 0:
            raise ValueError(f"slow_lr must be > 0, got {self.slow_lr}")


@register_combiner("slowmo", SlowMoOptions)
class SlowMoCombiner(_LocalCombiner):
    """SlowMo: local SGD averaging every ``period`` steps, a slow momentum step every
    ``slow_period`` steps (see the module docstring)."""

    summary = "local SGD with a slow momentum step"

    def __init__(self, options: SlowMoOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.period = self.options.period
        self.slow_period = self.options.slow_period
        self.slow_momentum = float(self.options.slow_momentum)
        self.slow_lr = float(self.options.slow_lr)
        self.anchor: list[Tensor] | None = None  # x0: the model of the last slow step
        self.buffer: list[Tensor] | None = None

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        model = super().prepare(model, optimizer, env)
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


ADAALTER_EPS_MODES = ("constant", "per_step")
ADAALTER_WEIGHT_DECAY_MODES = ("decoupled", "in_gradient")


@dataclass(frozen=True)
class LocalAdaAlterOptions:
    """Local AdaAlter's options; the defaults are the authors' (``local_adaalter.py`` and the
    driver ``large_word_language_model_local_hvd.py`` of xcgoner/AISTATS2020-AdaAlter-GluonNLP).

    ``warmup_steps`` defaults to 1, the authors' script default (``--warmup-steps 1``): the
    first step is synchronous, which seeds the common denominator with the averaged gradient
    before the workers drift apart. Their README runs 600 synchronous steps on the 1B-word
    benchmark (8 workers, tens of thousands of steps per epoch, under 1 % of training); on our
    264-step digits recipe 600 would leave no local step at all, and a fixed fraction would be
    our invention, so the default stays the script's 1 and a longer phase is one flag away
    (the authors tie it to their learning-rate warm-up: ``--adaalter-warmup-steps 44`` with the
    digits recipe's 2-epoch warm-up).
    """

    period: int = option(
        8, "local steps between synchronisations of models and accumulators H", flag="--local-steps"
    )
    warmup_steps: int = option(
        1,
        "fully synchronous AdaAlter for the first N steps (gradients averaged, accumulator "
        "updated with the average); the authors' --warmup-steps: 1 in their script, 600 in "
        "their README",
        flag="--adaalter-warmup-steps",
    )
    eps: float = option(
        1.0,
        "epsilon of the denominator: sqrt(D + eps) (constant; the authors' script default 1) "
        "or sqrt(D + s * eps^2) (per_step)",
        flag="--adaalter-eps",
    )
    eps_mode: str = option(
        "constant",
        "constant: sqrt(D + eps), the authors' code; per_step: sqrt(D + s * eps^2) with s the "
        "local steps since the last synchronisation (this library's earlier rule)",
        flag="--adaalter-eps-mode",
        choices=ADAALTER_EPS_MODES,
    )
    weight_decay_mode: str = option(
        "decoupled",
        "decoupled: x -= lr * wd * x apart from the gradient, never accumulated (the authors' "
        "code); in_gradient: g += wd * x before the step and the accumulator (this library's "
        "earlier rule)",
        flag="--adaalter-weight-decay-mode",
        choices=ADAALTER_WEIGHT_DECAY_MODES,
    )
    initial_accumulator: float = option(
        0.0, "starting value of the accumulators A and D", flag="--adaalter-initial-accumulator"
    )

    def __post_init__(self) -> None:
        _check_period(self.period, "period")
        if self.warmup_steps < 0:
            raise ValueError(
                f"warmup_steps must be >= 0 (synchronous steps before local AdaAlter), got "
                f"{self.warmup_steps}"
            )
        if self.eps_mode not in ADAALTER_EPS_MODES:
            raise ValueError(
                f"eps_mode {self.eps_mode!r}: choose 'constant' (sqrt(D + eps), the authors') "
                "or 'per_step' (sqrt(D + s * eps^2))"
            )
        if self.weight_decay_mode not in ADAALTER_WEIGHT_DECAY_MODES:
            raise ValueError(
                f"weight_decay_mode {self.weight_decay_mode!r}: choose 'decoupled' (the "
                "authors': x -= lr * wd * x, not accumulated) or 'in_gradient' (g += wd * x)"
            )
        if self.eps < 0 or self.initial_accumulator < 0:
            raise ValueError(
                f"eps and initial_accumulator must be >= 0, got {self.eps} and "
                f"{self.initial_accumulator}"
            )
        if self.eps == 0 and self.initial_accumulator == 0:
            raise ValueError(
                "eps = 0 with initial_accumulator = 0 divides by zero at the first step; set "
                "eps > 0 (the authors' default is 1.0) or initial_accumulator > 0"
            )


@register_combiner("local-adaalter", LocalAdaAlterOptions)
class LocalAdaAlterCombiner(_LocalCombiner):
    """Local AdaAlter (see the module docstring); needs ``torch.optim.SGD`` with momentum 0,
    whose groups' ``lr`` and ``weight_decay`` it uses."""

    summary = "local AdaGrad with a lagging denominator"
    synced_copies = 2  # the models and the accumulators

    def __init__(self, options: LocalAdaAlterOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.period = self.options.period
        self.warmup_steps = self.options.warmup_steps
        self.eps = float(self.options.eps)
        self.initial_accumulator = float(self.options.initial_accumulator)
        self.acc: list[Tensor] | None = None  # A_i
        self.den: list[Tensor] | None = None  # D (the accumulator at the last sync)
        self.since_sync = 0

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        if not isinstance(optimizer, torch.optim.SGD) or any(
            g.get("momentum", 0) or g.get("nesterov", False) for g in optimizer.param_groups
        ):
            raise ValueError(
                "combiner 'local-adaalter' applies AdaAlter's own update (AdaGrad with a "
                "lagging denominator) with the optimizer's lr and weight decay; it needs "
                f"plain SGD with momentum 0 (--optimizer sgd --momentum 0), got "
                f"{type(optimizer).__name__} with momentum "
                f"{optimizer.param_groups[0].get('momentum')}"
            )
        model = super().prepare(model, optimizer, env)
        self.acc = [torch.full_like(p, self.initial_accumulator) for p in model.parameters()]
        self.den = [a.clone() for a in self.acc]
        return model

    def _synchronous(self) -> bool:
        """Whether the step being taken (0-based ``self.steps``) is in the synchronous phase."""
        return self.steps < self.warmup_steps

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        super().reduce_gradients(scaler)
        env = self.env
        if env is None or not env.distributed or not self._synchronous():
            return
        assert self.model is not None
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.counter.add(allreduce_mean_(grads, env, dtype=_wire_dtype(grads)))

    @torch.no_grad()
    def _local_step(self, optimizer, scaler) -> None:
        assert self.model is not None and self.acc is not None and self.den is not None
        slot = {id(p): i for i, p in enumerate(self.model.parameters())}
        synchronous = self._synchronous()
        s = 1 if synchronous else self.since_sync + 1
        shift = self.eps if self.options.eps_mode == "constant" else s * self.eps**2
        decoupled = self.options.weight_decay_mode == "decoupled"
        for group in optimizer.param_groups:
            lr, wd = group["lr"], group.get("weight_decay", 0.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                i = slot[id(p)]
                g = p.grad if not wd or decoupled else p.grad.add(p, alpha=wd)
                denom = (self.den[i] + shift).sqrt_()
                if wd and decoupled:  # the authors': w += (g / sqrt(D + eps) + w * wd) * -lr
                    p.add_((g / denom).add_(p, alpha=wd), alpha=-lr)
                else:
                    p.addcdiv_(g, denom, value=-lr)
                self.acc[i].addcmul_(g, g)
                if synchronous:  # the gradient is the average: every worker holds the same A
                    self.den[i].copy_(self.acc[i])
        if synchronous:
            if self.env is not None and self.env.distributed:
                broadcast_(list(self.model.buffers()))  # DDP's behaviour while synchronous
        else:
            self.since_sync = s

    def _communicate(self, optimizer: torch.optim.Optimizer) -> None:
        local = self.steps - self.warmup_steps
        if local > 0 and local % self.period == 0:
            self._sync()

    def _sync(self) -> None:
        assert self.env is not None and self.acc is not None and self.den is not None
        self._average()
        self.counter.add(allreduce_mean_(self.acc, self.env, dtype=_wire_dtype(self.acc)))
        with torch.no_grad():
            for a, d in zip(self.acc, self.den, strict=True):
                d.copy_(a)
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
