"""ResNet v1b and v1d: GluonCV's default ImageNet family.

He et al., "Deep Residual Learning for Image Recognition" (2015),
https://arxiv.org/abs/1512.03385; the variants are those of He et al., "Bag of Tricks for Image
Classification with Convolutional Neural Networks" (2018), https://arxiv.org/abs/1812.01187,
as GluonCV builds them (``gluoncv.model_zoo.resnetv1b.ResNetV1b``):

* **v1b** (ResNet-B, torchvision's ResNet, NVIDIA's "v1.5"): a 7x7 stride-2 stem convolution,
  and the stride of a downsampling bottleneck on its 3x3 convolution, not its first 1x1.
* **v1d** (ResNet-D): v1b with a deep stem (three 3x3 convolutions, widths 32, 32, 64) and
  shortcuts that downsample with a 2x2 average pool before their 1x1 convolution.

Module and parameter names follow torchvision's and timm's ResNet (``conv1``, ``bn1``,
``layer1.0.conv1``, ``layer1.0.downsample.0``, ``fc``; for v1d timm's ``resnet50d``:
``conv1.0/1/3/4/6`` and ``downsample.1/2`` after the pool), so their state dicts load with
``strict=True``; GluonCV's ``.params`` files are converted on load
(:mod:`modelzoo.convert.gluoncv_resnet`).
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
from .trunk import ResNetTrunk

__all__ = ["Bottleneck", "ResNetFamily", "ResNetV1b"]


class Bottleneck(nn.Module):
    """ResNet v1b bottleneck: 1x1 conv, 3x3 conv (strided), 1x1 conv expanding 4x, residual.

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
        last_gamma: bool = False,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.last_gamma = last_gamma
        self.downsample = downsample if downsample is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = self.downsample(x)
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)  # (B, planes, H / stride, W / stride)
        out = self.bn2(out)
        out = self.relu(out)
        out = self.conv3(out)
        out = self.bn3(out)
        out = out + shortcut
        return self.relu(out)


