"""A streamed reader of the svmlight / libsvm text format, into torch sparse CSR tensors.

The format (the one KDD Cup, RCV1, criteo and the url data sets ship in), one example a line::

    <label> [qid:<int>] <index>:<value> <index>:<value> ... [# comment]

Indices are 1-based in the standard (``zero_based=False``); ``zero_based=True`` reads files
written 0-based, and :func:`load_svmlight` also takes ``"auto"`` (0-based when any index is
0, scikit-learn's rule). Indices of a line must be strictly increasing. Blank lines and lines
that are only a comment are skipped. Any other deviation raises :class:`SvmlightFormatError`
naming the file and the line number.

:func:`iter_svmlight` streams: it holds one batch of ``batch_size`` lines in memory at a time
and needs ``n_features`` (the column count every batch shares). :func:`load_svmlight` reads
a whole file into one CSR matrix, sizing it from the file when ``n_features`` is not given.

Example:
    >>> import pathlib, tempfile
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.svm"
    >>> _ = p.write_text("1 1:0.5 3:2\\n0 2:1 # a comment\\n")
    >>> data = load_svmlight(p)
    >>> data.X.to_dense().tolist(), data.y.tolist()
    ([[0.5, 0.0, 2.0], [0.0, 1.0, 0.0]], [1.0, 0.0])
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["SvmlightBatch", "SvmlightData", "SvmlightFormatError", "iter_svmlight", "load_svmlight"]


class SvmlightFormatError(ValueError):
    """A line of an svmlight file that is not in the format; the message names file:line."""


@dataclass
class SvmlightBatch:
    """Consecutive examples of a file.

    Attributes:
        X: ``(n, d)`` ``torch.sparse_csr`` features.
        y: ``(n,)`` labels.
        qid: ``(n,)`` query ids (int64), or None when the file has none.
        first_line: 1-based line number of the first example of the batch.
    """

    X: torch.Tensor
    y: torch.Tensor
    qid: torch.Tensor | None
    first_line: int


class _Rows:
    """Parsed lines of one batch: CSR arrays under construction."""

    def __init__(self) -> None:
        self.labels: list[float] = []
        self.qids: list[int] = []
        self.indptr: list[int] = [0]
        self.indices: list[int] = []
        self.values: list[float] = []
        self.first_line = 0
        self.has_qid = False

    def __len__(self) -> int:
        return len(self.labels)


def _parse_line(text: str, rows: _Rows, where: str, offset: int, limit: int | None = None) -> None:
    """Append one line to ``rows``; ``offset`` is subtracted from each index (1 or 0), and
    an index at or beyond ``limit`` (0-based) raises."""
    body = text.split("#", 1)[0].split()
    if not body:
        return
    try:
        label = float(body[0])
    except ValueError:
        raise SvmlightFormatError(
            f"{where}: the label {body[0]!r} is not a number (each line starts with the label; "
            "multi-label files are not supported)"
        ) from None
    tokens = body[1:]
    qid = None
    if tokens and tokens[0].startswith("qid:"):
        try:
            qid = int(tokens[0][4:])
        except ValueError:
            raise SvmlightFormatError(f"{where}: bad query id {tokens[0]!r}") from None
        tokens = tokens[1:]
    if len(rows) and rows.has_qid != (qid is not None):
        raise SvmlightFormatError(
            f"{where}: {'a' if qid is not None else 'no'} qid on this line, but the earlier "
            "lines of the batch have " + ("none" if qid is not None else "one")
        )
    previous = -1
    for token in tokens:
        name, sep, value = token.partition(":")
        if not sep:
            raise SvmlightFormatError(
                f"{where}: {token!r} is not an index:value pair (expected e.g. 7:0.5)"
            )
        try:
            index = int(name) - offset
        except ValueError:
            raise SvmlightFormatError(
                f"{where}: the feature index {name!r} is not an integer"
            ) from None
        try:
            number = float(value)
        except ValueError:
            raise SvmlightFormatError(
                f"{where}: the value {value!r} of feature {name} is not a number"
            ) from None
        if index < 0:
            hint = " (the file may be 0-based: pass zero_based=True)" if offset == 1 else ""
            raise SvmlightFormatError(f"{where}: feature index {name} is out of range{hint}")
        if index <= previous:
            raise SvmlightFormatError(
                f"{where}: feature indices must be strictly increasing, {name} follows "
                f"{previous + offset}"
            )
        if limit is not None and index >= limit:
            raise SvmlightFormatError(
                f"{where}: feature index {name} is beyond n_features={limit}; pass a larger "
                "n_features"
            )
        previous = index
        rows.indices.append(index)
        rows.values.append(number)
    rows.has_qid = qid is not None
    rows.labels.append(label)
    if qid is not None:
        rows.qids.append(qid)
    rows.indptr.append(len(rows.indices))


def _tensors(
    rows: _Rows, indices: torch.Tensor, n_features: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rows' CSR features (with these column ``indices``), labels and qids."""
    X = _csr(
        torch.tensor(rows.indptr, dtype=torch.int64),
        indices,
        torch.tensor(rows.values, dtype=dtype),
        (len(rows), n_features),
    )
    qid = torch.tensor(rows.qids, dtype=torch.int64) if rows.has_qid else None
    return X, torch.tensor(rows.labels, dtype=dtype), qid


