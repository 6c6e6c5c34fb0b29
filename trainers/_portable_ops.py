"""IEEE square roots on CPU for the portable exact mode (``MODELZOO_PORTABLE=2``).

ATen hands a contiguous ``float32``/``float64`` ``sqrt`` (and ``exp``, ``log``, ``tanh``,
``erf``, the trigonometric functions) to MKL's vector math library (VML) at its high-accuracy
setting: results within one ulp, not correctly rounded, and computed by a code path MKL picks
by processor; neither ``MKL_CBWR`` nor ``MKL_ENABLE_INSTRUCTIONS`` changes that path on an AMD
EPYC (measured, docs/run_logs.md). Bisecting the first step of ``karate_gcn`` between an Intel
Xeon and an AMD EPYC found it there: Adam's ``exp_avg_sq.sqrt()`` was the first operator
whose output differed while its input was identical.

A square root has one right answer, the correctly rounded one, which every x86-64 processor's
``sqrtps``/``sqrtpd`` computes. :func:`install` replaces ATen's CPU kernels of ``aten::sqrt``
(``sqrt``, ``sqrt_``, ``sqrt.out``) with numpy's ``np.sqrt``, which is that instruction, so
every caller (``torch.sqrt``, ``Tensor.sqrt_``, ``torch._foreach_sqrt``'s CPU loop, the
optimizers in ``torch.optim``) gets the same bits on every processor. ``float16`` and
``bfloat16`` are computed in ``float32`` and rounded to nearest even, as ATen does; integer and
bool inputs are promoted to the default float dtype, as ATen does. Other devices, and sparse
tensors' own kernels, are untouched.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

__all__ = ["install", "installed"]

_LIBRARY: torch.library.Library | None = None

# dtypes numpy computes itself (float16: in float32, rounded to nearest even, as ATen does)
_NUMPY = (torch.float32, torch.float64, torch.float16, torch.complex64, torch.complex128)


def installed() -> bool:
    """Whether :func:`install` replaced ATen's CPU square root in this process."""
    return _LIBRARY is not None


def _result_dtype(x: torch.Tensor) -> torch.dtype:
    if x.is_floating_point() or x.is_complex():
        return x.dtype
    return torch.get_default_dtype()  # integers and bool promote, as ATen's unary float ops do


def _sqrt_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the correctly rounded square root of ``x`` into ``out`` (same shape)."""
    src = x.detach().resolve_conj().resolve_neg()
    dtype = _result_dtype(x)
    if src.dtype != dtype:
        src = src.to(dtype)
    target = out.detach()
    if dtype in _NUMPY and target.dtype == dtype and not (target.is_conj() or target.is_neg()):
        np.sqrt(src.numpy(), out=target.numpy())  # in place, strides and aliasing included
        return out
    # bfloat16 (numpy has none): in float32, then rounded to nearest even by copy_; or an
    # out= of another dtype: cast by copy_, as ATen casts
    root = np.sqrt((src if dtype in _NUMPY else src.to(torch.float32)).numpy())
    target.copy_(torch.from_numpy(np.asarray(root)))
    return out


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x, dtype=_result_dtype(x))
    return _sqrt_into(x, out)


def _sqrt_(x: torch.Tensor) -> torch.Tensor:
    if not (x.is_floating_point() or x.is_complex()):
        raise RuntimeError(
            f"result type {_result_dtype(x)} can't be cast to the desired output type {x.dtype}"
        )
    return _sqrt_into(x, x)


def _sqrt_out(x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    if out.shape != x.shape:
        out.resize_(x.shape)
    return _sqrt_into(x, out)


def install() -> None:
    """Replace ATen's CPU ``sqrt`` kernels with correctly rounded ones (idempotent)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    library = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (overrides on purpose)
    with warnings.catch_warnings():
        # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        library.impl("sqrt", _sqrt, "CPU")
        library.impl("sqrt_", _sqrt_, "CPU")
        library.impl("sqrt.out", _sqrt_out, "CPU")
    _LIBRARY = library
