"""The forward pass and classifier every ResNet-shaped classifier of the zoo shares.

A ResNet-shaped network (ResNet v1b/v1d, ResNeSt) is a stem (``conv1``, ``bn1``, ``relu``,
``maxpool``), four stages (``layer1`` to ``layer4``), global average pooling (``avgpool``),
dropout (``drop``) and a linear classifier (``fc``) on ``num_features`` channels. Each model
builds those modules; :class:`ResNetTrunk` runs them in that order and owns the classifier
(timm's ``forward_features``/``get_classifier``/``reset_classifier``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ResNetTrunk"]


class ResNetTrunk(nn.Module):
    """Base class of the ResNet-shaped classifiers (see the module docstring)."""

    num_classes: int
    num_features: int

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