def _to_batch(rows: _Rows, n_features: int, dtype: torch.dtype, path: Path) -> SvmlightBatch:
    indices = torch.tensor(rows.indices, dtype=torch.int64)
    return SvmlightBatch(*_tensors(rows, indices, n_features, dtype), rows.first_line)


def _csr(
    indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, size: tuple[int, int]
) -> torch.Tensor:
    """A CSR tensor, without torch's once-per-process "sparse CSR is in beta" warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(indptr, indices, values, size=size, check_invariants=False)


def _check_path(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such svmlight file: {path}")
    return path


def iter_svmlight(
    path: str | os.PathLike[str],
    n_features: int,
    *,
    batch_size: int = 65536,
    zero_based: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Iterator[SvmlightBatch]:
    """Stream ``path`` in batches of ``batch_size`` examples (the last one may be smaller).

    Args:
        path: the text file.
        n_features: columns of every batch; an index at or beyond it raises.
        batch_size: examples per batch.
        zero_based: the file's indices start at 0 (default: at 1, the libsvm standard).
        dtype: dtype of the values and labels.
    """
    if isinstance(zero_based, str):
        raise ValueError(
            "zero_based='auto' needs the whole file; use load_svmlight, or say True/False"
        )
    if batch_size < 1 or n_features < 1:
        raise ValueError(f"batch_size={batch_size} and n_features={n_features} must be positive")
    path = _check_path(path)
    offset = 0 if zero_based else 1
    rows = _Rows()
    with path.open(encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            before = len(rows)
            _parse_line(text, rows, f"{path}:{lineno}", offset, n_features)
            if len(rows) > before and before == 0:
                rows.first_line = lineno
            if len(rows) == batch_size:
                yield _to_batch(rows, n_features, dtype, path)
                rows = _Rows()
    if len(rows):
        yield _to_batch(rows, n_features, dtype, path)


@dataclass
class SvmlightData:
    """A whole file: ``X`` (CSR), ``y``, ``qid`` (or None)."""

    X: torch.Tensor
    y: torch.Tensor
    qid: torch.Tensor | None


def load_svmlight(
    path: str | os.PathLike[str],
    n_features: int | None = None,
    *,
    zero_based: bool | str = "auto",
    dtype: torch.dtype = torch.float32,
) -> SvmlightData:
    """Read all of ``path`` into one CSR matrix.

    Args:
        path: the text file.
        n_features: columns; default one past the largest index in the file.
        zero_based: True, False, or ``"auto"`` (0-based when some index is 0, as in
            ``sklearn.datasets.load_svmlight_file``).
        dtype: dtype of the values and labels.
    """
    if zero_based not in (True, False, "auto"):
        raise ValueError(f"zero_based={zero_based!r}: choose True, False or 'auto'")
    path = _check_path(path)
    rows = _Rows()
    offset = 1 if zero_based is False else 0  # "auto": raw indices, shifted below
    limit = None if n_features is None or zero_based == "auto" else n_features
    with path.open(encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            _parse_line(text, rows, f"{path}:{lineno}", offset, limit)
    indices = torch.tensor(rows.indices, dtype=torch.int64)
    if zero_based == "auto" and indices.numel() > 0 and int(indices.min()) > 0:
        indices = indices - 1  # no index 0 anywhere: a 1-based file
    width = int(indices.max()) + 1 if indices.numel() else 0
    if n_features is None:
        n_features = width
    elif width > n_features:
        raise SvmlightFormatError(
            f"{path}: the largest feature index needs {width} columns, n_features={n_features}"
        )
    return SvmlightData(*_tensors(rows, indices, n_features, dtype))
