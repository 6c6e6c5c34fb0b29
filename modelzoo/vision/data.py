"""Image datasets: ImageNet-layout folders, MXNet RecordIO files, and a built-in digits folder.

- :class:`ImageFolder` reads ``root/<class>/<image>`` (the ImageNet layout GluonCV's
  ``--data-dir`` expects); classes are the sorted folder names.
- :class:`RecordIODataset` reads the ``.rec``/``.idx`` pairs made by MXNet's ``im2rec``
  (GluonCV's ``--rec-train``/``--rec-train-idx``) without MXNet; :func:`write_recordio`
  writes the same format.
- :func:`digits_imagefolder` writes scikit-learn's 1,797 real handwritten digits once as
  an ImageNet-layout folder with a fixed held-out split, a first dataset that needs no
  download.

Bad images. By default a file that cannot be decoded raises :class:`BadImageError`,
naming it. With ``skip_bad=True`` (the scripts' ``--skip-bad-images``) the dataset
instead marks the sample as bad, warns once naming the file, and returns the next
readable sample (``index + 1``, ``index + 2``, ... wrapping around) *with that sample's
own label*: an image is never paired with another image's label, and the batch size
stays fixed. The marks live in shared memory, so samples found bad inside DataLoader
workers are seen by the main process: ``bad_files`` lists them and ``report()`` sums
them up at the end of a run. ``verify()`` decodes every file up front instead, so that
evaluation can exclude bad files before the first batch rather than substitute them.

RecordIO format (dmlc-core ``recordio.h``): each record is
``uint32 magic 0xced7230a | uint32 lrec | data | zero padding to 4 bytes`` with
``lrec = cflag << 29 | length``. A payload that contains the magic number at a 4-aligned
offset is split there into parts (``cflag`` 1 = first, 2 = middle, 3 = last; 0 = whole
record) and the reader puts the magic back between parts. An image record's payload is
MXNet's ``IRHeader`` ``<IfQQ`` (``flag``, ``label``, ``id``, ``id2``), then ``flag`` float32
labels when ``flag > 0``, then the encoded image. The ``.idx`` file has one
``key<TAB>offset`` line per record.
"""

from __future__ import annotations

import contextlib
import io
import json
import operator
import os
import shutil
import struct
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image

from modelzoo.vision.transforms import ImageDecodeError, decode_rgb

from ..store import cache_root

__all__ = [
    "IMG_EXTENSIONS",
    "BadImageError",
    "RecordIOError",
    "ImageFolder",
    "RecordIODataset",
    "IRHeader",
    "pack_record",
    "unpack_record",
    "write_recordio",
    "index_recordio",
    "digits_imagefolder",
]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")

_SKIP_HINT = (
    "fix or delete the file, or pass --skip-bad-images (skip_bad=True) to skip unreadable "
    "images; skipped images are counted and reported"
)
# Errors Image.open raises for a file that is not a readable image.
_OPEN_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)


class BadImageError(ValueError):
    """An image file or record could not be decoded."""


class RecordIOError(ValueError):
    """A RecordIO file is malformed (bad magic number, truncated record, bad index)."""


def _decode_sample(src: Any, transform: Callable[[Any], Any] | None, where: str) -> Any:
    """Open ``src`` (path-like file object or bytes stream), decode, transform.

    Only decode failures become :class:`BadImageError`; errors raised by the transform
    itself propagate unchanged.
    """
    try:
        img = Image.open(src)
    except _OPEN_ERRORS as err:
        raise BadImageError(
            f"{where}: not a readable image ({type(err).__name__}: {err}); {_SKIP_HINT}"
        ) from err
    # No img.close() afterwards: it would destroy the pixels of a returned image that
    # is `img` itself; the caller closes the underlying file.
    try:
        if transform is not None and getattr(transform, "accepts_lazy_image", False):
            return transform(img)  # decodes in draft mode where the output size allows
        rgb, _, _ = decode_rgb(img)
        return transform(rgb) if transform is not None else rgb
    except ImageDecodeError as err:
        raise BadImageError(f"{where}: cannot decode image ({err}); {_SKIP_HINT}") from err


