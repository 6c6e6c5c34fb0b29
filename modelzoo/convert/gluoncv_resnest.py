"""GluonCV ResNeSt parameters -> our ResNeSt state dict (official PyTorch ResNeSt names).

GluonCV's published ResNeSt files (``{name}-{sha1[:8]}.params``) were saved with
``collect_params().save()``, so their names are Gluon's flat, creation-order names rather than
module paths. The rules below are derived from how ``gluoncv.model_zoo.resnest`` builds the
network (``name_prefix="resnest_"``; its blocks create their children without a name scope of
their own, so each stage's counters run across all of its blocks):

==========================================  ==============================================
GluonCV name (after the prefix)             ours
==========================================  ==============================================
``conv0`` / ``conv1`` / ``conv2``           ``conv1.0`` / ``conv1.3`` / ``conv1.6`` (deep stem)
``batchnorm0`` / ``batchnorm1``             ``conv1.1`` / ``conv1.4``
``batchnorm2``                              ``bn1``
``conv0``, ``batchnorm0`` (no deep stem)    ``conv1``, ``bn1``
``layers{i}_conv{5j+0..4}``                 ``layer{i}.{j}.`` ``conv1``, ``conv2.conv``,
                                            ``conv2.fc1``, ``conv2.fc2``, ``conv3``
``layers{i}_batchnorm{4j+0..3}``            ``layer{i}.{j}.`` ``bn1``, ``conv2.bn0``,
                                            ``conv2.bn1``, ``bn3``
``down{i}_conv0`` / ``down{i}_batchnorm0``  ``layer{i}.0.downsample.1`` / ``.2`` (avg_down;
                                            ``.0`` / ``.1`` without it)
``dense0``                                  ``fc``
==========================================  ==============================================

and per parameter ``gamma -> weight``, ``beta -> bias``; ``weight``, ``bias``,
``running_mean`` and ``running_var`` keep their names. Files written by Gluon's newer
``save_parameters`` carry structural names (``layer1.0.conv2.bn.gamma``); those are accepted
too (``conv2.bn`` is our ``conv2.bn0``). Array layouts are the same in both frameworks (conv
``(out, in / groups, kh, kw)``, dense ``(out, in)``), so values are copied unchanged.
BatchNorm's ``num_batches_tracked`` buffers, which MXNet does not have, are set to 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from ._gluon import assemble_state_dict, map_resnet_names

__all__ = ["convert_gluoncv_resnest", "gluoncv_resnest_key_map"]

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
_BLOCK_CONVS = ("conv1", "conv2.conv", "conv2.fc1", "conv2.fc2", "conv3")
_BLOCK_BNS = ("bn1", "conv2.bn0", "conv2.bn1", "bn3")


def _flat_target(match: re.Match[str], deep_stem: bool, avg_down: bool) -> str | None:
    scope, kind, index = match["scope"], match["kind"], int(match["index"])
    param = _PARAM[match["param"]]
    if scope == "layers":
        if kind == "conv":
            block, role = divmod(index, len(_BLOCK_CONVS))
            return f"layer{match['stage']}.{block}.{_BLOCK_CONVS[role]}.{param}"
        if kind == "batchnorm":
            block, role = divmod(index, len(_BLOCK_BNS))
            return f"layer{match['stage']}.{block}.{_BLOCK_BNS[role]}.{param}"
        return None
    if scope == "down":
        if index != 0 or kind == "dense":
            return None
        position = (1 if avg_down else 0) + (kind == "batchnorm")
        return f"layer{match['stage']}.0.downsample.{position}.{param}"
    if kind == "dense":
        return f"fc.{param}" if index == 0 else None
    if deep_stem:
        stem = {("conv", 0): "conv1.0", ("conv", 1): "conv1.3", ("conv", 2): "conv1.6"}
        stem |= {("batchnorm", 0): "conv1.1", ("batchnorm", 1): "conv1.4"}
        stem |= {("batchnorm", 2): "bn1"}
    else:
        stem = {("conv", 0): "conv1", ("batchnorm", 0): "bn1"}
    module = stem.get((kind, index))
    return f"{module}.{param}" if module else None


def _structural_target(name: str) -> str:
    module, _, param = name.rpartition(".")
    module = re.sub(r"(^|\.)conv2\.bn$", r"\1conv2.bn0", module)
    return f"{module}.{_PARAM.get(param, param)}"


def gluoncv_resnest_key_map(
    names: list[str], target_keys: list[str] | Mapping[str, object]
) -> dict[str, str | None]:
    """Maps each GluonCV parameter name to our key (``None`` where no rule applies).

    Args:
        names: GluonCV names, flat (``resnest_layers1_conv0_weight``) or structural
            (``layer1.0.conv1.weight``).
        target_keys: Our model's state-dict keys; they tell deep stem and avg_down apart.

    Raises:
        ValueError: Flat names that do not share one prefix.
    """
    return map_resnet_names(
        names, target_keys, flat=_FLAT, flat_target=_flat_target,
        structural_target=_structural_target, what="ResNeSt", prefix_example="resnest_",
    )  # fmt: skip


def convert_gluoncv_resnest(
    params: Mapping[str, np.ndarray], model: nn.Module, *, classifier: str = "fc"
) -> dict[str, torch.Tensor]:
    """Converts GluonCV ResNeSt parameters into a state dict for ``model``.

    Args:
        params: GluonCV name -> array, e.g. from
            :func:`modelzoo.convert.mxnet.load_mxnet_params`.
        model: The target :class:`modelzoo.vision.resnest.ResNeSt` (any device, including
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
            architecture, e.g. another depth or radix).

    Example:
        >>> from modelzoo.convert.mxnet import load_mxnet_params
        >>> model = get_model("resnest50")  # doctest: +SKIP
        >>> state = convert_gluoncv_resnest(load_mxnet_params(path), model)  # doctest: +SKIP
        >>> model.load_state_dict(state)  # doctest: +SKIP
    """
    key_map = gluoncv_resnest_key_map(list(params), model.state_dict())
    return assemble_state_dict(
        params, model, key_map, classifier=classifier, what="GluonCV ResNeSt parameters",
        hint="Check that the weights are for this variant (depth, radix, cardinality, width).",
    )  # fmt: skip
