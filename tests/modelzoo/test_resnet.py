"""ResNet v1b/v1d (``modelzoo.vision.resnet``) against GluonCV and timm, and through the
model-family protocol (backbones, export, pipeline blocks).

Oracles:

* GluonCV 0.10.5 / MXNet 1.9.1 itself: ``tests/fixtures/gluoncv_resnet/make_fixture.py`` built
  a small v1b and a small v1d with GluonCV's own ``ResNetV1b`` constructor, randomized every
  parameter including the BatchNorm statistics, saved them the way GluonCV's published files
  are saved (flat names, zipped) and recorded the logits for a fixed input; it also recorded
  the parameter names (flat and structural) and shapes of GluonCV's full ``resnet50_v1b`` and
  ``resnet50_v1d`` and the parameter counts of all six depths.
* timm's ``resnet50`` and ``resnet50d`` (``pip install --no-deps timm==1.0.31``; loaded by
  ``timm_oracle.py`` without torchvision): their state dicts load into ours with
  ``strict=True`` and give the same logits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import modelzoo
from modelzoo import entries, export
from modelzoo.convert.gluoncv_resnet import convert_gluoncv_resnet, gluoncv_resnet_key_map
from modelzoo.convert.load import read_state_dict
from modelzoo.convert.mxnet import load_mxnet_params
from modelzoo.family import family_of
from modelzoo.vision.resnet import Bottleneck, ResNetFamily, ResNetV1b

from ..loopback import LocalServer
from ._reference import randomize_batchnorm
from .timm_oracle import INSTALL, load_timm, timm_available

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gluoncv_resnet"
INPUT = FIXTURES.parent / "gluoncv_resnest" / "input.npy"  # (2, 3, 70, 70), shared
TAGS = ["tiny_v1b", "tiny_v1d"]
NAMES = ["resnet50_v1b", "resnet50_v1d"]
ALL = [f"resnet{d}_v1{v}" for v in "bd" for d in (50, 101, 152)]


def _config(tag: str) -> dict:
    return json.loads((FIXTURES / f"{tag}_config.json").read_text())


def _build(tag: str, num_classes: int | None = None) -> ResNetV1b:
    cfg = _config(tag)
    return ResNetV1b(
        cfg["layers"],
        num_classes=cfg["classes"] if num_classes is None else num_classes,
        deep_stem=cfg["deep_stem"],
        stem_width=cfg["stem_width"],
        avg_down=cfg["avg_down"],
    )


def _member(tag: str) -> bytes:
    with zipfile.ZipFile(FIXTURES / f"{tag}.zip") as zf:
        assert zf.namelist() == [f"{tag}.params"]
        return zf.read(f"{tag}.params")


def _params_file(tag: str, tmp_path: Path) -> Path:
    path = tmp_path / f"{tag}.params"
    path.write_bytes(_member(tag))
    return path


def _input() -> torch.Tensor:
    return torch.from_numpy(np.load(INPUT))


def _small(**kwargs) -> ResNetV1b:
    """One block a stage: the architecture's behaviour at a fraction of ResNet-50's cost."""
    return ResNetV1b((1, 1, 1, 1), num_classes=10, **kwargs)


# ---------------------------------------------------------------------------------------------
# Architecture and registry
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_parameter_counts_are_gluoncvs(name):
    counts = json.loads((FIXTURES / "param_counts.json").read_text())
    with torch.device("meta"):
        model = modelzoo.get_model(name)
    assert sum(p.numel() for p in model.parameters()) == counts[name]
    for weights in modelzoo.registry.get_model_entry(name).weights.values():
        assert weights.num_params == counts[name]


def test_resnet50_parameter_counts():
    # torchvision's / timm's resnet50 and timm's resnet50d.
    with torch.device("meta"):
        v1b = modelzoo.get_model("resnet50_v1b")
        v1d = modelzoo.get_model("resnet50_v1d")
    assert sum(p.numel() for p in v1b.parameters()) == 25_557_032
    assert sum(p.numel() for p in v1d.parameters()) == 25_576_264


def test_v1b_and_v1d_shapes():
    with torch.device("meta"):
        v1b = modelzoo.get_model("resnet50_v1b")
        v1d = modelzoo.get_model("resnet50_v1d")
    assert isinstance(v1b.conv1, nn.Conv2d) and v1b.conv1.kernel_size == (7, 7)
    assert isinstance(v1d.conv1, nn.Sequential)
    assert [m.out_channels for m in v1d.conv1 if isinstance(m, nn.Conv2d)] == [32, 32, 64]
    for model in (v1b, v1d):
        assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
        block = model.layer2[0]
        assert block.conv1.stride == (1, 1) and block.conv2.stride == (2, 2)  # v1b: 3x3 strides
        assert model.num_features == 2048 and model.fc.in_features == 2048
        assert isinstance(model.drop, nn.Identity)
    assert isinstance(v1b.layer2[0].downsample[0], nn.Conv2d)  # strided 1x1
    assert isinstance(v1d.layer2[0].downsample[0], nn.AvgPool2d)  # ResNet-D
    assert isinstance(v1d.layer1[0].downsample[0], nn.Identity)  # stride 1: no pool


def test_get_model_with_num_classes():
    torch.manual_seed(0)
    model = modelzoo.get_model("resnet50_v1b", num_classes=10).eval()
    assert isinstance(model, ResNetV1b) and model.num_classes == 10
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        features = model.forward_features(x)
        logits = model(x)
    assert features.shape == (2, 2048, 2, 2)
    assert logits.shape == (2, 10)
    torch.testing.assert_close(logits, model.fc(features.mean((2, 3))))


def test_options():
    model = _small(final_drop=0.2, last_gamma=True, in_chans=1)
    assert isinstance(model.drop, nn.Dropout) and model.drop.p == 0.2
    assert model.conv1.in_channels == 1
    for block in model.modules():
        if isinstance(block, Bottleneck):
            assert torch.count_nonzero(block.bn3.weight) == 0
            assert torch.count_nonzero(block.bn2.weight) == block.bn2.num_features
    model.reset_classifier(3)
    assert model.num_classes == 3 and model.get_classifier().out_features == 3
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": (3, 4, 6)}, "four positive block counts"),
        ({"layers": (3, 0, 6, 3)}, "four positive block counts"),
        ({"layers": (1, 1, 1, 1), "final_drop": 1.0}, "final_drop"),
        ({"layers": (1, 1, 1, 1), "deep_stem": True, "stem_width": 0}, "stem_width"),
    ],
)
def test_invalid_options_say_what_is_wrong(kwargs, message):
    layers = kwargs.pop("layers")
    with pytest.raises(ValueError, match=message):
        ResNetV1b(layers, **kwargs)


def test_family():
    model = _small()
    family = family_of(model)
    assert family.name == "ResNet" and isinstance(family, ResNetFamily)
    assert family_of(ResNetV1b) is family
    assert family_of(modelzoo.get_model("resnest14")).name == "ResNeSt"
    assert family.modality == "image" and family.classifiers == (ResNetV1b,)


def test_weights_entries():
    for name in ALL:
        entry = modelzoo.registry.get_model_entry(name)
        assert entry.default_tag == "gluoncv"
        gluon = entry.weights["gluoncv"]
        assert gluon.hash_algo == "sha1" and len(gluon.hash_prefix) == 40
        assert gluon.url.endswith(f"/gluon/models/{name}-{gluon.hash_prefix[:8]}.zip")
        assert gluon.archive_member == f"{name}-{gluon.hash_prefix[:8]}.params"
    published = {  # GluonCV's ResNet.csv: top-1, hashtag
        "resnet50_v1b": (77.67, "0ecdba34"),
        "resnet101_v1b": (79.20, "a455932a"),
        "resnet152_v1b": (79.69, "a5a61ee1"),
        "resnet50_v1d": (79.15, "117a384e"),
        "resnet101_v1d": (80.51, "1b2b825f"),
        "resnet152_v1d": (80.61, "cddbc86f"),
    }
    for name, (top1, tag) in published.items():
        weights = modelzoo.get_weights(name, "gluoncv")
        assert weights.metrics["imagenet_top1"] == top1 and weights.hash_prefix.startswith(tag)
    tv1 = modelzoo.get_weights("resnet50_v1b", "torchvision")
    tv2 = modelzoo.get_weights("resnet50_v1b", "torchvision_v2")
    # torchvision's evaluation: resize 256 (V1) or 232 (V2), centre crop 224
    assert math.ceil(tv1.input_size / tv1.crop_ratio) == 256
    assert math.ceil(tv2.input_size / tv2.crop_ratio) == 232
    assert tv1.file_name == "resnet50_v1b-0676ba61.pth"


# ---------------------------------------------------------------------------------------------
# GluonCV parity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tag", TAGS)
def test_converted_gluoncv_weights_give_gluoncv_logits(tag, tmp_path):
    model = _build(tag)
    raw = read_state_dict(_params_file(tag, tmp_path), "params")  # the registry's path
    prefix = "resnetv1d_" if _config(tag)["avg_down"] else "resnetv1b_"
    assert all(name.startswith(prefix) for name in raw)
    state = convert_gluoncv_resnet(raw, model)
    assert list(state) == list(model.state_dict())
    model.load_state_dict(state, strict=True)
    model.eval()
    expected = torch.from_numpy(np.load(FIXTURES / f"{tag}_logits.npy"))
    with torch.no_grad():
        logits = model(_input())
    torch.testing.assert_close(logits, expected, rtol=0.0, atol=1e-4)


def test_fixture_logits_depend_on_the_input():
    # Guards the oracle: the two samples must give clearly different logits.
    for tag in TAGS:
        logits = np.load(FIXTURES / f"{tag}_logits.npy")
        assert np.abs(logits[0] - logits[1]).max() > 0.1


@pytest.mark.parametrize("tag", TAGS)
def test_every_tensor_is_used_once(tag, tmp_path):
    raw = load_mxnet_params(_params_file(tag, tmp_path))
    state = convert_gluoncv_resnet(raw, _build(tag))
    sources = [v for k, v in state.items() if not k.endswith("num_batches_tracked")]
    assert all(v.item() == 0 for k, v in state.items() if k.endswith("num_batches_tracked"))
    assert len(sources) == len(raw)
    raw_sums = sorted(float(np.abs(v).sum()) for v in raw.values())
    assert sorted(float(t.abs().sum()) for t in sources) == pytest.approx(raw_sums, rel=1e-6)


def _names(name: str) -> list[dict]:
    return json.loads((FIXTURES / f"{name}_names.json").read_text())


def _structural_to_ours(structural: str) -> str:
    """GluonCV's structural names are ours but for BatchNorm's gamma / beta (written out
    here, independently of the converter)."""
    module, _, param = structural.rpartition(".")
    param = {"gamma": "weight", "beta": "bias"}.get(param, param)
    return f"{module}.{param}"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("style", ["name", "structural", "unprefixed"])
def test_gluoncv_resnet50_maps_onto_ours(name, style):
    entries_ = _names(name)
    assert len(entries_) == {"resnet50_v1b": 267, "resnet50_v1d": 277}[name]
    with torch.device("meta"):
        model = modelzoo.get_model(name)
    target = model.state_dict()
    prefix = "resnetv1b_" if name.endswith("v1b") else "resnetv1d_"
    if style == "unprefixed":  # the old Block.save_params: prefix stripped
        names = [e["name"].removeprefix(prefix) for e in entries_]
    else:
        names = [e[style] for e in entries_]
    params = {
        n: np.zeros(e["shape"], dtype=np.float32) for n, e in zip(names, entries_, strict=True)
    }
    key_map = gluoncv_resnet_key_map(names, target)
    assert [key_map[n] for n in names] == [_structural_to_ours(e["structural"]) for e in entries_]
    assert set(key_map.values()) == {k for k in target if not k.endswith("num_batches_tracked")}
    state = convert_gluoncv_resnet(params, model)  # also checks every shape
    assert list(state) == list(target)


@pytest.fixture
def tiny_v1b(tmp_path):
    return load_mxnet_params(_params_file("tiny_v1b", tmp_path)), _build("tiny_v1b")


def test_missing_parameter_is_reported(tiny_v1b):
    raw, model = tiny_v1b
    del raw["resnetv1b_layers2_batchnorm4_running_var"]  # block 1's bn2
    with pytest.raises(ValueError, match=r"layer2\.1\.bn2\.running_var"):
        convert_gluoncv_resnet(raw, model)


def test_unknown_parameter_is_reported(tiny_v1b):
    raw, model = tiny_v1b
    raw["resnetv1b_layers1_conv3_weight"] = np.zeros((1,), np.float32)  # a second block
    raw["resnetv1b_mystery"] = np.zeros((1,), np.float32)
    with pytest.raises(ValueError, match="resnetv1b_layers1_conv3_weight.*resnetv1b_mystery"):
        convert_gluoncv_resnet(raw, model)


def test_v1b_weights_into_a_v1d_model_are_reported(tiny_v1b):
    raw, _ = tiny_v1b
    with pytest.raises(ValueError, match="v1d: deep stem") as info:
        convert_gluoncv_resnet(raw, _build("tiny_v1d"))
    assert "conv1.0.weight" in str(info.value)  # the deep stem the file lacks


def test_other_class_count_passes_the_classifier_through(tiny_v1b):
    raw, _ = tiny_v1b
    model = _build("tiny_v1b", num_classes=5)
    state = convert_gluoncv_resnet(raw, model)
    assert state["fc.weight"].shape == (10, 2048)
    with pytest.raises(RuntimeError, match="size mismatch for fc.weight"):
        model.load_state_dict(state, strict=True)
    state = {k: v for k, v in state.items() if not k.startswith("fc.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert sorted(missing) == ["fc.bias", "fc.weight"] and not unexpected


def test_mixed_prefixes_are_reported(tiny_v1b):
    raw, model = tiny_v1b
    raw["other_conv0_weight"] = raw.pop("resnetv1b_conv0_weight")
    with pytest.raises(ValueError, match="prefixes"):
        convert_gluoncv_resnet(raw, model)


# ---------------------------------------------------------------------------------------------
# Pretrained weights end to end: zip over HTTP, sha1 of the member, reader, conversion
# ---------------------------------------------------------------------------------------------


def _zip(member_name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(member_name, data)
    return buffer.getvalue()


def _gluon_weights(
    registered: str, name: str, data: bytes, url_base: str, **changes
) -> modelzoo.Weights:
    """The GluonCV entry of ``registered`` (its real ``convert``) for the file ``data``,
    named as GluonCV names its files."""
    sha1 = hashlib.sha1(data).hexdigest()
    return dataclasses.replace(
        modelzoo.get_weights(registered, "gluoncv"),
        url=f"{url_base}/{name}-{sha1[:8]}.zip",
        archive_member=f"{name}-{sha1[:8]}.params",
        hash_prefix=sha1,
        **changes,
    )


@pytest.mark.usefixtures("isolated_home")  # tests/conftest.py
def test_gluoncv_file_over_http_through_get_model(monkeypatch):
    """GluonCV's own v1d file, served from a mirror (MODELZOO_REPO_URL), through get_model."""
    monkeypatch.setattr(entries, "_REGISTRY", dict(entries._REGISTRY))  # a scratch registry
    member = _member("tiny_v1d")
    weights = _gluon_weights(
        "resnet50_v1d", "tiny_resnet_v1d", member, "https://example.invalid/gluon/models",
        num_classes=10, num_params=0, labels=None,  # a tiny fixture model
    )  # fmt: skip

    def tiny_resnet_v1d(*, num_classes: int = 10) -> ResNetV1b:
        return _build("tiny_v1d", num_classes)

    modelzoo.register_model(tiny_resnet_v1d, weights={"gluoncv": weights})
    server = LocalServer()
    try:
        route = f"mirror/{weights.url.rsplit('/', 1)[1]}"
        server.serve(route, _zip(weights.archive_member, member))
        monkeypatch.setenv("MODELZOO_REPO_URL", server.url("mirror"))
        model = modelzoo.get_model("tiny_resnet_v1d", pretrained=True, progress=False)
        assert server.hits[route] == 1
    finally:
        server.close()
    expected = torch.from_numpy(np.load(FIXTURES / "tiny_v1d_logits.npy"))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(_input()), expected, rtol=0, atol=1e-4)


