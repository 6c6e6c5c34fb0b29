"""Our ResNeSt against GluonCV's, through converted GluonCV ``.params`` files.

The oracle is GluonCV 0.10.5 / MXNet 1.9.1 itself: ``tests/fixtures/gluoncv_resnest/
make_fixture.py`` built two small ResNeSts with GluonCV's own constructor, randomized every
parameter including the BatchNorm statistics, saved them the way GluonCV's published files are
saved (flat names, zipped) and recorded the logits for a fixed input. It also recorded the
parameter names and shapes of GluonCV's full ``resnest50``.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import modelzoo
from modelzoo.convert.gluoncv_resnest import convert_gluoncv_resnest, gluoncv_resnest_key_map
from modelzoo.convert.load import read_state_dict
from modelzoo.convert.mxnet import load_mxnet_params
from modelzoo.vision.resnest import ResNeSt

FIXTURES = Path(__file__).parent.parent / "fixtures" / "gluoncv_resnest"
TAGS = ["tiny_a", "tiny_b"]  # a: radix 2, avd after conv2; b: radix 4, cardinality 2, avd_first


def _params_file(tag: str, tmp_path: Path) -> Path:
    with zipfile.ZipFile(FIXTURES / f"{tag}.zip") as zf:
        assert zf.namelist() == [f"{tag}.params"]
        zf.extractall(tmp_path)
    return tmp_path / f"{tag}.params"


def _build(tag: str) -> ResNeSt:
    cfg = json.loads((FIXTURES / f"{tag}_config.json").read_text())
    assert cfg["use_splat"] and cfg["dropblock_prob"] == 0.0
    return ResNeSt(
        cfg["layers"],
        num_classes=cfg["classes"],
        radix=cfg["radix"],
        cardinality=cfg["cardinality"],
        bottleneck_width=cfg["bottleneck_width"],
        stem_width=cfg["stem_width"],
        deep_stem=cfg["deep_stem"],
        avg_down=cfg["avg_down"],
        avd=cfg["avd"],
        avd_first=cfg["avd_first"],
    )


@pytest.mark.parametrize("tag", TAGS)
def test_converted_gluoncv_weights_give_gluoncv_logits(tag, tmp_path):
    model = _build(tag)
    raw = read_state_dict(_params_file(tag, tmp_path), "params")  # the registry's path
    assert all(name.startswith("resnest_") for name in raw)
    state = convert_gluoncv_resnest(raw, model)
    assert list(state) == list(model.state_dict())
    model.load_state_dict(state, strict=True)
    model.eval()
    x = torch.from_numpy(np.load(FIXTURES / "input.npy"))
    expected = torch.from_numpy(np.load(FIXTURES / f"{tag}_logits.npy"))
    with torch.no_grad():
        logits = model(x)
    torch.testing.assert_close(logits, expected, rtol=0.0, atol=1e-4)


def test_fixture_logits_depend_on_the_input():
    # Guards the oracle: the two samples must give clearly different logits, or a broken
    # early layer could hide behind the biases.
    for tag in TAGS:
        logits = np.load(FIXTURES / f"{tag}_logits.npy")
        assert np.abs(logits[0] - logits[1]).max() > 0.1


def test_every_tensor_is_used_once(tmp_path):
    model = _build("tiny_a")
    raw = load_mxnet_params(_params_file("tiny_a", tmp_path))
    state = convert_gluoncv_resnest(raw, model)
    for key, value in state.items():
        if key.endswith("num_batches_tracked"):
            assert value.item() == 0
    sources = [v for k, v in state.items() if not k.endswith("num_batches_tracked")]
    assert len(sources) == len(raw)
    # Values arrive unchanged (same bytes), each from a distinct array.
    raw_sums = sorted(float(np.abs(v).sum()) for v in raw.values())
    assert sorted(float(t.abs().sum()) for t in sources) == pytest.approx(raw_sums, rel=1e-6)


@pytest.fixture(scope="module")
def resnest50_names():
    return json.loads((FIXTURES / "resnest50_names.json").read_text())


@pytest.mark.parametrize("style", ["name", "structural"])
def test_gluoncv_resnest50_maps_onto_ours(resnest50_names, style):
    assert len(resnest50_names) == 405
    with torch.device("meta"):
        model = modelzoo.get_model("resnest50")
    target = model.state_dict()
    params = {e[style]: np.zeros(e["shape"], dtype=np.float32) for e in resnest50_names}
    key_map = gluoncv_resnest_key_map(list(params), target)
    mapped = list(key_map.values())
    assert None not in mapped
    assert len(set(mapped)) == len(mapped) == 405
    assert set(mapped) == {k for k in target if not k.endswith("num_batches_tracked")}
    state = convert_gluoncv_resnest(params, model)  # also checks every shape
    assert list(state) == list(target)


def test_flat_and_structural_names_agree(resnest50_names):
    with torch.device("meta"):
        target = modelzoo.get_model("resnest50").state_dict()
    flat = gluoncv_resnest_key_map([e["name"] for e in resnest50_names], target)
    structural = gluoncv_resnest_key_map([e["structural"] for e in resnest50_names], target)
    for e in resnest50_names:
        assert flat[e["name"]] == structural[e["structural"]], e


@pytest.fixture
def tiny_a(tmp_path):
    return load_mxnet_params(_params_file("tiny_a", tmp_path)), _build("tiny_a")


def test_missing_parameter_is_reported(tiny_a):
    raw, model = tiny_a
    del raw["resnest_layers3_batchnorm2_running_var"]
    with pytest.raises(ValueError, match=r"layer3\.0\.conv2\.bn1\.running_var"):
        convert_gluoncv_resnest(raw, model)


def test_unknown_parameter_is_reported(tiny_a):
    raw, model = tiny_a
    raw["resnest_layers1_conv5_weight"] = np.zeros((1,), np.float32)  # a second block
    raw["resnest_mystery"] = np.zeros((1,), np.float32)
    with pytest.raises(ValueError, match="resnest_layers1_conv5_weight.*resnest_mystery"):
        convert_gluoncv_resnest(raw, model)


def test_other_architecture_is_reported(tiny_a):
    raw, _ = tiny_a
    with pytest.raises(ValueError, match="shape mismatches"):
        convert_gluoncv_resnest(raw, _build("tiny_b"))


def test_other_class_count_passes_the_classifier_through(tiny_a):
    # get_model(..., num_classes=5, pretrained="gluoncv") converts for a 5-class model, then
    # loads everything but the classifier.
    raw, _ = tiny_a
    model = ResNeSt([1, 1, 1, 1], num_classes=5, bottleneck_width=8, stem_width=8)
    state = convert_gluoncv_resnest(raw, model)
    assert state["fc.weight"].shape == (10, 2048)
    with pytest.raises(RuntimeError, match="size mismatch for fc.weight"):
        model.load_state_dict(state, strict=True)
    state = {k: v for k, v in state.items() if not k.startswith("fc.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert sorted(missing) == ["fc.bias", "fc.weight"] and not unexpected


def test_mixed_prefixes_are_reported(tiny_a):
    raw, model = tiny_a
    raw["other_conv0_weight"] = raw.pop("resnest_conv0_weight")
    with pytest.raises(ValueError, match="prefixes"):
        convert_gluoncv_resnest(raw, model)
