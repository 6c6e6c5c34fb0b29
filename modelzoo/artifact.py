"""One folder from training to serving: the model, its weights, preprocessing and labels.

A training script's ``--export-dir DIR`` (or :func:`save_artifact`) writes

* ``modelzoo.json`` — what the model is (its registry name and builder options), its task,
  the preprocessing its evaluation used, the class names, the run's final metrics, the
  command that trained it, and ``files``: the sha256 of every other file of the folder;
* ``model.safetensors`` — the weights (for BERT: the Hugging Face layout, with its
  ``config.json``, ``vocab.txt`` and ``tokenizer_config.json``, so ``transformers`` reads the
  same folder).

``modelzoo.get_model(DIR)`` and ``modelzoo.pipeline(task, DIR)`` load it back; the
preprocessing is rebuilt by the same functions the training script's evaluation called
(:func:`modelzoo.vision.transforms.eval_transforms`, the SQuAD windowing of
:func:`modelzoo.nlp.squad.make_features`, :class:`modelzoo.graph.transforms.NodeFeatures`),
so training and serving cannot drift apart (ML.NET's lesson). The folder is written under a
temporary name and renamed into place: a failed export leaves nothing behind. Weights with a
NaN or infinite value are refused before anything is written.

Loading checks every file against the sha256 that ``modelzoo.json`` records: a file changed
or corrupted since the export (one flipped byte of ``model.safetensors``) is an
:class:`ArtifactError` naming it, never different predictions. Folders written before the
hashes were recorded (no ``files`` field) still load, unchecked.

Example:
    >>> save_artifact("runs/digits/export", model, model_name="resnest14",  # doctest: +SKIP
    ...               model_kwargs={"num_classes": 10}, task="image-classification",
    ...               labels=train_set.classes, preprocessing=image_preprocessing(32, 0.875))
    >>> net = modelzoo.get_model("runs/digits/export")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import nn

from .family import get_modality
from .fileio import fsync_directory

__all__ = [
    "ARTIFACT_FILE",
    "ARTIFACT_FORMAT",
    "TASKS",
    "Artifact",
    "ArtifactError",
    "image_preprocessing",
    "is_artifact",
    "load_artifact",
    "save_artifact",
]

ARTIFACT_FILE = "modelzoo.json"
ARTIFACT_FORMAT = 1
WEIGHTS_FILE = "model.safetensors"

#: task -> the modality of its input.
TASKS = {
    "image-classification": "image",
    "question-answering": "text",
    "fill-mask": "text",
    "node-classification": "graph",
}

#: SQuAD windowing and post-processing options a question-answering artifact records.
QA_OPTIONS = {
    "max_seq_length": 384,
    "doc_stride": 128,
    "max_query_length": 64,
    "max_answer_length": 30,
    "n_best_size": 20,
    "version_2": False,
    "null_score_diff_threshold": 0.0,
}


class ArtifactError(ValueError):
    """A folder that is not a readable modelzoo artifact (the message names file and field)."""


def image_preprocessing(
    input_size: int,
    crop_ratio: float,
    mean: Sequence[float] = (0.485, 0.456, 0.406),
    std: Sequence[float] = (0.229, 0.224, 0.225),
) -> dict[str, Any]:
    """The ``preprocessing`` of an image artifact; ``mean``/``std`` in [0, 1] units (as
    :class:`~modelzoo.Weights`; the scripts' ``--rgb-mean`` is in 0-255 units: divide)."""
    return {
        "input_size": int(input_size),
        "crop_ratio": float(crop_ratio),
        "mean": [float(m) for m in mean],
        "std": [float(s) for s in std],
    }


@dataclass(frozen=True)
class Artifact:
    """A loaded ``modelzoo.json``: everything but the weights (see :meth:`build`).

    It answers the same questions as :class:`~modelzoo.Weights` (``labels``,
    :meth:`transforms`, :meth:`tokenizer`, ``modality``), so pipelines take either.
    """

    directory: Path
    model_name: str
    model_kwargs: Mapping[str, Any]
    task: str
    labels: tuple[str, ...] | None = None
    preprocessing: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    source: Mapping[str, Any] = field(default_factory=dict)

    @property
    def modality(self) -> str:
        return TASKS[self.task]

    @property
    def num_classes(self) -> int | None:
        value = self.model_kwargs.get("num_classes")
        return None if value is None else int(value)

    def transforms(self) -> Any:
        """The evaluation preprocessing of the run (images: the eval transform; graphs: the
        node-feature transform). Text: raises, use :meth:`tokenizer`."""
        from .family import get_modality

        return get_modality(self.modality).transforms(dict(self.preprocessing), str(self.directory))

    def tokenizer(self, *, progress: bool = False) -> Any:
        """The tokenizer saved in the folder (text artifacts)."""
        from .family import get_modality

        return get_modality(self.modality).tokenizer(
            owner=str(self.directory), directory=self.directory, progress=progress
        )

    def build(self, **overrides: Any) -> nn.Module:
        """The model with the folder's weights loaded strictly, in eval mode.

        ``overrides`` are builder options that do not change the parameters (e.g.
        ``final_drop=0.0``); ones that do make the strict load fail with the names.
        """
        from .family import get_modality

        modality = get_modality(self.modality)
        if not modality.registered_model:
            try:
                model = modality.load_model(self.directory, dict(self.model_kwargs), overrides)
            except ArtifactError:
                raise
            except ValueError as exc:
                raise ArtifactError(str(exc)) from None
            return model.eval()
        from safetensors.torch import load_model

        from .entries import get_model_entry

        entry = get_model_entry(self.model_name)
        model = entry.builder(**{**self.model_kwargs, **overrides})
        missing, unexpected = load_model(model, str(self.directory / WEIGHTS_FILE), strict=False)
        if missing or unexpected:
            raise ArtifactError(
                f"{self.directory / WEIGHTS_FILE}: the weights do not fit {self.model_name}"
                f"({_kwargs_text({**self.model_kwargs, **overrides})}): missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}"
            )
        return model.eval()


def _kwargs_text(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items()))


