"""Command-line flags shared by every training script, and what they build.

Each script calls :func:`add_optimizer_args`, :func:`add_schedule_args` and
:func:`add_distributed_args` on its parser, then :func:`build_optimizer`,
:func:`build_schedule` and :func:`build_combiner` with the parsed namespace, so a flag added
here (a new optimizer's hyperparameter, a new gradient combiner) reaches every script. The
same goes for what users reach for while training: :func:`add_tensorboard_args`
(``--tensorboard``), :func:`add_ema_args` (``--model-ema``, :func:`build_ema`) and
:func:`add_gradient_checkpointing_args` (``--gradient-checkpointing``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .comm import GradCombiner, combiner_class, create_combiner, list_combiners
from .config import CombinerConfig, ElasticConfig, OptimizerConfig, ScheduleConfig
from .dist import DistEnv
from .ema import DEFAULT_DECAY, EMAConfig, ModelEMA
from .optim import create_optimizer, list_optimizers, optimizer_accepts
from .schedules import SCHEDULE_MODES, LRSchedule

__all__ = [
    "DTYPES",
    "MXNET_OPTIONS",
    "ArgumentParser",
    "add_distributed_args",
    "add_elastic_args",
    "add_ema_args",
    "add_gradient_checkpointing_args",
    "add_optimizer_args",
    "add_schedule_args",
    "add_tensorboard_args",
    "add_tensor_parallel_args",
    "apply_model_parallel",
    "apply_plan",
    "apply_tensor_parallel",
    "tensor_parallel_mesh",
    "unsplit_for_saving",
    "build_combiner",
    "build_elastic",
    "build_ema",
    "build_optimizer",
    "build_schedule",
    "combiner_config",
    "combiner_flags",
    "elastic_config",
    "ema_config",
    "optimizer_config",
    "run_configs",
    "schedule_config",
    "split_command",
]


# --dtype (GluonCV's spelling) -> TrainerConfig.precision
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``[own flags..., "--", command...]`` -> ``(own flags, command)`` (no ``--``: no command);
    for tools that run another script (``publish.py``, ``trainers.elastic_drill``)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


# ---- the parser every script uses ---------------------------------------------------------------
# MXNet/GluonCV/GluonNLP options that have no meaning here: accepted, with a one-line note.
MXNET_OPTIONS: dict[str, tuple[str | None, str]] = {
    # flag: (metavar, what it means here); metavar None: a switch
    "--num-gpus": ("N", "GPUs: launch one process per GPU with torchrun --nproc-per-node N"),
    "--gpus": ("IDS", "GPUs: launch one process per GPU with torchrun --nproc-per-node N"),
    "--gpu": ("ID", "GPUs: launch one process per GPU with torchrun --nproc-per-node N"),
    "--kvstore": ("TYPE", "gradient exchange: torch.distributed (see --grad-combine)"),
    "--mode": (
        "MODE",
        "MXNet's hybrid (graph) / imperative execution: PyTorch runs eagerly here, in both",
    ),
    "--bert-dataset": (
        "NAME",
        "GluonNLP's pretraining corpus name: the vocabulary and weights come from --bert-model",
    ),
}


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with the conventions every script shares.

    * No abbreviations: an unknown option is an error, never a prefix of another one
      (``--mode hybrid`` is not ``--model hybrid``).
    * One vocabulary, dashed names: ``--max_seq_length`` is accepted for
      ``--max-seq-length`` (GluonCV and GluonNLP spell their flags both ways).
    * :meth:`add_mxnet_options`: MXNet-only options (``--num-gpus``, ``--gpus``, ...) are
      accepted, and a one-line note says what they mean here.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        self._mxnet: dict[str, str] = {}

    def add_mxnet_options(self, *flags: str) -> None:
        """Accept MXNet-only options (all of :data:`MXNET_OPTIONS` by default) with a note."""
        g = self.add_argument_group("MXNet options (accepted; see the note each one prints)")
        for flag in flags or tuple(MXNET_OPTIONS):
            metavar, note = MXNET_OPTIONS[flag]
            dest = "mxnet_" + flag[2:].replace("-", "_")
            if metavar is None:
                g.add_argument(flag, dest=dest, action="store_true", help=f"ignored: {note}")
            else:  # a value, or none (GluonNLP's bare --gpu)
                g.add_argument(
                    flag, dest=dest, metavar=metavar, nargs="?", const=True, help=f"ignored: {note}"
                )
            self._mxnet[dest] = f"note: {flag} is an MXNet option; {note}"

    def add_renamed(self, old: str, new: str, why: str) -> None:
        """``old`` is an error that names ``new`` (a flag whose meaning here differs)."""
        message = f"{old} is not an option of this script: use {new} ({why})"

        class Renamed(argparse.Action):
            def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
                parser.error(message)

        self.add_argument(old, nargs="?", action=Renamed, help=argparse.SUPPRESS)

    def _dashed(self, args: list[str]) -> list[str]:
        out = []
        known = self._option_string_actions
        for token in args:
            if token == "--":
                out.extend(args[len(out) :])
                break
            if token.startswith("--") and "_" in token:
                name, eq, value = token.partition("=")
                dashed = "--" + name[2:].replace("_", "-")
                if name not in known and dashed in known:
                    token = dashed + eq + value
            out.append(token)
        return out

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        parsed, rest = super().parse_known_args(self._dashed(argv), namespace)
        for dest, note in self._mxnet.items():
            if getattr(parsed, dest, None) not in (None, False):
                print(note, file=sys.stderr)
        return parsed, rest


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
        action=argparse.BooleanOptionalAction,
        default=None,
        help="lamb/lans: apply the trust ratio to the --no-wd parameters too (unset: the "
        "optimizer's default, lamb off, lans on; --no-adapt-no-wd turns it off for lans)",
    )
    g.add_argument(
        "--use-nvlamb",
        action="store_true",
        help="lamb: apex's use_nvlamb, the trust ratio on every tensor "
        "(= --always-adapt --adapt-no-wd)",
    )
    g.add_argument(
        "--optimizer-variant",
        default=None,
        metavar="NAME",
        help="lamb: apex (default) or deepspeed (DeepSpeed FusedLamb); lans: gluonnlp "
        "(default, the authors' FusedLANS), mxnet or mxnet-sequential",
    )


_OPTIMIZER_OPTION_FLAGS = {
    "max_grad_norm": "--max-grad-norm",
    "trust_clamp": "--trust-clamp",
    "weight_norm_clamp": "--weight-norm-clamp",
    "bias_correction": "--no-bias-correction",
    "always_adapt": "--always-adapt",
    "adapt_no_wd": "--adapt-no-wd",
    "use_nvlamb": "--use-nvlamb",
    "variant": "--optimizer-variant",
}


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    """The :class:`OptimizerConfig` of parsed :func:`add_optimizer_args` flags.

    Only the options actually given reach ``options``; the others keep the optimizer's
    defaults.

    Raises:
        ValueError: a flag given that the chosen optimizer does not take.
    """
    options: dict[str, Any] = {}
    max_grad_norm = getattr(args, "max_grad_norm", None)
    if max_grad_norm is not None:
        options["max_grad_norm"] = max_grad_norm if max_grad_norm > 0 else None
    for option in ("trust_clamp", "weight_norm_clamp"):
        if getattr(args, option, None) is not None:
            options[option] = getattr(args, option)
    if getattr(args, "no_bias_correction", False):
        options["bias_correction"] = False
    for option in ("always_adapt", "use_nvlamb"):
        if getattr(args, option, False):
            options[option] = True
    if getattr(args, "adapt_no_wd", None) is not None:
        options["adapt_no_wd"] = bool(args.adapt_no_wd)
    if getattr(args, "optimizer_variant", None) is not None:
        options["variant"] = args.optimizer_variant
    for option, value in options.items():
        if not optimizer_accepts(args.optimizer, option):
            flag = _OPTIMIZER_OPTION_FLAGS[option]
            if option == "adapt_no_wd" and not value:
                flag = "--no-adapt-no-wd"
            takers = [n for n in list_optimizers() if optimizer_accepts(n, option)]
            raise ValueError(
                f"{flag} is not an option of --optimizer {args.optimizer}; drop it or pick an "
                f"optimizer that takes it ({', '.join(takers)})"
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


def schedule_config(args: argparse.Namespace) -> ScheduleConfig:
    """The :class:`ScheduleConfig` of parsed :func:`add_schedule_args` flags."""
    decay = tuple(int(e) for e in args.lr_decay_epoch.split(",") if e.strip())
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


# ---- model parallelism (trainers/parallel, docs/model_parallel.md) --------------------------
def _boundaries(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected block indices separated by commas, e.g. 0,4,8; got {text!r}"
        ) from None


def add_tensor_parallel_args(
    parser: argparse.ArgumentParser, *, tensor: bool = True, pipeline: bool = True
) -> None:
    """``--tensor-parallel N`` (``tensor=True``: BERTs) and (``pipeline=True``)
    ``--pipeline-parallel N --micro-batches M --pipeline-schedule --pipeline-boundaries``."""
    g = parser.add_argument_group("model parallelism (docs/model_parallel.md)")
    if not tensor:
        parser.set_defaults(tensor_parallel=1)
    else:
        g.add_argument(
            "--tensor-parallel",
            type=int,
            default=1,
            metavar="N",
            help="split every Transformer layer over N processes (Megatron's layout on "
            "DTensor); the world (torchrun's processes) becomes WORLD/N data-parallel "
            "replicas of N ranks",
        )
    g.add_argument(
        "--plan",
        type=str,
        default=None,
        metavar="FILE",
        help="a placement from the planner (python -m trainers.parallel.plan ... --json FILE): "
        "its tensor/pipeline degrees, micro-batches, schedule and stage boundaries; the run's "
        "world size, model and global batch must be the plan's",
    )
    if not pipeline:
        return
    g.add_argument(
        "--pipeline-parallel",
        type=int,
        default=1,
        metavar="N",
        help="cut the model into N pipeline stages, one per process (torch.distributed."
        "pipelining); the world becomes WORLD/N data-parallel replicas of N stages",
    )
    g.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        metavar="M",
        help="micro-batches per pipeline step (--batch-size must divide by M; default: the "
        "number of stages)",
    )
    g.add_argument(
        "--pipeline-schedule",
        choices=("1f1b", "gpipe"),
        default=None,
        help="1f1b (the default): one forward, one backward (activations of at most N "
        "micro-batches); gpipe: all forwards, then all backwards",
    )
    g.add_argument(
        "--pipeline-boundaries",
        type=_boundaries,
        default=None,
        metavar="B0,B1,...",
        help="the block where each stage starts, and the end (default: balanced by parameter "
        "count; the planner, python -m trainers.parallel.plan, gives measured ones)",
    )


def unsplit_for_saving(model: nn.Module) -> nn.Module:
    """``model``, or for a tensor- or pipeline-parallel one the whole single-process model (a
    collective over its group: call it on every rank before rank 0 saves)."""
    from ._dtensor import is_pipeline_parallel, is_tensor_parallel

    if is_pipeline_parallel(model):
        model.synchronize()  # type: ignore[operator]
        model = model.full_model  # type: ignore[assignment]  (tensor-parallel inside: unsplit)
    if not is_tensor_parallel(model):
        return model
    from .parallel.tensor import unsplit_model

    return unsplit_model(model)


def _model_parallel_checks(args: argparse.Namespace, env: DistEnv, flag: str, n: int) -> None:
    if env.world_size % n:
        raise SystemExit(
            f"{flag} {n} needs a world size divisible by {n}; this run has "
            f"{env.world_size} process(es) (torchrun --nproc-per-node)"
        )
    if getattr(args, "elastic_dir", None):
        raise SystemExit(
            f"{flag} and --elastic-dir do not combine: a model-parallel replica cannot change "
            "its width; run elastic training data-parallel"
        )
    if getattr(args, "model_ema", False):
        raise SystemExit(
            f"--model-ema does not run on a model split by {flag} yet (its copy would be "
            f"split too); drop one of --model-ema and {flag}"
        )
    if getattr(args, "grad_combine", "average") != "average":
        raise SystemExit(f"{flag} runs with --grad-combine average (got {args.grad_combine!r})")


def _degree(args: argparse.Namespace, name: str) -> int:
    value = getattr(args, name, None)
    n = 1 if value is None else int(value)
    if n < 1:
        raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {n}")
    return n


def tensor_parallel_mesh(args: argparse.Namespace, env: DistEnv) -> Any:
    """The ``(dp, tp)`` device mesh of ``--tensor-parallel N`` (``None`` for ``N = 1``), after
    checking that the run can be split that way."""
    tp = _degree(args, "tensor_parallel")
    if tp == 1:
        return None
    _model_parallel_checks(args, env, "--tensor-parallel", tp)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        env.device.type, (env.world_size // tp, tp), mesh_dim_names=("dp", "tp")
    )


# What --plan sets, and each flag's value when it is not given on the command line.
_PLAN_FLAGS = (
    ("tensor_parallel", "--tensor-parallel", 1),
    ("pipeline_parallel", "--pipeline-parallel", 1),
    ("micro_batches", "--micro-batches", None),
    ("pipeline_schedule", "--pipeline-schedule", None),
    ("pipeline_boundaries", "--pipeline-boundaries", None),
)


def apply_plan(
    args: argparse.Namespace,
    env: DistEnv,
    *,
    model_name: str | None,
    batch_size: int,
    accumulate: int,
    seq_len: int | None = None,
    image_size: int | None = None,
) -> None:
    """``--plan FILE``: set the model-parallel flags of ``args`` from the planner's plan
    (:func:`trainers.parallel.plan.load_plan`), after checking that this run is the one
    planned: the world size is the plan's devices, ``model_name`` (when the script knows it)
    the plan's model, and ``batch_size x accumulate`` per rank the plan's global batch over its
    data-parallel replicas (pipeline: one batch of ``micro_batches`` micro-batches, no
    accumulation; otherwise ``micro_batches`` accumulation steps). A flag given on the command
    line with another value than the plan's is an error. Call it before the run-log header
    is written, so that the header holds the placement the run uses; the plan's predicted
    step time and its memory are printed on rank 0. Does nothing without ``--plan``."""
    path = getattr(args, "plan", None)
    if not path:
        return
    from .parallel.plan import load_plan  # noqa: PLC0415 (only with --plan)

    try:
        plan = load_plan(path)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--plan {path}: {err}") from None
    pp, tp, dp, micro = (plan.pipeline_parallel, plan.tensor_parallel, plan.data_parallel,
                         plan.micro_batches)  # fmt: skip
    if plan.devices != env.world_size:
        raise SystemExit(
            f"--plan {path} places {plan.devices} devices (tp {tp} x pp {pp} x dp {dp}); this "
            f"run has {env.world_size} process(es): start it with that many (torchrun "
            "--nproc-per-node / --nnodes) or plan for this world size"
        )
    if model_name is not None and plan.model != model_name:
        raise SystemExit(
            f"--plan {path} was made for the model {plan.model!r}; this run trains "
            f"{model_name!r}: plan this model (python -m trainers.parallel.plan --model "
            f"{model_name} ...)"
        )
    if seq_len is not None and plan.seq_len is not None and plan.seq_len != seq_len:
        raise SystemExit(
            f"--plan {path} was profiled at sequence length {plan.seq_len}; this run uses "
            f"{seq_len}: plan with --seq-len {seq_len} or run at {plan.seq_len}"
        )
    if image_size is not None and plan.image_size is not None and plan.image_size != image_size:
        raise SystemExit(
            f"--plan {path} was profiled at image size {plan.image_size}; this run uses "
            f"{image_size}: plan with --image-size {image_size} or run at {plan.image_size}"
        )
    per_replica = plan.global_batch // dp
    want = (per_replica, 1) if pp > 1 else (per_replica // micro, micro)
    if (batch_size, accumulate) != want:
        what = "one batch in" if pp > 1 else "accumulation steps of"
        raise SystemExit(
            f"--plan {path} is for a global batch of {plan.global_batch} = dp {dp} x "
            f"{per_replica} per replica, {what} {micro} micro-batches of "
            f"{per_replica // micro}; this run has a batch of {batch_size} per rank x "
            f"accumulate {accumulate}: pass a batch size of {want[0]} and accumulate {want[1]}"
        )
    values: dict[str, Any] = {"tensor_parallel": tp, "pipeline_parallel": pp}
    if pp > 1:
        values.update(micro_batches=micro, pipeline_schedule=plan.schedule,
                      pipeline_boundaries=list(plan.boundaries))  # fmt: skip
    for name, flag, unset in _PLAN_FLAGS:
        if name not in values:
            continue
        if not hasattr(args, name):
            if values[name] != unset:
                raise SystemExit(f"--plan {path} needs {flag} {values[name]}, which this "
                                 "script does not offer")  # fmt: skip
            continue
        given = getattr(args, name)
        if given != unset and given != values[name]:
            raise SystemExit(
                f"{flag} {given} contradicts --plan {path}, which sets {values[name]}; "
                f"drop {flag} or the plan"
            )
        setattr(args, name, values[name])
    if env.is_main:
        print(
            f"--plan {path}: tp {tp} x pp {pp} x dp {dp}, {micro} micro-batch(es), "
            f"{plan.schedule}, boundaries {list(plan.boundaries)}; predicted step "
            f"{plan.predicted_step_s:.4g} s, {plan.memory_per_device_bytes / 2**30:.2f} GiB "
            "per device",
            file=sys.stderr,
        )


def _check_plan_blocks(path: str, model: nn.Module) -> None:
    """The model a run builds has the planned model's number of pipeline blocks
    (:func:`~trainers.parallel.pipeline.model_blocks`), so the plan's boundaries cut it where
    the planner meant."""
    from .parallel.pipeline import model_blocks  # noqa: PLC0415
    from .parallel.plan import load_plan  # noqa: PLC0415

    planned = load_plan(path).profile.get("blocks")
    try:
        blocks = len(model_blocks(model))
    except TypeError:
        return  # a model the pipeline cannot cut: the degrees are all the plan gives it
    if planned is not None and planned != blocks:
        raise SystemExit(
            f"--plan {path} was profiled on a model of {planned} blocks; this run's model has "
            f"{blocks}: plan the model this run builds"
        )


def apply_tensor_parallel(
    args: argparse.Namespace, env: DistEnv, model: nn.Module
) -> tuple[nn.Module, DistEnv]:
    """Lay ``model`` out over ``--tensor-parallel N`` ranks; returns it and the environment
    the Trainer and the data should see (the data-parallel view of ``env``; ``env`` itself
    with ``N = 1``)."""
    mesh = tensor_parallel_mesh(args, env)
    if mesh is None:
        return model, env
    from .parallel.tensor import parallelize_bert

    parallelize_bert(model, mesh["tp"])
    return model, env.data_parallel(mesh["dp"])


def apply_model_parallel(
    args: argparse.Namespace,
    env: DistEnv,
    model: nn.Module,
    *,
    inputs_of: Callable[[Any], Sequence[torch.Tensor]] | None = None,
    batch_size: int | None = None,
) -> tuple[nn.Module, DistEnv]:
    """``--tensor-parallel`` (:func:`apply_tensor_parallel`) or ``--pipeline-parallel N``:
    ``model`` as a :class:`trainers.parallel.PipelinedModel` over a ``(dp, pp)`` mesh, and the
    data-parallel view of ``env``. Both (``--tensor-parallel T --pipeline-parallel N``): a
    ``(dp, pp, tp)`` mesh in Megatron's rank order, each stage's layers split over ``T``
    ranks. ``inputs_of(batch)``: the model's positional inputs;
    ``batch_size``: the per-rank batch to split into micro-batches (default
    ``--batch-size``). With ``--plan`` (already applied by :func:`apply_plan`), ``model`` must
    have as many blocks as the planned one."""
    batch = args.batch_size if batch_size is None else batch_size
    if getattr(args, "plan", None):
        _check_plan_blocks(args.plan, model)
    pp = _degree(args, "pipeline_parallel")
    if pp == 1:
        return apply_tensor_parallel(args, env, model)
    tp = _degree(args, "tensor_parallel")
    flag = "--pipeline-parallel" if tp == 1 else "--tensor-parallel x --pipeline-parallel"
    _model_parallel_checks(args, env, flag, pp * tp)
    micro = args.micro_batches if args.micro_batches is not None else pp
    if micro < 1:
        raise SystemExit(f"--micro-batches must be >= 1, got {micro}")
    if batch % micro:
        raise SystemExit(
            f"the batch size {batch} does not split into --micro-batches {micro}; make the "
            "batch size a multiple of the micro-batches"
        )
    if inputs_of is None:
        raise SystemExit(f"--pipeline-parallel: {type(model).__name__} has no pipeline inputs")
    from torch.distributed.device_mesh import init_device_mesh

    from .parallel.pipeline import PipelinedModel

    # Megatron-LM's rank order, tensor parallel innermost (the planner's):
    # rank = replica * (pp * tp) + stage * tp + tp_index.
    if tp == 1:
        mesh = init_device_mesh(
            env.device.type, (env.world_size // pp, pp), mesh_dim_names=("dp", "pp")
        )
    else:
        mesh = init_device_mesh(
            env.device.type, (env.world_size // (pp * tp), pp, tp),
            mesh_dim_names=("dp", "pp", "tp"),
        )  # fmt: skip
    try:
        pipelined = PipelinedModel(
            model, group=mesh["pp"].get_group(), micro_batches=micro, inputs_of=inputs_of,
            schedule=args.pipeline_schedule or "1f1b", boundaries=args.pipeline_boundaries,
            device=env.device, tensor_mesh=mesh["tp"] if tp > 1 else None,
        )  # fmt: skip
    except (TypeError, ValueError) as err:
        raise SystemExit(f"{flag} {pp if tp == 1 else f'{tp} x {pp}'}: {err}") from None
    return pipelined, env.data_parallel(mesh["dp"])


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


def export_source(args: argparse.Namespace, command: Sequence[str], **more: Any) -> dict[str, Any]:
    """The ``source`` of an exported artifact: the command, the seed, the run log."""
    out: dict[str, Any] = {"command": " ".join(str(c) for c in command), "seed": args.seed}
    if getattr(args, "run_log", None):
        out["run_log"] = str(args.run_log)
    out.update(more)
    return out
