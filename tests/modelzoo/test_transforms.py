"""Transforms against references: Pillow's own resize/crop, numpy transcriptions of the
GluonCV/MXNet formulas (PCA lighting, colour jitter, normalize)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from modelzoo.vision.transforms import (
    CenterCrop,
    ColorJitter,
    Compose,
    Lighting,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToTensor,
    decode_rgb,
    eval_transforms,
    train_transforms,
)

MEAN = np.array([123.68, 116.779, 103.939])
STD = np.array([58.393, 57.12, 57.375])


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth, photo-like RGB image (low-frequency colour blobs, stripes, mild noise)."""
    rng = np.random.default_rng(seed)
    small = (rng.random((max(2, height // 16), max(2, width // 16), 3)) * 255).astype(np.uint8)
    a = np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC), dtype=float)
    yy, xx = np.mgrid[0:height, 0:width]
    a[..., 0] += 40 * np.sin(xx / 23.0)
    a[..., 1] += 30 * np.cos(yy / 17.0)
    a += rng.normal(0, 4, a.shape)
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def jpeg_bytes(img: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def np_normalize(a_uint8_hwc: np.ndarray) -> np.ndarray:
    """Reference normalize: (pixel - mean) / std in 0-255 units, HWC -> CHW."""
    return ((a_uint8_hwc.astype(np.float64) - MEAN) / STD).transpose(2, 0, 1)


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (333, 333)])
def test_eval_transform_is_pillow_resize_then_center_crop(size):
    img = photo(*size)
    out = eval_transforms(224)(img)
    assert out.shape == (3, 224, 224) and out.dtype == torch.float32

    w, h = size
    short, long = min(w, h), max(w, h)
    long_new = int(256 * long / short)  # GluonCV/torchvision keep-ratio rounding
    target = (256, long_new) if w <= h else (long_new, 256)
    ref = np.asarray(img.resize(target, Image.BILINEAR))
    top, left = (target[1] - 224) // 2, (target[0] - 224) // 2
    ref = ref[top : top + 224, left : left + 224]
    np.testing.assert_allclose(out.numpy(), np_normalize(ref), atol=1e-4)


def test_eval_resize_size_uses_ceil_of_crop_ratio():
    tf = eval_transforms(200, crop_ratio=0.9)
    assert tf.transforms[0].size == math.ceil(200 / 0.9) == 223
    assert eval_transforms(224).transforms[0].size == 256


def test_resize_and_center_crop_geometry():
    r = Resize(100)
    assert r.output_size(300, 200) == (150, 100)
    assert r.output_size(200, 301) == (100, 150)
    assert Resize((20, 30))(photo(64, 48)).size == (30, 20)
    same = Resize(48)(photo(64, 48))  # already the right size: returned decoded, usable
    assert same.size == (64, 48) and np.asarray(same).shape == (48, 64, 3)
    t = torch.arange(2 * 7 * 9).reshape(2, 7, 9)
    np.testing.assert_array_equal(CenterCrop((3, 4))(t), t.numpy()[:, 2:5, 2:6])
    with pytest.raises(ValueError, match="larger than the image"):
        CenterCrop(10)(photo(8, 8))


def test_random_resized_crop_area_and_ratio_bounds():
    width, height = 500, 375
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    torch.manual_seed(0)
    areas, ratios = [], []
    for _ in range(2000):
        top, left, h, w = RandomResizedCrop.get_params(width, height, scale, ratio)
        assert top >= 0 and top + h <= height and left >= 0 and left + w <= width
        # Sides are rounded to integers: allow one pixel of rounding on each side.
        lo_area = (math.sqrt(scale[0] * width * height) - 1.5) ** 2
        assert lo_area <= w * h <= width * height
        assert (w - 0.5) / (h + 0.5) <= ratio[1] and (w + 0.5) / (h - 0.5) >= ratio[0]
        areas.append(w * h / (width * height))
        ratios.append(w / h)
    # The draws cover the ranges, not one corner of them.
    assert min(areas) < 0.1 and max(areas) > 0.9
    assert min(ratios) < 0.78 and max(ratios) > 1.28


def test_random_resized_crop_fallback_is_clamped_center_crop():
    # A 1000x10 strip: no crop with ratio <= 4/3 and area >= 8 % fits in 10 attempts.
    torch.manual_seed(0)
    top, left, h, w = RandomResizedCrop.get_params(1000, 10, (0.08, 1.0), (3 / 4, 4 / 3))
    assert (h, w) == (10, round(10 * 4 / 3))
    assert (top, left) == (0, (1000 - 13) // 2)


def test_random_resized_crop_pixels_match_pillow_crop_then_resize():
    img = photo(500, 375)
    rrc = RandomResizedCrop(224)
    for seed in range(3):
        torch.manual_seed(seed)
        out = np.asarray(rrc(img), dtype=int)
        torch.manual_seed(seed)
        top, left, h, w = rrc.get_params(500, 375, rrc.scale, rrc.ratio)
        crop = img.crop((left, top, left + w, top + h))
        ref = np.asarray(crop.resize((224, 224), Image.BILINEAR), dtype=int)
        # Resizing from the whole image lets the filter see pixels just outside the crop;
        # away from the border the two agree exactly.
        np.testing.assert_array_equal(out[4:-4, 4:-4], ref[4:-4, 4:-4])
        assert np.abs(out - ref).mean() < 0.1


def test_train_transform_is_deterministic_under_manual_seed():
    img = photo(320, 240)
    tf = train_transforms(64)
    torch.manual_seed(123)
    a = tf(img)
    torch.manual_seed(123)
    b = tf(img)
    torch.manual_seed(124)
    c = tf(img)
    assert a.shape == (3, 64, 64)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_lighting_matches_numpy_pca_formula():
    x = ToTensor()(photo(40, 30))
    torch.manual_seed(7)
    out = Lighting(0.1)(x)
    torch.manual_seed(7)
    alpha = (torch.randn(3) * 0.1).double().numpy()
    # MXNet's image_random-inl.h table: eig[c][k] = eigval[k] * eigvec[c][k], 0-255 units.
    eig = np.array(
        [
            [55.46 * -0.5675, 4.794 * 0.7192, 1.148 * 0.4009],
            [55.46 * -0.5808, 4.794 * -0.0045, 1.148 * -0.8140],
            [55.46 * -0.5836, 4.794 * -0.6948, 1.148 * 0.4203],
        ]
    )
    rgb = eig @ alpha
    ref = np.clip(x.double().numpy() * 255 + rgb[:, None, None], 0, 255) / 255
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-5)
    assert not torch.allclose(out, x)


def _np_gray(a):
    return 0.299 * a[0] + 0.587 * a[1] + 0.114 * a[2]


@pytest.mark.parametrize("which", ["brightness", "contrast", "saturation"])
def test_color_jitter_single_op_matches_numpy(which):
    x = ToTensor()(photo(40, 30))
    torch.manual_seed(3)
    out = ColorJitter(**{which: 0.4})(x)
    torch.manual_seed(3)
    torch.randperm(3)  # the order draw
    a = 0.6 + 0.8 * torch.rand(()).item()
    xn = x.double().numpy()
    if which == "brightness":
        ref = a * xn
    elif which == "contrast":
        ref = a * xn + (1 - a) * _np_gray(xn).mean()
    else:
        ref = a * xn + (1 - a) * _np_gray(xn)[None]
    np.testing.assert_allclose(out.numpy(), np.clip(ref, 0, 1), atol=1e-5)


def test_color_jitter_all_ops_stay_in_range_and_vary():
    x = ToTensor()(photo(40, 30))
    cj = ColorJitter(0.4, 0.4, 0.4)
    outs = []
    for seed in range(4):
        torch.manual_seed(seed)
        outs.append(cj(x))
    assert all(o.min() >= 0 and o.max() <= 1 for o in outs)
    assert not torch.equal(outs[0], outs[1])
    with pytest.raises(TypeError, match="after ToTensor"):
        cj(photo(8, 8))


def test_normalize_matches_numpy_and_rejects_unit_scale():
    img = photo(16, 12)
    out = Normalize(MEAN, STD)(ToTensor()(img))
    np.testing.assert_allclose(out.numpy(), np_normalize(np.asarray(img)), atol=1e-4)
    with pytest.raises(ValueError, match="0-255 units"):
        Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def test_to_tensor_and_flip():
    img = photo(10, 6)
    t = ToTensor()(img)
    np.testing.assert_allclose(t.numpy(), np.asarray(img).transpose(2, 0, 1) / 255.0, atol=1e-7)
    gray = ToTensor()(img.convert("L"))
    assert gray.shape == (1, 6, 10)
    always = RandomHorizontalFlip(p=1.0)
    assert torch.equal(always(t), t.flip(-1))
    np.testing.assert_array_equal(np.asarray(always(img)), np.asarray(img)[:, ::-1])
    assert RandomHorizontalFlip(p=0.0)(t) is t


def test_draft_decode_eval_path_is_close_to_full_decode():
    data = jpeg_bytes(photo(1600, 1200))
    lazy = Image.open(io.BytesIO(data))
    _, sx, sy = decode_rgb(Image.open(io.BytesIO(data)), (341, 256))
    assert (sx, sy) == (4.0, 4.0)  # 1200 / 256 -> libjpeg decodes at 1/4 scale
    full = Image.open(io.BytesIO(data))
    full.load()
    tf = eval_transforms(224)
    assert tf.accepts_lazy_image
    a, b = tf(lazy), tf(full)
    diff = ((a - b) * torch.tensor(STD, dtype=torch.float32).view(3, 1, 1)).abs()  # 0-255 units
    assert diff.mean() < 2.5 and diff.max() < 25


def test_draft_decode_train_path_keeps_geometry():
    # Same random crop with and without draft decoding. A smooth image shows that the
    # geometry is identical (a one-pixel shift at 1/8 scale would be 8 source pixels);
    # per-pixel noise differs a little more, DCT scaling filtering it differently.
    rng = np.random.default_rng(0)
    blobs = (rng.random((30, 40, 3)) * 255).astype(np.uint8)
    smooth = Image.fromarray(blobs).resize((1600, 1200), Image.BICUBIC)
    rrc = RandomResizedCrop(128)
    for img, tol in ((smooth, 1.5), (photo(1600, 1200), 4.0)):
        data = jpeg_bytes(img)
        full = Image.open(io.BytesIO(data))
        full.load()
        for seed in range(4):
            torch.manual_seed(seed)
            a = np.asarray(rrc(Image.open(io.BytesIO(data))), dtype=float)
            torch.manual_seed(seed)
            b = np.asarray(rrc(full), dtype=float)
            assert np.abs(a - b).mean() < tol


def test_compose_lazy_flag():
    assert train_transforms(32).accepts_lazy_image
    assert not Compose([ToTensor()]).accepts_lazy_image
    assert not Compose([]).accepts_lazy_image
