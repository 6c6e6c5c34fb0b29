"""Command-line flags shared by every training script, and what they build.

Each script calls :func:`add_run_args`, :func:`add_optimizer_args`, :func:`add_schedule_args`
and :func:`add_distributed_args` on its parser, then :func:`trainer_config`,
:func:`build_optimizer`, :func:`schedule_config` (the trainer counts the steps) and
:func:`build_combiner` with the parsed namespace, so a flag added here (a new optimizer's
hyperparameter, a new gradient combiner) reaches every script. The
same goes for what users reach for while training: :func:`add_tensorboard_args`
(``--tensorboard``), :func:`add_ema_args` (``--model-ema``, :func:`build_ema`) and
:func:`add_gradient_checkpointing_args` (``--gradient-checkpointing``).

The parser itself (:class:`ArgumentParser`, :data:`BOUNDS`, :func:`run_main`, ...) is in
:mod:`trainers.cli_parser`, the model-parallel flags and what they build
(:func:`add_tensor_parallel_args`, :func:`apply_model_parallel`, ...) in
:mod:`trainers.parallel_setup`; both are re-exported here, so scripts import from this module
alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .cli_parser import (
    BOUNDS,
    MXNET_OPTIONS,
    ArgumentParser,
    Bound,
    brief,
    describe_defaults,
    print_config,
    run_main,
    split_command,
)
from .comm import GradCombiner, combiner_class, create_combiner, list_combiners
from .config import (
    COMPILE_MODES,
    CombinerConfig,
    ElasticConfig,
    OptimizerConfig,
    ScheduleConfig,
    TrainerConfig,
)
from .dist import DistEnv
from .ema import DEFAULT_DECAY, EMAConfig, ModelEMA
from .optim import create_optimizer, list_optimizers, option_fields
from .parallel_setup import (
    _PLAN_FLAGS,  # noqa: F401 (tests/trainers/test_plan.py reads it here)
    ParallelSetup,
    _check_plan_blocks,  # noqa: F401 (tests/trainers/test_plan.py reads it here)
    add_tensor_parallel_args,
    apply_model_parallel,
    apply_plan,
    apply_tensor_parallel,
    parallel_config,
    tensor_parallel_mesh,
    unsplit_for_saving,
)
from .schedules import SCHEDULE_MODES, LRSchedule

__all__ = [
    "BOUNDS",
    "DTYPES",
    "MXNET_OPTIONS",
    "ArgumentParser",
    "Bound",
    "ParallelSetup",
    "brief",
    "describe_defaults",
    "print_config",
    "run_main",
    "add_distributed_args",
    "add_elastic_args",
    "add_ema_args",
    "add_gradient_checkpointing_args",
    "add_optimizer_args",
    "add_run_args",
    "add_schedule_args",
    "add_tensorboard_args",
    "add_tensor_parallel_args",
    "apply_model_parallel",
    "apply_plan",
    "apply_tensor_parallel",
    "parallel_config",
    "tensor_parallel_mesh",
    "unsplit_for_saving",
    "build_combiner",
    "build_elastic",
    "build_ema",
    "build_optimizer",
    "build_schedule",
    "check_flag_groups",
    "combiner_config",
    "combiner_flags",
    "elastic_config",
    "ema_config",
    "optimizer_config",
    "run_configs",
    "schedule_config",
    "split_command",
    "trainer_config",
]


# --dtype (GluonCV's spelling) -> TrainerConfig.precision
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


# ---- the run: the flags of the loop every script shares, and its TrainerConfig ------------------
def add_run_args(
    training: Any,
    logging: Any,
    *,
    seed: int = 0,
    seed_help: str = "run seed: initial weights, data order, augmentation",
    clip_grad_norm: float | None | bool = None,
    accumulate: bool = True,
    precision: bool = True,
    max_steps_help: str = "stop after N optimizer steps",
    log_interval: int | None = None,
    log_interval_help: str = "optimizer steps between log lines",
    logging_file: bool = True,
    compile_default: str = "auto",
    compile_help: str = "torch.compile the model: auto = on a CUDA device without tensor or "
    "pipeline parallelism, off on CPU",
) -> None:
    """The flags of the training loop every script shares, in the script's ``training`` and
    ``logging`` argument groups: ``--accumulate``, ``--clip-grad-norm`` (default
    ``clip_grad_norm``; ``False``: no such flag), ``--skip-nonfinite``, ``--dtype``,
    ``--compile`` (default ``compile_default``), ``--max-steps``, ``--seed``;
    ``--log-interval``, ``--run-log``, ``--logging-file``, ``--no-progress``.
    :func:`trainer_config` reads them back."""
    if accumulate:
        training.add_argument(
            "--accumulate", type=int, default=1, help="micro-batches per optimizer step"
        )
    if clip_grad_norm is not False:
        training.add_argument(
            "--clip-grad-norm", type=float, default=clip_grad_norm,
            help="global gradient clipping (<= 0: none)",
        )  # fmt: skip
    training.add_argument(
        "--skip-nonfinite", type=int, default=0, metavar="N",
        help="tolerate N optimizer steps with a non-finite loss: skip their updates (0: the "
        "first one stops the run, naming the step)",
    )  # fmt: skip
    if precision:
        training.add_argument(
            "--dtype", type=str, default="float32", choices=sorted(DTYPES),
            help="float16: autocast with loss scaling; bfloat16: autocast",
        )  # fmt: skip
    training.add_argument(
        "--compile", type=str, default=compile_default, choices=COMPILE_MODES, help=compile_help
    )
    training.add_argument("--max-steps", type=int, default=None, help=max_steps_help)
    training.add_argument("--seed", type=int, default=seed, help=seed_help)
    logging.add_argument("--log-interval", type=int, default=log_interval, help=log_interval_help)
    logging.add_argument("--run-log", type=str, default=None, help="JSON Lines run log")
    if logging_file:
        logging.add_argument(
            "--logging-file", type=str, default=None, help="also write the console lines here"
        )
    logging.add_argument("--no-progress", action="store_true", help="no progress bar")


def trainer_config(args: argparse.Namespace, **fields: Any) -> TrainerConfig:
    """The :class:`TrainerConfig` of the shared flags (:func:`add_run_args`,
    ``--inject-straggler`` of :func:`add_distributed_args`, ``--num-workers`` where the
    script has it), with ``fields`` (the script's own: ``epochs``, ``batch_size``...) on top."""
    config: dict[str, Any] = dict(
        max_steps=args.max_steps,
        seed=args.seed,
        progress=not args.no_progress,
        inject_straggler=args.inject_straggler,
        skip_nonfinite=args.skip_nonfinite,
        log_interval=args.log_interval,
    )
    if hasattr(args, "accumulate"):
        config["grad_accum_steps"] = args.accumulate
    if hasattr(args, "dtype"):
        config["precision"] = DTYPES[args.dtype]
    if hasattr(args, "clip_grad_norm"):
        clip = args.clip_grad_norm
        config["clip_grad_norm"] = clip if clip is not None and clip > 0 else None
    if hasattr(args, "num_workers"):
        config["num_workers"] = args.num_workers
    if hasattr(args, "compile"):
        config["compile"] = args.compile
    config.update(fields)
    return TrainerConfig(**config)


def check_flag_groups(args: argparse.Namespace) -> None:
    """The optimizer, schedule and combiner flags of ``args`` go together, for the groups the
    script added (:meth:`ArgumentParser.check` calls it).

    Raises:
        ValueError: naming the flag and what to do.
    """
    if hasattr(args, "optimizer") and hasattr(args, "beta1"):
        if args.optimizer not in list_optimizers():
            known = ", ".join(list_optimizers())
            raise ValueError(f"--optimizer {args.optimizer}: choose one of {known}")
        optimizer_config(args)
    if hasattr(args, "lr_mode"):
        _decay_epochs(args.lr_decay_epoch)
        _check_warmup(args)
    if hasattr(args, "grad_combine") and hasattr(args, "inject_straggler"):
        combiner_config(args)


def _decay_epochs(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(e) for e in text.split(",") if e.strip())
    except ValueError:
        raise ValueError(
            f"--lr-decay-epoch {text!r}: expected epochs separated by commas, e.g. 40,60"
        ) from None


def _check_warmup(args: argparse.Namespace) -> None:
    """``--warmup-epochs`` (+ ``--const-epochs``) fit in ``--num-epochs``, in epochs."""
    epochs = getattr(args, "num_epochs", None)
    warmup, const = float(args.warmup_epochs or 0), float(args.const_epochs or 0)
    if epochs and warmup + const > epochs:
        plus = f" + --const-epochs {const:g}" if const else ""
        raise ValueError(
            f"--warmup-epochs {warmup:g}{plus} is longer than --num-epochs {epochs}: "
            "shorten the warmup or train longer"
        )


# ---- the optimizer (trainers/optim, docs/optimizers.md) -----------------------------------------
def add_optimizer_args(
    parser: argparse.ArgumentParser,
    *,
    default: str = "nag",
    lr: float | None = None,
    wd: float | None = 1e-4,
) -> None:
    """``--optimizer``, the hyperparameters every optimizer family shares, and a flag for each
    option only some optimizers take (:class:`~trainers.optim.OptimizerOptions`: name, help
    and parser from its fields). A script whose defaults depend on its data passes
    ``lr=None``/``wd=None`` and fills them in itself."""
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
    # The options of some optimizers (lamb, lans): passed only when given, and an error with
    # an optimizer that does not take them (optimizer_config).
    for field in option_fields():
        if field.negatable:
            g.add_argument(field.flag, action=argparse.BooleanOptionalAction, default=None,
                           help=field.help)  # fmt: skip
        elif field.switch:
            g.add_argument(field.flag, action="store_true", help=field.help)
        else:
            g.add_argument(field.flag, type=field.parse, default=None, metavar=field.metavar,
                           help=field.help)  # fmt: skip
    brief(parser, "--optimizer", "--lr", "--wd")


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    """The :class:`OptimizerConfig` of parsed :func:`add_optimizer_args` flags.

    Only the options actually given reach ``options``; the others keep the optimizer's
    defaults.

    Raises:
        ValueError: a flag given that the chosen optimizer does not take.
    """
    options: dict[str, Any] = {}
    for field in option_fields():
        parsed = getattr(args, field.dest, None)
        if not field.given(parsed):
            continue
        value = options[field.name] = field.value(parsed)
        if args.optimizer.lower() not in field.takers:
            if args.optimizer.lower() not in list_optimizers():
                known = ", ".join(list_optimizers())
                raise ValueError(f"unknown optimizer {args.optimizer!r}; available: {known}")
            takers = [n for n in list_optimizers() if n in field.takers]
            raise ValueError(
                f"{field.spelled(value)} is not an option of --optimizer {args.optimizer}; drop "
                f"it or pick an optimizer that takes it ({', '.join(takers)})"
            )
    return OptimizerConfig(
        name=args.optimizer,
        lr=args.lr,
        weight_decay=args.wd,
        momentum=args.momentum,
        no_wd=bool(args.no_wd),
        betas=(args.beta1, args.beta2),
        eps=args.epsilon,
        options=options,
    )


def build_optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    config = optimizer_config(args)
    return create_optimizer(config.name, model, **config.kwargs())


# ---- the learning-rate schedule (trainers/schedules.py) ----------------------------------------
def add_schedule_args(parser: argparse.ArgumentParser, *, default: str = "cosine") -> None:
    """GluonCV's learning-rate flags (per-iteration schedules)."""
    g = parser.add_argument_group("learning-rate schedule")
    g.add_argument("--lr-mode", type=str, default=default, choices=SCHEDULE_MODES)
    g.add_argument("--lr-decay", type=float, default=0.1, help="step mode: decay factor")
    g.add_argument("--lr-decay-epoch", type=str, default="40,60", help="step mode: epochs")
    g.add_argument(
        "--lr-decay-power",
        type=float,
        default=2.0,
        help="poly / warmup_const_poly / nvidia_poly_warmup power (NVIDIA's BERT: 0.5)",
    )
    g.add_argument("--warmup-lr", type=float, default=0.0, help="lr at the start of warmup")
    g.add_argument("--warmup-epochs", type=float, default=None, help="linear warmup length")
    g.add_argument(
        "--const-epochs", type=float, default=0.0, help="warmup_const_poly: constant phase"
    )
    g.add_argument("--final-lr", type=float, default=0.0, help="lr at the end (cosine/poly/linear)")
    brief(parser, "--lr-mode", "--warmup-epochs")


def schedule_config(args: argparse.Namespace) -> ScheduleConfig:
    """The :class:`ScheduleConfig` of parsed :func:`add_schedule_args` flags."""
    decay = _decay_epochs(args.lr_decay_epoch)
    return ScheduleConfig(
        mode=args.lr_mode,
        base_lr=args.lr,
        warmup_epochs=float(args.warmup_epochs or 0),
        warmup_lr=args.warmup_lr,
        decay_epochs=decay,
        decay_factor=args.lr_decay,
        power=args.lr_decay_power,
        final_lr=args.final_lr,
        const_epochs=args.const_epochs,
    )


def build_schedule(args: argparse.Namespace, *, steps_per_epoch: int, epochs: int) -> LRSchedule:
    return schedule_config(args).build(steps_per_epoch=steps_per_epoch, epochs=epochs)


# ---- gradient combining (trainers/comm, docs/communication.md) ---------------------------------
@dataclasses.dataclass
class _CombinerFlag:
    """One command-line flag and the combiner options it sets (several modes may share it)."""

    flag: str
    dest: str
    kind: type
    choices: list[str] | None
    takers: list[tuple[str, dataclasses.Field[Any]]]  # (mode, options field)


def _scalar(annotation: Any) -> type:
    """``int`` of ``int | None`` and so on: the argparse type of an options field."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and args:
        for t in (bool, int, float, str):
            if t in args:
                return t
    if annotation in (bool, int, float, str):
        return annotation
    raise TypeError(f"options field of type {annotation!r} has no command-line form")


def combiner_flags() -> dict[str, _CombinerFlag]:
    """Every registered combiner's options, by flag (``--local-steps``: localsgd, slowmo...)."""
    flags: dict[str, _CombinerFlag] = {}
    for mode in list_combiners():
        options = combiner_class(mode).Options
        hints = typing.get_type_hints(options)
        for f in dataclasses.fields(options):
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            kind = _scalar(hints[f.name])
            choices = f.metadata.get("choices")
            choices = list(choices() if callable(choices) else choices) if choices else None
            entry = flags.setdefault(
                flag, _CombinerFlag(flag, flag[2:].replace("-", "_"), kind, choices, [])
            )
            if entry.kind is not kind or entry.choices != choices:
                raise TypeError(
                    f"{flag} means {entry.kind.__name__} {entry.choices or ''} for "
                    f"{entry.takers[0][0]} but {kind.__name__} {choices or ''} for {mode}"
                )
            entry.takers.append((mode, f))
    return flags


def _flag_help(entry: _CombinerFlag) -> str:
    parts: dict[str, list[str]] = {}  # help text (with default) -> modes
    for mode, f in entry.takers:
        default = f.default
        text = f.metadata.get("help", "")
        if default is not None and not isinstance(default, bool):
            text += f" (default {default})"
        parts.setdefault(text, []).append(mode)
    return "; ".join(f"{' / '.join(modes)}: {text}" for text, modes in parts.items())


def straggler_arg(text: str) -> tuple[int, float]:
    """``RANK:FACTOR`` of ``--inject-straggler`` (argparse type)."""
    rank, sep, factor = text.partition(":")
    try:
        parsed = (int(rank), float(factor))
    except ValueError:
        parsed = None
    if not sep or parsed is None or parsed[0] < 0 or not parsed[1] >= 1:
        raise argparse.ArgumentTypeError(
            f"expected RANK:FACTOR with a rank >= 0 and a factor >= 1 (e.g. 1:2), got {text!r}"
        )
    return parsed


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """``--grad-combine`` (the registered modes) and every mode's options as flags.

    Flags, types, help texts and defaults come from the combiners' options dataclasses
    (:mod:`trainers.comm`); launch with ``torchrun`` for several ranks.
    """
    g = parser.add_argument_group("distributed (launch with torchrun; docs/communication.md)")
    g.add_argument(
        "--grad-combine",
        type=str.lower,
        default="average",
        choices=list_combiners(),
        metavar="MODE",
        help="how workers combine their work: "
        + ", ".join(f"{m} ({combiner_class(m).summary})" for m in list_combiners()),
    )
    g.add_argument(
        "--inject-straggler",
        type=straggler_arg,
        default=None,
        metavar="RANK:FACTOR",
        help="make rank RANK a straggler: it sleeps FACTOR - 1 times its own forward + "
        "backward time after each micro-step (e.g. 1:2 slows rank 1 twice; for straggler "
        "experiments, docs/communication.md)",
    )
    for entry in combiner_flags().values():
        if entry.kind is bool:  # --flag / --no-flag; None: the mode's own default
            g.add_argument(
                entry.flag,
                dest=entry.dest,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=_flag_help(entry),
            )
        else:
            g.add_argument(
                entry.flag,
                dest=entry.dest,
                type=str.lower if entry.kind is str else entry.kind,
                default=None,
                choices=entry.choices,
                help=_flag_help(entry),
            )
    brief(parser, "--grad-combine")
    parser._option_string_actions["--grad-combine"].brief_help = (  # type: ignore[attr-defined]
        f"how workers combine their work: {', '.join(list_combiners())} (default: average; "
        "--help-all says what each does, docs/communication.md)"
    )


def combiner_config(args: argparse.Namespace) -> CombinerConfig:
    """The :class:`CombinerConfig` of parsed :func:`add_distributed_args` flags.

    Raises:
        ValueError: a flag of another mode, or an invalid option value (naming the flag).
    """
    mode = args.grad_combine
    cls = combiner_class(mode)
    given: dict[str, Any] = {}
    flag_of: dict[str, str] = {}
    for entry in combiner_flags().values():
        value = getattr(args, entry.dest, None)
        if value is None:
            continue
        field = next((f for m, f in entry.takers if m == cls.name), None)
        if field is None:
            modes = " / ".join(m for m, _ in entry.takers)
            raise ValueError(
                f"{entry.flag} only applies with --grad-combine {modes}, not with "
                f"--grad-combine {mode}; drop it or change the mode"
            )
        given[field.name] = value
        flag_of[field.name] = entry.flag
    try:
        options = cls.Options(**given)
    except ValueError as e:
        flags = ", ".join(f"{flag_of[k]} sets {k}" for k in given)
        raise ValueError(f"--grad-combine {mode}: {e}" + (f" ({flags})" if flags else "")) from e
    return CombinerConfig(cls.name, options)


def build_combiner(args: argparse.Namespace, env: DistEnv | None = None) -> GradCombiner:
    """The combiner of parsed flags, seeded with ``--seed`` (``env`` is not needed)."""
    return create_combiner(combiner_config(args), seed=int(getattr(args, "seed", 0) or 0))


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
    brief(parser, "--elastic-dir")


def elastic_resuming(
    args: argparse.Namespace | ElasticConfig | None, run_log: str | None, *, is_main: bool
) -> bool:
    """Whether this worker group resumes an elastic job (append to the run log, no header).

    ``args``: parsed flags or an :class:`ElasticConfig` (``None``: not elastic). On rank 0 a
    torn last line of ``run_log`` (its writer was killed) is dropped.
    """
    from .elastic import ElasticState, repair_run_log  # local: keeps this section self-contained

    config = args if isinstance(args, ElasticConfig) or args is None else elastic_config(args)
    if config is None or not ElasticState.has_checkpoint(config.dir):
        return False
    if is_main and run_log is not None:
        repair_run_log(run_log)
    return True


def elastic_config(args: argparse.Namespace) -> ElasticConfig | None:
    """The :class:`ElasticConfig` of parsed :func:`add_elastic_args` flags (None without
    ``--elastic-dir``); ``--elastic-lr-scaling auto`` is ``none`` with Adasum, else linear."""
    if getattr(args, "elastic_dir", None) is None:
        return None
    scaling = args.elastic_lr_scaling
    if scaling == "auto":
        scaling = "none" if getattr(args, "grad_combine", "average") == "adasum" else "linear"
    return ElasticConfig(
        dir=args.elastic_dir,
        checkpoint_steps=args.elastic_checkpoint_steps,
        ramp_steps=args.elastic_ramp_steps,
        lr_scaling=scaling,
        ledger=not args.no_elastic_ledger,
    )


def build_elastic(args: argparse.Namespace | ElasticConfig | None, trainer: Any) -> Any:
    """An :class:`~trainers.elastic.ElasticState` for ``trainer`` from parsed flags or an
    :class:`ElasticConfig` (None without ``--elastic-dir``)."""
    from .elastic import ElasticState

    config = args if isinstance(args, ElasticConfig) or args is None else elastic_config(args)
    if config is None:
        return None
    return ElasticState(
        trainer,
        config.dir,
        checkpoint_steps=config.checkpoint_steps,
        ramp_steps=config.ramp_steps,
        lr_scaling=config.lr_scaling,
        ledger=config.ledger,
    )


def run_configs(args: argparse.Namespace, **more: Any) -> dict[str, Any]:
    """The typed configs of every flag group the script added, for the run-log header.

    ``optimizer`` (with :func:`add_optimizer_args`), ``schedule`` (:func:`add_schedule_args`),
    ``combiner`` (:func:`add_distributed_args`), ``elastic`` (with ``--elastic-dir``),
    ``ema`` (with ``--model-ema``), plus ``more`` (e.g. ``run=TrainerConfig(...)``).
    """
    configs: dict[str, Any] = {}
    if hasattr(args, "optimizer") and hasattr(args, "beta1"):
        configs["optimizer"] = optimizer_config(args)
    if hasattr(args, "lr_mode"):
        configs["schedule"] = schedule_config(args)
    if hasattr(args, "grad_combine"):
        configs["combiner"] = combiner_config(args)
    if hasattr(args, "elastic_dir"):
        configs["elastic"] = elastic_config(args)
    if hasattr(args, "model_ema"):
        configs["ema"] = ema_config(args)
    configs.update(more)
    return {k: v for k, v in configs.items() if v is not None}


# ---- while training: TensorBoard, weight averaging, activation memory ------------------------
def _tensorboard_dir(text: str) -> str:
    """``--tensorboard DIR`` (argparse type): refused at once when the package is missing."""
    from .tensorboard import INSTALL_HINT, require_tensorboard  # noqa: PLC0415 (optional)

    try:
        require_tensorboard()
    except ImportError:
        raise argparse.ArgumentTypeError(
            f"the tensorboard package is not installed: {INSTALL_HINT}"
        ) from None
    return text


def add_tensorboard_args(parser: argparse.ArgumentParser) -> None:
    """``--tensorboard DIR``: the run log's records as TensorBoard scalars
    (:mod:`trainers.tensorboard`); pass ``args.tensorboard`` to ``RunLogger(tensorboard=)``."""
    g = parser.add_argument_group("TensorBoard (docs/training.md)")
    g.add_argument(
        "--tensorboard",
        type=_tensorboard_dir,
        default=None,
        metavar="DIR",
        help="also write the run log's numbers (loss, lr, metrics, speed, bytes sent, "
        "evaluations) as TensorBoard scalars to DIR, at the global step (rank 0; needs "
        'pip install "modelzoo-trainers-pt[tensorboard]")',
    )
    brief(parser, "--tensorboard")


def _ema_decay(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(
            f"expected a decay in [0, 1) (timm's default {DEFAULT_DECAY}), got {text!r}"
        )
    return value


def add_ema_args(parser: argparse.ArgumentParser) -> None:
    """``--model-ema``, ``--model-ema-decay``, ``--model-ema-warmup`` (timm's flags and
    default); the script builds the hook with :func:`build_ema`."""
    g = parser.add_argument_group("weight averaging (docs/training.md)")
    g.add_argument(
        "--model-ema",
        action="store_true",
        help="keep an exponential moving average of the weights, updated after every "
        "optimizer step, checkpointed, and evaluated after each evaluation (ema_ metrics in "
        "the run log and the end record)",
    )
    g.add_argument(
        "--model-ema-decay",
        type=_ema_decay,
        default=DEFAULT_DECAY,
        help="EMA decay d: w_ema = d w_ema + (1 - d) w (about 1 / (1 - d) steps; timm's default)",
    )
    g.add_argument(
        "--model-ema-warmup",
        action="store_true",
        help="timm's EMA warmup: decay min(d, 1 - t^(-2/3)) at update t",
    )
    brief(parser, "--model-ema")


def ema_config(args: argparse.Namespace) -> EMAConfig | None:
    """The :class:`~trainers.ema.EMAConfig` of parsed :func:`add_ema_args` flags (None
    without ``--model-ema``)."""
    if not getattr(args, "model_ema", False):
        return None
    return EMAConfig(decay=args.model_ema_decay, warmup=bool(args.model_ema_warmup))


def build_ema(
    args: argparse.Namespace,
    model: nn.Module,
    *,
    eval_dataset: Any = None,
    collate_fn: Any = None,
    on_evaluated: Any = None,
) -> ModelEMA | None:
    """The :class:`~trainers.ema.ModelEMA` hook of parsed flags (None without
    ``--model-ema``); add it to the Trainer's hooks after the script's own hooks."""
    config = ema_config(args)
    if config is None:
        return None
    return ModelEMA(
        model,
        decay=config.decay,
        warmup=config.warmup,
        eval_dataset=eval_dataset,
        collate_fn=collate_fn,
        on_evaluated=on_evaluated,
    )


def add_gradient_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    """``--gradient-checkpointing`` (transformers: recompute each layer in the backward)."""
    g = parser.add_argument_group("activation memory (docs/training.md)")
    g.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each transformer layer's activations in the backward instead of "
        "keeping them: less memory for about one more forward pass; the same gradients",
    )
    brief(parser, "--gradient-checkpointing")


def add_export_args(parser: argparse.ArgumentParser) -> None:
    """``--export-dir DIR``: after training, one artifact folder
    (:func:`modelzoo.artifact.save_artifact`) that ``modelzoo.get_model(DIR)`` and
    ``modelzoo.pipeline(task, DIR)`` load."""
    g = parser.add_argument_group("export (docs/inference.md)")
    g.add_argument(
        "--export-dir",
        default=None,
        metavar="DIR",
        help="after training, write DIR with modelzoo.json (model, options, preprocessing, "
        "labels, metrics), model.safetensors (the EMA's weights with --model-ema) and, for "
        "BERT, its vocabulary: modelzoo.get_model(DIR) / modelzoo.pipeline(task, DIR) load it",
    )
    brief(parser, "--export-dir")


def export_source(args: argparse.Namespace, command: Sequence[str], **more: Any) -> dict[str, Any]:
    """The ``source`` of an exported artifact: the command, the seed, the run log."""
    out: dict[str, Any] = {"command": " ".join(str(c) for c in command), "seed": args.seed}
    if getattr(args, "run_log", None):
        out["run_log"] = str(args.run_log)
    out.update(more)
    return out
