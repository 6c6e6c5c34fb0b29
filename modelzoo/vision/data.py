"""Image datasets: ImageNet-layout folders, MXNet RecordIO files, and a built-in digits folder.

- :class:`ImageFolder` reads ``root/<class>/<image>`` (the ImageNet layout GluonCV's
  ``--data-dir`` expects); classes are the sorted folder names.
- :class:`~modelzoo.vision.recordio.RecordIODataset` (in :mod:`modelzoo.vision.recordio`)
  reads the ``.rec``/``.idx`` pairs made by MXNet's ``im2rec``.
- :func:`digits_imagefolder` writes scikit-learn's 1,797 real handwritten digits once as
  an ImageNet-layout folder with a fixed held-out split, a first dataset that needs no
  download.

Bad images. By default a file that cannot be decoded raises :class:`BadImageError`,
naming it. With ``skip_bad=True`` (the scripts' ``--skip-bad-images``) the dataset
instead marks the sample as bad, warns once naming the file, and returns the next
readable sample (``index + 1``, ``index + 2``, ... wrapping around) *with that sample's
own label*: an image is never paired with another image's label, and the batch size
stays fixed. The marks live in shared memory, so samples found bad inside DataLoader
workers are seen by the main process: ``bad_files`` lists them and ``report()`` sums
them up at the end of a run. ``verify()`` decodes every file up front instead, so that
evaluation can exclude bad files before the first batch rather than substitute them.
"""

from __future__ import annotations

import contextlib
import io
import json
import operator
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from modelzoo.vision import jpeg
from modelzoo.vision.transforms import ImageDecodeError, decode_rgb

from ..store import cache_root

__all__ = [
    "IMG_EXTENSIONS",
    "BadImageError",
    "RecordIOError",
    "ImageFolder",
    "digits_imagefolder",
]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")

_SKIP_HINT = (
    "fix or delete the file, or pass --skip-bad-images (skip_bad=True) to skip unreadable "
    "images; skipped images are counted and reported"
)
# Errors Image.open raises for a file that is not a readable image.
_OPEN_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)


class BadImageError(ValueError):
    """An image file or record could not be decoded."""


class RecordIOError(ValueError):
    """A RecordIO file is malformed (bad magic number, truncated record, bad index)."""


def _decode_sample(src: Any, transform: Callable[[Any], Any] | None, where: str) -> Any:
    """Open ``src`` (path-like file object or bytes stream), decode, transform.

    With the simplejpeg backend (:mod:`modelzoo.vision.jpeg`) and a transform that takes
    encoded JPEGs, a JPEG's bytes go to the transform undecoded; everything else is opened
    with Pillow. Only decode failures become :class:`BadImageError`; errors raised by the
    transform itself propagate unchanged.
    """
    if getattr(transform, "accepts_encoded_jpeg", False) and jpeg.backend() == "simplejpeg":
        data = src.read()
        encoded = jpeg.EncodedJPEG.parse(data)
        if encoded is not None:
            try:
                return transform(encoded)  # type: ignore[misc]
            except ImageDecodeError as err:
                raise BadImageError(f"{where}: cannot decode image ({err}); {_SKIP_HINT}") from err
        src = io.BytesIO(data)  # not a JPEG simplejpeg decodes: Pillow's turn
    try:
        img = Image.open(src)
    except _OPEN_ERRORS as err:
        raise BadImageError(
            f"{where}: not a readable image ({type(err).__name__}: {err}); {_SKIP_HINT}"
        ) from err
    # No img.close() afterwards: it would destroy the pixels of a returned image that
    # is `img` itself; the caller closes the underlying file.
    try:
        if transform is not None and getattr(transform, "accepts_lazy_image", False):
            return transform(img)  # decodes in draft mode where the output size allows
        rgb, _, _ = decode_rgb(img)
        return transform(rgb) if transform is not None else rgb
    except ImageDecodeError as err:
        raise BadImageError(f"{where}: cannot decode image ({err}); {_SKIP_HINT}") from err


