"""NodeFeatures: the one node-feature transform of training (train_gnn.py) and the weights.

Oracle: the row normalisation formula as train_gnn.py wrote it before NodeFeatures existed,
``x / x.sum(dim=1, keepdim=True).clamp(min=1e-12)``, bit for bit.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import modelzoo
from modelzoo.graph import datasets as gd
from modelzoo.graph._common import published
from modelzoo.graph.transforms import NodeFeatures
from modelzoo.weights import Weights

ROOT = Path(__file__).resolve().parents[2]


def _formula(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(dim=1, keepdim=True).clamp(min=1e-12)


def _features() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(50, 20, generator=g) > 0.7).float() * torch.rand(50, 20, generator=g)
    x[3] = 0.0  # an empty row stays empty (no NaN)
    return x


def test_normalize_is_the_training_formula_bit_for_bit():
    x = _features()
    out = NodeFeatures(normalize=True)(x)
    assert torch.equal(out, _formula(x))
    assert torch.equal(out[3], torch.zeros(20)) and torch.isfinite(out).all()
    nonzero = x.sum(1) > 0
    torch.testing.assert_close(out[nonzero].sum(1), torch.ones(int(nonzero.sum())))
    assert torch.equal(NodeFeatures(normalize=True)(x.double()), _formula(x.double()))


def test_a_data_comes_back_as_a_copy_and_the_input_is_untouched():
    data = gd.karate_club()
    data.x = _features()[:34, :].clone()
    before = data.x.clone()
    out = NodeFeatures(normalize=True)(data)
    assert out is not data and torch.equal(out.x, _formula(before))
    assert torch.equal(data.x, before)  # not modified, not replaced
    assert out.edge_index is data.edge_index and out.class_names == data.class_names
    same = NodeFeatures()(data)
    assert same is not data and same.x is data.x  # nothing to do: the same features


def test_repr_equality_and_errors():
    assert repr(NodeFeatures(normalize=True)) == "NodeFeatures(normalize=True)"
    assert repr(NodeFeatures()) == "NodeFeatures(normalize=False)"
    assert NodeFeatures(normalize=True) == NodeFeatures(normalize=True) != NodeFeatures()
    with pytest.raises(ValueError, match=r"\(num_nodes, num_features\), got shape \(5,\)"):
        NodeFeatures(normalize=True)(torch.ones(5))
    with pytest.raises(TypeError, match="expected a torch_geometric Data with node features x"):
        NodeFeatures()([1, 2])


def test_train_gnn_normalizes_with_the_same_object(tmp_path):
    spec = importlib.util.spec_from_file_location("train_gnn_nf", ROOT / "scripts" / "train_gnn.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.NodeFeatures is NodeFeatures
    x = _features().numpy()
    path = tmp_path / "g.npz"
    mask = np.arange(50) < 20
    np.savez(path, edge_index=np.array([[0, 1, 2], [1, 2, 3]]), x=x, y=np.arange(50) % 3,
             train_mask=mask, val_mask=~mask, test_mask=~mask)  # fmt: skip
    raw = script.load_dataset(script.parse_args(["--dataset", "npz", "--npz", str(path)]))
    args = script.parse_args(["--dataset", "npz", "--npz", str(path), "--normalize-features"])
    data = script.load_dataset(args)
    assert torch.equal(raw.x, torch.from_numpy(x))
    assert torch.equal(data.x, _formula(torch.from_numpy(x)))
    assert torch.equal(data.x, NodeFeatures(normalize=True)(raw).x)


def _graph_weights(**kw) -> Weights:
    return Weights(url="package://modelzoo/graph/weights/m-12345678.pth", hash_prefix="12345678",
                   num_params=1, num_classes=2, metrics={}, source="t", license="MIT",
                   modality="graph", **kw)  # fmt: skip


def test_graph_weights_transforms_are_node_features():
    assert _graph_weights(normalize_features=True).transforms() == NodeFeatures(normalize=True)
    assert _graph_weights().transforms() == NodeFeatures(normalize=False)
    for name in modelzoo.list_models(pretrained=True):
        weights = modelzoo.get_weights(name)
        if weights.modality != "graph":
            continue
        command = weights.recipe["command"].split()
        assert weights.normalize_features == ("--normalize-features" in command), name
        assert weights.transforms() == NodeFeatures(normalize=weights.normalize_features)
        with pytest.raises(ValueError, match="no tokenizer"):
            weights.tokenizer()


def test_published_refuses_a_transform_the_recipe_did_not_use():
    common = dict(num_params=1, num_classes=2, metrics={}, log="l", paper="p", dataset="d")
    with pytest.raises(ValueError, match="normalize_features=True but the recipe does not pass"):
        published("m", "1" * 64, command="python scripts/train_gnn.py", normalize_features=True,
                  **common)  # fmt: skip
    with pytest.raises(ValueError, match="normalize_features=False but the recipe passes"):
        published("m", "1" * 64, command="train_gnn.py --normalize-features", **common)
    w = published("m", "1" * 64, command="train_gnn.py --normalize-features",
                  normalize_features=True, labels=["a", "b"], **common)  # fmt: skip
    assert w.labels == ("a", "b") and w.transforms() == NodeFeatures(normalize=True)
