"""GAT: graph attention networks.

Veličković et al., "Graph Attention Networks" (ICLR 2018), https://arxiv.org/abs/1710.10903.
The layer is ``torch_geometric.nn.GATConv`` (self-loops added):

.. math::
    \\alpha_{ij} = \\mathrm{softmax}_j\\big(\\mathrm{LeakyReLU}_{0.2}(a_s^\\top W h_j +
    a_t^\\top W h_i)\\big), \\qquad h_i' = \\big\\Vert_{k=1}^{K} \\sum_j \\alpha^k_{ij} W^k h_j

The recipe is the paper's and DGL's (``examples/pytorch/gat``): 8 heads x 8 hidden with
ELU, one output head averaged, dropout 0.6 on features and attention, Adam lr 5e-3, weight
decay 5e-4, early stopping on validation (patience 100).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import register_model
from ._common import NodeClassifier, bipartite, check_dropout, check_positive, published
from .datasets import KARATE_CLUB_NAMES
from .synthetic import sbm_block_names

__all__ = ["GAT"]

_PAPER = "https://arxiv.org/abs/1710.10903"


class GAT(NodeClassifier):
    """Multi-head graph attention network for node classification.

    Args:
        in_channels: Node feature size.
        num_classes: Output classes.
        hidden_channels: Features per head in the hidden layers.
        heads: Attention heads of the hidden layers (concatenated).
        out_heads: Attention heads of the output layer (averaged).
        num_layers: GAT layers in all (the last one outputs the logits).
        dropout: Dropout on each layer's input features.
        attn_dropout: Dropout on the attention coefficients.
        negative_slope: LeakyReLU slope of the attention scores.

    Shape:
        ``x`` ``(N, in_channels)``, ``edge_index`` ``(2, E)`` -> ``(N, num_classes)``.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        *,
        hidden_channels: int = 8,
        heads: int = 8,
        out_heads: int = 1,
        num_layers: int = 2,
        dropout: float = 0.6,
        attn_dropout: float = 0.6,
        negative_slope: float = 0.2,
    ) -> None:
        super().__init__()
        check_positive("GAT", in_channels=in_channels, num_classes=num_classes,
                       hidden_channels=hidden_channels, heads=heads, out_heads=out_heads,
                       num_layers=num_layers)  # fmt: skip
        check_dropout("GAT", dropout=dropout, attn_dropout=attn_dropout)
        from torch_geometric.nn import GATConv

        self.in_channels, self.num_classes = in_channels, num_classes
        widths = [in_channels] + [hidden_channels * heads] * (num_layers - 1)
        self.convs = nn.ModuleList(
            GATConv(a, hidden_channels, heads=heads, dropout=attn_dropout,
                    negative_slope=negative_slope)
            for a in widths[:-1]
        )  # fmt: skip
        self.head = GATConv(widths[-1], num_classes, heads=out_heads, concat=False,
                            dropout=attn_dropout, negative_slope=negative_slope)  # fmt: skip
        self.dropout = dropout
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot weights and attention vectors, zero biases (the paper's initialization)."""
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
        """Dropout, then one GAT layer (ELU after the hidden ones); see
        :meth:`NodeClassifier.layer_forward`. The attention softmax runs over each target's
        in-edges plus its self-loop, so a block with all of them gives the whole graph's."""
        x = F.dropout(x, self.dropout, training=self.training)
        inputs, edges = bipartite(x, edge_index, size)
        x = self.layer(index)(inputs, edges)  # (N_dst, heads * hidden)
        if index < len(self.convs):
            x = F.elu(x)
        return x


# --------------------------------------------------------------------------- published weights
# Trained here by the recorded command; the files ship in modelzoo/graph/weights/.
_KARATE = published(
    "gat_karate",
    "2678746730788b80f92a472ed85a6cbee27594114acf5e943bdb9379b1fe284c",
    num_params=2502,
    num_classes=2,
    metrics={"test_acc": 95.45},
    command="python scripts/train_gnn.py --model gat_karate --dataset karate --lr 0.005 --export-weights "
    "--no-progress --seed 0 --run-log logs/karate_gat/seed0.jsonl",
    log="logs/karate_gat/seed0.jsonl",
    paper=_PAPER,
    dataset="karate club (built in)",
    labels=KARATE_CLUB_NAMES,
)
_SBM = published(
    "gat_sbm",
    "f2daca65431db0e7bf112722381ac861d0005cef883c63ef26d2e91e82415f10",
    num_params=2776,
    num_classes=8,
    metrics={"test_acc": 95.55},
    command="python scripts/train_gnn.py --model gat_sbm --dataset sbm --fanouts 10,10 --batch-size 1024 --lr 0.01 --num-epochs 5 --export-weights "
    "--no-progress --seed 0 --run-log logs/sbm_gat/seed0.jsonl",
    log="logs/sbm_gat/seed0.jsonl",
    paper=_PAPER,
    dataset="synthetic SBM, 100k nodes (datasets.sbm_graph)",
    labels=sbm_block_names(8),
)


# ---------------------------------------------------------------------------------- builders
@register_model
def gat(*, num_classes: int = 7, in_channels: int = 1433, **kwargs: Any) -> GAT:
    """GAT with the Cora recipe: 8 heads x 8 hidden, one output head."""
    return GAT(
        in_channels, num_classes, **{"hidden_channels": 8, "heads": 8, "out_heads": 1, **kwargs}
    )


@register_model(weights={"karate": _KARATE})
def gat_karate(*, num_classes: int = 2, in_channels: int = 34, **kwargs: Any) -> GAT:
    """GAT for the karate club (34 one-hot features, 2 clubs): 8 heads x 8 hidden."""
    return GAT(
        in_channels, num_classes, **{"hidden_channels": 8, "heads": 8, "out_heads": 1, **kwargs}
    )


@register_model(weights={"sbm": _SBM})
def gat_sbm(*, num_classes: int = 8, in_channels: int = 32, **kwargs: Any) -> GAT:
    """GAT for the 100k-node SBM graph (32 features, 8 blocks): 4 heads x 16 hidden."""
    return GAT(
        in_channels, num_classes, **{"hidden_channels": 16, "heads": 4, "out_heads": 1, **kwargs}
    )