class _BadMarks:
    """A per-sample "bad" flag in shared memory, visible across DataLoader workers.

    Each worker only ever sets flags to 1, so concurrent writes need no lock.
    """

    def __init__(self, n: int) -> None:
        self.flags = torch.zeros(n, dtype=torch.uint8)
        # Without shared memory the marks stay per process (still correct, less complete).
        with contextlib.suppress(RuntimeError, OSError):
            self.flags.share_memory_()

    def mark(self, i: int) -> None:
        self.flags[i] = 1

    def is_bad(self, i: int) -> bool:
        return bool(self.flags[i])

    def indices(self) -> list[int]:
        return torch.nonzero(self.flags).flatten().tolist()


class _SkippingDataset(torch.utils.data.Dataset):
    """Shared skip-bad logic: subclasses implement ``_load(i)`` and ``_describe(i)``."""

    skip_bad: bool
    _bad: _BadMarks

    def _load(self, index: int) -> tuple[Any, Any]:
        raise NotImplementedError

    def _describe(self, index: int) -> str:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        n = len(self)
        index = operator.index(index)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} samples")
        index %= n
        if not self.skip_bad:
            return self._load(index)
        for step in range(n):
            j = (index + step) % n
            if self._bad.is_bad(j):
                continue
            try:
                return self._load(j)
            except BadImageError as err:
                self._bad.mark(j)
                warnings.warn(f"skip_bad: skipping {err}", RuntimeWarning, stacklevel=2)
        raise RuntimeError(f"every one of the {n} images is unreadable; see the warnings above")

    @property
    def num_bad(self) -> int:
        """Number of distinct samples found unreadable so far (across DataLoader workers)."""
        return int(self._bad.flags.sum())

    @property
    def bad_files(self) -> list[str]:
        """Descriptions (paths, or record keys) of the samples found unreadable so far."""
        return [self._describe(i) for i in self._bad.indices()]

    def _bad_report(self, max_listed: int = 10) -> str:
        bad = self.bad_files
        if not bad:
            return "no unreadable images"
        listed = "\n  ".join(bad[:max_listed])
        more = f"\n  ... and {len(bad) - max_listed} more" if len(bad) > max_listed else ""
        return (
            f"{len(bad)} unreadable image(s) skipped, each replaced by the next readable "
            f"sample:\n  {listed}{more}"
        )

    def verify(self, num_threads: int = 8) -> list[str]:
        """Decode every sample once (in draft mode, so it is quick) and mark the bad ones.

        With ``skip_bad=True`` the bad samples are then skipped without ever being tried
        again; with ``skip_bad=False`` the first bad sample raises :class:`BadImageError`.

        Returns:
            ``bad_files`` after the scan.
        """

        def check(i: int) -> BadImageError | None:
            try:
                self._load(i, _verify_only=True)  # type: ignore[call-arg]
            except BadImageError as err:
                return err
            return None

        todo = [i for i in range(len(self)) if not self._bad.is_bad(i)]
        with ThreadPoolExecutor(max(1, num_threads)) as pool:
            for i, err in zip(todo, pool.map(check, todo), strict=True):
                if err is None:
                    continue
                if not self.skip_bad:
                    raise err
                self._bad.mark(i)
        return self.bad_files


def _verify_transform(img: Image.Image) -> None:
    """Decode at the smallest draft scale: enough to find truncated or corrupt data."""
    decode_rgb(img, (1, 1))


_verify_transform.accepts_lazy_image = True  # type: ignore[attr-defined]


