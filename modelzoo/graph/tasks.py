"""Node and graph classification as tasks: what the trainer batches, the loss, and the
evaluation on the held-out split (``scripts/train_gnn.py``; the trainer is duck-typed).

A full-graph epoch is one item, :data:`FULL`: the model sees the whole graph and the loss
covers the training nodes. With ``fanouts``, the items are the training node ids, and
:meth:`NodeClassificationTask.collate` samples each mini-batch's neighbourhoods (GraphSAGE's
sampler, :class:`~modelzoo.graph.sampler.NeighborSampler`). Graph classification batches
whole graphs (PyG ``Batch``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from .sampler import NeighborSampler

__all__ = ["FULL", "GraphClassificationTask", "NodeClassificationTask", "NodeItems"]

FULL = "full"  # the single item of a full-graph epoch or evaluation


class NodeItems(Dataset):
    """The items the Trainer batches: training node ids, or the one ``FULL`` item."""

    def __init__(self, nodes: torch.Tensor | None) -> None:
        self.nodes = nodes

    def __len__(self) -> int:
        return 1 if self.nodes is None else self.nodes.numel()

    def __getitem__(self, index: int) -> Any:
        return FULL if self.nodes is None else int(self.nodes[index])


def _accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if labels.numel() == 0:
        return torch.tensor(math.nan)
    return (logits.argmax(dim=1) == labels).float().mean()


class NodeClassificationTask:
    """Full-graph or sampled mini-batch steps, and whole-graph evaluation."""

    def __init__(self, data: Any, device: torch.device, fanouts: list[int]) -> None:
        self.x = data.x.to(device)
        self.edge_index = data.edge_index.to(device)
        self.y = data.y.to(device)
        self.masks = {k: data[k].to(device) for k in ("train_mask", "val_mask", "test_mask")}
        self.sampler = (
            NeighborSampler(data.edge_index, data.num_nodes, fanouts) if fanouts else None
        )
        self.trim = False  # set when the model computes only what each layer needs

    def collate(self, items: list[Any]) -> Any:
        if items == [FULL]:
            return FULL
        sub = self.sampler.sample(torch.tensor(items, dtype=torch.long))
        return {"n_id": sub.n_id, "edge_index": sub.edge_index, "batch_size": sub.batch_size,
                "layer_sizes": sub.layer_sizes}  # fmt: skip

    def train_step(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict]:
        if batch == FULL:
            mask = self.masks["train_mask"]
            logits = model(self.x, self.edge_index)[mask]  # (N_train, C)
            labels = self.y[mask]
        else:
            n_id = batch["n_id"].to(self.x.device)
            sizes = {"layer_sizes": batch["layer_sizes"]} if self.trim else {}
            out = model(self.x[n_id], batch["edge_index"].to(self.x.device), **sizes)
            logits = out[: batch["batch_size"]]  # (B, C)
            labels = self.y[n_id[: batch["batch_size"]]]
        loss = F.cross_entropy(logits, labels)
        correct = (logits.argmax(dim=1) == labels).sum()
        return loss, {"accuracy": correct, "count": labels.numel()}

    def eval_step(self, model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        logits = model(self.x, self.edge_index).float()  # (N, C): all neighbours
        val, test = self.masks["val_mask"], self.masks["test_mask"]
        return {
            "val_acc": _accuracy(logits[val], self.y[val]),
            "val_loss": F.cross_entropy(logits[val], self.y[val]),
            "test_acc": _accuracy(logits[test], self.y[test]),
        }


class GraphClassificationTask:
    """Mini-batches of whole graphs (PyG ``Batch``) and evaluation on the held-out graphs."""

    def __init__(self, graphs: list[Any], splits: dict[str, list[int]], device: torch.device):
        self.graphs, self.splits, self.device = graphs, splits, device

    def _batch(self, indices: list[int]) -> dict[str, Any]:
        from torch_geometric.data import Batch

        b = Batch.from_data_list([self.graphs[i] for i in indices])
        return {"x": b.x, "edge_index": b.edge_index, "batch": b.batch, "y": b.y,
                "num_graphs": b.num_graphs}  # fmt: skip

    def collate(self, items: list[Any]) -> Any:
        return FULL if items == [FULL] else self._batch(items)

    def _forward(self, model: torch.nn.Module, b: dict[str, Any]) -> torch.Tensor:
        dev = self.device
        return model(b["x"].to(dev), b["edge_index"].to(dev), b["batch"].to(dev), b["num_graphs"])

    def train_step(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict]:
        logits = self._forward(model, batch)  # (G, C)
        labels = batch["y"].to(self.device)
        loss = F.cross_entropy(logits, labels)
        return loss, {"accuracy": (logits.argmax(1) == labels).sum(), "count": labels.numel()}

    def eval_step(self, model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for split in ("val", "test"):
            indices = self.splits[split]
            logits, labels = [], []
            for start in range(0, len(indices), 512):
                b = self._batch(indices[start : start + 512])
                logits.append(self._forward(model, b).float())
                labels.append(b["y"].to(self.device))
            logits_all, labels_all = torch.cat(logits), torch.cat(labels)
            out[f"{split}_acc"] = _accuracy(logits_all, labels_all)
            if split == "val":
                out["val_loss"] = F.cross_entropy(logits_all, labels_all)
        return out
