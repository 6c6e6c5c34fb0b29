"""Run logs: one JSON Lines file per run plus GluonCV-style console lines (rank 0 only).

The record kinds and fields are specified in ``docs/run_logs.md``: ``header`` first, then
``step`` / ``epoch`` / ``eval`` / ``checkpoint`` / ``membership`` records, ``end`` last. Each
line is flushed as soon as it is written, so a crashed run keeps every record up to the
crash. The console shows the same numbers in the format GluonCV users know::

    Epoch[0] Batch [49]	Speed: 1293.07 samples/sec	loss=1.234567	accuracy=0.817100	lr=0.003133
    [Epoch 0] training: loss=1.102345 accuracy=0.664033
    [Epoch 0] speed: 4456 samples/sec	time cost: 297.58
    [Epoch 0] validation: top1=0.908084 top5=0.771923
    Training time for 1 epochs: 301.20 sec.

Metrics print with six decimals (GluonCV's ``%f``), the per-batch speed with two.
Non-finite floats are written as JSON ``null`` (JSON has no NaN) and print as ``nan``/``inf``.

Example:
    >>> logger = RunLogger("runs/r1.jsonl", enabled=env.is_main, logging_file="runs/r1.log")
    >>> logger.header(make_header(sys.argv, seed=0, world_size=env.world_size, config=args))
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import shutil
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from .fingerprint import (
    ISA_PIN_VARIABLES,
    PORTABLE_CPU_PINS,
    PORTABLE_EXACT_PINS,
    PORTABLE_MODE_VERSIONS,
    PORTABLE_ONEDNN_PINS,
    cpu_info,
    machine_fingerprint,
    not_comparable_reason,
)

__all__ = [
    "ISA_PIN_VARIABLES",
    "PORTABLE_CPU_PINS",
    "PORTABLE_EXACT_PINS",
    "PORTABLE_MODE_VERSIONS",
    "PORTABLE_ONEDNN_PINS",
    "PhasedRunLogger",
    "RunLogError",
    "RunLogger",
    "gluonnlp_step_line",
    "cpu_info",
    "discard_unstarted_logs",
    "format_metrics",
    "machine_fingerprint",
    "not_comparable_reason",
    "read_run_log",
    "make_header",
    "progress_bar",
    "ratio_metrics",
]

_T = TypeVar("_T")
_REPO_ROOT = Path(__file__).resolve().parents[1]
_DISTRIBUTION = "modelzoo-trainers-pt"


# -- values -----------------------------------------------------------------------------------
def _to_json(value: Any) -> Any:
    """Plain JSON types: tensors/numpy scalars become numbers, NaN/inf become null."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def _fmt(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, (bool, str)):
        return str(value)
    try:
        return f"{float(value):.6f}"
    except (TypeError, ValueError):
        return str(value)


def format_metrics(metrics: Mapping[str, Any], sep: str = " ") -> str:
    """``name=value`` pairs with six decimals, joined by ``sep``."""
    return sep.join(f"{name}={_fmt(value)}" for name, value in metrics.items())


def _relative_command(command: Sequence[str]) -> list[str]:
    """``sys.argv`` with the script path made relative to the repository root if inside it."""
    args = [str(a) for a in command]
    if args:
        script = Path(args[0])
        with contextlib.suppress(ValueError, OSError):
            args[0] = script.resolve().relative_to(_REPO_ROOT).as_posix()
    return args


def _config_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, argparse.Namespace):
        config = vars(config)
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be an argparse.Namespace, a dataclass or a mapping, got {type(config).__name__}"
        )
    return {str(k): _to_json(v) for k, v in config.items()}


