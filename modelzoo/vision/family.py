"""The family protocol for the zoo's ResNet-shaped image classifiers (ResNeSt, ResNet v1b/v1d).

A model of this shape has a stem (``conv1``, ``bn1``, ``relu``, ``maxpool``; ``conv1`` may be
a deep stem), four stages ``layer1``-``layer4`` of bottleneck blocks whose last BN is
``bn3``, and a head ``avgpool`` -> ``drop`` -> ``fc``. :class:`ResNetShapedFamily` answers
the protocol (:mod:`modelzoo.family`) from that shape alone; a family of this shape is a
subclass naming its classes (see the bottom of ``resnest.py`` and ``resnet.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..family import FeatureSpec, Modality, ModelFamily, register_modality

__all__ = ["ImageModality", "ResNetShapedFamily"]

_STEM = ("conv1", "bn1", "relu", "maxpool")
_STAGES = ("layer1", "layer2", "layer3", "layer4")


class ImageModality(Modality):
    """Images: the evaluation transform ``train_imagenet.py`` evaluates with
    (:func:`modelzoo.vision.transforms.eval_transforms`), from ``input_size``, ``crop_ratio``,
    ``mean`` and ``std`` (in [0, 1] units)."""

    name = "image"
    required_options = ("input_size", "crop_ratio", "mean", "std")

    def transforms(self, options: dict[str, Any], owner: str) -> Any:
        from .transforms import eval_transforms

        return eval_transforms(
            int(options["input_size"]),
            crop_ratio=float(options["crop_ratio"]),
            mean=tuple(255.0 * m for m in options["mean"]),
            std=tuple(255.0 * s for s in options["std"]),
        )


register_modality(ImageModality())


def _channels(model: nn.Module) -> list[int]:
    stages = [getattr(model, name) for name in _STAGES]
    return [model.bn1.num_features, *(stage[-1].bn3.num_features for stage in stages)]


def _in_chans(model: nn.Module) -> int:
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return 3 if conv is None else conv.in_channels


class _Head(nn.Module):
    """Global average pool, dropout and classifier: the last pipeline block."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.avgpool, self.drop, self.fc = model.avgpool, model.drop, model.fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.avgpool(x).flatten(1)))


class ResNetShapedFamily(ModelFamily):
    """The protocol's answers for a ResNet-shaped classifier (and its backbones)."""

    modality = "image"
    # The stem's convolution has stride 2 and its max pool another 2, layer1 keeps the side
    # and layers 2-4 halve it (no dilated variants here).
    features = FeatureSpec(
        sequence=(*_STEM, *_STAGES),
        modules=("relu", *_STAGES),
        reductions=(2, 4, 8, 16, 32),
        channels=_channels,
        notes=("stem", *_STAGES),
    )

    def example_inputs(
        self,
        model: nn.Module,
        *,
        batch_size: int,
        generator: torch.Generator,
        image_size: int = 224,
        **sizes: Any,
    ) -> tuple[Any, ...]:
        x = torch.randn(batch_size, _in_chans(model), image_size, image_size, generator=generator)
        return (x,)

    def inputs_like(self, model: nn.Module, inputs: tuple[Any, ...]) -> dict[str, Any]:
        first = inputs[0]
        return {"batch_size": first.shape[0] + 1, "image_size": first.shape[-1]}

    def pipeline_blocks(self, model: nn.Module) -> list[nn.Module]:
        blocks: list[nn.Module] = [nn.Sequential(*(getattr(model, name) for name in _STEM))]
        for name in _STAGES:
            blocks += list(getattr(model, name))
        blocks.append(_Head(model))
        return blocks

    def pipeline_block_names(self, model: nn.Module, count: int) -> list[str]:
        names = ["stem"]
        for stage in _STAGES:
            names += [f"{stage}.{i}" for i in range(len(getattr(model, stage)))]
        return [*names, "head"]

    def profile_inputs(
        self,
        model: nn.Module,
        batch: int,
        *,
        seq_len: int | None,
        image_size: int | None,
        generator: torch.Generator,
        owner: str,
    ) -> tuple[torch.Tensor, ...]:
        if image_size is None:
            raise ValueError(f"{owner}: an image model needs the image size (--image-size)")
        return (torch.randn(batch, 3, image_size, image_size, generator=generator),)
