"""Building torch_geometric ``Data`` objects: coalesced edges, masks (shared by the loaders)."""

from __future__ import annotations

from typing import Any

import torch


def _data(
    x: torch.Tensor,
    edge_index: torch.Tensor,
    y: torch.Tensor,
    masks: dict[str, torch.Tensor] | None = None,
    *,
    undirected: bool = True,
) -> Any:
    """A ``Data`` with coalesced edges sorted by target (both directions if undirected)."""
    from torch_geometric.data import Data

    num_nodes = x.size(0)
    edge_index = _coalesce(edge_index, num_nodes, undirected=undirected)
    data = Data(x=x, edge_index=edge_index, y=y)
    for key, mask in (masks or {}).items():
        data[key] = mask
    data.num_classes = int(y.max()) + 1 if y.numel() else 0
    return data


def _coalesce(edge_index: torch.Tensor, num_nodes: int, *, undirected: bool) -> torch.Tensor:
    """Drop self-loops and duplicates, add reverse edges if undirected, sort by (dst, src)."""
    src, dst = edge_index
    if undirected:
        src, dst = torch.cat([src, dst]), torch.cat([dst, src])
    keep = src != dst
    key = torch.unique(dst[keep] * num_nodes + src[keep])  # sorted: by target, then source
    return torch.stack([key % num_nodes, key // num_nodes])


def _index_mask(index: torch.Tensor, size: int) -> torch.Tensor:
    mask = torch.zeros(size, dtype=torch.bool)
    mask[index] = True
    return mask
