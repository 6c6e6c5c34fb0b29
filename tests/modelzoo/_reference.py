"""Reference formulas the tests compare the library with (written out, not imported)."""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image
from torch import nn


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


def randomize_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """BatchNorm running statistics and affine parameters far from their initial 0 and 1, so
    that eval-mode BatchNorm is really exercised; the model's mode is left as it is."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.running_mean.copy_(torch.rand(n, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.rand(n, generator=g) - 0.5)
    return model
