"""Pieces the graph model families share: the published-weights entry and the base class."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..weights import Weights

__all__ = ["NodeClassifier", "bipartite", "check_choice", "published"]

PACKAGE_WEIGHTS = "package://modelzoo/graph/weights"


class NodeClassifier(nn.Module):
    """A stack of message-passing layers mapping node features to per-node class logits.

    Subclasses fill ``convs`` (the hidden layers) and ``head`` (the last layer, producing the
    logits; the ``classifier`` of their weights). ``forward(x, edge_index)``: ``x`` is
    ``(N, in_channels)``, ``edge_index`` is ``(2, E)`` with rows ``(source, target)``; the
    output is ``(N, num_classes)``. The same module runs on a whole graph or on a sampled
    subgraph (:mod:`modelzoo.graph.sampler`).

    Models with ``supports_layer_sizes`` also take ``layer_sizes``, one ``(num_dst,
    num_edges)`` per layer (:attr:`SampledSubgraph.layer_sizes`): layer ``l`` then computes
    only the first ``num_dst`` nodes from the first ``num_edges`` edges (nodes numbered by hop,
    edges sorted by target), as DGL's message-flow graphs do, and the output has the seeds'
    rows only. The result for those rows is the same; the outer hops' wasted work is skipped.

    Layer by layer (:func:`modelzoo.graph.inference.layerwise_inference`): ``forward`` is
    :meth:`layer_forward` applied for ``i = 0 .. num_message_passing_layers - 1``, each layer
    with its activation and dropout, so a caller can run one layer over all nodes before the
    next one, on bipartite blocks (targets first, ``size=(num_dst, num_edges)``) holding every
    in-edge of their targets. :meth:`layerwise_edges` gives the edges those blocks are cut from
    (GCN: with its self-loops and the whole graph's normalisation as ``edge_weight``).
    """

    in_channels: int
    num_classes: int
    supports_layer_sizes = False

    def forward(
        self,
        x: torch.Tensor,
        edge_index: torch.Tensor,
        layer_sizes: Sequence[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        """:meth:`layer_forward` for every layer (``layer_sizes``: see the class docstring;
        models without ``supports_layer_sizes`` define their own ``forward`` without it)."""
        sizes = self._check_layer_sizes(layer_sizes)
        for index, size in enumerate(sizes):
            x = self.layer_forward(index, x, edge_index, size=size)  # (N_dst, C_l)
        return x  # (N_dst, num_classes)

    @property
    def num_message_passing_layers(self) -> int:
        """Message-passing layers in all, the head included (the builders' ``num_layers``)."""
        return len(self.convs) + 1

    def layer(self, index: int) -> nn.Module:
        """Layer ``index``: ``convs[index]``, or ``head`` for the last one."""
        if not 0 <= index < self.num_message_passing_layers:
            raise IndexError(
                f"{type(self).__name__} has {self.num_message_passing_layers} layers; "
                f"no layer {index}"
            )
        return self.head if index == len(self.convs) else self.convs[index]

    def layer_forward(
        self,
        index: int,
        x: torch.Tensor,
        edge_index: torch.Tensor,
        *,
        size: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Layer ``index`` with what follows it (activation, dropout) up to the next layer.

        Args:
            index: The layer, ``0 .. num_message_passing_layers - 1``.
            x: ``(N_src, C_in)`` the layer's input rows.
            edge_index: ``(2, E)`` edges among the rows of ``x``, sorted by target.
            size: ``(num_dst, num_edges)``: compute only the first ``num_dst`` rows from the
                first ``num_edges`` edges (:func:`bipartite`); ``None``: every row.

        Returns:
            ``(N_dst, C_out)``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define layer_forward")

    def layerwise_edges(
        self, edge_index: torch.Tensor, num_nodes: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The whole graph's edges for layer-wise inference, and per-edge keyword inputs of
        :meth:`layer_forward` (sliced with the edges). Default: the edges as given, none."""
        return edge_index, {}

    def _check_layer_sizes(
        self, layer_sizes: Sequence[tuple[int, int]] | None
    ) -> list[tuple[int, int] | None]:
        layers = len(self.convs) + 1
        if layer_sizes is None:
            return [None] * layers
        if len(layer_sizes) != layers:
            raise ValueError(
                f"{type(self).__name__} has {layers} layers but got {len(layer_sizes)} "
                "layer_sizes; sample with one fan-out per layer"
            )
        return list(layer_sizes)


def bipartite(
    x: torch.Tensor, edge_index: torch.Tensor, size: tuple[int, int] | None
) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Layer input: ``(x, edge_index)``, or ``((x, x[:num_dst]), edge_index[:, :num_edges])``."""
    if size is None:
        return x, edge_index
    num_dst, num_edges = size
    return (x, x[:num_dst]), edge_index[:, :num_edges]


def check_choice(owner: str, option: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{owner}: {option} must be one of {', '.join(choices)}, got {value!r}")
    return value


def check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{owner}: {name} must be >= 1, got {value}")


def check_dropout(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{owner}: {name} must be in [0, 1), got {value}")


def published(
    name: str,
    sha256: str,
    *,
    num_params: int,
    num_classes: int,
    metrics: Mapping[str, float],
    command: str,
    log: str,
    paper: str,
    dataset: str,
    classifier: str = "head",
    labels: Sequence[str] | None = None,
    normalize_features: bool = False,
) -> Weights:
    """Weights trained by ``scripts/train_gnn.py`` here and shipped inside the package.

    The file is ``modelzoo/graph/weights/{name}-{sha256[:8]}.pth`` (a plain state dict, read
    with ``weights_only=True``); ``log`` is its published run log (seed 0 of the recipe, for
    the recipes published over seeds), and ``command`` rebuilds it bit for bit on the processor
    model that log's fingerprint names, under its recorded threads and ISA pins
    (``scripts/reproduce.py`` re-applies them). ``labels`` are the class names in the order of
    the logits (the dataset's ``class_names``); ``normalize_features`` says the run used
    ``--normalize-features`` (:meth:`Weights.transforms` then row-normalizes).
    """
    if normalize_features != ("--normalize-features" in command.split()):
        raise ValueError(
            f"published({name!r}): normalize_features={normalize_features} but the recipe "
            f"{'does not pass' if normalize_features else 'passes'} --normalize-features; the "
            "weights' transforms() must be the features the run trained on"
        )
    return Weights(
        url=f"{PACKAGE_WEIGHTS}/{name}-{sha256[:8]}.pth",
        hash_prefix=sha256,
        hash_algo="sha256",
        file_format="pth",
        num_params=num_params,
        num_classes=num_classes,
        metrics=dict(metrics),
        source="modelzoo (trained here, shipped in the package)",
        license="Apache-2.0",
        classifier=classifier,
        modality="graph",
        labels=None if labels is None else tuple(labels),
        normalize_features=normalize_features,
        recipe={"command": command, "log": log, "paper": paper},
        tags={"dataset": dataset},
    )