class ImageFolder(_SkippingDataset):
    """Images in the ImageNet layout ``root/<class>/**/<image>``.

    Classes are the sorted names of the folders in ``root``; ``samples`` lists
    ``(path, class_index)`` in sorted order. Images are decoded with Pillow and converted
    to RGB (``Image.MAX_IMAGE_PIXELS`` is respected). If ``transform`` accepts lazily
    opened images (:func:`~modelzoo.vision.transforms.train_transforms` and
    :func:`~modelzoo.vision.transforms.eval_transforms` do), JPEGs are decoded in draft
    mode at reduced size.

    Args:
        root: dataset folder, e.g. ``~/imagenet/train``.
        transform: applied to the decoded RGB image; ``None`` returns the PIL image.
        skip_bad: skip unreadable images (see the module docstring) and empty class folders
            (which keep their class index) instead of raising.
        extensions: file name endings counted as images (case-insensitive).

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: ``root`` has no class folders, or (without ``skip_bad``) a class folder
            has no images, which would silently shift every later label if ignored.

    Example:
        >>> from modelzoo.vision.data import ImageFolder, digits_imagefolder
        >>> from modelzoo.vision.transforms import eval_transforms
        >>> ds = ImageFolder(digits_imagefolder() / "val", eval_transforms(32, crop_ratio=1.0))
        >>> x, y = ds[0]  # (3, 32, 32) float tensor, int label
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        transform: Callable[[Any], Any] | None = None,
        *,
        skip_bad: bool = False,
        extensions: Sequence[str] = IMG_EXTENSIONS,
    ) -> None:
        self.root = Path(root).expanduser()
        self.transform = transform
        self.skip_bad = skip_bad
        self.extensions = tuple(e.lower() for e in extensions)
        if not self.root.is_dir():
            what = "is not a folder" if self.root.exists() else "does not exist"
            raise FileNotFoundError(
                f"image folder {self.root} {what}; expected the ImageNet layout "
                "<root>/<class>/<image> (e.g. --data-dir ~/imagenet with train/ and val/ inside)"
            )
        self.classes = sorted(
            e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith(".")
        )
        if not self.classes:
            raise ValueError(
                f"no class folders in {self.root}; expected the ImageNet layout "
                "<root>/<class>/<image>, one folder per class"
            )
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = []
        self.empty_classes: list[str] = []
        self.ignored_files = 0
        for cls in self.classes:
            files, ignored = self._scan(self.root / cls)
            self.ignored_files += ignored
            if not files:
                if not skip_bad:
                    raise ValueError(
                        f"class folder {self.root / cls} has no image files "
                        f"({', '.join(self.extensions)}); remove the folder or add images: "
                        "an empty class is an error because ignoring it would shift every "
                        "later label (--skip-bad-images keeps its label index and reports it)"
                    )
                self.empty_classes.append(cls)
            label = self.class_to_idx[cls]
            self.samples.extend((f, label) for f in files)
        if not self.samples:
            raise ValueError(f"no image files under {self.root}")
        self.targets = [label for _, label in self.samples]
        self._bad = _BadMarks(len(self.samples))

    def _scan(self, folder: Path) -> tuple[list[str], int]:
        files, ignored = [], 0
        for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                if name.lower().endswith(self.extensions):
                    files.append(os.path.join(dirpath, name))
                else:
                    ignored += 1
        return files, ignored

    def __len__(self) -> int:
        return len(self.samples)

    def _describe(self, index: int) -> str:
        return self.samples[index][0]

    def _load(self, index: int, _verify_only: bool = False) -> tuple[Any, int]:
        path, label = self.samples[index]
        transform = _verify_transform if _verify_only else self.transform
        with open(path, "rb") as f:
            return _decode_sample(f, transform, path), label

    def report(self) -> str:
        """One paragraph for the end of a run: sizes, empty classes, unreadable images."""
        lines = [
            f"ImageFolder {self.root}: {len(self.samples)} images in {len(self.classes)} classes"
        ]
        if self.empty_classes:
            lines.append(
                f"{len(self.empty_classes)} empty class folder(s) kept their label index: "
                + ", ".join(self.empty_classes)
            )
        if self.ignored_files:
            lines.append(f"{self.ignored_files} non-image file(s) ignored by extension")
        lines.append(self._bad_report())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(root={str(self.root)!r}, samples={len(self)}, "
            f"classes={len(self.classes)}, skip_bad={self.skip_bad})"
        )


# --------------------------------------------------------------------------- RecordIO

_MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", _MAGIC)
_LEN_MASK = (1 << 29) - 1
_IR_FORMAT = "<IfQQ"
_IR_SIZE = struct.calcsize(_IR_FORMAT)  # 24


class IRHeader(NamedTuple):
    """MXNet's image-record header: ``label`` is a float, or a float32 array if ``flag > 0``."""

    flag: int
    label: Any
    id: int
    id2: int


