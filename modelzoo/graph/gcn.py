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
        for conv in self.convs:
            x = conv(x, edge_index)  # (N, hidden)
            x = F.relu(x)
            x = F.dropout(x, self.dropout, training=self.training)
        return self.head(x, edge_index)  # (N, num_classes)


# --------------------------------------------------------------------------- published weights
# Trained here by the recorded command; the files ship in modelzoo/graph/weights/.
_KARATE = published(
    "gcn_karate",
    "a58f4044f92f8cf65610ce08b1186a2836f7ed02379b3495fd153f1aa5e05363",
    num_params=594,
    num_classes=2,
    metrics={"test_acc": 95.45},
    command="python scripts/train_gnn.py --model gcn_karate --dataset karate --export-weights "
    "--no-progress --seed 0 --run-log logs/karate_gcn/seed0.jsonl",
    log="logs/karate_gcn/seed0.jsonl",
    paper=_PAPER,
    dataset="karate club (built in)",
)
_SBM = published(
    "gcn_sbm",
    "f2a84932c2211b11be340965ef4d2f710355f8a928698cc3ac19c347c7c6bf10",
    num_params=2632,
    num_classes=8,
    metrics={"test_acc": 96.90},
    command="python scripts/train_gnn.py --model gcn_sbm --dataset sbm --num-epochs 30 --eval-interval 5 --export-weights "
    "--no-progress --seed 0 --run-log logs/sbm_gcn/seed0.jsonl",
    log="logs/sbm_gcn/seed0.jsonl",
    paper=_PAPER,
    dataset="synthetic SBM, 100k nodes (datasets.sbm_graph)",
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
