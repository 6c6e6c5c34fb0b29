"""scripts/train_imagenet.py end to end: bad input, scale-out, published logs."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from modelzoo.vision.data import BadImageError, RecordIOError
from modelzoo.vision.recordio import write_recordio
from trainers.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train_imagenet.py"
TINY = ["--model", "resnest14", "--input-size", "32", "--batch-size", "4", "--num-epochs", "1",
        "-j", "0", "--no-progress", "--log-interval", "1"]  # fmt: skip


def _load_script():
    spec = importlib.util.spec_from_file_location("train_imagenet_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


def _folder(root: Path, per_class: int = 4) -> Path:
    for split in ("train", "val"):
        for c, cls in enumerate(("cat", "dog")):
            d = root / split / cls
            d.mkdir(parents=True)
            for i in range(per_class):
                (d / f"{i}.jpg").write_bytes(_jpeg(100 * c + i + (50 if split == "val" else 0)))
    return root


@pytest.mark.usefixtures("isolated_home")
@pytest.mark.slow
def test_truncated_jpeg_names_the_file_or_is_skipped(tmp_path, capsys):
    data = _folder(tmp_path / "data")
    bad = data / "train" / "cat" / "broken.jpg"
    bad.write_bytes(_jpeg(7)[:300])
    script = _load_script()
    with pytest.raises(BadImageError, match="broken.jpg") as info:
        script.main([*TINY, "--data-dir", str(data)])
    assert "--skip-bad-images" in str(info.value)
    assert script.main([*TINY, "--data-dir", str(data), "--skip-bad-images"]) == 0
    out = capsys.readouterr().out
    assert "broken.jpg" in out and "Held-out top-1" in out


@pytest.mark.usefixtures("isolated_home")
def test_non_image_file_and_empty_class_folder(tmp_path):
    data = _folder(tmp_path / "data")
    (data / "train" / "dog" / "notes.jpg").write_text("this is not an image")
    script = _load_script()
    with pytest.raises(BadImageError, match="notes.jpg"):
        script.main([*TINY, "--data-dir", str(data)])
    (data / "train" / "dog" / "notes.jpg").unlink()
    (data / "train" / "emu").mkdir()
    with pytest.raises(ValueError, match="emu"):
        script.main([*TINY, "--data-dir", str(data)])


@pytest.mark.usefixtures("isolated_home")
def test_recordio_bad_magic_and_missing_index(tmp_path):
    rec, idx = tmp_path / "train.rec", tmp_path / "train.idx"
    write_recordio(rec, idx, [(i % 2, _jpeg(i)) for i in range(8)])
    script = _load_script()
    args = [*TINY, "--use-rec", "--rec-train", str(rec), "--num-classes", "2"]
    with pytest.raises(UsageError, match=r"--rec-train-idx \S*missing\.idx: no such file"):
        script.main([*args, "--rec-train-idx", str(tmp_path / "missing.idx")])
    raw = bytearray(rec.read_bytes())
    raw[0:4] = b"\x00\x00\x00\x00"  # the first record's magic number
    rec.write_bytes(bytes(raw))
    with pytest.raises(RecordIOError, match=r"train\.rec.*offset 0|offset 0.*train\.rec"):
        script.main([*args, "--rec-train-idx", str(idx), "--max-steps", "2"])


def _run(cmd: list[str], env_extra: dict[str, str], timeout: int = 600) -> None:
    env = {**os.environ, **env_extra, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _steps(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "step"]


@pytest.mark.dist
@pytest.mark.slow
def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    """2 workers x 32 == 1 worker x 64 in data order and initial weights; with the same
    BatchNorm partition (1 worker x 32 x accumulate 2) the losses agree to float precision,
    and so do 2 pipeline stages over 2 micro-batches of 32 (``--pipeline-parallel 2``)."""
    env = {"MODELZOO_HOME": str(tmp_path / "home")}
    common = ["--max-steps", "3", "--log-interval", "1", "-j", "0", "--no-progress",
              "--warmup-epochs", "0", "--lr", "0.01"]  # fmt: skip
    one, acc, two = tmp_path / "one.jsonl", tmp_path / "acc.jsonl", tmp_path / "two.jsonl"
    _run([sys.executable, str(SCRIPT), *common, "--batch-size", "64", "--run-log", str(one)], env)
    _run(
        [sys.executable, str(SCRIPT), *common, "--batch-size", "32", "--accumulate", "2",
         "--run-log", str(acc)],
        env,
    )  # fmt: skip
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              "2", str(SCRIPT), *common]  # fmt: skip
    _run([*launch, "--batch-size", "32", "--run-log", str(two)], env)
    pipe = tmp_path / "pipe.jsonl"
    _run([*launch, "--batch-size", "64", "--pipeline-parallel", "2", "--micro-batches", "2",
          "--run-log", str(pipe)], env)  # fmt: skip
    a, b, c, d = _steps(one), _steps(acc), _steps(two), _steps(pipe)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [r["step"] for r in c] == [1, 2, 3]
    assert [r["step"] for r in d] == [1, 2, 3]
    for rb, rd in zip(b, d, strict=True):  # the same micro-batches, BatchNorm partition, order
        assert rd["loss"] == pytest.approx(rb["loss"], rel=1e-4), (rb, rd)
        assert rd["accuracy"] == pytest.approx(rb["accuracy"], abs=1e-9)
    for ra, rb, rc in zip(a, b, c, strict=True):
        assert rc["lr"] == pytest.approx(ra["lr"], rel=1e-9)
        # Same BatchNorm partition of the same samples: equal up to float summation order.
        assert rc["loss"] == pytest.approx(rb["loss"], rel=1e-4), (rb, rc)
        assert rc["accuracy"] == pytest.approx(rb["accuracy"], abs=1e-9)
    # Against one worker with the whole batch, the first loss (no update yet) differs only by
    # BatchNorm's statistics over 32 instead of 64 images per rank.
    assert c[0]["loss"] == pytest.approx(a[0]["loss"], rel=0.01)
    header = json.loads(two.read_text().splitlines()[0])
    assert header["world_size"] == 2


def test_the_data_sets_and_options_are_library_code(tmp_path):
    """What the script wires, reusable without it: the folder's sets with GluonCV's transforms,
    the class check, the rgb parsing and the recipe's model options."""
    from modelzoo.vision.recipe import ImageSetError, image_datasets, model_options, parse_rgb

    root = _folder(tmp_path / "images", per_class=2)
    mean, std = parse_rgb("123.68,116.779,103.939", "--rgb-mean"), (58.4, 57.1, 57.4)
    train, val, classes = image_datasets("folder", data_dir=root, input_size=32, mean=mean, std=std)
    assert classes == 2 and train.classes == val.classes == ["cat", "dog"]
    image, target = train[0]
    assert tuple(image.shape) == (3, 32, 32) and target == 0
    with pytest.raises(ImageSetError, match="--num-classes 3 disagrees with the 2 class"):
        image_datasets("folder", data_dir=root, input_size=32, mean=mean, std=std, num_classes=3)
    with pytest.raises(ValueError, match="--rgb-std: expected three comma-separated numbers"):
        parse_rgb("1,2", "--rgb-std")
    assert model_options(last_gamma=True, final_drop=0.2) == {"last_gamma": True, "final_drop": 0.2}
    assert model_options() == {}


