"""Aggregations the graph models use beyond ``torch_geometric``'s built-in ones.

This module imports ``torch_geometric`` (seconds); the model files import it lazily.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch_geometric.nn.aggr import Aggregation

__all__ = ["PackedLSTMAggregation"]


class PackedLSTMAggregation(Aggregation):
    """GraphSAGE's LSTM aggregator: the last hidden state of an LSTM run over the neighbours.

    Hamilton et al. (2017) run the LSTM over each node's neighbours in a random order;
    neighbours arrive in ``edge_index`` order (the sampler shuffles them). Unlike
    ``torch_geometric.nn.aggr.LSTMAggregation``, which reads the output at the last *padded*
    position (so a node with fewer neighbours than the maximum ends on zero inputs), the
    sequences are packed, as DGL's degree buckets do: each node gets the state after its own
    last neighbour. A node without neighbours aggregates to zeros.

    Args:
        in_channels: Neighbour feature size.
        out_channels: LSTM hidden size.

    Shape:
        ``x`` ``(E, in_channels)`` messages, ``index`` ``(E,)`` sorted targets ->
        ``(N, out_channels)``.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.lstm = nn.LSTM(in_channels, out_channels, batch_first=True)

    def reset_parameters(self) -> None:
        """PyTorch's LSTM initialization, U(-1/sqrt(hidden), 1/sqrt(hidden))."""
        self.lstm.reset_parameters()

    def forward(
        self,
        x: torch.Tensor,
        index: torch.Tensor | None = None,
        ptr: torch.Tensor | None = None,
        dim_size: int | None = None,
        dim: int = -2,
        max_num_elements: int | None = None,
    ) -> torch.Tensor:
        dense, mask = self.to_dense_batch(
            x, index, ptr, dim_size, dim, max_num_elements=max_num_elements
        )  # (N, max_degree, C), (N, max_degree)
        lengths = mask.sum(dim=1)
        out = x.new_zeros(dense.size(0), self.out_channels)
        has = lengths > 0
        if bool(has.any()):
            packed = pack_padded_sequence(
                dense[has], lengths[has].cpu(), batch_first=True, enforce_sorted=False
            )
            _, (h, _) = self.lstm(packed)  # (1, N_has, out)
            out[has] = h[-1].to(out.dtype)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_channels}, {self.out_channels})"
