"""A pure-numpy reader for MXNet NDArray files (``.params``, ``mx.nd.save``).

GluonCV and GluonNLP publish their weights in this format. Reading it needs no MXNet: the file
is a small binary container of dense arrays, described here from MXNet's ``NDArray::Save`` /
``NDArray::Load`` (``src/ndarray/ndarray.cc``). All integers are little-endian.

File::

    uint64 magic = 0x112        # kMXAPINDArrayListMagic
    uint64 reserved = 0
    uint64 n_arrays, then n_arrays NDArray records
    uint64 n_names, then n_names x (uint64 length, UTF-8 bytes)   # 0 names: a list file

NDArray record, by its leading uint32:

* ``0xF993FAC9`` (V2) or ``0xF993FACA`` (V3, saved under ``np_shape`` semantics)::

      int32 storage type          # 0 dense; 1 row_sparse and 2 csr are rejected
      shape: int32 ndim, ndim x int64
      (V2: ndim == 0 means an uninitialized array and the record ends here;
       V3: ndim == -1 does, and ndim == 0 is a 0-d scalar)
      context: int32 dev_type, int32 dev_id   # ignored, data is always written from the host
      int32 dtype flag            # mshadow: 0 f32, 1 f64, 2 f16, 3 u8, 4 i32, 5 i8, 6 i64,
                                  # 7 bool, 8 i16, 9 u16, 10 u32, 11 u64 (12 bf16: rejected)
      prod(shape) x itemsize bytes, C order

* ``0xF993FAC8`` (V1): shape as above (int64 dims), then context, dtype flag, data.
* anything else (V0, the oldest files): that uint32 is ndim, followed by ndim x uint32 dims,
  then context, dtype flag, data.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

__all__ = ["load_mxnet_params"]

LIST_MAGIC = 0x112
NDARRAY_V1_MAGIC = 0xF993FAC8
NDARRAY_V2_MAGIC = 0xF993FAC9
NDARRAY_V3_MAGIC = 0xF993FACA
_MAX_LEGACY_NDIM = 32  # a V0 record starts with its ndim; anything larger is not one

_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),
    1: np.dtype("<f8"),
    2: np.dtype("<f2"),
    3: np.dtype("u1"),
    4: np.dtype("<i4"),
    5: np.dtype("i1"),
    6: np.dtype("<i8"),
    7: np.dtype("?"),
    8: np.dtype("<i2"),
    9: np.dtype("<u2"),
    10: np.dtype("<u4"),
    11: np.dtype("<u8"),
}
_UNSUPPORTED_DTYPES = {12: "bfloat16 (no numpy dtype)"}
_STORAGE_TYPES = {0: "default (dense)", 1: "row_sparse", 2: "csr"}
_PREFIXES = ("arg:", "aux:")


class _Reader:
    """Sequential reads with the byte offset kept for error messages."""

    def __init__(self, f: BinaryIO, path: Path, size: int) -> None:
        self.f = f
        self.path = path
        self.size = size
        self.offset = 0

    def remaining(self) -> int:
        return self.size - self.offset

    def read_into(self, nbytes: int, what: str) -> bytearray:
        if nbytes > self.remaining():
            raise ValueError(
                f"{self.path}: truncated MXNet NDArray file: {what} needs {nbytes} bytes at "
                f"offset {self.offset}, only {self.remaining()} left; download the file again"
            )
        buf = bytearray(nbytes)
        got = self.f.readinto(buf)
        if got != nbytes:
            raise ValueError(
                f"{self.path}: truncated MXNet NDArray file: read {got} of {nbytes} bytes of "
                f"{what} at offset {self.offset}; download the file again"
            )
        self.offset += nbytes
        return buf

    def scalar(self, fmt: str, what: str) -> int:
        dtype = np.dtype(fmt)
        return int(np.frombuffer(self.read_into(dtype.itemsize, what), dtype)[0])

    def array(self, fmt: str, count: int, what: str) -> np.ndarray:
        dtype = np.dtype(fmt)
        return np.frombuffer(self.read_into(dtype.itemsize * count, what), dtype)


def _read_shape(r: _Reader, dim_fmt: str, what: str, ndim: int | None = None) -> tuple | None:
    """Reads a shape; returns None for MXNet's 'unknown shape' (ndim < 0)."""
    if ndim is None:
        ndim = r.scalar("<i4", f"{what} ndim")
    if ndim < 0:
        return None
    if ndim > _MAX_LEGACY_NDIM:
        raise ValueError(f"{r.path}: corrupt MXNet NDArray file: {what} has ndim {ndim}")
    dims = r.array(dim_fmt, ndim, f"{what} dims")
    if (dims < 0).any():
        raise ValueError(
            f"{r.path}: {what} has an unknown dimension in shape {tuple(dims.tolist())}; "
            "only fully initialized arrays can be read"
        )
    return tuple(int(d) for d in dims)


