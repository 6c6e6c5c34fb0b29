"""GraphSAGE: inductive representation learning on large graphs.

Hamilton, Ying & Leskovec, "Inductive Representation Learning on Large Graphs" (NeurIPS
2017), https://arxiv.org/abs/1706.02216. The layer is ``torch_geometric.nn.SAGEConv``:

.. math::
    h_i' = W_1 h_i + W_2 \\, \\mathrm{AGG}(\\{h_j : j \\in \\mathcal N(i)\\})

with the paper's aggregators: ``mean``; ``pool`` (element-wise max of
``ReLU(W_pool h_j + b)``); ``lstm`` (an LSTM over the neighbours,
:class:`~modelzoo.graph.layers.PackedLSTMAggregation`). The recipe is DGL's
(``examples/pytorch/graphsage``): 2 layers, hidden 16 on Planetoid (256 on Reddit and
ogbn-products with fan-outs 25,10), ReLU, dropout 0.5.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import register_model
from ._common import (
    NodeClassifier,
    bipartite,
    check_choice,
    check_dropout,
    check_positive,
    published,
)
from .datasets import KARATE_CLUB_NAMES
from .synthetic import sbm_block_names

__all__ = ["AGGREGATORS", "GraphSAGE"]

AGGREGATORS = ("mean", "pool", "lstm")
_PAPER = "https://arxiv.org/abs/1706.02216"


def _sage_conv(in_channels: int, out_channels: int, aggregator: str) -> nn.Module:
    from torch_geometric.nn import SAGEConv

    if aggregator == "mean":
        return SAGEConv(in_channels, out_channels, aggr="mean")
    if aggregator == "pool":  # project=True: ReLU(W_pool h_j + b) before the max
        return SAGEConv(in_channels, out_channels, aggr="max", project=True)
    from .layers import PackedLSTMAggregation

    return SAGEConv(in_channels, out_channels, aggr=PackedLSTMAggregation(in_channels, in_channels))


class GraphSAGE(NodeClassifier):
    """GraphSAGE for node classification, full-graph or on sampled subgraphs.

    Args:
        in_channels: Node feature size.
        num_classes: Output classes.
        hidden_channels: Width of the hidden layers.
        num_layers: SAGE layers in all (the last one outputs the logits); with neighbour
            sampling, give one fan-out per layer.
        aggregator: ``"mean"``, ``"pool"`` or ``"lstm"``.
        dropout: Dropout after every hidden layer.

    Shape:
        ``x`` ``(N, in_channels)``, ``edge_index`` ``(2, E)`` -> ``(N, num_classes)``. The
        ``lstm`` aggregator needs ``edge_index`` sorted by target (the datasets and the
        sampler give it so).
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        *,
        hidden_channels: int = 16,
        num_layers: int = 2,
        aggregator: str = "mean",
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        check_positive("GraphSAGE", in_channels=in_channels, num_classes=num_classes,
                       hidden_channels=hidden_channels, num_layers=num_layers)  # fmt: skip
        check_dropout("GraphSAGE", dropout=dropout)
        self.aggregator = check_choice("GraphSAGE", "aggregator", aggregator, AGGREGATORS)
        self.in_channels, self.num_classes = in_channels, num_classes
        widths = [in_channels] + [hidden_channels] * (num_layers - 1)
        self.convs = nn.ModuleList(
            _sage_conv(a, b, aggregator) for a, b in zip(widths[:-1], widths[1:], strict=True)
        )
        self.head = _sage_conv(widths[-1], num_classes, aggregator)
        self.dropout = dropout
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Kaiming-uniform linear layers (``torch_geometric``'s default, as DGL's Xavier)."""
        for conv in (*self.convs, self.head):
            conv.reset_parameters()

    supports_layer_sizes = True

    def layer_forward(
        self,
        index: int,
        x: torch.Tensor,
        edge_index: torch.Tensor,
        *,
        size: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """One SAGE layer (ReLU and dropout after the hidden ones); see
        :meth:`NodeClassifier.layer_forward`."""
        inputs, edges = bipartite(x, edge_index, size)
        x = self.layer(index)(inputs, edges)  # (N_dst, out)
        if index < len(self.convs):
            x = F.relu(x)
            x = F.dropout(x, self.dropout, training=self.training)
        return x


# --------------------------------------------------------------------------- published weights
# Trained here by the recorded command; the files ship in modelzoo/graph/weights/.
_KARATE = published(
    "graphsage_mean_karate",
    "6d9d4477efc56d26d0cf2e973b03ee684a0cf3572b1d056471a00238749b5c7b",
    num_params=1170,
    num_classes=2,
    metrics={"test_acc": 90.91},
    command="python scripts/train_gnn.py --model graphsage_mean_karate --dataset karate --export-weights "
    "--no-progress --seed 0 --run-log logs/karate_graphsage_mean/seed0.jsonl",
    log="logs/karate_graphsage_mean/seed0.jsonl",
    paper=_PAPER,
    dataset="karate club (built in)",
    labels=KARATE_CLUB_NAMES,
)
_SBM = published(
    "graphsage_mean_sbm",
    "2da9efaff7b306bad711e2d14e3acbed23139f0e5320022d0a3502844eaa0e44",
    num_params=5192,
    num_classes=8,
    metrics={"test_acc": 95.73},
    command="python scripts/train_gnn.py --model graphsage_mean_sbm --dataset sbm --fanouts 25,10 --batch-size 1024 --lr 0.003 --num-epochs 5 --export-weights "
    "--no-progress --seed 0 --run-log logs/sbm_graphsage_mean/seed0.jsonl",
    log="logs/sbm_graphsage_mean/seed0.jsonl",
    paper=_PAPER,
    dataset="synthetic SBM, 100k nodes (datasets.sbm_graph)",
    labels=sbm_block_names(8),
)


# ---------------------------------------------------------------------------------- builders
def _sage(aggregator: str, num_classes: int, in_channels: int, **kwargs: Any) -> GraphSAGE:
    options = {"hidden_channels": 16, "num_layers": 2, **kwargs}
    return GraphSAGE(in_channels, num_classes, aggregator=aggregator, **options)


@register_model
def graphsage_mean(*, num_classes: int = 7, in_channels: int = 1433, **kwargs: Any) -> GraphSAGE:
    """GraphSAGE-mean with the Cora recipe: 2 layers, hidden 16."""
    return _sage("mean", num_classes, in_channels, **kwargs)


@register_model
def graphsage_pool(*, num_classes: int = 7, in_channels: int = 1433, **kwargs: Any) -> GraphSAGE:
    """GraphSAGE-pool (max-pooling aggregator) with the Cora recipe: 2 layers, hidden 16."""
    return _sage("pool", num_classes, in_channels, **kwargs)


@register_model
def graphsage_lstm(*, num_classes: int = 7, in_channels: int = 1433, **kwargs: Any) -> GraphSAGE:
    """GraphSAGE-LSTM with the Cora recipe: 2 layers, hidden 16."""
    return _sage("lstm", num_classes, in_channels, **kwargs)


@register_model(weights={"karate": _KARATE})
def graphsage_mean_karate(
    *, num_classes: int = 2, in_channels: int = 34, **kwargs: Any
) -> GraphSAGE:
    """GraphSAGE-mean for the karate club (34 one-hot features, 2 clubs): hidden 16."""
    return _sage("mean", num_classes, in_channels, **kwargs)


@register_model(weights={"sbm": _SBM})
def graphsage_mean_sbm(*, num_classes: int = 8, in_channels: int = 32, **kwargs: Any) -> GraphSAGE:
    """GraphSAGE-mean for the 100k-node SBM graph (32 features, 8 blocks): hidden 64."""
    kwargs.setdefault("hidden_channels", 64)
    return _sage("mean", num_classes, in_channels, **kwargs)
