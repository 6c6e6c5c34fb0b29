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
import copy
import dataclasses
import math
import re
import sys
import textwrap
import traceback
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .comm import GradCombiner, combiner_class, create_combiner, list_combiners
from .config import CombinerConfig, ElasticConfig, OptimizerConfig, ScheduleConfig
from .dist import DistEnv
from .ema import DEFAULT_DECAY, EMAConfig, ModelEMA
from .errors import UsageError
from .logs import discard_unstarted_logs
from .optim import create_optimizer, list_optimizers, optimizer_accepts
from .schedules import SCHEDULE_MODES, LRSchedule

__all__ = [
    "BOUNDS",
    "DTYPES",
    "MXNET_OPTIONS",
    "ArgumentParser",
    "Bound",
    "brief",
    "describe_defaults",
    "print_config",
    "run_main",
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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, without ``(default: None)`` / ``(default: False)``: an
    unset default either means "off" or depends on other flags, which the help text says."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)

    # Lines break between words, never inside a flag name (--data-/dir).
    def _split_lines(self, text: str, width: int) -> list[str]:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.wrap(text, width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)  # fmt: skip


class _HelpAction(argparse.Action):
    """``--help`` (the main flags of each group) and ``--help-all`` (every flag)."""

    def __init__(self, option_strings: list[str], dest: str, full: bool = False, **kw: Any):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                         nargs=0, **kw)  # fmt: skip
        self.full = full

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        text = parser.format_help_all() if self.full else parser.format_help()
        parser._print_message(text, sys.stdout)
        parser.exit()


def brief(parser: argparse.ArgumentParser, *flags: str) -> None:
    """Show ``flags`` with their help text in ``--help``; a group's other flags are listed by
    name only (``--help-all`` describes every flag)."""
    for flag in flags:
        parser._option_string_actions[flag].brief = True  # type: ignore[attr-defined]


def describe_defaults(
    parser: argparse.ArgumentParser, cases: typing.Mapping[str, typing.Mapping[str, Any]]
) -> None:
    """Say in ``--help`` what a default that depends on other flags resolves to: ``cases``
    maps a situation (``"the built-in digits"``) to the defaults the script fills in then;
    each flag's help ends with ``(default: resnest14 with the built-in digits, resnest50
    with --data-dir)``. Flags whose default is the same in every case get it once."""
    for dest in dict.fromkeys(k for defaults in cases.values() for k in defaults):
        action = next((a for a in parser._actions if a.dest == dest and a.option_strings), None)
        if action is None:
            continue
        values = {case: defaults[dest] for case, defaults in cases.items() if dest in defaults}
        if len(set(map(repr, values.values()))) == 1:
            text = f"default: {_show(next(iter(values.values())))}"
        else:
            text = "default: " + ", ".join(f"{_show(v)} {case}" for case, v in values.items())
        action.help = f"{action.help} ({text})" if action.help else text


