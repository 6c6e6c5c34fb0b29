"""GCN: graph convolutional networks for semi-supervised node classification.

Kipf & Welling, "Semi-Supervised Classification with Graph Convolutional Networks" (ICLR
2017), https://arxiv.org/abs/1609.02907. The layer is ``torch_geometric.nn.GCNConv``:

.. math::
    H' = \\hat D^{-1/2} (A + I) \\hat D^{-1/2} H W + b

The recipe is DGL's example (``examples/pytorch/gcn``): 2 layers, hidden 16, ReLU, dropout
0.5 before the second layer, Adam lr 1e-2, weight decay 5e-4, 200 epochs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import register_model
from ._common import NodeClassifier, check_dropout, check_positive, published
from .datasets import KARATE_CLUB_NAMES
from .synthetic import sbm_block_names

__all__ = ["GCN"]

_PAPER = "https://arxiv.org/abs/1609.02907"


class GCN(NodeClassifier):
    """Kipf & Welling's GCN.

    Args:
        in_channels: Node feature size.
        num_classes: Output classes.
        hidden_channels: Width of the hidden layers.
        num_layers: Graph convolutions in all (the last one outputs the logits).
        dropout: Dropout on the input of every layer but the first (DGL's placement).

    Shape:
        ``x`` ``(N, in_channels)``, ``edge_index`` ``(2, E)`` -> ``(N, num_classes)``.

    Example:
        >>> net = GCN(in_channels=34, num_classes=2)
        >>> net(torch.eye(34), edge_index).shape
        torch.Size([34, 2])
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        *,
        hidden_channels: int = 16,
        num_layers: int = 2,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        check_positive("GCN", in_channels=in_channels, num_classes=num_classes,
                       hidden_channels=hidden_channels, num_layers=num_layers)  # fmt: skip
        check_dropout("GCN", dropout=dropout)
        from torch_geometric.nn import GCNConv

        self.in_channels, self.num_classes = in_channels, num_classes
        widths = [in_channels] + [hidden_channels] * (num_layers - 1)
        self.convs = nn.ModuleList(
            GCNConv(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True)
        )
        self.head = GCNConv(widths[-1], num_classes)
        self.dropout = dropout
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot-uniform weights and zero biases, as in the paper's code."""
        for conv in (*self.convs, self.head):
            conv.reset_parameters()

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        for index in range(self.num_message_passing_layers):
            x = self.layer_forward(index, x, edge_index)  # (N, hidden), last (N, num_classes)
        return x

    def layer_forward(
        self,
        index: int,
        x: torch.Tensor,
        edge_index: torch.Tensor,
        *,
        size: tuple[int, int] | None = None,
        edge_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One graph convolution (ReLU and dropout after the hidden ones).

        ``D^-1/2 (A + I) D^-1/2`` needs every source's degree in the whole graph, which a
        block does not have: with ``size`` (a block), pass ``edge_weight``, the normalized
        weights of :meth:`layerwise_edges`' edges (self-loops included), and the layer
        computes ``sum_j w_ji (x_j W) + b`` over them. Without ``edge_weight`` it is
        ``GCNConv``'s own forward on a whole graph.
        """
        conv = self.layer(index)
        if edge_weight is None:
            if size is not None:
                raise ValueError(
                    "GCN.layer_forward: a bipartite block (size=...) needs edge_weight, the "
                    "whole graph's normalisation from GCN.layerwise_edges; a block's own "
                    "degrees are not the graph's"
                )
            x = conv(x, edge_index)  # (N, out)
        else:
            num_dst, num_edges = (x.size(0), edge_index.size(1)) if size is None else size
            h = conv.lin(x)  # (N_src, out)
            edges, weight = edge_index[:, :num_edges], edge_weight[:num_edges]
            x = conv.propagate(edges, x=h, edge_weight=weight, size=(x.size(0), num_dst))
            if conv.bias is not None:
                x = x + conv.bias  # (N_dst, out)
        if index < len(self.convs):
            x = F.relu(x)
            x = F.dropout(x, self.dropout, training=self.training)
        return x

    def layerwise_edges(
        self, edge_index: torch.Tensor, num_nodes: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The edges with ``GCNConv``'s self-loops and their weights ``d_j^-1/2 d_i^-1/2``,
        computed on the whole graph as ``GCNConv`` does (every layer shares them)."""
        from torch_geometric.nn.conv.gcn_conv import gcn_norm

        conv = self.head
        layers = (*self.convs, self.head)
        settings = {(c.improved, c.add_self_loops, c.normalize, c.flow) for c in layers}
        if len(settings) != 1 or not conv.normalize or conv.flow != "source_to_target":
            raise ValueError(
                "GCN: layer-wise inference needs every GCNConv normalized the same way, with "
                "normalize=True and flow='source_to_target'; got (improved, add_self_loops, "
                f"normalize, flow) = {sorted(settings)}"
            )
        edges, weight = gcn_norm(edge_index, None, num_nodes, conv.improved,
                                 conv.add_self_loops, conv.flow, dtype)  # fmt: skip
        return edges, {"edge_weight": weight}


# --------------------------------------------------------------------------- published weights
# Trained here by the recorded command; the files ship in modelzoo/graph/weights/.
_KARATE = published(
    "gcn_karate",
    "3b77115e2586f89be82ebc5b453192e7d29182ee19e99b1b388f2d604be5f1e1",
    num_params=594,
    num_classes=2,
    metrics={"test_acc": 95.45},
    command="python scripts/train_gnn.py --model gcn_karate --dataset karate --export-weights "
    "--no-progress --seed 0 --run-log logs/karate_gcn/seed0.jsonl",
    log="logs/karate_gcn/seed0.jsonl",
    paper=_PAPER,
    dataset="karate club (built in)",
    labels=KARATE_CLUB_NAMES,
)
_SBM = published(
    "gcn_sbm",
    "98b438f11278d64ca3e51e95fd5531e669153da4b9a28b318d031d045f5c0eed",
    num_params=2632,
    num_classes=8,
    metrics={"test_acc": 96.90},
    command="python scripts/train_gnn.py --model gcn_sbm --dataset sbm --num-epochs 30 --eval-interval 5 --export-weights "
    "--no-progress --seed 0 --run-log logs/sbm_gcn/seed0.jsonl",
    log="logs/sbm_gcn/seed0.jsonl",
    paper=_PAPER,
    dataset="synthetic SBM, 100k nodes (datasets.sbm_graph)",
    labels=sbm_block_names(8),
)


# ---------------------------------------------------------------------------------- builders
@register_model
def gcn(*, num_classes: int = 7, in_channels: int = 1433, **kwargs: Any) -> GCN:
    """GCN with the Cora recipe (1433 features, 7 classes): 2 layers, hidden 16."""
    return GCN(in_channels, num_classes, **{"hidden_channels": 16, "num_layers": 2, **kwargs})


@register_model(weights={"karate": _KARATE})
def gcn_karate(*, num_classes: int = 2, in_channels: int = 34, **kwargs: Any) -> GCN:
    """GCN for the karate club (34 one-hot features, 2 clubs): 2 layers, hidden 16."""
    return GCN(in_channels, num_classes, **{"hidden_channels": 16, "num_layers": 2, **kwargs})


@register_model(weights={"sbm": _SBM})
def gcn_sbm(*, num_classes: int = 8, in_channels: int = 32, **kwargs: Any) -> GCN:
    """GCN for the 100k-node SBM graph (32 features, 8 blocks): 2 layers, hidden 64."""
    return GCN(in_channels, num_classes, **{"hidden_channels": 64, "num_layers": 2, **kwargs})
