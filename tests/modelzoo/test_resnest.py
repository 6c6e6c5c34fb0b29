"""ResNeSt against the authors' official PyTorch implementation and the paper's numbers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelzoo
from modelzoo.vision.resnest import ResNeSt
from modelzoo.vision.splat import DropBlock2d, set_dropblock_prob

from ._reference import randomize_batchnorm
from .official_resnest import load_official

# (name, official builder module attribute, published params in millions, 2 decimals)
VARIANTS = [
    ("resnest50", "resnest", 27.48),
    ("resnest101", "resnest", 48.28),
    ("resnest200", "resnest", 70.20),
    ("resnest269", "resnest", 110.93),
    ("resnest50_fast_2s1x64d", "ablation", 27.48),
    ("resnest50_fast_4s2x40d", "ablation", 30.42),
]


def _official_model(name: str, module: str) -> nn.Module:
    resnest, ablation = load_official()
    return getattr(resnest if module == "resnest" else ablation, name)(pretrained=False)


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(("name", "module", "millions"), VARIANTS)
def test_state_dict_layout_equals_official(name, module, millions):
    with torch.device("meta"):
        ours = modelzoo.get_model(name)
        theirs = _official_model(name, module)
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert list(ours_sd) == list(theirs_sd)
    for key, value in theirs_sd.items():
        assert ours_sd[key].shape == value.shape, key
    assert _count(ours) == _count(theirs)
    assert round(_count(ours) / 1e6, 2) == pytest.approx(millions, abs=0.011)


def test_resnest50_has_the_published_parameter_count():
    with torch.device("meta"):
        assert _count(modelzoo.get_model("resnest50")) == 27_483_240


@pytest.mark.parametrize("name", ["resnest50", "resnest50_fast_2s1x64d", "resnest50_fast_4s2x40d"])
def test_official_weights_load_strict_and_give_the_same_logits(name):
    module = "resnest" if name == "resnest50" else "ablation"
    torch.manual_seed(0)
    theirs = randomize_batchnorm(_official_model(name, module).eval())  # eval-mode BN exercised
    ours = modelzoo.get_model(name)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    ours.eval()
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-5)


def test_training_mode_matches_official_gradients():
    torch.manual_seed(1)
    resnest, _ = load_official()
    theirs = resnest.ResNet(
        resnest.Bottleneck, [1, 1, 1, 1], radix=2, groups=2, bottleneck_width=32,
        deep_stem=True, stem_width=16, avg_down=True, avd=True, avd_first=True, num_classes=10,
    )  # fmt: skip
    ours = ResNeSt(
        [1, 1, 1, 1], radix=2, cardinality=2, bottleneck_width=32, stem_width=16,
        avd_first=True, num_classes=10,
    )  # fmt: skip
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(4, 3, 64, 64)
    ours(x).square().sum().backward()
    theirs(x).square().sum().backward()
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_last_gamma_zeroes_each_blocks_last_bn():
    net = modelzoo.get_model("resnest14", last_gamma=True)
    blocks = [m for m in net.modules() if hasattr(m, "bn3")]
    assert len(blocks) == 4
    assert all(torch.count_nonzero(b.bn3.weight) == 0 for b in blocks)
    # so at initialization every block is the identity on its shortcut path
    assert torch.count_nonzero(modelzoo.get_model("resnest14").layer1[0].bn3.weight) > 0


def test_dropblock_is_in_stages_3_and_4_and_ramps():
    net = modelzoo.get_model("resnest14", dropblock_prob=0.1)
    for stage, expected in ((net.layer1, 0), (net.layer2, 0), (net.layer3, 3), (net.layer4, 3)):
        assert sum(isinstance(m, DropBlock2d) for m in stage.modules()) == expected
    assert set_dropblock_prob(net, 0.5) == pytest.approx(0.05)
    assert all(
        m.drop_prob == pytest.approx(0.05) for m in net.modules() if isinstance(m, DropBlock2d)
    )
    with pytest.raises(ValueError, match="fraction"):
        set_dropblock_prob(net, 1.5)


def test_dropblock_statistics():
    torch.manual_seed(0)
    block = DropBlock2d(0.2, block_size=3).train()
    x = torch.ones(64, 8, 24, 24)
    y = block(x)
    dropped = (y == 0).float().mean().item()
    # The paper's gamma makes the expected dropped fraction about drop_prob (blocks overlap,
    # so slightly less); the rescaling keeps the mean activation at 1.
    assert 0.15 < dropped < 0.22
    assert y.mean().item() == pytest.approx(1.0, abs=1e-4)
    mask = (y == 0).float()
    assert mask[0, 0].sum() > 0
    # Dropped positions come in whole 3x3 blocks inside the map.
    assert _covered_by_full_blocks(mask, 3)
    assert block.eval()(x).equal(x)


def _covered_by_full_blocks(mask: torch.Tensor, k: int) -> bool:
    """Whether every 1 of ``mask`` (B, C, H, W) lies in a k x k window inside the map that is
    all 1s: a min-pool marks the full windows (by their top-left corner), a max-pool over the
    windows containing each pixel spreads them back."""
    full = -F.max_pool2d(-mask, k, stride=1)  # (B, C, H - k + 1, W - k + 1)
    covered = F.max_pool2d(F.pad(full, (k - 1,) * 4), k, stride=1)  # (B, C, H, W)
    return bool(torch.all(covered >= mask))


def test_full_block_check_rejects_other_shapes():
    def mask_with(*pixels: tuple[int, int]) -> torch.Tensor:
        m = torch.zeros(1, 1, 8, 8)
        for i, j in pixels:
            m[0, 0, i, j] = 1.0
        return m

    block = [(i, j) for i in range(2, 5) for j in range(3, 6)]
    corner = [(i, j) for i in range(5, 8) for j in range(5, 8)]
    assert _covered_by_full_blocks(mask_with(), 3)
    assert _covered_by_full_blocks(mask_with(*block), 3)
    assert _covered_by_full_blocks(mask_with(*block, *corner), 3)
    assert not _covered_by_full_blocks(mask_with((4, 4)), 3)  # an isolated dropped pixel
    assert not _covered_by_full_blocks(mask_with(*block, (0, 0)), 3)  # a block and a stray one
    assert not _covered_by_full_blocks(mask_with(*block, (5, 4)), 3)  # a block with a bump
    assert not _covered_by_full_blocks(mask_with(*block[:-1]), 3)  # a block missing one
    assert not _covered_by_full_blocks(mask_with((0, 0), (0, 1), (1, 0), (1, 1)), 3)  # 2x2


def test_recipes_name_autoaugment_only_as_not_implemented():
    # The paper's recipe used AutoAugment; our transforms have none, so a recipe that names it
    # must say so.
    names = modelzoo.list_models("resnest*", pretrained=True)
    assert names
    for name in names:
        for tag, weights in modelzoo.registry.get_model_entry(name).weights.items():
            text = str((weights.recipe or {}).get("description", ""))
            mentions = text.count("AutoAugment")
            assert mentions == text.count("AutoAugment (not implemented here)"), (name, tag, text)


def test_bad_options_have_clear_errors():
    with pytest.raises(ValueError, match="layers"):
        ResNeSt([3, 4, 6])
    with pytest.raises(ValueError, match="dropblock_prob"):
        ResNeSt([1, 1, 1, 1], dropblock_prob=1.5)
    with pytest.raises(ValueError, match="cardinality"):
        ResNeSt([1, 1, 1, 1], cardinality=3, bottleneck_width=10)
