"""GPU kernels written in Triton: whether they run, how they are built, the tables they take.

A few hot passes have no multi-tensor kernel in torch that fits them: LAMB's and LANS's update
with a per-tensor trust ratio (``torch._foreach_addcmul_`` with a different 0-d coefficient
per tensor takes torch's slow path on CUDA, one launch per tensor), and Adasum's per-tensor
dot products over a fused gradient buffer. Their CPU versions are C kernels
(:mod:`modelzoo._native`); on CUDA they are Triton kernels, one launch per pass over all
tensors: a *tile* is ``BLOCK`` consecutive elements of one tensor, program ``i`` of a launch
works on tile ``i``, and each tensor is found through a table of addresses.

The environment variable ``MODELZOO_TRITON`` decides:

* ``1`` (the default): CUDA tensors use the Triton kernels when ``triton`` imports (it ships
  with PyTorch's CUDA wheels); without it the torch path runs (warned once).
* ``0``: never (the torch path everywhere).
* ``interpret``: the same kernels run in Triton's interpreter on *CPU* tensors (slow: for
  testing the kernels on a machine without a GPU; the test suite does this).

The kernels are compiled on first use (a second or two per kernel and set of constants).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "SWITCH",
    "Tiles",
    "Unavailable",
    "addresses",
    "disable",
    "int64_table",
    "jit",
    "mode",
    "tiles",
    "to_device",
    "usable",
]

SWITCH = "MODELZOO_TRITON"
_MODES = ("1", "0", "interpret")
_WARNED: set[str] = set()
_DISABLED: set[str] = set()


def mode() -> str:
    """``MODELZOO_TRITON``'s value: ``"1"`` (default), ``"0"`` or ``"interpret"``."""
    value = os.environ.get(SWITCH, "1").strip().lower()
    if value not in _MODES:
        raise ValueError(
            f"environment variable {SWITCH}={value!r}: use 1 (Triton kernels on CUDA, the "
            "default), 0 (never) or interpret (the kernels in Triton's interpreter on CPU "
            "tensors, for tests)"
        )
    return value


@functools.cache
def _importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - an absent or broken install: the torch path runs
        return False
    return True


class Unavailable(RuntimeError):
    """A kernel could not be built here (raised once, after :func:`disable`'s warning); the
    caller takes its torch path, which nothing has touched yet."""


def usable(device: torch.device, what: str) -> bool:
    """Whether the Triton kernels run on ``device``: CUDA by default, CPU under
    ``interpret``, and not after :func:`disable`. ``what`` names the kernels in the one
    warning when CUDA lacks Triton."""
    current = mode()
    wanted = {"1": "cuda", "interpret": "cpu"}.get(current)
    if device.type != wanted or what in _DISABLED:
        return False
    if _importable():
        return True
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(
            f"{what}: the Triton kernels need the triton package (it comes with PyTorch's CUDA "
            f"wheels), which does not import here; using the torch kernels ({SWITCH}=0 "
            "silences this)",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def disable(what: str, err: BaseException) -> Unavailable:
    """Turn ``what`` off for this process after its kernel failed to build (an unsupported
    GPU, a Triton release the kernels do not compile with, ...), with one warning; returns
    the :class:`Unavailable` for the caller to raise."""
    _DISABLED.add(what)
    warnings.warn(
        f"{what}: the Triton kernel could not be built ({type(err).__name__}: "
        f"{str(err)[:300]}); using the torch kernels for the rest of this process",
        RuntimeWarning,
        stacklevel=3,
    )
    return Unavailable(what)


def jit(fn: Callable[..., None]) -> Any:
    """``fn`` as a Triton kernel: compiled (``triton.jit``), or interpreted under
    ``MODELZOO_TRITON=interpret``. Call it inside the kernel module's builder, not at import,
    so the mode in force when the kernels are first used decides."""
    if mode() == "interpret":
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    import triton

    return triton.jit(fn)


@dataclass(frozen=True)
class Tiles:
    """The tiles of tensors of ``sizes`` at ``block`` elements: tile ``i`` covers elements
    ``start[i] .. start[i] + block`` of tensor ``tensor[i]``; a tensor's tiles are
    consecutive, ``count[t]`` of them (at least 1, so an empty tensor has one empty tile)."""

    tensor: Tensor  # int32 (n_tiles,)
    start: Tensor  # int64 (n_tiles,)
    count: Tensor  # int64 (n_tensors,)
    sizes: Tensor  # int64 (n_tensors,)
    n: int


_TILES: OrderedDict[tuple[Any, ...], Tiles] = OrderedDict()
_INT64: OrderedDict[tuple[Any, ...], Tensor] = OrderedDict()
_CACHED = 256  # tables kept per kind (a step reuses the same few dozen)


def _remember(cache: OrderedDict, key: tuple[Any, ...], value: Any) -> Any:
    cache[key] = value
    while len(cache) > _CACHED:
        cache.popitem(last=False)
    return value


def to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` as a ``dtype`` tensor on ``device``, copied without waiting for the device
    (from pinned memory, which torch keeps until the copy is done)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def tiles(sizes: Sequence[int], block: int, device: torch.device) -> Tiles:
    """The tile table of tensors of ``sizes`` (cached: a step's buckets repeat)."""
    key = (tuple(sizes), block, device)
    hit = _TILES.get(key)
    if hit is not None:
        _TILES.move_to_end(key)
        return hit
    tensor, start, count = [], [], []
    for t, n in enumerate(sizes):
        k = max(1, -(-n // block))
        tensor.extend([t] * k)
        start.extend(range(0, k * block, block))
        count.append(k)
    table = Tiles(
        tensor=to_device(tensor, torch.int32, device),
        start=to_device(start, torch.int64, device),
        count=to_device(count, torch.int64, device),
        sizes=to_device(list(sizes), torch.int64, device),
        n=len(tensor),
    )
    return _remember(_TILES, key, table)


def int64_table(values: Sequence[int], device: torch.device) -> Tensor:
    """``values`` as an int64 tensor on ``device``, cached by the values (a step asks for
    the same tables again, and then copies nothing to the device)."""
    key = (device, *values)
    hit = _INT64.get(key)
    if hit is not None:
        _INT64.move_to_end(key)
        return hit
    return _remember(_INT64, key, to_device(list(values), torch.int64, device))


def addresses(tensors: Sequence[Tensor]) -> Tensor:
    """The tensors' data addresses, as :func:`int64_table` (parameters and optimizer state
    do not move between steps; a reused address gets the same, correct, table)."""
    return int64_table([t.data_ptr() for t in tensors], tensors[0].device)
