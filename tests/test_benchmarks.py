"""Benchmarks that need what a machine may lack (a GPU, root) keep working: toy runs, refusals.

benchmarks/gpu_check.py where no GPU is: its parts at toy sizes on the CPU. The figures of a
CPU run mean nothing; what is checked is that every part runs, the JSON and the doc section
hold each one, an existing doc keeps its other text, and the Adasum rule on the device agrees
with the float64 rule (float32 rounding, < 1e-6 relative).

benchmarks/bench_network.py: one toy setting on the lab network where namespaces can be made
(the ring's bytes per node are the oracle for the counters), a one-line refusal elsewhere."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
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
    # the CUDA kernels of LAMB, LANS and Adasum run too, in Triton's interpreter
    env = dict(os.environ, MODELZOO_TRITON="interpret", MODELZOO_ADASUM_NATIVE="0")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--skip-tests",
         "--json", str(out), "--doc", str(doc)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["skipped"] == {}
    for part in ("optimizers", "resnest", "bert", "adasum", "resnest_compiled", "bert_compiled"):
        assert part in res, part
    assert (
        res["resnest_compiled"]["compile_s"] > 0
        and len(res["resnest_compiled"]["images_per_s"]) == 5
    )
    assert set(res["bert_compiled"]["sequences_per_s"]) == {"ours", "hf"}
    assert len(res["resnest"]["images_per_s"]) == 5
    assert set(res["bert"]["sequences_per_s"]) == {"ours", "hf"}
    assert 0 <= res["adasum"]["max_rel_diff_vs_cpu_float64"] < 1e-6
    if importlib.util.find_spec("triton") is not None:  # a test requirement on Linux
        assert res["optimizers"]["kernels"] == res["adasum"]["kernels"] == "triton"
    assert max(res["optimizers"]["max_rel_diff_vs_torch_path"].values()) < 1e-5
    assert max(res["adasum"]["fused_max_rel_diff_vs_cpu_float64"].values()) < 1e-6
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "old" not in text
    for words in ("Optimizer step", "training, 32x32", "span-QA training", "Adasum's rule",
                  "training as above, compiled", "ours compiled"):  # fmt: skip
        assert words in text, words


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_gpu_check_without_a_gpu_says_so():
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "no CUDA device here" in done.stderr


NETWORK = ROOT / "benchmarks" / "bench_network.py"


def _netlab_why() -> str | None:
    from trainers.netlab import missing_requirements

    return missing_requirements()


def test_bench_network_without_the_capabilities_refuses_in_one_line():
    drop = ["setpriv", "--bounding-set=-net_admin,-sys_admin", "--inh-caps=-net_admin,-sys_admin"]
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: cannot drop the capabilities")
    done = subprocess.run(
        [*(drop if os.geteuid() == 0 else []), sys.executable, str(NETWORK)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "bench_network: needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN missing): run it as root, "
        "e.g. with sudo"
    ]


@pytest.mark.slow
@pytest.mark.netlab
def test_bench_network_on_two_lab_nodes_writes_a_result_make_doc_reads(tmp_path):
    """A toy setting (2 MB at 1 Gbit, 2 nodes): the run ends with ``ratio=``, its JSON passes
    make_doc's checks, the bytes on each cable are the ring's (the formula is the oracle) and
    no lab is left behind."""
    why = _netlab_why()
    if why:
        pytest.skip(f"netlab: {why}")
    from trainers.netlab import list_labs

    out = tmp_path / "bench_network.json"
    done = subprocess.run(
        [sys.executable, str(NETWORK), "--nodes", "2", "--caps", "1gbit", "--megabytes", "2",
         "--timeout", "240", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("ratio=")
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_doc", ROOT / "benchmarks" / "make_doc.py")
    make_doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_doc)
    res = make_doc.load(out)
    assert len(res["ours_rounds"]) == 5 and set(res["peer_rounds"]) == {0.016}  # 2 MB / 125 MB/s
    head = res["extra"]["headline"]
    assert head["ring_bytes_per_node"] == 2e6
    for sent in head["sent_bytes_per_node"]:  # the payload plus headers, barriers, timing
        assert 2e6 <= sent < 2e6 * 1.05, head
    assert not [name for name in list_labs() if re.fullmatch(r"bn\d+s\d+", name)]


PLAN_CHECK = ROOT / "benchmarks" / "plan_check.py"
TINY_BERT = ["--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "1024", "--warmup", "1"]


@pytest.mark.slow
@pytest.mark.dist
def test_plan_check_at_chosen_degrees_and_micro_batches(tmp_path):
    """``--only`` and ``--micro-batches``: one row per micro-batch count, each planned at it."""
    out = tmp_path / "plan.json"
    done = subprocess.run(
        [sys.executable, str(PLAN_CHECK), "--worlds", "2", "--only", "1,2,1",
         "--micro-batches", "2,4", *TINY_BERT, "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("max_rel_error=")
    rows = json.loads(out.read_text())["2"]
    assert [(r["plan"]["pipeline_parallel"], r["plan"]["micro_batches"]) for r in rows] == [
        (2, 2),
        (2, 4),
    ]
    assert all(len(r["measured_s"]) == 5 for r in rows)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--only", "1,4"], "'1,4' is not TP,PP,DP"),
        (["--worlds", "2", "--only", "1,4,1"], "--only: degrees for [4] processes"),
        (["--only", "1,2,1", "--micro-batches", "3"], "--micro-batches 3: the global batch 32"),
    ],
)
def test_plan_check_refuses_bad_degrees_and_micro_batches(argv, message):
    done = subprocess.run([sys.executable, str(PLAN_CHECK), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