def is_artifact(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder holding a ``modelzoo.json``."""
    try:
        return (Path(path).expanduser() / ARTIFACT_FILE).is_file()
    except (OSError, ValueError):
        return False


def _jsonable(value: Any, where: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"{where} must be JSON data (numbers, strings, lists): {exc}") from None
    return value


def save_artifact(
    directory: str | os.PathLike[str],
    model: nn.Module,
    *,
    model_name: str,
    model_kwargs: Mapping[str, Any],
    task: str,
    labels: Sequence[str] | None = None,
    preprocessing: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
    metrics: Mapping[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Writes ``model`` as an artifact folder (replacing an older one) and returns it.

    Args:
        directory: the folder to create (its parent is created if needed).
        model: the trained model (a bare module, not DDP).
        model_name: its registry name: :meth:`Artifact.build` calls that builder (BERT is
            rebuilt from the Hugging Face ``config.json`` written beside the weights, so a
            model configured by its sizes may say ``"bert"``).
        model_kwargs: the builder options that give ``model``'s parameters
            (``num_classes``, ``in_channels``, ``head``, ...).
        task: one of :data:`TASKS`.
        labels: class names, one per classifier output (image and graph classifiers).
        preprocessing: image: :func:`image_preprocessing`; question answering: the SQuAD
            options of :data:`QA_OPTIONS` the run evaluated with; graph:
            ``{"normalize_features": bool}``.
        tokenizer: text tasks: the :class:`~modelzoo.nlp.tokenizer.BertTokenizer`.
        metrics: the run's final metrics (recorded, not used).
        source: where it comes from (command, run log, seed).
        state_dict: weights to write instead of ``model``'s (e.g. its EMA); same names.

    Raises:
        ArtifactError: an unknown task, labels that do not match ``num_classes``, missing
            preprocessing or tokenizer, fields that are not JSON data, or weights with a NaN
            or infinite value (nothing is written).
    """
    if task not in TASKS:
        raise ArtifactError(f"save_artifact: task must be one of {sorted(TASKS)}, got {task!r}")
    modality = TASKS[task]
    kwargs = dict(_jsonable(dict(model_kwargs), "save_artifact: model_kwargs"))
    if labels is not None:
        labels = [str(x) for x in labels]
        classes = kwargs.get("num_classes")
        if classes is not None and len(labels) != int(classes):
            raise ArtifactError(
                f"save_artifact: {len(labels)} labels for num_classes={classes}; give one "
                "name per classifier output"
            )
    prep = dict(preprocessing or {})
    if task == "question-answering":
        unknown = sorted(set(prep) - set(QA_OPTIONS))
        if unknown:
            raise ArtifactError(
                f"save_artifact: preprocessing keys {unknown} are not SQuAD options "
                f"{sorted(QA_OPTIONS)}"
            )
        prep = {**QA_OPTIONS, **prep}
    kind = get_modality(modality)
    missing = sorted(set(kind.required_options) - set(prep))
    if missing:
        raise ArtifactError(
            f"save_artifact: {modality} preprocessing lacks {missing}; use image_preprocessing()"
        )
    if kind.needs_tokenizer and tokenizer is None:
        raise ArtifactError(f"save_artifact: a {task} artifact needs its tokenizer=")
    meta = {
        "format": ARTIFACT_FORMAT,
        "model": model_name.lower(),
        "model_kwargs": kwargs,
        "task": task,
        "labels": labels,
        "preprocessing": _jsonable(prep, "save_artifact: preprocessing"),
        "metrics": _jsonable(dict(metrics or {}), "save_artifact: metrics"),
        "source": _jsonable(dict(source or {}), "save_artifact: source"),
    }
    if kind.registered_model:  # else rebuilt from the folder's files; the name is a record
        from .entries import get_model_entry

        get_model_entry(model_name)  # an unknown name fails now, not when loading

    directory = Path(directory).expanduser()
    bad = _nonfinite_weight(state_dict if state_dict is not None else model.state_dict())
    if bad is not None:
        raise ArtifactError(
            f"save_artifact: weight {bad!r} has a non-finite value (NaN or inf): the model "
            f"diverged, so nothing was written to {directory}; export a model from before the "
            "divergence (retrain with a lower learning rate)"
        )
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.partial-"))
    try:
        target = model if state_dict is None else _with_state(model, state_dict)
        if not kind.save_model(target, tokenizer, tmp):  # the modality's own files, or:
            from safetensors.torch import save_model

            save_model(target, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        meta["files"] = _file_hashes(tmp)  # every file but modelzoo.json, verified on load
        text = json.dumps(meta, indent=2) + "\n"
        (tmp / ARTIFACT_FILE).write_text(text, encoding="utf-8")
        if directory.exists():
            old = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.old-"))
            os.replace(directory, old / "x")
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
        fsync_directory(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _nonfinite_weight(state: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor of ``state`` with a NaN or inf value."""
    named = [(n, t.detach()) for n, t in state.items() if torch.is_floating_point(t)]
    if not named:
        return None
    with torch.no_grad():
        finite = [bool(ok) for ok in torch.stack([torch.isfinite(t).all().cpu() for _, t in named])]
    return next((n for (n, _), ok in zip(named, finite, strict=True) if not ok), None)


def _file_hashes(directory: Path) -> dict[str, str]:
    """``{relative posix path: sha256}`` of every file under ``directory`` but the metadata."""
    from .store import file_hash

    return {
        path.relative_to(directory).as_posix(): file_hash(path)
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.relative_to(directory).as_posix() != ARTIFACT_FILE
    }


def _verify_files(directory: Path, files: Any, meta_path: Path) -> None:
    """Check each file against the sha256 ``modelzoo.json`` records for it."""
    from .store import file_hash

    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        raise ArtifactError(f"{meta_path}: field 'files' must map file names to sha256 digests")
    again = (
        "export the model again (the training script's --export-dir, or save_artifact) or "
        "download the artifact folder again"
    )
    for name, expected in sorted(files.items()):
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts:
            raise ArtifactError(f"{meta_path}: field 'files' names {name!r}, outside the folder")
        path = directory / relative
        if not path.is_file():
            raise ArtifactError(f"{path}: missing, but {ARTIFACT_FILE} lists it; {again}")
        actual = file_hash(path)
        if actual != expected.lower():
            raise ArtifactError(
                f"{path}: its sha256 {actual[:12]}... is not the {expected[:12]}... that "
                f"{ARTIFACT_FILE} records: the file changed or was corrupted after the export; "
                f"{again}"
            )


def _with_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module:
    import copy

    clone = copy.deepcopy(model)
    clone.load_state_dict(dict(state), strict=True)
    return clone


def load_artifact(path: str | os.PathLike[str], *, verify: bool = True) -> Artifact:
    """Reads ``path/modelzoo.json`` (checked field by field) and verifies the folder's files.

    Args:
        path: the artifact folder.
        verify: check every file against the sha256 recorded in ``files`` (default). A folder
            written before the hashes were recorded has no ``files`` and loads unchecked.

    Raises:
        ArtifactError: not an artifact folder, unreadable JSON, a newer format, a field
            missing or of the wrong type (the message names it), or a file that is missing
            or whose sha256 differs from the recorded one (the message names the file).
    """
    directory = Path(path).expanduser()
    meta_path = directory / ARTIFACT_FILE
    if not meta_path.is_file():
        raise ArtifactError(
            f"{directory}: no {ARTIFACT_FILE}; an artifact folder is written by a training "
            "script's --export-dir or modelzoo.artifact.save_artifact"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{meta_path}: not readable JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ArtifactError(f"{meta_path}: expected a JSON object")

    def need(key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in meta:
            raise ArtifactError(f"{meta_path}: field {key!r} is missing")
        if not isinstance(meta[key], kind):
            raise ArtifactError(f"{meta_path}: field {key!r} has the wrong type ({meta[key]!r})")
        return meta[key]

    fmt = need("format", int)
    if fmt > ARTIFACT_FORMAT:
        raise ArtifactError(
            f"{meta_path}: format {fmt} is newer than this modelzoo reads ({ARTIFACT_FORMAT}); "
            "upgrade modelzoo"
        )
    task = need("task", str)
    if task not in TASKS:
        raise ArtifactError(f"{meta_path}: field 'task' is {task!r}, not one of {sorted(TASKS)}")
    labels = meta.get("labels")
    if labels is not None and (
        not isinstance(labels, list) or not all(isinstance(x, str) for x in labels)
    ):
        raise ArtifactError(f"{meta_path}: field 'labels' must be a list of strings or null")
    artifact = Artifact(
        directory=directory,
        model_name=need("model", str),
        model_kwargs=need("model_kwargs", dict),
        task=task,
        labels=tuple(labels) if labels is not None else None,
        preprocessing=meta.get("preprocessing") or {},
        metrics=meta.get("metrics") or {},
        source=meta.get("source") or {},
    )
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise ArtifactError(f"{directory}: {WEIGHTS_FILE} is missing")
    kind = get_modality(artifact.modality)
    if kind.needs_tokenizer and not (directory / "vocab.txt").is_file():
        raise ArtifactError(f"{directory}: vocab.txt is missing (a text artifact's tokenizer)")
    missing = sorted(set(kind.required_options) - set(artifact.preprocessing))
    if missing:
        raise ArtifactError(f"{meta_path}: field 'preprocessing' lacks {missing}")
    if verify and meta.get("files") is not None:
        _verify_files(directory, meta["files"], meta_path)
    return artifact
