"""Per-iteration learning-rate schedules: linear warmup, then step/cosine/poly/linear/constant.

The formulas follow GluonCV's ``gluoncv.utils.LRScheduler`` composed with
``LRSequential`` (a ``linear`` warmup scheduler followed by the main one), as used by
GluonCV's ``train_imagenet.py``, and the warmup -> constant -> polynomial-decay schedule of
the LANS paper (Zheng et al. 2020, "Accelerated Large Batch Optimization of BERT
Pretraining in 54 Minutes"). A schedule is a pure function of the global optimizer step,
so resuming needs no schedule state beyond its configuration.

With ``t`` the 0-based global optimizer step, ``W = warmup_steps``, ``C = constant_steps``,
``T = total_steps`` and ``p = clip((t - W - C) / (T - W - C), 0, 1)`` the decay progress:

============================  =============================================================
phase                         learning rate
============================  =============================================================
warmup, ``t < W``             ``warmup_lr + (base_lr - warmup_lr) * t / W``
constant, ``W <= t < W + C``  ``base_lr``
``constant``                  ``base_lr``
``linear``                    ``final_lr + (base_lr - final_lr) * (1 - p)``
``poly``                      ``final_lr + (base_lr - final_lr) * (1 - p) ** power``
``cosine``                    ``final_lr + (base_lr - final_lr) * (1 + cos(pi * p)) / 2``
``warmup_const_poly``         same as ``poly`` (the LANS recipe: ``warmup_lr = final_lr = 0``,
                              ``power = 1``, ``W = 0.05 T``, ``C = 0.25 T``)
``step``                      ``base_lr * decay_factor ** #{e in decay_epochs :
                              e * steps_per_epoch <= t}``
============================  =============================================================

Edge cases, as in GluonCV: steps past ``total_steps`` keep the value at ``total_steps``
(``final_lr`` for the decaying modes); ``warmup_steps = 0`` skips the warmup; a decay epoch
takes effect at the first step of that epoch, counted in absolute epochs (GluonCV's
script subtracts ``warmup_epochs`` from ``--lr-decay-epoch`` and its ``LRSequential``
offset adds it back); a decay epoch inside the warmup applies once the warmup ends.

These are the formulas GluonCV's ``LRScheduler`` documents, and what it computed while it
took ``(batch i, epoch)`` and set ``T = epoch * niters + i`` (0-based). GluonCV 0.10 splits
the schedule into ``LRSequential`` phases whose ``LRScheduler`` divides by ``niters - 1``
rather than ``niters`` (each phase reaches its target on its last iteration, so the last
warmup step and the first main step both use ``base_lr``), evaluated at MXNet's 1-based
``num_update``: the same curves, shifted by about one step within each phase. GluonCV's ``train_imagenet.py`` also warms
up from 0 whatever ``--warmup-lr`` says; here ``warmup_lr`` is honoured (its default, 0,
gives GluonCV's behaviour).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SCHEDULE_MODES", "LRSchedule", "apply_lr", "create_schedule"]

SCHEDULE_MODES = ("step", "cosine", "poly", "linear", "constant", "warmup_const_poly")


@dataclass
class LRSchedule:
    """A learning rate as a pure function of the global optimizer step (0-based).

    See the module docstring for the formulas. Build one with :func:`create_schedule`.

    Example:
        >>> sched = create_schedule("cosine", base_lr=0.4, total_steps=1000, warmup_steps=50)
        >>> sched(0), sched(50), sched(1000)
        (0.0, 0.4, 0.0)
    """

    mode: str
    base_lr: float
    total_steps: int
    warmup_steps: int = 0
    warmup_lr: float = 0.0
    steps_per_epoch: int | None = None
    decay_epochs: tuple[int, ...] = field(default_factory=tuple)
    decay_factor: float = 0.1
    power: float = 2.0
    final_lr: float = 0.0
    constant_steps: int = 0

    def __post_init__(self) -> None:
        self.decay_epochs = tuple(int(e) for e in self.decay_epochs)
        self._validate()

    def _validate(self) -> None:
        if self.mode not in SCHEDULE_MODES:
            raise ValueError(
                f"unknown learning-rate mode {self.mode!r}; choose one of {', '.join(SCHEDULE_MODES)}"
            )
        if self.total_steps <= 0:
            raise ValueError(f"total_steps must be positive, got {self.total_steps}")
        if self.warmup_steps < 0 or self.constant_steps < 0:
            raise ValueError(
                f"warmup_steps and constant_steps must be >= 0, got {self.warmup_steps} "
                f"and {self.constant_steps}"
            )
        if self.warmup_steps + self.constant_steps > self.total_steps:
            raise ValueError(
                f"warmup_steps + constant_steps ({self.warmup_steps} + {self.constant_steps}) "
                f"exceeds total_steps ({self.total_steps}); shorten the warmup or train longer"
            )
        if self.base_lr < 0 or self.warmup_lr < 0 or self.final_lr < 0:
            raise ValueError("base_lr, warmup_lr and final_lr must be >= 0")
        if self.mode == "step":
            if self.steps_per_epoch is None or self.steps_per_epoch <= 0:
                raise ValueError(
                    "mode 'step' decays at epochs, so it needs steps_per_epoch > 0 "
                    f"(got {self.steps_per_epoch}); pass the number of optimizer steps per epoch"
                )
            if self.constant_steps:
                raise ValueError(
                    "constant_steps is not used by mode 'step' (its decays are at absolute "
                    "epochs); set constant_steps=0"
                )
        if self.power <= 0:
            raise ValueError(f"power must be positive, got {self.power}")

    def __call__(self, step: int) -> float:
        """The learning rate for the 0-based global optimizer step ``step``."""
        t = min(max(int(step), 0), self.total_steps)
        if t < self.warmup_steps:
            return self.warmup_lr + (self.base_lr - self.warmup_lr) * t / self.warmup_steps
        if self.mode == "step":
            assert self.steps_per_epoch is not None  # checked in _validate
            count = sum(1 for e in self.decay_epochs if e * self.steps_per_epoch <= t)
            return self.base_lr * self.decay_factor**count
        if self.mode == "constant":
            return self.base_lr
        decay_start = self.warmup_steps + self.constant_steps
        if t < decay_start:
            return self.base_lr
        decay_steps = self.total_steps - decay_start
        p = 1.0 if decay_steps == 0 else (t - decay_start) / decay_steps
        if self.mode == "linear":
            factor = 1.0 - p
        elif self.mode in ("poly", "warmup_const_poly"):
            factor = (1.0 - p) ** self.power
        else:  # cosine
            factor = (1.0 + math.cos(math.pi * p)) / 2.0
        return self.final_lr + (self.base_lr - self.final_lr) * factor

    def state_dict(self) -> dict[str, Any]:
        """The configuration (the schedule has no other state)."""
        state = dataclasses.asdict(self)
        state["decay_epochs"] = list(self.decay_epochs)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the configuration with a saved one (e.g. from a checkpoint)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = set(state_dict) - names
        if unknown:
            raise KeyError(f"unknown LRSchedule fields in state_dict: {sorted(unknown)}")
        for name, value in state_dict.items():
            setattr(self, name, value)
        self.__post_init__()


def create_schedule(
    mode: str,
    *,
    base_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    warmup_lr: float = 0.0,
    steps_per_epoch: int | None = None,
    decay_epochs: Sequence[int] = (),
    decay_factor: float = 0.1,
    power: float = 2.0,
    final_lr: float = 0.0,
    constant_steps: int = 0,
) -> LRSchedule:
    """Build a per-iteration learning-rate schedule.

    Args:
        mode: one of ``step``, ``cosine``, ``poly``, ``linear``, ``constant``,
            ``warmup_const_poly`` (formulas in the module docstring).
        base_lr: the learning rate after warmup (GluonCV ``--lr``).
        total_steps: optimizer steps in the whole run (``num_epochs * steps_per_epoch``).
        warmup_steps: linear warmup length in optimizer steps (``warmup_epochs *
            steps_per_epoch``); 0 disables it.
        warmup_lr: the learning rate at step 0 of the warmup.
        steps_per_epoch: optimizer steps per epoch; required by ``step``.
        decay_epochs: absolute epochs at which ``step`` multiplies the rate by
            ``decay_factor`` (GluonCV ``--lr-decay-epoch``).
        decay_factor: GluonCV ``--lr-decay``.
        power: exponent of ``poly``/``warmup_const_poly``; GluonCV's default is 2, the
            LANS recipe uses 1.
        final_lr: the rate reached at ``total_steps`` by the decaying modes (GluonCV
            ``target_lr``, timm ``min_lr``).
        constant_steps: steps held at ``base_lr`` between the warmup and the decay (the
            LANS recipe's middle phase); not allowed with ``step``.

    Returns:
        An :class:`LRSchedule`; call it with the 0-based global step.
    """
    return LRSchedule(
        mode=mode,
        base_lr=float(base_lr),
        total_steps=int(total_steps),
        warmup_steps=int(warmup_steps),
        warmup_lr=float(warmup_lr),
        steps_per_epoch=None if steps_per_epoch is None else int(steps_per_epoch),
        decay_epochs=tuple(decay_epochs),
        decay_factor=float(decay_factor),
        power=float(power),
        final_lr=float(final_lr),
        constant_steps=int(constant_steps),
    )


def apply_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate to ``lr`` times its ``lr_scale`` (default 1)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
