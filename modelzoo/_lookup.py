"""The "unknown name" error every registry of modelzoo raises, with the closest names."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def unknown_name(what: str, name: str, known: Iterable[str], listing: str) -> ValueError:
    """``ValueError: Unknown <what> '<name>'; did you mean a, b? (<listing>)``: up to five
    of ``known`` close to ``name`` (lower-cased), then where the full list is."""
    close = difflib.get_close_matches(name.lower(), list(known), n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ValueError(f"Unknown {what} {name!r}{hint} ({listing})")
