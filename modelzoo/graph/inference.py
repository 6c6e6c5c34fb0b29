"""Predicting with the graph models: layer-wise inference over all nodes and a pipeline.

:func:`layerwise_inference` computes a model over every node of a graph one layer at a time,
as PyG's and DGL's examples evaluate on graphs too large for one full-graph pass: for each
layer, mini-batches of target nodes with *all* their in-neighbours (no sampling) produce the
layer's output for every node before the next layer starts. Each block holds every in-edge
of its targets, so GraphSAGE's aggregations and GAT's attention softmax see the whole
neighbourhood, and GCN's normalisation comes from the whole graph's degrees
(:meth:`~modelzoo.graph.gcn.GCN.layerwise_edges`): the result equals the full-graph forward
up to float summation order. Memory per step: one block's messages; the layer outputs of
all nodes stay where the input features are (e.g. on the host while the model runs on a GPU).

:class:`NodeClassificationPipeline` is features -> (transform) -> model -> softmax -> class
names per node, with the transform and the names of the published weights
(:meth:`~modelzoo.Weights.transforms`, :attr:`~modelzoo.Weights.labels`).

>>> classify = NodeClassificationPipeline.from_pretrained("gcn_karate")  # doctest: +SKIP
>>> classify(karate_club(), nodes=[0, 33])  # doctest: +SKIP
[{'node': 0, 'label': 'Mr. Hi', 'index': 0, 'score': 0.98},
 {'node': 33, 'label': 'Officer', 'index': 1, 'score': 0.99}]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["NodeClassificationPipeline", "layerwise_inference"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16}  # fmt: skip


# ------------------------------------------------------------------------------ the inputs
def _unpack(data: Any, owner: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, edge_index)`` of a ``Data`` or of an ``(x, edge_index)`` pair."""
    if isinstance(data, (tuple, list)):
        if len(data) != 2:
            raise TypeError(f"{owner}: a tuple input is (x, edge_index), got {len(data)} items")
        return data[0], data[1]
    if hasattr(data, "x") and hasattr(data, "edge_index"):
        return data.x, data.edge_index
    raise TypeError(
        f"{owner}: expected a torch_geometric Data with x and edge_index, or a tuple "
        f"(x, edge_index), got {type(data).__name__}"
    )


def _check_graph(
    x: Any, edge_index: Any, in_channels: int | None, owner: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fix-it errors for features and edges the model cannot read."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{owner}: x must be a (num_nodes, num_features) tensor, got {shape}")
    if in_channels is not None and x.size(1) != in_channels:
        raise ValueError(
            f"{owner}: the model reads in_channels={in_channels} features per node, but x has "
            f"{x.size(1)} (shape {tuple(x.shape)}); pass the features it was trained on"
        )
    if not isinstance(edge_index, torch.Tensor) or edge_index.dim() != 2 or edge_index.size(0) != 2:
        shape = tuple(edge_index.shape) if isinstance(edge_index, torch.Tensor) else None
        raise ValueError(
            f"{owner}: edge_index must be a (2, num_edges) tensor of (source, target) rows, "
            f"got {shape if shape is not None else type(edge_index).__name__}"
            + ("; transpose an (E, 2) edge list with .t()" if shape and shape[-1] == 2 else "")
        )
    if edge_index.dtype != torch.long:
        raise ValueError(
            f"{owner}: edge_index must hold int64 node ids (torch.long), got {edge_index.dtype}; "
            "convert it with edge_index.long()"
        )
    num_nodes = x.size(0)
    if edge_index.numel():
        low, high = int(edge_index.min()), int(edge_index.max())
        if low < 0 or high >= num_nodes:
            bad = low if low < 0 else high
            raise ValueError(
                f"{owner}: edge_index names node {bad}, out of range for the {num_nodes} nodes "
                "of x (ids are 0 .. num_nodes - 1)"
            )
    return x, edge_index


def _model_dtype(model: nn.Module) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.get_default_dtype()


