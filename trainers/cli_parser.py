"""The parser every training script uses, and the one error path they share.

:class:`ArgumentParser` is argparse with the scripts' conventions (no abbreviations, dashed
names, MXNet options accepted with a note, a short ``--help``, ``--help-all``,
``--print-config``, ``--debug``, one-line usage errors, and :meth:`ArgumentParser.check` of
every flag before any work); :data:`BOUNDS` are the shared flags' ranges; :func:`run_main`
runs a script's ``main`` with the one error path. The flag groups built on it (optimizer,
schedule, combiner, elastic, ...) are in :mod:`trainers.cli`, which re-exports these names.
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
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import UsageError
from .logs import discard_unstarted_logs

__all__ = [
    "BOUNDS",
    "MXNET_OPTIONS",
    "ArgumentParser",
    "Bound",
    "brief",
    "describe_defaults",
    "print_config",
    "run_main",
    "split_command",
]


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
        from .cli import check_flag_groups  # noqa: PLC0415 (the groups are built on this parser)

        try:
            check_flag_groups(args)
        except ValueError as err:
            self.error(str(err))

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
