"""JPEG decoding backends for the dataset transforms: libjpeg-turbo through simplejpeg, or Pillow.

:class:`~modelzoo.vision.transforms.RandomResizedCrop` and
:class:`~modelzoo.vision.transforms.Resize` choose their output geometry from the JPEG header
alone, then decode at the smallest DCT scale (1/2, 1/4, 1/8) that still leaves enough pixels.
Two backends do the decoding:

- ``"simplejpeg"``: libjpeg-turbo's TurboJPEG API through the optional `simplejpeg
  <https://gitlab.com/jfolz/simplejpeg>`_ package (``pip install
  modelzoo-trainers-pt[fast-jpeg]``). The file's bytes go to the transform as an
  :class:`EncodedJPEG`; it decodes straight into a numpy array (training crops with
  ``fastdct=True, fastupsample=True``; evaluation with libjpeg's accurate defaults, the
  pixels Pillow decodes), and torch's antialiased uint8 resize crops and resizes it.
- ``"pillow"``: Pillow's draft mode on a lazily opened image (the fallback; always there).

Both draw the same random numbers and crop the same box in original-image coordinates; only
the pixels differ, by the decoder's DCT / upsampling and the resize filter's rounding.
Non-JPEG files, CMYK/YCCK JPEGs and anything libjpeg-turbo refuses (its strict mode rejects
some files Pillow decodes with a warning) go through Pillow, which decodes them or raises
the same error as before.

Choosing the backend: :func:`set_backend` (``"auto"``, ``"simplejpeg"`` or ``"pillow"``) for
this process, else the environment variable ``MODELZOO_JPEG_BACKEND`` (same values; read at
every call, so DataLoader workers started with ``spawn`` see it too), else ``"auto"``:
simplejpeg when it is importable.

Example:
    >>> from modelzoo.vision import jpeg
    >>> jpeg.set_backend("pillow")  # force the fallback, e.g. to compare the two
    >>> jpeg.backend()
    'pillow'
    >>> jpeg.set_backend(None)  # back to MODELZOO_JPEG_BACKEND / auto
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass

import numpy as np
from PIL import Image

try:
    import simplejpeg
except ImportError:  # optional dependency: Pillow decodes everything
    simplejpeg = None

__all__ = ["ENV_VAR", "BACKENDS", "EncodedJPEG", "available", "backend", "set_backend"]

#: Environment variable that chooses the backend when :func:`set_backend` was not called.
ENV_VAR = "MODELZOO_JPEG_BACKEND"
#: Accepted backend names.
BACKENDS = ("auto", "simplejpeg", "pillow")

_override: str | None = None
# Colour spaces TurboJPEG converts to RGB the way Pillow does (CMYK/YCCK go to Pillow,
# which knows Adobe's inverted CMYK).
_RGB_COLORSPACES = ("YCbCr", "Gray", "RGB")
_JPEG_MAGIC = b"\xff\xd8"
# Per-thread output buffer that decode(scratch=True) reuses: a fresh 1-4 MB array per image
# costs its page faults again each time (~20 % of a 500x375 decode here).
_scratch = threading.local()
_SCRATCH_MAX = 4096 * 4096 * 3  # bytes; larger images get a fresh array


def available() -> bool:
    """Whether simplejpeg is importable (the ``fast-jpeg`` extra is installed)."""
    return simplejpeg is not None


def _check(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise ValueError(
            f"{where}: unknown JPEG backend {name!r}; choose one of {', '.join(BACKENDS)}"
        )
    if name == "simplejpeg" and simplejpeg is None:
        raise ImportError(
            f"{where} asks for the simplejpeg JPEG backend, but simplejpeg is not installed: "
            "pip install simplejpeg (or modelzoo-trainers-pt[fast-jpeg]), or choose 'auto' "
            "or 'pillow'"
        )
    return name


def set_backend(name: str | None) -> None:
    """Choose the JPEG backend for this process: ``"auto"``, ``"simplejpeg"``, ``"pillow"``,
    or ``None`` to follow ``MODELZOO_JPEG_BACKEND`` again.

    Raises:
        ValueError: an unknown name.
        ImportError: ``"simplejpeg"`` without simplejpeg installed.
    """
    global _override
    _override = None if name is None else _check(name, "set_backend")


def backend() -> str:
    """The backend in force: ``"simplejpeg"`` or ``"pillow"`` (``"auto"`` resolved)."""
    name = _override if _override is not None else os.environ.get(ENV_VAR, "auto") or "auto"
    if name == "auto":
        return "simplejpeg" if simplejpeg is not None else "pillow"
    return _check(name, ENV_VAR)


def dct_scale(width: int, height: int, min_width: float, min_height: float) -> int:
    """The largest DCT scale denominator ``d`` in (1, 2, 4, 8) whose decode keeps at least
    ``min_width`` x ``min_height`` pixels: Pillow's draft rule, so both backends decode the
    same size (``ceil(width / d)`` x ``ceil(height / d)``)."""
    fit = min(width // max(1, math.ceil(min_width)), height // max(1, math.ceil(min_height)))
    for d in (8, 4, 2):
        if fit >= d:
            return d
    return 1


@dataclass(frozen=True)
class EncodedJPEG:
    """A JPEG file's bytes and header size, not decoded yet (what the simplejpeg backend hands
    to the transforms instead of a lazily opened PIL image).

    Attributes:
        data: the file's bytes.
        width: image width from the header.
        height: image height from the header.
    """

    data: bytes
    width: int
    height: int

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)``, as ``PIL.Image.size``."""
        return self.width, self.height

    @classmethod
    def parse(cls, data: bytes) -> EncodedJPEG | None:
        """Read the header; ``None`` when simplejpeg should not decode ``data`` (no
        simplejpeg, not a JPEG, an unreadable header, CMYK/YCCK, more pixels than
        ``PIL.Image.MAX_IMAGE_PIXELS``, whose warning or error Pillow gives): Pillow takes
        it then."""
        if simplejpeg is None or data[:2] != _JPEG_MAGIC:
            return None
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            return None
        if colorspace not in _RGB_COLORSPACES or width <= 0 or height <= 0:
            return None
        limit = Image.MAX_IMAGE_PIXELS
        if limit is not None and width * height > limit:
            return None
        return cls(data, int(width), int(height))

    def decode(self, scale: int = 1, *, fast: bool = True, scratch: bool = False) -> np.ndarray:
        """Decode to RGB at ``1 / scale`` of the size (``scale`` in 1, 2, 4, 8).

        Args:
            scale: DCT scale denominator; the result is ``ceil(height / scale)`` x
                ``ceil(width / scale)``.
            fast: libjpeg-turbo's fast integer DCT and plain (not fancy) chroma upsampling.
            scratch: decode into this thread's reusable buffer: the result is only valid
                until the next ``scratch`` decode on this thread (for callers that resize it
                at once).

        Returns:
            A writable ``uint8`` array ``(H, W, 3)``.

        Raises:
            ValueError: libjpeg-turbo reported an error or, in its strict mode, a warning
                (truncated data, corrupt markers).
        """
        want_h, want_w = -(-self.height // scale), -(-self.width // scale)
        buffer = None
        nbytes = want_h * want_w * 3
        if scratch and nbytes <= _SCRATCH_MAX:
            buffer = getattr(_scratch, "buffer", None)
            if buffer is None or buffer.size < nbytes:
                buffer = _scratch.buffer = np.empty(nbytes, dtype=np.uint8)
        arr = simplejpeg.decode_jpeg(
            self.data,
            colorspace="RGB",
            fastdct=fast,
            fastupsample=fast,
            min_height=want_h,
            min_width=want_w,
            buffer=buffer,
        )
        if arr.shape[:2] != (want_h, want_w):  # another scale than asked: a libjpeg change
            raise ValueError(
                f"simplejpeg decoded {arr.shape[1]}x{arr.shape[0]}, not the 1/{scale} scale "
                f"{want_w}x{want_h} of {self.width}x{self.height}"
            )
        return arr