def _model_device(model: nn.Module) -> torch.device:
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def _check_positive(owner: str, **values: Any) -> None:
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):  # fmt: skip
            raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


def _check_layerwise(model: nn.Module) -> None:
    """Raises unless ``model`` exposes the per-layer structure layer-wise inference runs."""
    name = type(model).__name__
    if not callable(getattr(model, "layer_forward", None)) or not hasattr(
        model, "num_message_passing_layers"
    ):
        raise TypeError(
            f"layerwise_inference: {name} exposes no per-layer structure "
            "(layer_forward and num_message_passing_layers); it supports the zoo's GCN, "
            "GraphSAGE, GAT and GIN. Run the full-graph forward instead (batch_size=None)"
        )
    if model.training:
        raise ValueError(
            f"layerwise_inference: {name} is in training mode, where dropout would draw other "
            "masks per block (and batch norm use block statistics), so layer-wise results "
            "would not be the model's; call model.eval() first"
        )


# ---------------------------------------------------------------------------- layer-wise
@dataclass
class _Block:
    """Targets ``start:end`` and every in-edge, in local ids (targets first)."""

    start: int
    end: int
    n_id: torch.Tensor  # (N_src,) graph ids of the block's rows; the first end - start: targets
    edge_index: torch.Tensor  # (2, E_blk) local ids, sorted by target
    edge_inputs: dict[str, torch.Tensor]  # per-edge inputs of layer_forward (GCN: weights)


def _blocks(
    edge_index: torch.Tensor,
    edge_inputs: dict[str, torch.Tensor],
    num_nodes: int,
    batch_size: int,
) -> list[_Block]:
    src, dst = edge_index
    order = torch.argsort(dst, stable=True)  # keeps each target's neighbour order (LSTM)
    src, dst = src[order], dst[order]
    edge_inputs = {k: v[order] for k, v in edge_inputs.items()}
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.long, device=dst.device)
    torch.cumsum(torch.bincount(dst, minlength=num_nodes), 0, out=rowptr[1:])
    bounds = rowptr.tolist()
    blocks = []
    for start in range(0, num_nodes, batch_size):
        end = min(start + batch_size, num_nodes)
        first, last = bounds[start], bounds[end]
        s, d = src[first:last], dst[first:last] - start  # targets are start .. end - 1
        outside = (s < start) | (s >= end)
        others = torch.unique(s[outside])  # the other sources, after the targets
        local = s - start
        local[outside] = (end - start) + torch.searchsorted(others, s[outside])
        n_id = torch.cat([torch.arange(start, end, device=s.device), others])
        inputs = {k: v[first:last] for k, v in edge_inputs.items()}
        blocks.append(_Block(start, end, n_id, torch.stack([local, d]), inputs))
    return blocks