def _brief_help(action: argparse.Action) -> argparse.Action:
    """``action`` with its ``brief_help`` (a shorter text for ``--help``), if it has one."""
    short = getattr(action, "brief_help", None)
    if short is None:
        return action
    action = copy.copy(action)
    action.help = short
    return action


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with the conventions every script shares.

    * No abbreviations: an unknown option is an error, never a prefix of another one
      (``--mode hybrid`` is not ``--model hybrid``).
    * One vocabulary, dashed names: ``--max_seq_length`` is accepted for
      ``--max-seq-length`` (GluonCV and GluonNLP spell their flags both ways).
    * :meth:`add_mxnet_options`: MXNet-only options (``--num-gpus``, ``--gpus``, ...) are
      accepted, and a one-line note says what they mean here.
    * A short ``--help`` (each group's main flags, marked by :func:`brief`, the others by
      name), ``--help-all`` for every flag, ``--print-config`` (:meth:`finish` and
      :func:`print_config`: print the resolved flags and stop) and ``--debug`` (tracebacks of
      expected errors, :func:`run_main`).
    * A usage error is one line and a pointer to ``--help``, not the usage of every flag.
    * :meth:`check`: every float flag finite, the shared flags in range (:data:`BOUNDS`), the
      optimizer, schedule and combiner flags consistent, in the flags' own terms.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        if kwargs.get("formatter_class") in (None, argparse.ArgumentDefaultsHelpFormatter):
            kwargs["formatter_class"] = _HelpFormatter
        kwargs["add_help"] = False
        super().__init__(*args, **kwargs)
        self._mxnet: dict[str, str] = {}
        g = self._help_group = self.add_argument_group("help and errors")
        g.add_argument("-h", "--help", action=_HelpAction, help="the main flags of each group")
        g.add_argument("--help-all", action=_HelpAction, full=True, help="every flag")
        g.add_argument(
            "--print-config",
            action="store_true",
            default=argparse.SUPPRESS,
            help="print the flags as this run resolves them (the defaults that depend on "
            "other flags filled in) after checking them, and stop",
        )
        g.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show the traceback of an error about flags or data, too",
        )
        brief(self, "--help", "--help-all", "--print-config", "--debug")

    # -- help and errors ------------------------------------------------------------------------
    def format_usage(self) -> str:
        formatter = self._get_formatter()
        formatter.add_usage(self._short_usage(), self._actions, [])
        return formatter.format_help()

    def _short_usage(self) -> str:
        if self.usage is not None:
            return self.usage
        positionals = [a for a in self._actions if not a.option_strings]
        names = [self._get_formatter()._format_args(a, a.dest) for a in positionals]
        return " ".join(["%(prog)s [flags]", *names])

    def format_help(self) -> str:
        """The short help: each group's :func:`brief` flags, the others by name."""
        formatter = self._get_formatter()
        formatter.add_usage(self._short_usage(), self._actions, [])
        formatter.add_text(self.description)
        for group in self._groups_help_last():
            actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS]
            if not actions:
                continue
            shown = [a for a in actions if getattr(a, "brief", False) or not a.option_strings]
            rest = [a for a in actions if a not in shown]
            formatter.start_section(group.title)
            formatter.add_arguments([_brief_help(a) for a in shown])
            if rest:
                names = [next(s for s in a.option_strings if s.startswith("--")) for a in rest]
                more = f" and {len(names) - 12} more" if len(names) > 14 else ""
                names = names[:12] if more else names
                formatter.add_text(("also: " if shown else "") + ", ".join(names) + more)
            formatter.end_section()
        formatter.add_text(
            "--help-all describes every flag; --print-config shows the values a run would use"
        )
        return formatter.format_help()

    def _groups_help_last(self) -> list[Any]:
        helps = [g for g in self._action_groups if g is self._help_group]
        return [g for g in self._action_groups if g is not self._help_group] + helps

    def format_help_all(self) -> str:
        """Every flag with its help text and default (argparse's help, a short usage line)."""
        formatter = self._get_formatter()
        formatter.add_usage(self._short_usage(), self._actions, [])
        formatter.add_text(self.description)
        for group in self._groups_help_last():
            formatter.start_section(group.title)
            formatter.add_text(group.description)
            formatter.add_arguments(group._group_actions)
            formatter.end_section()
        formatter.add_text(self.epilog)
        return formatter.format_help()

    def error(self, message: str) -> typing.NoReturn:
        """One line naming what is wrong, one pointing to ``--help``; exit status 2."""
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: see --help for the flags\n")

    # -- checks and --print-config --------------------------------------------------------------
    def flag_of(self, dest: str) -> str:
        """The command-line name of the argument stored in ``dest``."""
        for action in self._actions:
            if action.dest == dest and action.option_strings:
                return next((s for s in action.option_strings if s.startswith("--")),
                            action.option_strings[0])  # fmt: skip
        return "--" + dest.replace("_", "-")

    def check(
        self, args: argparse.Namespace, bounds: typing.Mapping[str, Bound] | None = None
    ) -> None:
        """Refuse (one line, exit 2) a float flag that is not finite, a value out of its
        :class:`Bound` (:data:`BOUNDS`, then ``bounds``: the script's own), and optimizer,
        schedule or combiner flags that do not go together. Call it after the script has
        filled in the defaults that depend on other flags."""
        for action in self._actions:
            value = getattr(args, action.dest, None)
            if action.type is float and isinstance(value, float) and not math.isfinite(value):
                self.error(f"{self.flag_of(action.dest)} {value}: give a finite number")
        for dest, bound in {**BOUNDS, **(bounds or {})}.items():
            value = getattr(args, dest, None)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and not bound.contains(value):
                self.error(f"{self.flag_of(dest)} {_num(value)}: must be {bound}")
        try:
            if hasattr(args, "optimizer") and hasattr(args, "beta1"):
                if args.optimizer not in list_optimizers():
                    known = ", ".join(list_optimizers())
                    self.error(f"--optimizer {args.optimizer}: choose one of {known}")
                optimizer_config(args)
            if hasattr(args, "lr_mode"):
                _decay_epochs(args.lr_decay_epoch)
                self._check_warmup(args)
            if hasattr(args, "grad_combine") and hasattr(args, "inject_straggler"):
                combiner_config(args)
        except ValueError as err:
            self.error(str(err))

    def _check_warmup(self, args: argparse.Namespace) -> None:
        """``--warmup-epochs`` (+ ``--const-epochs``) fit in ``--num-epochs``, in epochs."""
        epochs = getattr(args, "num_epochs", None)
        warmup, const = float(args.warmup_epochs or 0), float(args.const_epochs or 0)
        if epochs and warmup + const > epochs:
            plus = f" + --const-epochs {const:g}" if const else ""
            self.error(
                f"--warmup-epochs {warmup:g}{plus} is longer than --num-epochs {epochs}: "
                "shorten the warmup or train longer"
            )

    def finish(self, args: argparse.Namespace) -> argparse.Namespace:
        """``args``; with ``--print-config``, ``args.print_config`` becomes the text
        :func:`print_config` prints (the run never starts, so no header records it). Call it
        last in ``parse_args``, once the defaults are resolved and the flags checked."""
        if getattr(args, "print_config", False):
            args.print_config = self.format_config(args)
        return args

    def format_config(self, args: argparse.Namespace) -> str:
        """The flags of ``args`` by group, one ``--flag value`` a line (MXNet options only when
        given); values the script derived from the flags last."""
        lines = [f"# {self.prog}: the flags as this run resolves them (--print-config)"]
        seen = {"help", "print_config", "debug"}
        for group in self._action_groups:
            rows = []
            for action in group._group_actions:
                dest = action.dest
                if dest in seen or not action.option_strings or not hasattr(args, dest):
                    continue
                seen.add(dest)
                value = getattr(args, dest)
                unset_mxnet = dest.startswith("mxnet_") and value in (None, False)
                if unset_mxnet or action.help == argparse.SUPPRESS:
                    continue
                rows.append((self.flag_of(action.dest), _show(value)))
            if rows:
                lines.append(f"{group.title}:")
                width = max(len(flag) for flag, _ in rows)
                lines.extend(f"  {flag:<{width}}  {value}" for flag, value in rows)
        derived = [(k, _show(v)) for k, v in sorted(vars(args).items()) if k not in seen]
        derived = [(k, v) for k, v in derived if not k.startswith("mxnet_")]
        if derived:
            lines.append("derived from the flags:")
            width = max(len(k) for k, _ in derived)
            lines.extend(f"  {k:<{width}}  {v}" for k, v in derived)
        return "\n".join(lines) + "\n"

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


