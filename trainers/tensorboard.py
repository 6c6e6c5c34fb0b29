"""TensorBoard scalars from the run-log records (``--tensorboard DIR``).

A :class:`TensorBoardSink` is attached to a :class:`~trainers.logs.RunLogger`
(``RunLogger(..., tensorboard=DIR)`` or :meth:`RunLogger.add_sink
<trainers.logs.RunLogger.add_sink>`), which forwards it every record it writes, so every
script that logs gets TensorBoard curves with the same numbers as its JSON Lines log. Only
rank 0 writes (the logger is disabled elsewhere). The scalars, by record kind:

* ``step`` records: ``train/<field>`` (loss, lr, samples_per_sec, every metric, the
  combiner's ``bytes_sent`` ...) at the record's ``step``, the global optimizer step;
* ``eval`` records: ``eval/<field>`` (``eval/top1``, ``eval/ema_top1``) at their ``step``;
* ``epoch`` records: ``epoch/<field>`` at their ``step`` where they carry one (pretraining,
  linear), else at the epoch number (the Trainer's epoch records);
* ``membership`` records: ``membership/world_size`` at their ``step``;
* the ``end`` record: ``end/<field>``, the final metrics, at its ``steps``.

Every numeric field becomes a scalar (booleans, strings and nulls do not); the fields that
locate a record (``kind``, ``epoch``, ``batch``, ``step``, ``phase``, ...) are not scalars
of their own. The header's command is written as text. Values are those of the JSON Lines
record; TensorBoard stores them as 32-bit floats.

Needs the ``tensorboard`` package: ``pip install "modelzoo-trainers-pt[tensorboard]"``.

Example:
    >>> logger = RunLogger("runs/r1.jsonl", enabled=env.is_main, tensorboard="runs/tb")
    >>> # tensorboard --logdir runs/tb
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["INSTALL_HINT", "TensorBoardSink", "require_tensorboard"]

INSTALL_HINT = 'pip install "modelzoo-trainers-pt[tensorboard]"'

# kind -> (tag prefix, the field read as the x value, fields that are not scalars)
_LAYOUT: dict[str, tuple[str, str, frozenset[str]]] = {
    "step": ("train", "step", frozenset({"kind", "epoch", "batch", "step", "phase"})),
    "eval": ("eval", "step", frozenset({"kind", "epoch", "step", "phase"})),
    "epoch": ("epoch", "step", frozenset({"kind", "epoch", "step", "phase"})),
    "end": ("end", "steps", frozenset({"kind", "steps", "epochs"})),
}


def require_tensorboard() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or an ImportError that says what to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 (optional package)
    except ImportError as exc:
        raise ImportError(
            f"--tensorboard needs the tensorboard package, which is not installed: {INSTALL_HINT}"
        ) from exc
    return SummaryWriter


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TensorBoardSink:
    """Writes run-log records as TensorBoard scalars (see the module docstring).

    Args:
        log_dir: the event-file directory (``tensorboard --logdir`` it); created if missing.
        flush_secs: the writer's flush period; every record but ``step`` records is
            flushed at once.

    Raises:
        ImportError: the tensorboard package is missing (the message says what to install).
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, flush_secs: int = 10) -> None:
        writer_class = require_tensorboard()
        self.log_dir = os.fspath(log_dir)
        self.writer = writer_class(log_dir=self.log_dir, flush_secs=flush_secs)

    def write(self, record: Mapping[str, Any]) -> None:
        """Write one run-log record (plain JSON values, as the logger writes them)."""
        kind = record.get("kind")
        if kind == "header":
            command = record.get("command") or []
            self.writer.add_text("header/command", " ".join(str(a) for a in command), 0)
            self.writer.flush()
            return
        if kind == "membership":
            step = record.get("step")
            if _is_number(step) and _is_number(record.get("new_world_size")):
                self.writer.add_scalar(
                    "membership/world_size", record["new_world_size"], global_step=int(step)
                )
                self.writer.flush()
            return
        if kind not in _LAYOUT:
            return
        prefix, x_field, located_by = _LAYOUT[kind]
        x = record.get(x_field)
        if not _is_number(x) and kind == "epoch":
            x = record.get("epoch")  # a Trainer epoch record: no step, at its epoch number
        if not _is_number(x):
            return
        for name, value in record.items():
            if name in located_by or not _is_number(value):
                continue
            self.writer.add_scalar(f"{prefix}/{name}", value, global_step=int(x))
        if kind != "step":
            self.writer.flush()

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
