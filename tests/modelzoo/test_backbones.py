"""Backbones (``get_model(..., features_only=True)``) and the torch.hub entry points.

Oracles: the classification model run eagerly with hooks on its stem and stages (same
weights, so the maps are bit-identical), the GluonCV logits of a real MXNet-made checkpoint,
and the shapes the (meta-device) forward really produces.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import modelzoo
from modelzoo.family import find_family
from modelzoo.features import FeatureListNet, create_features
from modelzoo.registry import get_model_entry
from modelzoo.vision.resnest import ResNeSt

from ._reference import randomize_batchnorm
from .test_registry import _serve_weights, scratch_registry  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "gluoncv_resnest"
ALL = modelzoo.list_models()


def _is_backbone(name: str) -> bool:
    """Whether the registered model's family declares feature maps (built on meta: free)."""
    with torch.device("meta"):
        family = find_family(get_model_entry(name).builder())
    return family is not None and family.features is not None


# Every registered model whose family declares features (new ones are tested for free: the
# ResNeSts, the ResNet v1b/v1d); the rest are not backbones.
BACKBONES = [n for n in ALL if _is_backbone(n)]
NOT_BACKBONES = [n for n in ALL if n not in BACKBONES]
STAGES = ("relu", "layer1", "layer2", "layer3", "layer4")  # the full model's modules, 0..4


pytestmark = pytest.mark.usefixtures("isolated_home")  # tests/conftest.py


