"""The registry contract: names, errors, listing and the classifier reset on load."""

from __future__ import annotations

import dataclasses
import hashlib
import warnings

import pytest
import torch
from torch import nn

import modelzoo
from modelzoo import entries
from modelzoo.weights import Weights


@pytest.fixture
def scratch_registry(monkeypatch):
    """An isolated registry so test models never leak into the real one."""
    monkeypatch.setattr(entries, "_REGISTRY", dict(entries._REGISTRY))
    return entries._REGISTRY


class _Tiny(nn.Module):
    def __init__(self, num_classes: int = 5) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.body(x)))


def test_names_are_case_insensitive():
    a = modelzoo.get_model("ResNeSt14", num_classes=3)
    assert isinstance(a, nn.Module)
    assert "resnest50" in modelzoo.list_models("RESNEST5*")


def test_unknown_name_suggests_close_matches():
    with pytest.raises(ValueError, match="resnest50") as info:
        modelzoo.get_model("resnet50")
    assert "Unknown model 'resnet50'" in str(info.value)


def test_duplicate_registration_raises(scratch_registry):
    @modelzoo.register_model(name="tiny_dup")
    def tiny_dup(*, num_classes: int = 5) -> nn.Module:
        return _Tiny(num_classes)

    with pytest.raises(ValueError, match="already registered"):
        modelzoo.register_model(tiny_dup, name="TINY_DUP")


def test_list_models_filters():
    every = modelzoo.list_models()
    assert every == sorted(every)
    with_weights = set(modelzoo.list_models(pretrained=True))
    without = set(modelzoo.list_models(pretrained=False))
    assert with_weights | without == set(every)
    assert not with_weights & without
    assert {"resnest14", "resnest50", "resnest269"} <= with_weights


def test_unknown_weights_tag():
    with pytest.raises(ValueError, match="available"):
        modelzoo.get_weights("resnest50", "imagenet22k")


def test_overrides_reach_the_builder():
    net = modelzoo.get_model("resnest14", num_classes=7, final_drop=0.2)
    assert net.fc.out_features == 7
    assert isinstance(net.drop, nn.Dropout) and net.drop.p == 0.2


def _serve_weights(tmp_path, state, monkeypatch):
    """Writes ``state`` as a .pth named like a publisher would and points the store at it."""
    raw = tmp_path / "src"
    raw.mkdir()
    tmp = raw / "tmp.pth"
    torch.save(state, tmp)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    final = raw / f"tiny-{digest[:8]}.pth"
    tmp.rename(final)
    monkeypatch.setenv("MODELZOO_HOME", str(tmp_path / "home"))
    return final, digest


def test_pretrained_load_and_classifier_reset(tmp_path, monkeypatch, scratch_registry):
    torch.manual_seed(0)
    source = _Tiny(5)
    path, digest = _serve_weights(tmp_path, source.state_dict(), monkeypatch)
    weights = Weights(
        url=path.as_uri(),
        hash_prefix=digest[:8],
        num_params=sum(p.numel() for p in source.parameters()),
        num_classes=5,
        metrics={"toy": 1.0},
        source="test",
        license="CC0",
    )

    @modelzoo.register_model(name="tiny_pre", weights={"v1": weights})
    def tiny_pre(*, num_classes: int = 5) -> nn.Module:
        return _Tiny(num_classes)

    same = modelzoo.get_model("tiny_pre", pretrained=True, progress=False)
    for key, value in source.state_dict().items():
        assert torch.equal(same.state_dict()[key], value), key

    torch.manual_seed(123)
    with pytest.warns(UserWarning, match="freshly initialized"):
        other = modelzoo.get_model("tiny_pre", pretrained="v1", num_classes=3, progress=False)
    assert other.fc.out_features == 3
    assert torch.equal(other.body.weight, source.body.weight)
    torch.manual_seed(123)
    fresh = _Tiny(3)  # the classifier is the builder's own initialization, untouched
    assert torch.equal(other.fc.weight, fresh.fc.weight)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        modelzoo.get_model("tiny_pre", pretrained=True, num_classes=5, progress=False)


def test_pretrained_rejects_a_mismatched_file(tmp_path, monkeypatch, scratch_registry):
    source = _Tiny(5)
    state = source.state_dict()
    state["extra.weight"] = torch.zeros(1)
    path, digest = _serve_weights(tmp_path, state, monkeypatch)
    weights = Weights(
        url=path.as_uri(), hash_prefix=digest, num_params=0, num_classes=5, metrics={},
        source="test", license="CC0",
    )  # fmt: skip
    modelzoo.register_model(
        lambda *, num_classes=5: _Tiny(num_classes), name="tiny_bad", weights={"v": weights}
    )
    with pytest.raises(RuntimeError, match="extra.weight"):
        modelzoo.get_model("tiny_bad", pretrained=True, progress=False)
    with pytest.raises(RuntimeError, match="extra.weight"):
        modelzoo.get_model("tiny_bad", pretrained=True, num_classes=2, progress=False)


def test_offline_mode_names_the_missing_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELZOO_HOME", str(tmp_path))
    monkeypatch.setenv("MODELZOO_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="resnest50-528c19ca.pth"):
        modelzoo.get_model("resnest50", pretrained=True, progress=False)


def test_weights_validate_their_fields():
    good = modelzoo.get_weights("resnest50", "official")
    with pytest.raises(ValueError, match="hash_algo"):
        dataclasses.replace(good, hash_algo="md5")
    with pytest.raises(ValueError, match="hash_prefix"):
        dataclasses.replace(good, hash_prefix="XYZ")
    with pytest.raises(ValueError, match="file_format"):
        dataclasses.replace(good, file_format="ckpt")