def _layer(
    model: nn.Module,
    index: int,
    x: torch.Tensor,
    blocks: list[_Block],
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Layer ``index``'s output for every node, block by block, stored where ``x`` is."""
    out = None
    for blk in blocks:
        inputs = x[blk.n_id].to(device=device, dtype=dtype)  # (N_src, C_in)
        extra = {k: v.to(device) for k, v in blk.edge_inputs.items()}
        size = (blk.end - blk.start, blk.edge_index.size(1))
        h = model.layer_forward(index, inputs, blk.edge_index.to(device), size=size, **extra)
        if out is None:
            out = torch.empty((x.size(0), h.size(1)), dtype=h.dtype, device=x.device)
        out[blk.start : blk.end] = h.to(x.device)  # (N_dst, C_out)
    return out


@torch.no_grad()
def layerwise_inference(
    model: nn.Module,
    data: Any,
    *,
    batch_size: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The model's output on a whole graph, computed one layer at a time in node batches.

    Args:
        model: A zoo GCN, GraphSAGE (any aggregator), GAT or GIN, in eval mode.
        data: A ``torch_geometric`` ``Data`` (a ``Batch`` of graphs for GIN) or a tuple
            ``(x, edge_index)``; ``x`` may live elsewhere than the model (the host).
        batch_size: Target nodes per block.
        device: Where the layers run (default: the model's device).

    Returns:
        ``(N, num_classes)`` node logits (GIN: ``(num_graphs, num_classes)`` graph scores), on
        the device of ``x``: ``model(x, edge_index)`` up to float summation order.

    Raises:
        TypeError: The model has no per-layer structure (``layer_forward``).
        ValueError: Training mode (dropout and batch norm are not per node), features of the
            wrong width, a malformed ``edge_index`` or an empty graph.
    """
    owner = f"layerwise_inference({type(model).__name__})"
    _check_layerwise(model)
    _check_positive(owner, batch_size=batch_size)
    x, edge_index = _check_graph(*_unpack(data, owner), getattr(model, "in_channels", None), owner)
    num_nodes = x.size(0)
    if num_nodes == 0:
        raise ValueError(f"{owner}: the graph has no nodes")
    device = _model_device(model) if device is None else torch.device(device)
    dtype = _model_dtype(model)
    edge_index = edge_index.to(x.device)  # blocks are cut where the features are
    prepare = getattr(model, "layerwise_edges", None)  # GCN: self-loops, global weights
    edges, edge_inputs = (
        (edge_index, {}) if prepare is None else prepare(edge_index, num_nodes, dtype)
    )
    blocks = _blocks(edges, edge_inputs, num_nodes, batch_size)
    readout = getattr(model, "layer_readout", None)  # graph classifiers (GIN)
    if readout is not None:
        batch = getattr(data, "batch", None)
        if batch is None:  # one graph, as GIN.forward without a batch vector
            batch, num_graphs = torch.zeros(num_nodes, dtype=torch.long), 1
        else:
            num_graphs = getattr(data, "num_graphs", None) or int(batch.max()) + 1
        batch = batch.to(device)
        score = readout(0, x.to(device=device, dtype=dtype), batch, num_graphs)
    h = x
    for index in range(model.num_message_passing_layers):
        h = _layer(model, index, h, blocks, device, dtype)  # (N, C_index)
        if readout is not None:
            score = score + readout(index + 1, h.to(device), batch, num_graphs)
    return score.to(x.device) if readout is not None else h


# ------------------------------------------------------------------------------ pipeline
def _node_ids(nodes: Any, num_nodes: int, owner: str) -> tuple[torch.Tensor, bool]:
    """``(ids, single)`` of ``None`` (all), one id, a sequence/tensor of ids or a bool mask."""
    if nodes is None:
        return torch.arange(num_nodes), False
    try:
        ids = torch.as_tensor(nodes)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{owner}: nodes must be node ids (ints) or a boolean mask: {e}") from e
    single = ids.dim() == 0 and ids.dtype != torch.bool  # one id: its entry, not a list
    if ids.dtype == torch.bool:
        if ids.shape != (num_nodes,):
            raise ValueError(
                f"{owner}: a boolean node mask must have shape ({num_nodes},), got "
                f"{tuple(ids.shape)}"
            )
        return ids.nonzero().view(-1).cpu(), False
    if ids.numel() == 0:
        return torch.zeros(0, dtype=torch.long), False
    if ids.is_floating_point() or ids.is_complex() or ids.dim() > 1:
        raise TypeError(
            f"{owner}: nodes must be integer node ids (a 1-D sequence or tensor), got "
            f"{ids.dtype} of shape {tuple(ids.shape)}"
        )
    ids = ids.reshape(-1).long().cpu()
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_nodes:
        raise IndexError(
            f"{owner}: node {low if low < 0 else high} is out of range for a graph of "
            f"{num_nodes} nodes (ids are 0 .. {num_nodes - 1})"
        )
    return ids, single


class NodeClassificationPipeline:
    """Class names and probabilities of a graph's nodes.

    Args:
        model: A node classifier (``model(x, edge_index) -> (N, num_classes)`` logits), e.g.
            the zoo's GCN, GraphSAGE or GAT.
        labels: Class names in the order of the logits (default: the indices as strings).
        transform: Node-feature preprocessing applied first
            (:class:`~modelzoo.graph.transforms.NodeFeatures`, what the weights'
            ``transforms()`` return; any callable ``Data -> Data``, e.g. a PyG transform).
        batch_size: ``None``: one full-graph forward. An int: :func:`layerwise_inference` with
            that many target nodes per block (for graphs whose full pass does not fit).
        device: Where the model runs (default: where its parameters are).
        dtype: Its precision (``torch.float64``, ``"bfloat16"``, ...; default: unchanged).
        top_k: Classes returned per node.

    Call it as ``pipe(data, nodes=None, top_k=None)``: ``data`` a ``torch_geometric`` ``Data``
    (or a tuple ``(x, edge_index)``) with the raw features (the pipeline applies
    ``transform``); ``nodes`` the node ids to report (``None``: all, an int: one, a sequence
    or tensor of ids, or a boolean mask such as ``data.test_mask``). Every node still gets
    its whole neighbourhood: the model runs on the whole graph.

    Returns:
        Per requested node, in the order of ``nodes``: with ``top_k=1`` one dict
        ``{"node": id, "label": name, "index": class, "score": probability}``; with
        ``top_k > 1`` a list of ``top_k`` such dicts, best first. For an int ``nodes`` that
        node's entry alone, else a list. :meth:`probabilities` gives the ``(len(nodes),
        num_classes)`` tensor instead.

    Example:
        >>> pipe = NodeClassificationPipeline.from_pretrained("gcn_karate")
        >>> pipe(karate_club(), nodes=33)  # doctest: +SKIP
        {'node': 33, 'label': 'Officer', 'index': 1, 'score': 0.99}
    """

    task = "node-classification"

    def __init__(
        self,
        model: nn.Module,
        *,
        labels: Sequence[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        batch_size: int | None = None,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | str | None = None,
        top_k: int = 1,
    ) -> None:
        owner = "NodeClassificationPipeline"
        if not isinstance(model, nn.Module):
            raise TypeError(f"{owner}: model must be a torch.nn.Module, got {type(model).__name__}")
        if hasattr(model, "layer_readout"):
            raise ValueError(
                f"{owner}: {type(model).__name__} is a graph classifier (one prediction per "
                "graph), not a node classifier; call the model on a Batch of graphs, or "
                "layerwise_inference(model, batch, batch_size=...)"
            )
        _check_positive(owner, batch_size=batch_size, top_k=top_k)
        if transform is not None and not callable(transform):
            raise TypeError(f"{owner}: transform must be callable, got {type(transform).__name__}")
        self.device = self._device(device, model)
        self.model = model.to(self.device).eval()
        if dtype is not None:
            if isinstance(dtype, str) and dtype not in _DTYPES:
                raise ValueError(
                    f"{owner}: dtype must be one of {sorted(_DTYPES)} or a torch.dtype, "
                    f"got {dtype!r}"
                )
            self.model.to(_DTYPES[dtype] if isinstance(dtype, str) else dtype)
        self.dtype = _model_dtype(self.model)
        if batch_size is not None:
            _check_layerwise(self.model)
        self.in_channels: int | None = getattr(model, "in_channels", None)
        self.num_classes: int | None = getattr(model, "num_classes", None)
        self.labels = tuple(labels) if labels is not None else None
        known = self.labels is not None and self.num_classes is not None
        if known and len(self.labels) != self.num_classes:
            raise ValueError(
                f"{owner}: {len(self.labels)} labels for a model with "
                f"num_classes={self.num_classes}; give one name per class"
            )
        self._check_top_k(top_k)
        self.transform = transform
        self.batch_size = batch_size
        self.top_k = top_k

    @classmethod
    def from_pretrained(
        cls, name: str, tag: bool | str = True, **kwargs: Any
    ) -> NodeClassificationPipeline:
        """The pipeline of a registered model's published weights: the model with them, their
        ``labels`` and ``transforms()``; ``kwargs`` override those or set the options."""
        from ..registry import get_model, get_weights

        weights = get_weights(name, tag)
        if weights.modality != "graph":
            raise ValueError(
                f"NodeClassificationPipeline.from_pretrained: {name!r} has {weights.modality} "
                "weights; use modelzoo.pipeline() with its task"
            )
        kwargs.setdefault("labels", weights.labels)
        kwargs.setdefault("transform", weights.transforms())
        return cls(get_model(name, pretrained=tag, progress=False), **kwargs)

    @staticmethod
    def _device(device: torch.device | str | int | None, model: nn.Module) -> torch.device:
        if device is None:
            return _model_device(model)
        if isinstance(device, int):
            return torch.device("cuda", device) if device >= 0 else torch.device("cpu")
        return torch.device(device)

    def _check_top_k(self, top_k: int) -> None:
        _check_positive("NodeClassificationPipeline", top_k=top_k)
        if self.num_classes is not None and top_k > self.num_classes:
            raise ValueError(
                f"NodeClassificationPipeline: top_k={top_k} > the model's {self.num_classes} "
                "classes"
            )

    def _inputs(self, data: Any) -> tuple[torch.Tensor, torch.Tensor]:
        owner = "node-classification"
        x, edge_index = _unpack(data, owner)
        if self.transform is not None:
            if isinstance(data, (tuple, list)):
                from torch_geometric.data import Data

                data = Data(x=x, edge_index=edge_index)
            x, edge_index = _unpack(self.transform(data), owner)
        return _check_graph(x, edge_index, self.in_channels, owner)

    @torch.no_grad()
    def logits(self, data: Any) -> torch.Tensor:
        """``(N, num_classes)`` logits of every node (transform, then the model)."""
        x, edge_index = self._inputs(data)
        if self.batch_size is not None:
            return layerwise_inference(
                self.model, (x, edge_index), batch_size=self.batch_size, device=self.device
            )
        x = x.to(device=self.device, dtype=self.dtype)
        return self.model(x, edge_index.to(self.device))  # (N, C)

    def probabilities(self, data: Any, nodes: Any = None) -> torch.Tensor:
        """``(len(nodes), num_classes)`` class probabilities (softmax of the logits), on the
        host; float64 for a float64 model, else float32."""
        probs, _, _ = self._probabilities(data, nodes)
        return probs

    def _probabilities(self, data: Any, nodes: Any) -> tuple[torch.Tensor, torch.Tensor, bool]:
        logits = self.logits(data)
        ids, single = _node_ids(nodes, logits.size(0), "node-classification")
        wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
        probs = logits[ids.to(logits.device)].to(wide).softmax(dim=-1).cpu()  # (K, C)
        return probs, ids, single

    def __call__(self, data: Any, nodes: Any = None, *, top_k: int | None = None) -> Any:
        top_k = self.top_k if top_k is None else top_k
        self._check_top_k(top_k)
        probs, ids, single = self._probabilities(data, nodes)
        classes = probs.size(-1)
        if self.labels is not None and len(self.labels) != classes:
            raise ValueError(
                f"node-classification: {len(self.labels)} labels for a model with {classes} outputs"
            )
        if top_k > classes:
            raise ValueError(f"node-classification: top_k={top_k} > {classes} classes")
        scores, indices = probs.topk(top_k, dim=-1)  # (K, top_k), best first
        out = []
        for node, row_p, row_k in zip(ids.tolist(), scores.tolist(), indices.tolist(), strict=True):
            preds = [{"node": node, "label": self._label(k), "index": k, "score": p}
                     for p, k in zip(row_p, row_k, strict=True)]  # fmt: skip
            out.append(preds[0] if top_k == 1 else preds)
        return out[0] if single else out

    def _label(self, index: int) -> str:
        return self.labels[index] if self.labels is not None else str(index)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model={type(self.model).__name__}, "
            f"labels={None if self.labels is None else len(self.labels)}, "
            f"transform={self.transform!r}, batch_size={self.batch_size}, "
            f"device={self.device}, dtype={self.dtype}, top_k={self.top_k})"
        )
