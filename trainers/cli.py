"""Command-line flags shared by every training script, and what they build.

Each script calls :func:`add_optimizer_args`, :func:`add_schedule_args` and
:func:`add_distributed_args` on its parser, then :func:`build_optimizer`,
:func:`build_schedule` and :func:`build_combiner` with the parsed namespace, so a flag added
here (a new optimizer's hyperparameter, a new gradient combiner) reaches every script.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from .adasum import ADASUM_MODES, AdasumDeltaCombiner, AdasumGradCombiner, resolve_adasum_mode
from .combine import AverageCombiner, GradCombiner
from .dist import DistEnv
from .optim import create_optimizer, list_optimizers, optimizer_accepts
from .schedules import SCHEDULE_MODES, LRSchedule, create_schedule

__all__ = [
    "GRAD_COMBINE_CHOICES",
    "add_distributed_args",
    "add_optimizer_args",
    "add_schedule_args",
    "build_combiner",
    "build_optimizer",
    "build_schedule",
]

GRAD_COMBINE_CHOICES = ("average", "adasum")


def _bounds(text: str) -> tuple[float | None, float | None]:
    """``"LOW,HIGH"`` -> ``(low, high)``; an empty side is unbounded (``"0.01,"``)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH (e.g. 0.01,10), got {text!r}")
    try:
        return tuple(float(v) if v.strip() else None for v in parts)  # type: ignore[return-value]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two numbers LOW,HIGH, got {text!r}") from None


def add_optimizer_args(
    parser: argparse.ArgumentParser, *, default: str = "nag", lr: float | None = None
) -> None:
    """``--optimizer`` and the hyperparameters of every registered optimizer."""
    g = parser.add_argument_group("optimizer")
    g.add_argument(
        "--optimizer", type=str.lower, default=default, help=f"one of {list_optimizers()}"
    )
    g.add_argument("--lr", type=float, default=lr, help="base learning rate")
    g.add_argument("--momentum", type=float, default=0.9, help="sgd/nag momentum")
    g.add_argument("--wd", type=float, default=1e-4, help="weight decay")
    g.add_argument(
        "--no-wd",
        action="store_true",
        default=None,
        help="no weight decay on bias and norm parameters (a script may default it on)",
    )
    g.add_argument("--beta1", type=float, default=0.9, help="adam-family first-moment decay")
    g.add_argument("--beta2", type=float, default=0.999, help="adam-family second-moment decay")
    g.add_argument(
        "--epsilon",
        type=float,
        default=None,
        help="adam-family epsilon (optimizer default if unset)",
    )
    # Large-batch optimizers (lamb, lans); passed only when given, and an error with an
    # optimizer that does not take them.
    g.add_argument(
        "--max-grad-norm",
        type=float,
        default=None,
        help="lamb/lans: clip the global gradient norm inside the optimizer (default 1.0; "
        "0 turns it off)",
    )
    g.add_argument(
        "--trust-clamp",
        type=_bounds,
        default=None,
        metavar="LOW,HIGH",
        help="lamb/lans: clamp the trust ratio (DeepSpeed: 0.01,10)",
    )
    g.add_argument(
        "--weight-norm-clamp",
        type=_bounds,
        default=None,
        metavar="LOW,HIGH",
        help="lamb/lans: clamp ||w|| in the trust ratio (MXNet's lower_bound,upper_bound)",
    )
    g.add_argument(
        "--no-bias-correction", action="store_true", help="lamb/lans: no Adam bias correction"
    )
    g.add_argument(
        "--always-adapt",
        action="store_true",
        help="lamb: apply the trust ratio where the weight decay is 0 too",
    )
    g.add_argument(
        "--adapt-no-wd",
        action="store_true",
        help="lamb/lans: apply the trust ratio to the --no-wd parameters too",
    )