def make_header(
    command: Sequence[str],
    seed: int,
    world_size: int,
    config: Any = None,
    *,
    configs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``header`` record of docs/run_logs.md.

    Args:
        command: ``sys.argv``; the script path is made relative to the repository root.
        seed: the run seed.
        world_size: number of ranks.
        config: all parsed flags (``argparse.Namespace``, dataclass or mapping).
        configs: the typed configs of the run by name (:mod:`trainers.config`; e.g.
            :func:`trainers.cli.run_configs`), recorded as plain JSON under ``"configs"``.
    """
    from .config import configs_record

    fingerprint = machine_fingerprint(world_size)
    header = {
        "kind": "header",
        "command": _relative_command(command),
        "seed": int(seed),
        "world_size": int(world_size),
        "fingerprint": fingerprint,
        "git": fingerprint["git"]["commit"],
        "config": _config_dict(config),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if configs:
        header["configs"] = configs_record(**configs)
    network = _lab_network()
    if network is not None:
        header["network"] = network
    return header


def _lab_network() -> dict[str, Any] | None:
    """The lab network a job ran on (``python -m trainers.netlab run`` sets the variables):
    node count and each node's cap. ``None`` outside a lab."""
    nodes = os.environ.get("MODELZOO_NETLAB_NODES")
    if not nodes:
        return None
    caps = os.environ.get("MODELZOO_NETLAB_CAPS", "")
    return {"netlab": True, "nodes": int(nodes), "caps": caps.split(",") if caps else []}


# -- progress bar -----------------------------------------------------------------------------
def progress_bar(
    iterable: Iterable[_T],
    *,
    total: int | None = None,
    desc: str | None = None,
    enabled: bool = True,
) -> Iterable[_T]:
    """A tqdm bar on stderr when ``enabled`` (pass ``env.is_main``) and stderr is a terminal.

    Otherwise the iterable itself: CI logs and redirected output never get bar garbage.
    """
    if not enabled or not _isatty(sys.stderr):
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)


def _isatty(stream: IO[str] | None) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):
        return False


