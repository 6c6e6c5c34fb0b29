"""Run logs: JSONL records of docs/run_logs.md and GluonCV-style console lines."""

from __future__ import annotations

import datetime
import json
import re
import sys

import torch

from tests.trainers._trainer_toys import ToyDataset, eval_step, make_mlp, train_step
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig, make_header, progress_bar
from trainers.logs import _REPO_ROOT

FLOAT = r"-?\d+\.\d{6}"


def run(tmp_path, **logger_kwargs):
    logger = RunLogger(tmp_path / "run.jsonl", **logger_kwargs)
    argv = [str(_REPO_ROOT / "scripts" / "train_x.py"), "--lr", "0.1"]
    logger.header(make_header(argv, seed=0, world_size=1, config={"lr": 0.1, "dir": tmp_path}))
    model = make_mlp()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerConfig(epochs=2, batch_size=4, log_interval=2),
        env=DistEnv(),
        logger=logger,
        train_step=train_step,
        eval_step=eval_step,
    )
    trainer.fit(ToyDataset(16), eval_dataset=ToyDataset(6))
    logger.close()
    return tmp_path / "run.jsonl"


def test_jsonl_records(tmp_path):
    path = run(tmp_path, console=False)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds == ["header"] + (["step"] * 2 + ["epoch", "eval"]) * 2 + ["end"]
    header = records[0]
    assert header["command"] == ["scripts/train_x.py", "--lr", "0.1"]
    assert header["seed"] == 0 and header["world_size"] == 1
    assert set(header["versions"]) == {"python", "torch", "numpy", "modelzoo"}
    assert header["git"] is None or re.fullmatch(r"[0-9a-f]{40}", header["git"])
    assert header["config"] == {"lr": 0.1, "dir": str(tmp_path)}
    assert datetime.datetime.fromisoformat(header["time"]).utcoffset().total_seconds() == 0
    steps = [r for r in records if r["kind"] == "step"]
    assert [(r["epoch"], r["batch"], r["step"]) for r in steps] == [
        (0, 1, 2),
        (0, 3, 4),
        (1, 1, 6),
        (1, 3, 8),
    ]
    for r in steps:
        assert {"loss", "lr", "samples_per_sec", "accuracy"} <= set(r) and r["lr"] == 0.1
        assert 0 <= r["accuracy"] <= 1 and r["samples_per_sec"] > 0
    epoch = next(r for r in records if r["kind"] == "epoch")
    assert {"epoch", "loss", "samples_per_sec", "time_cost", "accuracy"} <= set(epoch)
    # The epoch loss is the mean of the per-micro-batch losses of both intervals.
    assert abs(epoch["loss"] - (steps[0]["loss"] + steps[1]["loss"]) / 2) < 1e-6
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(r["epoch"], r["step"]) for r in evals] == [(0, 4), (1, 8)]
    assert {"top1", "loss"} <= set(evals[0]) and "count" not in evals[0]
    end = records[-1]
    assert end["steps"] == 8 and end["epochs"] == 2 and end["total_time"] > 0
    assert end["top1"] == evals[-1]["top1"]


def test_console_lines_in_gluoncv_style(tmp_path, capsys):
    run(tmp_path, logging_file=tmp_path / "train.log")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Namespace(lr=0.1, dir=" + repr(str(tmp_path)) + ")"
    step = rf"Epoch\[0\] Batch \[1\]\tSpeed: \d+\.\d\d samples/sec\tloss={FLOAT}\taccuracy={FLOAT}\tlr=0\.100000"
    assert re.fullmatch(step, out[1]), out[1]
    assert re.fullmatch(rf"\[Epoch 0\] training: loss={FLOAT} accuracy={FLOAT}", out[3])
    assert re.fullmatch(r"\[Epoch 0\] speed: \d+ samples/sec\ttime cost: \d+\.\d\d", out[4])
    assert re.fullmatch(rf"\[Epoch 0\] validation: top1={FLOAT} loss={FLOAT}", out[5])
    assert re.fullmatch(r"Training time for 2 epochs: \d+\.\d\d sec\.", out[-1])
    assert (tmp_path / "train.log").read_text().splitlines() == out


def test_only_rank_zero_writes(tmp_path, capsys):
    logger = RunLogger(tmp_path / "rank1.jsonl", enabled=False, logging_file=tmp_path / "r1.log")
    logger.header(make_header(["x.py"], seed=0, world_size=2))
    logger.step(epoch=0, batch=0, step=1, loss=1.0, lr=0.1, samples_per_sec=1.0)
    logger.end(total_time=1.0, steps=1, epochs=1)
    logger.close()
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out == ""


def test_non_finite_numbers_are_null(tmp_path):
    with RunLogger(tmp_path / "a.jsonl", console=False) as logger:
        logger.eval(epoch=0, step=1, loss=float("nan"), top1=torch.tensor(0.5))
    record = json.loads((tmp_path / "a.jsonl").read_text())
    assert record == {"kind": "eval", "epoch": 0, "step": 1, "loss": None, "top1": 0.5}


def test_progress_bar_only_on_a_terminal(monkeypatch):
    items = [1, 2]
    assert progress_bar(items, enabled=False) is items
    monkeypatch.setattr(sys, "stderr", open(__file__))  # not a TTY  # noqa: SIM115
    try:
        assert progress_bar(items, enabled=True) is items
    finally:
        sys.stderr.close()
