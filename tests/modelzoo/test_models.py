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
from modelzoo.vision.resnest import ResNeSt

ALL = modelzoo.list_models()
PRETRAINED = [
    (n, t)
    for n in modelzoo.list_models(pretrained=True)
    for t in modelzoo.registry.get_model_entry(n).weights
]


def _example_input(model: nn.Module) -> torch.Tensor:
    if isinstance(model, ResNeSt):
        return torch.randn(2, 3, 32, 32)
    raise AssertionError(
        f"tests/modelzoo/test_models.py: add an example input for {type(model).__name__}"
    )


def test_registry_is_not_empty():
    assert len(ALL) >= 8


@pytest.mark.parametrize("name", ALL)
def test_forward_backward_state_dict(name):
    torch.manual_seed(0)
    model = modelzoo.get_model(name, num_classes=7)
    x = _example_input(model)
    out = model(x)
    assert out.shape == (x.shape[0], 7)
    assert torch.isfinite(out).all()
    out.logsumexp(dim=1).mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)

    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    clone = modelzoo.get_model(name, num_classes=7)
    clone.load_state_dict(torch.load(buffer, weights_only=True), strict=True)
    model.eval()
    clone.eval()
    with torch.no_grad():
        assert torch.equal(model(x), clone(x))


REQUIRED = ("url", "hash_prefix", "hash_algo", "file_format", "num_params", "num_classes", "metrics",
            "input_size", "crop_ratio", "mean", "std", "license", "source", "recipe")  # fmt: skip


@pytest.mark.parametrize(("name", "tag"), PRETRAINED)
def test_weights_metadata(name, tag):
    weights = modelzoo.get_weights(name, tag)
    meta = weights.to_dict()
    for field in REQUIRED:
        assert meta.get(field) not in (None, "", {}), f"{name}/{tag}: {field} is empty"
    assert weights.url.startswith(("https://", "http://"))
    assert weights.hash_prefix in weights.file_name
    assert weights.file_name.startswith(name + "-")
    assert weights.file_name.endswith("." + weights.file_format)
    assert all(isinstance(v, float) and 0 < v <= 100 for v in weights.metrics.values())
    assert weights.input_size >= 32 and 0.5 < weights.crop_ratio <= 1
    assert len(weights.mean) == len(weights.std) == 3
    with torch.device("meta"):
        model = modelzoo.get_model(name, num_classes=weights.num_classes)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == weights.num_params
    assert math.isfinite(weights.num_params)