def _read_payload(r: _Reader, shape: tuple, what: str) -> np.ndarray:
    r.array("<i4", 2, f"{what} context")  # dev_type, dev_id: irrelevant on load
    flag = r.scalar("<i4", f"{what} dtype flag")
    if flag in _UNSUPPORTED_DTYPES:
        raise ValueError(f"{r.path}: {what} has dtype {_UNSUPPORTED_DTYPES[flag]}, not supported")
    if flag not in _DTYPES:
        raise ValueError(f"{r.path}: {what} has unknown MXNet dtype flag {flag}")
    dtype = _DTYPES[flag]
    count = int(np.prod(shape, dtype=np.int64))
    data = np.frombuffer(r.read_into(count * dtype.itemsize, f"{what} data"), dtype)
    return data.astype(dtype.newbyteorder("="), copy=False).reshape(shape)


def _empty() -> np.ndarray:
    return np.zeros((0,), dtype=np.float32)


def _read_ndarray(r: _Reader, what: str) -> np.ndarray:
    magic = r.scalar("<u4", f"{what} magic")
    if magic in (NDARRAY_V2_MAGIC, NDARRAY_V3_MAGIC):
        stype = r.scalar("<i4", f"{what} storage type")
        if stype != 0:
            kind = _STORAGE_TYPES.get(stype, f"unknown ({stype})")
            raise ValueError(
                f"{r.path}: {what} has storage type {kind}; only dense arrays are supported "
                "(convert with .tostype('default') in MXNet before saving)"
            )
        shape = _read_shape(r, "<i8", what)
        if shape is None or (magic == NDARRAY_V2_MAGIC and len(shape) == 0):
            return _empty()  # saved uninitialized: MXNet writes no data for it
        return _read_payload(r, shape, what)
    if magic == NDARRAY_V1_MAGIC:
        shape = _read_shape(r, "<i8", what)
    elif magic <= _MAX_LEGACY_NDIM:
        shape = _read_shape(r, "<u4", what, ndim=magic)
    else:
        raise ValueError(
            f"{r.path}: {what} starts with 0x{magic:08X}, not an MXNet NDArray record "
            f"(expected 0x{NDARRAY_V2_MAGIC:08X}, 0x{NDARRAY_V3_MAGIC:08X}, "
            f"0x{NDARRAY_V1_MAGIC:08X} or a legacy ndim)"
        )
    if shape is None or len(shape) == 0:
        return _empty()
    return _read_payload(r, shape, what)


def load_mxnet_params(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Reads an MXNet NDArray file (``mx.nd.save``, Gluon ``.params``) without MXNet.

    Names keep the file's order. GluonCV's ``arg:`` / ``aux:`` prefixes (from symbolic
    checkpoints) are stripped. A list-style file (``mx.nd.save(path, [a, b])``, which stores
    no names) is returned with keys ``"0"``, ``"1"``, ... in list order. An array MXNet saved
    uninitialized (no shape, no data) is returned as an empty float32 array of shape ``(0,)``.

    Args:
        path: The file.

    Returns:
        Name -> array, each a fresh writable numpy array with the saved dtype and shape.

    Raises:
        ValueError: Not an NDArray file (wrong magic), truncated or trailing bytes, a sparse
            array (row_sparse / csr), an unsupported dtype (bfloat16), duplicate names; the
            message names the file.

    Example:
        >>> params = load_mxnet_params("resnest50-bcfefe1d.params")  # doctest: +SKIP
        >>> params["resnest_conv0_weight"].shape  # doctest: +SKIP
        (32, 3, 3, 3)
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, path, size)
        if size < 16:
            raise ValueError(
                f"{path}: not an MXNet NDArray file: {size} bytes, shorter than its 16-byte header"
            )
        magic = r.scalar("<u8", "file magic")
        r.scalar("<u8", "reserved header field")
        if magic != LIST_MAGIC:
            raise ValueError(
                f"{path}: not an MXNet NDArray file: magic 0x{magic:X}, expected "
                f"0x{LIST_MAGIC:X}; is it a zip archive or a PyTorch checkpoint?"
            )
        n_arrays = r.scalar("<u8", "array count")
        if n_arrays > r.remaining() // 4:
            raise ValueError(
                f"{path}: corrupt or truncated MXNet NDArray file: it claims {n_arrays} arrays "
                f"in {r.remaining()} remaining bytes"
            )
        arrays = [_read_ndarray(r, f"array #{i}") for i in range(n_arrays)]
        n_names = r.scalar("<u8", "name count")
        if n_names not in (0, n_arrays):
            raise ValueError(
                f"{path}: corrupt MXNet NDArray file: {n_names} names for {n_arrays} arrays"
            )
        names = []
        for i in range(n_names):
            length = r.scalar("<u8", f"length of name #{i}")
            raw = bytes(r.read_into(length, f"name #{i}"))
            try:
                names.append(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}: name #{i} is not valid UTF-8: {raw[:40]!r}") from exc
        if r.remaining():
            raise ValueError(
                f"{path}: {r.remaining()} unexpected bytes after the last name at offset "
                f"{r.offset}; the file is corrupt (or two files were concatenated)"
            )

    if not names:
        return {str(i): a for i, a in enumerate(arrays)}
    out: dict[str, np.ndarray] = {}
    for name, array in zip(names, arrays, strict=True):
        key = name[4:] if name.startswith(_PREFIXES) else name
        if key in out:
            raise ValueError(f"{path}: duplicate parameter name {key!r} (from {name!r})")
        out[key] = array
    return out
