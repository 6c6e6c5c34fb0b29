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

import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..registry import ModelEntry, list_models
from ..registry import get_model_entry as _entry
from .resnest import ResNeSt

__all__ = [
    "FeatureFamily",
    "FeatureInfo",
    "FeatureListNet",
    "create_features",
    "feature_family",
    "list_feature_families",
    "register_feature_family",
]


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


@dataclass(frozen=True)
class FeatureFamily:
    """How a family's classification model splits into a backbone.

    Attributes:
        name: The family's name in messages (``"ResNeSt"``).
        model_class: The classification model class (subclasses belong to the family).
        sequence: Top-level children of the model in the order its forward runs them, from
            the input to the last stage (everything after it, pool and classifier, is left out).
        modules: For each feature index, the child of ``sequence`` whose output it is.
        reductions: For each feature index, input side / feature-map side.
        channels: ``channels(model)`` gives each feature index's channels for one instance.
        notes: For each feature index, a short description for docs and errors.
    """

    name: str
    model_class: type[nn.Module]
    sequence: tuple[str, ...]
    modules: tuple[str, ...]
    reductions: tuple[int, ...]
    channels: Callable[[nn.Module], list[int]]
    notes: tuple[str, ...]

    def __post_init__(self) -> None:
        counts = {len(self.modules), len(self.reductions), len(self.notes)}
        if len(counts) != 1:
            raise ValueError(
                f"FeatureFamily({self.name!r}): modules, reductions and notes need one entry "
                f"per feature index, got {len(self.modules)}, {len(self.reductions)} and "
                f"{len(self.notes)}"
            )
        missing = [m for m in self.modules if m not in self.sequence]
        if missing:
            raise ValueError(
                f"FeatureFamily({self.name!r}): modules {missing} are not in sequence "
                f"{self.sequence}"
            )

    @property
    def num_features(self) -> int:
        return len(self.modules)

    def describe(self) -> str:
        """``"0: stem (reduction 2), 1: layer1 (reduction 4), ..."``."""
        return ", ".join(
            f"{i}: {note} (reduction {r})"
            for i, (note, r) in enumerate(zip(self.notes, self.reductions, strict=True))
        )

    def check_out_indices(self, out_indices: Sequence[int] | None, owner: str) -> tuple[int, ...]:
        """``out_indices`` as a tuple (``None``: every feature index, like timm).

        Raises:
            ValueError: Not a non-empty sequence of distinct integers in the valid range.
        """
        last = self.num_features - 1
        if out_indices is None:
            return tuple(range(self.num_features))
        valid = (
            isinstance(out_indices, (tuple, list))
            and len(out_indices) > 0
            and all(isinstance(i, int) and not isinstance(i, bool) for i in out_indices)
            and all(0 <= i <= last for i in out_indices)
            and len(set(out_indices)) == len(out_indices)
        )
        if not valid:
            raise ValueError(
                f"{owner}: out_indices must be a non-empty tuple of distinct integers in "
                f"0..{last} ({self.describe()}), got {out_indices!r}"
            )
        return tuple(out_indices)


_FAMILIES: list[FeatureFamily] = []


def register_feature_family(family: FeatureFamily) -> FeatureFamily:
    """Makes ``features_only=True`` work for every model of ``family.model_class``.

    Raises:
        ValueError: The class already belongs to a registered family.
    """
    for known in _FAMILIES:
        if known.model_class is family.model_class:
            raise ValueError(
                f"register_feature_family: {family.model_class.__qualname__} is already "
                f"registered as the {known.name!r} family"
            )
    _FAMILIES.append(family)
    return family


def list_feature_families() -> list[FeatureFamily]:
    """The registered feature families."""
    return list(_FAMILIES)


def _family_of_class(cls: type) -> FeatureFamily | None:
    for family in _FAMILIES:
        if issubclass(cls, family.model_class):
            return family
    return None


