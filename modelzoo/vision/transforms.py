"""Image transforms for ImageNet-style training and evaluation, without torchvision.

The pipelines reproduce GluonCV's ``train_imagenet.py`` preprocessing:

- train: ``RandomResizedCrop(224)`` (Inception crop, Szegedy et al. 2015,
  https://arxiv.org/abs/1409.4842), horizontal flip, colour jitter 0.4, AlexNet PCA
  lighting 0.1 (Krizhevsky et al. 2012), normalize;
- eval: resize the short side to ``ceil(input_size / crop_ratio)``, centre crop
  ``input_size``, normalize.

Geometric transforms take PIL images (flip and centre crop also ``(3, H, W)`` tensors);
photometric ones take the float tensors that :class:`ToTensor` makes. Conventions:

- ``ToTensor`` gives ``float32`` tensors of shape ``(C, H, W)`` with values in ``[0, 1]``.
- ``Normalize`` takes ``mean``/``std`` in **0-255 units**, like GluonCV's
  ``--rgb-mean 123.68,116.779,103.939 --rgb-std 58.393,57.12,57.375``; it computes
  ``(255 * x - mean) / std``.
- All randomness comes from torch's global RNG (``torch.manual_seed`` makes a sample
  reproducible); nothing here uses ``random`` or ``numpy.random``.

Fast JPEG decoding: :class:`RandomResizedCrop` and :class:`Resize` accept a *lazily
opened* PIL image (``Image.open`` without ``load()``). They first choose the output
geometry from the header's size, then ask libjpeg (Pillow's ``draft``) to decode at the
smallest DCT scale (1/2, 1/4, 1/8) that still leaves at least as many pixels as the output
needs, and map the crop box into the reduced image with sub-pixel precision. The random
draws and the geometry are therefore exactly those of a full decode; only the pixels
differ, by the (small) difference between DCT-domain downscaling and Pillow's filter.
A :class:`Compose` whose first transform accepts lazy images advertises it through
``accepts_lazy_image``; the datasets in :mod:`modelzoo.vision.data` use that flag.

With the optional simplejpeg package (the ``fast-jpeg`` extra) the same two transforms also
take an :class:`~modelzoo.vision.jpeg.EncodedJPEG`: the file's bytes, decoded by
libjpeg-turbo at the same DCT scale, then cropped and resized by torch's antialiased uint8
resize (the same filter as Pillow's, within rounding). They return a ``(3, H, W)`` uint8
tensor then, which :class:`RandomHorizontalFlip`, :class:`CenterCrop` and :class:`ToTensor`
take as they take PIL images, so no PIL image is made. A :class:`Compose` advertises
``accepts_encoded_jpeg`` when its first transform takes encoded JPEGs and every transform up
to :class:`ToTensor` takes uint8 tensors (``accepts_uint8_tensor``). The random draws and
the crop box are those of the Pillow path; :mod:`modelzoo.vision.jpeg` describes the
backends and how to choose one.

Example:
    >>> from PIL import Image
    >>> from modelzoo.vision.transforms import eval_transforms
    >>> tf = eval_transforms(224)
    >>> x = tf(Image.new("RGB", (500, 375)))
    >>> tuple(x.shape)
    (3, 224, 224)
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from modelzoo.vision import resample as resample_native
from modelzoo.vision.jpeg import EncodedJPEG, dct_scale

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGENET_EIGVAL",
    "IMAGENET_EIGVEC",
    "ImageDecodeError",
    "decode_rgb",
    "Compose",
    "RandomResizedCrop",
    "RandomHorizontalFlip",
    "Resize",
    "CenterCrop",
    "ToTensor",
    "ColorJitter",
    "Lighting",
    "Normalize",
    "train_transforms",
    "eval_transforms",
]

#: ImageNet RGB mean and std in 0-255 units (GluonCV's ``--rgb-mean``/``--rgb-std``).
IMAGENET_MEAN = (123.68, 116.779, 103.939)
IMAGENET_STD = (58.393, 57.12, 57.375)
#: ImageNet RGB PCA in 0-255 units, as in MXNet's ``RandomLighting`` (used by GluonCV).
IMAGENET_EIGVAL = (55.46, 4.794, 1.148)
IMAGENET_EIGVEC = (
    (-0.5675, 0.7192, 0.4009),
    (-0.5808, -0.0045, -0.8140),
    (-0.5836, -0.6948, 0.4203),
)

_INTERPOLATION = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}

# Exceptions Pillow raises for undecodable or truncated image data.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)


class ImageDecodeError(OSError):
    """Pillow could not decode the pixel data (truncated or corrupt file)."""


def decode_rgb(
    img: Image.Image, draft_size: tuple[int, int] | None = None
) -> tuple[Image.Image, float, float]:
    """Decode a (possibly lazily opened) PIL image to RGB.

    Args:
        img: a PIL image; if it is a JPEG that is not loaded yet and ``draft_size`` is given,
            libjpeg decodes it at the smallest DCT scale whose result is at least
            ``draft_size`` = ``(width, height)``.
        draft_size: minimum decoded size, or ``None`` for a full decode.

    Returns:
        ``(rgb, sx, sy)``: the decoded RGB image and the factors that map its pixel
        coordinates to the original ones (``x_original = sx * x_decoded``); 1.0 unless
        draft mode reduced the image.

    Raises:
        ImageDecodeError: the pixel data could not be decoded.
    """
    width, height = img.size
    sx = sy = 1.0
    try:
        if draft_size is not None and img.format == "JPEG":
            request = (max(1, int(draft_size[0])), max(1, int(draft_size[1])))
            drafted = img.draft("RGB", request)
            if drafted is not None:
                box = drafted[1]
                sx, sy = width / box[2], height / box[3]
        if img.mode == "RGB":
            img.load()
        else:
            img = img.convert("RGB")
    except _DECODE_ERRORS as err:
        raise ImageDecodeError(f"{type(err).__name__}: {err}") from err
    return img, sx, sy


def _hwc_to_chw(arr: np.ndarray) -> torch.Tensor:
    """``(H, W, 3)`` uint8 array -> ``(3, H, W)`` uint8 tensor (a view when ``arr`` is
    writable; numpy views of Pillow images are read-only and are copied)."""
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr).permute(2, 0, 1)


def _resize_array(
    arr: np.ndarray,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    resample: Image.Resampling,
) -> torch.Tensor:
    """Resize the ``box`` (left, top, right, bottom) of an RGB ``(H, W, 3)`` uint8 array to
    ``size`` = ``(width, height)``; returns a ``(3, height, width)`` uint8 tensor.

    A whole-pixel box with the bilinear filter goes through torch's antialiased uint8 resize
    on a view of the box (no copy; Pillow's filter within rounding, about 3x faster than
    Pillow here). A fractional box (a DCT-scaled decode) with the bilinear filter goes
    through :func:`modelzoo.vision.resample.resize_bilinear_chw` (Pillow's arithmetic in C,
    about 4x faster than Pillow on a 224 crop). Without that kernel, or with another filter,
    Pillow resizes, given only the rows and columns its filter reads, so the result equals
    Pillow's on the whole array.
    """
    out_w, out_h = size
    left, top, right, bottom = box
    if resample == Image.Resampling.BILINEAR and all(float(v).is_integer() for v in box):
        x = _hwc_to_chw(arr)[None, :, int(top) : int(bottom), int(left) : int(right)]  # (1,3,h,w)
        return F.interpolate(x, size=(out_h, out_w), mode="bilinear", antialias=True)[0]
    if resample == Image.Resampling.BILINEAR and resample_native.available():
        return resample_native.resize_bilinear_chw(arr, box, size)
    height, width = arr.shape[:2]
    # Pillow's widest filter (lanczos) reads 3 input pixels per unit of downscaling.
    mx = math.ceil(3 * max((right - left) / out_w, 1.0)) + 2
    my = math.ceil(3 * max((bottom - top) / out_h, 1.0)) + 2
    x0, y0 = max(0, math.floor(left) - mx), max(0, math.floor(top) - my)
    x1, y1 = min(width, math.ceil(right) + mx), min(height, math.ceil(bottom) + my)
    region = Image.fromarray(arr[y0:y1, x0:x1])
    out = region.resize(size, resample, box=(left - x0, top - y0, right - x0, bottom - y0))
    return _hwc_to_chw(np.array(out))


def _decode_crop_resize(
    jpeg: EncodedJPEG,
    min_size: tuple[int, int],
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    resample: Image.Resampling,
    *,
    fast: bool,
) -> torch.Tensor:
    """Decode ``jpeg`` with libjpeg-turbo at the DCT scale Pillow's draft would use for
    ``min_size``, then resize ``box`` (original-image coordinates) to ``size`` =
    ``(width, height)``; returns a ``(3, height, width)`` uint8 tensor.

    If libjpeg-turbo refuses the data (its strict mode also rejects some files Pillow
    decodes with a warning), Pillow decodes the same crop, or raises
    :class:`ImageDecodeError` as for any other file.
    """
    scale = dct_scale(jpeg.width, jpeg.height, *min_size)
    bilinear = resample == Image.Resampling.BILINEAR
    if scale == 2 and bilinear and any(v % 2 for v in box) and not resample_native.available():
        # At 1/2 scale the box has half pixels, which then only Pillow's resize takes (~2-3x
        # slower than torch's); libjpeg-turbo's 1/2 decode saves less than that (entropy
        # decoding, which no DCT scale shortens, dominates), so decode the whole image and
        # resize the whole-pixel box with torch. 1/4 and 1/8 still pay off.
        scale = 1
    try:
        arr = jpeg.decode(scale, fast=fast, scratch=True)  # (H / scale, W / scale, 3), reused
    except ValueError:
        try:
            img = Image.open(io.BytesIO(jpeg.data))
        except _DECODE_ERRORS as err:
            raise ImageDecodeError(f"{type(err).__name__}: {err}") from err
        rgb, sx, sy = decode_rgb(img, min_size)
        pil_box = (box[0] / sx, box[1] / sy, box[2] / sx, box[3] / sy)
        return _hwc_to_chw(np.array(rgb.resize(size, resample, box=pil_box)))
    height, width = arr.shape[:2]
    scaled = (box[0] / scale, box[1] / scale, box[2] / scale, box[3] / scale)
    if scaled == (0, 0, width, height) and size == (width, height):
        return _hwc_to_chw(arr.copy())  # arr is the decoder's reused buffer
    return _resize_array(arr, scaled, size, resample)


def _pair(size: int | Sequence[int], name: str) -> tuple[int, int]:
    """Return ``(height, width)`` from an int or a ``(height, width)`` pair."""
    if isinstance(size, int):
        pair = (size, size)
    else:
        pair = tuple(int(s) for s in size)
        if len(pair) != 2:
            raise ValueError(f"{name}: size must be an int or (height, width), got {size!r}")
    if min(pair) <= 0:
        raise ValueError(f"{name}: size must be positive, got {size!r}")
    return pair  # type: ignore[return-value]


def _interpolation(name: str) -> Image.Resampling:
    if name not in _INTERPOLATION:
        raise ValueError(
            f"unknown interpolation {name!r}; choose one of {', '.join(sorted(_INTERPOLATION))}"
        )
    return _INTERPOLATION[name]


def _uniform(low: float, high: float) -> float:
    return low + (high - low) * torch.rand(()).item()


class Compose:
    """Apply transforms in order.

    Args:
        transforms: callables applied one after another.
    """

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    @property
    def accepts_lazy_image(self) -> bool:
        """Whether the first transform can take a lazily opened PIL image (draft decode)."""
        return bool(self.transforms) and getattr(self.transforms[0], "accepts_lazy_image", False)

    @property
    def accepts_encoded_jpeg(self) -> bool:
        """Whether the first transform can take an :class:`~modelzoo.vision.jpeg.EncodedJPEG`
        and every later one up to :class:`ToTensor` the uint8 tensor it then returns."""
        if not self.transforms or not getattr(self.transforms[0], "accepts_encoded_jpeg", False):
            return False
        for t in self.transforms[1:]:
            if not getattr(t, "accepts_uint8_tensor", False):
                return False
            if isinstance(t, ToTensor):
                break
        return True

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x

    def __repr__(self) -> str:
        body = "".join(f"\n    {t!r}," for t in self.transforms)
        return f"{type(self).__name__}([{body}\n])"


class RandomResizedCrop:
    """Crop a random area and aspect ratio, then resize to ``size`` (the Inception crop).

    The area fraction is drawn uniformly from ``scale`` and the aspect ratio
    log-uniformly from ``ratio``; up to 10 attempts, then a centre crop clamped to
    ``ratio`` (the algorithm of GluonCV/torchvision). Takes a PIL image (loaded or lazily
    opened; JPEGs are decoded in draft mode at the smallest scale that keeps at least
    ``size`` pixels inside the crop) or an :class:`~modelzoo.vision.jpeg.EncodedJPEG`
    (decoded by libjpeg-turbo at that scale with its fast DCT and upsampling). Returns an RGB
    PIL image of ``size``, or for an ``EncodedJPEG`` a ``(3, height, width)`` uint8 tensor.

    Args:
        size: output size, an int or ``(height, width)``.
        scale: bounds of the crop area as a fraction of the image area.
        ratio: bounds of the crop aspect ratio (width / height).
        interpolation: ``"bilinear"`` (default), ``"bicubic"``, ``"nearest"`` or ``"lanczos"``.
    """

    accepts_lazy_image = True
    accepts_encoded_jpeg = True

    def __init__(
        self,
        size: int | Sequence[int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        interpolation: str = "bilinear",
    ) -> None:
        self.size = _pair(size, "RandomResizedCrop")
        if not (0 < scale[0] <= scale[1] <= 1):
            raise ValueError(f"RandomResizedCrop: need 0 < scale[0] <= scale[1] <= 1, got {scale}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"RandomResizedCrop: need 0 < ratio[0] <= ratio[1], got {ratio}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.interpolation = interpolation
        self._resample = _interpolation(interpolation)

    @staticmethod
    def get_params(
        width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float]
    ) -> tuple[int, int, int, int]:
        """Draw a crop ``(top, left, height, width)`` for an image of ``width`` x ``height``."""
        area = width * height
        log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        for _ in range(10):
            target_area = area * _uniform(scale[0], scale[1])
            aspect = math.exp(_uniform(log_ratio[0], log_ratio[1]))
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, ()).item())
                left = int(torch.randint(0, width - w + 1, ()).item())
                return top, left, h, w
        # Fallback: the largest centred crop whose aspect ratio lies within `ratio`.
        in_ratio = width / height
        if in_ratio < ratio[0]:
            w = width
            h = int(round(w / ratio[0]))
        elif in_ratio > ratio[1]:
            h = height
            w = int(round(h * ratio[1]))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img: Image.Image | EncodedJPEG) -> Image.Image | torch.Tensor:
        out_h, out_w = self.size
        top, left, h, w = self.get_params(img.width, img.height, self.scale, self.ratio)
        # Decoded size such that the crop still spans >= (out_w, out_h) pixels.
        draft = (math.ceil(img.width * out_w / w), math.ceil(img.height * out_h / h))
        if isinstance(img, EncodedJPEG):
            box = (left, top, left + w, top + h)
            return _decode_crop_resize(img, draft, box, (out_w, out_h), self._resample, fast=True)
        img, sx, sy = decode_rgb(img, draft)
        box = (left / sx, top / sy, (left + w) / sx, (top + h) / sy)
        return img.resize((out_w, out_h), self._resample, box=box)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, scale={self.scale}, "
            f"ratio=({self.ratio[0]:.4f}, {self.ratio[1]:.4f}), "
            f"interpolation={self.interpolation!r})"
        )


class Resize:
    """Resize a PIL image.

    An int ``size`` sets the shorter side, keeping the aspect ratio (the longer side is
    ``size * long // short``, as GluonCV's ``Resize(keep_ratio=True)``); a pair sets
    ``(height, width)``. Takes a loaded or lazily opened PIL image (JPEGs are decoded in
    draft mode at the smallest scale that is still at least the output size) or an
    :class:`~modelzoo.vision.jpeg.EncodedJPEG` (libjpeg-turbo at that scale, with its
    accurate DCT and upsampling: Pillow's pixels). Returns an RGB PIL image, or for an
    ``EncodedJPEG`` a ``(3, H, W)`` uint8 tensor.

    Args:
        size: shorter-side length, or ``(height, width)``.
        interpolation: ``"bilinear"`` (default), ``"bicubic"``, ``"nearest"`` or ``"lanczos"``.
    """

    accepts_lazy_image = True
    accepts_encoded_jpeg = True

    def __init__(self, size: int | Sequence[int], interpolation: str = "bilinear") -> None:
        if isinstance(size, int):
            if size <= 0:
                raise ValueError(f"Resize: size must be positive, got {size}")
            self.size: int | tuple[int, int] = size
        else:
            self.size = _pair(size, "Resize")
        self.interpolation = interpolation
        self._resample = _interpolation(interpolation)

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """Output ``(width, height)`` for an input of ``width`` x ``height``."""
        if isinstance(self.size, int):
            if width <= height:
                return self.size, self.size * height // width
            return self.size * width // height, self.size
        return self.size[1], self.size[0]

    def __call__(self, img: Image.Image | EncodedJPEG) -> Image.Image | torch.Tensor:
        out_w, out_h = self.output_size(img.width, img.height)
        width, height = img.size
        if isinstance(img, EncodedJPEG):
            box = (0, 0, width, height)
            return _decode_crop_resize(
                img, (out_w, out_h), box, (out_w, out_h), self._resample, fast=False
            )
        img, sx, sy = decode_rgb(img, (out_w, out_h))
        if (out_w, out_h) == img.size and sx == sy == 1.0:
            return img
        return img.resize((out_w, out_h), self._resample, box=(0, 0, width / sx, height / sy))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, interpolation={self.interpolation!r})"


class CenterCrop:
    """Crop the centre of a PIL image or a ``(..., H, W)`` tensor.

    The top-left corner is ``((H - h) // 2, (W - w) // 2)`` (GluonCV's ``center_crop``
    rounding). Raises if the input is smaller than the crop.

    Args:
        size: crop size, an int or ``(height, width)``.
    """

    accepts_uint8_tensor = True

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = _pair(size, "CenterCrop")

    def __call__(self, img: Image.Image | torch.Tensor) -> Image.Image | torch.Tensor:
        h, w = self.size
        if isinstance(img, torch.Tensor):
            height, width = img.shape[-2:]
        else:
            width, height = img.size
        if h > height or w > width:
            raise ValueError(
                f"CenterCrop: crop {h}x{w} is larger than the image {height}x{width}; "
                "resize the image first (e.g. Resize before CenterCrop)"
            )
        top, left = (height - h) // 2, (width - w) // 2
        if isinstance(img, torch.Tensor):
            return img[..., top : top + h, left : left + w]
        return img.crop((left, top, left + w, top + h))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size})"


class RandomHorizontalFlip:
    """Flip a PIL image or a ``(..., H, W)`` tensor left-right with probability ``p``."""

    accepts_uint8_tensor = True

    def __init__(self, p: float = 0.5) -> None:
        if not 0 <= p <= 1:
            raise ValueError(f"RandomHorizontalFlip: p must be in [0, 1], got {p}")
        self.p = p

    def __call__(self, img: Image.Image | torch.Tensor) -> Image.Image | torch.Tensor:
        if torch.rand(()).item() >= self.p:
            return img
        if isinstance(img, torch.Tensor):
            return img.flip(-1)
        return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(p={self.p})"


class ToTensor:
    """PIL image (``H x W`` pixels, mode RGB or L) or ``(C, H, W)`` uint8 tensor -> contiguous
    ``float32`` tensor ``(C, H, W)`` in [0, 1].

    The result is contiguous in ``(C, H, W)`` order: the photometric transforms after it run
    about twice as fast on it as on the channels-last view of the pixels.
    """

    accepts_uint8_tensor = True

    def __call__(self, img: Image.Image | torch.Tensor) -> torch.Tensor:
        if isinstance(img, torch.Tensor):
            if img.dtype != torch.uint8 or img.dim() != 3:
                raise TypeError(
                    f"ToTensor takes PIL images or (C, H, W) uint8 tensors, got a {img.dtype} "
                    f"tensor of shape {tuple(img.shape)}"
                )
            x = img
        else:
            if img.mode not in ("RGB", "L"):
                img = img.convert("RGB")
            arr = np.array(img, dtype=np.uint8, copy=True)  # (H, W[, C])
            if arr.ndim == 2:
                arr = arr[:, :, None]
            x = torch.from_numpy(arr).permute(2, 0, 1)  # (C, H, W) view
        # One pass: uint8 -> float32 / 255, written in (C, H, W) order.
        return torch.div(x, 255.0, out=torch.empty(x.shape, dtype=torch.float32))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _require_tensor(x: Any, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} works on (3, H, W) float tensors in [0, 1]; put it after ToTensor")
    if x.dim() < 3 or x.shape[-3] != 3:
        raise ValueError(f"{name} expects a (..., 3, H, W) RGB tensor, got shape {tuple(x.shape)}")
    return x


_GRAY = torch.tensor([0.299, 0.587, 0.114])  # ITU-R 601 luma, as MXNet's image ops


def _gray(x: torch.Tensor) -> torch.Tensor:
    """Luma of a ``(..., 3, H, W)`` tensor, shape ``(..., 1, H, W)``."""
    if x.dim() == 3 and x.is_contiguous():  # one sample: a (3,) x (3, H*W) product, no copy
        return (_GRAY.to(x.dtype) @ x.view(3, -1)).view(1, *x.shape[1:])
    return torch.tensordot(x, _GRAY.to(x.dtype), dims=([-3], [0])).unsqueeze(-3)


class ColorJitter:
    """Random brightness, contrast and saturation, in random order (MXNet/GluonCV semantics).

    Each enabled adjustment draws a factor ``a ~ U[1 - s, 1 + s]`` and blends the image
    with a reference, clamping to [0, 1] after each step:
    brightness ``a * x``; contrast ``a * x + (1 - a) * mean(gray(x))``;
    saturation ``a * x + (1 - a) * gray(x)``, with ``gray = 0.299 R + 0.587 G + 0.114 B``.
    The order is a random permutation, as in MXNet's ``RandomColorJitter``.

    Args:
        brightness: jitter strength for brightness (GluonCV's ``jitter_param`` 0.4).
        contrast: jitter strength for contrast.
        saturation: jitter strength for saturation.
        inplace: modify the input tensor instead of copying it first (saves an allocation;
            :func:`train_transforms` uses it on :class:`ToTensor`'s fresh output).
    """

    def __init__(
        self,
        brightness: float = 0.0,
        contrast: float = 0.0,
        saturation: float = 0.0,
        inplace: bool = False,
    ):
        for name, value in (
            ("brightness", brightness),
            ("contrast", contrast),
            ("saturation", saturation),
        ):
            if not 0 <= value <= 1:
                raise ValueError(f"ColorJitter: {name} must be in [0, 1], got {value}")
        self.brightness = float(brightness)
        self.contrast = float(contrast)
        self.saturation = float(saturation)
        self.inplace = bool(inplace)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = _require_tensor(x, "ColorJitter")
        strengths = (self.brightness, self.contrast, self.saturation)
        owned = self.inplace  # otherwise the caller's tensor is kept: copy on the first step
        for op in torch.randperm(3).tolist():
            s = strengths[op]
            if s == 0:
                continue
            a = _uniform(1.0 - s, 1.0 + s)
            if op == 0:
                x = x.mul_(a) if owned else x.mul(a)
            else:
                if op == 1:  # the image's mean luma = luma of the channel means
                    ref = x.mean(dim=(-2, -1)) @ _GRAY.to(x.dtype)
                    ref = ref.view(*ref.shape, 1, 1, 1)
                else:
                    ref = _gray(x)
                # a x + (1 - a) ref in one pass: x + (1 - a) (ref - x)
                x = x.lerp_(ref, 1.0 - a) if owned else torch.lerp(x, ref, 1.0 - a)
            owned = True
            x.clamp_(0.0, 1.0)
        return x

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(brightness={self.brightness}, contrast={self.contrast}, "
            f"saturation={self.saturation}, inplace={self.inplace})"
        )


class Lighting:
    """AlexNet-style PCA lighting noise (Krizhevsky et al. 2012), as MXNet's ``RandomLighting``.

    Draws ``alpha ~ N(0, alphastd^2)`` (3 values) and adds to every pixel the RGB offset
    ``eigvec @ (alpha * eigval) / 255`` (the PCA is in 0-255 units, the tensor in [0, 1]),
    then clamps to [0, 1].

    Args:
        alphastd: standard deviation of the PCA coefficients (GluonCV's 0.1).
        eigval: PCA eigenvalues in 0-255 units (ImageNet's by default).
        eigvec: PCA eigenvectors, one per column (``eigvec[c][k]``: channel ``c``, component ``k``).
        inplace: add to the input tensor instead of a copy of it.
    """

    def __init__(
        self,
        alphastd: float = 0.1,
        eigval: Sequence[float] = IMAGENET_EIGVAL,
        eigvec: Sequence[Sequence[float]] = IMAGENET_EIGVEC,
        inplace: bool = False,
    ) -> None:
        if alphastd < 0:
            raise ValueError(f"Lighting: alphastd must be >= 0, got {alphastd}")
        self.alphastd = float(alphastd)
        self.inplace = bool(inplace)
        self.eigval = torch.tensor(eigval, dtype=torch.float32)
        self.eigvec = torch.tensor(eigvec, dtype=torch.float32)
        if self.eigval.shape != (3,) or self.eigvec.shape != (3, 3):
            raise ValueError("Lighting: eigval must have 3 values and eigvec be 3x3")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = _require_tensor(x, "Lighting")
        if self.alphastd == 0:
            return x
        alpha = torch.randn(3) * self.alphastd
        rgb = (self.eigvec @ (alpha * self.eigval)) / 255.0  # (3,)
        rgb = rgb.to(x.dtype).view(3, 1, 1)
        x = x.add_(rgb) if self.inplace else torch.add(x, rgb)
        return x.clamp_(0.0, 1.0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(alphastd={self.alphastd}, inplace={self.inplace})"


class Normalize:
    """``(255 * x - mean) / std`` per channel, with ``mean``/``std`` in **0-255 units**.

    Takes the [0, 1] tensors of :class:`ToTensor`; ``mean``/``std`` are given like
    GluonCV's ``--rgb-mean 123.68,116.779,103.939 --rgb-std 58.393,57.12,57.375``.
    Values that look like 0-1 units (all <= 1) are rejected with a hint, since they
    would silently produce a wrongly scaled input.

    Args:
        mean: per-channel mean in 0-255 units.
        std: per-channel standard deviation in 0-255 units.
        inplace: normalize the input tensor itself instead of a copy.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], inplace: bool = False) -> None:
        mean_t = torch.tensor(mean, dtype=torch.float32).flatten()
        std_t = torch.tensor(std, dtype=torch.float32).flatten()
        if mean_t.numel() != std_t.numel():
            raise ValueError(f"Normalize: mean {tuple(mean)} and std {tuple(std)} differ in length")
        if (std_t <= 0).any():
            raise ValueError(f"Normalize: std must be positive, got {tuple(std)}")
        if (mean_t.abs() <= 1).all() and (std_t <= 1).all():
            raise ValueError(
                f"Normalize: mean={tuple(mean)}, std={tuple(std)} look like 0-1 units; this "
                "library takes 0-255 units (e.g. mean 123.68,116.779,103.939 and std "
                "58.393,57.12,57.375): multiply them by 255"
            )
        self.mean = tuple(float(m) for m in mean_t)
        self.std = tuple(float(s) for s in std_t)
        self.inplace = bool(inplace)
        # (255 x - mean) / std = x * scale + shift
        self._scale = (255.0 / std_t).view(-1, 1, 1)
        self._shift = (-mean_t / std_t).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError("Normalize works on float tensors in [0, 1]; put it after ToTensor")
        # x * scale + shift as two passes: ~3x faster on CPU than one broadcasting addcmul
        # (the same values to within one float32 rounding).
        scale = self._scale.to(x.dtype)
        x = x.mul_(scale) if self.inplace else x.mul(scale)
        return x.add_(self._shift.to(x.dtype))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mean={self.mean}, std={self.std}, inplace={self.inplace})"


def train_transforms(
    input_size: int = 224,
    *,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    jitter: float = 0.4,
    lighting: float = 0.1,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
    hflip: float = 0.5,
) -> Compose:
    """GluonCV's ImageNet training transform.

    ``RandomResizedCrop(input_size)`` -> flip (probability ``hflip``) -> ``ToTensor`` ->
    ``ColorJitter(jitter)`` -> ``Lighting(lighting)`` -> ``Normalize(mean, std)``; a zero
    ``hflip``, ``jitter`` or ``lighting`` drops that step (mirrored digits or text are other
    classes, so their recipes use ``hflip=0``). ``mean``/``std`` are in 0-255 units. The
    steps after ``ToTensor`` work in place on its fresh tensor.
    """
    steps: list[Callable[[Any], Any]] = [RandomResizedCrop(input_size, scale=scale, ratio=ratio)]
    if hflip > 0:
        steps.append(RandomHorizontalFlip(hflip))
    steps.append(ToTensor())
    if jitter > 0:
        steps.append(
            ColorJitter(brightness=jitter, contrast=jitter, saturation=jitter, inplace=True)
        )
    if lighting > 0:
        steps.append(Lighting(lighting, inplace=True))
    steps.append(Normalize(mean, std, inplace=True))
    return Compose(steps)


def eval_transforms(
    input_size: int = 224,
    *,
    crop_ratio: float = 0.875,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> Compose:
    """GluonCV's ImageNet evaluation transform.

    Resize the shorter side to ``ceil(input_size / crop_ratio)`` (256 for 224), centre
    crop ``input_size``, ``ToTensor``, ``Normalize(mean, std)`` (0-255 units).
    """
    if not 0 < crop_ratio <= 1:
        raise ValueError(f"eval_transforms: crop_ratio must be in (0, 1], got {crop_ratio}")
    resize = int(math.ceil(input_size / crop_ratio))
    return Compose(
        [Resize(resize), CenterCrop(input_size), ToTensor(), Normalize(mean, std, inplace=True)]
    )
