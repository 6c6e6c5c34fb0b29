"""Reference formulas the tests compare the library with (written out, not imported)."""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image


def reference_eval_preprocess(
    img: Image.Image, size: int, crop_ratio: float, mean: tuple, std: tuple
) -> torch.Tensor:
    """GluonCV's evaluation transform by hand, with PIL: shorter side to
    ``ceil(size / crop_ratio)`` (bilinear), centre crop ``size``, ``(x / 255 - mean) / std``
    with ``mean``/``std`` in [0, 1] units. Use images whose sizes make every step exact."""
    short = math.ceil(size / crop_ratio)
    w, h = img.size
    new = (short, h * short // w) if w <= h else (w * short // h, short)
    resized = img.convert("RGB").resize(new, Image.Resampling.BILINEAR)
    left, top = (new[0] - size) // 2, (new[1] - size) // 2
    crop = resized.crop((left, top, left + size, top + size))
    x = torch.from_numpy(np.array(crop)).permute(2, 0, 1).float() / 255
    m = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    return (x - m) / s


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