def optimizer_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for :func:`trainers.optim.create_optimizer` from parsed flags.

    Raises:
        ValueError: a flag given that the chosen optimizer does not take.
    """
    kwargs: dict[str, Any] = dict(
        lr=args.lr,
        weight_decay=args.wd,
        momentum=args.momentum,
        no_wd=bool(args.no_wd),
        betas=(args.beta1, args.beta2),
    )
    if args.epsilon is not None:
        kwargs["eps"] = args.epsilon
    given: dict[str, tuple[str, Any]] = {}
    max_grad_norm = getattr(args, "max_grad_norm", None)
    if max_grad_norm is not None:
        given["max_grad_norm"] = ("--max-grad-norm", max_grad_norm if max_grad_norm > 0 else None)
    for option, flag in (
        ("trust_clamp", "--trust-clamp"),
        ("weight_norm_clamp", "--weight-norm-clamp"),
    ):
        if getattr(args, option, None) is not None:
            given[option] = (flag, getattr(args, option))
    if getattr(args, "no_bias_correction", False):
        given["bias_correction"] = ("--no-bias-correction", False)
    for option in ("always_adapt", "adapt_no_wd"):
        if getattr(args, option, False):
            given[option] = ("--" + option.replace("_", "-"), True)
    for option, (flag, value) in given.items():
        if not optimizer_accepts(args.optimizer, option):
            raise ValueError(
                f"{flag} is not an option of --optimizer {args.optimizer}; drop it or pick an "
                "optimizer that takes it (lamb, lans)"
            )
        kwargs[option] = value
    return kwargs


def build_optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    return create_optimizer(args.optimizer, model, **optimizer_kwargs(args))


def add_schedule_args(parser: argparse.ArgumentParser, *, default: str = "cosine") -> None:
    """GluonCV's learning-rate flags (per-iteration schedules)."""
    g = parser.add_argument_group("learning-rate schedule")
    g.add_argument("--lr-mode", type=str, default=default, choices=SCHEDULE_MODES)
    g.add_argument("--lr-decay", type=float, default=0.1, help="step mode: decay factor")
    g.add_argument("--lr-decay-epoch", type=str, default="40,60", help="step mode: epochs")
    g.add_argument(
        "--lr-decay-power", type=float, default=2.0, help="poly / warmup_const_poly power"
    )
    g.add_argument("--warmup-lr", type=float, default=0.0, help="lr at the start of warmup")
    g.add_argument("--warmup-epochs", type=float, default=None, help="linear warmup length")
    g.add_argument(
        "--const-epochs", type=float, default=0.0, help="warmup_const_poly: constant phase"
    )
    g.add_argument("--final-lr", type=float, default=0.0, help="lr at the end (cosine/poly/linear)")


def build_schedule(args: argparse.Namespace, *, steps_per_epoch: int, epochs: int) -> LRSchedule:
    decay = tuple(int(e) for e in args.lr_decay_epoch.split(",") if e.strip())
    return create_schedule(
        args.lr_mode,
        base_lr=args.lr,
        total_steps=steps_per_epoch * epochs,
        warmup_steps=round(steps_per_epoch * (args.warmup_epochs or 0)),
        warmup_lr=args.warmup_lr,
        steps_per_epoch=steps_per_epoch,
        decay_epochs=decay if args.lr_mode == "step" else (),
        decay_factor=args.lr_decay,
        power=args.lr_decay_power,
        final_lr=args.final_lr,
        constant_steps=round(steps_per_epoch * args.const_epochs),
    )


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """How the ranks' gradients are combined (launch with ``torchrun`` for several ranks)."""
    g = parser.add_argument_group("distributed (launch with torchrun)")
    g.add_argument(
        "--grad-combine",
        type=str.lower,
        default="average",
        choices=GRAD_COMBINE_CHOICES,
        help="how workers combine gradients: average (DistributedDataParallel) or adasum "
        "(adaptive summation; keep the single-worker learning rate, see docs/adasum.md)",
    )
    g.add_argument(
        "--adasum-mode",
        type=str.lower,
        default=None,
        choices=ADASUM_MODES,
        help="adasum: combine optimizer updates (delta) or gradients (gradient); auto (default): "
        "gradient for sgd/nag, delta for adaptive optimizers (adam, adamw, lamb, lans, ...)",
    )
    g.add_argument(
        "--adasum-hierarchical",
        action="store_true",
        help="adasum: average inside each node, Adasum across nodes (needs >= 2 nodes)",
    )


