"""MXNet RecordIO without MXNet: :class:`RecordIODataset` reads the ``.rec``/``.idx`` pairs
made by MXNet's ``im2rec`` (GluonCV's ``--rec-train``/``--rec-train-idx``);
:func:`write_recordio` writes the same format and :func:`index_recordio` rebuilds an index.

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

import io
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np
import torch

from ..fileio import atomic_write, atomic_write_text
from .data import RecordIOError, _BadMarks, _decode_sample, _SkippingDataset, _verify_transform

__all__ = [
    "IRHeader",
    "RecordIODataset",
    "index_recordio",
    "pack_record",
    "unpack_record",
    "write_recordio",
]


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
    offsets: list[int] = []

    def write(frec: IO[bytes]) -> None:
        for label, data in items:
            offsets.append(frec.tell())
            record = pack_record(IRHeader(0, label, len(offsets) - 1, 0), bytes(data))
            frec.write(_encode_recordio(record))

    atomic_write(rec_path, write)
    atomic_write_text(idx_path, "".join(f"{i}\t{o}\n" for i, o in enumerate(offsets)))
    return len(offsets)


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
    atomic_write_text(idx_path, "".join(f"{i}\t{o}\n" for i, o in enumerate(offsets)))
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
                "modelzoo.vision.recordio.index_recordio(rec_path, idx_path)"
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
