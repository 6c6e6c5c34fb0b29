"""Backbones: a classification model's intermediate feature maps, for detection and segmentation.

``get_model(name, features_only=True, out_indices=(1, 2, 3, 4))`` returns a
:class:`FeatureListNet`: the stem and stages of the classification model, without its global
pool and classifier, whose forward returns the list of selected feature maps. Its
``feature_info`` (:class:`FeatureInfo`) says the channels, the reduction (input side / map
side) and the module name of each output, as timm's ``features_only`` models do.

The modules are the classification model's own (same names, same parameters), so published
weights load into the full model strictly and the backbone keeps everything but the head;
the stages after the last selected one are dropped as well, so every parameter of the
backbone receives a gradient (DDP without ``find_unused_parameters``).

Example:
    >>> import torch, modelzoo
    >>> net = modelzoo.get_model("resnest14", features_only=True, out_indices=(1, 2, 3, 4))
    >>> [f.shape[1] for f in net(torch.randn(2, 3, 64, 64))]
    [256, 512, 1024, 2048]
    >>> net.feature_info.reduction()
    [4, 8, 16, 32]
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .family import FeatureSpec, ModelFamily, list_families

__all__ = ["FeatureInfo", "FeatureListNet", "backbone_families", "create_features", "feature_spec"]


def backbone_families() -> list[ModelFamily]:
    """The registered families whose models can be backbones (they declare ``features``)."""
    return [f for f in list_families() if f.features is not None]


def feature_spec(model: nn.Module | type, owner: str) -> tuple[ModelFamily, FeatureSpec]:
    """The family of ``model`` (or of a model class) and its backbone split.

    Raises:
        ValueError: ``model`` is of no family with feature-map stages; the message names those
            that have them.
    """
    from .family import find_family

    family = find_family(model)
    if family is None or family.features is None:
        cls = model if isinstance(model, type) else type(model)
        names = ", ".join(f.name for f in backbone_families())
        raise ValueError(
            f"{owner}: {cls.__qualname__} is not a backbone model (it has no feature-map "
            f"stages); the families that can be backbones: {names}"
        )
    return family, family.features


class FeatureInfo:
    """Channels, reduction and module name of each output of a features module (timm's API).

    Entry ``i`` describes output ``i``: a dict with ``num_chs`` (channels), ``reduction``
    (input side / feature-map side), ``module`` (the name of the module whose output it is,
    the same in the classification model) and ``index`` (the family's feature index, as
    given in ``out_indices``). Unlike timm, where ``feature_info[i]`` indexes every stage of
    the network, entries here follow the outputs, in the order of ``out_indices``.

    Args:
        stages: One entry per feature index of the family (``num_chs``, ``reduction``,
            ``module``).
        out_indices: The selected feature indices, in output order.
    """

    def __init__(self, stages: Sequence[Mapping[str, Any]], out_indices: Sequence[int]) -> None:
        self.stages = tuple(dict(stage, index=i) for i, stage in enumerate(stages))
        self.out_indices = tuple(out_indices)
        self.info = [self.stages[i] for i in self.out_indices]

    def get(self, key: str, idx: int | Sequence[int] | None = None) -> Any:
        """Field ``key`` of every output (``idx=None``), of output ``idx`` or of several."""
        if idx is None:
            return [entry[key] for entry in self.info]
        if isinstance(idx, int):
            return self.info[idx][key]
        return [self.info[i][key] for i in idx]

    def get_dicts(
        self, keys: Sequence[str] | None = None, idx: int | Sequence[int] | None = None
    ) -> Any:
        """The entries (copies) of every output, of output ``idx`` or of several, optionally
        restricted to ``keys``."""

        def pick(entry: dict[str, Any]) -> dict[str, Any]:
            return dict(entry) if keys is None else {k: entry[k] for k in keys}

        if idx is None:
            return [pick(entry) for entry in self.info]
        if isinstance(idx, int):
            return pick(self.info[idx])
        return [pick(self.info[i]) for i in idx]

    def channels(self, idx: int | Sequence[int] | None = None) -> Any:
        """Channels of the outputs (a list), or of output ``idx``."""
        return self.get("num_chs", idx)

    def reduction(self, idx: int | Sequence[int] | None = None) -> Any:
        """Reductions (input side / map side) of the outputs, or of output ``idx``."""
        return self.get("reduction", idx)

    def module_name(self, idx: int | Sequence[int] | None = None) -> Any:
        """Names of the modules producing the outputs, or that of output ``idx``."""
        return self.get("module", idx)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        return dict(self.info[idx])

    def __len__(self) -> int:
        return len(self.info)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (dict(entry) for entry in self.info)

    def __repr__(self) -> str:
        return f"FeatureInfo({self.info})"


class FeatureListNet(nn.Module):
    """The stem and stages of a classification model; forward returns selected feature maps.

    Holds the model's own modules under their own names (so its state dict is the model's
    minus the head and the unused stages) up to the last selected feature index.

    Args:
        model: A classification model of a registered family with ``features``
            (:mod:`modelzoo.family`).
        out_indices: Feature indices to return, in this order (``None``: all).

    Shape:
        Input ``(B, C, H, W)``; output ``i`` is
        ``(B, feature_info.channels(i), ceil(H / r), ceil(W / r))`` with
        ``r = feature_info.reduction(i)``.
    """

    def __init__(self, model: nn.Module, out_indices: Sequence[int] | None = None) -> None:
        super().__init__()
        family, spec = feature_spec(model, "FeatureListNet")
        indices = spec.check_out_indices(out_indices, f"FeatureListNet({family.name})")
        channels = spec.channels(model)
        stages = [
            {"num_chs": c, "reduction": r, "module": m}
            for c, r, m in zip(channels, spec.reductions, spec.modules, strict=True)
        ]
        self.feature_info = FeatureInfo(stages, indices)
        self.model_family = family  # export and the planner ask the backbone's family
        last = spec.sequence.index(spec.modules[max(indices)])
        for child in spec.sequence[: last + 1]:
            self.add_module(child, getattr(model, child))
        # child name -> the feature indices it produces (a module may serve several)
        self._taps: dict[str, list[int]] = {}
        for i in indices:
            self._taps.setdefault(spec.modules[i], []).append(i)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        found: dict[int, torch.Tensor] = {}
        for name, module in self.named_children():
            x = module(x)
            for i in self._taps.get(name, ()):
                found[i] = x
        return [found[i] for i in self.feature_info.out_indices]


def create_features(model: nn.Module, out_indices: Sequence[int] | None = None) -> FeatureListNet:
    """A :class:`FeatureListNet` over ``model``'s modules (shared, not copied).

    Use it on a model at hand (fine-tuned, converted); ``get_model(..., features_only=True)``
    builds one from the registry.
    """
    return FeatureListNet(model, out_indices)
