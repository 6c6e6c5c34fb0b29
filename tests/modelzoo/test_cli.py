"""``python -m modelzoo predict|evaluate``: GluonCV's verify_pretrained on a folder.

The oracle is the evaluation written out image by image (PIL preprocessing of
tests/modelzoo/_reference.py, the model, top-k against the folder's labels).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from modelzoo.artifact import image_preprocessing, save_artifact
from modelzoo.cli import main

from ._reference import reference_eval_preprocess
from .test_pipelines import _net

ROOT = Path(__file__).resolve().parents[2]
PREP = image_preprocessing(32, 0.8, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
CLASSES = [str(i) for i in range(10)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """An artifact and a 10-class folder of real digit images (2 per class)."""
    pytest.importorskip("sklearn")
    from modelzoo.vision.data import digits_imagefolder

    base = tmp_path_factory.mktemp("cli")
    digits = digits_imagefolder(base / "digits")
    val = base / "val"
    for cls in CLASSES:
        (val / cls).mkdir(parents=True)
        for f in sorted((digits / "val" / cls).iterdir())[:2]:
            shutil.copy(f, val / cls / f.name)
    net = _net(2)
    art = base / "art"
    save_artifact(art, net, model_name="resnest14", model_kwargs={"num_classes": 10},
                  task="image-classification", labels=CLASSES, preprocessing=PREP)  # fmt: skip
    return art, val, net


def _reference(net, val):
    xs, ys = [], []
    for cls in CLASSES:
        for f in sorted((val / cls).iterdir()):
            xs.append(reference_eval_preprocess(Image.open(f), 32, 0.8, PREP["mean"], PREP["std"]))
            ys.append(int(cls))
    with torch.no_grad():
        top = net(torch.stack(xs)).topk(5, dim=-1).indices
    y = torch.tensor(ys)
    return (top[:, 0] == y).float().mean().item(), (top == y[:, None]).any(-1).float().mean().item()


def test_evaluate_equals_the_image_by_image_reference(setup, capsys):
    art, val, net = setup
    assert main(["evaluate", "--model", str(art), "--data-dir", str(val), "--json",
                 "--batch-size", "7", "--no-progress"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    top1, top5 = _reference(net, val)
    assert report["count"] == 20
    assert report["top1"] == pytest.approx(top1) and report["top5"] == pytest.approx(top5)


def test_evaluate_refuses_folders_that_do_not_fit(setup, tmp_path):
    art, val, _ = setup
    few = tmp_path / "few"
    shutil.copytree(val / "0", few / "0")
    with pytest.raises(SystemExit, match="1 class folders, the model 10 outputs"):
        main(["evaluate", "--model", str(art), "--data-dir", str(few), "--no-progress"])
    with pytest.raises(SystemExit, match="give --data-dir"):
        main(["evaluate", "--model", str(art)])


def test_predict_prints_one_json_line_per_image(setup, capsys):
    art, val, net = setup
    files = [str(sorted((val / c).iterdir())[0]) for c in ("3", "7")]
    assert main(["predict", "--model", str(art), "--top-k", "2", *files]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["input"] for x in lines] == files
    xs = [
        reference_eval_preprocess(Image.open(f), 32, 0.8, PREP["mean"], PREP["std"]) for f in files
    ]
    with torch.no_grad():
        top = net(torch.stack(xs)).topk(2, dim=-1).indices
    for line, row in zip(lines, top, strict=True):
        assert [p["label"] for p in line["predictions"]] == [CLASSES[i] for i in row.tolist()]


def test_python_dash_m_modelzoo_runs(setup):
    art, val, _ = setup
    out = subprocess.run(
        [sys.executable, "-m", "modelzoo", "evaluate", "--model", str(art), "--data-dir",
         str(val), "--no-progress"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "top-1" in out.stdout and "on 20 images" in out.stdout


def test_export_writes_a_program_at_the_artifacts_image_size(setup, tmp_path, capsys):
    art, _, net = setup
    out = tmp_path / "net.pt2"
    assert main(["export", "--model", str(art), "--output", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    program = torch.export.load(str(out))
    x = torch.randn(3, 3, 32, 32)  # the artifact's input_size, another batch than exported
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), net(x), rtol=0, atol=1e-5)
    with pytest.raises(SystemExit, match="image-size is for image models"):
        main(["export", "--model", "gcn_karate", "--output", str(tmp_path / "g.pt2"),
              "--image-size", "32"])  # fmt: skip


def test_predict_mistakes_are_one_line_and_exit_2(setup, tmp_path, capsys):
    """A bad image names the flag that skips it, and predict takes that flag; a missing file,
    an unknown model and --question for an image model are one line each, exit status 2."""
    from modelzoo.cli import run

    art, val, _ = setup
    good = str(sorted((val / "3").iterdir())[0])
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")
    assert run(["predict", "--model", str(art), good, str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "--skip-bad-images" in err[0]
    assert run(["predict", "--model", str(art), "--skip-bad-images", good, str(bad)]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(x)["input"] for x in out.splitlines()] == [good]
    assert f"skipped {bad}" in err and "skipped 1 unreadable image(s) of 2" in err
    cases = {
        ("predict", "--model", str(art), str(tmp_path / "missing.jpg")): "no such image file",
        ("predict", "--model", "resnest1", good): "--model: Unknown model 'resnest1'",
        ("predict", "--model", str(art), "--question", "Why?", "--context", "x"): "reads image",
        ("evaluate", "--model", str(art), "--data-dir", str(tmp_path / "no")): "--data-dir",
    }
    for argv, expected in cases.items():
        assert run(list(argv)) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0] and "Traceback" not in err[0], err


def test_python_dash_m_modelzoo_reports_a_missing_file_in_one_line(setup, tmp_path):
    art, _, _ = setup
    out = subprocess.run(
        [sys.executable, "-m", "modelzoo", "predict", "--model", str(art),
         str(tmp_path / "missing.jpg")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"python -m modelzoo predict: error: no such image file: {tmp_path / 'missing.jpg'}"
    )
