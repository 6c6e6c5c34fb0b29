"""Class names of the data sets the vision models are trained on."""

from __future__ import annotations

import functools
from importlib import resources

__all__ = ["IMAGENET_CLASSES_FILE", "imagenet_classes", "imagenet_synsets"]

IMAGENET_CLASSES_FILE = "imagenet_classes.tsv"


@functools.lru_cache(maxsize=1)
def _imagenet_table() -> tuple[tuple[str, str], ...]:
    text = resources.files(__package__).joinpath(IMAGENET_CLASSES_FILE).read_text("utf-8")
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        synset, sep, name = line.partition("\t")
        if not sep or not name:
            raise ValueError(f"{IMAGENET_CLASSES_FILE}:{number}: expected 'synset<TAB>name'")
        rows.append((synset, name))
    if len(rows) != 1000:
        raise ValueError(f"{IMAGENET_CLASSES_FILE}: {len(rows)} classes, expected 1000")
    return tuple(rows)


def imagenet_classes() -> tuple[str, ...]:
    """ImageNet-1k's 1000 short class names in classifier order (``"tench"``, ``"goldfish"``,
    ...; torchvision's names)."""
    return tuple(name for _, name in _imagenet_table())


def imagenet_synsets() -> tuple[str, ...]:
    """ImageNet-1k's 1000 WordNet synset ids in classifier order (``"n01440764"``, ...),
    the folder names of the ILSVRC-2012 train and val sets."""
    return tuple(synset for synset, _ in _imagenet_table())
