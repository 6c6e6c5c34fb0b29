"""The C bilinear resize (modelzoo.vision.resample) against Pillow, the reference."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from modelzoo import _native
from modelzoo.vision import resample


@pytest.fixture(scope="module", autouse=True)
def built():
    if not resample.available():
        pytest.fail("the C resize kernel did not build (a C compiler is a test requirement)")


def _pillow_two_passes(arr: np.ndarray, box, size) -> np.ndarray:
    """Pillow's vertical-only resize, then its horizontal-only one: each is one of Pillow's
    own passes (a pass whose axis does not change is skipped)."""
    height, width = arr.shape[:2]
    left, top, right, bottom = box
    tall = Image.fromarray(arr).resize(
        (width, size[1]), Image.BILINEAR, box=(0, top, width, bottom)
    )
    return np.asarray(tall.resize(size, Image.BILINEAR, box=(left, 0, right, size[1])))


def _cases(seed: int, n: int):
    rng = np.random.default_rng(seed)
    for i in range(n):
        h, w = (int(v) for v in rng.integers(1, 160, 2))
        arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        x0, y0 = rng.uniform(0, w - 0.5), rng.uniform(0, h - 0.5)
        x1, y1 = rng.uniform(x0 + 0.25, w), rng.uniform(y0 + 0.25, h)
        if i % 3 == 0:  # half pixels: a 1/2-scale JPEG decode's box
            x0, y0, x1, y1 = (np.floor(v * 2) / 2 for v in (x0, y0, x1, y1))
        size = (int(rng.integers(1, 260)), int(rng.integers(1, 260)))
        if i % 7 == 0:  # the horizontal pass skipped
            x0, x1, size = 0.0, float(w), (w, size[1])
        if i % 11 == 0:  # the vertical pass skipped
            y0, y1, size = 0.0, float(h), (size[0], h)
        box = tuple(float(v) for v in (x0, y0, x1, y1))
        if box[0] < box[2] and box[1] < box[3]:
            yield arr, box, size


def test_equals_pillows_two_passes_and_a_direct_resize_within_one_level():
    count = 0
    for arr, box, size in _cases(0, 250):
        got = resample.resize_bilinear_chw(arr, box, size)
        assert got.shape == (3, size[1], size[0]) and got.is_contiguous()
        hwc = got.permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(
            hwc, _pillow_two_passes(arr, box, size), err_msg=f"{arr.shape} {box} {size}"
        )
        direct = np.asarray(Image.fromarray(arr).resize(size, Image.BILINEAR, box=box))
        assert (
            np.abs(direct.astype(int) - hwc).max() <= 1
        )  # Pillow 13 may run the passes the other way
        count += 1
    assert count > 200


def test_rows_of_a_bigger_array_and_the_same_size():
    rng = np.random.default_rng(3)
    big = rng.integers(0, 256, (90, 70, 3), dtype=np.uint8)
    part = big[10:60]  # rows 70 * 3 bytes apart: contiguous rows
    got = resample.resize_bilinear_chw(part, (3.5, 2.0, 60.5, 49.5), (31, 17))
    np.testing.assert_array_equal(
        got.permute(1, 2, 0).numpy(),
        _pillow_two_passes(np.ascontiguousarray(part), (3.5, 2.0, 60.5, 49.5), (31, 17)),
    )
    same = resample.resize_bilinear_chw(part, (0.0, 0.0, 70.0, 50.0), (70, 50))  # nothing to do
    np.testing.assert_array_equal(same.permute(1, 2, 0).numpy(), part)


def test_bad_input_is_refused_with_the_reason():
    arr = np.zeros((10, 12, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="outside"):
        resample.resize_bilinear_chw(arr, (0, 0, 13, 10), (4, 4))
    with pytest.raises(ValueError, match="empty"):
        resample.resize_bilinear_chw(arr, (5, 0, 5, 10), (4, 4))
    with pytest.raises(ValueError, match="contiguous rows"):
        resample.resize_bilinear_chw(arr[:, ::2], (0, 0, 6, 10), (4, 4))
    with pytest.raises(ValueError, match="uint8"):
        resample.resize_bilinear_chw(arr.astype(np.float32), (0, 0, 12, 10), (4, 4))
    with pytest.raises(ValueError, match="positive"):
        resample.resize_bilinear_chw(arr, (0, 0, 12, 10), (0, 4))


def test_switched_off_it_is_unavailable(monkeypatch):
    monkeypatch.setattr(_native, "_LOADED", {})
    monkeypatch.setenv("MODELZOO_NATIVE_RESIZE", "0")
    assert not resample.available()
    with pytest.raises(RuntimeError, match="not available"):
        resample.resize_bilinear_chw(np.zeros((4, 4, 3), dtype=np.uint8), (0, 0, 4, 4), (2, 2))
