"""``--export-dir`` end to end: what a training script exports, the pipelines and
``python -m modelzoo evaluate`` load back and predict with exactly as the run evaluated.

Oracles: the run's own evaluation in its JSON Lines log (the metric the script measured on
its held-out data) against the exported folder evaluated by the inference code path.
"""

from __future__ import annotations

import json

import pytest
import torch

import modelzoo

from ._scripts import load_script, read_records


def _load(name: str):
    return load_script(name, "export")


@pytest.mark.usefixtures("isolated_home")
def test_digits_export_evaluates_to_the_runs_ema_top1(tmp_path, capsys):
    """Real digit scans (a 12-per-class subset of the built-in set) with --model-ema: the
    folder holds the EMA's weights, so `python -m modelzoo evaluate` on the same val folder
    gives the logged ema_top1, and its preprocessing is the run's."""
    pytest.importorskip("sklearn")
    import shutil

    from modelzoo.cli import main as modelzoo_cli
    from modelzoo.vision.data import digits_imagefolder

    digits, data = digits_imagefolder(), tmp_path / "digits"
    for split, count in (("train", 12), ("val", 3)):
        for c in range(10):
            (data / split / str(c)).mkdir(parents=True)
            for f in sorted((digits / split / str(c)).iterdir())[:count]:
                shutil.copy(f, data / split / str(c) / f.name)
    out, log = tmp_path / "export", tmp_path / "run.jsonl"
    script = _load("train_imagenet")
    assert script.main(["--data-dir", str(data), "--model", "resnest14", "--input-size", "32",
                        "--rgb-mean", "127.5,127.5,127.5", "--rgb-std", "127.5,127.5,127.5",
                        "--num-epochs", "2", "--batch-size", "30", "--lr", "0.05",
                        "--warmup-epochs", "0", "--no-progress", "-j", "0", "--model-ema",
                        "--model-ema-decay", "0.5", "--run-log", str(log),
                        "--save-dir", str(tmp_path / "save"), "--export-dir", str(out)]) == 0  # fmt: skip
    evals = [r for r in read_records(log) if r["kind"] == "eval"]
    ema_top1 = next(r["ema_top1"] for r in reversed(evals) if "ema_top1" in r)
    ema_top5 = next(r["ema_top5"] for r in reversed(evals) if "ema_top5" in r)
    art = modelzoo.load_artifact(out)
    assert art.labels == tuple(str(i) for i in range(10)) and art.source["weights"] == "ema"
    assert art.preprocessing == {"input_size": 32, "crop_ratio": 0.875, "mean": [0.5] * 3,
                                 "std": [0.5] * 3}  # fmt: skip
    assert art.metrics["ema_top1"] == ema_top1
    capsys.readouterr()
    assert modelzoo_cli(["evaluate", "--model", str(out), "--data-dir", str(data / "val"),
                         "--json", "--no-progress", "--batch-size", "7"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["count"] == 30
    assert report["top1"] == pytest.approx(ema_top1, abs=1e-9)
    assert report["top5"] == pytest.approx(ema_top5, abs=1e-9)
    # the folder holds the EMA, not the trained weights of the run's last checkpoint
    from trainers.checkpoint import load_checkpoint

    trained = load_checkpoint(tmp_path / "save" / "latest.pt")["model"]
    exported = modelzoo.get_model(str(out)).state_dict()
    assert exported.keys() == trained.keys()
    assert not all(torch.equal(exported[k], trained[k]) for k in trained)
    first = sorted((data / "val" / "7").iterdir())[0]
    pred = modelzoo.pipeline("image-classification", out, top_k=3)(str(first))
    assert len(pred) == 3 and all(p["label"] in art.labels for p in pred)


@pytest.mark.usefixtures("isolated_home")
def test_karate_export_predicts_the_runs_best_test_accuracy(tmp_path):
    from modelzoo.graph import datasets as gd

    out, log = tmp_path / "export", tmp_path / "run.jsonl"
    script = _load("train_gnn")
    assert script.main(["--model", "gcn_karate", "--lr", "0.05", "--num-epochs", "60",
                        "--early-stop", "5", "--no-progress", "--run-log", str(log),
                        "--export-dir", str(out)]) == 0  # fmt: skip
    end = read_records(log)[-1]
    data = gd.karate_club()
    pipe = modelzoo.pipeline("node-classification", out)
    test_nodes = data.test_mask.nonzero().view(-1)
    preds = pipe(data, nodes=test_nodes)
    labels = modelzoo.load_artifact(out).labels
    assert labels == ("Mr. Hi", "Officer")
    acc = sum(p["label"] == labels[int(data.y[p["node"]])] for p in preds) / len(preds)
    assert acc == pytest.approx(end["best_test_acc"])
    assert modelzoo.load_artifact(out).metrics["best_test_acc"] == end["best_test_acc"]


@pytest.mark.usefixtures("isolated_home")
def test_graph_classification_refuses_export_dir(tmp_path, capsys):
    script = _load("train_gnn")
    with pytest.raises(SystemExit) as err:  # a flag combination: refused by its parser
        script.main(["--model", "gin_sbm", "--dataset", "sbm_graphs", "--export-dir",
                     str(tmp_path / "x"), "--no-progress"])  # fmt: skip
    assert err.value.code == 2 and "graph classification" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
