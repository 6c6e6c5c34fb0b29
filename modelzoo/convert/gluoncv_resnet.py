"""GluonCV ResNetV1b parameters -> our ResNet v1b/v1d state dict (torchvision/timm names).

GluonCV publishes ``resnet{50,101,152}_v1{b,d}-{sha1[:8]}.params``. Depending on how a file
was saved its names are either Gluon's flat, creation-order names (``collect_params().save``;
with the network's prefix ``resnetv1b_`` / ``resnetv1d_``, or without it from the old
``save_params``) or structural module paths (``save_parameters``). The flat rules below are
derived from how ``gluoncv.model_zoo.resnetv1b.ResNetV1b`` builds the network: its bottlenecks
create their children without a name scope of their own, so a stage's counters run across all
of its blocks (three convolutions and three BatchNorms a block), and the deep stem's layers
are created in the network's own scope:

==========================================  ==============================================
GluonCV flat name (after the prefix)        ours
==========================================  ==============================================
``conv0``, ``batchnorm0`` (7x7 stem)        ``conv1``, ``bn1``
``conv0`` / ``conv1`` / ``conv2``           ``conv1.0`` / ``conv1.3`` / ``conv1.6`` (deep stem)
``batchnorm0`` / ``batchnorm1``             ``conv1.1`` / ``conv1.4``
``batchnorm2``                              ``bn1`` (deep stem)
``layers{i}_conv{3j+r}``                    ``layer{i}.{j}.conv{r+1}``
``layers{i}_batchnorm{3j+r}``               ``layer{i}.{j}.bn{r+1}``
``down{i}_conv0`` / ``down{i}_batchnorm0``  ``layer{i}.0.downsample.1`` / ``.2`` (avg_down;
                                            ``.0`` / ``.1`` without it)
``dense0``                                  ``fc``
==========================================  ==============================================

Structural names are ours already (GluonCV's ``ResNetV1b`` and torchvision's ResNet share their
attribute names, and v1d's shortcut pool is child 0 in both), except that BatchNorm's
``gamma`` / ``beta`` are our ``weight`` / ``bias``; ``weight``, ``bias``, ``running_mean`` and
``running_var`` keep their names. Array layouts are the same in both frameworks (conv
``(out, in, kh, kw)``, dense ``(out, in)``), so values are copied unchanged. BatchNorm's
``num_batches_tracked`` buffers, which MXNet does not have, are set to 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from ._gluon import assemble_state_dict, map_resnet_names

__all__ = ["convert_gluoncv_resnet", "gluoncv_resnet_key_map"]

_FLAT = re.compile(
    r"^(?P<prefix>.*?)(?:(?P<scope>layers|down)(?P<stage>\d+)_)?"
    r"(?P<kind>conv|batchnorm|dense)(?P<index>\d+)_"
    r"(?P<param>weight|bias|gamma|beta|running_mean|running_var)$"
)
_PARAM = {
    "weight": "weight",
    "bias": "bias",
    "gamma": "weight",
    "beta": "bias",
    "running_mean": "running_mean",
    "running_var": "running_var",
}
_PER_BLOCK = 3  # convolutions (and BatchNorms) in a bottleneck
_DEEP_STEM = {
    ("conv", 0): "conv1.0",
    ("batchnorm", 0): "conv1.1",
    ("conv", 1): "conv1.3",
    ("batchnorm", 1): "conv1.4",
    ("conv", 2): "conv1.6",
    ("batchnorm", 2): "bn1",
}
_STEM = {("conv", 0): "conv1", ("batchnorm", 0): "bn1"}


def _flat_target(match: re.Match[str], deep_stem: bool, avg_down: bool) -> str | None:
    scope, kind, index = match["scope"], match["kind"], int(match["index"])
    param = _PARAM[match["param"]]
    if scope == "layers":
        if kind == "dense":
            return None
        block, role = divmod(index, _PER_BLOCK)
        module = "conv" if kind == "conv" else "bn"
        return f"layer{match['stage']}.{block}.{module}{role + 1}.{param}"
    if scope == "down":
        if index != 0 or kind == "dense":
            return None
        position = (1 if avg_down else 0) + (kind == "batchnorm")
        return f"layer{match['stage']}.0.downsample.{position}.{param}"
    if kind == "dense":
        return f"fc.{param}" if index == 0 else None
    module = (_DEEP_STEM if deep_stem else _STEM).get((kind, index))
    return f"{module}.{param}" if module else None


def _structural_target(name: str) -> str:
    module, _, param = name.rpartition(".")
    return f"{module}.{_PARAM.get(param, param)}"


def gluoncv_resnet_key_map(
    names: list[str], target_keys: list[str] | Mapping[str, object]
) -> dict[str, str | None]:
    """Maps each GluonCV ResNetV1b parameter name to our key (``None`` where no rule applies).

    Args:
        names: GluonCV names, flat (``resnetv1b_layers1_conv0_weight``, with or without the
            prefix) or structural (``layer1.0.conv1.weight``).
        target_keys: Our model's state-dict keys; they tell the deep stem (v1d) and
            average-pool shortcuts apart.

    Raises:
        ValueError: Flat names that do not share one prefix.
    """
    return map_resnet_names(
        names, target_keys, flat=_FLAT, flat_target=_flat_target,
        structural_target=_structural_target, what="ResNet", prefix_example="resnetv1b_",
    )  # fmt: skip


def convert_gluoncv_resnet(
    params: Mapping[str, np.ndarray], model: nn.Module, *, classifier: str = "fc"
) -> dict[str, torch.Tensor]:
    """Converts GluonCV ResNetV1b parameters into a state dict for ``model``.

    Args:
        params: GluonCV name -> array, e.g. from
            :func:`modelzoo.convert.mxnet.load_mxnet_params`.
        model: The target :class:`modelzoo.vision.resnet.ResNetV1b` (any device, including
            ``meta``); it supplies the keys, their order and shapes.
        classifier: The classifier module's name. Its tensors may differ in shape from the
            model's (a model built for another number of classes): they are passed through with
            the file's shape, for the caller to drop (as ``get_model(..., num_classes=...)``
            does); a strict ``load_state_dict`` then reports the size mismatch.

    Returns:
        A state dict in ``model.state_dict()`` key order, ready for
        ``model.load_state_dict(state, strict=True)``.

    Raises:
        ValueError: Names no rule maps, names mapped twice, model keys left without a value, or
            shapes that disagree; every offending name is listed (the weights are for another
            architecture, e.g. another depth, or v1b weights for a v1d model).

    Example:
        >>> from modelzoo.convert.mxnet import load_mxnet_params
        >>> model = get_model("resnet50_v1d")  # doctest: +SKIP
        >>> state = convert_gluoncv_resnet(load_mxnet_params(path), model)  # doctest: +SKIP
        >>> model.load_state_dict(state)  # doctest: +SKIP
    """
    key_map = gluoncv_resnet_key_map(list(params), model.state_dict())
    return assemble_state_dict(
        params, model, key_map, classifier=classifier, what="GluonCV ResNet parameters",
        hint="Check that the weights are for this variant (depth; v1b: 7x7 stem, v1d: deep "
        "stem and average-pool shortcuts).",
    )  # fmt: skip
