"""The set-up of image-classifier training, for ``scripts/train_imagenet.py`` and any other caller.

The recipes' defaults (:data:`DIGITS_DEFAULTS`, :data:`IMAGENET_DEFAULTS`, filled in by
:func:`recipe_defaults`); a recipe's data
and model options as one config (:class:`ImageRecipe`: its checks, data sets, model, teacher
and exported artifact); the data sets with GluonCV's training and evaluation transforms
(:func:`image_datasets`: an ImageNet-layout folder, MXNet RecordIO files, or the built-in
digits), the model options of a recipe (:func:`model_options`), which zoo models classify
images (:func:`is_image_classifier`), the refusal of one image per BatchNorm forward pass
(:func:`check_batch_norm`), the lines that report a finished run (:func:`held_out_report`)
and the exported artifact (:func:`save_classifier_artifact`). Options are explicit arguments
or typed fields, not a script's namespace; nothing here imports ``trainers``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import registry
from ..artifact import image_preprocessing, is_artifact, save_artifact
from .data import ImageFolder, digits_imagefolder
from .recordio import RecordIODataset
from .transforms import eval_transforms, train_transforms

__all__ = [
    "DIGITS_DEFAULTS",
    "IMAGENET_DEFAULTS",
    "ImageRecipe",
    "ImageSetError",
    "RecipeOptionError",
    "check_batch_norm",
    "held_out_report",
    "image_datasets",
    "image_root",
    "is_image_classifier",
    "model_options",
    "parse_rgb",
    "recipe_defaults",
    "resume_path",
    "save_classifier_artifact",
]

PathLike = str | os.PathLike[str]

# The built-in default: what a newcomer gets with no data flags. Measured on seed 0 (AVX2
# pins, docs/training.md): the GluonCV-like 8 epochs at lr 0.1 with flips reached 0.9526 and
# its BatchNorm statistics blew up the first validations (loss 122, 137); without flips
# (a mirrored digit is another glyph) 0.969; with lr 0.05, weight decay 5e-4, label smoothing
# 0.1, 2 warm-up epochs of 12 the validation loss stays below 4 and top-1 reached 0.989.
DIGITS_DEFAULTS = dict(
    model="resnest14",
    input_size=32,
    crop_ratio=1.0,
    batch_size=64,
    num_epochs=12,
    lr=0.05,
    wd=5e-4,
    label_smoothing=0.1,
    warmup_epochs=2,
    rgb_mean="127.5,127.5,127.5",
    rgb_std="127.5,127.5,127.5",
    jitter=0.0,
    lighting=0.0,
    min_random_area=0.6,
    hflip=0.0,
    log_interval=10,
    last_gamma=True,
    no_wd=True,
)
#: GluonCV's ImageNet recipe: the defaults with ``--data-dir`` or ``--use-rec``.
IMAGENET_DEFAULTS = dict(
    model="resnest50",
    input_size=224,
    crop_ratio=0.875,
    batch_size=32,
    num_epochs=120,
    lr=0.1,
    wd=1e-4,
    label_smoothing=0.0,
    warmup_epochs=0,
    rgb_mean="123.68,116.779,103.939",
    rgb_std="58.393,57.12,57.375",
    jitter=0.4,
    lighting=0.1,
    min_random_area=0.08,
    hflip=0.5,
    log_interval=50,
    last_gamma=False,
    no_wd=False,
)


def recipe_defaults(options: Mapping[str, Any]) -> tuple[str, dict[str, Any], str | None]:
    """The data set that ``options`` (flag values by name, ``None``: not given) name and the
    recipe's defaults for the options they leave unset.

    No ``data_dir`` and no ``use_rec`` is the built-in digits (:data:`DIGITS_DEFAULTS`), else
    :data:`IMAGENET_DEFAULTS`. A default warm-up that does not fit ``num_epochs`` (after
    ``const_epochs``) is shortened to half the run, and a note says so.

    Returns:
        ``(dataset, values, note)``: ``"digits"``, ``"folder"`` or ``"recordio"``; the values
        of the options not given; the note for the user, or ``None``.
    """
    digits = options.get("data_dir") is None and not options.get("use_rec")
    defaults = DIGITS_DEFAULTS if digits else IMAGENET_DEFAULTS
    values = {key: value for key, value in defaults.items() if options.get(key) is None}
    dataset = "digits" if digits else ("recordio" if options.get("use_rec") else "folder")
    resolved = {**options, **values}
    num_epochs, const_epochs = resolved["num_epochs"], resolved.get("const_epochs") or 0
    note = None
    fits = resolved["warmup_epochs"] + const_epochs <= num_epochs
    if "warmup_epochs" in values and num_epochs >= 1 and not fits:
        # The recipe's warmup does not fit a shorter run: warm up over half of it (say so).
        values["warmup_epochs"] = max(0.0, num_epochs - const_epochs) / 2
        note = (
            f"note: the default --warmup-epochs {defaults['warmup_epochs']} does not fit "
            f"--num-epochs {num_epochs}: warming up for {values['warmup_epochs']:g} epochs "
            "(half the run); pass --warmup-epochs to choose"
        )
    return dataset, values, note


class ImageSetError(ValueError):
    """The data sets disagree with each other or with the options (e.g. their classes)."""


class RecipeOptionError(ValueError):
    """A recipe's options cannot run: the message names the flag (``train_imagenet.py``'s
    spelling) and what to do instead."""


@dataclass(frozen=True)
class ImageRecipe:
    """An image-classification recipe's data and model options, as ``train_imagenet.py``'s
    flags of the same names (defaults: GluonCV's ImageNet recipe, :data:`IMAGENET_DEFAULTS`).

    ``dataset`` is ``"digits"`` (the built-in digits), ``"folder"`` (``data_dir`` with
    ``train/<class>/*`` and optionally ``val/<class>/*``) or ``"recordio"`` (the ``rec_*``
    files); ``rgb_mean``/``rgb_std`` are three comma-separated numbers in 0-255 units;
    ``resume`` a checkpoint or ``"auto"`` (``save_dir``'s ``latest.pt``).
    """

    dataset: str = "folder"
    data_dir: PathLike | None = None
    use_rec: bool = False
    rec_train: PathLike | None = None
    rec_train_idx: PathLike | None = None
    rec_val: PathLike | None = None
    rec_val_idx: PathLike | None = None
    num_classes: int | None = None
    skip_bad_images: bool = False
    input_size: int = 224
    crop_ratio: float = 0.875
    rgb_mean: str = "123.68,116.779,103.939"
    rgb_std: str = "58.393,57.12,57.375"
    jitter: float = 0.4
    lighting: float = 0.1
    min_random_area: float = 0.08
    hflip: float = 0.5
    model: str = "resnest50"
    teacher: str | None = None
    last_gamma: bool = False
    dropblock_prob: float = 0.0
    final_drop: float = 0.0
    batch_size: int = 32
    num_epochs: int = 120
    mixup: bool = False
    mixup_off_epoch: int = 0
    channels_last: bool = False
    target_top1: float | None = None
    pipeline_parallel: int = 1
    micro_batches: int | None = None
    resume: str | None = None
    save_dir: PathLike | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ImageRecipe:
        """The recipe of ``options`` (e.g. a script's flags, ``vars(args)``): its fields by
        name; the other entries are not the recipe's."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in options.items() if key in names})

    @property
    def mean(self) -> tuple[float, float, float]:
        return parse_rgb(self.rgb_mean, "--rgb-mean")

    @property
    def std(self) -> tuple[float, float, float]:
        return parse_rgb(self.rgb_std, "--rgb-std")

    def check_options(self) -> None:
        """What the options must satisfy together, in their own terms (nothing is read).

        Raises:
            RecipeOptionError: the first option that does not fit, named as its flag.
        """
        for flag, text in (("--rgb-mean", self.rgb_mean), ("--rgb-std", self.rgb_std)):
            try:
                parse_rgb(text, flag)
            except ValueError as err:
                raise RecipeOptionError(str(err)) from None
        if 0 in self.std:
            raise RecipeOptionError(
                f"--rgb-std {self.rgb_std}: a standard deviation of 0 divides by zero"
            )
        if self.mixup_off_epoch > self.num_epochs:
            raise RecipeOptionError(
                f"--mixup-off-epoch {self.mixup_off_epoch} exceeds --num-epochs {self.num_epochs}"
            )
        if self.use_rec and not (self.rec_train and self.rec_train_idx):
            raise RecipeOptionError("--use-rec needs --rec-train and --rec-train-idx (and "
                                    "--rec-val/--rec-val-idx to evaluate)")  # fmt: skip
        if self.rec_val and not self.rec_val_idx:
            raise RecipeOptionError("--rec-val needs --rec-val-idx")
        if self.target_top1 is not None and self.dataset == "recordio" and not self.rec_val:
            raise RecipeOptionError(
                "--target-top1 needs a validation set: --rec-val and --rec-val-idx"
            )
        if self.pipeline_parallel > 1:
            for flag, on in (("--mixup", self.mixup), ("--teacher", self.teacher),
                             ("--channels-last", self.channels_last)):  # fmt: skip
                if on:
                    raise RecipeOptionError(
                        f"{flag} does not run with --pipeline-parallel yet (the stages take "
                        "the images as the loader gives them); drop one of the two"
                    )

    def check_inputs(self) -> None:
        """What the options name -- models, files, folders -- exists, before any work.

        Raises:
            RecipeOptionError: naming the flag and what to do.
        """
        for flag, name in (("--model", self.model), ("--teacher", self.teacher)):
            if name is not None:
                _check_image_model(flag, name)
        if self.dataset == "recordio":
            for flag in ("--rec-train", "--rec-train-idx", "--rec-val", "--rec-val-idx"):
                path = getattr(self, flag[2:].replace("-", "_"))
                if path and not Path(path).expanduser().is_file():
                    raise RecipeOptionError(f"{flag} {path}: no such file")
        if self.dataset == "folder":
            assert self.data_dir is not None, "an image folder needs its data_dir"
            root = Path(self.data_dir).expanduser()
            if not (root / "train").is_dir():
                what = "has no train/ folder" if root.is_dir() else "does not exist"
                raise RecipeOptionError(
                    f"--data-dir {self.data_dir} {what}: give a folder with train/<class>/* "
                    "(and val/<class>/* to evaluate), or no --data-dir for the built-in digits"
                )
            if self.target_top1 is not None and not (root / "val").is_dir():
                raise RecipeOptionError(
                    f"--target-top1 needs a validation set: {root / 'val'} is missing"
                )
        if self.resume is not None and not self.resume_path().is_file():
            raise RecipeOptionError(f"--resume {self.resume_path()}: no such checkpoint")

    def resume_path(self) -> Path:
        """The checkpoint ``resume`` names (:func:`resume_path`)."""
        assert self.resume is not None, "no checkpoint to resume from"
        return resume_path(self.resume, self.save_dir)

    def datasets(self) -> tuple[Any, Any, int]:
        """The training set, the validation set (``None`` without one) and the number of
        classes (:func:`image_datasets`).

        Raises:
            ImageSetError: The data sets disagree with each other or with ``num_classes``.
        """
        return image_datasets(
            self.dataset, input_size=self.input_size, crop_ratio=self.crop_ratio,
            mean=self.mean, std=self.std, jitter=self.jitter, lighting=self.lighting,
            min_random_area=self.min_random_area, hflip=self.hflip, data_dir=self.data_dir,
            rec_train=self.rec_train, rec_train_idx=self.rec_train_idx, rec_val=self.rec_val,
            rec_val_idx=self.rec_val_idx, num_classes=self.num_classes,
            skip_bad=self.skip_bad_images,
        )  # fmt: skip

    def model_options(self) -> dict[str, Any]:
        """The recipe's keyword arguments of ``modelzoo.get_model`` (:func:`model_options`)."""
        return model_options(last_gamma=self.last_gamma, dropblock_prob=self.dropblock_prob,
                             final_drop=self.final_drop)  # fmt: skip

    def build_model(
        self, num_classes: int, *, pretrained: bool = False, progress: bool = True
    ) -> torch.nn.Module:
        """Zoo model (or artifact) ``model`` with the recipe's options for ``num_classes``.

        Raises:
            RecipeOptionError: It has BatchNorm and a forward pass gets one image
                (:func:`check_batch_norm`).
        """
        model = registry.get_model(self.model, pretrained=pretrained, num_classes=num_classes,
                                   progress=progress, **self.model_options())  # fmt: skip
        check_batch_norm(model, model_name=self.model, batch_size=self.batch_size,
                         pipeline_parallel=self.pipeline_parallel,
                         micro_batches=self.micro_batches)  # fmt: skip
        return model

    def build_teacher(self, num_classes: int, device: Any) -> torch.nn.Module | None:
        """The pretrained ``teacher`` to distil from, frozen in evaluation mode on ``device``
        (``None`` without one)."""
        if not self.teacher:
            return None
        teacher = registry.get_model(self.teacher, pretrained=True, num_classes=num_classes).eval()
        teacher.to(device).requires_grad_(False)
        return teacher

    def export(
        self,
        directory: PathLike,
        model: torch.nn.Module,
        *,
        num_classes: int,
        labels: Sequence[str] | None,
        metrics: Mapping[str, Any],
        source: Mapping[str, Any],
        state_dict: Mapping[str, Any] | None = None,
    ) -> Path:
        """The artifact folder of the trained ``model`` (or of ``state_dict``'s weights, e.g.
        an EMA's) with the recipe's evaluation preprocessing (:func:`save_classifier_artifact`)."""
        return save_classifier_artifact(
            directory, model, model_name=self.model,
            model_kwargs={"num_classes": num_classes, **self.model_options()}, labels=labels,
            input_size=self.input_size, crop_ratio=self.crop_ratio, mean=self.mean,
            std=self.std, metrics=metrics, source=source, state_dict=state_dict,
        )  # fmt: skip


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


def _check_image_model(flag: str, name: str) -> None:
    """``name`` is a zoo image model or an exported artifact folder."""
    if is_artifact(name):
        return
    try:
        registry.get_model_entry(name)
    except ValueError as err:
        raise RecipeOptionError(f"{flag} {name}: {err}") from None
    if not is_image_classifier(name):
        images = ", ".join(registry.list_models(modality="image"))
        raise RecipeOptionError(f"{flag} {name} is not an image classifier; choose one of {images}")


def resume_path(resume: str, save_dir: PathLike | None) -> Path:
    """The checkpoint ``--resume`` names: ``resume``, or with ``"auto"`` ``save_dir``'s
    ``latest.pt``.

    Raises:
        RecipeOptionError: ``"auto"`` without a ``save_dir``.
    """
    if resume != "auto":
        return Path(resume)
    if save_dir is None:
        raise RecipeOptionError(
            "--resume without a path continues from <save-dir>/latest.pt: pass --save-dir"
        )
    return Path(save_dir) / "latest.pt"


def check_batch_norm(
    model: torch.nn.Module,
    *,
    model_name: str,
    batch_size: int,
    pipeline_parallel: int = 1,
    micro_batches: int | None = None,
) -> None:
    """BatchNorm normalizes each channel over the batch: one image per forward pass has no
    spread to normalize (ResNeSt's split attention pools to 1x1 first), so refuse it.

    Raises:
        RecipeOptionError: ``model`` has BatchNorm layers and a forward pass (a micro-batch
            with ``pipeline_parallel`` stages) gets fewer than 2 images.
    """
    per_forward = batch_size
    if pipeline_parallel > 1:
        per_forward //= micro_batches or pipeline_parallel
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if has_bn and per_forward < 2:
        what = "--batch-size 1" if per_forward == batch_size else (
            f"--batch-size {batch_size} in {batch_size // max(per_forward, 1)} "
            "micro-batches")  # fmt: skip
        raise RecipeOptionError(
            f"{what}: {model_name} has BatchNorm layers, which need at least 2 images per "
            "forward pass in training; pass --batch-size 2 or more"
        )


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


def held_out_report(
    train_set: Any,
    val_set: Any,
    metrics: Mapping[str, Any],
    ema_metrics: Mapping[str, Any] | None,
    seconds: float,
) -> list[str]:
    """The lines that end a run: the unreadable images each set skipped, the held-out top-1
    of ``metrics`` (the last evaluation, after ``seconds``) and of the EMA's ``ema_metrics``
    (``None``: no EMA)."""
    lines = []
    for ds, name in ((train_set, "train"), (val_set, "val")):
        report = getattr(ds, "report", None)
        if ds is not None and report is not None and ds.bad_files:
            lines.append(f"[{name}] {report()}")
    if val_set is not None and "top1" in metrics:
        lines.append(
            f"Held-out top-1 accuracy: {metrics['top1']:.4f} ({len(val_set)} images, "
            f"{seconds:.1f} s)"
        )
    if ema_metrics is not None and "ema_top1" in ema_metrics:
        lines.append(f"Held-out top-1 accuracy of the EMA: {ema_metrics['ema_top1']:.4f}")
    return lines


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
