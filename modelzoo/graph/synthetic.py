"""Synthetic stochastic-block-model graphs: node classification on one graph of up to
millions of nodes, and graph classification over many small graphs (seeded, homophilous)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._graph_data import _coalesce, _data, _index_mask

__all__ = [
    "SBM_GRAPH_CLASSES",
    "SBM_GRAPH_CLASS_NAMES",
    "sbm_block_names",
    "sbm_graph",
    "sbm_graph_classification",
]


# ------------------------------------------------------------------------------- synthetic
def sbm_block_names(num_blocks: int) -> tuple[str, ...]:
    """Class names of :func:`sbm_graph`'s labels: ``y == b`` is block ``b``, ``"block b"``."""
    return tuple(f"block {b}" for b in range(num_blocks))


def _split_masks(
    num_nodes: int, fractions: Sequence[float], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    perm = torch.randperm(num_nodes, generator=generator)
    sizes = [int(f * num_nodes) for f in fractions]
    masks, start = {}, 0
    for key, size in zip(("train_mask", "val_mask", "test_mask"), sizes, strict=True):
        masks[key] = _index_mask(perm[start : start + size], num_nodes)
        start += size
    return masks


def _planted_edges(
    blocks: torch.Tensor, num_blocks: int, num_edges: int, p_intra: float, g: torch.Generator
) -> torch.Tensor:
    """``num_edges`` edges whose ends share a block with probability ``p_intra``.

    Node ``i`` is in block ``blocks[i]``; the other end is uniform within the chosen block.
    """
    n = blocks.numel()
    order = torch.argsort(blocks, stable=True)  # nodes grouped by block
    counts = torch.bincount(blocks, minlength=num_blocks)
    starts = torch.cumsum(counts, 0) - counts
    src = torch.randint(n, (num_edges,), generator=g)
    same = torch.rand(num_edges, generator=g) < p_intra
    shift = torch.randint(1, max(num_blocks, 2), (num_edges,), generator=g)
    target_block = torch.where(same, blocks[src], (blocks[src] + shift) % num_blocks)
    target_block = torch.where(counts[target_block] > 0, target_block, blocks[src])  # empty
    offset = (torch.rand(num_edges, generator=g) * counts[target_block]).long()
    dst = order[starts[target_block] + offset]
    return torch.stack([src, dst])


def sbm_graph(
    num_nodes: int = 100_000,
    *,
    num_blocks: int = 8,
    avg_degree: float = 10.0,
    p_intra: float = 0.6,
    num_features: int = 32,
    feature_signal: float = 0.4,
    split: Sequence[float] = (0.1, 0.1, 0.8),
    seed: int = 0,
) -> Any:
    """A planted-partition stochastic block model graph for node classification.

    Each node's block (its label) is uniform over ``num_blocks``; ``num_nodes * avg_degree
    / 2`` undirected edges are drawn with a uniform first end and a second end in the same
    block with probability ``p_intra`` (else in another block), duplicates and self-loops
    dropped. Features are ``feature_signal * mu[block] + N(0, I)`` with ``mu`` standard
    normal per block, so neither the features nor the structure alone give the label away.
    The graph depends only on the arguments (CPU generator seeded with ``seed``).

    Returns:
        A ``Data`` with random ``split`` train/val/test masks and ``class_names``
        (:func:`sbm_block_names`).
    """
    if num_blocks < 2 or num_nodes < num_blocks:
        raise ValueError(
            f"sbm_graph: need num_nodes >= num_blocks >= 2, got {num_nodes}, {num_blocks}"
        )
    if not 0.0 <= p_intra <= 1.0:
        raise ValueError(f"sbm_graph: p_intra must be in [0, 1], got {p_intra}")
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(num_blocks, (num_nodes,), generator=g)
    edges = _planted_edges(blocks, num_blocks, int(num_nodes * avg_degree / 2), p_intra, g)
    mu = torch.randn(num_blocks, num_features, generator=g)
    x = feature_signal * mu[blocks] + torch.randn(num_nodes, num_features, generator=g)
    data = _data(x, edges, blocks, _split_masks(num_nodes, split, g))
    data.class_names = sbm_block_names(num_blocks)
    return data


#: Graph classes of :func:`sbm_graph_classification`: (blocks, average degree, p_intra).
SBM_GRAPH_CLASSES = ((1, 2.5, 1.0), (2, 5.0, 0.9), (4, 10.0, 0.8))
#: Class names of :func:`sbm_graph_classification`'s labels, from :data:`SBM_GRAPH_CLASSES`.
SBM_GRAPH_CLASS_NAMES = tuple(
    f"{k} block{'s' if k > 1 else ''} (avg degree {d:g}, p_intra {p:g})"
    for k, d, p in SBM_GRAPH_CLASSES
)


def sbm_graph_classification(
    num_graphs: int = 2500,
    *,
    min_nodes: int = 20,
    max_nodes: int = 60,
    split: Sequence[float] = (0.8, 0.1, 0.1),
    seed: int = 0,
) -> tuple[list[Any], dict[str, list[int]]]:
    """Small SBM graphs labelled by the model that made them (:data:`SBM_GRAPH_CLASSES`).

    Class ``c`` graphs have ``SBM_GRAPH_CLASSES[c]`` blocks, average degree and intra-block
    edge probability, a uniform size in ``[min_nodes, max_nodes]`` and one constant input
    feature per node (as TU datasets without node labels), so a classifier has to read the
    structure. About 100k nodes with the defaults.

    Returns:
        The graphs (``Data`` with ``x`` ``(n, 1)``, ``edge_index``, ``y`` ``(1,)``) and the
        ``{"train", "val", "test"}`` graph indices.
    """
    from torch_geometric.data import Data

    g = torch.Generator().manual_seed(seed)
    graphs = []
    for _ in range(num_graphs):
        label = int(torch.randint(len(SBM_GRAPH_CLASSES), (1,), generator=g))
        blocks_k, degree, p_intra = SBM_GRAPH_CLASSES[label]
        n = int(torch.randint(min_nodes, max_nodes + 1, (1,), generator=g))
        blocks = torch.randint(blocks_k, (n,), generator=g)
        edges = _planted_edges(blocks, blocks_k, int(n * degree / 2), p_intra, g)
        edge_index = _coalesce(edges, n, undirected=True)
        graphs.append(Data(x=torch.ones(n, 1), edge_index=edge_index, y=torch.tensor([label])))
    perm = torch.randperm(num_graphs, generator=g).tolist()
    a, b = int(split[0] * num_graphs), int((split[0] + split[1]) * num_graphs)
    return graphs, {"train": perm[:a], "val": perm[a:b], "test": perm[b:]}
