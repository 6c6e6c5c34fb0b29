"""Datasets against references: hand-written RecordIO bytes in dmlc-core's exact layout,
scikit-learn's digits arrays, and files we corrupt on purpose."""

from __future__ import annotations

import io
import json
import shutil
import struct
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from modelzoo.vision.data import (
    BadImageError,
    ImageFolder,
    RecordIOError,
    _digits_manifest_ok,
    digits_imagefolder,
)
from modelzoo.vision.recordio import RecordIODataset, index_recordio, write_recordio
from modelzoo.vision.transforms import eval_transforms, train_transforms

MAGIC = struct.pack("<I", 0xCED7230A)


def jpeg(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def make_folder(root: Path, layout: dict[str, int]) -> Path:
    for cls, n in layout.items():
        (root / cls).mkdir(parents=True)
        for i in range(n):
            (root / cls / f"img{i}.JPEG").write_bytes(jpeg((10 * i, 100, 200)))
    return root


# ------------------------------------------------------------------------ ImageFolder


def test_imagefolder_classes_and_labels(tmp_path):
    root = make_folder(tmp_path / "ds", {"n02": 2, "n01": 1, "n10": 3})
    (root / "n01" / "notes.txt").write_text("not an image")
    (root / "n01" / "b.png").write_bytes((root / "n02" / "img0.JPEG").read_bytes())
    ds = ImageFolder(root)
    assert ds.classes == ["n01", "n02", "n10"]
    assert ds.class_to_idx == {"n01": 0, "n02": 1, "n10": 2}
    assert [Path(p).relative_to(root).as_posix() for p, _ in ds.samples] == [
        "n01/b.png",
        "n01/img0.JPEG",
        "n02/img0.JPEG",
        "n02/img1.JPEG",
        "n10/img0.JPEG",
        "n10/img1.JPEG",
        "n10/img2.JPEG",
    ]
    assert [y for _, y in ds.samples] == [0, 0, 1, 1, 2, 2, 2]
    assert ds.ignored_files == 1
    img, label = ds[3]
    assert isinstance(img, Image.Image) and img.mode == "RGB" and label == 1
    assert np.abs(np.asarray(img, dtype=int) - (10, 100, 200)).max() <= 3  # pixels usable
    x, label = ImageFolder(root, eval_transforms(24, crop_ratio=1.0))[6]
    assert x.shape == (3, 24, 24) and label == 2


def test_imagefolder_missing_root_and_no_classes(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        ImageFolder(tmp_path / "nope")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(jpeg((1, 2, 3)))
    with pytest.raises(ValueError, match="no class folders"):
        ImageFolder(tmp_path / "flat")


def test_empty_class_folder_raises_or_keeps_its_label(tmp_path):
    root = make_folder(tmp_path / "ds", {"a": 1, "c": 1})
    (root / "b").mkdir()
    (root / "b" / "readme.txt").write_text("only text here")
    with pytest.raises(ValueError, match=r"class folder .*[/\\]b has no image files"):
        ImageFolder(root)
    ds = ImageFolder(root, skip_bad=True)
    assert ds.class_to_idx == {"a": 0, "b": 1, "c": 2}  # labels after b do not shift
    assert [y for _, y in ds.samples] == [0, 2]
    assert ds.empty_classes == ["b"]
    assert "empty class folder" in ds.report() and "b" in ds.report()


@pytest.fixture
def folder_with_bad_files(tmp_path):
    root = make_folder(tmp_path / "ds", {"a": 3, "b": 2})
    truncated = root / "a" / "img1.JPEG"
    noise = np.random.default_rng(0).integers(0, 256, (150, 200, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, "JPEG", quality=90)
    full = buf.getvalue()
    truncated.write_bytes(full[: len(full) // 2])  # header intact, scan data cut
    text = root / "b" / "img0.JPEG"
    text.write_text("this is a text file with a .JPEG name")
    return root, str(truncated), str(text)


@pytest.mark.parametrize("transform", [None, "train"])
def test_bad_images_raise_naming_the_file(folder_with_bad_files, transform):
    root, truncated, text = folder_with_bad_files
    tf = train_transforms(16) if transform else None
    ds = ImageFolder(root, tf)
    ds[0]
    with pytest.raises(BadImageError, match="skip-bad-images") as err:
        ds[1]
    assert truncated in str(err.value) and "truncated" in str(err.value)
    with pytest.raises(BadImageError) as err:
        ds[3]
    assert text in str(err.value)


def test_skip_bad_replaces_with_next_sample_and_counts(folder_with_bad_files):
    root, truncated, text = folder_with_bad_files
    ds = ImageFolder(root, train_transforms(16), skip_bad=True)
    with pytest.warns(RuntimeWarning, match="img1.JPEG"):
        x, y = ds[1]  # a/img1 is truncated -> a/img2, label of a
    assert x.shape == (3, 16, 16) and y == 0
    with pytest.warns(RuntimeWarning, match="img0.JPEG"):
        _, y = ds[3]  # b/img0 is text -> b/img1, label of b
    assert y == 1
    assert ds.num_bad == 2 and ds.bad_files == [truncated, text]
    report = ds.report()
    assert "2 unreadable image(s) skipped" in report and truncated in report
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known-bad file is skipped without a new attempt
        assert ds[1][1] == 0


def test_skip_bad_counts_are_seen_across_dataloader_workers(folder_with_bad_files):
    root, truncated, text = folder_with_bad_files
    ds = ImageFolder(root, eval_transforms(16, crop_ratio=1.0), skip_bad=True)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=2, num_workers=2, multiprocessing_context="fork"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        labels = torch.cat([y for _, y in loader]).tolist()
    assert len(labels) == len(ds) == 5
    assert labels == [0, 0, 0, 1, 1]  # each bad sample replaced by its successor
    assert ds.num_bad == 2 and sorted(ds.bad_files) == sorted([truncated, text])


def test_verify_finds_bad_files_up_front(folder_with_bad_files):
    root, truncated, text = folder_with_bad_files
    with pytest.raises(BadImageError):
        ImageFolder(root).verify(num_threads=2)
    ds = ImageFolder(root, skip_bad=True)
    assert ds.verify(num_threads=2) == [truncated, text]


# --------------------------------------------------------------------------- RecordIO


def hand_record(payload: bytes, label: float = 0.0, rid: int = 0) -> bytes:
    """One complete (cflag 0) record, spelled out from dmlc-core's recordio.h."""
    data = struct.pack("<IfQQ", 0, label, rid, 0) + payload
    pad = b"\0" * (-len(data) % 4)
    return MAGIC + struct.pack("<I", len(data)) + data + pad


def test_write_recordio_bytes_match_the_format(tmp_path):
    rec, idx = tmp_path / "d.rec", tmp_path / "d.idx"
    assert write_recordio(rec, idx, [(3, b"abc"), (7, b"wxyz1234")]) == 2
    first = hand_record(b"abc", 3.0, 0)
    expected = first + hand_record(b"wxyz1234", 7.0, 1)
    assert rec.read_bytes() == expected
    assert len(first) == 8 + 28  # 27 data bytes padded to 28
    assert idx.read_text() == f"0\t0\n1\t{len(first)}\n"


def test_recordio_roundtrip_labels_and_bytes(tmp_path):
    images = [jpeg((i * 40, 0, 255 - i * 40)) for i in range(5)]
    rec, idx = tmp_path / "t.rec", tmp_path / "t.idx"
    write_recordio(rec, idx, [(i % 3, b) for i, b in enumerate(images)] + [([1, 2.5], images[0])])
    ds = RecordIODataset(rec, idx)
    assert len(ds) == 6
    for i, data in enumerate(images):
        header, payload = ds.read_record(i)
        assert payload == data and header.label == i % 3 and header.id == i and header.flag == 0
        img, label = ds[i]
        assert label == i % 3 and isinstance(label, int) and img.size == (40, 30)
    header, payload = ds.read_record(5)
    assert header.flag == 2 and payload == images[0]
    assert torch.equal(ds[5][1], torch.tensor([1.0, 2.5]))
    x, _ = RecordIODataset(rec, idx, train_transforms(16))[2]
    assert x.shape == (3, 16, 16)


def test_recordio_multipart_record(tmp_path):
    # The data is IRHeader (24 bytes) + payload; magic at payload offset 4 sits at data
    # offset 28 (4-aligned: split there), magic at payload offset 9 is unaligned (kept).
    payload = b"JFIF" + MAGIC + b"x" + MAGIC + b"tail"
    data = struct.pack("<IfQQ", 0, 5.0, 0, 0) + payload
    assert data.find(MAGIC) == 28
    part1 = data[:28]
    part3 = data[32:]
    expected = (
        MAGIC
        + struct.pack("<I", 1 << 29 | len(part1))
        + part1
        + MAGIC
        + struct.pack("<I", 3 << 29 | len(part3))
        + part3
        + b"\0" * (-len(part3) % 4)
    )
    rec, idx = tmp_path / "m.rec", tmp_path / "m.idx"
    write_recordio(rec, idx, [(5, payload), (6, b"next")])
    raw = rec.read_bytes()
    assert raw.startswith(expected)
    ds = RecordIODataset(rec, idx)
    assert ds.read_record(0)[1] == payload and ds.read_record(0)[0].label == 5
    assert ds.read_record(1)[1] == b"next"


def test_recordio_reads_hand_written_three_part_record(tmp_path):
    # A record split at two aligned magics: parts with cflag 1, 2, 3.
    header = struct.pack("<IfQQ", 0, 9.0, 42, 0)  # 24 bytes
    pieces = [header + b"abcd", b"", b"xyz"]  # magic after part 1, magic after part 2
    raw = b""
    for cflag, piece in zip((1, 2, 3), pieces, strict=True):
        raw += MAGIC + struct.pack("<I", cflag << 29 | len(piece)) + piece
        raw += b"\0" * (-len(piece) % 4)
    raw_offset = len(hand_record(b"first"))
    (tmp_path / "h.rec").write_bytes(hand_record(b"first") + raw)
    (tmp_path / "h.idx").write_text(f"0\t0\n1\t{raw_offset}\n")
    ds = RecordIODataset(tmp_path / "h.rec", tmp_path / "h.idx")
    head, payload = ds.read_record(1)
    assert payload == b"abcd" + MAGIC + MAGIC + b"xyz"
    assert head.label == 9.0 and head.id == 42
    assert ds.read_record(0)[1] == b"first"


def test_recordio_bad_magic_names_file_and_offset(tmp_path):
    rec, idx = tmp_path / "b.rec", tmp_path / "b.idx"
    write_recordio(rec, idx, [(0, b"aaaa"), (1, b"bbbb")])
    second = len(hand_record(b"aaaa"))
    raw = bytearray(rec.read_bytes())
    raw[second : second + 4] = b"JUNK"
    rec.write_bytes(bytes(raw))
    ds = RecordIODataset(rec, idx)
    assert ds.read_record(0)[1] == b"aaaa"
    with pytest.raises(RecordIOError, match=rf"b\.rec: bad RecordIO magic .* at offset {second}"):
        ds.read_record(1)
    with pytest.raises(RecordIOError, match="magic"):  # never skipped: the file is broken
        RecordIODataset(rec, idx, skip_bad=True)[1]


def test_recordio_truncated_file(tmp_path):
    rec, idx = tmp_path / "t.rec", tmp_path / "t.idx"
    write_recordio(rec, idx, [(0, b"a" * 100), (1, b"b" * 100)])
    rec.write_bytes(rec.read_bytes()[:-20])
    ds = RecordIODataset(rec, idx)
    with pytest.raises(RecordIOError, match=r"t\.rec: truncated record at offset"):
        ds.read_record(1)


def test_recordio_missing_idx_and_rebuild(tmp_path):
    rec, idx = tmp_path / "x.rec", tmp_path / "x.idx"
    payload = b"p" + MAGIC * 3  # multi-part record in the middle
    write_recordio(rec, idx, [(0, b"one"), (1, payload), (2, b"three")])
    original = idx.read_text()
    idx.unlink()
    with pytest.raises(FileNotFoundError, match=r"x\.idx does not exist.*im2rec.*index_recordio"):
        RecordIODataset(rec, idx)
    assert index_recordio(rec) == 3
    assert idx.read_text() == original
    assert RecordIODataset(rec).read_record(1)[1] == payload


def test_recordio_bad_image_is_skipped(tmp_path):
    rec = tmp_path / "s.rec"
    write_recordio(rec, None, [(0, jpeg((1, 2, 3))), (1, b"not a jpeg"), (2, jpeg((9, 9, 9)))])
    with pytest.raises(BadImageError, match=r"s\.rec record key 1 \(offset \d+\).*skip-bad"):
        RecordIODataset(rec)[1]
    ds = RecordIODataset(rec, skip_bad=True)
    with pytest.warns(RuntimeWarning):
        assert ds[1][1] == 2
    assert ds.num_bad == 1 and "key 1" in ds.report()


# ----------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits_root(tmp_path_factory):
    return digits_imagefolder(tmp_path_factory.mktemp("zoo") / "digits")


def _indices(split_root: Path) -> dict[int, int]:
    return {int(p.stem): int(p.parent.name) for p in split_root.glob("*/*.png")}


def test_digits_folder_content(digits_root):
    from sklearn.datasets import load_digits

    digits = load_digits()
    train, val = _indices(digits_root / "train"), _indices(digits_root / "val")
    assert len(train) + len(val) == 1797
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(range(1797))
    for split in (train, val):
        assert all(int(digits.target[i]) == c for i, c in split.items())
    for c in range(10):
        n, n_val = int((digits.target == c).sum()), sum(1 for v in val.values() if v == c)
        assert n_val == round(0.2 * n)
    ds_train, ds_val = ImageFolder(digits_root / "train"), ImageFolder(digits_root / "val")
    assert ds_train.classes == ds_val.classes == [str(c) for c in range(10)]
    assert len(ds_train) + len(ds_val) == 1797
    # Pixels: np.rint(v * 255 / 16) with every source pixel repeated as a 4x4 block.
    for i in (0, 1, 500, 1796):
        split = "val" if i in val else "train"
        path = digits_root / split / str(digits.target[i]) / f"{i:04d}.png"
        arr = np.asarray(Image.open(path))
        expected = np.rint(digits.images[i] * 255 / 16).astype(np.uint8)
        assert arr.shape == (32, 32)
        np.testing.assert_array_equal(arr, np.repeat(np.repeat(expected, 4, 0), 4, 1))
    manifest = json.loads((digits_root / "manifest.json").read_text())
    assert manifest["num_images"] == 1797 and manifest["split_seed"] == 0


def test_digits_folder_rebuilt_when_stale_by_concurrent_builders(digits_root, tmp_path):
    root = tmp_path / "d"
    shutil.copytree(digits_root, root)
    assert digits_imagefolder(root) == root  # valid: kept as is
    victim = next((root / "val" / "3").glob("*.png"))
    victim.unlink()
    assert not _digits_manifest_ok(root)  # a file missing behind the manifest: stale
    (root / "manifest.json").unlink()
    (root / "train" / "stale.png").write_bytes(b"")
    results, errors = [], []

    def build():
        try:
            results.append(digits_imagefolder(root))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [root] * 3
    assert victim.exists() and _digits_manifest_ok(root)
    assert not (root / "train" / "stale.png").exists()
    assert len(list(root.glob("*/*/*.png"))) == 1797
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["d"]  # no temp dirs left
