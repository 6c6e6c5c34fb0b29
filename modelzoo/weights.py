"""Metadata of published weights, kept next to each model builder.

Every pretrained entry says where its file lives, how the publisher hashed it, what it
reaches and how it was trained, so a user (and the schema test) can check it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "MODALITIES", "VocabFile", "Weights"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_FORMATS = ("pth", "params", "safetensors")
MODALITIES = ("image", "text", "graph")
_VOCAB_FORMATS = ("txt", "gluonnlp")
_HEX = re.compile(r"^[0-9a-f]+$")


def _check_hash(owner: str, hash_prefix: str, hash_algo: str) -> None:
    if hash_algo not in ("sha256", "sha1"):
        raise ValueError(f"{owner}: hash_algo must be sha256 or sha1, got {hash_algo!r}")
    if not _HEX.match(hash_prefix) or len(hash_prefix) < 8:
        raise ValueError(
            f"{owner}: hash_prefix must be at least 8 lowercase hex digits, got {hash_prefix!r}"
        )


@dataclass(frozen=True)
class VocabFile:
    """The tokenizer vocabulary published with a language model's weights.

    Attributes:
        url: Where the publisher serves it (``https://``, ``file://`` or ``package://``, see
            :func:`modelzoo.store.fetch`).
        hash_prefix: Hex digest (or its first 8+ digits) of the file (of ``archive_member``).
        hash_algo: ``"sha256"`` or ``"sha1"`` (GluonNLP).
        file_format: ``"txt"`` (BERT ``vocab.txt``: one token a line, the id is the line
            number) or ``"gluonnlp"`` (GluonNLP's JSON ``.vocab``, with its own token order).
        archive_member: For a zip download, the member holding the vocabulary.
        local_name: Name of the cached file when the URL's base name is not unique.
        lowercase: Uncased vocabulary: lowercase and strip accents before WordPiece.
    """

    url: str
    hash_prefix: str
    hash_algo: str = "sha256"
    file_format: str = "txt"
    archive_member: str | None = None
    local_name: str | None = None
    lowercase: bool = True

    def __post_init__(self) -> None:
        _check_hash(f"VocabFile({self.url})", self.hash_prefix, self.hash_algo)
        if self.file_format not in _VOCAB_FORMATS:
            raise ValueError(
                f"VocabFile({self.url}): file_format must be one of {_VOCAB_FORMATS}, "
                f"got {self.file_format!r}"
            )

    @property
    def file_name(self) -> str:
        """Name of the cached file."""
        return self.local_name or self.archive_member or os.path.basename(self.url)


@dataclass(frozen=True)
class Weights:
    """One published weight file and what it is for.

    Attributes:
        url: Where the publisher serves the file (``MODELZOO_REPO_URL`` replaces its base).
        hash_prefix: Hex digest of the file as the publisher gives it: full, or the 8-char
            prefix in the published file name.
        hash_algo: ``"sha256"`` (official ResNeSt, ours) or ``"sha1"`` (GluonCV).
        file_format: ``"pth"`` (torch state dict, loaded with ``weights_only=True``),
            ``"params"`` (MXNet NDArray file, read without MXNet) or ``"safetensors"``.
        num_params: Trainable parameter count of the model these weights fit.
        num_classes: Classifier outputs of the checkpoint.
        metrics: Published results, e.g. ``{"imagenet_top1": 81.03}``.
        source: Who published the file (``"official"``, ``"gluoncv"``, ``"modelzoo"``).
        license: License of the weights.
        input_size: Evaluation input side in pixels.
        crop_ratio: Evaluation centre-crop ratio (resize side = input_size / crop_ratio).
        mean: Per-channel normalisation mean in [0, 1] units.
        std: Per-channel normalisation std in [0, 1] units.
        classifier: State-dict prefix of the classifier, dropped when ``num_classes`` differs.
        archive_member: For a zip download, the member holding the weights (hashed itself).
        convert: Maps a foreign state dict (e.g. GluonCV names) onto the model's:
            ``convert(raw, model) -> state_dict``. ``None`` for native files.
        local_name: Name of the cached file when the URL's base name does not say which model
            it is (Hugging Face serves every model as ``model.safetensors``); by convention
            ``{model}-{hash8}.{ext}``.
        vocab: The tokenizer vocabulary that goes with these weights (language models).
        modality: What the model reads: ``"image"`` (preprocessing: :meth:`transforms`),
            ``"text"`` (:meth:`tokenizer`) or ``"graph"`` (node features, :meth:`transforms`).
        labels: Class names in the order of the classifier's outputs (ImageNet's 1000 for
            the ImageNet weights), or ``None`` where the outputs are not classes.
        normalize_features: Graph weights trained on row-normalized node features
            (``train_gnn.py --normalize-features``): :meth:`transforms` applies it.
        recipe: The command that trained it and its published log, where known.
        tags: Free-form extra facts (paper, notes).
    """

    url: str
    hash_prefix: str
    num_params: int
    num_classes: int
    metrics: Mapping[str, float]
    source: str
    license: str
    hash_algo: str = "sha256"
    file_format: str = "pth"
    input_size: int = 224
    crop_ratio: float = 0.875
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    classifier: str = "fc"
    archive_member: str | None = None
    convert: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None
    local_name: str | None = None
    vocab: VocabFile | None = None
    modality: str = "image"
    labels: tuple[str, ...] | None = None
    normalize_features: bool = False
    recipe: Mapping[str, str] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_hash(f"Weights({self.url})", self.hash_prefix, self.hash_algo)
        if self.file_format not in _FORMATS:
            raise ValueError(
                f"Weights({self.url}): file_format must be one of {_FORMATS}, got {self.file_format!r}"
            )
        if self.modality not in MODALITIES:
            raise ValueError(
                f"Weights({self.url}): modality must be one of {MODALITIES}, got {self.modality!r}"
            )
        if self.labels is not None:
            if not isinstance(self.labels, tuple):
                object.__setattr__(self, "labels", tuple(self.labels))
            if len(self.labels) != self.num_classes:
                raise ValueError(
                    f"Weights({self.url}): {len(self.labels)} labels for num_classes="
                    f"{self.num_classes}; give one name per classifier output"
                )
        if self.modality == "text" and self.vocab is None:
            raise ValueError(f"Weights({self.url}): text weights need their vocab=VocabFile(...)")

    @property
    def file_name(self) -> str:
        """Name of the cached file: ``{name}-{hash8}.{ext}`` as the publisher names it."""
        return self.local_name or self.archive_member or os.path.basename(self.url)

    def transforms(self) -> Callable[[Any], Any]:
        """The evaluation preprocessing these weights expect, as one callable.

        Image weights: the very pipeline ``train_imagenet.py`` evaluates with
        (:func:`modelzoo.vision.transforms.eval_transforms` of ``input_size``, ``crop_ratio``,
        ``mean``, ``std``): a PIL image (or a path's decoded image) -> a normalized
        ``(3, input_size, input_size)`` float tensor. Graph weights: the node-feature
        transform ``train_gnn.py`` applied (:class:`modelzoo.graph.transforms.NodeFeatures`).

        Raises:
            ValueError: Text weights; their preprocessing is :meth:`tokenizer`.
        """
        from .family import get_modality

        options = {
            "input_size": self.input_size,
            "crop_ratio": self.crop_ratio,
            "mean": self.mean,
            "std": self.std,
            "normalize_features": self.normalize_features,
        }
        return get_modality(self.modality).transforms(options, f"Weights({self.file_name})")

    def tokenizer(self, *, progress: bool = True) -> Any:
        """The :class:`~modelzoo.nlp.tokenizer.BertTokenizer` of these (text) weights'
        vocabulary, fetched and verified like the weights.

        Raises:
            ValueError: The weights have no vocabulary (image and graph weights).
        """
        from .family import get_modality

        owner = f"Weights({self.file_name})"
        return get_modality(self.modality).tokenizer(
            owner=owner, vocab=self.vocab, progress=progress
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain-data view (no callables), for docs tables and run-log headers.

        ``labels`` is summarised as ``num_labels`` (ImageNet's would be 1000 names).
        """
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("convert", "labels")
        }
        out["num_labels"] = None if self.labels is None else len(self.labels)
        out["metrics"] = dict(self.metrics)
        out["recipe"] = dict(self.recipe)
        out["tags"] = dict(self.tags)
        out["vocab"] = dataclasses.asdict(self.vocab) if self.vocab is not None else None
        out["file_name"] = self.file_name
        return out
