"""What the script tests share: loading a script as a module and reading its run log (the
clean single-process environment with its own cache is ``isolated_home``, tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str, tag: str = "under_test"):
    """``scripts/<name>.py`` as a fresh module (registered: dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(f"{name}_{tag}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def captured_parser(module):
    """The ``trainers.cli.ArgumentParser`` a script's ``parse_args`` builds, captured as it
    starts parsing (nothing is parsed)."""
    from trainers import cli

    captured = []
    original = cli.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        captured.append(self)
        raise SystemExit(0)

    cli.ArgumentParser.parse_known_args = capture
    try:
        with pytest.raises(SystemExit):
            module.parse_args([])
    finally:
        cli.ArgumentParser.parse_known_args = original
    return captured[0]


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]
