"""Decode + augment throughput: our ImageFolder pipeline vs a plain Pillow pipeline.

Ours: ``ImageFolder`` + ``train_transforms`` / ``eval_transforms`` (JPEG draft decoding at
the smallest DCT scale the output size allows, crop and resize in one Pillow call).
Peer: what a hand-written Pillow loader does, as torchvision's PIL path does: open, full
decode, ``convert("RGB")``, crop, resize, flip, ``np.asarray`` -> tensor. Both draw the
same crops (same RNG, same seed per sample) and run the same tensor-side colour jitter,
lighting and normalization, so the difference is decoding and geometry.

Images: synthetic photo-like JPEGs (smooth colour fields, edges, sensor noise) at quality
90, written to a temporary folder. Runs alternate ours/peer in one process; the last line
is ``ratio=<peer_time/our_time>`` for the training pipeline on 500x375 images (ImageNet's
typical size) at 224.

Usage: python benchmarks/bench_data.py [--images 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from modelzoo.vision.data import ImageFolder
from modelzoo.vision.transforms import (
    ColorJitter,
    Lighting,
    Normalize,
    RandomResizedCrop,
    eval_transforms,
    train_transforms,
)

MEAN, STD = (123.68, 116.779, 103.939), (58.393, 57.12, 57.375)


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


def run_peer(paths: list[str], fn) -> float:
    t0 = time.perf_counter()
    for i, p in enumerate(paths):
        torch.default_generator.manual_seed(i)  # CPU-only reseed: cheap
        fn(p)
    return time.perf_counter() - t0


def compare(name: str, root: Path, ours_tf, peer_fn, rounds: int) -> float:
    ds = ImageFolder(root, ours_tf)
    paths = [p for p, _ in ds.samples]
    run_ours(ds), run_peer(paths, peer_fn)  # warm the page cache and allocators
    t_ours, t_peer = [], []
    for _ in range(rounds):
        t_ours.append(run_ours(ds))
        t_peer.append(run_peer(paths, peer_fn))
    ours, peer = min(t_ours), min(t_peer)
    n = len(paths)
    print(
        f"{name:<34} ours {n / ours:8.1f} img/s   plain Pillow {n / peer:8.1f} img/s   "
        f"peer/ours {peer / ours:.2f}"
    )
    return peer / ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one DataLoader worker's view
    with tempfile.TemporaryDirectory() as tmp:
        small = make_folder(Path(tmp) / "500x375", args.images, (500, 375))
        large = make_folder(Path(tmp) / "1280x960", args.images // 2, (1280, 960), seed=1)
        print(f"{args.images} JPEGs 500x375 and {args.images // 2} JPEGs 1280x960, quality 90")
        compare("eval 224, 500x375", small, eval_transforms(224), PlainPillowEval(224), args.rounds)
        compare(
            "train 128, 500x375", small, train_transforms(128), PlainPillowTrain(128), args.rounds
        )
        compare(
            "eval 224, 1280x960", large, eval_transforms(224), PlainPillowEval(224), args.rounds
        )
        compare(
            "train 224, 1280x960", large, train_transforms(224), PlainPillowTrain(224), args.rounds
        )
        ratio = compare(
            "train 224, 500x375 (headline)",
            small,
            train_transforms(224),
            PlainPillowTrain(224),
            args.rounds,
        )
    print(f"ratio={ratio:.2f}")


if __name__ == "__main__":
    main()
