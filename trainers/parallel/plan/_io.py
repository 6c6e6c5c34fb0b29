"""Validation of the planner's JSON fields and atomic JSON reading/writing (profiles and
plans)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

_MISSING = object()


def _get(data: Mapping[str, Any], key: str, where: str, kind: type, *, default: Any = _MISSING,
         minimum: float | None = None) -> Any:  # fmt: skip
    """``data[key]`` checked to be of ``kind`` (int, float, str, bool, list, dict)."""
    if key not in data:
        if default is not _MISSING:
            return default
        raise ValueError(f"{where}: missing field {key!r}")
    value = data[key]
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        what = "an integer"
    elif kind is float:
        ok = (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        )
        what = "a finite number"
    elif kind is str:
        ok = isinstance(value, str) and bool(value)
        what = "a non-empty string"
    else:
        ok = isinstance(value, kind)
        what = f"a {'JSON object' if kind is dict else kind.__name__}"
    if not ok:
        raise ValueError(f"{where}: field {key!r} must be {what}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: field {key!r} must be >= {minimum:g}, got {value!r}")
    return float(value) if kind is float else value


def _check_unknown(data: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; known: "
            f"{', '.join(sorted(known))}"
        )


def _read_json(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such {what} file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON {what} file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a {what} file holds a JSON object, got {type(data).__name__}")
    return data


def _write_json(path: str | os.PathLike[str], data: Mapping[str, Any]) -> Path:
    from trainers.checkpoint import atomic_write_text

    return atomic_write_text(path, json.dumps(data, indent=1, sort_keys=False) + "\n")
