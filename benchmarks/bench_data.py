"""Decode + augment throughput: our ImageFolder pipeline vs a plain Pillow pipeline.

Ours: ``ImageFolder`` + ``train_transforms`` / ``eval_transforms``. With simplejpeg installed
(the default ``--backend auto``) JPEGs are decoded by libjpeg-turbo at the smallest DCT scale
the crop allows (fast DCT and upsampling for training crops) and cropped/resized by torch's
antialiased uint8 resize; with ``--backend pillow``, Pillow's draft mode and resize.
Peer: what a hand-written Pillow loader does, as torchvision's PIL path does: open, full
decode, ``convert("RGB")``, crop, resize, flip, ``np.array`` -> tensor. Both draw the same
crops (same RNG, same seed per sample) and run the library's colour jitter, lighting and
normalization on the tensor they made, so the difference is decoding, geometry and the
tensor conversion.

Images: synthetic photo-like JPEGs (smooth colour fields, edges, sensor noise) at quality
90, written to a temporary folder. Each case runs ``--rounds`` paired rounds in one process,
alternating which side goes first; each prints min / median / max ms per image for both
sides and the ratio of medians. The last lines are ``benchmarks/_report.py``'s: the machine,
the spreads of the headline case (training, 224, on 500x375 images, ImageNet's typical
size) and ``ratio=<peer median / our median>`` for it. ``--json FILE`` also writes the
rounds, the ratio (target 1.25) and, under ``extra``, the 1280x960 training case (target 2.0)
and the other cases.

Usage: python benchmarks/bench_data.py [--images 200] [--rounds 7] [--backend auto]
       [--json benchmarks/results/bench_data.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import PIL
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report, beside this file

import _report  # noqa: E402

from modelzoo.vision import jpeg  # noqa: E402
from modelzoo.vision.data import ImageFolder  # noqa: E402
from modelzoo.vision.transforms import (  # noqa: E402
    ColorJitter,
    Lighting,
    Normalize,
    RandomResizedCrop,
    eval_transforms,
    train_transforms,
)

MEAN, STD = (123.68, 116.779, 103.939), (58.393, 57.12, 57.375)
TARGET_500 = 1.25  # train 224 on 500x375 images (issue 21, item 5)
TARGET_1280 = 2.0  # train 224 on 1280x960 images


def photo(width: int, height: int, rng: np.random.Generator) -> Image.Image:
    small = (rng.random((height // 24 + 2, width // 24 + 2, 3)) * 255).astype(np.uint8)
    a = np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC), dtype=float)
    yy, xx = np.mgrid[0:height, 0:width]
    a += 50 * (((xx // 37 + yy // 29) % 2) - 0.5)[..., None]  # hard edges
    a += rng.normal(0, 3, a.shape)  # sensor noise
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def make_folder(root: Path, n: int, size: tuple[int, int], seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for i in range(n):
        cls = root / f"class{i % 4}"
        cls.mkdir(parents=True, exist_ok=True)
        photo(*size, rng).save(cls / f"img{i:04d}.JPEG", quality=90)
    return root


class PlainPillowTrain:
    """Full decode, then the same crop/flip/jitter/lighting/normalize with plain Pillow/numpy."""

    def __init__(self, size: int):
        self.size = size
        self.jitter = ColorJitter(0.4, 0.4, 0.4)
        self.lighting = Lighting(0.1)
        self.normalize = Normalize(MEAN, STD)

    def __call__(self, path: str) -> torch.Tensor:
        img = Image.open(path).convert("RGB")
        top, left, h, w = RandomResizedCrop.get_params(
            img.width, img.height, (0.08, 1.0), (3 / 4, 4 / 3)
        )
        img = img.crop((left, top, left + w, top + h)).resize(
            (self.size, self.size), Image.BILINEAR
        )
        if torch.rand(()).item() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.array(img)).permute(2, 0, 1).float().div(255)
        return self.normalize(self.lighting(self.jitter(x)))


class PlainPillowEval:
    def __init__(self, size: int, crop_ratio: float = 0.875):
        self.size = size
        self.resize = int(math.ceil(size / crop_ratio))
        self.normalize = Normalize(MEAN, STD)

    def __call__(self, path: str) -> torch.Tensor:
        img = Image.open(path).convert("RGB")
        w, h = img.size
        s = self.resize
        tw, th = (s, s * h // w) if w <= h else (s * w // h, s)
        img = img.resize((tw, th), Image.BILINEAR)
        left, top = (tw - self.size) // 2, (th - self.size) // 2
        img = img.crop((left, top, left + self.size, top + self.size))
        x = torch.from_numpy(np.array(img)).permute(2, 0, 1).float().div(255)
        return self.normalize(x)


def run_ours(ds: ImageFolder) -> float:
    t0 = time.perf_counter()
    for i in range(len(ds)):
        torch.default_generator.manual_seed(i)  # CPU-only reseed: cheap
        ds[i]
    return time.perf_counter() - t0


def run_peer(paths: list[str], fn: Callable[[str], torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for i, p in enumerate(paths):
        torch.default_generator.manual_seed(i)  # CPU-only reseed: cheap
        fn(p)
    return time.perf_counter() - t0


def compare(
    name: str, root: Path, ours_tf: Callable, peer_fn: Callable, rounds: int
) -> tuple[list[float], list[float]]:
    """Paired rounds (alternating which side goes first); returns seconds per image."""
    ds = ImageFolder(root, ours_tf)
    paths = [p for p, _ in ds.samples]
    n = len(paths)
    run_ours(ds), run_peer(paths, peer_fn)  # warm the page cache and allocators
    ours, peer = [], []
    for r in range(rounds):
        if r % 2 == 0:
            ours.append(run_ours(ds) / n)
            peer.append(run_peer(paths, peer_fn) / n)
        else:
            peer.append(run_peer(paths, peer_fn) / n)
            ours.append(run_ours(ds) / n)
    ratio = statistics.median(peer) / statistics.median(ours)
    print(f"{name} ({n} images): peer/ours {ratio:.2f}")
    print(f"  ours:         {_report.spread(ours, 'ms/img', 1e3)}")
    print(f"  plain Pillow: {_report.spread(peer, 'ms/img', 1e3)}")
    return ours, peer


def case(ours: list[float], peer: list[float], target: float | None = None) -> dict:
    ratio = statistics.median(peer) / statistics.median(ours)
    return {
        "unit": "s/img",
        "ours_rounds": ours,
        "peer_rounds": peer,
        "ratio": ratio,
        "target": target,
        "met": None if target is None else ratio >= target,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--images", type=int, default=200, help="500x375 images (half as many 1280x960)"
    )
    parser.add_argument("--backend", default="auto", choices=jpeg.BACKENDS,
                        help="our JPEG decoder (modelzoo.vision.jpeg); auto: simplejpeg if installed")  # fmt: skip
    _report.add_args(parser)
    args = parser.parse_args()
    rounds = _report.check_rounds(args.rounds)
    jpeg.set_backend(args.backend)
    torch.set_num_threads(1)  # one DataLoader worker's view
    print(f"our JPEG backend: {jpeg.backend()} (simplejpeg installed: {jpeg.available()})")
    with tempfile.TemporaryDirectory() as tmp:
        small = make_folder(Path(tmp) / "500x375", args.images, (500, 375))
        large = make_folder(Path(tmp) / "1280x960", args.images // 2, (1280, 960), seed=1)
        print(f"{args.images} JPEGs 500x375 and {args.images // 2} JPEGs 1280x960, quality 90")
        cases = {
            "eval 224, 500x375": (small, eval_transforms(224), PlainPillowEval(224)),
            "eval 224, 1280x960": (large, eval_transforms(224), PlainPillowEval(224)),
            "train 224, 1280x960": (large, train_transforms(224), PlainPillowTrain(224)),
            "train 224, 500x375": (small, train_transforms(224), PlainPillowTrain(224)),
        }
        results = {name: compare(name, *spec, rounds) for name, spec in cases.items()}
    ours, peer = results.pop("train 224, 500x375")
    big = results.pop("train 224, 1280x960")
    extra = {
        "backend": jpeg.backend(),
        "versions": {
            "simplejpeg": getattr(jpeg.simplejpeg, "__version__", None),
            "Pillow": PIL.__version__,
        },
        "images": {"500x375": args.images, "1280x960": args.images // 2},
        "1280x960": case(*big, target=TARGET_1280),
        **{name: case(*r) for name, r in results.items()},
    }
    print(f"train 224, 1280x960: ratio={extra['1280x960']['ratio']:.3f} (target {TARGET_1280})")
    print(f"headline: train 224, 500x375 (target {TARGET_500}), seconds per image:")
    _report.finish(
        args.json,
        "bench_data",
        ours,
        peer,
        ours_label=f"ImageFolder + train_transforms(224), {jpeg.backend()} backend",
        peer_label="plain Pillow: full decode, crop, resize, flip, np.array -> tensor",
        target=TARGET_500,
        unit="s/img",
        extra=extra,
    )


if __name__ == "__main__":
    main()
