"""The set-up of SQuAD fine-tuning, for ``scripts/finetune_squad.py`` and any other caller.

Which data (:func:`load_squad_sets`: the built-in standard-library set, SQuAD's official files
fetched by name through the store, or your own files), which model (:func:`build_qa_model`:
zoo weights, a pretrained checkpoint, or a fine-tuned one), which vocabulary
(:func:`build_qa_tokenizer`), the windows the model reads (:func:`squad_windows`) and the
exported artifact (:func:`save_qa_artifact`). Options are
explicit arguments, not a script's namespace; nothing here imports ``trainers`` (a trainer
checkpoint is read by the ``load_state`` the caller passes).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .. import registry
from ..artifact import save_artifact
from ..convert.bert import load_bert_checkpoint
from ..store import ChecksumError, DownloadError
from .bert import bert_from_checkpoint
from .squad import SquadFeature, SquadSet, make_features, read_squad, squad_file
from .squad_task import EvalExamples
from .stdlib_squad import stdlib_squad
from .tokenizer import BertTokenizer, get_tokenizer

__all__ = [
    "NAMED_VERSIONS",
    "PREDICTION_OPTIONS",
    "MissingVocabularyError",
    "SquadFetchError",
    "build_qa_model",
    "build_qa_tokenizer",
    "load_squad_sets",
    "save_qa_artifact",
    "squad_windows",
]

#: SQuAD's official data sets by name, and their versions.
NAMED_VERSIONS = {"squad1.1": "1.1", "squad2.0": "2.0"}
#: The windowing and post-processing options an exported QA model was evaluated with.
PREDICTION_OPTIONS = ("max_seq_length", "doc_stride", "max_query_length", "max_answer_length",
                      "n_best_size", "version_2", "null_score_diff_threshold")  # fmt: skip

PathLike = str | os.PathLike[str]


class SquadFetchError(RuntimeError):
    """An official SQuAD file could not be fetched (no network, offline, or wrong bytes).

    Attributes:
        split: ``"train"`` or ``"dev"``.
        cause: the store's error, whose message names the file, its URL and where to put it.
    """

    def __init__(self, split: str, cause: Exception) -> None:
        super().__init__(f"{split}: {cause}")
        self.split = split
        self.cause = cause


class MissingVocabularyError(FileNotFoundError):
    """A checkpoint has no ``vocab.txt`` beside it and no vocabulary was given."""


def load_squad_sets(
    dataset: str,
    *,
    train_file: PathLike | None = None,
    predict_file: PathLike | None = None,
    version_2: bool = False,
    only_predict: bool = False,
    skip_bad: bool = False,
    data_dir: PathLike | None = None,
    progress: bool = True,
    chosen_by: str = "",
    say: Callable[[str], Any] | None = None,
) -> tuple[SquadSet | None, SquadSet | None]:
    """The training and evaluation sets, saying in one line (``say``) which data.

    Args:
        dataset: ``stdlib`` (the built-in set), a name of :data:`NAMED_VERSIONS` (the official
            files, fetched and verified into ``data_dir`` when missing), or ``files``.
        train_file, predict_file: your own SQuAD-format files; they replace the named ones.
        version_2: read SQuAD 2.0 (unanswerable questions).
        only_predict: no training set (``None`` in its place).
        skip_bad: skip malformed questions (counted) instead of raising.
        data_dir: the folder of the named files (default: the store's).
        progress: show download progress.
        chosen_by: what chose the data, for the line ``say`` gets.

    Raises:
        SquadFetchError: A named file cannot be fetched.
        SquadFormatError: A file is not SQuAD-format (and ``skip_bad`` is off).
    """
    say = say or (lambda line: None)
    version = "2.0" if version_2 else "1.1"
    if dataset == "stdlib":
        say(
            "data: the built-in SQuAD 1.1-format set of Python standard-library docstrings "
            "(modelzoo.nlp.stdlib_squad, nothing downloaded); --dataset squad1.1 or squad2.0 "
            "fetches SQuAD"
        )
        train = None if only_predict else read_squad(stdlib_squad("train"), training=True)
        return train, read_squad(stdlib_squad("dev"))
    own = {"train": train_file, "dev": predict_file}
    paths: dict[str, tuple[str, bool]] = {}  # split -> (path, official)
    for split in ("dev",) if only_predict else ("train", "dev"):
        if own[split]:
            paths[split] = (str(own[split]), False)
        elif dataset in NAMED_VERSIONS:
            try:
                path = squad_file(NAMED_VERSIONS[dataset], split, root=data_dir, progress=progress)
            except (DownloadError, ChecksumError, FileNotFoundError) as exc:
                raise SquadFetchError(split, exc) from None
            paths[split] = (str(path), True)
    named = dataset in NAMED_VERSIONS
    what = f"SQuAD v{version} by name" if named else f"SQuAD {version}-format files"
    listed = ", ".join(
        f"{split} {path}" + (" (official, sha256-verified)" if official else " (yours)")
        for split, (path, official) in paths.items()
    )
    say(f"data: {what} ({chosen_by}): {listed}")
    read = {
        split: read_squad(path, version=version, skip_bad=skip_bad, training=split == "train")
        for split, (path, _) in paths.items()
    }
    return read.get("train"), read.get("dev")


def squad_windows(
    train_set: SquadSet | None,
    dev_set: SquadSet | None,
    tokenizer: BertTokenizer,
    *,
    max_seq_length: int,
    doc_stride: int,
    max_query_length: int,
    say: Callable[[str], Any] | None = None,
) -> tuple[list[SquadFeature] | None, EvalExamples | None]:
    """The training windows and the evaluation set (whole questions with their windows) of
    the sets given (``None`` for a set not given), saying how many windows each has."""
    say = say or (lambda line: None)
    window = dict(
        max_seq_length=max_seq_length, doc_stride=doc_stride, max_query_length=max_query_length
    )
    train_features = None
    if train_set is not None:
        train_features = make_features(train_set.examples, tokenizer, training=True, **window)
        say(f"[train] {len(train_features)} windows of {len(train_set)} questions")
    eval_set = None
    if dev_set is not None:
        dev_features = make_features(dev_set.examples, tokenizer, **window)
        eval_set = EvalExamples(dev_set.examples, dev_features)
        say(f"[dev] {len(dev_features)} windows of {len(dev_set)} questions")
    return train_features, eval_set


def build_qa_model(
    model_name: str,
    *,
    pretrained_parameters: PathLike | None = None,
    fine_tuned_parameters: PathLike | None = None,
    weights: str | None = None,
    progress: bool = True,
    load_state: Callable[[Path], Mapping[str, Any]] | None = None,
    say: Callable[[str], Any] | None = None,
) -> torch.nn.Module:
    """A BERT with a span (question-answering) head, in this order of sources:

    ``pretrained_parameters`` with a ``config.json`` beside it builds that checkpoint's size;
    otherwise zoo model ``model_name`` is built, with the weights of ``pretrained_parameters``
    (a Hugging Face directory or file, or a GluonNLP ``.params`` file), or its published
    weights ``weights`` (default: its first tag) when neither parameters file is given. Then
    ``fine_tuned_parameters`` are loaded: a Hugging Face directory or ``.safetensors`` file, or
    any other checkpoint through ``load_state`` (default ``torch.load(weights_only=True)``;
    its ``"model"`` entry when it has one).
    """
    say = say or (lambda line: None)
    entry = registry.get_model_entry(model_name)
    source = Path(pretrained_parameters or "")
    folder = source if source.is_dir() else source.parent
    if pretrained_parameters and (folder / "config.json").is_file():
        # A checkpoint with its config (e.g. scripts/pretrain_bert.py's): build its size.
        model = bert_from_checkpoint(source, head="qa")
        say(f"loaded {source} ({model.config.num_layers} layers, from its config.json)")
    elif pretrained_parameters or fine_tuned_parameters:
        model = entry.builder(head="qa")
        if pretrained_parameters:
            load_bert_checkpoint(model, pretrained_parameters)
            say(f"loaded {pretrained_parameters}")
    else:
        model = registry.get_model(model_name, pretrained=weights or True, head="qa",
                                   progress=progress)  # fmt: skip
    if fine_tuned_parameters:
        path = Path(fine_tuned_parameters)
        if path.is_dir() or path.suffix == ".safetensors":
            load_bert_checkpoint(model, path)  # a Hugging Face directory, or ours
        else:
            load = load_state or (lambda p: torch.load(p, map_location="cpu", weights_only=True))
            state = load(path)  # e.g. a trainer checkpoint
            model.load_state_dict(state.get("model", state), strict=True)
        say(f"loaded fine-tuned parameters {path}")
    return model


def build_qa_tokenizer(
    model_name: str,
    *,
    vocab_file: PathLike | None = None,
    fine_tuned_parameters: PathLike | None = None,
    pretrained_parameters: PathLike | None = None,
    weights: str | None = None,
    progress: bool = True,
) -> BertTokenizer:
    """``vocab_file``; else the vocabulary saved beside ``fine_tuned_parameters`` or
    ``pretrained_parameters``; else the one published with zoo model ``model_name``'s weights.

    Raises:
        MissingVocabularyError: ``pretrained_parameters`` (not a GluonNLP ``.params`` file,
            whose vocabulary is the published one) has no ``vocab.txt`` beside it.
    """
    if vocab_file:
        return BertTokenizer.from_file(vocab_file)
    for source in (fine_tuned_parameters, pretrained_parameters):
        if not source:
            continue
        folder = Path(source) if Path(source).is_dir() else Path(source).parent
        if (folder / "vocab.txt").is_file():
            return BertTokenizer.from_dir(folder)
    source = pretrained_parameters
    if source and Path(source).suffix != ".params":
        raise MissingVocabularyError(f"{source}: no vocab.txt beside it")
    return get_tokenizer(model_name, weights or True, progress=progress)


def save_qa_artifact(
    directory: PathLike,
    model: torch.nn.Module,
    tokenizer: BertTokenizer,
    *,
    model_name: str,
    options: Mapping[str, Any],
    metrics: Mapping[str, Any],
    source: Mapping[str, Any],
    state_dict: Mapping[str, Any] | None = None,
) -> Path:
    """The artifact folder of a fine-tuned QA model: the model (or ``state_dict``'s weights,
    e.g. an EMA's), its vocabulary, and the :data:`PREDICTION_OPTIONS` of ``options`` it was
    evaluated with; ``modelzoo.pipeline('question-answering', directory)`` loads it."""
    return save_artifact(
        directory, model, model_name=model_name, model_kwargs={"head": "qa"},
        task="question-answering", preprocessing={key: options[key] for key in PREDICTION_OPTIONS},
        tokenizer=tokenizer, metrics=dict(metrics), source=dict(source), state_dict=state_dict,
    )  # fmt: skip