def _write_mxnet_params(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``mx.nd.save(path, dict)`` (the layout of ``modelzoo/convert/mxnet.py``'s docstring):
    V2 dense float32 records, then the names."""
    out = [struct.pack("<QQQ", 0x112, 0, len(arrays))]
    for value in arrays.values():
        value = np.ascontiguousarray(value, dtype="<f4")
        out.append(struct.pack("<Iii", 0xF993FAC9, 0, value.ndim))
        out.append(struct.pack(f"<{value.ndim}q", *value.shape))
        out.append(struct.pack("<iii", 1, 0, 0))  # cpu(0), float32
        out.append(value.tobytes())
    out.append(struct.pack("<Q", len(arrays)))
    for name in arrays:
        raw = name.encode()
        out.append(struct.pack("<Q", len(raw)) + raw)
    path.write_bytes(b"".join(out))


@pytest.mark.usefixtures("isolated_home")
def test_resnet50_v1b_pretrained_gluoncv_file(tmp_path, monkeypatch):
    """``get_model("resnet50_v1b", pretrained=True)`` on a full-size file in GluonCV's layout:
    its flat names in its file order, each holding the tensor that GluonCV's recorded
    structural name designates in a source model."""
    torch.manual_seed(0)
    source = randomize_batchnorm(modelzoo.get_model("resnet50_v1b"))
    state = source.state_dict()
    arrays = {
        e["name"]: state[_structural_to_ours(e["structural"])].numpy()
        for e in _names("resnet50_v1b")
    }
    path = tmp_path / "file.params"
    _write_mxnet_params(path, arrays)
    data = path.read_bytes()
    weights = _gluon_weights(
        "resnet50_v1b", "resnet50_v1b", data, "https://example.invalid/gluon/models"
    )
    monkeypatch.setitem(modelzoo.registry.get_model_entry("resnet50_v1b").weights, "gluoncv",
                        weights)  # fmt: skip
    server = LocalServer()
    try:
        server.serve(f"mirror/{weights.url.rsplit('/', 1)[1]}", _zip(weights.archive_member, data))
        monkeypatch.setenv("MODELZOO_REPO_URL", server.url("mirror"))
        model = modelzoo.get_model("resnet50_v1b", pretrained=True, progress=False)
    finally:
        server.close()
    for key, value in model.state_dict().items():
        if key.endswith("num_batches_tracked"):
            assert value.item() == 0
        else:
            assert torch.equal(value, state[key]), key


# ---------------------------------------------------------------------------------------------
# timm
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def timm():
    if not timm_available():
        pytest.skip(f"timm is the oracle of these tests: {INSTALL}")
    return load_timm()


@pytest.mark.parametrize(("name", "timm_name"), [("resnet50_v1b", "resnet50"),
                                                 ("resnet50_v1d", "resnet50d")])  # fmt: skip
def test_timm_weights_load_strictly_and_agree(timm, name, timm_name):
    torch.manual_seed(0)
    reference = randomize_batchnorm(timm.create_model(timm_name, pretrained=False)).eval()
    state = reference.state_dict()
    with torch.device("meta"):
        model = modelzoo.get_model(name)
    assert list(model.state_dict()) == list(state)  # same names, same order
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=1e-5)
        torch.testing.assert_close(
            model.forward_features(x), reference.forward_features(x), rtol=0, atol=1e-5
        )


# ---------------------------------------------------------------------------------------------
# Through the family protocol: backbones, export, pipeline blocks
# ---------------------------------------------------------------------------------------------


def test_features_only():
    torch.manual_seed(0)
    net = modelzoo.get_model("resnet50_v1d", features_only=True, out_indices=(1, 2, 3, 4))
    assert net.feature_info.channels() == [256, 512, 1024, 2048]
    assert net.feature_info.reduction() == [4, 8, 16, 32]
    assert net.feature_info.module_name() == ["layer1", "layer2", "layer3", "layer4"]
    with torch.no_grad():
        feats = net.eval()(torch.randn(2, 3, 64, 64))
    assert [tuple(f.shape) for f in feats] == [
        (2, 256, 16, 16), (2, 512, 8, 8), (2, 1024, 4, 4), (2, 2048, 2, 2),
    ]  # fmt: skip


def test_features_equal_the_full_models_stages():
    torch.manual_seed(0)
    full = randomize_batchnorm(_small(deep_stem=True, avg_down=True)).eval()
    net = modelzoo.create_features(full)
    assert net.feature_info.channels() == [64, 256, 512, 1024, 2048]
    x = torch.randn(2, 3, 70, 70)
    with torch.no_grad():
        feats = net.eval()(x)
        stem = full.maxpool(full.relu(full.bn1(full.conv1(x))))
        stages = [full.layer1(stem)]
        for i in (2, 3, 4):
            stages.append(getattr(full, f"layer{i}")(stages[-1]))
    for ours, expected in zip(feats[1:], stages, strict=True):
        assert torch.equal(ours, expected)


def test_export_program_round_trip(tmp_path):
    torch.manual_seed(0)
    model = randomize_batchnorm(_small(deep_stem=True, avg_down=True)).train()
    path = export.export_program(
        model, export.example_inputs(model, image_size=64), tmp_path / "resnet.pt2"
    )
    assert model.training  # its mode is given back
    program = torch.export.load(path).module()
    model.eval()
    for batch in (1, 3):  # another batch than exported: the batch stayed dynamic
        x = export.example_inputs(model, batch_size=batch, image_size=64, seed=batch)
        with torch.no_grad():
            torch.testing.assert_close(program(*x), model(*x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("v1d", [False, True])
def test_pipeline_blocks_compose_to_the_model(v1d):
    from trainers.parallel.pipeline import model_blocks

    torch.manual_seed(0)
    model = randomize_batchnorm(ResNetV1b((2, 1, 1, 1), num_classes=10, deep_stem=v1d,
                                          avg_down=v1d)).eval()  # fmt: skip
    blocks = model_blocks(model)
    names = family_of(model).pipeline_block_names(model, len(blocks))
    assert names == ["stem", "layer1.0", "layer1.1", "layer2.0", "layer3.0", "layer4.0", "head"]
    params = {id(p) for p in model.parameters()}
    assert {id(p) for b in blocks for p in b.parameters()} == params  # shared, all covered
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        out = x
        for block in blocks:
            out = block(out)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
