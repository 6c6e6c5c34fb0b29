"""scripts/scaling_whatif.py: the model's formulas, and that it runs on every published log.

Oracles: the ring all-reduce cost ``2 (N - 1) / N * S / B + 2 (N - 1) a`` and the scaling
factor ``T_c / (T_c + max(0, T_comm - o T_c))`` evaluated by hand here for fixed numbers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOGS = sorted((ROOT / "logs").glob("*.jsonl"))


def _load():
    spec = importlib.util.spec_from_file_location("scaling_whatif", ROOT / "scripts" / "scaling_whatif.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules["scaling_whatif"] = module
    spec.loader.exec_module(module)
    return module


whatif = _load()


def test_ring_allreduce_scaling_factor_by_hand():
    # T_c = 0.1 s, G = 100 MB, 8 workers, 10 Gbps = 1.25e9 B/s, no latency, no overlap:
    # T_comm = 2 * 7/8 * 1e8 / 1.25e9 = 0.14 s; f = 0.1 / 0.24.
    w = whatif.Workload(compute_time=0.1, grad_bytes=1e8)
    assert whatif.comm_time(w, 8, 10, 0.0) == pytest.approx(0.14)
    assert whatif.scaling_factor(w, 8, 10, 0.0) == pytest.approx(0.1 / 0.24)
    # Latency adds 2 (N - 1) hops: 14 x 10 us.
    assert whatif.comm_time(w, 8, 10, 1e-5) == pytest.approx(0.14 + 14e-5)
    # Overlap hides up to o T_c: 0.14 - 0.05 exposed.
    half = whatif.Workload(compute_time=0.1, grad_bytes=1e8, overlap=0.5)
    assert whatif.scaling_factor(half, 8, 10, 0.0) == pytest.approx(0.1 / 0.19)
    # Compression divides the bytes; all-gather pays (N - 1) S / B.
    ten = whatif.Workload(compute_time=0.1, grad_bytes=1e8, compression_ratio=10)
    assert whatif.comm_time(ten, 8, 10, 0.0) == pytest.approx(0.014)
    gather = whatif.Workload(compute_time=0.1, grad_bytes=1e8, compression_ratio=10, allgather=True)
    assert whatif.comm_time(gather, 8, 10, 0.0) == pytest.approx(7 * 1e7 / 1.25e9)
    assert whatif.scaling_factor(w, 1, 10, 0.0) == 1.0


def test_needed_compression_ratio_reaches_the_target():
    w = whatif.Workload(compute_time=0.1, grad_bytes=1e8)
    # Exposed budget for f = 0.9: 0.1 (1/0.9 - 1); dense time 0.14 s -> r = 0.14 / budget.
    r = whatif.needed_ratio(w, 8, 10, 0.0, 0.9)
    assert r == pytest.approx(0.14 / (0.1 * (1 / 0.9 - 1)))
    compressed = whatif.Workload(compute_time=0.1, grad_bytes=1e8, compression_ratio=r)
    assert whatif.scaling_factor(compressed, 8, 10, 0.0) == pytest.approx(0.9)
    assert whatif.needed_ratio(w, 8, 400, 0.0, 0.9) == 1.0  # fast enough without compression
    assert math.isinf(whatif.needed_ratio(w, 8, 10, 0.01, 0.9))  # latency alone is too much


def test_more_bandwidth_never_scales_worse():
    w = whatif.Workload(compute_time=0.2, grad_bytes=1e8, overlap=0.3)
    for n in (2, 4, 16, 64):
        fs = [whatif.scaling_factor(w, n, b, 1e-5) for b in (10, 25, 100, 400)]
        assert fs == sorted(fs) and all(0 < f <= 1 for f in fs)


def test_reads_compute_time_bytes_and_ratio_from_a_log(tmp_path):
    header = {"kind": "header", "command": ["scripts/x.py"], "seed": 0, "world_size": 2,
              "config": {"batch_size": 16, "accumulate": 2, "grad_combine": "ef", "compressor": "sign"}}  # fmt: skip
    steps = [
        {"kind": "step", "epoch": 0, "batch": i, "step": i + 1, "loss": 1.0, "lr": 0.1,
         "samples_per_sec": s, "bytes_sent": b, "grad_bytes": 320.0, "compression_ratio": None}
        for i, (s, b) in enumerate([(1.0, 0.0), (64.0, 20.0), (32.0, 0.0), (16.0, 20.0)])
    ]  # fmt: skip
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [header, *steps, {"kind": "end"}]) + "\n")
    w = whatif.workload_from_log(path)
    assert w.compute_time == pytest.approx(2.0)  # median of 64/64, 64/32, 64/16 (first skipped)
    # r over the run: 4 x 320 dense bytes against 40 sent (intervals sending 0 count too).
    assert (w.grad_bytes, w.compression_ratio, w.overlap, w.allgather) == (320.0, 32.0, 0.0, True)


def test_command_line_errors_and_plot(tmp_path, capsys):
    with pytest.raises(SystemExit):
        whatif.main(["--compute-time", "0.1"])  # no bytes
    out = tmp_path / "w.png"
    assert whatif.main(["--compute-time", "0.1", "--grad-bytes", "1e8", "--plot", str(out)]) == 0
    assert out.stat().st_size > 1000
    text = capsys.readouterr().out
    assert "predicted scaling factor" in text and "compression ratio needed" in text


@pytest.mark.parametrize("path", LOGS, ids=[p.stem for p in LOGS])
def test_runs_on_every_published_log(path, capsys):
    try:
        assert whatif.main([str(path), "--workers", "2,64"]) == 0
    except SystemExit as e:  # a log without the numbers says which flag to pass
        assert "pass --" in str(e), e
        return
    assert "predicted scaling factor" in capsys.readouterr().out


def test_plot_comm_totals_bytes_per_run(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("plot_comm", ROOT / "scripts" / "plot_comm.py")
    plot_comm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_comm)
    header = {"kind": "header", "command": ["scripts/x.py"], "seed": 0, "world_size": 2,
              "config": {"grad_combine": "ef", "compressor": "qsgd"}}  # fmt: skip
    records = [
        header,
        {"kind": "step", "step": 5, "bytes_sent": 10.0, "grad_bytes": 40.0},
        {"kind": "eval", "step": 7, "top1": 0.5},  # 2 more steps at the last rate
        {"kind": "step", "step": 10, "bytes_sent": 20.0, "grad_bytes": 40.0},
        {"kind": "eval", "step": 10, "top1": 0.75},
        {"kind": "end"},
    ]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert plot_comm.collect([path], None) == {"ef-qsgd": [(70.0, 0.5), (130.0, 0.75)]}
    out = tmp_path / "c.png"
    assert plot_comm.main([str(path), "-o", str(out)]) == 0 and out.stat().st_size > 1000
    assert "ef-qsgd" in capsys.readouterr().out
