"""The generated docs stay in step with the registry."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_model_zoo_table_is_current():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_model_zoo_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0].strip() for b in text.split("```bash")[1:3]]
    assert "scripts/train_imagenet.py" in blocks[0]
    assert "pytest" in blocks[1]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert blocks[1] in ci, ".ci/run must run the README's test command verbatim"
