"""Small C kernels compiled on first use with the system C compiler, loaded through ``ctypes``.

For the few hot loops where a fused pass matters and no installed library offers one (Adasum's
per-tensor dots, :mod:`trainers.comm.adasum.native`; Pillow's resampling on a decoded array,
:mod:`modelzoo.vision.resample`). The source is compiled once per process into a private
temporary directory (a fraction of a second) with ``$CC``, else ``cc``, ``gcc`` or ``clang``:
the same requirement as TorchInductor's CPU backend. Without a compiler, or when the caller's
environment switch is ``0``, :func:`load` warns once and returns ``None``, and the caller
uses its pure-torch path. Nothing is installed or cached on disk.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Mapping, Sequence

__all__ = ["load"]

# No fast-math and no FMA contraction: results do not depend on the instructions the compiler
# picks for this machine (-march=native), so every machine computes the same bits.
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared"]
_LOADED: dict[str, ctypes.CDLL | None] = {}


def load(
    name: str,
    source: str,
    signatures: Mapping[str, Sequence[type]],
    *,
    switch: str,
    what: str,
) -> ctypes.CDLL | None:
    """The library built from ``source``, its functions' ``argtypes`` set from ``signatures``;
    ``None`` (warned once) when it cannot be built or the environment variable ``switch`` is
    ``"0"``. ``what`` names the kernels and their fallback in the warning."""
    if name in _LOADED:
        return _LOADED[name]
    lib = _build(name, source, what) if os.environ.get(switch, "1") != "0" else None
    if lib is not None:
        for function, argtypes in signatures.items():
            getattr(lib, function).argtypes = list(argtypes)
    _LOADED[name] = lib
    return lib


def _build(name: str, source: str, what: str) -> ctypes.CDLL | None:
    candidates = (os.environ.get("CC"), "cc", "gcc", "clang")
    cc = next((c for c in candidates if c and shutil.which(c)), None)
    if cc is None:
        warnings.warn(
            f"{what}: C kernels need a C compiler ($CC, cc, gcc or clang), none was found; "
            "using the torch kernels instead",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    with tempfile.TemporaryDirectory(prefix=f"modelzoo-{name}-") as tmp:
        src, lib = os.path.join(tmp, f"{name}.c"), os.path.join(tmp, f"{name}.so")
        with open(src, "w") as f:
            f.write(source)
        done = None
        for flags in ([*_FLAGS, "-march=native"], _FLAGS):  # some targets lack -march=native
            done = subprocess.run([cc, *flags, src, "-o", lib], capture_output=True, text=True)
            if done.returncode == 0:
                return ctypes.CDLL(lib)  # loaded: the file may go
        warnings.warn(
            f"{what}: C kernels did not compile with {cc} ({done.stderr.strip()[:300]}); "
            "using the torch kernels instead",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
