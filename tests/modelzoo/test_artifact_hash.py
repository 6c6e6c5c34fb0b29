"""Artifact integrity: recorded sha256 of every file, verified on load; no non-finite export.

Oracles: ``hashlib.sha256`` of the files as written on disk, and the model's own forward
(a flipped byte, loaded unchecked, really changes the predictions: the check is what stops
it).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import modelzoo
from modelzoo.artifact import ArtifactError, load_artifact, save_artifact

KWARGS = {"num_classes": 3, "in_channels": 4}


pytestmark = pytest.mark.usefixtures("isolated_home")  # tests/conftest.py


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return modelzoo.get_model("gcn", **KWARGS).eval()


def _save(path, net, **extra):
    return save_artifact(path, net, model_name="gcn", model_kwargs=KWARGS,
                         task="node-classification", labels=["a", "b", "c"],
                         preprocessing={"normalize_features": False}, **extra)  # fmt: skip


def _graph():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, generator=g)
    edges = torch.tensor([[0, 1, 2, 3, 4, 5, 1, 2], [1, 2, 3, 4, 5, 0, 0, 1]])
    return x, edges


def _predict(model):
    with torch.no_grad():
        return model(*_graph())


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # a float32's high byte (little-endian): sign and exponent bits
    path.write_bytes(bytes(data))


def test_every_file_is_recorded_with_its_sha256(tmp_path):
    path = _save(tmp_path / "art", _net())
    meta = json.loads((path / "modelzoo.json").read_text())
    on_disk = sorted(p.name for p in path.iterdir() if p.name != "modelzoo.json")
    assert sorted(meta["files"]) == on_disk == ["model.safetensors"]
    for name, digest in meta["files"].items():
        assert digest == hashlib.sha256((path / name).read_bytes()).hexdigest()
    torch.testing.assert_close(_predict(modelzoo.get_model(str(path))), _predict(_net()))


def test_a_flipped_byte_is_refused_naming_the_file_and_the_fix(tmp_path):
    net = _net()
    path = _save(tmp_path / "art", net)
    _flip_last_byte(path / "model.safetensors")
    # unchecked, the corrupted weights load and answer differently: what the check prevents
    corrupted = load_artifact(path, verify=False).build()
    assert not torch.allclose(_predict(corrupted), _predict(net), equal_nan=True)
    for load in (lambda: modelzoo.get_model(str(path)), lambda: load_artifact(path)):
        with pytest.raises(ArtifactError) as info:
            load()
        message = str(info.value)
        assert str(path / "model.safetensors") in message
        assert "export the model again" in message and "download" in message
    with pytest.raises(ArtifactError, match="model.safetensors"):
        modelzoo.pipeline("node-classification", str(path))


def test_a_listed_file_that_is_missing_or_outside_the_folder_is_refused(tmp_path):
    path = _save(tmp_path / "art", _net())
    meta_path = path / "modelzoo.json"
    meta = json.loads(meta_path.read_text())
    meta["files"]["labels.txt"] = "0" * 64
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="labels.txt: missing"):
        load_artifact(path)
    meta["files"] = {"../model.safetensors": "0" * 64}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="outside the folder"):
        load_artifact(path)


def test_an_artifact_written_before_the_hashes_still_loads(tmp_path):
    net = _net()
    path = _save(tmp_path / "art", net)
    meta = json.loads((path / "modelzoo.json").read_text())
    del meta["files"]
    (path / "modelzoo.json").write_text(json.dumps(meta))
    torch.testing.assert_close(_predict(modelzoo.get_model(str(path))), _predict(net))


def test_non_finite_weights_are_never_exported(tmp_path):
    old = _save(tmp_path / "art", _net())
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    net = _net(seed=1)
    with torch.no_grad():
        net.head.lin.weight[0, 0] = float("nan")
    with pytest.raises(ArtifactError, match="'head.lin.weight' has a non-finite value"):
        _save(tmp_path / "art", net)
    with pytest.raises(ArtifactError, match="nothing was written"):
        _save(tmp_path / "fresh", net)
    assert not (tmp_path / "fresh").exists()
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before  # the old one untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial
    # the EMA's weights (state_dict=) are what is written, so they are what is checked
    state = {k: v.clone() for k, v in _net().state_dict().items()}
    state["convs.0.bias"][0] = float("inf")
    with pytest.raises(ArtifactError, match="'convs.0.bias'"):
        _save(tmp_path / "ema", _net(), state_dict=state)
    assert not (tmp_path / "ema").exists()
