"""The pure-numpy MXNet NDArray reader against files written by MXNet 1.9.1 itself.

The ``.params`` files and their numpy equivalents (``mxnet_ndarray_cases.npz``) were made by
``tests/fixtures/gluoncv_resnest/make_fixture.py`` with ``mx.nd.save``.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from modelzoo.convert.mxnet import (
    NDARRAY_V1_MAGIC,
    NDARRAY_V2_MAGIC,
    load_mxnet_params,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "gluoncv_resnest"
CASES = FIXTURES / "mxnet_ndarray_cases.params"  # V2 records, dict
LIST = FIXTURES / "mxnet_ndarray_list.params"  # V2 records, no names
NP_SHAPE = FIXTURES / "mxnet_ndarray_np.params"  # V3 records (np_shape): 0-d and 0-size

# Byte offsets in CASES, from the layout: 8 magic + 8 reserved + 8 count, then the first
# record ("f32_2d", shape (3, 4)): 4 magic, 4 storage type, 4 ndim + 2 x 8 dims, 8 context,
# 4 dtype flag, 48 bytes of data.
FIRST_RECORD = 24
STYPE_AT = FIRST_RECORD + 4
DTYPE_AT = FIRST_RECORD + 4 + 4 + 4 + 16 + 8


@pytest.fixture(scope="module")
def oracle():
    with np.load(FIXTURES / "mxnet_ndarray_cases.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize(("path", "group"), [(CASES, "dict"), (LIST, "list"), (NP_SHAPE, "np")])
def test_reader_matches_mxnet(path, group, oracle):
    expected = {k.split("/", 1)[1]: v for k, v in oracle.items() if k.startswith(group + "/")}
    got = load_mxnet_params(path)
    assert list(got) == list(expected)  # file order kept; list files keyed "0", "1", ...
    for name, want in expected.items():
        value = got[name]
        assert value.dtype == want.dtype, name
        assert value.shape == want.shape, name
        np.testing.assert_array_equal(value, want, err_msg=name)
        assert value.flags.writeable and value.flags.c_contiguous, name


def test_all_dtypes_are_covered(oracle):
    dtypes = {v.dtype for v in oracle.values()}
    for name in ("float32", "float16", "float64", "int32", "int64", "uint8", "int8"):
        assert np.dtype(name) in dtypes


def test_list_file_keys(oracle):
    got = load_mxnet_params(LIST)
    assert list(got) == ["0", "1", "2"]


def _copy(tmp_path: Path, source: Path = CASES) -> tuple[Path, bytearray]:
    path = tmp_path / source.name
    shutil.copy(source, path)
    return path, bytearray(path.read_bytes())


def _expect_error(path: Path, data: bytes, *fragments: str) -> None:
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError) as info:
        load_mxnet_params(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message


def test_wrong_file_magic(tmp_path):
    path, data = _copy(tmp_path)
    _expect_error(path, b"PK\x03\x04" + data[4:], "magic")
    _expect_error(path, b"\x00" * 8, "header")


@pytest.mark.parametrize("keep", [20, 30, 60, 100, 500, -1])
def test_truncated_file(tmp_path, keep):
    path, data = _copy(tmp_path)
    _expect_error(path, data[:keep], "truncated")


def test_trailing_bytes(tmp_path):
    path, data = _copy(tmp_path)
    _expect_error(path, data + b"\x00\x01", "unexpected bytes")


def test_wrong_record_magic(tmp_path):
    path, data = _copy(tmp_path)
    assert struct.unpack_from("<I", data, FIRST_RECORD)[0] == NDARRAY_V2_MAGIC
    struct.pack_into("<I", data, FIRST_RECORD, 0xDEADBEEF)
    _expect_error(path, data, "array #0", "0xDEADBEEF")


@pytest.mark.parametrize(("stype", "kind"), [(1, "row_sparse"), (2, "csr")])
def test_sparse_storage_is_rejected(tmp_path, stype, kind):
    path, data = _copy(tmp_path)
    assert struct.unpack_from("<i", data, STYPE_AT)[0] == 0
    struct.pack_into("<i", data, STYPE_AT, stype)
    _expect_error(path, data, "array #0", kind)


@pytest.mark.parametrize(("flag", "fragment"), [(12, "bfloat16"), (99, "dtype flag 99")])
def test_unsupported_dtype_is_rejected(tmp_path, flag, fragment):
    path, data = _copy(tmp_path)
    assert struct.unpack_from("<i", data, DTYPE_AT)[0] == 0  # float32
    struct.pack_into("<i", data, DTYPE_AT, flag)
    _expect_error(path, data, "array #0", fragment)


def test_name_count_must_match(tmp_path):
    path, data = _copy(tmp_path, LIST)
    assert struct.unpack_from("<Q", data, len(data) - 8)[0] == 0  # a list file has no names
    _expect_error(path, data[:-8] + struct.pack("<Q", 1) + struct.pack("<Q", 1) + b"a", "names")


def _with_names(data: bytearray, names: list[str]) -> bytes:
    out = bytes(data[:-8]) + struct.pack("<Q", len(names))
    for name in names:
        raw = name.encode()
        out += struct.pack("<Q", len(raw)) + raw
    return out


def test_arg_aux_prefixes_are_stripped(tmp_path, oracle):
    path, data = _copy(tmp_path, LIST)
    path.write_bytes(_with_names(data, ["arg:conv0_weight", "aux:bn0_running_mean", "plain"]))
    got = load_mxnet_params(path)
    assert list(got) == ["conv0_weight", "bn0_running_mean", "plain"]
    np.testing.assert_array_equal(got["bn0_running_mean"], oracle["list/1"])


def test_duplicate_names_after_stripping(tmp_path):
    path, data = _copy(tmp_path, LIST)
    _expect_error(path, _with_names(data, ["arg:w", "aux:w", "x"]), "duplicate", "'w'")


def _file(records: list[bytes]) -> bytes:
    header = struct.pack("<QQQ", 0x112, 0, len(records))
    return header + b"".join(records) + struct.pack("<Q", 0)


def test_legacy_v1_and_v0_records(tmp_path):
    """Older MXNet wrote no storage type (V1, int64 dims) or no magic at all (V0: the record
    starts with ndim, uint32 dims). Built here from the documented layout."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1, -2, 3], dtype=np.int64)
    context_and_dtype = struct.pack("<iii", 1, 0, 0)  # cpu(0), float32
    v1 = struct.pack("<Iiqq", NDARRAY_V1_MAGIC, 2, 2, 3) + context_and_dtype + a.tobytes()
    v0 = struct.pack("<II", 1, 3) + struct.pack("<iii", 1, 0, 6) + b.tobytes()
    path = tmp_path / "legacy.params"
    path.write_bytes(_file([v1, v0]))
    got = load_mxnet_params(path)
    np.testing.assert_array_equal(got["0"], a)
    np.testing.assert_array_equal(got["1"], b)
    assert got["1"].dtype == np.int64


def test_uninitialized_array_reads_as_empty(tmp_path):
    # V2 with ndim 0: MXNet's "none" array; its record ends after the shape.
    none_record = struct.pack("<Iii", NDARRAY_V2_MAGIC, 0, 0)
    path = tmp_path / "none.params"
    path.write_bytes(_file([none_record]))
    got = load_mxnet_params(path)
    assert got["0"].shape == (0,) and got["0"].dtype == np.float32