# ---- checking flags before any work ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Bound:
    """The values a numeric flag takes: ``low <= value <= high`` (``<`` on an open side);
    ``str(bound)`` says it the way the error message does (``>= 1``, ``in [0, 1)``)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        low, high = _num(self.low), _num(self.high)
        if self.high is None:
            return f"> {low}" if self.low_open else f">= {low}"
        if self.low is None:
            return f"< {high}" if self.high_open else f"<= {high}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


def _num(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


_PROBABILITY = Bound(0, 1, high_open=True)
#: The shared flags' ranges (by ``dest``), checked by :meth:`ArgumentParser.check` when a script
#: has the flag; a script adds its own with ``check(args, bounds={...})``.
BOUNDS: dict[str, Bound] = {
    "lr": Bound(0), "wd": Bound(0), "momentum": _PROBABILITY, "beta1": _PROBABILITY,
    "beta2": _PROBABILITY, "epsilon": Bound(0, low_open=True), "max_grad_norm": Bound(0),
    "warmup_lr": Bound(0), "warmup_epochs": Bound(0), "const_epochs": Bound(0),
    "final_lr": Bound(0), "lr_decay": Bound(0, low_open=True),
    "lr_decay_power": Bound(0, low_open=True),
    "batch_size": Bound(1), "accumulate": Bound(1), "num_epochs": Bound(1), "epochs": Bound(1),
    "max_steps": Bound(1), "log_interval": Bound(0), "num_workers": Bound(0),
    "seed": Bound(0, 2**32 - 1), "dropout": _PROBABILITY,
    "elastic_checkpoint_steps": Bound(1), "elastic_ramp_steps": Bound(0),
    "tensor_parallel": Bound(1), "pipeline_parallel": Bound(1), "micro_batches": Bound(1),
    "skip_nonfinite": Bound(0),
}  # fmt: skip


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) if value else "(none)"
    return "(unset)" if value is None else str(value)


def _decay_epochs(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(e) for e in text.split(",") if e.strip())
    except ValueError:
        raise ValueError(
            f"--lr-decay-epoch {text!r}: expected epochs separated by commas, e.g. 40,60"
        ) from None


def print_config(args: argparse.Namespace) -> bool:
    """With ``--print-config``: print the flags as the run resolves them
    (:meth:`ArgumentParser.finish`) and return True: the script stops there, after its checks
    and before any work."""
    text = getattr(args, "print_config", None)
    if not text:
        return False
    print(text if isinstance(text, str) else "", end="")
    return True


def run_main(
    main: Callable[[list[str] | None], int | None],
    argv: Sequence[str] | None = None,
    *,
    expected: tuple[type[BaseException], ...] = (),
) -> int:
    """Run a script's ``main`` with the one error path every script shares.

    An expected error -- :class:`~trainers.errors.UsageError`, ``SystemExit("message")`` (the
    scripts' older convention) or one of ``expected`` (e.g. a download that failed) -- prints
    ``<script>: error: <message>`` on stderr and returns 2, after the run logs this process
    started and that hold no training record yet are removed
    (:func:`trainers.logs.discard_unstarted_logs`). ``--debug`` prints the traceback first.
    Anything else is a bug: it propagates with its traceback. Use it as
    ``sys.exit(run_main(main))``.
    """
    given = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in split_command(given)[0]
    prog = Path(sys.argv[0]).name or "script"
    try:
        status = main(None if argv is None else given)
    except SystemExit as err:
        if err.code is None or isinstance(err.code, int):
            raise  # argparse's exits (its message is printed), sys.exit(N)
        message = str(err.code)
        trace = traceback.format_exc() if debug else ""
    except (UsageError, *expected) as err:
        message = str(err)
        trace = traceback.format_exc() if debug else ""
    else:
        return int(status or 0)
    discard_unstarted_logs()
    message = re.sub(r"^[\w.-]+: error: ", "", message.strip())
    print(f"{trace}{prog}: error: {message}", file=sys.stderr, flush=True)
    return 2


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
    brief(parser, "--optimizer", "--lr", "--wd")


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
        brief(parser, "--tensor-parallel")
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
    brief(parser, "--pipeline-parallel")


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
