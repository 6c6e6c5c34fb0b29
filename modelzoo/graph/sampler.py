"""Neighbour sampling for mini-batch GNN training, on plain torch ops.

``torch_geometric.loader.NeighborLoader`` needs the compiled ``pyg-lib`` or ``torch-sparse``
packages, which have no wheels for every torch release (none for torch 2.13 on CPU), so
the sampler is ours, with the same semantics as ``NeighborLoader(num_neighbors=[25, 10])``
(directed, non-disjoint sampling; Hamilton et al. 2017): from the seed nodes, each hop
samples up to ``fanout`` in-neighbours of every newly reached node, without replacement
(all of them when the node has fewer; ``-1`` takes all). The result is the subgraph of the
sampled edges over every reached node, seeds first, so the same model runs on it as on the
whole graph and its first ``batch_size`` output rows are the seeds'.

Everything is vectorized over a CSR index by target (``rowptr``, ``col``): one
``repeat_interleave`` and one sort per hop, no Python loop over nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["CSRGraph", "NeighborSampler", "SampledSubgraph"]


@dataclass
class SampledSubgraph:
    """A sampled mini-batch: ``n_id`` maps local ids to graph ids; seeds are ``0..batch_size-1``.

    ``edge_index`` is in local ids, sorted by target; nodes are numbered hop by hop.
    """

    n_id: torch.Tensor  # (N_sub,)
    edge_index: torch.Tensor  # (2, E_sub)
    batch_size: int
    #: Per layer, input first: (nodes whose output the layer must compute, edges into them).
    #: Nodes are numbered by hop and edges sorted by target, so both are prefixes.
    layer_sizes: list[tuple[int, int]]

    def hop_counts(self) -> tuple[list[int], list[int]]:
        """``(num_sampled_nodes_per_hop, num_sampled_edges_per_hop)`` as PyG's
        ``NeighborLoader`` batches carry them, for ``torch_geometric.utils.trim_to_layer``
        (and PyG's ``BasicGNN`` models): the seeds then each hop's new nodes; per hop, the
        edges into that hop's nodes (the edges sampled at hop ``h + 1``)."""
        layers = len(self.layer_sizes)
        reached = [self.layer_sizes[layers - 1 - h][0] for h in range(layers)]
        reached.append(int(self.n_id.numel()))
        nodes = [reached[0]] + [reached[h] - reached[h - 1] for h in range(1, layers + 1)]
        into = [self.layer_sizes[layers - 1 - h][1] for h in range(layers)]
        edges = [into[0]] + [into[h] - into[h - 1] for h in range(1, layers)]
        return nodes, edges


class CSRGraph:
    """In-neighbour lists in CSR form: the sources of node ``v``'s edges are
    ``col[rowptr[v]:rowptr[v + 1]]``.

    Args:
        edge_index: ``(2, E)`` with rows ``(source, target)``.
        num_nodes: Number of nodes.
    """

    def __init__(self, edge_index: torch.Tensor, num_nodes: int) -> None:
        src, dst = edge_index
        order = torch.argsort(dst * num_nodes + src)
        self.col = src[order].contiguous()
        counts = torch.bincount(dst, minlength=num_nodes)
        self.rowptr = torch.zeros(num_nodes + 1, dtype=torch.long)
        torch.cumsum(counts, 0, out=self.rowptr[1:])
        self.num_nodes = num_nodes

    def degree(self, nodes: torch.Tensor) -> torch.Tensor:
        return self.rowptr[nodes + 1] - self.rowptr[nodes]


class NeighborSampler:
    """Samples the ``len(fanouts)``-hop neighbourhood of seed nodes (see the module docstring).

    Args:
        edge_index: ``(2, E)`` of the whole graph.
        num_nodes: Number of nodes.
        fanouts: Neighbours per hop, the seeds' hop first (``[25, 10]``); ``-1``: all.

    Randomness comes from torch's global CPU generator (or ``generator``), so a seeded run
    samples the same subgraphs.

    Example:
        >>> sampler = NeighborSampler(data.edge_index, data.num_nodes, [25, 10])
        >>> sub = sampler.sample(torch.tensor([0, 5, 9]))
        >>> out = model(data.x[sub.n_id], sub.edge_index)[: sub.batch_size]
    """

    def __init__(self, edge_index: torch.Tensor, num_nodes: int, fanouts: Sequence[int]) -> None:
        if not fanouts or any(f == 0 or f < -1 for f in fanouts):
            raise ValueError(
                f"fanouts must be positive neighbour counts (or -1 for all), one per layer, "
                f"e.g. 25,10; got {list(fanouts)}"
            )
        self.graph = CSRGraph(edge_index, num_nodes)
        self.fanouts = [int(f) for f in fanouts]
        self._local = torch.full((num_nodes,), -1, dtype=torch.long)  # graph id -> local id

    def _sample_hop(
        self, frontier: torch.Tensor, fanout: int, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled ``(edge positions in col, index into frontier of their target)``."""
        rowptr = self.graph.rowptr
        deg = self.graph.degree(frontier)
        total = int(deg.sum())
        row = torch.repeat_interleave(torch.arange(frontier.numel()), deg)  # (total,)
        first = torch.cumsum(deg, 0) - deg  # start of each row in the flattened list
        pos = torch.arange(total) - first[row]  # rank of the edge within its row
        edge = rowptr[frontier][row] + pos  # position in col
        if fanout < 0 or total == 0:
            return edge, row
        big = deg[row] > fanout
        if bool(big.any()):
            # Random order inside each row: sort by row + U(0, 1), keep the first `fanout`.
            keys = row.double() + torch.rand(total, generator=generator, dtype=torch.float64)
            keys = torch.where(big, keys, row.double())
            order = torch.argsort(keys)
            edge, row = edge[order], row[order]
            pos = torch.arange(total) - first[row]
        keep = pos < fanout
        return edge[keep], row[keep]

    def sample(
        self, seeds: torch.Tensor, generator: torch.Generator | None = None
    ) -> SampledSubgraph:
        """The sampled subgraph around ``seeds`` (distinct graph node ids)."""
        seeds = seeds.reshape(-1).long()
        local = self._local
        local[seeds] = torch.arange(seeds.numel())
        n_ids, sources, targets = [seeds], [], []
        frontier, count = seeds, seeds.numel()
        try:
            for fanout in self.fanouts:
                edge, row = self._sample_hop(frontier, fanout, generator)
                nbrs = self.graph.col[edge]
                new = torch.unique(nbrs[local[nbrs] < 0])
                local[new] = torch.arange(count, count + new.numel())
                count += new.numel()
                sources.append(local[nbrs])
                targets.append(local[frontier[row]])
                n_ids.append(new)
                frontier = new
            n_id = torch.cat(n_ids)
        finally:
            for part in n_ids:
                local[part] = -1  # ready for the next batch
        src, dst = torch.cat(sources), torch.cat(targets)
        order = torch.argsort(dst * count + src)  # sorted by target (LSTM aggregation)
        src, dst = src[order], dst[order]
        # Layer l (of L) needs outputs for hops 0 .. L-1-l: a prefix of nodes and of edges.
        reached = torch.cumsum(torch.tensor([p.numel() for p in n_ids]), 0).tolist()
        layers = len(self.fanouts)
        layer_sizes = []
        for layer in range(layers):
            num_dst = int(reached[layers - 1 - layer])
            num_edges = int(torch.searchsorted(dst, torch.tensor(num_dst)))
            layer_sizes.append((num_dst, num_edges))
        return SampledSubgraph(n_id, torch.stack([src, dst]), seeds.numel(), layer_sizes)
