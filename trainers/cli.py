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
from .compress import (
    COMPRESSORS,
    DDP_HOOKS,
    Compressor,
    CSERCombiner,
    DDPHookCombiner,
    ErrorFeedbackCombiner,
    create_compressor,
)
from .dist import DistEnv
from .localsgd import LocalAdaAlterCombiner, LocalSGDCombiner, SlowMoCombiner
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

GRAD_COMBINE_CHOICES = (
    "average",
    "adasum",
    "ef",
    "cser",
    "powersgd",
    "fp16",
    "bf16",
    "localsgd",
    "slowmo",
    "local-adaalter",
)
# Communication-efficient modes' flags: (dest, flag, the --grad-combine modes that take it).
_COMM_FLAGS = (
    ("compressor", "--compressor", ("ef", "cser")),
    ("compress_ratio", "--compress-ratio", ("ef", "cser")),
    ("qsgd_levels", "--qsgd-levels", ("ef", "cser")),
    ("qsgd_bucket", "--qsgd-bucket", ("ef", "cser")),
    ("cser_period", "--cser-period", ("cser",)),
    ("cser_reset_compressor", "--cser-reset-compressor", ("cser",)),
    ("powersgd_rank", "--powersgd-rank", ("powersgd",)),
    ("powersgd_start_iter", "--powersgd-start-iter", ("powersgd",)),
    ("local_steps", "--local-steps", ("localsgd", "slowmo", "local-adaalter")),
    ("localsgd_warmup_steps", "--localsgd-warmup-steps", ("localsgd",)),
    ("slowmo_period", "--slowmo-period", ("slowmo",)),
    ("slowmo_momentum", "--slowmo-momentum", ("slowmo",)),
    ("slowmo_lr", "--slowmo-lr", ("slowmo",)),
    ("adaalter_eps", "--adaalter-eps", ("local-adaalter",)),
)


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
    parser: argparse.ArgumentParser,
    *,
    default: str = "nag",
    lr: float | None = None,
    wd: float | None = 1e-4,
) -> None:
    """``--optimizer`` and the hyperparameters of every registered optimizer (a script whose
    defaults depend on its data passes ``lr=None``/``wd=None`` and fills them in itself)."""
    g = parser.add_argument_group("optimizer")
    g.add_argument(
        "--optimizer", type=str.lower, default=default, help=f"one of {list_optimizers()}"
    )
    g.add_argument("--lr", type=float, default=lr, help="base learning rate")
    g.add_argument("--momentum", type=float, default=0.9, help="sgd/nag momentum")
    g.add_argument("--wd", type=float, default=wd, help="weight decay")
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
        help="how workers combine gradients: average (DistributedDataParallel), adasum "
        "(adaptive summation; keep the single-worker learning rate, see docs/adasum.md), "
        "ef (a --compressor with error feedback), cser (compression with error reset), "
        "powersgd / fp16 / bf16 (PyTorch's DDP communication hooks), localsgd (post-local "
        "SGD), slowmo, local-adaalter; see docs/communication.md",
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
    c = parser.add_argument_group("communication-efficient modes (docs/communication.md)")
    c.add_argument(
        "--compressor",
        type=str.lower,
        default=None,
        choices=list(COMPRESSORS),
        help="ef/cser: the compressor (default topk)",
    )
    c.add_argument(
        "--compress-ratio",
        type=float,
        default=None,
        help="topk/randblock: fraction of the entries sent (default 0.01)",
    )
    c.add_argument(
        "--qsgd-levels",
        type=int,
        default=None,
        help="qsgd: levels s (default: the most for which the sum of all workers fits int8)",
    )
    c.add_argument("--qsgd-bucket", type=int, default=None, help="qsgd: elements per norm (512)")
    c.add_argument("--cser-period", type=int, default=None, help="cser: error-reset period H (8)")
    c.add_argument(
        "--cser-reset-compressor",
        type=str.lower,
        default=None,
        choices=list(COMPRESSORS),
        help="cser: compressor C2 of the error reset (default none: an exact reset)",
    )
    c.add_argument("--powersgd-rank", type=int, default=None, help="powersgd: rank (default 2)")
    c.add_argument(
        "--powersgd-start-iter",
        type=int,
        default=None,
        help="powersgd: plain all-reduce before this step (default 10; >= 2)",
    )
    c.add_argument(
        "--local-steps",
        type=int,
        default=None,
        help="localsgd/local-adaalter: steps between model averagings (8); slowmo: base "
        "local-SGD period (3)",
    )
    c.add_argument(
        "--localsgd-warmup-steps",
        type=int,
        default=None,
        help="localsgd: synchronous gradient averaging for the first N steps (post-local SGD; 0)",
    )
    c.add_argument(
        "--slowmo-period", type=int, default=None, help="slowmo: steps between slow updates (48)"
    )
    c.add_argument("--slowmo-momentum", type=float, default=None, help="slowmo: b (0.5)")
    c.add_argument("--slowmo-lr", type=float, default=None, help="slowmo: slow lr alpha (1.0)")
    c.add_argument("--adaalter-eps", type=float, default=None, help="local-adaalter: epsilon (1.0)")


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
        _check_comm_flags(args)
        return AverageCombiner()
    if args.grad_combine == "adasum":
        _check_comm_flags(args)
        mode = resolve_adasum_mode(args.adasum_mode or "auto", getattr(args, "optimizer", None))
        combiner = AdasumDeltaCombiner if mode == "delta" else AdasumGradCombiner
        return combiner(hierarchical=args.adasum_hierarchical)
    if args.grad_combine in GRAD_COMBINE_CHOICES:
        if adasum_flags:
            raise ValueError(
                f"{' and '.join(adasum_flags)} only apply with --grad-combine adasum "
                f"(this run uses --grad-combine {args.grad_combine})"
            )
        return _build_comm_combiner(args)
    raise ValueError(f"--grad-combine {args.grad_combine!r}: choose one of {GRAD_COMBINE_CHOICES}")


