"""The one atomic file writer of modelzoo and trainers: a failure never leaves a partial file.

:func:`atomic_write` fills a temporary file in the destination's directory, flushes and
fsyncs it, ``os.replace``-s it over the destination (atomic on POSIX and Windows for paths
on one file system) and fsyncs the directory. On any exception the temporary file is
removed and the destination keeps its previous content (or stays absent). Checkpoints,
claims, SQuAD predictions, pretraining shards, RecordIO files and exported weights all go
through it (``trainers.checkpoint`` re-exports it; trainers may import modelzoo, not the
other way round).

Example:
    >>> import json, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = atomic_write_text(d / "a.json", json.dumps({"x": 1}))
    >>> (d / "a.json").read_text()
    '{"x": 1}'
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "atomic_write_text", "fsync_directory"]


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a rename in ``directory`` durable; not every platform can open a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any], *, mode: int | None = None
) -> Path:
    """Create or replace ``path`` atomically with what ``write(f)`` writes to a binary file.

    Args:
        path: the destination; its directory is created if needed.
        write: fills the (binary) temporary file.
        mode: permission bits for the result (default: ``mkstemp``'s 0o600).

    Returns:
        The destination path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp_name, mode)
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    fsync_directory(path.parent)
    return path


def atomic_write_text(
    path: str | os.PathLike[str],
    text: str | Callable[[IO[str]], Any],
    *,
    encoding: str = "utf-8",
) -> Path:
    """:func:`atomic_write` of a text, or of what ``text(f)`` writes to a text file
    (``"\\n"`` line endings on every platform)."""
    if isinstance(text, str):
        data = text.encode(encoding)
        return atomic_write(path, lambda f: f.write(data))

    def write(f: IO[bytes]) -> None:
        wrapper = io.TextIOWrapper(f, encoding=encoding, newline="\n")  # type: ignore[arg-type]
        text(wrapper)
        wrapper.flush()
        wrapper.detach()  # leave the binary file open for atomic_write's fsync

    return atomic_write(path, write)
