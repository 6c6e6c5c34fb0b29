"""The forward pass and classifier every ResNet-shaped classifier of the zoo shares.

A ResNet-shaped network (ResNet v1b/v1d, ResNeSt) is a stem (``conv1``, ``bn1``, ``relu``,
``maxpool``), four stages (``layer1`` to ``layer4``), global average pooling (``avgpool``),
dropout (``drop``) and a linear classifier (``fc``) on ``num_features`` channels. Each model
builds those modules; :class:`ResNetTrunk` runs them in that order and owns the classifier
(timm's ``forward_features``/``get_classifier``/``reset_classifier``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["ResNetTrunk"]


class ResNetTrunk(nn.Module):
    """Base class of the ResNet-shaped classifiers (see the module docstring); subclasses
    set ``num_classes`` and ``num_features`` (the classifier's input channels)."""

    def _build_stem(self, in_chans: int, *, deep_stem: bool, stem_width: int) -> None:
        """``conv1`` (a 7x7 convolution, or with ``deep_stem`` three 3x3 ones ending at
        ``2 x stem_width`` channels), ``bn1``, ``relu``, ``maxpool``; sets ``inplanes``."""
        if deep_stem:
            self.conv1: nn.Module = nn.Sequential(
                nn.Conv2d(in_chans, stem_width, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(stem_width),
                nn.ReLU(inplace=True),
                nn.Conv2d(stem_width, stem_width, 3, stride=1, padding=1, bias=False),
                nn.BatchNorm2d(stem_width),
                nn.ReLU(inplace=True),
                nn.Conv2d(stem_width, stem_width * 2, 3, stride=1, padding=1, bias=False),
            )
            self.inplanes = stem_width * 2
        else:
            self.conv1 = nn.Conv2d(in_chans, 64, 7, stride=2, padding=3, bias=False)
            self.inplanes = 64
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)

    def reset_parameters(self) -> None:
        """The initialization of the official ResNeSt, torchvision and timm: conv weights
        He-normal with fan-out, N(0, 2 / (k * k * out_channels)), conv biases 0, BN gamma 1 and
        beta 0 (gamma 0 on each block's last BN, ``bn3``, where the block has ``last_gamma``),
        PyTorch's default for the classifier."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                fan_out = module.kernel_size[0] * module.kernel_size[1] * module.out_channels
                nn.init.normal_(module.weight, 0.0, math.sqrt(2.0 / fan_out))
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                module.reset_parameters()
        for module in self.modules():
            last = getattr(module, "bn3", None)
            if isinstance(last, nn.BatchNorm2d) and getattr(module, "last_gamma", False):
                nn.init.zeros_(last.weight)

    def get_classifier(self) -> nn.Module:
        return self.fc

    def reset_classifier(self, num_classes: int) -> None:
        """Replaces the classifier with a freshly initialized one (GluonCV's ``reset_class``)."""
        self.num_classes = num_classes
        self.fc = nn.Linear(self.num_features, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)  # (B, C, H / 2, W / 2)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)  # (B, C, H / 4, W / 4)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)  # (B, num_features, H / 32, W / 32)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(x)
        x = self.avgpool(x).flatten(1)  # (B, num_features)
        x = self.drop(x)
        return self.fc(x)
