"""Reading weight files of every supported format into a flat name -> array mapping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["read_state_dict"]


def read_state_dict(path: str | Path, file_format: str) -> dict[str, Any]:
    """Reads a weight file without executing code from it.

    Args:
        path: The file.
        file_format: ``"pth"`` (``torch.load(weights_only=True)``), ``"safetensors"`` or
            ``"params"`` (MXNet NDArray file, read in pure numpy; values are numpy arrays).

    Raises:
        ValueError: Unknown format, or a file that is not a flat state dict.
    """
    path = Path(path)
    if file_format == "pth":
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types for foreign or corrupt files
            raise ValueError(
                f"{path}: not a loadable torch state dict ({exc}); delete it and download again"
            ) from exc
        if (
            isinstance(state, dict)
            and "state_dict" in state
            and isinstance(state["state_dict"], dict)
        ):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
            raise ValueError(f"{path}: expected a flat dict of tensors (a state dict)")
        return dict(state)
    if file_format == "safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    if file_format == "params":
        from .mxnet import load_mxnet_params

        return load_mxnet_params(path)
    raise ValueError(
        f"{path}: unknown weights format {file_format!r}; use pth, safetensors or params"
    )