def pack_record(header: IRHeader | tuple, payload: bytes) -> bytes:
    """Pack ``header`` and ``payload`` as ``mxnet.recordio.pack`` does.

    A scalar label is stored in the header with ``flag = 0``; a sequence of labels is
    stored as ``flag`` float32 values after the header.
    """
    header = IRHeader(*header)
    if np.ndim(header.label) == 0:
        return struct.pack(_IR_FORMAT, 0, float(header.label), header.id, header.id2) + payload
    labels = np.asarray(header.label, dtype="<f4").ravel()
    head = struct.pack(_IR_FORMAT, labels.size, 0.0, header.id, header.id2)
    return head + labels.tobytes() + payload


def unpack_record(buf: bytes) -> tuple[IRHeader, bytes]:
    """Split a record into its :class:`IRHeader` and payload (``mxnet.recordio.unpack``)."""
    if len(buf) < _IR_SIZE:
        raise RecordIOError(f"record of {len(buf)} bytes is shorter than the 24-byte IRHeader")
    flag, label, rid, rid2 = struct.unpack_from(_IR_FORMAT, buf)
    rest = buf[_IR_SIZE:]
    if flag > 0:
        if len(rest) < 4 * flag:
            raise RecordIOError(
                f"record header says {flag} labels but only {len(rest)} bytes follow it"
            )
        label = np.frombuffer(rest, dtype="<f4", count=flag).copy()
        rest = rest[4 * flag :]
    return IRHeader(flag, label, rid, rid2), rest


def _encode_recordio(payload: bytes) -> bytes:
    """Frame ``payload`` as dmlc RecordIO, splitting it where the magic is 4-byte aligned."""
    if len(payload) >= 1 << 29:
        raise RecordIOError(f"a RecordIO record must be < 2^29 bytes, got {len(payload)}")
    out = bytearray()
    start = 0
    pos = payload.find(_MAGIC_BYTES)
    while pos != -1:
        if pos % 4 == 0:
            cflag = 1 if start == 0 else 2
            out += struct.pack("<II", _MAGIC, cflag << 29 | (pos - start))
            out += payload[start:pos]  # 4-aligned length: no padding
            start = pos + 4
            pos = payload.find(_MAGIC_BYTES, start)
        else:
            pos = payload.find(_MAGIC_BYTES, pos + 1)
    cflag = 3 if start > 0 else 0
    tail = len(payload) - start
    out += struct.pack("<II", _MAGIC, cflag << 29 | tail)
    out += payload[start:]
    out += b"\0" * (-tail % 4)
    return bytes(out)


def write_recordio(
    rec_path: str | os.PathLike[str],
    idx_path: str | os.PathLike[str] | None,
    items: Iterable[tuple[float | Sequence[float], bytes]],
) -> int:
    """Write ``(label, encoded_image)`` items as an MXNet ``.rec`` file and its ``.idx``.

    The same bytes ``im2rec`` would write: record ``i`` has key ``i`` and
    ``IRHeader(flag, label, id=i, id2=0)``. Both files appear atomically (written to
    temporary names, then renamed).

    Args:
        rec_path: the ``.rec`` file to write.
        idx_path: its index; ``None`` means ``rec_path`` with the suffix ``.idx``.
        items: ``(label, bytes)`` pairs; a label is a number or a sequence of numbers.

    Returns:
        The number of records written.

    Example:
        Convert an image folder::

            ds = ImageFolder("train")
            items = ((label, Path(p).read_bytes()) for p, label in ds.samples)
            write_recordio("train.rec", "train.idx", items)
    """
    rec_path = Path(rec_path)
    idx_path = Path(idx_path) if idx_path is not None else rec_path.with_suffix(".idx")
    rec_tmp = rec_path.with_name(f".{rec_path.name}.tmp-{os.getpid()}")
    idx_tmp = idx_path.with_name(f".{idx_path.name}.tmp-{os.getpid()}")
    n = 0
    try:
        with open(rec_tmp, "wb") as frec, open(idx_tmp, "w", encoding="ascii") as fidx:
            for label, data in items:
                offset = frec.tell()
                frec.write(_encode_recordio(pack_record(IRHeader(0, label, n, 0), bytes(data))))
                fidx.write(f"{n}\t{offset}\n")
                n += 1
        os.replace(rec_tmp, rec_path)
        os.replace(idx_tmp, idx_path)
    finally:
        for tmp in (rec_tmp, idx_tmp):
            if tmp.exists():
                tmp.unlink()
    return n


