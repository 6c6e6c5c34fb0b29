"""Shared test setup: an isolated model-zoo cache and environment.

Every test that reaches the model store, the dataset downloads or a training script runs
with :func:`isolated_home` (``pytestmark = pytest.mark.usefixtures("isolated_home")`` or by
name), so that a test

* never reads or writes the user's cache (``~/.cache/modelzoo`` or their ``MODELZOO_HOME``):
  a file left there by an earlier run cannot make a download test pass, and a test cannot
  leave files behind in it;
* never inherits the user's weights or data mirror (``MODELZOO_REPO_URL``,
  ``MODELZOO_DATA_URL``) or offline switch (``MODELZOO_OFFLINE``), which would change where
  a file comes from or whether it is fetched at all;
* never joins a torchrun job by accident: with ``RANK``/``WORLD_SIZE``/... set (a test run
  started under torchrun, or inside a job's shell) a script run in-process would try to
  rendezvous with that job.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# The user's overrides of where files come from, and torchrun's rendezvous variables.
CLEARED = ("MODELZOO_REPO_URL", "MODELZOO_DATA_URL", "MODELZOO_OFFLINE",
           "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def isolate(monkeypatch: pytest.MonkeyPatch, home: Path) -> Path:
    """Points ``MODELZOO_HOME`` at ``home`` (not created) and clears :data:`CLEARED`; for
    fixtures of a wider scope than a function (their own ``pytest.MonkeyPatch()``)."""
    monkeypatch.setenv("MODELZOO_HOME", str(home))
    for var in CLEARED:
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The model-zoo cache of this test, ``tmp_path / "home"`` (not created), with the
    user's mirror and offline settings and torchrun's variables cleared (module docstring).

    A test that wants another cache directory, a mirror or offline mode sets it itself
    after this fixture (``monkeypatch.setenv``)."""
    return isolate(monkeypatch, tmp_path / "home")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests on a multi-process fixture declared with ``tests._tiers.slow_fixture`` join
    the slow tier (``-m "not slow"`` leaves them out; CI runs them)."""
    from tests._tiers import uses_slow_fixture

    for item in items:
        if uses_slow_fixture(item):
            item.add_marker(pytest.mark.slow)
