"""The model registry: name -> builder and its published weights.

Builders register themselves with :func:`register_model` next to their definition; the
registry is the single source for :func:`list_models`, the docs tables and the
parametrized tests. Names are case-insensitive; registering a name twice raises.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from torch import nn

from ._lookup import unknown_name
from .weights import Weights

__all__ = [
    "ModelEntry",
    "fetch_weights",
    "get_model",
    "get_model_entry",
    "get_weights",
    "list_models",
    "load_pretrained",
    "register_model",
]

Builder = TypeVar("Builder", bound=Callable[..., nn.Module])


@dataclass(frozen=True)
class ModelEntry:
    """A registered model: its builder, its weights by tag and the default tag."""

    name: str
    builder: Callable[..., nn.Module]
    weights: Mapping[str, Weights]
    default_tag: str | None


_REGISTRY: dict[str, ModelEntry] = {}


def register_model(
    fn: Builder | None = None,
    *,
    name: str | None = None,
    weights: Mapping[str, Weights] | None = None,
    default_tag: str | None = None,
) -> Any:
    """Registers a model builder under its function name (or ``name``).

    Usable bare (``@register_model``) or with arguments
    (``@register_model(weights={"official": Weights(...)})``). The first weights tag is the
    default unless ``default_tag`` names another.

    Raises:
        ValueError: The name is already registered, or ``default_tag`` is not a weights tag.
    """

    def decorator(builder: Builder) -> Builder:
        key = (name or builder.__name__).lower()
        if key in _REGISTRY:
            existing = _REGISTRY[key].builder
            raise ValueError(
                f"register_model: model name {key!r} is already registered by "
                f"{existing.__module__}.{existing.__qualname__}; pick another name"
            )
        tags = dict(weights or {})
        tag = default_tag if default_tag is not None else next(iter(tags), None)
        if tag is not None and tag not in tags:
            raise ValueError(
                f"register_model({key!r}): default_tag {tag!r} is not one of {list(tags)}"
            )
        _REGISTRY[key] = ModelEntry(name=key, builder=builder, weights=tags, default_tag=tag)
        return builder

    if fn is not None:
        return decorator(fn)
    return decorator


def get_model_entry(name: str) -> ModelEntry:
    """The registry entry for ``name`` (case-insensitive).

    Raises:
        ValueError: Unknown name; the message lists the closest registered names.
    """
    key = name.lower()
    if key not in _REGISTRY:
        listing = f"modelzoo.list_models() lists all {len(_REGISTRY)}"
        raise unknown_name("model", name, _REGISTRY, listing)
    return _REGISTRY[key]


def list_models(pattern: str | None = None, pretrained: bool | None = None) -> list[str]:
    """Sorted registered names, optionally filtered.

    Args:
        pattern: A shell-style wildcard, case-insensitive (``"resnest*"``).
        pretrained: ``True`` keeps models with published weights, ``False`` those without.
    """
    names = sorted(_REGISTRY)
    if pattern is not None:
        names = [n for n in names if fnmatch.fnmatchcase(n, pattern.lower())]
    if pretrained is not None:
        names = [n for n in names if bool(_REGISTRY[n].weights) == pretrained]
    return names


def get_weights(name: str, tag: str | bool = True) -> Weights:
    """The :class:`Weights` of model ``name`` for ``tag`` (``True``: the default tag)."""
    entry = get_model_entry(name)
    if not entry.weights:
        raise ValueError(f"Model {entry.name!r} has no pretrained weights; use pretrained=False")
    key = entry.default_tag if tag is True else tag
    if key not in entry.weights:
        raise ValueError(
            f"Model {entry.name!r} has no weights tagged {tag!r}; available: {sorted(entry.weights)}"
        )
    return entry.weights[key]


def fetch_weights(weights: Weights, *, progress: bool = True) -> Path:
    """Makes sure the file of ``weights`` is in the cache and verified; returns its path."""
    from . import store  # the only module that touches the network

    return store.fetch(
        weights.url,
        file_name=weights.file_name,
        hash_prefix=weights.hash_prefix,
        hash_algo=weights.hash_algo,
        archive_member=weights.archive_member,
        progress=progress,
    )


def load_pretrained(
    model: nn.Module,
    weights: Weights,
    *,
    progress: bool = True,
    strict_classifier: bool = True,
    path: str | Path | None = None,
) -> nn.Module:
    """Downloads (or finds in the cache) ``weights`` and loads them into ``model``.

    With ``strict_classifier=False`` the checkpoint's classifier (``weights.classifier``) is
    not loaded and the model keeps its freshly initialized one; everything else must match
    exactly. ``path`` skips the fetch when the verified file is already at hand.
    """
    from .convert.load import read_state_dict

    if path is None:
        path = fetch_weights(weights, progress=progress)
    state = read_state_dict(path, weights.file_format)
    if weights.convert is not None:
        state = weights.convert(state, model)
    if strict_classifier:
        model.load_state_dict(state, strict=True)
        return model
    prefix = weights.classifier + "."
    state = {k: v for k, v in state.items() if not k.startswith(prefix)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    wrong = [k for k in missing if not k.startswith(prefix)]
    if wrong or unexpected:
        raise RuntimeError(
            f"Weights {weights.file_name} do not fit the model: missing {wrong}, unexpected {unexpected}"
        )
    return model


def get_model(
    name: str,
    *,
    pretrained: bool | str = False,
    num_classes: int | None = None,
    progress: bool = True,
    features_only: bool = False,
    out_indices: Sequence[int] | None = None,
    **overrides: Any,
) -> nn.Module:
    """Builds a registered model, optionally with published weights.

    Args:
        name: A registered name (case-insensitive), see :func:`list_models`, or the folder
            of an artifact (a training script's ``--export-dir``, see
            :mod:`modelzoo.artifact`): its model with its weights, in eval mode.
        pretrained: ``False``, ``True`` (the default weights) or a weights tag such as
            ``"gluoncv"``.
        num_classes: Classifier outputs. With pretrained weights for a different number of
            classes, everything but the classifier is loaded and the classifier is freshly
            initialized (GluonCV's ``reset_class``); a warning says so.
        progress: Show a download progress bar (only on a terminal).
        features_only: Return a backbone instead
            (:class:`~modelzoo.vision.features.FeatureListNet`): the stem and stages without
            the global pool and classifier, whose forward gives the list of feature maps
            selected by ``out_indices`` and whose ``feature_info`` gives their channels,
            reductions and module names (timm's ``features_only``). Pretrained weights are
            loaded strictly into the full model, whose head is then dropped.
        out_indices: With ``features_only``, the feature indices to return, in this order;
            ResNeSt: 0 the stem (reduction 2), 1-4 the stages (reductions 4, 8, 16, 32).
            Default: all.
        **overrides: Builder options, e.g. ``dropblock_prob=0.1`` or ``final_drop=0.2``.

    Returns:
        The model, in training mode.

    Raises:
        ValueError: Unknown name or weights tag; ``features_only`` for a model that is not a
            backbone (BERT, GNNs) or with ``num_classes``; invalid ``out_indices``, or
            ``out_indices`` without ``features_only``.

    Example:
        >>> net = get_model("resnest50", pretrained=True)  # doctest: +SKIP
        >>> backbone = get_model("resnest50", features_only=True, out_indices=(1, 2, 3, 4))
    """
    from .artifact import is_artifact

    if is_artifact(name):
        return _get_artifact_model(
            name, pretrained, num_classes, features_only, out_indices, overrides
        )
    entry = get_model_entry(name)
    if features_only:
        return _get_backbone(entry, pretrained, num_classes, progress, out_indices, overrides)
    if out_indices is not None:
        raise ValueError(
            f"get_model({entry.name!r}): out_indices={out_indices!r} only applies with "
            f"features_only=True; pass features_only=True or drop out_indices"
        )
    if pretrained is False:
        kwargs = dict(overrides)
        if num_classes is not None:
            kwargs["num_classes"] = num_classes
        return entry.builder(**kwargs)
    weights = get_weights(entry.name, pretrained)
    path = fetch_weights(weights, progress=progress)  # fail fast, before building a big model
    classes = weights.num_classes if num_classes is None else num_classes
    model = entry.builder(num_classes=classes, **overrides)
    if classes != weights.num_classes:
        warnings.warn(
            f"{entry.name}: the pretrained weights have {weights.num_classes} classes, "
            f"you asked for {classes}; loading everything except the classifier "
            f"'{weights.classifier}', which is freshly initialized",
            UserWarning,
            stacklevel=2,
        )
        return load_pretrained(model, weights, strict_classifier=False, path=path)
    return load_pretrained(model, weights, path=path)


def _get_backbone(
    entry: ModelEntry,
    pretrained: bool | str,
    num_classes: int | None,
    progress: bool,
    out_indices: Sequence[int] | None,
    overrides: dict[str, Any],
) -> nn.Module:
    """``get_model(..., features_only=True)``: checks everything before any download, loads
    the weights strictly into the classification model, then keeps its stem and stages."""
    from .vision.features import create_features, feature_family

    owner = f"get_model({entry.name!r}, features_only=True)"
    if num_classes is not None:
        raise ValueError(
            f"{owner}: num_classes={num_classes} has no meaning, a backbone has no "
            f"classifier; drop num_classes"
        )
    family = feature_family(entry.name, **overrides)
    indices = family.check_out_indices(out_indices, owner)
    model = get_model(entry.name, pretrained=pretrained, progress=progress, **overrides)
    return create_features(model, indices)


def _get_artifact_model(
    path: str,
    pretrained: bool | str,
    num_classes: int | None,
    features_only: bool,
    out_indices: Sequence[int] | None,
    overrides: dict[str, Any],
) -> nn.Module:
    """``get_model(folder)``: the artifact's model with its weights."""
    from .artifact import load_artifact

    if isinstance(pretrained, str):
        raise ValueError(
            f"get_model({path!r}): an artifact folder has one set of weights; "
            f"pretrained={pretrained!r} names a tag of the registry's weights, drop it"
        )
    artifact = load_artifact(path)
    if num_classes is not None and num_classes != artifact.num_classes:
        raise ValueError(
            f"get_model({path!r}): the artifact's model has {artifact.num_classes} classes, "
            f"not {num_classes}; to fine-tune for {num_classes} classes build "
            f"get_model({artifact.model_name!r}, num_classes={num_classes}) and load the "
            "weights but the classifier"
        )
    model = artifact.build(**overrides)
    if features_only:
        from .vision.features import create_features, feature_family

        owner = f"get_model({path!r}, features_only=True)"
        family = feature_family(artifact.model_name, **{**artifact.model_kwargs, **overrides})
        return create_features(model, family.check_out_indices(out_indices, owner))
    if out_indices is not None:
        raise ValueError(f"get_model({path!r}): out_indices only applies with features_only=True")
    return model
