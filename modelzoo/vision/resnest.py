"""ResNeSt: split-attention networks.

Zhang et al., "ResNeSt: Split-Attention Networks" (2020), https://arxiv.org/abs/2004.08955.
A ResNet-D (deep stem, average-pool shortcut, AVD strided pooling) whose bottleneck 3x3
convolution is a split-attention convolution (:mod:`modelzoo.vision.splat`).

Module and parameter names follow the official PyTorch release
(github.com/zhanghang1989/ResNeSt), so its ``.pth`` files load with ``strict=True``; the
GluonCV ``.params`` files are converted on load (:mod:`modelzoo.convert.gluoncv_resnest`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..family import register_family
from ..registry import register_model
from ..weights import Weights
from .family import ResNetShapedFamily
from .labels import imagenet_classes
from .splat import DropBlock2d, SplitAttnConv2d
from .trunk import ResNetTrunk

__all__ = ["Bottleneck", "ResNeSt", "ResNeStFamily"]


class Bottleneck(nn.Module):
    """ResNeSt bottleneck: 1x1 conv, split-attention 3x3 conv, 1x1 conv, residual.

    With ``avd`` the stride moves out of the 3x3 convolution into a 3x3 average pool placed
    after it (or before it with ``avd_first``, the paper's "fast" variants).

    Shape:
        Input ``(B, inplanes, H, W)``; output ``(B, planes * 4, H / stride, W / stride)``.
    """

    expansion = 4

    def __init__(
        self,
        inplanes: int,
        planes: int,
        *,
        stride: int = 1,
        downsample: nn.Module | None = None,
        radix: int = 2,
        cardinality: int = 1,
        bottleneck_width: int = 64,
        avd: bool = True,
        avd_first: bool = False,
        is_first: bool = False,
        dropblock_prob: float = 0.0,
        last_gamma: bool = False,
    ) -> None:
        super().__init__()
        group_width = int(planes * (bottleneck_width / 64.0)) * cardinality
        self.conv1 = nn.Conv2d(inplanes, group_width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(group_width)
        self.dropblock1 = _dropblock(dropblock_prob)
        self.relu = nn.ReLU(inplace=True)
        use_avd = avd and (stride > 1 or is_first)
        self.avd_first = avd_first
        pool = nn.AvgPool2d(3, stride, padding=1) if use_avd else nn.Identity()
        self.avd_layer_first = pool if avd_first else nn.Identity()
        self.avd_layer_last = nn.Identity() if avd_first else pool
        self.conv2 = SplitAttnConv2d(
            group_width,
            group_width,
            kernel_size=3,
            stride=1 if use_avd else stride,
            padding=1,
            groups=cardinality,
            radix=radix,
            dropblock_prob=dropblock_prob,
        )
        self.conv3 = nn.Conv2d(group_width, planes * self.expansion, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.last_gamma = last_gamma
        self.dropblock3 = _dropblock(dropblock_prob)
        self.downsample = downsample if downsample is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = self.downsample(x)
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.dropblock1(out)
        out = self.relu(out)
        out = self.avd_layer_first(out)
        out = self.conv2(out)
        out = self.avd_layer_last(out)  # (B, C, H / stride, W / stride)
        out = self.conv3(out)
        out = self.bn3(out)
        out = self.dropblock3(out)
        out = out + shortcut
        return self.relu(out)


def _dropblock(prob: float) -> nn.Module:
    return DropBlock2d(prob, 3) if prob > 0 else nn.Identity()


class ResNeSt(ResNetTrunk):
    """ResNeSt image classifier.

    Args:
        layers: Bottleneck blocks in each of the four stages.
        num_classes: Classifier outputs.
        radix: Splits per cardinal group in split attention.
        cardinality: Cardinal groups.
        bottleneck_width: Width per group at 64 planes.
        stem_width: Width of the deep stem's first two convolutions (output is twice it).
        deep_stem: Three 3x3 convolutions instead of one 7x7.
        avg_down: Average-pool then 1x1 conv in strided shortcuts (ResNet-D).
        avd: Strided 3x3 average pooling instead of a strided 3x3 convolution.
        avd_first: Pool before the split-attention conv (the "fast" variants).
        dropblock_prob: DropBlock probability in stages 3 and 4 (0 disables DropBlock); ramp it
            with :func:`modelzoo.vision.splat.set_dropblock_prob`.
        final_drop: Dropout before the classifier.
        last_gamma: Zero-initialise the last BN gamma of every block (``--last-gamma``).
        in_chans: Input channels.

    Shape:
        Input ``(B, in_chans, H, W)``; output ``(B, num_classes)``.
    """

    def __init__(
        self,
        layers: Sequence[int],
        *,
        num_classes: int = 1000,
        radix: int = 2,
        cardinality: int = 1,
        bottleneck_width: int = 64,
        stem_width: int = 32,
        deep_stem: bool = True,
        avg_down: bool = True,
        avd: bool = True,
        avd_first: bool = False,
        dropblock_prob: float = 0.0,
        final_drop: float = 0.0,
        last_gamma: bool = False,
        in_chans: int = 3,
    ) -> None:
        super().__init__()
        if len(layers) != 4 or any(n < 1 for n in layers):
            raise ValueError(
                f"ResNeSt: layers must be four positive block counts, got {tuple(layers)}"
            )
        if not 0.0 <= dropblock_prob < 1.0:
            raise ValueError(f"ResNeSt: dropblock_prob must be in [0, 1), got {dropblock_prob}")
        if not 0.0 <= final_drop < 1.0:
            raise ValueError(f"ResNeSt: final_drop must be in [0, 1), got {final_drop}")
        self.num_classes = num_classes
        self.block_args = dict(
            radix=radix,
            cardinality=cardinality,
            bottleneck_width=bottleneck_width,
            avd=avd,
            avd_first=avd_first,
            last_gamma=last_gamma,
        )
        self.avg_down = avg_down
        self._build_stem(in_chans, deep_stem=deep_stem, stem_width=stem_width)
        self.layer1 = self._make_layer(64, layers[0], stride=1, is_first=False)
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2, dropblock_prob=dropblock_prob)
        self.layer4 = self._make_layer(512, layers[3], stride=2, dropblock_prob=dropblock_prob)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(final_drop) if final_drop > 0 else nn.Identity()
        self.num_features = 512 * Bottleneck.expansion
        self.fc = nn.Linear(self.num_features, num_classes)
        self.reset_parameters()

    def _make_layer(
        self,
        planes: int,
        blocks: int,
        *,
        stride: int,
        dropblock_prob: float = 0.0,
        is_first: bool = True,
    ) -> nn.Sequential:
        out_planes = planes * Bottleneck.expansion
        downsample = None
        if stride != 1 or self.inplanes != out_planes:
            if self.avg_down:
                downsample = nn.Sequential(
                    nn.AvgPool2d(stride, stride, ceil_mode=True, count_include_pad=False),
                    nn.Conv2d(self.inplanes, out_planes, 1, bias=False),
                    nn.BatchNorm2d(out_planes),
                )
            else:
                downsample = nn.Sequential(
                    nn.Conv2d(self.inplanes, out_planes, 1, stride=stride, bias=False),
                    nn.BatchNorm2d(out_planes),
                )
        layers = [
            Bottleneck(
                self.inplanes,
                planes,
                stride=stride,
                downsample=downsample,
                is_first=is_first,
                dropblock_prob=dropblock_prob,
                **self.block_args,
            )
        ]
        self.inplanes = out_planes
        for _ in range(1, blocks):
            layers.append(
                Bottleneck(self.inplanes, planes, dropblock_prob=dropblock_prob, **self.block_args)
            )
        return nn.Sequential(*layers)


# ---------------------------------------------------------------------------------------------
# Published weights
# ---------------------------------------------------------------------------------------------

_OFFICIAL_BASE = "https://github.com/zhanghang1989/ResNeSt/releases/download/weights_step1/"
_GLUON_BASE = "https://apache-mxnet.s3-accelerate.dualstack.amazonaws.com/gluon/models/"
_PAPER = "https://arxiv.org/abs/2004.08955"
_GLUON_RECIPE = (
    "GluonCV ResNeSt recipe (paper, Table 4 setting): 64 GPUs x 128 images, lr 0.05 per 128 x 64 "
    "(linear scaling), cosine, 5 warm-up epochs, 270 epochs, wd 1e-4 with --no-wd, --last-gamma, "
    "label smoothing 0.1, mixup 0.2, AutoAugment (not implemented here), DropBlock 0.1 ramped"
)


def _from_gluoncv(raw: dict[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    from ..convert.gluoncv_resnest import convert_gluoncv_resnest

    return convert_gluoncv_resnest(raw, model)


def _official(name: str, sha: str, params: int, top1: float, size: int) -> Weights:
    return Weights(
        url=f"{_OFFICIAL_BASE}{name}-{sha}.pth",
        hash_prefix=sha,
        hash_algo="sha256",
        file_format="pth",
        num_params=params,
        num_classes=1000,
        metrics={"imagenet_top1": top1},
        source="official (zhanghang1989/ResNeSt, PyTorch)",
        license="Apache-2.0",
        input_size=size,
        crop_ratio=0.875,
        labels=imagenet_classes(),
        recipe={"paper": _PAPER},
    )


def _gluon(name: str, sha1: str, params: int, top1: float, size: int) -> Weights:
    return Weights(
        url=f"{_GLUON_BASE}{name}-{sha1}.zip",
        archive_member=f"{name}-{sha1}.params",
        hash_prefix=sha1,
        hash_algo="sha1",
        file_format="params",
        convert=_from_gluoncv,
        num_params=params,
        num_classes=1000,
        metrics={"imagenet_top1": top1},
        source="gluoncv 0.10 model zoo (MXNet), converted on load",
        license="Apache-2.0",
        input_size=size,
        crop_ratio=0.875,
        labels=imagenet_classes(),
        recipe={"paper": _PAPER, "description": _GLUON_RECIPE},
    )


def _resnest(layers: Sequence[int], *, stem_width: int, **kwargs: Any) -> ResNeSt:
    defaults = dict(
        radix=2, cardinality=1, bottleneck_width=64, deep_stem=True, avg_down=True, avd=True
    )
    defaults.update(kwargs)
    return ResNeSt(layers, stem_width=stem_width, **defaults)


# Trainable parameters at 1000 classes (resnest50's 27,483,240 is the published count).
_P14, _P26, _P50, _P101 = 10_611_688, 17_069_448, 27_483_240, 48_275_016
_P200, _P269, _P50_4S2X40D = 70_201_544, 110_929_480, 30_417_592


@register_model(weights={"gluoncv": _gluon("resnest14", "7e0b0cae", _P14, 75.75, 224)})
def resnest14(*, num_classes: int = 1000, **kwargs: Any) -> ResNeSt:
    """ResNeSt-14 (GluonCV): layers 1,1,1,1, radix 2, stem width 32."""
    return _resnest((1, 1, 1, 1), stem_width=32, num_classes=num_classes, **kwargs)


@register_model(weights={"gluoncv": _gluon("resnest26", "36459074", _P26, 78.68, 224)})
def resnest26(*, num_classes: int = 1000, **kwargs: Any) -> ResNeSt:
    """ResNeSt-26 (GluonCV): layers 2,2,2,2, radix 2, stem width 32."""
    return _resnest((2, 2, 2, 2), stem_width=32, num_classes=num_classes, **kwargs)


@register_model(
    weights={
        "official": _official("resnest50", "528c19ca", _P50, 81.03, 224),
        "gluoncv": _gluon("resnest50", "bcfefe1d", _P50, 81.04, 224),
    }
)
def resnest50(*, num_classes: int = 1000, **kwargs: Any) -> ResNeSt:
    """ResNeSt-50: layers 3,4,6,3, radix 2, stem width 32."""
    return _resnest((3, 4, 6, 3), stem_width=32, num_classes=num_classes, **kwargs)


@register_model(
    weights={
        "official": _official("resnest101", "22405ba7", _P101, 82.83, 256),
        "gluoncv": _gluon("resnest101", "5da943b3", _P101, 82.81, 256),
    }
)
def resnest101(*, num_classes: int = 1000, **kwargs: Any) -> ResNeSt:
    """ResNeSt-101: layers 3,4,23,3, radix 2, stem width 64."""
    return _resnest((3, 4, 23, 3), stem_width=64, num_classes=num_classes, **kwargs)


@register_model(
    weights={
        "official": _official("resnest200", "75117900", _P200, 83.84, 320),
        "gluoncv": _gluon("resnest200", "0c5d117d", _P200, 83.88, 320),
    }
)
def resnest200(*, num_classes: int = 1000, **kwargs: Any) -> ResNeSt:
    """ResNeSt-200: layers 3,24,36,3, radix 2, stem width 64 (recipe: final_drop=0.2)."""
    return _resnest((3, 24, 36, 3), stem_width=64, num_classes=num_classes, **kwargs)


@register_model(
    weights={
        "official": _official("resnest269", "0cc87c48", _P269, 84.54, 416),
        "gluoncv": _gluon("resnest269", "11ae7f5d", _P269, 84.53, 416),
    }
)
def resnest269(*, num_classes: int = 1000, **kwargs: Any) -> ResNeSt:
    """ResNeSt-269: layers 3,30,48,8, radix 2, stem width 64 (recipe: final_drop=0.2)."""
    return _resnest((3, 30, 48, 8), stem_width=64, num_classes=num_classes, **kwargs)


@register_model(
    weights={"official": _official("resnest50_fast_2s1x64d", "44938639", _P50, 80.53, 224)}
)
def resnest50_fast_2s1x64d(*, num_classes: int = 1000, **kwargs: Any) -> ResNeSt:
    """ResNeSt-50 "fast" ablation 2s1x64d: radix 2, cardinality 1, width 64, avd_first."""
    return _resnest(
        (3, 4, 6, 3), stem_width=32, radix=2, cardinality=1, bottleneck_width=64, avd_first=True,
        num_classes=num_classes, **kwargs,
    )  # fmt: skip


@register_model(
    weights={"official": _official("resnest50_fast_4s2x40d", "41d14ed0", _P50_4S2X40D, 81.14, 224)}
)
def resnest50_fast_4s2x40d(*, num_classes: int = 1000, **kwargs: Any) -> ResNeSt:
    """ResNeSt-50 "fast" ablation 4s2x40d: radix 4, cardinality 2, width 40, avd_first."""
    return _resnest(
        (3, 4, 6, 3), stem_width=32, radix=4, cardinality=2, bottleneck_width=40, avd_first=True,
        num_classes=num_classes, **kwargs,
    )  # fmt: skip


class ResNeStFamily(ResNetShapedFamily):
    """ResNeSt's answers to the model-family protocol (:mod:`modelzoo.family`)."""

    name = "ResNeSt"
    model_classes = (ResNeSt,)
    classifiers = (ResNeSt,)


register_family(ResNeStFamily())
