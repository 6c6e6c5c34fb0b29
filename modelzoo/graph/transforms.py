"""Node-feature preprocessing of the graph weights, shared by training and inference.

``scripts/train_gnn.py --normalize-features`` and :meth:`modelzoo.Weights.transforms` of graph
weights use the very same :class:`NodeFeatures` object, so the features a published model
is evaluated on are the features it was trained on (no second copy of the formula).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["NodeFeatures"]

#: Floor of a row sum in the row normalisation: a zero row stays zero instead of NaN.
ROW_SUM_EPS = 1e-12


@dataclass(frozen=True)
class NodeFeatures:
    """The node-feature transform of a graph model's weights.

    Args:
        normalize: Row-normalize the features, ``x_i / max(sum_j x_ij, 1e-12)`` (DGL's and
            Kipf & Welling's preprocessing of the Planetoid bag-of-words features; it is meant
            for non-negative features). ``False``: the features pass through unchanged.

    Call it on a ``torch_geometric.data.Data`` (returns a shallow copy whose ``x`` is the
    transformed features; the input is never modified) or on an ``(N, F)`` feature tensor
    (returns the transformed tensor; the input tensor itself when nothing is to be done).

    Example:
        >>> NodeFeatures(normalize=True)(torch.tensor([[1.0, 3.0], [0.0, 0.0]]))
        tensor([[0.2500, 0.7500],
                [0.0000, 0.0000]])
    """

    normalize: bool = False

    def __call__(self, data: Any) -> Any:
        if isinstance(data, torch.Tensor):
            return self.features(data)
        if getattr(data, "x", None) is None:
            raise TypeError(
                "NodeFeatures: expected a torch_geometric Data with node features x or an "
                f"(N, F) tensor, got {type(data).__name__}"
                + (" without x" if hasattr(data, "edge_index") else "")
            )
        out = copy.copy(data)
        out.x = self.features(data.x)
        return out

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The transformed ``(N, F)`` feature matrix (a new tensor when anything changes)."""
        if x.dim() != 2:
            raise ValueError(
                f"NodeFeatures: node features must be (num_nodes, num_features), got shape "
                f"{tuple(x.shape)}"
            )
        if not self.normalize:
            return x
        return x / x.sum(dim=1, keepdim=True).clamp(min=ROW_SUM_EPS)  # (N, F)
