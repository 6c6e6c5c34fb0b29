"""The simplejpeg (libjpeg-turbo) decoding backend against Pillow, its fallback.

References: Pillow's full decode + crop + resize (the plain pipeline), Pillow's own resize of
a fractional box on the whole image, the Pillow backend's outputs and random draws, and numpy
transcriptions of the photometric formulas. Real photos: scikit-learn's bundled china.jpg and
flower.jpg (640x427, the files' own bytes) and 1280x960 upscales of them saved at quality 90.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from modelzoo.vision import jpeg
from modelzoo.vision import resample as resample_native
from modelzoo.vision.data import BadImageError, ImageFolder
from modelzoo.vision.jpeg import EncodedJPEG, dct_scale
from modelzoo.vision.transforms import (
    ColorJitter,
    Compose,
    Lighting,
    Normalize,
    RandomResizedCrop,
    Resize,
    ToTensor,
    _resize_array,
    eval_transforms,
    train_transforms,
)

needs_simplejpeg = pytest.mark.skipif(not jpeg.available(), reason="simplejpeg not installed")
MEAN = (123.68, 116.779, 103.939)
STD = (58.393, 57.12, 57.375)


@pytest.fixture(autouse=True)
def _restore_backend():
    yield
    jpeg.set_backend(None)


def _sample_image_bytes(name: str) -> bytes:
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    return (Path(sklearn_datasets.__file__).parent / "images" / name).read_bytes()


def _jpeg(img: Image.Image, quality: int = 90, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def photos() -> dict[str, bytes]:
    """Real photos: the two sample files and their 1280x960 upscales."""
    out = {}
    for name in ("china.jpg", "flower.jpg"):
        data = _sample_image_bytes(name)
        out[name] = data
        big = Image.open(io.BytesIO(data)).convert("RGB").resize((1280, 960), Image.BICUBIC)
        out[f"{name}@1280x960"] = _jpeg(big)
    return out


def _pillow_crop(data: bytes, rrc: RandomResizedCrop, seed: int) -> tuple[np.ndarray, tuple]:
    """The plain pipeline: full decode, crop, resize; with the crop drawn from ``seed``."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    torch.manual_seed(seed)
    top, left, h, w = rrc.get_params(img.width, img.height, rrc.scale, rrc.ratio)
    out = img.crop((left, top, left + w, top + h)).resize(rrc.size[::-1], Image.BILINEAR)
    return np.asarray(out, dtype=float), (top, left, h, w)


def _hwc(x: torch.Tensor) -> np.ndarray:
    return x.permute(1, 2, 0).numpy().astype(float)


# ------------------------------------------------------------------------ pixels