@pytest.mark.slow
def test_compile_on_trains_what_eager_trains(tmp_path):
    """``--compile on`` on CPU (where ``auto`` stays eager): torch.compile of the training
    forward gives eager's first loss to float rounding (inductor fuses, so the last bits
    move) and trains as eager does: at 32 x 32 the last stage's BatchNorm normalizes 1 x 1
    maps over 16 values, so rounding grows to about 1e-3 by the third step (measured: the
    float32 gradients of eager itself differ from float64 by up to 10 % there), while one
    step moves the loss by about 0.25. The run log's configuration says which ran."""
    env = {"MODELZOO_HOME": str(tmp_path / "home")}
    common = [*TINY, "--batch-size", "16", "--max-steps", "3", "--warmup-epochs", "0",
              "--lr", "0.01"]  # fmt: skip
    eager, compiled = tmp_path / "eager.jsonl", tmp_path / "compiled.jsonl"
    _run([sys.executable, str(SCRIPT), *common, "--run-log", str(eager)], env)
    _run([sys.executable, str(SCRIPT), *common, "--compile", "on", "--run-log", str(compiled)],
         env)  # fmt: skip
    a, b = _steps(eager), _steps(compiled)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert b[0]["loss"] == pytest.approx(a[0]["loss"], rel=1e-5)
    for ra, rb in zip(a[1:], b[1:], strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-2), (ra, rb)
    runs = [json.loads(p.read_text().splitlines()[0])["configs"]["run"] for p in (eager, compiled)]
    assert [r["compile"] for r in runs] == ["auto", "on"]