def build_combiner(args: argparse.Namespace, env: DistEnv) -> GradCombiner:
    adasum_flags = [
        flag
        for flag, given in (
            ("--adasum-mode", getattr(args, "adasum_mode", None) is not None),
            ("--adasum-hierarchical", getattr(args, "adasum_hierarchical", False)),
        )
        if given
    ]
    if args.grad_combine == "average":
        if adasum_flags:
            raise ValueError(
                f"{' and '.join(adasum_flags)} only apply with --grad-combine adasum "
                "(this run averages gradients)"
            )
        return AverageCombiner()
    if args.grad_combine == "adasum":
        mode = resolve_adasum_mode(args.adasum_mode or "auto", getattr(args, "optimizer", None))
        combiner = AdasumDeltaCombiner if mode == "delta" else AdasumGradCombiner
        return combiner(hierarchical=args.adasum_hierarchical)
    raise ValueError(f"--grad-combine {args.grad_combine!r}: choose one of {GRAD_COMBINE_CHOICES}")


# ---- elastic training (trainers/elastic.py) -------------------------------------------------
ELASTIC_LR_SCALING_CHOICES = ("auto", "linear", "none")


def add_elastic_args(parser: argparse.ArgumentParser) -> None:
    """``--elastic-dir`` and its tuning (launch with ``torchrun --nnodes=MIN:MAX``)."""
    g = parser.add_argument_group("elastic training (torchrun --nnodes=MIN:MAX, docs/elastic.md)")
    g.add_argument(
        "--elastic-dir",
        type=str,
        default=None,
        help="shared directory for the job's durable state and sample ledger; turns elastic "
        "training on: a restarted worker group (new world size) resumes from it",
    )
    g.add_argument(
        "--elastic-checkpoint-steps",
        type=int,
        default=50,
        help="durable checkpoint every N optimizer steps (a restart redoes at most N-1 steps)",
    )
    g.add_argument(
        "--elastic-ramp-steps",
        type=int,
        default=100,
        help="after a world-size change, move the lr to its new target linearly over N steps",
    )
    g.add_argument(
        "--elastic-lr-scaling",
        type=str.lower,
        default="auto",
        choices=ELASTIC_LR_SCALING_CHOICES,
        help="lr target on a world-size change: linear (x new/initial world size), none; "
        "auto: none with --grad-combine adasum, else linear",
    )
    g.add_argument(
        "--no-elastic-ledger",
        action="store_true",
        help="do not write the per-rank sample ledger (<elastic-dir>/ledger)",
    )


def elastic_resuming(args: argparse.Namespace, run_log: str | None, *, is_main: bool) -> bool:
    """Whether this worker group resumes an elastic job (append to the run log, no header).

    On rank 0 a torn last line of ``run_log`` (its writer was killed) is dropped.
    """
    from .elastic import ElasticState, repair_run_log  # local: keeps this section self-contained

    if getattr(args, "elastic_dir", None) is None:
        return False
    if not ElasticState.has_checkpoint(args.elastic_dir):
        return False
    if is_main and run_log is not None:
        repair_run_log(run_log)
    return True


def build_elastic(args: argparse.Namespace, trainer: Any) -> Any:
    """An :class:`~trainers.elastic.ElasticState` for ``trainer`` (None without --elastic-dir)."""
    from .elastic import ElasticState

    if getattr(args, "elastic_dir", None) is None:
        return None
    scaling = args.elastic_lr_scaling
    if scaling == "auto":
        scaling = "none" if getattr(args, "grad_combine", "average") == "adasum" else "linear"
    return ElasticState(
        trainer,
        args.elastic_dir,
        checkpoint_steps=args.elastic_checkpoint_steps,
        ramp_steps=args.elastic_ramp_steps,
        lr_scaling=scaling,
        ledger=not args.no_elastic_ledger,
    )
