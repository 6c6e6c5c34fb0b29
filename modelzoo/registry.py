"""The model registry: name -> builder and its published weights.

Builders register themselves with :func:`register_model` next to their definition; the
registry is the single source for :func:`list_models`, the docs tables and the
parametrized tests. Names are case-insensitive; registering a name twice raises.
"""

from __future__ import annotations

import typing
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from .entries import ModelEntry, get_model_entry, list_models, model_modality, register_model
from .weights import Weights

__all__ = [
    "ModelEntry",
    "fetch_weights",
    "get_model",
    "get_model_entry",
    "get_weights",
    "list_models",
    "load_pretrained",
    "model_modality",
    "register_model",
]


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
            (:class:`~modelzoo.features.FeatureListNet`): the stem and stages without
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
    from .features import create_features

    owner = f"get_model({entry.name!r}, features_only=True)"
    if num_classes is not None:
        raise ValueError(
            f"{owner}: num_classes={num_classes} has no meaning, a backbone has no "
            f"classifier; drop num_classes"
        )
    spec = _feature_spec(entry, overrides, owner)
    indices = spec.check_out_indices(out_indices, owner)
    model = get_model(entry.name, pretrained=pretrained, progress=progress, **overrides)
    return create_features(model, indices)


def _declared_class(entry: ModelEntry) -> type | None:
    """The class the builder's return annotation names, or ``None`` when it names none."""
    try:
        declared = typing.get_type_hints(entry.builder).get("return")
    except (NameError, TypeError):  # an annotation that does not resolve decides nothing
        return None
    return declared if isinstance(declared, type) else None


def _family_models(family: Any) -> list[str]:
    """Registered models whose builders declare a class of ``family``."""
    from .family import find_family

    return [n for n in list_models() if (c := _declared_class(get_model_entry(n))) is not None
            and find_family(c) is family]  # fmt: skip


def _feature_spec(entry: ModelEntry, overrides: Mapping[str, Any], owner: str) -> Any:
    """The backbone split of registered model ``entry``, from the family of the class its
    builder declares; a builder that declares only a base class (``nn.Module``) is built
    once on the ``meta`` device to see what it returns.

    Raises:
        ValueError: The model cannot be a backbone; the message names the families (and their
            models) that can.
    """
    import torch

    from .family import find_family
    from .features import backbone_families

    declared = _declared_class(entry)
    family = find_family(declared) if declared is not None else None
    if family is None or family.features is None:
        backbones = backbone_families()
        undecided = declared is None or any(
            issubclass(c, declared) for f in backbones for c in f.model_classes
        )
        if undecided:
            with torch.device("meta"):
                family = find_family(entry.builder(**overrides))
    if family is not None and family.features is not None:
        return family.features
    supported = "; ".join(
        f"{f.name} ({', '.join(_family_models(f)) or 'no registered models'})"
        for f in backbone_families()
    )
    raise ValueError(
        f"{owner}: {entry.name!r} is not a backbone model (it has no feature-map stages); "
        f"the families that support features_only=True: {supported}"
    )


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
        from .features import create_features, feature_spec

        owner = f"get_model({path!r}, features_only=True)"
        _, spec = feature_spec(model, owner)
        return create_features(model, spec.check_out_indices(out_indices, owner))
    if out_indices is not None:
        raise ValueError(f"get_model({path!r}): out_indices only applies with features_only=True")
    return model