@needs_simplejpeg
@pytest.mark.parametrize("size", [224, 64])
def test_crops_match_pillow_full_decode_crop_resize(photos, size):
    # 224 crops of 640x427 decode at full scale; 64 crops use the 1/2-1/8 DCT scales (at
    # 1280x960 mostly 1/8). The fast DCT and upsampling differ from Pillow's accurate
    # decode by about one grey level; DCT scaling filters a little differently again.
    rrc = RandomResizedCrop(size)
    scales = set()
    for name, data in photos.items():
        enc = EncodedJPEG.parse(data)
        assert enc is not None and enc.size == Image.open(io.BytesIO(data)).size
        diffs = []
        for seed in range(8):
            ref, (top, left, h, w) = _pillow_crop(data, rrc, seed)
            scales.add(
                dct_scale(
                    enc.width, enc.height, -(-enc.width * size // w), -(-enc.height * size // h)
                )
            )
            torch.manual_seed(seed)
            out = rrc(enc)
            assert out.dtype == torch.uint8 and out.shape == (3, size, size)
            diffs.append(np.abs(_hwc(out) - ref).mean())
        assert max(diffs) < 3.0, (name, diffs)
        assert np.mean(diffs) < 1.6, (name, diffs)
    assert scales >= ({1} if size == 224 else {2, 4, 8})


@needs_simplejpeg
def test_eval_resize_is_pillows_decode_and_resize(photos):
    # Evaluation decodes with libjpeg's accurate DCT and fancy upsampling: Pillow's pixels.
    # 640x427 -> 383x256 is a whole-pixel box (torch's resize, within rounding); 1280x960
    # decodes at 1/2 scale.
    for name, data in photos.items():
        enc = EncodedJPEG.parse(data)
        img = Image.open(io.BytesIO(data)).convert("RGB")
        res = Resize(256)
        ow, oh = res.output_size(*img.size)
        ref = np.asarray(img.resize((ow, oh), Image.BILINEAR), dtype=float)
        out = _hwc(res(enc))
        assert out.shape == ref.shape
        tol = 0.01 if img.width < 1000 else 1.0
        assert np.abs(out - ref).mean() < tol, name


@pytest.mark.parametrize("native", [True, False], ids=["c-kernel", "pillow"])
def test_fractional_box_resize_equals_pillow_on_the_whole_image(native, monkeypatch):
    """A fractional box: Pillow's arithmetic either way. The C kernel runs Pillow's two passes
    vertical first (exactly Pillow's vertical-only then horizontal-only resizes, within one
    grey level of a direct resize, whose pass order depends on Pillow's version); without it
    Pillow itself resizes, given only the rows and columns its filter reads."""
    if native:
        assert resample_native.available(), "the C resize kernel did not build"
    else:
        monkeypatch.setattr(resample_native, "available", lambda: False)
    rng = np.random.default_rng(0)
    arr = (rng.random((120, 160, 3)) * 255).astype(np.uint8)
    whole = Image.fromarray(arr)
    for box, resample in (
        ((10.5, 7.25, 90.75, 100.0), Image.Resampling.BILINEAR),
        ((0.5, 0.5, 159.5, 119.5), Image.Resampling.BILINEAR),
        ((33.125, 2.0, 140.0, 60.5), Image.Resampling.LANCZOS),
        ((20, 10, 100, 90), Image.Resampling.BICUBIC),
    ):
        out = _hwc(_resize_array(arr, box, (48, 40), resample)).astype(np.uint8)
        ref = np.asarray(whole.resize((48, 40), resample, box=box))
        if native and resample == Image.Resampling.BILINEAR:
            left, top, right, bottom = box
            tall = whole.resize((160, 40), resample, box=(0, top, 160, bottom))
            two_pass = np.asarray(tall.resize((48, 40), resample, box=(left, 0, right, 40)))
            np.testing.assert_array_equal(out, two_pass)
            assert np.abs(out.astype(int) - ref).max() <= 1
        else:
            np.testing.assert_array_equal(out, ref)


def test_whole_pixel_box_resize_is_pillows_crop_then_resize():
    rng = np.random.default_rng(1)
    arr = (rng.random((120, 160, 3)) * 255).astype(np.uint8)
    for box, size in (((10, 5, 150, 110), (56, 48)), ((30, 20, 60, 50), (100, 90))):
        out = _hwc(_resize_array(arr, box, size, Image.Resampling.BILINEAR))
        ref = np.asarray(Image.fromarray(arr).crop(box).resize(size, Image.BILINEAR), dtype=float)
        assert np.abs(out - ref).max() <= 1  # torch's uint8 rounding vs Pillow's


# ------------------------------------------------------------------------ same draws


def _folder(root: Path, files: dict[str, bytes]) -> Path:
    for i, (name, data) in enumerate(sorted(files.items())):
        cls = root / f"c{i % 2}"
        cls.mkdir(parents=True, exist_ok=True)
        (cls / name).write_bytes(data)
    return root


@needs_simplejpeg
def test_both_backends_draw_the_same_crops_flips_and_labels(photos, tmp_path, monkeypatch):
    files = {f"{k.replace('@', '_')}.jpg": v for k, v in photos.items()}
    root = _folder(tmp_path / "ds", files)
    boxes: list[tuple] = []
    get_params = RandomResizedCrop.get_params

    def spy(*args):
        boxes.append(get_params(*args))
        return boxes[-1]

    monkeypatch.setattr(RandomResizedCrop, "get_params", staticmethod(spy))
    tf = train_transforms(96, jitter=0.0, lighting=0.0)  # geometry only: pixels comparable
    runs = {}
    for backend in ("pillow", "simplejpeg"):
        jpeg.set_backend(backend)
        boxes.clear()
        ds = ImageFolder(root, tf)
        outs, labels, after = [], [], []
        for seed in range(3):
            for i in range(len(ds)):
                torch.manual_seed(seed * 100 + i)
                x, y = ds[i]
                outs.append(x)
                labels.append(y)
                after.append(torch.rand(()).item())  # the RNG state after the sample
        runs[backend] = (outs, labels, after, list(boxes))
    (po, pl, pa, pb), (so, sl, sa, sb) = runs["pillow"], runs["simplejpeg"]
    assert pl == sl and pa == sa and pb == sb
    std = torch.tensor(STD).view(3, 1, 1)
    means = []
    for p, s in zip(po, so, strict=True):
        # Grey levels. Pillow's draft decodes at a DCT scale where simplejpeg decodes whole
        # with its fast DCT, so the pixels differ a little; a different flip or box by far more.
        diff = ((p - s) * std).abs().mean()
        assert diff < 4.0
        assert (p.flip(-1) - s).mul(std).abs().mean() > 3 * diff
        means.append(diff)
    assert np.mean(means) < 2.0


@needs_simplejpeg
def test_simplejpeg_backend_decodes_with_simplejpeg(photos, tmp_path, monkeypatch):
    root = _folder(tmp_path / "ds", {"a.jpg": photos["china.jpg"]})
    calls = []
    decode = EncodedJPEG.decode
    monkeypatch.setattr(
        EncodedJPEG, "decode", lambda self, *a, **k: calls.append(1) or decode(self, *a, **k)
    )
    jpeg.set_backend("simplejpeg")
    ImageFolder(root, train_transforms(32))[0]
    ImageFolder(root, eval_transforms(32))[0]
    assert len(calls) == 2
    jpeg.set_backend("pillow")
    ImageFolder(root, train_transforms(32))[0]
    assert len(calls) == 2


# ------------------------------------------------------------------------ other files


def _photo(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    small = (rng.random((height // 8, width // 8, 3)) * 255).astype(np.uint8)
    return Image.fromarray(small).resize((width, height), Image.BICUBIC)


def _outputs(root: Path, tf, backend: str) -> list[torch.Tensor]:
    jpeg.set_backend(backend)
    ds = ImageFolder(root, tf)
    outs = []
    for i in range(len(ds)):
        torch.manual_seed(i)
        outs.append(ds[i][0])
    return outs


@needs_simplejpeg
def test_png_and_cmyk_go_through_pillow(tmp_path, monkeypatch):
    img = _photo(120, 90)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    files = {"a.png": buf.getvalue(), "b.jpg": _jpeg(img.convert("CMYK"))}
    assert EncodedJPEG.parse(files["b.jpg"]) is None  # Pillow converts Adobe CMYK
    root = _folder(tmp_path / "ds", files)
    monkeypatch.setattr(EncodedJPEG, "decode", lambda *a, **k: pytest.fail("simplejpeg used"))
    for tf in (train_transforms(48), eval_transforms(48)):
        fast = _outputs(root, tf, "simplejpeg")
        slow = _outputs(root, tf, "pillow")
        for a, b in zip(fast, slow, strict=True):
            assert a.shape == (3, 48, 48)
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_simplejpeg
def test_greyscale_jpeg_gives_rgb_equal_to_pillow(tmp_path):
    grey = _photo(160, 120).convert("L")
    data = _jpeg(grey)
    enc = EncodedJPEG.parse(data)
    assert enc is not None
    out = Resize((120, 160))(enc)  # same size: the decoded pixels themselves
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=float)
    assert out.shape == (3, 120, 160)
    np.testing.assert_array_equal(_hwc(out), ref)
    root = _folder(tmp_path / "ds", {"g.jpg": data})
    (x,) = _outputs(root, train_transforms(40, lighting=0.0), "simplejpeg")
    assert x.shape == (3, 40, 40)
    # The three channels are the same grey, so each normalized channel is an affine map of one.
    r, g = x[0] * STD[0] + MEAN[0], x[1] * STD[1] + MEAN[1]
    torch.testing.assert_close(r, g, rtol=0, atol=1e-3)


@needs_simplejpeg
def test_file_simplejpeg_refuses_is_decoded_by_pillow(tmp_path):
    # Extraneous bytes before EOI: libjpeg-turbo warns ("Corrupt JPEG data"), which
    # simplejpeg's strict mode raises; Pillow decodes it. The fallback gives Pillow's crop.
    data = _jpeg(_photo(200, 150))
    data = data[:-2] + b"\x00\x17\x00\x00" + data[-2:]
    enc = EncodedJPEG.parse(data)
    assert enc is not None
    with pytest.raises(ValueError):
        enc.decode(1)
    root = _folder(tmp_path / "ds", {"x.jpg": data})
    for tf in (train_transforms(64), eval_transforms(64)):
        fast = _outputs(root, tf, "simplejpeg")
        slow = _outputs(root, tf, "pillow")
        torch.testing.assert_close(fast[0], slow[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", ["pillow", "simplejpeg"])
def test_corrupt_jpegs_raise_naming_the_file(tmp_path, backend):
    if backend == "simplejpeg" and not jpeg.available():
        pytest.skip("simplejpeg not installed")
    noise = np.random.default_rng(0).integers(0, 256, (150, 200, 3), dtype=np.uint8)
    full = _jpeg(Image.fromarray(noise))
    root = tmp_path / "ds"
    (root / "a").mkdir(parents=True)
    truncated = root / "a" / "cut.jpg"
    truncated.write_bytes(full[: len(full) // 2])
    garbage = root / "a" / "junk.jpg"
    garbage.write_bytes(b"\xff\xd8\xff" + bytes(range(256)) * 4)
    jpeg.set_backend(backend)
    ds = ImageFolder(root, train_transforms(32))
    by_name = {Path(p).name: i for i, (p, _) in enumerate(ds.samples)}
    with pytest.raises(BadImageError, match="truncated") as err:
        ds[by_name["cut.jpg"]]
    assert str(truncated) in str(err.value)
    with pytest.raises(BadImageError) as err:
        ds[by_name["junk.jpg"]]
    assert str(garbage) in str(err.value)


# ------------------------------------------------------------------------ choosing


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(jpeg.ENV_VAR, raising=False)
    assert jpeg.backend() == ("simplejpeg" if jpeg.available() else "pillow")
    monkeypatch.setenv(jpeg.ENV_VAR, "pillow")
    assert jpeg.backend() == "pillow"
    monkeypatch.setenv(jpeg.ENV_VAR, "turbo")
    with pytest.raises(ValueError, match="auto, simplejpeg, pillow"):
        jpeg.backend()
    jpeg.set_backend("pillow")  # the switch wins over the variable
    assert jpeg.backend() == "pillow"
    with pytest.raises(ValueError, match="unknown JPEG backend"):
        jpeg.set_backend("libjpeg")
    monkeypatch.setattr(jpeg, "simplejpeg", None)  # as without the fast-jpeg extra
    jpeg.set_backend("auto")
    assert jpeg.backend() == "pillow"
    assert EncodedJPEG.parse(_jpeg(_photo(16, 16))) is None
    with pytest.raises(ImportError, match="pip install simplejpeg"):
        jpeg.set_backend("simplejpeg")


def test_dct_scale_is_pillows_draft_rule():
    data = _jpeg(_photo(640, 480))
    for want in ((640, 480), (320, 240), (319, 200), (160, 120), (100, 100), (80, 60), (10, 10)):
        img = Image.open(io.BytesIO(data))
        _, box = img.draft("RGB", want)
        assert dct_scale(640, 480, *want) == round(640 / box[2]), want


def test_compose_takes_encoded_jpegs_only_when_every_step_takes_tensors():
    assert train_transforms(32).accepts_encoded_jpeg
    assert eval_transforms(32).accepts_encoded_jpeg

    def pil_only(img: Image.Image) -> Image.Image:
        return img.rotate(90)

    assert not Compose([RandomResizedCrop(32), pil_only, ToTensor()]).accepts_encoded_jpeg
    assert Compose([RandomResizedCrop(32), ToTensor(), pil_only]).accepts_encoded_jpeg
    assert not Compose([ToTensor()]).accepts_encoded_jpeg


@needs_simplejpeg
def test_reused_decode_buffer_does_not_leak_into_results():
    a, b = _jpeg(_photo(64, 48, seed=1)), _jpeg(_photo(64, 48, seed=2))
    same = Resize((48, 64))  # output = decoded size: returned without resizing
    first = same(EncodedJPEG.parse(a)).clone()
    kept = same(EncodedJPEG.parse(a))
    same(EncodedJPEG.parse(b))  # decodes into the same scratch buffer
    assert torch.equal(kept, first)


# ------------------------------------------------------------------------ tensor side


def test_to_tensor_takes_uint8_tensors_and_returns_contiguous():
    img = _photo(30, 20)
    ref = ToTensor()(img)
    assert ref.is_contiguous() and ref.shape == (3, 20, 30)
    chw = torch.from_numpy(np.array(img)).permute(2, 0, 1)  # a strided view
    torch.testing.assert_close(ToTensor()(chw), ref, rtol=0, atol=0)
    with pytest.raises(TypeError, match="uint8"):
        ToTensor()(ref)


def _np_gray(x: np.ndarray) -> np.ndarray:
    return 0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2]


@pytest.mark.parametrize("inplace", [False, True])
def test_photometric_steps_match_numpy_and_respect_inplace(inplace):
    x = ToTensor()(_photo(40, 30))
    x[:, :3, :3] = 1.0  # saturated pixels: the clamps matter
    keep = x.clone()
    jitter = ColorJitter(0.4, 0.4, 0.4, inplace=inplace)
    light = Lighting(0.1, inplace=inplace)
    norm = Normalize(MEAN, STD, inplace=inplace)
    torch.manual_seed(5)
    out = norm(light(jitter(x)))
    # numpy reference with the same draws, in the same order
    torch.manual_seed(5)
    order = torch.randperm(3).tolist()
    factors = [0.6 + 0.8 * torch.rand(()).item() for _ in order]
    alpha = (torch.randn(3) * 0.1).numpy().astype(np.float64)
    ref = keep.double().numpy()
    for op, a in zip(order, factors, strict=True):
        if op == 0:
            ref = a * ref
        elif op == 1:
            ref = a * ref + (1 - a) * _np_gray(ref).mean()
        else:
            ref = a * ref + (1 - a) * _np_gray(ref)[None]
        ref = np.clip(ref, 0, 1)
    eigval = np.array([55.46, 4.794, 1.148])
    eigvec = np.array(
        [(-0.5675, 0.7192, 0.4009), (-0.5808, -0.0045, -0.8140), (-0.5836, -0.6948, 0.4203)]
    )
    ref = np.clip(ref + (eigvec @ (alpha * eigval) / 255.0)[:, None, None], 0, 1)
    ref = (255 * ref - np.array(MEAN)[:, None, None]) / np.array(STD)[:, None, None]
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-4)
    if inplace:
        assert out.data_ptr() == x.data_ptr()
    else:
        assert torch.equal(x, keep) and out.data_ptr() != x.data_ptr()
