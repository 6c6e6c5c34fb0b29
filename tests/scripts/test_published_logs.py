"""Every published run log in logs/ reproduces (a prefix) and states what it claims.

The oracle is the published log itself: ``scripts/reproduce.py`` reruns the command in its
header for the first logged steps and compares every shared number.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOGS = sorted((ROOT / "logs").glob("*.jsonl"))
# Held-out top-1 each published run must show in its last eval record (the claims in docs/).
CLAIMS = {
    "digits_resnest14.jsonl": 0.95,
    "digits_resnest14_2proc.jsonl": 0.93,
    "digits_resnest14_adasum_2proc.jsonl": 0.94,
    "elastic_digits_resnest14.jsonl": 0.94,
}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def test_the_main_logs_are_published():
    names = {p.name for p in LOGS}
    assert {"digits_resnest14.jsonl", "digits_resnest14_2proc.jsonl"} <= names


@pytest.mark.parametrize("path", LOGS, ids=[p.stem for p in LOGS])
def test_log_is_complete(path):
    records = _records(path)
    assert records[0]["kind"] == "header" and records[-1]["kind"] == "end"
    assert records[0]["command"][0].startswith("scripts/")
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals, "a published log needs its held-out evaluation"
    if path.name in CLAIMS:
        assert evals[-1]["top1"] >= CLAIMS[path.name]


@pytest.mark.slow
@pytest.mark.parametrize("path", LOGS, ids=[p.stem for p in LOGS])
def test_log_reproduces_its_first_steps(path, tmp_path):
    steps = [r["step"] for r in _records(path) if r["kind"] == "step"]
    prefix = steps[1] if len(steps) > 1 else steps[0]
    env = {**os.environ, "MODELZOO_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "reproduce.py"), str(path), "--max-steps", str(prefix)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