class _BadMarks:
    """A per-sample "bad" flag in shared memory, visible across DataLoader workers.

    Each worker only ever sets flags to 1, so concurrent writes need no lock.
    """

    def __init__(self, n: int) -> None:
        self.flags = torch.zeros(n, dtype=torch.uint8)
        # Without shared memory the marks stay per process (still correct, less complete).
        with contextlib.suppress(RuntimeError, OSError):
            self.flags.share_memory_()

    def mark(self, i: int) -> None:
        self.flags[i] = 1

    def is_bad(self, i: int) -> bool:
        return bool(self.flags[i])

    def indices(self) -> list[int]:
        return torch.nonzero(self.flags).flatten().tolist()


class _SkippingDataset(torch.utils.data.Dataset):
    """Shared skip-bad logic: subclasses implement ``_load(i)`` and ``_describe(i)``."""

    skip_bad: bool
    _bad: _BadMarks

    def _load(self, index: int) -> tuple[Any, Any]:
        raise NotImplementedError

    def _describe(self, index: int) -> str:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        n = len(self)
        index = operator.index(index)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} samples")
        index %= n
        if not self.skip_bad:
            return self._load(index)
        for step in range(n):
            j = (index + step) % n
            if self._bad.is_bad(j):
                continue
            try:
                return self._load(j)
            except BadImageError as err:
                self._bad.mark(j)
                warnings.warn(f"skip_bad: skipping {err}", RuntimeWarning, stacklevel=2)
        raise RuntimeError(f"every one of the {n} images is unreadable; see the warnings above")

    @property
    def num_bad(self) -> int:
        """Number of distinct samples found unreadable so far (across DataLoader workers)."""
        return int(self._bad.flags.sum())

    @property
    def bad_files(self) -> list[str]:
        """Descriptions (paths, or record keys) of the samples found unreadable so far."""
        return [self._describe(i) for i in self._bad.indices()]

    def _bad_report(self, max_listed: int = 10) -> str:
        bad = self.bad_files
        if not bad:
            return "no unreadable images"
        listed = "\n  ".join(bad[:max_listed])
        more = f"\n  ... and {len(bad) - max_listed} more" if len(bad) > max_listed else ""
        return (
            f"{len(bad)} unreadable image(s) skipped, each replaced by the next readable "
            f"sample:\n  {listed}{more}"
        )

    def verify(self, num_threads: int = 8) -> list[str]:
        """Decode every sample once (in draft mode, so it is quick) and mark the bad ones.

        With ``skip_bad=True`` the bad samples are then skipped without ever being tried
        again; with ``skip_bad=False`` the first bad sample raises :class:`BadImageError`.

        Returns:
            ``bad_files`` after the scan.
        """

        def check(i: int) -> BadImageError | None:
            try:
                self._load(i, _verify_only=True)  # type: ignore[call-arg]
            except BadImageError as err:
                return err
            return None

        todo = [i for i in range(len(self)) if not self._bad.is_bad(i)]
        with ThreadPoolExecutor(max(1, num_threads)) as pool:
            for i, err in zip(todo, pool.map(check, todo), strict=True):
                if err is None:
                    continue
                if not self.skip_bad:
                    raise err
                self._bad.mark(i)
        return self.bad_files


def _verify_transform(img: Image.Image) -> None:
    """Decode at the smallest draft scale: enough to find truncated or corrupt data."""
    decode_rgb(img, (1, 1))


_verify_transform.accepts_lazy_image = True  # type: ignore[attr-defined]