def _check_comm_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The communication flags given (not None); an error for one the mode does not take."""
    mode = args.grad_combine
    given: dict[str, Any] = {}
    for dest, flag, modes in _COMM_FLAGS:
        value = getattr(args, dest, None)
        if value is None:
            continue
        if mode not in modes:
            raise ValueError(
                f"{flag} only applies with --grad-combine {' / '.join(modes)}, not with "
                f"--grad-combine {mode}; drop it or change the mode"
            )
        given[dest] = value
    return given


def _compressor(name: str, given: dict[str, Any], flag: str) -> Compressor:
    for dest, option, takers in (
        ("compress_ratio", "--compress-ratio", ("topk", "randblock")),
        ("qsgd_levels", "--qsgd-levels", ("qsgd",)),
        ("qsgd_bucket", "--qsgd-bucket", ("qsgd",)),
    ):
        if dest in given and name not in takers:
            raise ValueError(
                f"{option} only applies to {flag} {' / '.join(takers)}, not {name}; drop it"
            )
    return create_compressor(
        name,
        ratio=given.get("compress_ratio", 0.01),
        levels=given.get("qsgd_levels"),
        bucket_size=given.get("qsgd_bucket", 512),
    )


def _build_comm_combiner(args: argparse.Namespace) -> GradCombiner:
    """The combiner of a communication-efficient ``--grad-combine`` mode."""
    given = _check_comm_flags(args)
    mode = args.grad_combine
    seed = int(getattr(args, "seed", 0) or 0)
    if mode in ("ef", "cser"):
        compressor = _compressor(given.get("compressor", "topk"), given, "--compressor")
        if mode == "ef":
            return ErrorFeedbackCombiner(compressor, seed=seed)
        reset = create_compressor(given.get("cser_reset_compressor", "none"))
        return CSERCombiner(
            compressor, period=given.get("cser_period", 8), reset_compressor=reset, seed=seed
        )
    if mode in DDP_HOOKS:
        return DDPHookCombiner(
            mode,
            rank=given.get("powersgd_rank", 2),
            start_iter=given.get("powersgd_start_iter", 10),
            seed=seed,
        )
    if mode == "localsgd":
        return LocalSGDCombiner(
            period=given.get("local_steps", 8),
            warmup_steps=given.get("localsgd_warmup_steps", 0),
        )
    if mode == "slowmo":
        return SlowMoCombiner(
            period=given.get("local_steps", 3),
            slow_period=given.get("slowmo_period", 48),
            slow_momentum=given.get("slowmo_momentum", 0.5),
            slow_lr=given.get("slowmo_lr", 1.0),
        )
    if mode == "local-adaalter":
        optimizer = getattr(args, "optimizer", "sgd")
        if optimizer != "sgd" or getattr(args, "momentum", 0.0):
            raise ValueError(
                "--grad-combine local-adaalter applies AdaAlter's own update (AdaGrad with a "
                "lagging denominator) with the optimizer's lr and weight decay; pass "
                f"--optimizer sgd --momentum 0 (got --optimizer {optimizer} --momentum "
                f"{getattr(args, 'momentum', None)})"
            )
        return LocalAdaAlterCombiner(
            period=given.get("local_steps", 8), eps=given.get("adaalter_eps", 1.0)
        )
    raise ValueError(f"--grad-combine {mode!r}: choose one of {', '.join(GRAD_COMBINE_CHOICES)}")


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
