"""The graph models' answers to the model-family protocol (:mod:`modelzoo.family`).

Two families: the node classifiers (GCN, GraphSAGE, GAT: node features and an edge list in,
per-node logits out) and GIN (graph classification: node features, edges inside each graph,
the node-to-graph vector and the number of graphs in, per-graph logits out). Both answer
export's questions (example graphs, dynamic node and edge counts); neither is split by
pipeline or tensor parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..family import Modality, ModelFamily, register_family, register_modality
from ._common import NodeClassifier
from .gin import GIN

__all__ = ["GINFamily", "GraphModality", "NodeClassifierFamily"]


class GraphModality(Modality):
    """Graphs: the node-feature transform ``train_gnn.py`` applied
    (:class:`modelzoo.graph.transforms.NodeFeatures`; option ``normalize_features``)."""

    name = "graph"

    def transforms(self, options: dict[str, Any], owner: str) -> Any:
        from .transforms import NodeFeatures

        return NodeFeatures(normalize=bool(options.get("normalize_features")))


register_modality(GraphModality())


def _random_edges(
    node_graph: torch.Tensor, num_edges: int, generator: torch.Generator
) -> torch.Tensor:
    """``(2, E)`` random edges, each inside one graph of ``node_graph``, sorted by target
    (GraphSAGE's LSTM aggregator needs that order; the others do not care)."""
    counts = torch.bincount(node_graph)
    starts = torch.cumsum(counts, 0) - counts
    src = torch.randint(0, node_graph.numel(), (num_edges,), generator=generator)
    graph = node_graph[src]
    offset = torch.randint(0, 2**31 - 1, (num_edges,), generator=generator) % counts[graph]
    dst = starts[graph] + offset
    order = torch.argsort(dst, stable=True)
    return torch.stack([src[order], dst[order]])  # (2, E)


class NodeClassifierFamily(ModelFamily):
    """GCN, GraphSAGE and GAT: ``forward(x, edge_index)`` -> per-node logits."""

    name = "node classifiers"
    model_classes = (NodeClassifier,)
    modality = "graph"
    classifiers = (NodeClassifier,)

    def example_inputs(
        self,
        model: nn.Module,
        *,
        batch_size: int,
        generator: torch.Generator,
        num_nodes: int = 12,
        num_edges: int = 48,
        **sizes: Any,
    ) -> tuple[Any, ...]:
        x = torch.randn(num_nodes, model.in_channels, generator=generator)
        graph = torch.zeros(num_nodes, dtype=torch.long)
        return x, _random_edges(graph, num_edges, generator)

    def inputs_like(self, model: nn.Module, inputs: tuple[Any, ...]) -> dict[str, Any]:
        # Denser as well as larger: other node degrees, which a trace may have baked in.
        return {"num_nodes": inputs[0].shape[0] + 3, "num_edges": 2 * inputs[1].shape[1] + 5}

    def dynamic_shapes(self, model: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        from torch.export import Dim

        nodes, edges = Dim("num_nodes", min=1), Dim("num_edges", min=1)
        specs: list[Any] = [{0: nodes}, {1: edges}]
        if len(inputs) > 2:
            specs.append(None if inputs[2] is None else {0: nodes})  # GIN's batch (N,)
        if len(inputs) > 3:
            specs.append(Dim.DYNAMIC if isinstance(inputs[3], int) else None)  # num_graphs
        return (tuple(specs) + (None,) * len(inputs))[: len(inputs)]


class GINFamily(NodeClassifierFamily):
    """GIN: ``forward(x, edge_index, batch, num_graphs)`` -> per-graph logits."""

    name = "GIN"
    model_classes = (GIN,)
    classifiers = (GIN,)
    tracing_options = {"num_graphs": None}

    def output_axes(self, model: nn.Module, inputs: tuple[Any, ...]) -> dict[tuple[int, int], str]:
        if len(inputs) > 3 and isinstance(inputs[3], int):
            return {(0, 0): "num_graphs"}  # (num_graphs, classes)
        return {}

    def example_inputs(
        self,
        model: nn.Module,
        *,
        batch_size: int,
        generator: torch.Generator,
        num_nodes: int = 12,
        num_edges: int = 48,
        num_graphs: int | None = 2,
        **sizes: Any,
    ) -> tuple[Any, ...]:
        """``x``, ``edge_index`` (edges inside each graph), ``batch`` ``(num_nodes,)`` and the
        int ``num_graphs``; with ``num_graphs=None`` only ``x`` and ``edge_index`` (one
        graph; TorchScript traces tensors only)."""
        graphs = 1 if num_graphs is None else num_graphs
        if not 1 <= graphs <= num_nodes:
            raise ValueError(
                f"example_inputs: num_graphs must be in [1, num_nodes={num_nodes}], "
                f"got {num_graphs}"
            )
        x = torch.randn(num_nodes, model.in_channels, generator=generator)
        batch = torch.arange(num_nodes) * graphs // num_nodes  # (N,), sorted, no empty graph
        edges = _random_edges(batch, num_edges, generator)
        if num_graphs is None:
            return x, edges
        return x, edges, batch, num_graphs

    def inputs_like(self, model: nn.Module, inputs: tuple[Any, ...]) -> dict[str, Any]:
        sizes = super().inputs_like(model, inputs)
        sizes["num_graphs"] = int(inputs[2].max()) + 2 if len(inputs) > 2 else None
        return sizes


register_family(NodeClassifierFamily())
register_family(GINFamily())
