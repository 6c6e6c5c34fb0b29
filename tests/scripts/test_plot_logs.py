"""scripts/plot_logs.py writes a PNG from run logs and rejects files that are not run logs."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "plot_logs.py"
spec = importlib.util.spec_from_file_location("plot_logs_script", SCRIPT)
plot_logs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_logs)


def write_log(path, scale):
    records = [{"kind": "header", "command": ["scripts/x.py"], "world_size": 1}]
    for step in range(1, 21):
        records.append(
            {
                "kind": "step",
                "epoch": step // 10,
                "batch": step % 10,
                "step": step,
                "loss": scale / step,
                "accuracy": 1 - scale / (step + 1),
                "lr": 0.1 * step / 20,
                "samples_per_sec": 100.0 + step,
            }
        )
        if step % 10 == 0:
            records.append({"kind": "epoch", "epoch": step // 10 - 1, "loss": 0.5})
            records.append(
                {
                    "kind": "eval",
                    "epoch": step // 10 - 1,
                    "step": step,
                    "top1": 0.5 + 0.01 * step,
                    "top5": 0.9,
                }
            )
    records.append({"kind": "end", "total_time": 3.0, "steps": 20})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_writes_png_from_two_logs(tmp_path):
    a = write_log(tmp_path / "run_a.jsonl", 1.0)
    b = write_log(tmp_path / "run_b.jsonl", 0.5)
    out = tmp_path / "curves.png"
    assert plot_logs.main([str(a), str(b), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    series = plot_logs.collect_series(plot_logs.read_log(a))
    assert set(series) == {
        "train loss",
        "train accuracy",
        "train lr",
        "train samples_per_sec",
        "eval top1",
        "eval top5",
    }
    assert series["eval top1"][0] == [10.0, 20.0]


def test_missing_file_is_a_clear_error(tmp_path, capsys):
    assert plot_logs.main([str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "x.png")]) == 2
    assert "no such run log" in capsys.readouterr().err


def test_file_without_header_is_a_clear_error(tmp_path, capsys):
    log = tmp_path / "bad.jsonl"
    log.write_text(json.dumps({"kind": "step", "step": 1, "loss": 1.0}) + "\n")
    assert plot_logs.main([str(log), "-o", str(tmp_path / "x.png")]) == 2
    assert "does not start with a header record" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
