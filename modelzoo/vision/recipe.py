"""The set-up of image-classifier training, for ``scripts/train_imagenet.py`` and any other caller.

The data sets with GluonCV's training and evaluation transforms (:func:`image_datasets`: an
ImageNet-layout folder, MXNet RecordIO files, or the built-in digits), the model options of a
recipe (:func:`model_options`), which zoo models classify images (:func:`is_image_classifier`)
and the exported artifact (:func:`save_classifier_artifact`). Options are explicit arguments,
not a script's namespace; nothing here imports ``trainers``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import registry
from ..artifact import image_preprocessing, save_artifact
from .data import ImageFolder, digits_imagefolder
from .recordio import RecordIODataset
from .transforms import eval_transforms, train_transforms

__all__ = [
    "ImageSetError",
    "image_datasets",
    "image_root",
    "is_image_classifier",
    "model_options",
    "parse_rgb",
    "save_classifier_artifact",
]

PathLike = str | os.PathLike[str]


class ImageSetError(ValueError):
    """The data sets disagree with each other or with the options (e.g. their classes)."""


def parse_rgb(text: str, name: str) -> tuple[float, float, float]:
    """Three comma-separated numbers (a per-channel mean or standard deviation).

    Raises:
        ValueError: ``text`` is not three numbers; the message starts with ``name``.
    """
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{name}: expected three comma-separated numbers, got {text!r}") from None
    if len(values) != 3:
        raise ValueError(f"{name}: expected three comma-separated numbers, got {text!r}")
    return values  # type: ignore[return-value]


def image_root(dataset: str, data_dir: PathLike | None = None) -> Path:
    """The ImageNet-layout folder of ``dataset``: the built-in digits (``"digits"``, written
    once into the cache) or ``data_dir``."""
    if dataset == "digits":
        return digits_imagefolder()
    assert data_dir is not None, "an image folder needs its data_dir"
    return Path(data_dir).expanduser()


def image_datasets(
    dataset: str,
    *,
    input_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    crop_ratio: float = 0.875,
    jitter: float = 0.4,
    lighting: float = 0.1,
    min_random_area: float = 0.08,
    hflip: float = 0.5,
    data_dir: PathLike | None = None,
    rec_train: PathLike | None = None,
    rec_train_idx: PathLike | None = None,
    rec_val: PathLike | None = None,
    rec_val_idx: PathLike | None = None,
    num_classes: int | None = None,
    skip_bad: bool = False,
) -> tuple[Any, Any, int]:
    """The training set, the validation set (``None`` without one) and the number of classes,
    with GluonCV's transforms (mean and std in 0-255 units).

    Args:
        dataset: ``"folder"`` (``data_dir`` with ``train/<class>/*`` and optionally
            ``val/<class>/*``), ``"recordio"`` (``rec_train``/``rec_train_idx`` and optionally
            ``rec_val``/``rec_val_idx``; ``num_classes`` default 1000) or ``"digits"``.
        num_classes: for a folder, must match its class folders when given.
        skip_bad: skip unreadable images (counted) instead of raising.

    Raises:
        ImageSetError: The validation classes differ from the training ones, or
            ``num_classes`` disagrees with the class folders.
    """
    train_tf = train_transforms(
        input_size, mean=mean, std=std, jitter=jitter, lighting=lighting,
        scale=(min_random_area, 1.0), hflip=hflip,
    )  # fmt: skip
    eval_tf = eval_transforms(input_size, crop_ratio=crop_ratio, mean=mean, std=std)
    if dataset == "recordio":
        train = RecordIODataset(rec_train, rec_train_idx, train_tf, skip_bad=skip_bad)
        val = None
        if rec_val:
            if not rec_val_idx:
                raise ImageSetError("--rec-val needs --rec-val-idx")
            val = RecordIODataset(rec_val, rec_val_idx, eval_tf, skip_bad=skip_bad)
        return train, val, num_classes or 1000
    root = image_root(dataset, data_dir)
    train = ImageFolder(root / "train", train_tf, skip_bad=skip_bad)
    val_dir = root / "val"
    val = ImageFolder(val_dir, eval_tf, skip_bad=skip_bad) if val_dir.is_dir() else None
    if val is not None and val.classes != train.classes:
        raise ImageSetError(f"{val_dir}: class folders differ from {root / 'train'}'s")
    if num_classes is not None and num_classes != len(train.classes):
        raise ImageSetError(
            f"--num-classes {num_classes} disagrees with the {len(train.classes)} class "
            f"folders in {root / 'train'}"
        )
    return train, val, len(train.classes)


def model_options(
    *, last_gamma: bool = False, dropblock_prob: float = 0.0, final_drop: float = 0.0
) -> dict[str, Any]:
    """The keyword arguments of ``modelzoo.get_model`` for a recipe's options (only those
    set, so that models without them build too)."""
    options: dict[str, Any] = {}
    if last_gamma:
        options["last_gamma"] = True
    if dropblock_prob > 0:
        options["dropblock_prob"] = dropblock_prob
    if final_drop > 0:
        options["final_drop"] = final_drop
    return options


def is_image_classifier(name: str) -> bool:
    """Whether zoo model ``name``'s family reads images (:func:`modelzoo.registry.model_modality`)."""
    return registry.model_modality(name) == "image"


def save_classifier_artifact(
    directory: PathLike,
    model: torch.nn.Module,
    *,
    model_name: str,
    model_kwargs: Mapping[str, Any],
    labels: Sequence[str] | None,
    input_size: int,
    crop_ratio: float,
    mean: Sequence[float],
    std: Sequence[float],
    metrics: Mapping[str, Any],
    source: Mapping[str, Any],
    state_dict: Mapping[str, Any] | None = None,
) -> Path:
    """The artifact folder of a trained classifier (or of ``state_dict``'s weights, e.g. an
    EMA's): the model, its evaluation preprocessing (mean and std in 0-255 units) and the
    class names; ``modelzoo.get_model`` and ``modelzoo.pipeline`` load it."""
    preprocessing = image_preprocessing(
        input_size, crop_ratio, [m / 255 for m in mean], [s / 255 for s in std]
    )
    return save_artifact(
        directory, model, model_name=model_name, model_kwargs=dict(model_kwargs),
        task="image-classification", labels=labels, preprocessing=preprocessing,
        metrics=dict(metrics), source=dict(source), state_dict=state_dict,
    )  # fmt: skip
