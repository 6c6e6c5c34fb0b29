"""The neighbour sampler against the definition of NeighborLoader's sampling.

Oracles: PyG's ``k_hop_subgraph`` for the reached nodes with all neighbours, and the edge
lists of the graph itself (every sampled edge exists; ``min(degree, fanout)`` distinct
in-neighbours per node; each neighbour equally likely).
"""

from __future__ import annotations

import pytest
import torch

from modelzoo.graph.datasets import sbm_graph
from modelzoo.graph.sampler import NeighborSampler


@pytest.fixture(scope="module")
def graph():
    return sbm_graph(600, num_blocks=3, avg_degree=12, num_features=4, seed=5)


def _global_edges(sub, n_id):
    return {(int(n_id[s]), int(n_id[t])) for s, t in sub.edge_index.t().tolist()}


def test_all_neighbours_reach_the_k_hop_subgraph(graph):
    from torch_geometric.utils import k_hop_subgraph

    seeds = torch.tensor([3, 77, 400])
    sub = NeighborSampler(graph.edge_index, graph.num_nodes, [-1, -1]).sample(seeds)
    subset, _, _, _ = k_hop_subgraph(seeds, 2, graph.edge_index, num_nodes=graph.num_nodes)
    assert set(sub.n_id.tolist()) == set(subset.tolist())
    assert sub.n_id[:3].tolist() == [3, 77, 400] and sub.batch_size == 3
    assert sub.n_id.unique().numel() == sub.n_id.numel()
    one_hop, _, _, _ = k_hop_subgraph(seeds, 1, graph.edge_index, num_nodes=graph.num_nodes)
    src, dst = graph.edge_index
    inner = torch.isin(dst, one_hop)  # edges into nodes within one hop: both layers use them
    expected = set(zip(src[inner].tolist(), dst[inner].tolist(), strict=True))
    assert _global_edges(sub, sub.n_id) == expected


def test_fanout_limits_and_edges_exist(graph):
    torch.manual_seed(0)
    fanouts = [5, 3]
    sampler = NeighborSampler(graph.edge_index, graph.num_nodes, fanouts)
    seeds = torch.arange(0, 600, 37)
    sub = sampler.sample(seeds)
    true_edges = set(map(tuple, graph.edge_index.t().tolist()))
    edges = _global_edges(sub, sub.n_id)
    assert edges <= true_edges
    assert len(edges) == sub.edge_index.size(1)  # no edge sampled twice
    degree = torch.bincount(graph.edge_index[1], minlength=graph.num_nodes)
    per_target = torch.bincount(sub.edge_index[1], minlength=sub.n_id.numel())
    # seeds: min(deg, 5) neighbours (+ up to 3 more edges if the seed is also a hop-1 node)
    for local, node in enumerate(seeds.tolist()):
        assert min(int(degree[node]), 5) <= int(per_target[local]) <= min(int(degree[node]), 8)
    assert bool((sub.edge_index[1][1:] >= sub.edge_index[1][:-1]).all())  # sorted by target


def test_each_neighbour_is_equally_likely(graph):
    degree = torch.bincount(graph.edge_index[1], minlength=graph.num_nodes)
    node = int(torch.nonzero(degree >= 10)[0])
    neighbours = graph.edge_index[0][graph.edge_index[1] == node].tolist()
    sampler = NeighborSampler(graph.edge_index, graph.num_nodes, [3])
    gen = torch.Generator().manual_seed(1)
    counts = dict.fromkeys(neighbours, 0)
    trials = 3000
    for _ in range(trials):
        sub = sampler.sample(torch.tensor([node]), generator=gen)
        picked = sub.n_id[sub.edge_index[0]].tolist()
        assert len(set(picked)) == 3
        for v in picked:
            counts[v] += 1
    expected = trials * 3 / len(neighbours)
    for v, c in counts.items():
        assert abs(c - expected) < 5 * expected**0.5, (v, c, expected)


def test_bad_fanouts_are_refused(graph):
    with pytest.raises(ValueError, match="fanouts must be positive"):
        NeighborSampler(graph.edge_index, graph.num_nodes, [25, 0])


@pytest.mark.parametrize("name", ["graphsage_mean", "graphsage_pool", "graphsage_lstm", "gat"])
def test_layer_sizes_give_the_seeds_the_same_output(graph, name):
    """Skipping the outer hops' work (DGL's message-flow graphs) changes no seed's output:
    the reference is the same model on the whole sampled subgraph (itself checked against
    dense math in test_graph_layers.py)."""
    import modelzoo

    torch.manual_seed(0)
    sub = NeighborSampler(graph.edge_index, graph.num_nodes, [6, 4]).sample(
        torch.arange(0, 600, 29)
    )
    counts = torch.bincount(sub.edge_index[1], minlength=sub.n_id.numel())
    (hop1_end, hop1_edges), (seeds, seed_edges) = sub.layer_sizes
    assert seeds == sub.batch_size and int(counts[hop1_end:].sum()) == 0  # outer hop: no in-edges
    assert seed_edges == int(counts[:seeds].sum()) and hop1_edges == sub.edge_index.size(1)
    model = modelzoo.get_model(name, num_classes=3, in_channels=4).double().eval()
    x = graph.x[sub.n_id].double()
    with torch.no_grad():
        full = model(x, sub.edge_index)[: sub.batch_size]
        trimmed = model(x, sub.edge_index, sub.layer_sizes)
    assert trimmed.shape == full.shape
    torch.testing.assert_close(trimmed, full)


@pytest.mark.parametrize("fanouts", [[6, 4], [5, 3, 2]])
def test_hop_counts_drive_pygs_trim_to_layer(graph, fanouts):
    """``hop_counts`` is what PyG's NeighborLoader batches carry: with it, PyG's own
    GraphSAGE trimmed layer by layer (``trim_to_layer``) gives the seeds the outputs of the
    same model on the whole subgraph (the oracle: PyG, untrimmed)."""
    from torch_geometric.nn.models import GraphSAGE

    sub = NeighborSampler(graph.edge_index, graph.num_nodes, fanouts).sample(
        torch.arange(0, 600, 31)
    )
    nodes, edges = sub.hop_counts()
    assert sum(nodes) == sub.n_id.numel() and sum(edges) == sub.edge_index.size(1)
    assert nodes[0] == sub.batch_size and len(nodes) == len(fanouts) + 1
    assert len(edges) == len(fanouts)
    torch.manual_seed(0)
    model = GraphSAGE(4, 16, num_layers=len(fanouts), out_channels=3).double().eval()
    x = graph.x[sub.n_id].double()
    with torch.no_grad():
        full = model(x, sub.edge_index)[: sub.batch_size]
        trimmed = model(x, sub.edge_index, num_sampled_nodes_per_hop=nodes,
                        num_sampled_edges_per_hop=edges)[: sub.batch_size]  # fmt: skip
    torch.testing.assert_close(trimmed, full)
