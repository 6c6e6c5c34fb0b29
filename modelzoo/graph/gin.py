"""GIN: graph isomorphism networks for graph classification.

Xu et al., "How Powerful are Graph Neural Networks?" (ICLR 2019),
https://arxiv.org/abs/1810.00826. The layer is ``torch_geometric.nn.GINConv``:

.. math::
    h_i' = \\mathrm{MLP}\\big((1 + \\epsilon) h_i + \\textstyle\\sum_{j \\in \\mathcal N(i)} h_j\\big)

As in the paper and DGL's example (``examples/pytorch/gin``): 5 layers (4 GIN layers plus the
input), 2-layer MLPs with batch norm, hidden 64, sum readout of every layer's
representation, each through its own linear prediction, dropout 0.5, the scores summed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import register_model
from ._common import bipartite, check_choice, check_dropout, check_positive, published
from .synthetic import SBM_GRAPH_CLASS_NAMES

__all__ = ["GIN", "READOUTS"]

READOUTS = ("sum", "mean", "max")
_PAPER = "https://arxiv.org/abs/1810.00826"


def _mlp(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(in_channels, out_channels),
        nn.BatchNorm1d(out_channels),
        nn.ReLU(),
        nn.Linear(out_channels, out_channels),
    )


class GIN(nn.Module):
    """GIN-epsilon graph classifier with per-layer readouts (the paper's GIN-0 by default).

    Args:
        in_channels: Node feature size.
        num_classes: Graph classes.
        hidden_channels: Width of every GIN layer.
        num_layers: Layers including the input representation (the paper's 5: 4 GIN layers).
        readout: Graph pooling of each layer: ``"sum"`` (the paper), ``"mean"`` or ``"max"``.
        train_eps: Learn epsilon (GIN-epsilon) instead of fixing it at 0 (GIN-0).
        dropout: Dropout before each layer's prediction.

    Shape:
        ``x`` ``(N, in_channels)``, ``edge_index`` ``(2, E)``, ``batch`` ``(N,)`` (graph of each
        node, 0-based and sorted; ``None``: one graph) -> ``(num_graphs, num_classes)``.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        *,
        hidden_channels: int = 64,
        num_layers: int = 5,
        readout: str = "sum",
        train_eps: bool = False,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        check_positive("GIN", in_channels=in_channels, num_classes=num_classes,
                       hidden_channels=hidden_channels)  # fmt: skip
        if num_layers < 2:
            raise ValueError(
                f"GIN: num_layers counts the input too; must be >= 2, got {num_layers}"
            )
        check_dropout("GIN", dropout=dropout)
        self.readout = check_choice("GIN", "readout", readout, READOUTS)
        from torch_geometric.nn import GINConv

        self.in_channels, self.num_classes = in_channels, num_classes
        widths = [in_channels] + [hidden_channels] * (num_layers - 1)
        self.convs = nn.ModuleList(
            GINConv(_mlp(a, b), train_eps=train_eps)
            for a, b in zip(widths[:-1], widths[1:], strict=True)
        )
        self.norms = nn.ModuleList(nn.BatchNorm1d(b) for b in widths[1:])
        self.heads = nn.ModuleList(nn.Linear(w, num_classes) for w in widths)
        self.dropout = dropout
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyTorch's default (Kaiming-uniform) linear layers, unit batch norms, eps = 0."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def _pool(self, h: torch.Tensor, batch: torch.Tensor, num_graphs: int) -> torch.Tensor:
        from torch_geometric.nn import global_add_pool, global_max_pool, global_mean_pool

        pool = {"sum": global_add_pool, "mean": global_mean_pool, "max": global_max_pool}
        return pool[self.readout](h, batch, num_graphs)  # (G, C)

    def forward(
        self,
        x: torch.Tensor,
        edge_index: torch.Tensor,
        batch: torch.Tensor | None = None,
        num_graphs: int | None = None,
    ) -> torch.Tensor:
        if batch is None:
            batch = x.new_zeros(x.size(0), dtype=torch.long)
        if num_graphs is None:
            num_graphs = int(batch.max()) + 1 if batch.numel() else 0
        hidden = [x]
        for index in range(self.num_message_passing_layers):
            x = self.layer_forward(index, x, edge_index)  # (N, hidden)
            hidden.append(x)
        score = 0
        for index, h in enumerate(hidden):
            score = score + self.layer_readout(index, h, batch, num_graphs)
        return score  # (G, num_classes)

    @property
    def num_message_passing_layers(self) -> int:
        """GIN layers (``num_layers - 1``: the builders' ``num_layers`` counts the input)."""
        return len(self.convs)

    def layer_forward(
        self,
        index: int,
        x: torch.Tensor,
        edge_index: torch.Tensor,
        *,
        size: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """GIN layer ``index`` with its batch norm and ReLU; ``size`` as in
        :meth:`modelzoo.graph._common.NodeClassifier.layer_forward` (a bipartite block)."""
        inputs, edges = bipartite(x, edge_index, size)
        x = self.convs[index](inputs, edges)  # (N_dst, hidden)
        x = self.norms[index](x)
        return F.relu(x)

    def layer_readout(
        self, index: int, h: torch.Tensor, batch: torch.Tensor, num_graphs: int
    ) -> torch.Tensor:
        """The class scores of representation ``index`` (0: the input, ``i``: layer
        ``i - 1``'s output): pooled per graph, through its own linear head, dropout."""
        pooled = self._pool(h, batch, num_graphs)  # (G, width)
        return F.dropout(self.heads[index](pooled), self.dropout, training=self.training)


# --------------------------------------------------------------------------- published weights
# Trained here by the recorded command; the file ships in modelzoo/graph/weights/.
_SBM = published(
    "gin_sbm",
    "64e4d98a28307f8a47db408db33c268b655e8b75745818c51a72f8540846c5c0",
    num_params=31058,
    num_classes=3,
    metrics={"test_acc": 100.00},
    command="python scripts/train_gnn.py --model gin_sbm --dataset sbm_graphs --batch-size 64 "
    "--num-epochs 10 --eval-interval 2 --export-weights --no-progress --seed 0 --run-log logs/sbm_gin/seed0.jsonl",
    log="logs/sbm_gin/seed0.jsonl",
    paper=_PAPER,
    dataset="synthetic SBM graphs, 2500 graphs (datasets.sbm_graph_classification)",
    classifier="heads",
    labels=SBM_GRAPH_CLASS_NAMES,
)


# ---------------------------------------------------------------------------------- builders
@register_model
def gin(*, num_classes: int = 2, in_channels: int = 7, **kwargs: Any) -> GIN:
    """GIN-0 with the paper's TU recipe (MUTAG sizes: 7 node labels, 2 classes)."""
    return GIN(in_channels, num_classes, **{"hidden_channels": 64, "num_layers": 5, **kwargs})


@register_model(weights={"sbm": _SBM})
def gin_sbm(*, num_classes: int = 3, in_channels: int = 1, **kwargs: Any) -> GIN:
    """GIN-0 for the SBM graph-classification set (constant features, 3 generators)."""
    return GIN(in_channels, num_classes, **{"hidden_channels": 64, "num_layers": 5, **kwargs})