def _read_record(fd: int, rec_path: str, offset: int, size: int) -> bytes:
    """Read the (possibly multi-part) record that starts at ``offset``."""
    parts = []
    pos = offset
    while True:
        head = os.pread(fd, 8, pos)
        if len(head) < 8:
            raise RecordIOError(
                f"{rec_path}: truncated record at offset {pos} (record starting at {offset}): "
                f"need an 8-byte header, the file ends after {len(head)} bytes "
                f"(file size {size}); the file is incomplete, download or convert it again"
            )
        magic, lrec = struct.unpack("<II", head)
        if magic != _MAGIC:
            raise RecordIOError(
                f"{rec_path}: bad RecordIO magic number 0x{magic:08x} at offset {pos} "
                f"(expected 0x{_MAGIC:08x}); the .idx file does not belong to this .rec "
                "file, or the .rec file is corrupt"
            )
        cflag, length = lrec >> 29, lrec & _LEN_MASK
        first = pos == offset
        if (first and cflag not in (0, 1)) or (not first and cflag not in (2, 3)):
            raise RecordIOError(
                f"{rec_path}: unexpected continuation flag {cflag} at offset {pos} "
                f"(record starting at {offset}); the .idx offset points into the middle of "
                "a record or the file is corrupt"
            )
        data = os.pread(fd, length, pos + 8)
        if len(data) < length:
            raise RecordIOError(
                f"{rec_path}: truncated record at offset {pos}: header says {length} bytes, "
                f"the file ends after {len(data)} (file size {size}); the file is "
                "incomplete, download or convert it again"
            )
        parts.append(data)
        pos += 8 + length + (-length % 4)
        if cflag in (0, 3):
            return _MAGIC_BYTES.join(parts)