def _declared_class(entry: ModelEntry) -> type | None:
    """The class the builder's return annotation names, or ``None`` when it names none."""
    try:
        declared = typing.get_type_hints(entry.builder).get("return")
    except (NameError, TypeError):  # an annotation that does not resolve decides nothing
        return None
    return declared if isinstance(declared, type) else None


def _family_models(family: FeatureFamily) -> list[str]:
    """Registered models whose builders declare a class of ``family``."""
    names = []
    for name in list_models():
        declared = _declared_class(_entry(name))
        if declared is not None and issubclass(declared, family.model_class):
            names.append(name)
    return names


def feature_family(name: str, **overrides: Any) -> FeatureFamily:
    """The feature family of registered model ``name``.

    Decided from the builder's return annotation; a builder that declares only a base class
    (``nn.Module``) is built once on the ``meta`` device to see what it returns.

    Raises:
        ValueError: The model cannot be a backbone; the message names the families (and their
            models) that can.
    """
    entry = _entry(name)
    declared = _declared_class(entry)
    family = _family_of_class(declared) if declared is not None else None
    undecided = declared is None or any(issubclass(f.model_class, declared) for f in _FAMILIES)
    if family is None and undecided:
        with torch.device("meta"):
            family = _family_of_class(type(entry.builder(**overrides)))
    if family is not None:
        return family
    supported = "; ".join(
        f"{f.name} ({', '.join(_family_models(f)) or 'no registered models'})" for f in _FAMILIES
    )
    raise ValueError(
        f"get_model({entry.name!r}, features_only=True): {entry.name!r} is not a backbone "
        f"model (it has no feature-map stages); the families that support "
        f"features_only=True: {supported}"
    )


class FeatureListNet(nn.Module):
    """The stem and stages of a classification model; forward returns selected feature maps.

    Holds the model's own modules under their own names (so its state dict is the model's
    minus the head and the unused stages) up to the last selected feature index.

    Args:
        model: A classification model of a registered :class:`FeatureFamily`.
        out_indices: Feature indices to return, in this order (``None``: all).

    Shape:
        Input ``(B, C, H, W)``; output ``i`` is
        ``(B, feature_info.channels(i), ceil(H / r), ceil(W / r))`` with
        ``r = feature_info.reduction(i)``.
    """

    def __init__(self, model: nn.Module, out_indices: Sequence[int] | None = None) -> None:
        super().__init__()
        family = _family_of_class(type(model))
        if family is None:
            names = ", ".join(f.model_class.__qualname__ for f in _FAMILIES)
            raise ValueError(
                f"FeatureListNet: model must be an instance of a feature family's class "
                f"({names}), got {type(model).__qualname__}"
            )
        indices = family.check_out_indices(out_indices, f"FeatureListNet({family.name})")
        channels = family.channels(model)
        stages = [
            {"num_chs": c, "reduction": r, "module": m}
            for c, r, m in zip(channels, family.reductions, family.modules, strict=True)
        ]
        self.feature_info = FeatureInfo(stages, indices)
        last = family.sequence.index(family.modules[max(indices)])
        for child in family.sequence[: last + 1]:
            self.add_module(child, getattr(model, child))
        # child name -> the feature indices it produces (a module may serve several)
        self._taps: dict[str, list[int]] = {}
        for i in indices:
            self._taps.setdefault(family.modules[i], []).append(i)

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


def _resnest_channels(model: nn.Module) -> list[int]:
    stages = [model.layer1, model.layer2, model.layer3, model.layer4]
    return [model.bn1.num_features, *(stage[-1].bn3.num_features for stage in stages)]


# The stem's 3x3 (or 7x7) convolution has stride 2 and its max pool another 2, layer1 keeps
# the side and layers 2-4 halve it (ResNeSt has no dilated variants here).
register_feature_family(
    FeatureFamily(
        name="ResNeSt",
        model_class=ResNeSt,
        sequence=("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"),
        modules=("relu", "layer1", "layer2", "layer3", "layer4"),
        reductions=(2, 4, 8, 16, 32),
        channels=_resnest_channels,
        notes=("stem", "layer1", "layer2", "layer3", "layer4"),
    )
)
