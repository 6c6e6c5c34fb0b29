"""Atomic checkpoint files: a crash while saving never leaves a partial or corrupt checkpoint.

:func:`save_checkpoint` writes to a temporary file in the destination's directory, flushes
and fsyncs it, then ``os.replace``-s it over the destination (atomic on POSIX and Windows
for paths on one file system) and fsyncs the directory. A worker killed mid-save leaves the
previous checkpoint intact; an exception mid-save also removes the temporary file.

:func:`load_checkpoint` uses ``torch.load(..., weights_only=True)``: tensors, numbers,
strings, lists, tuples and dicts only, never arbitrary pickled objects. Keep checkpoint
states to those types (the trainer stores numpy/``random`` RNG states as plain lists).

:func:`save_checkpoint` never writes a non-finite state: a floating-point tensor anywhere in
it (weights, optimizer moments, EMA) holding a NaN or an infinity raises
:class:`~trainers.errors.NonFiniteError` naming that tensor, and nothing is written (the
previous checkpoint at that path stays).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from modelzoo.fileio import atomic_write, atomic_write_text

from ._dtensor import local_tensor
from .errors import NonFiniteError

__all__ = [
    "CheckpointError",
    "atomic_write",
    "atomic_write_text",
    "load_checkpoint",
    "nonfinite_tensor",
    "save_checkpoint",
]


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or not loadable."""


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically (temp file + fsync + ``os.replace``).

    Args:
        path: destination file; its directory is created if needed.
        state: what ``torch.save`` writes; keep it to tensors and plain Python containers so
            that :func:`load_checkpoint` can read it with ``weights_only=True``.

    Returns:
        The destination path.

    Raises:
        NonFiniteError: a floating-point tensor of ``state`` has a NaN or infinite value (the
            message names it); nothing is written.
    """
    bad = nonfinite_tensor(state)
    if bad is not None:
        raise NonFiniteError(
            f"refusing to write checkpoint {os.fspath(path)!r}: {bad} has a non-finite value "
            "(NaN or inf), so the training diverged; nothing was written. Lower the learning "
            "rate (--lr) or clip the gradients (--clip-grad-norm), and resume from an earlier "
            "checkpoint"
        )
    return atomic_write(path, lambda f: torch.save(state, f))


def nonfinite_tensor(state: Any) -> str | None:
    """Where the first floating-point tensor of ``state`` with a NaN or infinite value is
    (e.g. ``"model['fc.weight']"``), or ``None`` when every one is finite.

    ``state`` is searched through dicts, lists and tuples; one host sync per device.
    """
    found: list[tuple[str, torch.Tensor]] = []

    def walk(value: Any, where: str) -> None:
        if isinstance(value, torch.Tensor):
            value = local_tensor(value)
            if value.is_floating_point() or value.is_complex():
                found.append((where, value))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{where}[{key!r}]" if where else str(key))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]")

    walk(state, "")
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, tensor) in enumerate(found):
        by_device.setdefault(tensor.device, []).append(i)
    bad: list[int] = []
    for indices in by_device.values():
        with torch.no_grad():
            ok = torch.stack([torch.isfinite(found[i][1]).all() for i in indices]).tolist()
        bad += [i for i, finite in zip(indices, ok, strict=True) if not finite]
    return (found[min(bad)][0] or "the tensor") if bad else None


def load_checkpoint(
    path: str | os.PathLike[str], *, map_location: Any = "cpu", weights_only: bool = True
) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Args:
        path: the checkpoint file.
        map_location: passed to ``torch.load`` (default: every tensor on the CPU).
        weights_only: refuse arbitrary pickled objects (default). Pass ``False`` only for
            a file you trust that stores other types.

    Raises:
        CheckpointError: the file is missing, truncated, or holds objects that
            ``weights_only=True`` refuses; the message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not exist; check the path (a run writes "
            "'latest.pt' and 'epoch<N>.pt' in its --save-dir)"
        )
    try:
        state = torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds objects that weights_only=True refuses ({err}); "
            "load it with weights_only=False only if you trust the file"
        ) from err
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is truncated or corrupt ({type(err).__name__}: {err}); "
            "use an earlier checkpoint"
        ) from err
    if not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds a {type(state).__name__}, expected a dict"
        )
    return state
