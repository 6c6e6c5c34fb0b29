"""Typed, frozen configs: what a run is, independent of how its flags were spelled.

Scripts map their flags onto these (:mod:`trainers.cli`) and every run-log header records
them under ``"configs"`` (:func:`configs_record`). The library takes them directly:
``create_optimizer``-style builders, :func:`trainers.comm.create_combiner`, the
:class:`~trainers.Trainer`.

* :class:`OptimizerConfig` — the optimizer's name and hyperparameters; ``None`` means "the
  optimizer's own default" for the options only some optimizers take.
* :class:`ScheduleConfig` — the learning-rate schedule, in epochs (converted to steps when the
  number of steps per epoch is known).
* :class:`CombinerConfig` — a ``--grad-combine`` mode and its options dataclass (owned by the
  combiner class, see :mod:`trainers.comm`).
* :class:`ElasticConfig` — elastic training (``torchrun --nnodes MIN:MAX``).
* :class:`~trainers.trainer.TrainerConfig` — the run itself: epochs, batch size,
  accumulation, precision, clipping, logging, evaluation and saving intervals, seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .comm import combiner_class

__all__ = [
    "CombinerConfig",
    "ElasticConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "configs_record",
]


@dataclass(frozen=True)
class OptimizerConfig:
    """An optimizer of :func:`trainers.optim.create_optimizer` and its hyperparameters.

    ``options`` holds the options only some optimizers take (``max_grad_norm``,
    ``trust_clamp``, ``bias_correction``, ...); :meth:`kwargs` checks that the optimizer
    takes each of them.
    """

    name: str = "nag"
    lr: float = 0.1
    weight_decay: float = 1e-4
    momentum: float = 0.9
    no_wd: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if value is None or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``create_optimizer(self.name, model, **kwargs)``.

        Raises:
            ValueError: an option of ``options`` that this optimizer does not take.
        """
        from .optim import optimizer_accepts

        out: dict[str, Any] = dict(
            lr=self.lr,
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            no_wd=self.no_wd,
            betas=tuple(self.betas),
        )
        if self.eps is not None:
            out["eps"] = self.eps
        for option, value in self.options.items():
            if not optimizer_accepts(self.name, option):
                raise ValueError(
                    f"option {option!r} is not one of optimizer {self.name!r}'s; drop it or "
                    "pick an optimizer that takes it (lamb, lans)"
                )
            out[option] = value
        return out


@dataclass(frozen=True)
class ScheduleConfig:
    """A learning-rate schedule of :func:`trainers.schedules.create_schedule`, in epochs."""

    mode: str = "cosine"
    base_lr: float = 0.1
    warmup_epochs: float = 0.0
    warmup_lr: float = 0.0
    decay_epochs: tuple[int, ...] = ()
    decay_factor: float = 0.1
    power: float = 2.0
    final_lr: float = 0.0
    const_epochs: float = 0.0

    def build(self, *, steps_per_epoch: int, epochs: int) -> Any:
        """The per-step schedule (an :class:`~trainers.schedules.LRSchedule`)."""
        from .schedules import create_schedule

        return create_schedule(
            self.mode,
            base_lr=self.base_lr,
            total_steps=steps_per_epoch * epochs,
            warmup_steps=round(steps_per_epoch * self.warmup_epochs),
            warmup_lr=self.warmup_lr,
            steps_per_epoch=steps_per_epoch,
            decay_epochs=self.decay_epochs if self.mode == "step" else (),
            decay_factor=self.decay_factor,
            power=self.power,
            final_lr=self.final_lr,
            constant_steps=round(steps_per_epoch * self.const_epochs),
        )


@dataclass(frozen=True)
class CombinerConfig:
    """A registered combining mode and an instance of its options dataclass.

    ``CombinerConfig("localsgd")`` takes the mode's defaults; ``CombinerConfig.of("localsgd",
    period=4)`` sets some.
    """

    mode: str = "average"
    options: Any = None

    def __post_init__(self) -> None:
        cls = combiner_class(self.mode)  # raises for an unknown mode, suggesting close ones
        object.__setattr__(self, "mode", cls.name)
        if self.options is None:
            object.__setattr__(self, "options", cls.Options())
        elif not isinstance(self.options, cls.Options):
            raise TypeError(
                f"combiner {self.mode!r} takes {cls.Options.__name__}, got "
                f"{type(self.options).__name__}"
            )

    @classmethod
    def of(cls, mode: str, **options: Any) -> CombinerConfig:
        return cls(mode, combiner_class(mode).Options(**options))


@dataclass(frozen=True)
class ElasticConfig:
    """Elastic training: durable state in ``dir``, resumed by a restarted worker group."""

    dir: str
    checkpoint_steps: int = 50
    ramp_steps: int = 100
    lr_scaling: str = "linear"
    ledger: bool = True

    def __post_init__(self) -> None:
        if self.lr_scaling not in ("linear", "none"):
            raise ValueError(f"lr_scaling must be 'linear' or 'none', got {self.lr_scaling!r}")
        if self.checkpoint_steps < 1 or self.ramp_steps < 0:
            raise ValueError(
                f"checkpoint_steps must be >= 1 and ramp_steps >= 0, got "
                f"{self.checkpoint_steps} and {self.ramp_steps}"
            )


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def configs_record(**configs: Any) -> dict[str, Any]:
    """The configs as JSON-ready dicts, for the run-log header's ``"configs"`` key."""
    return {name: _plain(c) for name, c in configs.items() if c is not None}
