"""trainers.tensorboard: ``--tensorboard DIR`` writes the run log's numbers as scalars.

Oracle: the JSON Lines run log of the same run, read back against the event files read by
TensorBoard's own reader (``EventAccumulator``), record by record and step by step.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.trainers._trainer_toys import ToyDataset, eval_step, lr_fn, make_mlp, train_step
from trainers import DistEnv, ModelEMA, RunLogger, Trainer, TrainerConfig

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

# kind -> (tag prefix, the x field, fields that locate a record rather than measure it)
LAYOUT = {
    "step": ("train", "step", {"kind", "epoch", "batch", "step", "phase"}),
    "eval": ("eval", "step", {"kind", "epoch", "step", "phase"}),
    "epoch": ("epoch", "step", {"kind", "epoch", "step", "phase"}),
    "end": ("end", "steps", {"kind", "steps", "epochs"}),
}


def expected_scalars(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What docs/training.md promises: every number of every record, at its global step
    (epoch records without a step: at their epoch), as a 32-bit float."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r["kind"] not in LAYOUT:
            continue
        prefix, x_field, located = LAYOUT[r["kind"]]
        x = r.get(x_field, r.get("epoch"))
        for name, value in r.items():
            if name in located or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            out.setdefault(f"{prefix}/{name}", []).append((int(x), float(np.float32(value))))
    return out


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_scalars_equal_the_run_log_step_by_step(tmp_path):
    log, tb = tmp_path / "run.jsonl", tmp_path / "tb"
    logger = RunLogger(log, console=False, tensorboard=tb)
    model = make_mlp(dropout=0.1)
    val = ToyDataset(12, seed=5)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=0.9),
        TrainerConfig(epochs=3, batch_size=8, log_interval=2, seed=2),
        env=DistEnv(),
        logger=logger,
        lr_schedule=lr_fn,
        train_step=train_step,
        eval_step=eval_step,
        hooks=[ModelEMA(model, decay=0.5, eval_dataset=val)],
    )
    trainer.fit(ToyDataset(40, noise=0.2), eval_dataset=val)
    logger.close()
    records = _records(log)
    want = expected_scalars(records)
    got = read_scalars(tb)
    assert got == want
    # the tags a user looks for, at the steps of the log
    assert [s for s, _ in got["train/loss"]] == [2, 4, 7, 9, 12, 14]
    assert {"train/lr", "train/samples_per_sec", "train/accuracy", "eval/top1", "eval/ema_top1",
            "epoch/loss", "end/ema_top1"} <= set(got)  # fmt: skip
    assert [s for s, _ in got["eval/ema_top1"]] == [5, 10, 15]
    assert [s for s, _ in got["epoch/loss"]] == [0, 1, 2]  # Trainer epoch records: the epoch
    first = next(r for r in records if r["kind"] == "step")
    assert got["train/lr"][0] == (2, float(np.float32(first["lr"])))


def test_records_with_their_own_step_and_non_numbers(tmp_path):
    tb = tmp_path / "tb"
    with RunLogger(None, console=False, tensorboard=tb) as logger:  # no JSONL: still written
        logger.write({"kind": "header", "command": ["scripts/x.py", "--seed", "1"]})
        logger.epoch(epoch=0, step=30, loss=0.5, samples_per_sec=10.0, time_cost=1.0,
                     ok=True, name="a")  # fmt: skip
        logger.eval(epoch=0, step=30, top1=math.nan, top5=0.75)
        logger.membership(step=31, old_world_size=2, new_world_size=3)
        logger.checkpoint(epoch=0, step=30, path="x.pt")
    got = read_scalars(tb)
    assert got == {
        "epoch/loss": [(30, 0.5)],
        "epoch/samples_per_sec": [(30, 10.0)],
        "epoch/time_cost": [(30, 1.0)],
        "eval/top5": [(30, 0.75)],  # NaN is null in the JSONL, and no scalar here
        "membership/world_size": [(31, 3.0)],
    }
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert acc.Tags()["tensors"] == ["header/command/text_summary"]


def test_only_rank_zero_writes(tmp_path):
    logger = RunLogger(tmp_path / "r1.jsonl", enabled=False, tensorboard=tmp_path / "tb")
    logger.step(epoch=0, batch=0, step=1, loss=1.0, lr=0.1, samples_per_sec=1.0)
    logger.close()
    assert not (tmp_path / "tb").exists() and not (tmp_path / "r1.jsonl").exists()


def test_a_missing_package_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    hint = 'pip install "modelzoo-trainers-pt[tensorboard]"'
    for enabled in (True, False):  # every rank fails, not only the one that writes
        with pytest.raises(ImportError, match="tensorboard package") as err:
            RunLogger(tmp_path / "run.jsonl", enabled=enabled, tensorboard=tmp_path / "tb")
        assert hint in str(err.value)
    assert not (tmp_path / "run.jsonl").exists()
    from trainers.cli import ArgumentParser, add_tensorboard_args

    parser = ArgumentParser(prog="train.py")
    add_tensorboard_args(parser)
    assert parser.parse_args([]).tensorboard is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--tensorboard", str(tmp_path / "tb")])
    assert hint in capsys.readouterr().err
