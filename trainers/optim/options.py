"""The options only some optimizers take (LAMB's and LANS's), each described once.

:class:`OptimizerOptions` is a frozen dataclass whose fields are the keyword arguments of
:func:`~trainers.optim.create_optimizer` that only some registered optimizers take. Each
field's metadata (:func:`option`) says which optimizers take it, its command-line flag, help
text and parser, as the combiners' options dataclasses do for ``--grad-combine``
(:mod:`trainers.comm`). From these fields :func:`trainers.cli.add_optimizer_args` generates
the flags, :func:`trainers.cli.optimizer_config` maps the flags given onto
``OptimizerConfig.options``, and ``scripts/make_optim_docs.py`` writes the table in
docs/optimizers.md. ``None`` is "not given: the optimizer's own default"; only the options
given reach the optimizer.

A ``bool`` field is a switch: ``--flag`` sets the option to ``sets`` (``--no-bias-correction``
sets ``bias_correction=False``), or with ``negatable`` ``--flag`` / ``--no-flag`` set it to
True / False. Any other field is a flag with a value, read by ``parse``; ``convert`` maps
that value to the option's (``--max-grad-norm 0`` turns the clip off: ``None``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["OptimizerOptions", "OptionField", "clamp_arg", "option", "option_fields"]


def option(
    takers: tuple[str, ...],
    *,
    help: str | Mapping[str, str],  # noqa: A002 - the argparse word
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    convert: Callable[[Any], Any] | None = None,
    sets: bool = True,
    negatable: bool = False,
) -> Any:
    """A field of :class:`OptimizerOptions`: the optimizers that take it and its flag.

    Args:
        takers: the registered optimizers whose builder takes this keyword argument.
        help: what the flag does; a mapping gives each optimizer its own text.
        flag: the command-line flag (default ``--<field-name-with-dashes>``); its name without
            the dashes is the parsed namespace's attribute.
        parse: the argparse ``type`` of a flag with a value (``None``: the text as given).
        metavar: the value's name in ``--help``.
        convert: flag value -> option value (default: the value as parsed).
        sets: a ``bool`` switch's option value when the flag is given.
        negatable: a ``bool`` option with ``--flag`` and ``--no-flag`` (unset: the default).
    """
    return dataclasses.field(
        default=None,
        metadata={
            "takers": tuple(takers),
            "help": help,
            "flag": flag,
            "parse": parse,
            "metavar": metavar,
            "convert": convert,
            "sets": sets,
            "negatable": negatable,
        },
    )


def clamp_arg(text: str) -> tuple[float | None, float | None]:
    """``"LOW,HIGH"`` -> ``(low, high)`` (argparse type); an empty side is unbounded
    (``"0.01,"``)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH (e.g. 0.01,10), got {text!r}")
    try:
        return tuple(float(v) if v.strip() else None for v in parts)  # type: ignore[return-value]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two numbers LOW,HIGH, got {text!r}") from None


def _positive_or_off(value: float) -> float | None:
    """``--max-grad-norm``: a norm > 0 clips, 0 (or less) turns the clip off."""
    return value if value > 0 else None


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """The options of :func:`~trainers.optim.create_optimizer` that only LAMB and LANS take
    (``None``: the optimizer's own default). Field order is the flags' order in ``--help``."""

    max_grad_norm: float | None = option(
        ("lamb", "lans"),
        parse=float,
        convert=_positive_or_off,
        help="clip the global gradient norm inside the optimizer (default 1.0; 0 turns it off)",
    )
    trust_clamp: tuple[float | None, float | None] | None = option(
        ("lamb", "lans"),
        parse=clamp_arg,
        metavar="LOW,HIGH",
        help="clamp the trust ratio (DeepSpeed: 0.01,10)",
    )
    weight_norm_clamp: tuple[float | None, float | None] | None = option(
        ("lamb", "lans"),
        parse=clamp_arg,
        metavar="LOW,HIGH",
        help="clamp ||w|| in the trust ratio (MXNet's lower_bound,upper_bound)",
    )
    bias_correction: bool | None = option(
        ("lamb", "lans"), flag="--no-bias-correction", sets=False, help="no Adam bias correction"
    )
    always_adapt: bool | None = option(
        ("lamb",), help="apply the trust ratio where the weight decay is 0 too"
    )
    adapt_no_wd: bool | None = option(
        ("lamb", "lans"),
        negatable=True,
        help="apply the trust ratio to the --no-wd parameters too (unset: the optimizer's "
        "default, lamb off, lans on; --no-adapt-no-wd turns it off for lans)",
    )
    use_nvlamb: bool | None = option(
        ("lamb",),
        help="apex's use_nvlamb, the trust ratio on every tensor (= --always-adapt --adapt-no-wd)",
    )
    variant: str | None = option(
        ("lamb", "lans"),
        flag="--optimizer-variant",
        metavar="NAME",
        help={
            "lamb": "apex (default) or deepspeed (DeepSpeed FusedLamb)",
            "lans": "gluonnlp (default, the authors' FusedLANS), mxnet or mxnet-sequential",
        },
    )


@dataclasses.dataclass(frozen=True)
class OptionField:
    """One field of :class:`OptimizerOptions` as a flag: what the CLI and the docs read."""

    name: str  # the optimizer's keyword argument
    flag: str
    takers: tuple[str, ...]
    text: str | Mapping[str, str]  # the help text (per optimizer: a mapping)
    switch: bool = False  # a bool option: the flag takes no value
    negatable: bool = False  # a switch with --no-<flag>
    sets: bool = True  # a plain switch's option value
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    convert: Callable[[Any], Any] | None = None

    @property
    def dest(self) -> str:
        """The parsed namespace's attribute."""
        return self.flag[2:].replace("-", "_")

    @property
    def flags(self) -> tuple[str, ...]:
        """The flag, and ``--no-<flag>`` for a negatable switch."""
        return (self.flag, "--no-" + self.flag[2:]) if self.negatable else (self.flag,)

    @property
    def help(self) -> str:
        """The help text, each part prefixed by the optimizers it is about (``lamb/lans: ...``)."""
        if isinstance(self.text, str):
            return f"{'/'.join(self.takers)}: {self.text}"
        return "; ".join(f"{name}: {part}" for name, part in self.text.items())

    def given(self, parsed: Any) -> bool:
        """Whether the flag was given, from its parsed value (an unset switch parses False)."""
        if self.switch and not self.negatable:
            return bool(parsed)
        return parsed is not None

    def value(self, parsed: Any) -> Any:
        """The option's value for a flag given with the parsed value ``parsed``."""
        if self.switch:
            return bool(parsed) if self.negatable else self.sets
        return parsed if self.convert is None else self.convert(parsed)

    def spelled(self, value: Any) -> str:
        """The flag as given for the option ``value`` (``--no-adapt-no-wd`` for False)."""
        return self.flags[-1] if self.negatable and not value else self.flag


def option_fields() -> list[OptionField]:
    """The fields of :class:`OptimizerOptions` in order, as flags."""
    hints = typing.get_type_hints(OptimizerOptions)
    out = []
    for f in dataclasses.fields(OptimizerOptions):
        meta = f.metadata
        out.append(
            OptionField(
                name=f.name,
                flag=meta["flag"] or "--" + f.name.replace("_", "-"),
                takers=meta["takers"],
                text=meta["help"],
                switch=bool in (hints[f.name], *typing.get_args(hints[f.name])),
                negatable=meta["negatable"],
                sets=meta["sets"],
                parse=meta["parse"],
                metavar=meta["metavar"],
                convert=meta["convert"],
            )
        )
    return out