def _stage_outputs(model: ResNeSt, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The full classifier's logits and the outputs of its stem and four stages (hooks)."""
    found: dict[str, torch.Tensor] = {}
    handles = [
        getattr(model, name).register_forward_hook(
            lambda _m, _i, out, name=name: found.__setitem__(name, out.clone())
        )
        for name in STAGES
    ]
    try:
        logits = model(x)
    finally:
        for handle in handles:
            handle.remove()
    return logits, [found[name] for name in STAGES]


@pytest.mark.usefixtures("scratch_registry")
def test_features_equal_the_full_models_stages_with_pretrained_weights(tmp_path, monkeypatch):
    torch.manual_seed(0)
    source = modelzoo.get_model("resnest14", num_classes=10)
    randomize_batchnorm(source)
    path, digest = _serve_weights(tmp_path, source.state_dict(), monkeypatch)
    weights = modelzoo.Weights(
        url=path.as_uri(), hash_prefix=digest[:8], num_params=0, num_classes=10, metrics={},
        source="test", license="CC0",
    )  # fmt: skip
    modelzoo.register_model(
        get_model_entry("resnest14").builder, name="resnest14_served", weights={"v1": weights}
    )

    net = modelzoo.get_model("resnest14_served", pretrained=True, features_only=True)
    full = modelzoo.get_model("resnest14_served", pretrained="v1")
    for key, value in net.state_dict().items():  # the file's tensors, everything but fc
        assert torch.equal(value, source.state_dict()[key]), key
    assert set(source.state_dict()) - set(net.state_dict()) == {"fc.weight", "fc.bias"}

    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        feats = net.eval()(x)
        _, expected = _stage_outputs(full.eval(), x)
    assert len(feats) == 5
    for i, (ours, theirs) in enumerate(zip(feats, expected, strict=True)):
        assert torch.equal(ours, theirs), f"feature {i} ({STAGES[i]})"
    # hubconf.py is generated from the registry at import: the served model has an entry too
    hub = torch.hub.load(
        str(ROOT), "resnest14_served", source="local", pretrained=True, features_only=True
    )
    with torch.no_grad():
        for ours, theirs in zip(hub.eval()(x), feats, strict=True):
            assert torch.equal(ours, theirs)


@pytest.mark.usefixtures("scratch_registry")
def test_gluoncv_weights_give_gluoncv_logits_through_the_backbone(tmp_path):
    """A checkpoint made by GluonCV (MXNet): the backbone's last map, pooled and fed to the
    full model's classifier, gives the logits GluonCV computed; the maps equal the full
    model's stages at an odd input size (70: ceil division at every stride)."""
    cfg = json.loads((FIXTURES / "tiny_a_config.json").read_text())
    with zipfile.ZipFile(FIXTURES / "tiny_a.zip") as zf:
        member = zf.read("tiny_a.params")
    sha1 = hashlib.sha1(member).hexdigest()
    archive = tmp_path / f"tiny-{sha1[:8]}.zip"  # the publisher's naming
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr(f"tiny-{sha1[:8]}.params", member)
    weights = dataclasses.replace(
        modelzoo.get_weights("resnest14", "gluoncv"),
        url=archive.as_uri(),
        archive_member=f"tiny-{sha1[:8]}.params",
        hash_prefix=sha1[:8],
        num_classes=cfg["classes"],
        labels=None,  # a tiny fixture model, not ImageNet's 1000 classes
    )

    def tiny_gluon(*, num_classes: int = 10) -> ResNeSt:
        return ResNeSt(
            cfg["layers"], num_classes=num_classes, radix=cfg["radix"],
            cardinality=cfg["cardinality"], bottleneck_width=cfg["bottleneck_width"],
            stem_width=cfg["stem_width"], avd_first=cfg["avd_first"],
        )  # fmt: skip

    modelzoo.register_model(tiny_gluon, weights={"gluoncv": weights})
    net = modelzoo.get_model("tiny_gluon", pretrained="gluoncv", features_only=True).eval()
    full = modelzoo.get_model("tiny_gluon", pretrained="gluoncv").eval()

    x = torch.from_numpy(np.load(FIXTURES / "input.npy"))  # (2, 3, 70, 70)
    gluon_logits = torch.from_numpy(np.load(FIXTURES / "tiny_a_logits.npy"))
    with torch.no_grad():
        feats = net(x)
        _, expected = _stage_outputs(full, x)
        logits = full.fc(full.avgpool(feats[-1]).flatten(1))
    torch.testing.assert_close(logits, gluon_logits, rtol=0, atol=1e-4)
    for i, (ours, theirs) in enumerate(zip(feats, expected, strict=True)):
        assert torch.equal(ours, theirs), f"feature {i}"
        r = net.feature_info.reduction(i)
        assert ours.shape == (2, net.feature_info.channels(i), math.ceil(70 / r), math.ceil(70 / r))


def test_features_equal_the_full_model_in_training_mode():
    """Train mode (batch statistics) on a "fast" variant: the same maps as the full model."""
    torch.manual_seed(0)
    full = modelzoo.get_model("resnest50_fast_2s1x64d", num_classes=4)
    net = create_features(full, out_indices=(0, 1, 2, 3, 4))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        feats = net(x)
        _, expected = _stage_outputs(full, x)
    for i, (ours, theirs) in enumerate(zip(feats, expected, strict=True)):
        assert torch.equal(ours, theirs), f"feature {i}"


@pytest.mark.parametrize("name", BACKBONES)
def test_feature_info_matches_the_outputs(name):
    """Shapes the forward really produces (meta tensors: shapes without arithmetic) against
    feature_info, for every registered backbone; channels against the layers themselves."""
    with torch.device("meta"):
        net = modelzoo.get_model(name, features_only=True)
        feats = net(torch.empty(2, 3, 64, 96))
    info = net.feature_info
    assert info.out_indices == (0, 1, 2, 3, 4)
    assert info.reduction() == [2, 4, 8, 16, 32]
    assert info.module_name() == list(STAGES)
    assert info.channels() == [
        net.bn1.num_features,  # the stem's output (a deep stem: 2 x its width)
        *(getattr(net, f"layer{i}")[-1].conv3.out_channels for i in range(1, 5)),
    ]
    modules = dict(net.named_modules())
    assert len(info) == len(feats) == 5
    for i, (entry, feat) in enumerate(zip(info, feats, strict=True)):
        assert entry == info[i] == info.get_dicts(idx=i)
        assert entry["index"] == i
        r = entry["reduction"]
        assert feat.shape == (2, entry["num_chs"], 64 // r, 96 // r)
        assert entry["module"] in modules


def test_out_indices_select_and_order_the_outputs():
    torch.manual_seed(0)
    every = modelzoo.get_model("resnest14", features_only=True)
    torch.manual_seed(0)
    some = modelzoo.get_model("resnest14", features_only=True, out_indices=(3, 1))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        all_maps = every(x)
        picked = some(x)
    assert len(picked) == 2
    assert torch.equal(picked[0], all_maps[3]) and torch.equal(picked[1], all_maps[1])
    assert some.feature_info.out_indices == (3, 1)
    assert some.feature_info.channels() == [1024, 256]
    assert some.feature_info.reduction() == [16, 4]
    assert some.feature_info.channels(1) == 256
    assert some.feature_info.channels([1, 0]) == [256, 1024]
    # the stages after the last selected one are not kept
    assert [n for n, _ in some.named_children()][-1] == "layer3"
    stem = modelzoo.get_model("resnest14", features_only=True, out_indices=(0,))
    assert [n for n, _ in stem.named_children()] == ["conv1", "bn1", "relu"]
    assert [tuple(f.shape) for f in stem(x)] == [(2, 64, 32, 32)]


@pytest.mark.parametrize("bad", [(5,), (-1,), (), (1, 1), 3, (True,), (1.0,), "1"])
def test_invalid_out_indices_name_the_valid_range(bad):
    with pytest.raises(ValueError, match=r"out_indices must be .* 0\.\.4") as info:
        modelzoo.get_model("resnest14", features_only=True, out_indices=bad)
    assert "reduction 32" in str(info.value)


@pytest.mark.parametrize("name", NOT_BACKBONES)
def test_models_without_stages_refuse_features_only(name, monkeypatch):
    # Refused before any download: offline with an empty cache would raise FileNotFoundError.
    monkeypatch.setenv("MODELZOO_OFFLINE", "1")
    pretrained = bool(get_model_entry(name).weights)
    with pytest.raises(ValueError, match=f"'{name}' is not a backbone") as info:
        modelzoo.get_model(name, pretrained=pretrained, features_only=True)
    assert "ResNeSt (" in str(info.value) and "resnest50" in str(info.value)


def test_other_misuse_has_clear_errors():
    with pytest.raises(ValueError, match="only applies with features_only=True"):
        modelzoo.get_model("resnest14", out_indices=(1, 2))
    with pytest.raises(ValueError, match="num_classes=3 has no meaning"):
        modelzoo.get_model("resnest14", features_only=True, num_classes=3)
    with pytest.raises(ValueError, match="ResNeSt"):
        create_features(nn.Linear(2, 2))


@pytest.mark.parametrize("out_indices", [(0, 1, 2, 3, 4), (1, 2)])
def test_no_classifier_and_every_parameter_gets_a_gradient(out_indices):
    """DDP without find_unused_parameters: every parameter takes part in the outputs."""
    torch.manual_seed(0)
    net = modelzoo.get_model("resnest14", features_only=True, out_indices=out_indices)
    assert isinstance(net, FeatureListNet)
    names = [n for n, _ in net.named_parameters()]
    assert not any(n.startswith(("fc.", "avgpool", "drop")) for n in names)
    kept = {f"layer{i}" for i in range(1, max(out_indices) + 1)} | {"conv1", "bn1"}
    assert {n.split(".")[0] for n in names} == kept
    feats = net(torch.randn(2, 3, 64, 64))
    sum(f.sum() for f in feats).backward()
    missing = [n for n, p in net.named_parameters() if p.grad is None]
    assert not missing
    if out_indices == (0, 1, 2, 3, 4):  # the full model minus exactly its classifier
        full = modelzoo.get_model("resnest14")
        count = sum(p.numel() for p in net.parameters())
        assert count == sum(p.numel() for p in full.parameters()) - sum(
            p.numel() for p in full.fc.parameters()
        )


def _hubconf():
    spec = importlib.util.spec_from_file_location("hubconf", ROOT / "hubconf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hub_load_equals_get_model():
    torch.manual_seed(0)
    hub = torch.hub.load(
        str(ROOT), "resnest14", source="local", pretrained=False, features_only=True
    )
    torch.manual_seed(0)
    ours = modelzoo.get_model("resnest14", features_only=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        for a, b in zip(hub(x), ours(x), strict=True):
            assert torch.equal(a, b)
    assert hub.feature_info.get_dicts() == ours.feature_info.get_dicts()
    sub = torch.hub.load(
        str(ROOT), "resnest14", source="local", out_indices=(2,), features_only=True
    )
    assert sub.feature_info.channels() == [512]
    clf = torch.hub.load(str(ROOT), "resnest14", source="local", num_classes=3, final_drop=0.1)
    assert isinstance(clf, ResNeSt) and clf.fc.out_features == 3 and clf.drop.p == 0.1


def test_hubconf_lists_exactly_the_vision_models():
    module = _hubconf()
    # torch.hub's own rule: every public callable of hubconf.py is an entry point
    entries = sorted(
        n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")
    )
    vision = [
        n for n in ALL if get_model_entry(n).builder.__module__.startswith("modelzoo.vision.")
    ]
    assert entries == vision
    assert set(modelzoo.list_models("resnest*")) <= set(entries)
    assert not {"bert_12_768_12", "gcn", "minilm_l6_h384"} & set(entries)
    assert "torch" in module.dependencies
    for name in module.dependencies:  # what torch.hub checks before calling an entry
        assert importlib.util.find_spec(name) is not None, name
    assert "ResNeSt-50" in module.resnest50.__doc__


def test_importing_hubconf_imports_no_heavy_packages():
    heavy = ["torch_geometric", "transformers", "tokenizers", "sklearn", "scipy", "PIL",
             "matplotlib", "safetensors"]  # fmt: skip
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); import hubconf; "
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "[]", result.stdout


def test_docs_table_is_resnest50s_feature_info():
    text = (ROOT / "docs" / "inference.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (\d) \| `(\w+)` \| (\d+) \| (\d+) \|", text, flags=re.M)
    with torch.device("meta"):
        info = modelzoo.get_model("resnest50", features_only=True).feature_info
    assert [(int(i), m, int(c), int(r)) for i, m, c, r in rows] == [
        (e["index"], e["module"], e["num_chs"], e["reduction"]) for e in info
    ]
