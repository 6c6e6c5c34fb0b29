"""The fast tier's line: ``pytest -m "not slow"`` leaves out every test marked ``slow``.

A test is marked where it is written (``@pytest.mark.slow``). A module-scoped fixture that
launches a multi-process job is paid for by whichever of its tests runs first, so marking
tests would not move its cost: declare it with :func:`slow_fixture` instead and every test
that uses it is in the slow tier (``tests/conftest.py`` adds the mark at collection).
Nothing is skipped by either: CI runs the whole suite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

#: The attribute :func:`slow_fixture` sets on the fixture's function.
SLOW_ATTR = "_modelzoo_slow_tier"


def slow_fixture(*args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Any]:
    """``pytest.fixture(...)`` whose users all belong to the slow tier."""

    def decorate(function: Callable[..., Any]) -> Any:
        setattr(function, SLOW_ATTR, True)
        return pytest.fixture(*args, **kwargs)(function)

    return decorate


def uses_slow_fixture(item: pytest.Item) -> bool:
    """Whether a collected test depends, directly or through other fixtures, on a fixture
    declared with :func:`slow_fixture`."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for name in info.names_closure:
        for definition in info.name2fixturedefs.get(name, ()):
            if getattr(definition.func, SLOW_ATTR, False):
                return True
    return False
