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
* :class:`TrainerConfig` — the run itself: epochs, batch size,
  accumulation, precision, clipping, logging, evaluation and saving intervals, seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .comm import combiner_class

__all__ = [
    "TrainerConfig",
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


_PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
COMPILE_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class TrainerConfig:
    """Everything the loop needs besides the model, optimizer and data.

    Attributes:
        epochs: epochs to train (the run ends earlier if ``max_steps`` is reached).
        max_steps: stop after this many optimizer steps overall (``None``: no limit).
        batch_size: samples per rank per micro-step.
        eval_batch_size: per rank for evaluation; default ``batch_size``.
        grad_accum_steps: micro-steps per optimizer step.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + loss scaling).
        clip_grad_norm: clip the global gradient 2-norm to this value (``None``: no clipping).
        log_interval: write a step record every this many optimizer steps of an epoch
            (0: none).
        eval_interval: evaluate every this many epochs (0: never during ``fit``).
        eval_interval_steps: also evaluate every this many global steps (0: never).
        save_dir: directory for ``latest.pt`` and ``epoch<N>.pt`` (``None``: no saving).
        save_frequency: write ``epoch<N>.pt`` every this many epochs (0: only
            ``latest.pt`` at the end).
        save_interval_steps: also write ``latest.pt`` every this many global steps (0: never).
        num_workers: DataLoader worker processes per rank.
        seed: run seed: data order, augmentation, and each rank's RNG (``seed + rank``).
        channels_last: convert the model and 4-D input tensors to channels-last.
        drop_last: drop each epoch's incomplete final global batch. If kept, it must give every
            rank at least one sample, and its micro-batches weigh as much as full ones.
        shuffle: shuffle the training data each epoch.
        progress: show a tqdm bar on rank 0 when stderr is a terminal.
        inject_straggler: ``(rank, factor)``: that rank sleeps ``factor - 1`` times its own
            forward + backward time after each micro-step, a reproducible slow worker for
            straggler experiments (``--inject-straggler RANK:FACTOR``; ``None``: none).
        skip_nonfinite: tolerate up to this many optimizer steps whose loss is non-finite on
            some rank: their update is skipped (every rank agrees, one small all-reduce per
            step in this mode) and counted in the end record (``nonfinite_steps_skipped``);
            one more stops the run with :class:`~trainers.errors.NonFiniteError`. 0 (default):
            the first non-finite loss stops the run (``--skip-nonfinite N``).
        compile: train through ``torch.compile`` of the model (of its DDP wrapper when
            averaging; the model itself, its ``state_dict`` keys, checkpoints and evaluation
            stay eager): ``"on"``, ``"off"``, or ``"auto"`` (default): on where it pays, on a
            CUDA device, and off on CPU (eager keeps published logs exactly reproducible, and
            a short run does not earn back the compilation) and with tensor or pipeline
            parallelism (``--compile``; :func:`~trainers.trainer.resolve_compile`).
    """

    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 32
    eval_batch_size: int | None = None
    grad_accum_steps: int = 1
    precision: str = "fp32"
    clip_grad_norm: float | None = None
    log_interval: int = 50
    eval_interval: int = 1
    eval_interval_steps: int = 0
    save_dir: str | None = None
    save_frequency: int = 1
    save_interval_steps: int = 0
    num_workers: int = 0
    seed: int = 0
    channels_last: bool = False
    drop_last: bool = True
    shuffle: bool = True
    progress: bool = True
    inject_straggler: tuple[int, float] | None = None
    skip_nonfinite: int = 0
    compile: str = "auto"

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_MODES:
            raise ValueError(
                f"compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}"
            )
        if self.inject_straggler is not None:
            rank, factor = self.inject_straggler
            if rank < 0 or factor < 1:
                raise ValueError(
                    f"inject_straggler needs a rank >= 0 and a factor >= 1, got {rank}:{factor}"
                )
        if self.precision not in _PRECISIONS:
            raise ValueError(
                f"precision must be one of {', '.join(_PRECISIONS)}, got {self.precision!r}"
            )
        for name in ("epochs", "batch_size", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "log_interval",
            "eval_interval",
            "eval_interval_steps",
            "save_frequency",
            "save_interval_steps",
            "num_workers",
            "skip_nonfinite",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 disables it), got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {self.max_steps}")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ValueError(f"clip_grad_norm must be > 0 or None, got {self.clip_grad_norm}")


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