def index_recordio(
    rec_path: str | os.PathLike[str], idx_path: str | os.PathLike[str] | None = None
) -> int:
    """Scan a ``.rec`` file and write its ``.idx`` (keys 0, 1, ... in file order).

    Returns:
        The number of records found.
    """
    rec_path = Path(rec_path)
    idx_path = Path(idx_path) if idx_path is not None else rec_path.with_suffix(".idx")
    size = rec_path.stat().st_size
    offsets = []
    fd = os.open(rec_path, os.O_RDONLY)
    try:
        pos = 0
        while pos < size:
            offsets.append(pos)
            while True:  # walk the parts of one record
                head = os.pread(fd, 8, pos)
                if len(head) < 8:
                    raise RecordIOError(f"{rec_path}: truncated record header at offset {pos}")
                magic, lrec = struct.unpack("<II", head)
                if magic != _MAGIC:
                    raise RecordIOError(
                        f"{rec_path}: bad RecordIO magic number 0x{magic:08x} at offset {pos}"
                    )
                length = lrec & _LEN_MASK
                pos += 8 + length + (-length % 4)
                if lrec >> 29 in (0, 3):
                    break
    finally:
        os.close(fd)
    tmp = idx_path.with_name(f".{idx_path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(f"{i}\t{o}\n" for i, o in enumerate(offsets)), encoding="ascii")
    os.replace(tmp, idx_path)
    return len(offsets)


class RecordIODataset(_SkippingDataset):
    """Images stored in MXNet RecordIO (``im2rec``) files, read without MXNet.

    Sample ``i`` is the record at the ``i``-th line of the ``.idx`` file. Its label is
    the header's label as an ``int`` (``flag == 0``, or a single packed label); records
    with several packed labels (``im2rec --pack-label``) give a float32 tensor.

    Args:
        rec_path: the ``.rec`` file.
        idx_path: its ``.idx`` index; ``None`` means ``rec_path`` with the suffix ``.idx``.
        transform: applied to the decoded RGB image; ``None`` returns the PIL image.
        skip_bad: skip undecodable images (see the module docstring). Malformed RecordIO
            framing (bad magic number, truncated file) always raises.

    Raises:
        FileNotFoundError: the ``.rec`` or ``.idx`` file is missing.
        RecordIOError: the ``.idx`` file is malformed, or a record is (when read).
    """

    def __init__(
        self,
        rec_path: str | os.PathLike[str],
        idx_path: str | os.PathLike[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        *,
        skip_bad: bool = False,
    ) -> None:
        self.rec_path = str(Path(rec_path).expanduser())
        idx = Path(idx_path).expanduser() if idx_path is not None else None
        self.idx_path = str(idx if idx is not None else Path(self.rec_path).with_suffix(".idx"))
        self.transform = transform
        self.skip_bad = skip_bad
        if not os.path.isfile(self.rec_path):
            raise FileNotFoundError(f"RecordIO file {self.rec_path} does not exist")
        if not os.path.isfile(self.idx_path):
            raise FileNotFoundError(
                f"RecordIO index {self.idx_path} does not exist; it is needed for random "
                f"access into {self.rec_path}. MXNet's tools/im2rec.py writes it next to the "
                "record file; or build it from the .rec with "
                "modelzoo.vision.data.index_recordio(rec_path, idx_path)"
            )
        self._size = os.path.getsize(self.rec_path)
        self.keys: list[str] = []
        self.offsets: list[int] = []
        with open(self.idx_path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                fields = line.split("\t")
                try:
                    key, offset = fields[0].strip(), int(fields[1])
                except (IndexError, ValueError):
                    raise RecordIOError(
                        f"{self.idx_path}:{lineno}: expected 'key<TAB>offset', got {line!r}"
                    ) from None
                if not 0 <= offset < self._size:
                    raise RecordIOError(
                        f"{self.idx_path}:{lineno}: offset {offset} is outside "
                        f"{self.rec_path} ({self._size} bytes); the index belongs to another file"
                    )
                self.keys.append(key)
                self.offsets.append(offset)
        if not self.offsets:
            raise RecordIOError(f"RecordIO index {self.idx_path} lists no records")
        self._bad = _BadMarks(len(self.offsets))
        self._fd: int | None = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fd"], state["_pid"] = None, -1  # each process opens its own descriptor
        return state

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None and self._pid == os.getpid():
            os.close(self._fd)  # type: ignore[arg-type]

    def _file(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.rec_path, os.O_RDONLY)
            self._pid = os.getpid()
        return self._fd

    def __len__(self) -> int:
        return len(self.offsets)

    def _describe(self, index: int) -> str:
        return f"{self.rec_path} record key {self.keys[index]} (offset {self.offsets[index]})"

    def read_record(self, index: int) -> tuple[IRHeader, bytes]:
        """Header and raw payload (the encoded image) of record ``index``."""
        buf = _read_record(self._file(), self.rec_path, self.offsets[index], self._size)
        try:
            return unpack_record(buf)
        except RecordIOError as err:
            raise RecordIOError(f"{self._describe(index)}: {err}") from None

    def _load(self, index: int, _verify_only: bool = False) -> tuple[Any, Any]:
        header, payload = self.read_record(index)
        transform = _verify_transform if _verify_only else self.transform
        img = _decode_sample(io.BytesIO(payload), transform, self._describe(index))
        return img, _label(header)

    def report(self) -> str:
        """One paragraph for the end of a run: size and unreadable images."""
        return f"RecordIO {self.rec_path}: {len(self)} records\n{self._bad_report()}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rec_path={self.rec_path!r}, records={len(self)}, "
            f"skip_bad={self.skip_bad})"
        )


def _label(header: IRHeader) -> int | float | torch.Tensor:
    label = header.label
    if header.flag > 0:
        if header.flag > 1:
            return torch.from_numpy(np.asarray(label, dtype=np.float32))
        label = float(label[0])
    return int(label) if float(label).is_integer() else float(label)


# ----------------------------------------------------------------------------- digits

_DIGITS_VERSION = 1
_DIGITS_SIZE = 32  # 8x8 -> 32x32, each source pixel becomes a 4x4 block (nearest)
_DIGITS_SEED = 0
_DIGITS_VAL_FRACTION = 0.2
_DIGITS_PARAMS = {
    "format_version": _DIGITS_VERSION,
    "source": "sklearn.datasets.load_digits",
    "image_size": _DIGITS_SIZE,
    "upscale": "nearest (np.kron with a 4x4 block of ones)",
    "pixel_scaling": "uint8 = np.rint(v * 255 / 16) for load_digits values v in 0..16",
    "split_seed": _DIGITS_SEED,
    "val_fraction": _DIGITS_VAL_FRACTION,
    "split": "per class: numpy default_rng(split_seed).permutation, first round(n * val_fraction) are val",
}


def _default_digits_root() -> Path:
    return cache_root() / "datasets" / "digits"


def _digits_manifest_ok(root: Path) -> bool:
    try:
        manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
        if any(manifest.get(k) != v for k, v in _DIGITS_PARAMS.items()):
            return False
        total = 0
        for split in ("train", "val"):
            classes = {e.name for e in os.scandir(root / split) if e.is_dir()}
            if classes != set(manifest["counts"][split]):
                return False
            for cls, count in manifest["counts"][split].items():
                on_disk = [n for n in os.listdir(root / split / cls) if n.endswith(".png")]
                if len(on_disk) != count:
                    return False
                total += count
        return total == manifest["num_images"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_digits(dest: Path) -> None:
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(
            "digits_imagefolder needs scikit-learn for its bundled digits data: "
            "pip install scikit-learn"
        ) from err
    digits = load_digits()
    images = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)  # (N, 8, 8)
    block = np.ones((_DIGITS_SIZE // 8, _DIGITS_SIZE // 8), dtype=np.uint8)
    rng = np.random.default_rng(_DIGITS_SEED)
    counts: dict[str, dict[str, int]] = {"train": {}, "val": {}}
    for c in range(10):
        idx = np.flatnonzero(digits.target == c)
        perm = rng.permutation(idx)
        n_val = int(round(len(idx) * _DIGITS_VAL_FRACTION))
        val = set(perm[:n_val].tolist())
        for split in ("train", "val"):
            (dest / split / str(c)).mkdir(parents=True, exist_ok=True)
        for i in idx.tolist():
            split = "val" if i in val else "train"
            img = Image.fromarray(np.kron(images[i], block))  # uint8 (32, 32): mode L
            img.save(dest / split / str(c) / f"{i:04d}.png", compress_level=1)
            counts[split][str(c)] = counts[split].get(str(c), 0) + 1
    manifest = dict(_DIGITS_PARAMS)
    manifest.update(
        num_images=len(images),
        num_classes=10,
        counts=counts,
        file_naming="<split>/<digit>/<index in load_digits, 4 digits>.png, mode L",
    )
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2), encoding="utf-8")


def digits_imagefolder(root: str | os.PathLike[str] | None = None) -> Path:
    """Write scikit-learn's handwritten digits as an ImageNet-layout folder, once.

    The 1,797 real 8x8 digit scans of ``sklearn.datasets.load_digits`` (16 grey levels)
    become 32x32 grey PNG files: values scaled by ``np.rint(v * 255 / 16)`` and each pixel
    repeated as a 4x4 block (nearest upscaling). A fixed, stratified split holds out 20 %
    of each class (``numpy.random.default_rng(0)``): ``root/train/<digit>/NNNN.png`` and
    ``root/val/<digit>/NNNN.png``, where ``NNNN`` is the index in ``load_digits``.

    The folder is built in a temporary directory and renamed into place under a file
    lock, so concurrent processes build it once and never see it half written; a
    ``manifest.json`` (parameters and per-class counts) is written last, and a folder
    whose manifest is missing, different or does not match the files is rebuilt.

    Args:
        root: destination; default ``$MODELZOO_HOME/datasets/digits`` (``MODELZOO_HOME``
            defaults to ``~/.cache/modelzoo``).

    Returns:
        ``root``, containing ``train/``, ``val/`` and ``manifest.json``.
    """
    from filelock import FileLock

    root = Path(root).expanduser() if root is not None else _default_digits_root()
    if _digits_manifest_ok(root):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root.parent / f".{root.name}.lock")):
        if _digits_manifest_ok(root):  # another process built it while we waited
            return root
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        try:
            _write_digits(tmp)
            if root.exists() or root.is_symlink():
                stale = Path(tempfile.mkdtemp(prefix=f".{root.name}.stale-", dir=root.parent))
                os.replace(root, stale / root.name)
                os.replace(tmp, root)
                shutil.rmtree(stale, ignore_errors=True)
            else:
                os.replace(tmp, root)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return root
