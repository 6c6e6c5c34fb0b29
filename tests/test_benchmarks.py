"""benchmarks/gpu_check.py keeps working where no GPU is: its parts at toy sizes on the CPU.

The figures of a CPU run mean nothing; what is checked is that every part runs, the JSON and
the doc section hold each one, an existing doc keeps its other text, and the Adasum rule on
the device agrees with the float64 rule (float32 rounding, < 1e-6 relative)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.mark.slow
def test_gpu_check_runs_every_part_and_writes_its_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nbefore\n\n<!-- gpu: python benchmarks/gpu_check.py -->\nold\n"
                   "<!-- /gpu -->\n\nafter\n")  # fmt: skip
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--skip-tests",
         "--json", str(out), "--doc", str(doc)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["skipped"] == {}
    for part in ("optimizers", "resnest", "bert", "adasum"):
        assert part in res, part
    assert len(res["resnest"]["images_per_s"]) == 5
    assert set(res["bert"]["sequences_per_s"]) == {"ours", "hf"}
    assert 0 <= res["adasum"]["max_rel_diff_vs_cpu_float64"] < 1e-6
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "old" not in text
    for words in ("Optimizer step", "training, 32x32", "span-QA training", "Adasum's rule"):
        assert words in text, words


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_gpu_check_without_a_gpu_says_so():
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "no CUDA device here" in done.stderr