class ImageFolder(_SkippingDataset):
    """Images in the ImageNet layout ``root/<class>/**/<image>``.

    Classes are the sorted names of the folders in ``root``; ``samples`` lists
    ``(path, class_index)`` in sorted order. Images are decoded with Pillow and converted
    to RGB (``Image.MAX_IMAGE_PIXELS`` is respected). If ``transform`` accepts lazily
    opened images (:func:`~modelzoo.vision.transforms.train_transforms` and
    :func:`~modelzoo.vision.transforms.eval_transforms` do), JPEGs are decoded in draft
    mode at reduced size, by libjpeg-turbo through simplejpeg when it is installed
    (:mod:`modelzoo.vision.jpeg`; same crops, Pillow for everything else).

    Args:
        root: dataset folder, e.g. ``~/imagenet/train``.
        transform: applied to the decoded RGB image; ``None`` returns the PIL image.
        skip_bad: skip unreadable images (see the module docstring) and empty class folders
            (which keep their class index) instead of raising.
        extensions: file name endings counted as images (case-insensitive).

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: ``root`` has no class folders, or (without ``skip_bad``) a class folder
            has no images, which would silently shift every later label if ignored.

    Example:
        >>> from modelzoo.vision.data import ImageFolder, digits_imagefolder
        >>> from modelzoo.vision.transforms import eval_transforms
        >>> ds = ImageFolder(digits_imagefolder() / "val", eval_transforms(32, crop_ratio=1.0))
        >>> x, y = ds[0]  # (3, 32, 32) float tensor, int label
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        transform: Callable[[Any], Any] | None = None,
        *,
        skip_bad: bool = False,
        extensions: Sequence[str] = IMG_EXTENSIONS,
    ) -> None:
        self.root = Path(root).expanduser()
        self.transform = transform
        self.skip_bad = skip_bad
        self.extensions = tuple(e.lower() for e in extensions)
        if not self.root.is_dir():
            what = "is not a folder" if self.root.exists() else "does not exist"
            raise FileNotFoundError(
                f"image folder {self.root} {what}; expected the ImageNet layout "
                "<root>/<class>/<image> (e.g. --data-dir ~/imagenet with train/ and val/ inside)"
            )
        self.classes = sorted(
            e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith(".")
        )
        if not self.classes:
            raise ValueError(
                f"no class folders in {self.root}; expected the ImageNet layout "
                "<root>/<class>/<image>, one folder per class"
            )
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = []
        self.empty_classes: list[str] = []
        self.ignored_files = 0
        for cls in self.classes:
            files, ignored = self._scan(self.root / cls)
            self.ignored_files += ignored
            if not files:
                if not skip_bad:
                    raise ValueError(
                        f"class folder {self.root / cls} has no image files "
                        f"({', '.join(self.extensions)}); remove the folder or add images: "
                        "an empty class is an error because ignoring it would shift every "
                        "later label (--skip-bad-images keeps its label index and reports it)"
                    )
                self.empty_classes.append(cls)
            label = self.class_to_idx[cls]
            self.samples.extend((f, label) for f in files)
        if not self.samples:
            raise ValueError(f"no image files under {self.root}")
        self.targets = [label for _, label in self.samples]
        self._bad = _BadMarks(len(self.samples))

    def _scan(self, folder: Path) -> tuple[list[str], int]:
        files, ignored = [], 0
        for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                if name.lower().endswith(self.extensions):
                    files.append(os.path.join(dirpath, name))
                else:
                    ignored += 1
        return files, ignored

    def __len__(self) -> int:
        return len(self.samples)

    def _describe(self, index: int) -> str:
        return self.samples[index][0]

    def _load(self, index: int, _verify_only: bool = False) -> tuple[Any, int]:
        path, label = self.samples[index]
        transform = _verify_transform if _verify_only else self.transform
        with open(path, "rb") as f:
            return _decode_sample(f, transform, path), label

    def report(self) -> str:
        """One paragraph for the end of a run: sizes, empty classes, unreadable images."""
        lines = [
            f"ImageFolder {self.root}: {len(self.samples)} images in {len(self.classes)} classes"
        ]
        if self.empty_classes:
            lines.append(
                f"{len(self.empty_classes)} empty class folder(s) kept their label index: "
                + ", ".join(self.empty_classes)
            )
        if self.ignored_files:
            lines.append(f"{self.ignored_files} non-image file(s) ignored by extension")
        lines.append(self._bad_report())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(root={str(self.root)!r}, samples={len(self)}, "
            f"classes={len(self.classes)}, skip_bad={self.skip_bad})"
        )


# ----------------------------------------------------------------------------- digits

_DIGITS_VERSION = 1
_DIGITS_SIZE = 32  # 8x8 -> 32x32, each source pixel becomes a 4x4 block (nearest)
_DIGITS_SEED = 0
_DIGITS_VAL_FRACTION = 0.2
_DIGITS_PARAMS = {
    "format_version": _DIGITS_VERSION,
    "source": "sklearn.datasets.load_digits",
    "image_size": _DIGITS_SIZE,
    "upscale": "nearest (np.kron with a 4x4 block of ones)",
    "pixel_scaling": "uint8 = np.rint(v * 255 / 16) for load_digits values v in 0..16",
    "split_seed": _DIGITS_SEED,
    "val_fraction": _DIGITS_VAL_FRACTION,
    "split": "per class: numpy default_rng(split_seed).permutation, first round(n * val_fraction) are val",
}


def _default_digits_root() -> Path:
    return cache_root() / "datasets" / "digits"


def _digits_manifest_ok(root: Path) -> bool:
    try:
        manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
        if any(manifest.get(k) != v for k, v in _DIGITS_PARAMS.items()):
            return False
        total = 0
        for split in ("train", "val"):
            classes = {e.name for e in os.scandir(root / split) if e.is_dir()}
            if classes != set(manifest["counts"][split]):
                return False
            for cls, count in manifest["counts"][split].items():
                on_disk = [n for n in os.listdir(root / split / cls) if n.endswith(".png")]
                if len(on_disk) != count:
                    return False
                total += count
        return total == manifest["num_images"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_digits(dest: Path) -> None:
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(
            "digits_imagefolder needs scikit-learn for its bundled digits data: "
            "pip install scikit-learn"
        ) from err
    digits = load_digits()
    images = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)  # (N, 8, 8)
    block = np.ones((_DIGITS_SIZE // 8, _DIGITS_SIZE // 8), dtype=np.uint8)
    rng = np.random.default_rng(_DIGITS_SEED)
    counts: dict[str, dict[str, int]] = {"train": {}, "val": {}}
    for c in range(10):
        idx = np.flatnonzero(digits.target == c)
        perm = rng.permutation(idx)
        n_val = int(round(len(idx) * _DIGITS_VAL_FRACTION))
        val = set(perm[:n_val].tolist())
        for split in ("train", "val"):
            (dest / split / str(c)).mkdir(parents=True, exist_ok=True)
        for i in idx.tolist():
            split = "val" if i in val else "train"
            img = Image.fromarray(np.kron(images[i], block))  # uint8 (32, 32): mode L
            img.save(dest / split / str(c) / f"{i:04d}.png", compress_level=1)
            counts[split][str(c)] = counts[split].get(str(c), 0) + 1
    manifest = dict(_DIGITS_PARAMS)
    manifest.update(
        num_images=len(images),
        num_classes=10,
        counts=counts,
        file_naming="<split>/<digit>/<index in load_digits, 4 digits>.png, mode L",
    )
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2), encoding="utf-8")


def digits_imagefolder(root: str | os.PathLike[str] | None = None) -> Path:
    """Write scikit-learn's handwritten digits as an ImageNet-layout folder, once.

    The 1,797 real 8x8 digit scans of ``sklearn.datasets.load_digits`` (16 grey levels)
    become 32x32 grey PNG files: values scaled by ``np.rint(v * 255 / 16)`` and each pixel
    repeated as a 4x4 block (nearest upscaling). A fixed, stratified split holds out 20 %
    of each class (``numpy.random.default_rng(0)``): ``root/train/<digit>/NNNN.png`` and
    ``root/val/<digit>/NNNN.png``, where ``NNNN`` is the index in ``load_digits``.

    The folder is built in a temporary directory and renamed into place under a file
    lock, so concurrent processes build it once and never see it half written; a
    ``manifest.json`` (parameters and per-class counts) is written last, and a folder
    whose manifest is missing, different or does not match the files is rebuilt.

    Args:
        root: destination; default ``$MODELZOO_HOME/datasets/digits`` (``MODELZOO_HOME``
            defaults to ``~/.cache/modelzoo``).

    Returns:
        ``root``, containing ``train/``, ``val/`` and ``manifest.json``.
    """
    from filelock import FileLock

    root = Path(root).expanduser() if root is not None else _default_digits_root()
    if _digits_manifest_ok(root):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root.parent / f".{root.name}.lock")):
        if _digits_manifest_ok(root):  # another process built it while we waited
            return root
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        try:
            _write_digits(tmp)
            if root.exists() or root.is_symlink():
                stale = Path(tempfile.mkdtemp(prefix=f".{root.name}.stale-", dir=root.parent))
                os.replace(root, stale / root.name)
                os.replace(tmp, root)
                shutil.rmtree(stale, ignore_errors=True)
            else:
                os.replace(tmp, root)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return root