# -- the logger -------------------------------------------------------------------------------
class RunLogger:
    """Writes the JSONL run log and the console lines; silent when ``enabled`` is False.

    Args:
        path: the ``.jsonl`` file, or None for console only.
        enabled: pass ``env.is_main``: only rank 0 writes anything.
        console: print the GluonCV-style lines to stdout.
        logging_file: also append the console lines to this file (``--logging-file``).
        mode: ``"w"`` starts a new log, ``"a"`` appends (e.g. after a restart).
        step_line: the console line of a ``step`` record (default GluonCV's; e.g.
            :func:`gluonnlp_step_line`); only the console changes, never the record.
        tensorboard: also write the records as TensorBoard scalars to this directory
            (``--tensorboard``, :class:`trainers.tensorboard.TensorBoardSink`); checked on
            every rank (a missing ``tensorboard`` package raises ImportError everywhere),
            written on rank 0 only.

    Sinks (:meth:`add_sink`) get every record the logger writes, after the JSONL file.

    A run that stops with an expected error (a bad flag, missing data) before its first
    training record leaves no log behind: :meth:`discard` (called for every open logger by
    :func:`discard_unstarted_logs`, which :func:`trainers.cli.run_main` calls) removes the files
    this logger created -- the ``.jsonl`` it started (``mode="w"``; an appended log,
    ``mode="a"``, is never removed), the ``logging_file`` if it did not exist, and the folders
    made for them if empty, and a ``tensorboard`` folder it made (with its event files).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        enabled: bool = True,
        console: bool = True,
        logging_file: str | os.PathLike[str] | None = None,
        mode: str = "w",
        step_line: Callable[[Mapping[str, Any]], str] | None = None,
        tensorboard: str | os.PathLike[str] | None = None,
    ) -> None:
        if mode not in ("w", "a"):
            raise ValueError(f"mode must be 'w' or 'a', got {mode!r}")
        self._sinks: list[Any] = []
        if tensorboard is not None:
            from .tensorboard import TensorBoardSink, require_tensorboard

            require_tensorboard()  # every rank fails alike, before any file is opened
        self.enabled = enabled
        self.step_line = step_line
        self.console = console and enabled
        self.path = Path(path) if path is not None else None
        self._file: IO[str] | None = None
        self._console_file: IO[str] | None = None
        self._own = _Created(weakref.ref(self))  # what discard() may remove
        if enabled and self.path is not None:
            self._make_parents(self.path)
            self._file = open(self.path, mode, encoding="utf-8")  # noqa: SIM115 (closed in close())
            if mode == "w":
                self._own.paths.insert(0, self.path)
        if enabled and logging_file is not None:
            console_path = Path(logging_file)
            self._make_parents(console_path)
            existed = console_path.exists()
            self._console_file = open(console_path, "a", encoding="utf-8")  # noqa: SIM115
            if not existed:
                self._own.paths.insert(0, console_path)
        if enabled and tensorboard is not None:
            board = Path(tensorboard)
            if not board.exists():  # the writer makes it and its event file at once
                self._make_parents(board)
                self._own.trees.append(board)
            self.add_sink(TensorBoardSink(tensorboard))
        if self._own.paths or self._own.trees:
            _CREATED.append(self._own)

    def take_over(self) -> None:
        """Start writing on a rank that was not rank 0 when the logger was made (the group
        was re-formed in process and this rank is the new rank 0): append to the run log,
        after dropping a line the previous writer left half-written."""
        if self.enabled:
            return
        self.enabled = True
        if self.path is not None:
            from .elastic import repair_run_log  # noqa: PLC0415 (elastic imports this module)

            repair_run_log(self.path)
            self._make_parents(self.path)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (close())

    def release(self) -> None:
        """Stop writing (the group was re-formed in process and this rank is no longer rank
        0: the new rank 0 has taken the run log over)."""
        for f in (self._file, self._console_file):
            if f is not None:
                f.close()
        self._file = self._console_file = None
        self.enabled = self.console = False

    def _make_parents(self, path: Path) -> None:
        missing = [p for p in path.parents if not p.exists()]
        path.parent.mkdir(parents=True, exist_ok=True)
        self._own.paths.extend(missing)

    def discard(self) -> None:
        """Close; if no training record was written yet, remove the files and folders this
        logger created (never a log it appended to, nor a non-empty folder)."""
        self.close()
        self._own.remove()

    def add_sink(self, sink: Any) -> None:
        """Forward every record from now on to ``sink.write(record)`` (plain JSON values, as
        in the file); ``sink.close()`` is called by :meth:`close`. Ignored when the logger is
        disabled: create sinks on rank 0 only."""
        if self.enabled:
            self._sinks.append(sink)

    # -- low level ----------------------------------------------------------------------------
    def write(self, record: Mapping[str, Any]) -> None:
        """Append one JSON record (must have a ``kind``) and flush it; then the sinks."""
        if self._file is None and not self._sinks:
            return
        if "kind" not in record:
            raise ValueError(f"run-log records need a 'kind', got keys {sorted(record)}")
        if record["kind"] != "header":
            self._own.started = True
        plain = _to_json(dict(record))
        if self._file is not None:
            line = json.dumps(plain, allow_nan=False, separators=(", ", ": "))
            self._file.write(line + "\n")
            self._file.flush()
        for sink in self._sinks:
            sink.write(plain)

    def info(self, line: str) -> None:
        """Print a console line (and tee it to the logging file)."""
        if not self.enabled:
            return
        if self.console:
            tqdm.write(line, file=sys.stdout)  # keeps a rank-0 progress bar intact
            sys.stdout.flush()
        if self._console_file is not None:
            self._console_file.write(line + "\n")
            self._console_file.flush()

    def close(self) -> None:
        for f in (self._file, self._console_file):
            if f is not None:
                f.close()
        self._file = self._console_file = None
        if self._own.started:  # a log with training records is never discarded
            with contextlib.suppress(ValueError):
                _CREATED.remove(self._own)
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- records ------------------------------------------------------------------------------
    def header(self, header: Mapping[str, Any]) -> None:
        """Write the header record (see :func:`make_header`). Nothing is printed: the header
        holds the configuration (a script's ``--print-config`` prints it readably)."""
        self.write(header)

    def step(
        self,
        *,
        epoch: int,
        batch: int,
        step: int,
        loss: float,
        lr: float,
        samples_per_sec: float,
        **metrics: Any,
    ) -> None:
        """A ``step`` record; ``batch`` is the 0-based index within the epoch."""
        record = {
            "kind": "step",
            "epoch": epoch,
            "batch": batch,
            "step": step,
            "loss": loss,
            "lr": lr,
            "samples_per_sec": samples_per_sec,
            **metrics,
        }
        self.write(record)
        if self.step_line is not None:
            self.info(self.step_line(record))
            return
        parts = [
            f"Epoch[{epoch}] Batch [{batch}]",
            f"Speed: {float(samples_per_sec):.2f} samples/sec",
        ]
        parts.append(format_metrics({"loss": loss, **metrics}, sep="\t"))
        parts.append(f"lr={_fmt(lr)}")
        self.info("\t".join(parts))

    def epoch(
        self, *, epoch: int, loss: float, samples_per_sec: float, time_cost: float, **metrics: Any
    ) -> None:
        """An ``epoch`` record: the epoch's training means, speed and time."""
        self.write(
            {
                "kind": "epoch",
                "epoch": epoch,
                "loss": loss,
                "samples_per_sec": samples_per_sec,
                "time_cost": time_cost,
                **metrics,
            }
        )
        self.info(f"[Epoch {epoch}] training: {format_metrics({'loss': loss, **metrics})}")
        self.info(
            f"[Epoch {epoch}] speed: {int(samples_per_sec)} samples/sec\ttime cost: {time_cost:.2f}"
        )

    def eval(self, *, epoch: int, step: int, **metrics: Any) -> None:
        """An ``eval`` record."""
        self.write({"kind": "eval", "epoch": epoch, "step": step, **metrics})
        self.info(f"[Epoch {epoch}] validation: {format_metrics(metrics)}")

    def checkpoint(self, *, epoch: int, step: int, path: str | os.PathLike[str]) -> None:
        """A ``checkpoint`` record, after the file is in place."""
        self.write({"kind": "checkpoint", "epoch": epoch, "step": step, "path": os.fspath(path)})
        self.info(f"[Epoch {epoch}] saved checkpoint {os.fspath(path)} at step {step}")

    def membership(
        self, *, step: int, old_world_size: int, new_world_size: int, **extra: Any
    ) -> None:
        """A ``membership`` record (elastic world-size change)."""
        self.write(
            {
                "kind": "membership",
                "step": step,
                "old_world_size": old_world_size,
                "new_world_size": new_world_size,
                **extra,
            }
        )
        self.info(f"[Step {step}] world size changed: {old_world_size} -> {new_world_size}")

    def end(self, *, total_time: float, steps: int, epochs: int, **metrics: Any) -> None:
        """The ``end`` record (last line) with the final metrics."""
        self.write(
            {"kind": "end", "total_time": total_time, "steps": steps, "epochs": epochs, **metrics}
        )
        self.info(f"Training time for {epochs} epochs: {total_time:.2f} sec.")


@dataclasses.dataclass(eq=False)
class _Created:
    """The files (then the folders made for them) one :class:`RunLogger` created, and whether
    it has written a training record. Kept apart from the logger, which may be gone (its
    frame unwound by the error) when :func:`discard_unstarted_logs` runs."""

    logger: weakref.ref[RunLogger]
    paths: list[Path] = dataclasses.field(default_factory=list)
    trees: list[Path] = dataclasses.field(default_factory=list)  # made whole: rmtree
    started: bool = False

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            _CREATED.remove(self)
        logger = self.logger()
        if logger is not None:
            logger.close()
        if self.started:
            return
        for tree in self.trees:  # a TensorBoard folder this logger made, with its events
            shutil.rmtree(tree, ignore_errors=True)
        self.trees = []
        files = [p for p in self.paths if not p.is_dir()]
        folders = sorted(set(self.paths) - set(files), key=lambda p: -len(p.parts))
        for path in files + folders:  # the innermost folders first
            with contextlib.suppress(OSError):
                if path in files:
                    path.unlink()
                else:
                    path.rmdir()  # only if empty
        self.paths = []


_CREATED: list[_Created] = []


def discard_unstarted_logs() -> None:
    """:meth:`RunLogger.discard` every logger of this process that created a file: a run that
    fails with an expected error before training leaves no partial log (logs with training
    records are kept: they show where the run stopped)."""
    for created in list(_CREATED):
        created.remove()


def gluonnlp_step_line(batches_per_epoch: int) -> Callable[[Mapping[str, Any]], str]:
    """GluonNLP's fine-tuning console line for a step record (``RunLogger(step_line=...)``)::

    Epoch: 0, Batch: 5/42, Loss=4.8437, lr=0.0000500 Thoughput=9.87 samples/s
    """

    def line(r: Mapping[str, Any]) -> str:
        return (
            f"Epoch: {r['epoch']}, Batch: {r['batch'] + 1}/{batches_per_epoch}, "
            f"Loss={r['loss']:.4f}, lr={r['lr']:.7f} Thoughput={r['samples_per_sec']:.2f} samples/s"
        )

    return line


def ratio_metrics(
    metrics: Mapping[str, Any], ratios: Mapping[str, tuple[str, str]]
) -> dict[str, Any]:
    """Replace sums by their ratios: ``ratios = {"accuracy": ("correct", "count")}`` turns
    ``{"correct": 30, "count": 40}`` into ``{"accuracy": 0.75}`` (NaN for a zero count).

    The trainer divides every reported sum by the same number of micro-batches (and ranks),
    so the ratio of two reported means is the exact ratio of the totals. Other fields pass
    through; a ratio whose two sums are not both present is left out.
    """
    raw = {k for pair in ratios.values() for k in pair}
    out = {k: v for k, v in metrics.items() if k not in raw}
    for name, (num, den) in ratios.items():
        if num in metrics and den in metrics:
            out[name] = metrics[num] / metrics[den] if metrics[den] else math.nan
    return out


class PhasedRunLogger(RunLogger):
    """One run log over several training phases (BERT pretraining's sequence lengths, a
    curriculum, ...), each phase a separate :meth:`Trainer.fit <trainers.Trainer.fit>`.

    * every ``step`` / ``epoch`` / ``eval`` / ``checkpoint`` record carries its ``phase``;
    * steps count across phases (a phase's trainer counts from 0; ``step_offset`` adds the
      optimizer steps of the phases before it);
    * sums reported by the task become ratios (:func:`ratio_metrics`, ``ratios=``);
    * a phase's end (the trainer's :meth:`end`) is printed and kept in ``phase_results``;
      the run's one ``end`` record is :meth:`finish`.

    Call :meth:`start_phase` before each phase's ``fit``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        ratios: Mapping[str, tuple[str, str]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(path, **kwargs)
        self.ratios = dict(ratios or {})
        self.phase = 1
        self.step_offset = 0
        self.trainer: Any = None
        self.phase_results: dict[int, dict[str, Any]] = {}

    def start_phase(self, phase: int, step_offset: int, trainer: Any = None) -> None:
        """Records from now on belong to ``phase``; its step 0 is run step ``step_offset``;
        ``trainer`` (the phase's) supplies the step of ``epoch`` records."""
        self.phase, self.step_offset, self.trainer = phase, step_offset, trainer

    def step(self, *, step: int, **fields: Any) -> None:  # type: ignore[override]
        metrics = ratio_metrics(fields, self.ratios)
        super().step(step=step + self.step_offset, phase=self.phase, **metrics)

    def epoch(self, **fields: Any) -> None:  # type: ignore[override]
        step = self.step_offset + (self.trainer.global_step if self.trainer is not None else 0)
        super().epoch(**ratio_metrics(fields, self.ratios), phase=self.phase, step=step)

    def eval(self, *, epoch: int, step: int, **metrics: Any) -> None:
        metrics = ratio_metrics(metrics, self.ratios)
        super().eval(epoch=epoch, step=step + self.step_offset, phase=self.phase, **metrics)

    def checkpoint(self, *, epoch: int, step: int, path: str | os.PathLike[str]) -> None:
        super().checkpoint(epoch=epoch, step=step + self.step_offset, path=path)

    def end(self, *, total_time: float, steps: int, epochs: int, **metrics: Any) -> None:
        """A phase's end: printed and kept; the run's ``end`` record is :meth:`finish`."""
        self.phase_results[self.phase] = {
            "time": total_time, "steps": steps, **ratio_metrics(metrics, self.ratios)
        }  # fmt: skip
        self.info(f"[Phase {self.phase}] {steps} steps in {total_time:.2f} sec.")

    def finish(self, *, total_time: float, steps: int, **metrics: Any) -> None:
        """The run's ``end`` record (steps over all phases, the final metrics as ratios)."""
        super().end(
            total_time=total_time, steps=steps, epochs=0, **ratio_metrics(metrics, self.ratios)
        )


# -- reading ----------------------------------------------------------------------------------
class RunLogError(ValueError):
    """A run log that cannot be read (missing, not JSON Lines, or no header first)."""


def read_run_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a JSON Lines run log; the first record must be the header.

    Raises:
        RunLogError: missing file, bad JSON (with the line number), or no header first.
    """
    path = Path(path)
    if not path.is_file():
        raise RunLogError(f"no such run log: {path}")
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise RunLogError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(record, dict) or "kind" not in record:
                raise RunLogError(f"{path}:{lineno}: a record must be a JSON object with a 'kind'")
            records.append(record)
    if not records:
        raise RunLogError(f"{path} is empty; a run log starts with a header record")
    if records[0]["kind"] != "header":
        raise RunLogError(
            f"{path} does not start with a header record (the first record has kind "
            f"{records[0]['kind']!r}); is it a run log?"
        )
    return records