class ResNetV1b(ResNetTrunk):
    """ResNet v1b / v1d image classifier (GluonCV's ``ResNetV1b``).

    Args:
        layers: Bottleneck blocks in each of the four stages (ResNet-50: 3, 4, 6, 3).
        num_classes: Classifier outputs.
        deep_stem: Three 3x3 convolutions instead of one 7x7 (v1c, v1d).
        stem_width: Width of the deep stem's first two convolutions (its output is twice it).
        avg_down: Average-pool then 1x1 conv in strided shortcuts (ResNet-D).
        final_drop: Dropout before the classifier.
        last_gamma: Zero-initialise the last BN gamma of every block (``--last-gamma``).
        in_chans: Input channels.

    Shape:
        Input ``(B, in_chans, H, W)``; output ``(B, num_classes)``.

    Example:
        >>> net = ResNetV1b((1, 1, 1, 1), num_classes=10)
        >>> net(torch.randn(2, 3, 64, 64)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        layers: Sequence[int],
        *,
        num_classes: int = 1000,
        deep_stem: bool = False,
        stem_width: int = 32,
        avg_down: bool = False,
        final_drop: float = 0.0,
        last_gamma: bool = False,
        in_chans: int = 3,
    ) -> None:
        super().__init__()
        if len(layers) != 4 or any(n < 1 for n in layers):
            raise ValueError(
                f"ResNetV1b: layers must be four positive block counts, got {tuple(layers)}"
            )
        if stem_width < 1:
            raise ValueError(f"ResNetV1b: stem_width must be positive, got {stem_width}")
        if not 0.0 <= final_drop < 1.0:
            raise ValueError(f"ResNetV1b: final_drop must be in [0, 1), got {final_drop}")
        self.num_classes = num_classes
        self.avg_down = avg_down
        self.last_gamma = last_gamma
        self._build_stem(in_chans, deep_stem=deep_stem, stem_width=stem_width)
        self.layer1 = self._make_layer(64, layers[0], stride=1)
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(final_drop) if final_drop > 0 else nn.Identity()
        self.num_features = 512 * Bottleneck.expansion
        self.fc = nn.Linear(self.num_features, num_classes)
        self.reset_parameters()

    def _make_layer(self, planes: int, blocks: int, *, stride: int) -> nn.Sequential:
        out_planes = planes * Bottleneck.expansion
        downsample = None
        if stride != 1 or self.inplanes != out_planes:
            if self.avg_down:
                # GluonCV pools with a 1x1 window (the identity) where the stride is 1; timm
                # puts nn.Identity there. Either way the conv and BN are downsample.1 and .2.
                pool = (
                    nn.AvgPool2d(stride, stride, ceil_mode=True, count_include_pad=False)
                    if stride > 1
                    else nn.Identity()
                )
                downsample = nn.Sequential(
                    pool,
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
                last_gamma=self.last_gamma,
            )
        ]
        self.inplanes = out_planes
        for _ in range(1, blocks):
            layers.append(Bottleneck(self.inplanes, planes, last_gamma=self.last_gamma))
        return nn.Sequential(*layers)


# ---------------------------------------------------------------------------------------------
# Published weights
# ---------------------------------------------------------------------------------------------

# GluonCV's model store (gluoncv/model_zoo/model_store.py: '{repo_url}gluon/models/{name}-{sha1
# [:8]}.zip', the .params inside hashed with sha1); the full sha1s are its _model_sha1 table
# (gluoncv 0.10.5.post0), the results its docs/model_zoo/csv_tables/Classifications/ResNet.csv.
_GLUON_BASE = "https://apache-mxnet.s3-accelerate.dualstack.amazonaws.com/gluon/models/"
_GLUON_TABLE = "https://cv.gluon.ai/model_zoo/classification.html"
_GLUON_LOGS = (
    "https://raw.githubusercontent.com/dmlc/web-data/master/gluoncv/logs/classification/imagenet/"
)
_PAPER = "https://arxiv.org/abs/1512.03385"
_TRICKS = "https://arxiv.org/abs/1812.01187"


def _from_gluoncv(raw: dict[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    from ..convert.gluoncv_resnet import convert_gluoncv_resnet

    return convert_gluoncv_resnet(raw, model)


def _gluon(name: str, sha1: str, params: int, top1: float, top5: float, log: str) -> Weights:
    return Weights(
        url=f"{_GLUON_BASE}{name}-{sha1[:8]}.zip",
        archive_member=f"{name}-{sha1[:8]}.params",
        hash_prefix=sha1,
        hash_algo="sha1",
        file_format="params",
        convert=_from_gluoncv,
        num_params=params,
        num_classes=1000,
        metrics={"imagenet_top1": top1, "imagenet_top5": top5},
        source="gluoncv 0.10 model zoo (MXNet), converted on load",
        license="Apache-2.0",
        input_size=224,
        crop_ratio=0.875,
        labels=imagenet_classes(),
        recipe={
            "paper": _TRICKS if "_v1d" in name else _PAPER,
            "command": f"{_GLUON_LOGS}{log}.sh",
            "log": f"{_GLUON_LOGS}{log}.log",
        },
        tags={"results": _GLUON_TABLE},
    )


def _torchvision(
    name: str, url: str, top1: float, top5: float, recipe: str, resize: int
) -> Weights:
    sha = url.rsplit("-", 1)[1].split(".")[0]
    return Weights(
        url=url,
        # torchvision loads these with check_hash=True: the name carries the file's sha256.
        hash_prefix=sha,
        hash_algo="sha256",
        file_format="pth",
        local_name=f"{name}-{sha}.pth",
        num_params=_P50,
        num_classes=1000,
        metrics={"imagenet_top1": top1, "imagenet_top5": top5},
        source="torchvision (pytorch/vision ResNet50_Weights)",
        license="BSD-3-Clause",
        input_size=224,
        # torchvision resizes to `resize` then crops 224; ceil(224 / crop_ratio) == resize.
        crop_ratio={256: 0.875, 232: 0.9656}[resize],
        labels=imagenet_classes(),
        recipe={"paper": _PAPER, "description": recipe},
        tags={"results": "torchvision/models/resnet.py (ResNet50_Weights meta)"},
    )


def _timm(name: str, url: str, params: int, top1: float, top5: float, recipe: str) -> Weights:
    sha = url.rsplit("-", 1)[1].split(".")[0]
    return Weights(
        url=url,
        # timm's clean_checkpoint.py names its published files {base}-{sha256[:8]}.pth.
        hash_prefix=sha,
        hash_algo="sha256",
        file_format="pth",
        local_name=f"{name}-{sha}.pth",
        num_params=params,
        num_classes=1000,
        metrics={"imagenet_top1": top1, "imagenet_top5": top5},
        source="timm (huggingface/pytorch-image-models)",
        license="Apache-2.0",
        input_size=224,
        crop_ratio=0.875,
        labels=imagenet_classes(),
        recipe={"paper": _TRICKS, "description": recipe},
        tags={
            "results": "timm results/results-imagenet.csv at 224, crop 0.875",
            "interpolation": "timm evaluates these with bicubic resizing; the stored transform "
            "resizes bilinearly, which can move top-1 by a few tenths",
        },
    )


def _resnet(layers: Sequence[int], *, v1d: bool, **kwargs: Any) -> ResNetV1b:
    if v1d:
        kwargs = {"deep_stem": True, "stem_width": 32, "avg_down": True, **kwargs}
    return ResNetV1b(layers, **kwargs)


# Trainable parameters at 1000 classes (GluonCV's, torchvision's and timm's counts).
_P50, _P101, _P152 = 25_557_032, 44_549_160, 60_192_808
_P50D, _P101D, _P152D = 25_576_264, 44_568_392, 60_212_040


@register_model(
    weights={
        "gluoncv": _gluon(
            "resnet50_v1b", "0ecdba34691be172036ddf244ff1b2eade75ffde", _P50, 77.67, 93.82,
            "resnet50_v1b",
        ),
        "torchvision": _torchvision(
            "resnet50_v1b", "https://download.pytorch.org/models/resnet50-0676ba61.pth",
            76.130, 92.862,
            "https://github.com/pytorch/vision/tree/main/references/classification#resnet", 256,
        ),
        "torchvision_v2": _torchvision(
            "resnet50_v1b", "https://download.pytorch.org/models/resnet50-11ad3fa6.pth",
            80.858, 95.434,
            "https://github.com/pytorch/vision/issues/3995#issuecomment-1013906621", 232,
        ),
    }
)  # fmt: skip
def resnet50_v1b(*, num_classes: int = 1000, **kwargs: Any) -> ResNetV1b:
    """ResNet-50 v1b: layers 3,4,6,3, 7x7 stem, stride on the 3x3 convolution."""
    return _resnet((3, 4, 6, 3), v1d=False, num_classes=num_classes, **kwargs)


@register_model(
    weights={
        "gluoncv": _gluon(
            "resnet101_v1b", "a455932aa95cb7dcfa05fd040b9b5a5660733c39", _P101, 79.20, 94.61,
            "resnet101_v1b",
        )
    }
)  # fmt: skip
def resnet101_v1b(*, num_classes: int = 1000, **kwargs: Any) -> ResNetV1b:
    """ResNet-101 v1b: layers 3,4,23,3, 7x7 stem, stride on the 3x3 convolution."""
    return _resnet((3, 4, 23, 3), v1d=False, num_classes=num_classes, **kwargs)


@register_model(
    weights={
        "gluoncv": _gluon(
            "resnet152_v1b", "a5a61ee1ce5ab7c09720775b223360f3c60e211d", _P152, 79.69, 94.74,
            "resnet152_v1b",
        )
    }
)  # fmt: skip
def resnet152_v1b(*, num_classes: int = 1000, **kwargs: Any) -> ResNetV1b:
    """ResNet-152 v1b: layers 3,8,36,3, 7x7 stem, stride on the 3x3 convolution."""
    return _resnet((3, 8, 36, 3), v1d=False, num_classes=num_classes, **kwargs)


@register_model(
    weights={
        "gluoncv": _gluon(
            "resnet50_v1d", "117a384ecf61490eb31ea147eb0e61e6d2b8a449", _P50D, 79.15, 94.58,
            "resnet50_v1d-mixup",
        ),
        "timm": _timm(
            "resnet50_v1d",
            "https://github.com/huggingface/pytorch-image-models/releases/download/v0.1-weights/"
            "resnet50d_ra2-464e36ba.pth",
            _P50D, 80.546, 95.160, "timm resnet50d.ra2_in1k (RandAugment 'ra2' recipe)",
        ),
    }
)  # fmt: skip
def resnet50_v1d(*, num_classes: int = 1000, **kwargs: Any) -> ResNetV1b:
    """ResNet-50 v1d: layers 3,4,6,3, deep stem (width 32), average-pool shortcuts."""
    return _resnet((3, 4, 6, 3), v1d=True, num_classes=num_classes, **kwargs)


@register_model(
    weights={
        "gluoncv": _gluon(
            "resnet101_v1d", "1b2b825feff86b0354642a4ab59f9b6e35e47338", _P101D, 80.51, 95.12,
            "resnet101_v1d-mixup",
        )
    }
)  # fmt: skip
def resnet101_v1d(*, num_classes: int = 1000, **kwargs: Any) -> ResNetV1b:
    """ResNet-101 v1d: layers 3,4,23,3, deep stem (width 32), average-pool shortcuts."""
    return _resnet((3, 4, 23, 3), v1d=True, num_classes=num_classes, **kwargs)


@register_model(
    weights={
        "gluoncv": _gluon(
            "resnet152_v1d", "cddbc86ff24a5544f57242ded0acb14ef1fbd437", _P152D, 80.61, 95.34,
            "resnet152_v1d-mixup",
        )
    }
)  # fmt: skip
def resnet152_v1d(*, num_classes: int = 1000, **kwargs: Any) -> ResNetV1b:
    """ResNet-152 v1d: layers 3,8,36,3, deep stem (width 32), average-pool shortcuts."""
    return _resnet((3, 8, 36, 3), v1d=True, num_classes=num_classes, **kwargs)


class ResNetFamily(ResNetShapedFamily):
    """ResNet v1b/v1d's answers to the model-family protocol (:mod:`modelzoo.family`)."""

    name = "ResNet"
    model_classes = (ResNetV1b,)
    classifiers = (ResNetV1b,)


register_family(ResNetFamily())
