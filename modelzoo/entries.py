"""The table of registered models: name -> builder and its published weights.

The lowest layer of the registry (:mod:`modelzoo.registry` builds on it): builders register
themselves with :func:`register_model` next to their definition, and artifacts
(:mod:`modelzoo.artifact`) look their builder up here. Names are case-insensitive;
registering a name twice raises.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from ._lookup import unknown_name
from .weights import Weights

__all__ = ["ModelEntry", "get_model_entry", "list_models", "model_modality", "register_model"]

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


def list_models(
    pattern: str | None = None, pretrained: bool | None = None, modality: str | None = None
) -> list[str]:
    """Sorted registered names, optionally filtered.

    Args:
        pattern: A shell-style wildcard, case-insensitive (``"resnest*"``).
        pretrained: ``True`` keeps models with published weights, ``False`` those without.
        modality: Keeps the models whose family reads this (``"image"``, ``"text"``,
            ``"graph"``, ``"tabular"``; :func:`model_modality`).
    """
    names = sorted(_REGISTRY)
    if pattern is not None:
        names = [n for n in names if fnmatch.fnmatchcase(n, pattern.lower())]
    if pretrained is not None:
        names = [n for n in names if bool(_REGISTRY[n].weights) == pretrained]
    if modality is not None:
        names = [n for n in names if model_modality(n) == modality]
    return names


_MODALITIES: dict[Callable[..., nn.Module], str | None] = {}  # builder -> its modality


def model_modality(name: str) -> str | None:
    """What registered model ``name`` reads: its family's modality (``"image"``, ``"text"``,
    ``"graph"``, ``"tabular"``; :mod:`modelzoo.family`), ``None`` for a model of no registered
    family. Found by building the model once on the meta device (no memory, no weights)."""
    entry = get_model_entry(name)
    if entry.builder not in _MODALITIES:
        import torch

        from .family import find_family

        with torch.device("meta"):
            family = find_family(entry.builder())
        _MODALITIES[entry.builder] = family.modality if family is not None else None
    return _MODALITIES[entry.builder]
