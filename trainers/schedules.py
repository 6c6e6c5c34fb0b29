"""Per-iteration learning-rate schedules: linear warmup, then step/cosine/poly/linear/constant.

The formulas follow GluonCV's ``gluoncv.utils.LRScheduler`` composed with
``LRSequential`` (a ``linear`` warmup scheduler followed by the main one), as used by
GluonCV's ``train_imagenet.py``, the warmup -> constant -> polynomial-decay schedule of
the LANS paper (Zheng et al. 2020, "Accelerated Large Batch Optimization of BERT
Pretraining in 54 Minutes"), and NVIDIA's ``PolyWarmUpScheduler`` of its LAMB BERT recipe
(``NVIDIA/DeepLearningExamples`` PyTorch/LanguageModeling/BERT/schedulers.py). A schedule is
a pure function of the global optimizer step, so resuming needs no schedule state beyond its
configuration.

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
``nvidia_poly_warmup``        its own formula below (no constant phase)
============================  =============================================================

``nvidia_poly_warmup`` is NVIDIA's ``PolyWarmUpScheduler``. NVIDIA's ``run_pretraining.py``
calls ``lr_scheduler.step()`` *before* ``optimizer.step()`` and the scheduler reads the
optimizer's step count plus one, so the 0-based step ``t`` sees ``k = min(t + 1, T)``::

    lr = warmup_lr + (base_lr - warmup_lr) * k / W              if k < W
    lr = final_lr + (base_lr - final_lr) * (1 - k / T) ** power   otherwise

Defaults ``warmup_lr = final_lr = 0``; NVIDIA's ``power`` is 0.5. The decay is over the
whole run, not renormalised after the warmup: the rate drops from about ``base_lr`` to
``base_lr * (1 - W / T) ** power`` when the warmup ends (0.846 of it for W/T = 0.2843), and
the last step (``k = T``) has rate 0. With an integer ``W`` this is NVIDIA's schedule with
``warmup = W / T`` exactly; pass ``warmup_ratio`` for a fractional one (below).

**Ratio form** (``warmup_ratio`` set, ``warmup_steps = constant_steps = 0``; modes
``warmup_const_poly`` and ``nvidia_poly_warmup``): the phases are fractions of the run,
tested the way the reference tests them, on ``x = t / T`` (gluon-nlp) or ``x = k / T``
(NVIDIA) against ``warmup_ratio`` and ``warmup_ratio + constant_ratio``, so no phase length
is rounded to whole steps. ``warmup_const_poly`` is then gluon-nlp's
``get_warmup_linear_const_decay_poly_schedule`` (src/gluonnlp/torch/optimizers/schedules.py):
``warmup_lr + (base_lr - warmup_lr) * (x / w)`` for ``x < w``, ``base_lr`` for
``x < w + c``, else ``final_lr + (base_lr - final_lr) * ((1 - x) / (1 - w - c)) ** power``,
and, as there, ``warmup_ratio = 0`` means ``base_lr`` at every step (no decay either). Both
match their references bit for bit in float64 at the defaults (``warmup_lr = final_lr = 0``).

The step form of ``warmup_const_poly`` (``W``, ``C`` in whole steps; the scripts pass
``round(ratio * T)``) equals gluon-nlp's schedule exactly when ``w * T`` and ``c * T`` are
whole numbers and ``w > 0``; otherwise the phase boundaries move to the rounded steps and the
slopes change with them (``tests/trainers/test_faithful_schedules.py`` measures it).

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

__all__ = [
    "RATIO_MODES",
    "SCHEDULE_MODES",
    "LRSchedule",
    "LinearWarmupRatio",
    "apply_lr",
    "create_schedule",
]

SCHEDULE_MODES = (
    "step",
    "cosine",
    "poly",
    "linear",
    "constant",
    "warmup_const_poly",
    "nvidia_poly_warmup",
)
# modes that take ``warmup_ratio`` (the phases as fractions of the run, as their sources)
RATIO_MODES = ("warmup_const_poly", "nvidia_poly_warmup")


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
    warmup_ratio: float | None = None
    constant_ratio: float | None = None

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
        if self.mode == "nvidia_poly_warmup" and (self.constant_steps or self.constant_ratio):
            raise ValueError(
                "NVIDIA's PolyWarmUpScheduler has no constant phase; set constant_steps=0 and "
                "constant_ratio=None (warmup_const_poly has one)"
            )
        if self.constant_ratio is not None and self.warmup_ratio is None:
            raise ValueError(
                "constant_ratio needs warmup_ratio (the ratio form); pass warmup_ratio=0.0 or "
                "give the constant phase in steps (constant_steps)"
            )
        if self.warmup_ratio is not None:
            if self.mode not in RATIO_MODES:
                raise ValueError(
                    f"warmup_ratio is used by {' and '.join(RATIO_MODES)}, not {self.mode!r}; "
                    "give the warmup in steps (warmup_steps)"
                )
            if self.warmup_steps or self.constant_steps:
                raise ValueError(
                    "give the phases either as ratios (warmup_ratio, constant_ratio) or in "
                    f"steps, not both (warmup_steps={self.warmup_steps}, "
                    f"constant_steps={self.constant_steps})"
                )
            ratios = self.warmup_ratio + (self.constant_ratio or 0.0)
            if self.warmup_ratio < 0 or (self.constant_ratio or 0.0) < 0 or ratios > 1:
                raise ValueError(
                    f"warmup_ratio ({self.warmup_ratio}) and constant_ratio "
                    f"({self.constant_ratio}) must be >= 0 with a sum <= 1"
                )

    def __call__(self, step: int) -> float:
        """The learning rate for the 0-based global optimizer step ``step``."""
        t = min(max(int(step), 0), self.total_steps)
        if self.mode == "nvidia_poly_warmup":
            return self._nvidia(min(t + 1, self.total_steps))
        if self.warmup_ratio is not None:
            return self._gluonnlp(t)
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

    def _nvidia(self, k: int) -> float:
        """``nvidia_poly_warmup`` at NVIDIA's 1-based scheduler step ``k`` (<= T)."""
        total = self.total_steps
        if self.warmup_ratio is None:
            warm, x, w = k < self.warmup_steps, k, self.warmup_steps
        else:  # NVIDIA's own test and quotients: progress = k / T against the proportion
            x = k / total
            warm, w = x < self.warmup_ratio, self.warmup_ratio
        if warm:
            return self.warmup_lr + (self.base_lr - self.warmup_lr) * x / w
        return self.final_lr + (self.base_lr - self.final_lr) * (1.0 - k / total) ** self.power

    def _gluonnlp(self, t: int) -> float:
        """``warmup_const_poly`` in the ratio form: gluon-nlp's lambda at ``x = t / T``."""
        w, c = self.warmup_ratio, self.constant_ratio or 0.0
        assert w is not None  # the caller checks
        x = t / self.total_steps
        if w == 0.0:  # gluon-nlp: no warmup means a constant rate, without decay
            return self.base_lr
        if x < w:
            return self.warmup_lr + (self.base_lr - self.warmup_lr) * (x / w)
        if x < w + c:
            return self.base_lr
        rest = 1.0 - w - c
        factor = 0.0 if rest <= 0 else ((1.0 - x) / rest) ** self.power
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
        # a state dict saved before the ratio form existed has no ratios
        for name, value in ({"warmup_ratio": None, "constant_ratio": None} | state_dict).items():
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
    warmup_ratio: float | None = None,
    constant_ratio: float | None = None,
) -> LRSchedule:
    """Build a per-iteration learning-rate schedule.

    Args:
        mode: one of ``step``, ``cosine``, ``poly``, ``linear``, ``constant``,
            ``warmup_const_poly``, ``nvidia_poly_warmup`` (formulas in the module docstring).
        base_lr: the learning rate after warmup (GluonCV ``--lr``).
        total_steps: optimizer steps in the whole run (``num_epochs * steps_per_epoch``).
        warmup_steps: linear warmup length in optimizer steps (``warmup_epochs *
            steps_per_epoch``); 0 disables it.
        warmup_lr: the learning rate at step 0 of the warmup.
        steps_per_epoch: optimizer steps per epoch; required by ``step``.
        decay_epochs: absolute epochs at which ``step`` multiplies the rate by
            ``decay_factor`` (GluonCV ``--lr-decay-epoch``).
        decay_factor: GluonCV ``--lr-decay``.
        power: exponent of ``poly``/``warmup_const_poly``/``nvidia_poly_warmup``; GluonCV's
            default is 2, the LANS recipe uses 1, NVIDIA's BERT recipe 0.5.
        final_lr: the rate reached at ``total_steps`` by the decaying modes (GluonCV
            ``target_lr``, timm ``min_lr``).
        constant_steps: steps held at ``base_lr`` between the warmup and the decay (the
            LANS recipe's middle phase); not allowed with ``step`` or ``nvidia_poly_warmup``.
        warmup_ratio: the ratio form of ``warmup_const_poly`` / ``nvidia_poly_warmup``: the
            warmup as a fraction of ``total_steps``, tested as gluon-nlp / NVIDIA test it
            (no rounding to whole steps); ``warmup_steps`` must then be 0.
        constant_ratio: with ``warmup_ratio``, ``warmup_const_poly``'s constant phase as a
            fraction of ``total_steps``.

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
        warmup_ratio=None if warmup_ratio is None else float(warmup_ratio),
        constant_ratio=None if constant_ratio is None else float(constant_ratio),
    )


@dataclass(frozen=True)
class LinearWarmupRatio:
    """A schedule in epochs (the trainer builds it per step once it knows the steps per epoch):
    linear warmup over ``int(total_steps x warmup_ratio)`` steps, then linear decay to 0 at
    ``total_steps`` -- GluonNLP's SQuAD and GLUE fine-tuning schedule.

    Example:
        >>> LinearWarmupRatio(3e-5, 0.1).build(steps_per_epoch=50, epochs=2)(10)
        3e-05
    """

    lr: float
    warmup_ratio: float

    def build(self, *, steps_per_epoch: int, epochs: int) -> LRSchedule:
        """The per-step :class:`LRSchedule` of a run of ``epochs x steps_per_epoch`` steps."""
        total = steps_per_epoch * epochs
        return create_schedule("linear", base_lr=self.lr, total_steps=total,
                               warmup_steps=int(total * self.warmup_ratio))  # fmt: skip


def apply_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate to ``lr`` times its ``lr_scale`` (default 1)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
